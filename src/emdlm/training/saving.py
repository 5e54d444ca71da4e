"""Saving checkpoints so that a kill or a full disk cannot leave a complete-looking folder.

* Atomic saves (:func:`atomic_checkpoint_trainer`): the Trainer writes ``checkpoint-<step>``
  inside ``tmp-checkpoint-<step>/`` and it is renamed into place once every file is written;
  :func:`remove_stale_saves` deletes what a killed save left.
* A full disk during a save (:func:`disk_full_error`): one line saying so, naming the folder and
  the newest intact checkpoint; the unfinished ``tmp-checkpoint-<step>`` is removed and the
  previous checkpoint is untouched.
"""


from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emdlm.training.checkpoints import (
    TMP_PREFIX,
    checkpoint_folders,
    checkpoint_problem,
    tied_missing_keys,
)

# --- a full disk -------------------------------------------------------------------------------

#: Below this many free bytes a failed write is taken for a full disk: torch.save reports
#: ENOSPC as "basic_ios::clear: iostream error" / "unexpected pos N vs M" (no errno).
LOW_SPACE_BYTES = 1 << 20
_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
# safetensors 0.8 on a full tmpfs: SafetensorError("Error while serializing: I/O error: No space
# left on device (os error 28)")
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "(os error 28)")


class DiskFullError(OSError):
    """The disk filled up while emdlm saved (a checkpoint, the final model): a one-line message
    naming what was being saved and where, and which checkpoint is intact. ``emdlm train``
    exits with code 3 on it."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.args[1])


def _error_chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _free_bytes(folder: Path) -> int | None:
    """Free bytes on the disk of ``folder`` (or of its nearest existing parent)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


# how torch.save / safetensors / Python word a write that failed (torch names no errno)
_WRITE_FAILURE = re.compile(r"write|iostream|unexpected pos|I/O|serializ", re.IGNORECASE)


def _looks_like_a_failed_write(err: BaseException) -> bool:
    return (isinstance(err, (OSError, RuntimeError)) or type(err).__name__ == "SafetensorError") \
        and _WRITE_FAILURE.search(str(err)) is not None


def _disk_full_reason(err: BaseException, folder: Path) -> str | None:
    """Why ``err`` (raised while writing into ``folder``) is a full disk, or None when it is
    not one: ENOSPC / EDQUOT, a writer's message saying so, or an error worded as a failed
    write (OSError, RuntimeError, SafetensorError) with less than :data:`LOW_SPACE_BYTES` left
    on the disk."""
    chain = _error_chain(err)
    for item in chain:
        if isinstance(item, OSError) and item.errno in _FULL_ERRNOS:
            where = f": {item.filename}" if item.filename else ""
            return f"{os.strerror(item.errno)}{where}"
        if any(text in str(item) for text in _FULL_TEXTS):
            return "No space left on device"
    if any(_looks_like_a_failed_write(e) for e in chain):
        free = _free_bytes(folder)
        if free is not None and free < LOW_SPACE_BYTES:
            return f"a write failed with {free} bytes left on the disk"
    return None


def _intact_checkpoint(folder: Path, trained_step: int | None) -> str:
    """The end of a full-disk message: the newest complete checkpoint, which is intact (saves
    go through ``tmp-checkpoint-<step>``), and how to go on: ``--resume``, or, when it holds
    the finished model (step ``trained_step``: the Trainer saves one at the last step), use it
    as it is."""
    for ckpt in checkpoint_folders(folder):
        if checkpoint_problem(ckpt) is None:
            if trained_step is not None and ckpt.name == f"checkpoint-{trained_step}":
                return (f"the checkpoint {ckpt} is intact and holds the trained model (step "
                        f"{trained_step}): free some space and use it, e.g. `emdlm eval {ckpt}`")
            return (f"the previous checkpoint {ckpt} is intact: free some space, then continue "
                    "with `emdlm train ... --resume`")
    return ("there is no earlier checkpoint to resume from: free some space, then start again "
            "with `emdlm train ... --overwrite`")


