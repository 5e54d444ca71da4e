"""The run folder: what emdlm wrote there, what ``--overwrite`` may delete, which checkpoints are
complete, and checkpoints saved so that a kill during the save cannot leave a complete-looking
folder.

* Ownership: :data:`MANIFEST` (``emdlm_outputs.json``) lists every top-level entry a run wrote;
  together with :data:`KNOWN_FILES` / :data:`KNOWN_PATTERNS` (also for folders written before
  the manifest existed) it is all that ``--overwrite`` removes. Anything else (a user's notes,
  sub-folders, data) stays.
* Refusals (:func:`check_overwrite_target`): the current folder, any parent of it, the home
  folder, and any folder that holds one of the run's own input files.
* Checkpoints (:func:`checkpoint_problem`): trainer state, model weights, optimizer and
  scheduler state must be present and readable (safetensors headers and extents, torch zip
  archives, JSON), checked without loading the tensors.
* Atomic saves (:func:`atomic_checkpoint_trainer`): the Trainer writes ``checkpoint-<step>``
  inside ``tmp-checkpoint-<step>/`` and it is renamed into place once every file is written.
* One writer (:func:`hold_run_folder`): ``emdlm train`` (new, ``--overwrite``, ``--resume``)
  holds an exclusive lock on :data:`RUN_LOCK` for the whole run, ``emdlm eval`` while it writes
  into the folder; a second process is refused at once, naming the holder's pid. The OS drops
  the lock when its holder ends, however it ends. The lock file is emdlm's (a known name) but
  ``--overwrite`` never removes it: the run that clears the folder holds it.
* A full disk during a save (:func:`disk_full_error`): one line saying so, naming the folder;
  the unfinished ``tmp-checkpoint-<step>`` is removed and the previous checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from emdlm._files import LockHeldError, check_lock_free, hold_lock_file
from emdlm.config import ConfigError

MANIFEST = "emdlm_outputs.json"
RUN_LOCK = ".emdlm.lock"  # held by the process writing the run folder (hold_run_folder)
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
TMP_PREFIX = "tmp-"  # tmp-checkpoint-<step>: a save in progress (or killed), never resumed from
# Written by emdlm train (Trainer.save_model / tokenizer.save_pretrained included) and eval.
KNOWN_FILES = frozenset({
    MANIFEST, RUN_LOCK, "run_config.yaml", "train_log.jsonl", "train_summary.json", "tb", "adapter",
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "tokenizer.model", "adapter_config.json",
    "adapter_model.safetensors",
})
KNOWN_PATTERNS = (
    "checkpoint-[0-9]*", f"{TMP_PREFIX}checkpoint-[0-9]*", "model-*-of-*.safetensors",
    "pytorch_model-*-of-*.bin",
    ".train_summary.json.*.tmp",  # an atomic write of train_summary.json cut by a kill
)
# emdlm eval's default "eval/": its outputs, and the temporary files of an interrupted
# atomic write of one of them (emdlm._files.atomic_write: ".<name>.<random>.tmp")
EVAL_FILES = frozenset({"metrics.json", "predictions.jsonl", "contact_sheet.png"})


def _warn(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


# --- ownership ---------------------------------------------------------------------------------


def read_manifest(folder: Path) -> set[str]:
    """Top-level names that emdlm recorded writing in ``folder`` (empty if no manifest)."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    entries = data.get("entries", []) if isinstance(data, dict) else []
    # only plain names: a hand-edited manifest must not reach outside the folder
    return {e for e in entries if isinstance(e, str) and e and "/" not in e and e not in ("..",)}


def record_outputs(folder: Path, names: Iterable[str]) -> None:
    """Add top-level ``names`` to ``folder``'s manifest (created if missing)."""
    entries = read_manifest(folder) | {MANIFEST} | {n for n in names if n}
    payload = {"written_by": "emdlm", "entries": sorted(entries)}
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)  # never a half-written manifest


