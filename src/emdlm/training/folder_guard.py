"""One run's output folder as one component of the ``emdlm train`` recipe: its safety checks,
its lock, resuming, and the whole-run loss after a resume.

:meth:`FolderGuard.check` runs in :func:`emdlm.training.train.prepare_run`, before anything is
built (reads only): another run in the folder is refused at once, a folder that is not empty
needs ``--resume`` or ``--overwrite``, ``--overwrite`` never deletes the current folder, its
parents or a folder holding the run's inputs, and ``--resume`` finds a complete checkpoint.
:meth:`FolderGuard.held` holds the folder's lock (rank 0) while training and makes the same
check again under it; :meth:`FolderGuard.prepare` is the first write; :meth:`FolderGuard.finish`
writes ``train_summary.json``, its ``train_loss`` over the whole run after a resume.

A resume continues the run it finds: :func:`check_resume_settings` (in ``prepare_run``, before
anything is written) refuses one whose config changes what was trained, naming the keys that
differ from the folder's ``run_config.yaml``. A resume may change only what does not define the
training (:data:`RESUME_MAY_CHANGE`): how long it runs (``train.max_steps`` / ``train.epochs``:
transformers then rebuilds the LR schedule for the new length and continues it from the
checkpoint's step), what it logs and saves, the data loader's workers and threads, gradient
checkpointing, and evaluation (``eval.*``, ``data.eval``). The model, tokenizer, training data,
objective, teacher, optimizer and batch, seed, precision and LoRA must stay as they were.
The folder's files themselves (manifest, checkpoints, locks) are :mod:`emdlm.training.run_folder`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from emdlm._files import atomic_write, read_appended_jsonl
from emdlm.config import ConfigError, RunConfig, read_yaml_file
from emdlm.integrations.sharding import world_size_from_env
from emdlm.training.checkpoints import checkpoint_folders, resume_checkpoint
from emdlm.training.run_folder import (
    check_overwrite_target,
    check_run_folder_free,
    clear_run_folder,
    has_entries,
    hold_run_folder,
    record_outputs,
)
from emdlm.training.saving import full_disk_in_one_line, remove_stale_saves

RUN_CONFIG = "run_config.yaml"  # also read by emdlm.training.evaluate
TRAIN_LOG = "train_log.jsonl"
SUMMARY = "train_summary.json"
BUSY_HINT = "wait for it to finish, or choose another output_dir"


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-<step> folder with the highest step, or None (``tmp-checkpoint-*``
    folders, saves in progress or killed, are ignored)."""
    found = checkpoint_folders(folder)
    return found[0] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    tail = checkpoint.name.split("-")[-1]
    return int(tail) if tail.isdigit() else 0


def logged_losses(log: Path, last_step: int) -> list[float] | None:
    """The per-step "loss" of steps 1..last_step from train_log.jsonl, or None when the log does
    not hold exactly those steps."""
    if not log.is_file():
        return None
    losses: dict[int, float] = {}
    for record in read_appended_jsonl(log):
        if "loss" in record and 1 <= int(record.get("step", 0)) <= last_step:
            losses[int(record["step"])] = float(record["loss"])
    if sorted(losses) != list(range(1, last_step + 1)):
        return None
    return [losses[s] for s in range(1, last_step + 1)]


def logged_mean_loss(log: Path, last_step: int) -> float | None:
    """Mean step loss of steps 1..``last_step`` from the logged window means of train_log.jsonl:
    Σ_w loss_w · (step_w − step_{w−1}) / last_step. None unless the windows end at ``last_step``.

    Used for multi-process runs: there transformers' ``training_loss`` adds one process's
    unlogged remainder to the all-gathered window means and is off (1.3865 against the
    one-process 1.3716 in tests/test_multiprocess.py), while the logged means are exact."""
    if not log.is_file() or last_step < 1:
        return None
    windows: dict[int, float] = {}
    for record in read_appended_jsonl(log):
        if "loss" in record and 1 <= int(record.get("step", 0)) <= last_step:
            windows[int(record["step"])] = float(record["loss"])
    if not windows or max(windows) != last_step:
        return None
    total, previous = 0.0, 0
    for step in sorted(windows):
        total += windows[step] * (step - previous)
        previous = step
    return total / last_step


def whole_run_loss(log: Path, resumed_at: int, result: Any) -> float | None:
    """Mean step loss over the whole run after a resume.

    transformers' ``training_loss`` averages only the steps this call ran (``resumed_at``+1 ..
    N); the steps before come from train_log.jsonl (kept up to ``resumed_at`` on resume), so
    the value equals an uninterrupted run's: (sum_{s<=S} loss_s + mean_this_call * (N - S)) / N.
    None when the log misses steps."""
    total_steps = int(result.global_step)
    before = logged_losses(log, resumed_at)
    if before is None or total_steps <= 0:
        return None
    return (sum(before) + result.training_loss * (total_steps - resumed_at)) / total_steps