def disk_full_error(
    err: BaseException, folder: Path, saving: str, *, trained_step: int | None = None,
    advice: str | None = None,
) -> DiskFullError | None:
    """A one-line :class:`DiskFullError` for ``err`` when it is a full disk (see
    :func:`_disk_full_reason`), else None. ``folder``: the run folder; ``saving``: what was
    being saved and where, e.g. "checkpoint-20 into <run>/tmp-checkpoint-20"; ``trained_step``:
    the last step of a finished training (the final model's save failed); ``advice``: what the
    message ends with instead of the run's intact checkpoint (a save that is no checkpoint,
    e.g. an evaluation's files)."""
    if isinstance(err, DiskFullError):
        return err
    reason = _disk_full_reason(err, folder)
    if reason is None:
        return None
    tail = advice if advice is not None else _intact_checkpoint(folder, trained_step)
    return DiskFullError(f"disk full ({reason}) while saving {saving}; {tail}")


@contextlib.contextmanager
def full_disk_in_one_line(
    folder: Path, saving: str, *, trained_step: int | None = None, advice: str | None = None
) -> Iterator[None]:
    """Raise :func:`disk_full_error`'s one-line :class:`DiskFullError` (from the original) when
    the ``with`` block fails on a full disk; any other error propagates unchanged."""
    try:
        yield
    except Exception as err:
        full = disk_full_error(err, folder, saving, trained_step=trained_step, advice=advice)
        if full is None or full is err:
            raise
        raise full from err


def remove_stale_saves(out: Path) -> list[str]:
    """Delete ``tmp-checkpoint-*`` folders left by a save that was killed; returns their names."""
    stale = sorted(p for p in out.glob(f"{TMP_PREFIX}checkpoint-*") if p.is_dir())
    for p in stale:
        shutil.rmtree(p)
    return [p.name for p in stale]


def _publish(staged: Path, final: Path) -> None:
    """Move a fully written checkpoint into place (renames: atomic on one filesystem)."""
    if final.exists():  # the same step saved again (a Ctrl-C save, a damaged older save)
        os.replace(final, staged.parent / "replaced")
    os.replace(staged, final)
    shutil.rmtree(staged.parent)


def atomic_checkpoint_trainer(base: type) -> type:
    """A subclass of Trainer class ``base`` whose checkpoints appear only once complete.

    transformers 5.23 writes ``checkpoint-<step>`` in place (model first, trainer_state.json
    last), so a kill during the save leaves a folder that has the right name. Here the Trainer
    saves into ``tmp-checkpoint-<step>/checkpoint-<step>`` (its own save code, unchanged: the
    run folder it sees is redirected while it saves), every process waits for the others (each
    writes its RNG state), and rank 0 renames the folder into place and rotates old checkpoints.
    A full disk during the save raises :class:`DiskFullError` (one line) after removing the
    unfinished ``tmp-checkpoint-<step>``; the checkpoints already published are untouched.
    On resume, a tied head is not reported as a missing key (:func:`tied_missing_keys`).
    """
    from transformers.trainer_utils import rotate_checkpoints

    class AtomicCheckpointTrainer(base):  # type: ignore[misc, valid-type]
        _staging_dir: str | None = None

        def _get_output_dir(self, trial: Any) -> str:
            if self._staging_dir is not None:
                return self._staging_dir
            return super()._get_output_dir(trial)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            run_dir = Path(super()._get_output_dir(trial))
            name = f"checkpoint-{self.state.global_step}"
            staging = run_dir / f"{TMP_PREFIX}{name}"
            if self.args.should_save and staging.exists():
                shutil.rmtree(staging)  # a killed earlier attempt at this step
            self.accelerator.wait_for_everyone()
            self._staging_dir = str(staging)
            try:
                super()._save_checkpoint(model, trial)
            except Exception as err:
                full = disk_full_error(err, run_dir, f"{name} into {staging}")
                if full is None:
                    raise
                if self.args.should_save:  # the unfinished save only takes space
                    shutil.rmtree(staging, ignore_errors=True)
                raise full from err
            finally:
                self._staging_dir = None
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                _publish(staging / name, run_dir / name)
                rotate_checkpoints(
                    output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                    best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True,
                )
            self.accelerator.wait_for_everyone()

        def _issue_warnings_after_load(self, load_result: Any) -> None:
            # transformers 5.23 warns "missing keys ['lm_head.weight']" on every resume of a
            # model whose head is tied to its input embedding (saved once, under the
            # embedding's name): keys that share their tensor with a loaded key are not missing.
            tied = tied_missing_keys(self.model, load_result.missing_keys)
            if tied and hasattr(load_result, "_replace"):
                kept = [key for key in load_result.missing_keys if key not in tied]
                load_result = load_result._replace(missing_keys=kept)
            super()._issue_warnings_after_load(load_result)

    AtomicCheckpointTrainer.__name__ = f"Atomic{base.__name__}"
    return AtomicCheckpointTrainer


