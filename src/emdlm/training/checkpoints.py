"""Checkpoints of a run folder: which are complete, and which one a resume starts from.

A checkpoint is complete when its trainer state, model weights, optimizer and scheduler state
are present and readable (safetensors headers and extents, torch zip archives, JSON) and no
pickle among them would run code (torch's ``weights_only`` unpickler refuses none), checked
without loading the tensors (:func:`checkpoint_problem`). ``tmp-checkpoint-<step>`` folders are
saves in progress (or killed, :mod:`emdlm.training.saving`) and are never resumed from.
"""


from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
TMP_PREFIX = "tmp-"  # tmp-checkpoint-<step>: a save in progress (or killed), never resumed from


def _warn(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)



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


def _unpickle_problem(path: Path, *, numpy_allowed: bool = False) -> str | None:
    """For pickled files (``pytorch_model.bin``, ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``): the one-line refusal naming ``path`` when torch's ``weights_only``
    unpickler (the one transformers loads them with) refuses it, a pickle that would run code;
    it is never unpickled otherwise. Tensors are memory-mapped, not read. ``numpy_allowed``:
    also admit the numpy array and dtype classes that transformers' Trainer allows when it
    loads ``rng_state.pth`` (``transformers.trainer_pt_utils.safe_globals``)."""
    if path.suffix not in (".bin", ".pt", ".pth"):
        return None
    import pickle

    import torch

    from emdlm.weights import weights_only_refusal

    allowed = contextlib.nullcontext()
    if numpy_allowed:
        from transformers.trainer_pt_utils import safe_globals

        allowed = safe_globals()
    try:
        with allowed:
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


def check_holds_model(folder: Path) -> None:
    """ConfigError when ``folder`` is not a model folder (no config.json), naming a complete
    checkpoint inside it to evaluate instead, when there is one (a run stopped before its
    final save)."""
    if not folder.is_dir():
        raise ConfigError(f"model folder not found: {folder}")
    if not (folder / "config.json").exists():
        complete = [c for c in checkpoint_folders(folder) if checkpoint_problem(c) is None]
        hint = f"; evaluate a checkpoint instead: emdlm eval {complete[0]}" if complete else ""
        raise ConfigError(f"{folder} holds no model (config.json missing){hint}")


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
            problem = _file_problem(path) or _unpickle_problem(path)
            if problem:
                return problem
    for rng in sorted(ckpt.glob("rng_state*.pth")):
        problem = _file_problem(rng) or _unpickle_problem(rng, numpy_allowed=True)
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