def is_run_folder(folder: Path) -> bool:
    """A folder an emdlm run wrote (a manifest, or the run_config.yaml of older versions)."""
    return (folder / MANIFEST).is_file() or (folder / "run_config.yaml").is_file()


def _is_eval_file(name: str) -> bool:
    return name in EVAL_FILES or any(
        fnmatch.fnmatchcase(name, f".{known}.*.tmp") for known in EVAL_FILES
    )


def _is_eval_folder(path: Path) -> bool:
    return path.is_dir() and all(_is_eval_file(p.name) for p in path.iterdir())


def emdlm_entries(folder: Path) -> list[Path]:
    """The entries of ``folder`` that emdlm wrote: manifest names, known names and patterns
    (an ``eval/`` folder only when it holds nothing but emdlm eval's files)."""
    recorded = read_manifest(folder)
    found = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        known = name in KNOWN_FILES or any(fnmatch.fnmatch(name, p) for p in KNOWN_PATTERNS)
        if name in recorded or known or (name == "eval" and _is_eval_folder(entry)):
            found.append(entry)
    return found


def clear_run_folder(folder: Path) -> tuple[list[str], list[str]]:
    """Delete what emdlm wrote in ``folder`` (see :func:`emdlm_entries`) except the lock file
    (:data:`RUN_LOCK`: the clearing process holds it); returns the names removed and the names
    kept (the lock file in neither)."""
    removed = []
    for entry in emdlm_entries(folder):
        if entry.name == RUN_LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    kept = sorted(p.name for p in folder.iterdir() if p.name != RUN_LOCK)
    return removed, kept


def has_entries(folder: Path) -> bool:
    """``folder`` holds anything besides the lock file (which a run that failed its folder
    check under the lock, or was killed right after taking it, leaves in an empty folder)."""
    return any(p.name != RUN_LOCK for p in folder.iterdir())


# --- one writer per run folder -----------------------------------------------------------------


class RunFolderBusy(ConfigError):
    """Another process holds the run folder's lock (:data:`RUN_LOCK`)."""


def _busy(folder: Path, err: LockHeldError, hint: str) -> RunFolderBusy:
    return RunFolderBusy(f"{folder} is in use by another process, {err.holder}: {hint}")


def check_run_folder_free(folder: Path, *, hint: str) -> None:
    """:class:`RunFolderBusy` (naming the holder) when another process holds ``folder``'s lock;
    writes nothing. Called early, so that a second ``emdlm train`` is refused before it loads
    data and model; the lock itself is taken later by :func:`hold_run_folder`."""
    try:
        check_lock_free(folder / RUN_LOCK)
    except LockHeldError as err:
        raise _busy(folder, err, hint) from None


@contextlib.contextmanager
def hold_run_folder(folder: Path, doing: str, *, hint: str) -> Iterator[None]:
    """Hold ``folder``'s exclusive lock (:data:`RUN_LOCK`, the holder recorded as ``doing``,
    e.g. "emdlm train") for the ``with`` block; the folder is created if missing, so call this
    only once every input has been checked. :class:`RunFolderBusy` at once, naming the holder
    and ending with ``hint`` (what to do instead), when another process holds it."""
    with contextlib.ExitStack() as held:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(hold_lock_file(folder / RUN_LOCK, doing))
        except LockHeldError as err:
            raise _busy(folder, err, hint) from None
        except OSError as err:
            raise ConfigError(f"cannot write in {folder}: {err.strerror or err}") from err
        yield


