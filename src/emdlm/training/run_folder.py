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
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError

MANIFEST = "emdlm_outputs.json"
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
TMP_PREFIX = "tmp-"  # tmp-checkpoint-<step>: a save in progress (or killed), never resumed from
# Written by emdlm train (Trainer.save_model / tokenizer.save_pretrained included) and eval.
KNOWN_FILES = frozenset({
    MANIFEST, "run_config.yaml", "train_log.jsonl", "train_summary.json", "tb", "adapter",
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "tokenizer.model", "adapter_config.json",
    "adapter_model.safetensors",
})
KNOWN_PATTERNS = (
    "checkpoint-[0-9]*", f"{TMP_PREFIX}checkpoint-[0-9]*", "model-*-of-*.safetensors",
    "pytorch_model-*-of-*.bin",
)
EVAL_FILES = frozenset({"metrics.json", "predictions.jsonl"})  # emdlm eval's default "eval/"


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


def _is_eval_folder(path: Path) -> bool:
    return path.is_dir() and all(p.name in EVAL_FILES for p in path.iterdir())


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
    """Delete what emdlm wrote in ``folder`` (see :func:`emdlm_entries`); returns the names
    removed and the names kept."""
    removed = []
    for entry in emdlm_entries(folder):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    kept = sorted(p.name for p in folder.iterdir())
    return removed, kept


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


def weights_problem(folder: Path) -> str | None:
    """None if ``folder``'s model (or LoRA adapter) weights are present and readable, else what
    is wrong, naming the file."""
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
                problem = _file_problem(folder / shard)
                if problem:
                    return problem
            return None
    for name in ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return _file_problem(folder / name)
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


def resume_checkpoint(out: Path, explicit: Path | None) -> Path:
    """The checkpoint to resume from, checked before anything changes.

    ``explicit`` (``--resume-from``): a problem with it is a ConfigError naming the file.
    Otherwise the newest complete checkpoint in ``out``; a damaged newer one is skipped with a
    warning naming its bad file; none complete is a ConfigError suggesting ``--resume-from``.
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
            for bad, why in skipped:
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