def truncate_log(log: Path, step: int) -> None:
    """Drop log records after the checkpoint being resumed (they will be logged again)."""
    if not log.is_file():
        return
    kept = [r for r in read_appended_jsonl(log) if r.get("step", 0) <= step]
    with atomic_write(log) as fh:  # killed mid-write, the old log stays whole
        fh.write("".join(json.dumps(r) + "\n" for r in kept))


#: What a resume may change (a dotted key covers everything under it); every other setting
#: defines what is trained and must equal the run folder's run_config.yaml.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "output_dir", "train.max_steps", "train.epochs", "train.logging_steps", "train.save_steps",
    "train.save_total_limit", "train.eval_steps", "train.progress_bar", "train.tensorboard",
    "train.report_to", "train.num_workers", "train.torch_threads", "train.gradient_checkpointing",
    "data.eval", "eval",
)


def _flat(mapping: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": leaf}`` (a list is a leaf; an empty mapping has no
    key, as an absent one)."""
    if not isinstance(mapping, dict):
        return {prefix[:-1]: mapping} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_resume_settings(out: Path, cfg: RunConfig) -> None:
    """ConfigError naming every setting of ``cfg`` outside :data:`RESUME_MAY_CHANGE` that
    differs from what the run in ``out`` was trained with (its ``run_config.yaml``), before
    anything is written. A key the saved file lacks (written by an older emdlm) counts as its
    default. Nothing to compare (no run_config.yaml): no check."""
    saved_path = out / RUN_CONFIG
    if not saved_path.is_file():
        return
    saved = read_yaml_file(saved_path)
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_path}: not a run config (a mapping); cannot check what "
                          "--resume would change")
    defaults, before, after = _flat(RunConfig().to_dict()), _flat(saved), _flat(cfg.to_dict())
    missing = object()
    changed = []
    for key in sorted(set(before) | set(after), key=lambda k: (k.count("."), k)):
        if _may_change(key):
            continue
        old, new = before.get(key, defaults.get(key, missing)), after.get(key, missing)
        if old != new:
            shown = [("(absent)" if v is missing else _short_repr(v)) for v in (old, new)]
            changed.append(f"{key} ({shown[0]} -> {shown[1]})")
    if changed:
        raise ConfigError(
            f"resuming {out} would change what it was trained with: {', '.join(changed)}; a "
            f"resume may change only {', '.join(RESUME_MAY_CHANGE)}: train with other settings "
            "in a new run (another output_dir, or --overwrite)"
        )


def run_inputs(cfg: RunConfig, config_path: str | Path | None) -> list[str | None]:
    """Files and folders the run reads: --overwrite must never delete a folder holding them."""
    sources = [s for s in (cfg.data.train, cfg.data.eval) if s is not None]
    return [
        *(s.path for s in sources), None if config_path is None else str(config_path),
        cfg.model.name, cfg.tokenizer, cfg.objective.cost_embedding, cfg.teacher,
    ]


def check_output_dir(
    out: Path, resume: bool | str, overwrite: bool, inputs: Sequence[str | None], *,
    warn: bool = True,
) -> Path | None:
    """The checkpoint to resume from (checked complete), or None for a new run; ConfigError for
    an output folder this run may not use. Reads only. A folder holding only the lock file
    counts as empty. ``warn=False``: the same check made again (under the lock), no warnings."""
    if resume and overwrite:
        raise ConfigError("give --resume or --overwrite, not both")
    if resume:
        if isinstance(resume, str) and resume not in ("true", "latest"):
            ckpt = Path(resume)
            if not ckpt.is_dir():
                raise ConfigError(f"checkpoint to resume from not found: {ckpt}")
            return resume_checkpoint(out, ckpt, warn=warn)
        return resume_checkpoint(out, None, warn=warn)
    if not is_main_process():
        # only rank 0 writes; another rank could otherwise see rank 0's fresh folder and stop
        return None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output path {out} exists and is not a folder")
    if out.is_dir() and has_entries(out):
        if not overwrite:
            raise ConfigError(
                f"output folder {out} is not empty: use --resume to continue it, --overwrite to "
                f"replace it, or another output_dir"
            )
        check_overwrite_target(out, inputs)
    elif overwrite:
        check_overwrite_target(out, [], require_run_folder=False)  # never cwd or its parents
    return None


@dataclass
class FolderGuard:
    """The output folder of one run: where it is, how it may be used (``resume`` as asked,
    ``overwrite``), the run's inputs (kept out of ``--overwrite``) and the checkpoint to resume
    from (None: a new run)."""

    out: Path
    resume: bool | str = False
    overwrite: bool = False
    inputs: tuple[str | None, ...] = ()
    resume_from: Path | None = None

    @classmethod
    def check(
        cls, out: Path, resume: bool | str, overwrite: bool, inputs: Sequence[str | None]
    ) -> FolderGuard:
        """Before anything is built: another run in the folder is refused now, not after
        loading (rank 0); then :func:`check_output_dir`. Reads only."""
        if is_main_process():
            check_run_folder_free(out, hint=BUSY_HINT)
        inputs = tuple(inputs)
        return cls(out, resume, overwrite, inputs, check_output_dir(out, resume, overwrite, inputs))

    def holder_label(self) -> str:
        """What the lock file says this process is doing (shown to a process it refuses)."""
        if self.resume_from is not None:
            return "emdlm train --resume"
        return "emdlm train --overwrite" if self.overwrite else "emdlm train"

    def check_again(self) -> None:
        """:meth:`check`'s output-folder check made again under the lock: between that check
        and the lock another run may have written into the folder (both saw it empty) or saved
        a newer checkpoint. ConfigError when the outcome changed, before anything is written."""
        resume = self.resume or (str(self.resume_from) if self.resume_from is not None else False)
        now = check_output_dir(self.out, resume, self.overwrite, self.inputs, warn=False)
        if now != self.resume_from:
            raise ConfigError(
                f"{self.out} changed while this run was being prepared (the checkpoint to "
                f"resume from is now {now}, was {self.resume_from}): run the command again"
            )

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Rank 0: the folder's lock, from before the first write until the block ends (however
        it ends), with the folder checked again under it. Other ranks take no lock: they would
        block on rank 0's (and rank 0 does all the writing)."""
        if not is_main_process():
            yield
            return
        with hold_run_folder(self.out, self.holder_label(), hint=BUSY_HINT):
            self.check_again()
            yield

    def prepare(self, cfg: RunConfig) -> set[str]:
        """Rank 0, after every check passed: clear what an old run wrote (``--overwrite``; the
        user's other files stay), or tidy a resumed folder; write run_config.yaml and the
        manifest; trim train_log.jsonl to the checkpoint. Returns the entries present before
        training."""
        out = self.out
        if self.overwrite and self.resume_from is None and out.is_dir():
            removed, kept = clear_run_folder(out)
            if removed:
                print(
                    f"--overwrite: removed from {out}: {', '.join(removed)}"
                    + (f" (kept: {', '.join(kept)})" if kept else ""), file=sys.stderr, flush=True,
                )
        out.mkdir(parents=True, exist_ok=True)
        if self.resume_from is not None:
            stale = remove_stale_saves(out)
            if stale:
                print(f"removed unfinished checkpoint saves: {', '.join(stale)}", file=sys.stderr)
        record_outputs(out, [RUN_CONFIG, TRAIN_LOG] + (["tb"] if cfg.train.tensorboard else []))
        with atomic_write(out / RUN_CONFIG) as fh:
            fh.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if self.resume_from is not None:
            truncate_log(out / TRAIN_LOG, checkpoint_step(self.resume_from))
        return {p.name for p in out.iterdir()}

    def whole_run_summary(self, summary: dict[str, Any], result: Any) -> None:
        """After a resume: ``train_loss`` over the whole run (see :func:`whole_run_loss`)."""
        assert self.resume_from is not None
        out, resumed_at = self.out, checkpoint_step(self.resume_from)
        summary["resumed_from_step"] = resumed_at
        whole = whole_run_loss(out / TRAIN_LOG, resumed_at, result)
        if whole is None:
            summary["train_loss_steps"] = f"{resumed_at + 1}-{result.global_step}"
            print(
                f"warning: {out / TRAIN_LOG} misses steps before {resumed_at + 1}: train_loss in "
                "train_summary.json covers only the steps run since the resume", file=sys.stderr,
            )
        else:
            summary["train_loss"] = whole

    def finish(
        self, summary: dict[str, Any], result: Any, existing: set[str], trained_step: int
    ) -> None:
        """Rank 0, after the final model was saved: ``train_loss`` over the whole run (after a
        resume) or from the logged means (several processes); train_summary.json (whole or
        absent: the experiment runner reads it to know the cell trained) and the manifest of
        what training created."""
        out = self.out
        if self.resume_from is not None:
            self.whole_run_summary(summary, result)
        elif world_size_from_env() > 1:
            logged = logged_mean_loss(out / TRAIN_LOG, int(result.global_step))
            if logged is not None:
                summary["train_loss"] = logged
        with full_disk_in_one_line(out, f"{out / SUMMARY} (the final model was saved)",
                                   trained_step=trained_step):
            with atomic_write(out / SUMMARY) as fh:
                fh.write(json.dumps(summary, indent=2))
            created = {p.name for p in out.iterdir()} - existing
            record_outputs(out, created | {SUMMARY})