def enclosing_run_folder(path: Path) -> Path | None:
    """The run folder (:func:`is_run_folder`) that is ``path`` or holds it, nearest first; None
    when there is none (e.g. an experiment cell's ``eval/step-<N>``)."""
    start = Path(path).absolute()
    for folder in (start, *start.parents):
        if is_run_folder(folder):
            return folder
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_overwrite_target(
    out: Path, inputs: Iterable[str | Path | None], *, require_run_folder: bool = True
) -> None:
    """ConfigError unless ``--overwrite`` may clear ``out``: never the current folder, a parent
    of it, the home folder, a folder that holds one of ``inputs`` (the run's data, config,
    model, tokenizer or cost-embedding files), or (``require_run_folder``) a folder emdlm did not
    write."""
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, target) or target == Path.home().resolve():
        where = "the current folder" if target == cwd else (
            "the home folder" if target == Path.home().resolve() else "a parent of the current "
            "folder"
        )
        raise ConfigError(
            f"--overwrite refuses output_dir={out}: it is {where}; choose a run folder of its "
            "own (e.g. output_dir=runs/<name>)"
        )
    for item in inputs:
        if item is None or str(item) in ("", "model"):
            continue
        path = Path(item).expanduser()
        if path.exists() and _inside(path.resolve(), target):
            raise ConfigError(
                f"--overwrite refuses output_dir={out}: it holds this run's input {item}; move "
                "the input out of the run folder or choose another output_dir"
            )
    if require_run_folder and not is_run_folder(out):
        raise ConfigError(f"--overwrite: {out} is not an emdlm run folder; refusing to delete")


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
    err: BaseException, folder: Path, saving: str, *, trained_step: int | None = None
) -> DiskFullError | None:
    """A one-line :class:`DiskFullError` for ``err`` when it is a full disk (see
    :func:`_disk_full_reason`), else None. ``folder``: the run folder; ``saving``: what was
    being saved and where, e.g. "checkpoint-20 into <run>/tmp-checkpoint-20"; ``trained_step``:
    the last step of a finished training (the final model's save failed)."""
    if isinstance(err, DiskFullError):
        return err
    reason = _disk_full_reason(err, folder)
    if reason is None:
        return None
    return DiskFullError(
        f"disk full ({reason}) while saving {saving}; {_intact_checkpoint(folder, trained_step)}"
    )


@contextlib.contextmanager
def full_disk_in_one_line(
    folder: Path, saving: str, *, trained_step: int | None = None
) -> Iterator[None]:
    """Raise :func:`disk_full_error`'s one-line :class:`DiskFullError` (from the original) when
    the ``with`` block fails on a full disk; any other error propagates unchanged."""
    try:
        yield
    except Exception as err:
        full = disk_full_error(err, folder, saving, trained_step=trained_step)
        if full is None or full is err:
            raise
        raise full from err


# --- checkpoints -------------------------------------------------------------------------------


def checkpoint_folders(folder: Path) -> list[Path]:
    """``checkpoint-<step>`` folders of ``folder``, newest (highest step) first; in-progress
    ``tmp-checkpoint-*`` folders are never listed."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        match = CHECKPOINT_RE.fullmatch(p.name)
        if match and p.is_dir():
            found.append((int(match.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        # safe_open checks the header and that the data covers every tensor's extent; the
        # slices are not read, so this costs the same for a 100 MB or a 10 GB file
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                fh.get_slice(key)
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
        return f"{path} is damaged or truncated ({err})"
    return None


def _torch_zip_problem(path: Path) -> str | None:
    """torch.save writes a zip archive; a truncated one has no central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path} is damaged or truncated ({err})"
    return None


def _file_problem(path: Path) -> str | None:
    if path.suffix == ".safetensors":
        return _safetensors_problem(path)
    if path.suffix in (".pt", ".pth", ".bin"):
        return _torch_zip_problem(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"{path} is damaged or truncated ({err})"
    return None


def _unpickle_problem(path: Path) -> str | None:
    """For pickled weights (``pytorch_model.bin``): the one-line refusal when torch's
    ``weights_only`` unpickler (the one transformers loads weights with) refuses ``path``, a
    pickle that would run code; it is never unpickled otherwise. Tensors are memory-mapped,
    not read."""
    if path.suffix not in (".bin", ".pt", ".pth"):
        return None
    import pickle

    import torch

    from emdlm.weights import weights_only_refusal

    try:
        torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        return weights_only_refusal(err, path)
    except Exception:  # another problem: the loader reports it
        return None
    return None


def weights_problem(folder: Path) -> str | None:
    """None if ``folder``'s model (or LoRA adapter) weights are present and readable, else what
    is wrong, naming the file (pickled weights that torch's ``weights_only`` refuses
    included)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            problem = _file_problem(index)
            if problem:
                return problem
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            for shard in shards:
                if not (folder / shard).is_file():
                    return f"{folder / shard} is missing (listed in {index})"
                problem = _file_problem(folder / shard) or _unpickle_problem(folder / shard)
                if problem:
                    return problem
            return None
    for name in ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return _file_problem(folder / name) or _unpickle_problem(folder / name)
    return f"{folder / 'model.safetensors'} is missing (no model weights in {folder})"


def checkpoint_problem(ckpt: Path) -> str | None:
    """None if ``ckpt`` holds everything ``Trainer.train(resume_from_checkpoint=...)`` loads, all
    readable; else the first problem, naming the file."""
    if not ckpt.is_dir():
        return f"checkpoint folder {ckpt} not found"
    state = ckpt / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing"
    problem = _file_problem(state) or weights_problem(ckpt)
    if problem:
        return problem
    if any(ckpt.glob("global_step*")):  # DeepSpeed keeps optimizer/scheduler in its own folder
        return None
    for stem in ("optimizer", "scheduler"):
        files = [ckpt / f"{stem}.pt", ckpt / f"{stem}.bin"]
        present = [p for p in files if p.is_file()]
        if not present and not any(ckpt.glob(f"{stem}_*")):  # FSDP: optimizer_0/ ...
            return f"{files[0]} is missing"
        for path in present:
            problem = _file_problem(path)
            if problem:
                return problem
    for rng in sorted(ckpt.glob("rng_state*.pth")):
        problem = _file_problem(rng)
        if problem:
            return problem
    return None


def resume_checkpoint(out: Path, explicit: Path | None, *, warn: bool = True) -> Path:
    """The checkpoint to resume from, checked before anything changes.

    ``explicit`` (``--resume-from``): a problem with it is a ConfigError naming the file.
    Otherwise the newest complete checkpoint in ``out``; a damaged newer one is skipped with a
    warning (unless ``warn`` is False: the same check made again) naming its bad file; none
    complete is a ConfigError suggesting ``--resume-from``.
    """
    if explicit is not None:
        problem = checkpoint_problem(explicit)
        if problem:
            raise ConfigError(f"cannot resume from {explicit}: {problem}")
        return explicit
    candidates = checkpoint_folders(out)
    if not candidates:
        raise ConfigError(f"--resume: no checkpoint-* folder in {out}")
    skipped = []
    for ckpt in candidates:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            for bad, why in skipped if warn else ():
                _warn(f"skipping damaged checkpoint {bad.name}: {why}; resuming from {ckpt.name}")
            return ckpt
        skipped.append((ckpt, problem))
    details = "; ".join(f"{c.name}: {why}" for c, why in skipped)
    raise ConfigError(
        f"--resume: no complete checkpoint in {out} ({details}); resume from another checkpoint "
        "with --resume-from <folder>, or start again with --overwrite"
    )


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


def tied_missing_keys(model: Any, missing_keys: Sequence[str]) -> set[str]:
    """The keys of ``missing_keys`` whose parameter is the same tensor as a key that was loaded
    (a tied LM head: ``lm_head.weight`` is ``transformer.wte.weight``), so nothing is missing."""
    missing = set(missing_keys)
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    return {
        name
        for names in names_by_tensor.values()
        if any(other not in missing for other in names)
        for name in names
        if name in missing
    }
