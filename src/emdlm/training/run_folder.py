"""The run folder: what emdlm wrote there, what ``--overwrite`` may delete, and one writer.

* Ownership: :data:`MANIFEST` (``emdlm_outputs.json``) lists every top-level entry a run wrote;
  together with :data:`KNOWN_FILES` / :data:`KNOWN_PATTERNS` (also for folders written before
  the manifest existed) it is all that ``--overwrite`` removes. Anything else (a user's notes,
  sub-folders, data) stays.
* Refusals (:func:`check_overwrite_target`): the current folder, any parent of it, the home
  folder, and any folder that holds one of the run's own input files.
* One writer (:func:`hold_run_folder`): ``emdlm train`` (new, ``--overwrite``, ``--resume``)
  holds an exclusive lock on :data:`RUN_LOCK` for the whole run, ``emdlm eval`` while it writes
  into the folder; a second process is refused at once, naming the holder's pid. The OS drops
  the lock when its holder ends, however it ends. The lock file is emdlm's (a known name) but
  ``--overwrite`` never removes it: the run that clears the folder holds it.
* No links (:func:`refuse_linked_entries`): an entry emdlm writes or removes (the lock, the
  manifest, known names and patterns, ``eval/``) that is a symbolic link is refused in one line
  naming it, before the first write and again under the lock; a user's own links stay.

Which checkpoints are complete: :mod:`emdlm.training.checkpoints`; saves that a kill or a full
disk cannot tear: :mod:`emdlm.training.saving`.
"""


from __future__ import annotations

import contextlib
import fnmatch
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from emdlm._files import (
    LockHeldError,
    atomic_write,
    check_lock_free,
    hold_lock_file,
    refuse_links,
)
from emdlm.config import ConfigError
from emdlm.training.checkpoints import TMP_PREFIX

MANIFEST = "emdlm_outputs.json"
RUN_LOCK = ".emdlm.lock"  # held by the process writing the run folder (hold_run_folder)
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
    f".{MANIFEST}.*.tmp",  # the same for the manifest
)
# emdlm eval's default "eval/": its outputs, and the temporary files of an interrupted
# atomic write of one of them (emdlm._files.atomic_write: ".<name>.<random>.tmp")
EVAL_FILES = frozenset({"metrics.json", "predictions.jsonl", "contact_sheet.png"})


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
    with atomic_write(folder / MANIFEST) as fh:  # never a half-written manifest
        fh.write(json.dumps(payload, indent=1) + "\n")


def is_run_folder(folder: Path) -> bool:
    """A folder an emdlm run wrote (a manifest, or the run_config.yaml of older versions)."""
    return (folder / MANIFEST).is_file() or (folder / "run_config.yaml").is_file()


def _is_eval_file(name: str) -> bool:
    return name in EVAL_FILES or any(
        fnmatch.fnmatchcase(name, f".{known}.*.tmp") for known in EVAL_FILES
    )


def _is_eval_folder(path: Path) -> bool:
    return path.is_dir() and all(_is_eval_file(p.name) for p in path.iterdir())


def _is_known_name(name: str, recorded: set[str]) -> bool:
    return name in recorded or name in KNOWN_FILES or any(
        fnmatch.fnmatch(name, p) for p in KNOWN_PATTERNS)


def emdlm_entries(folder: Path) -> list[Path]:
    """The entries of ``folder`` that emdlm wrote: manifest names, known names and patterns
    (an ``eval/`` folder only when it holds nothing but emdlm eval's files)."""
    recorded = read_manifest(folder)
    found = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if _is_known_name(name, recorded) or (name == "eval" and _is_eval_folder(entry)):
            found.append(entry)
    return found


def refuse_linked_entries(folder: Path) -> None:
    """:class:`emdlm._files.FolderEntryError` naming the first entry of ``folder`` that emdlm
    writes, replaces or removes (manifest names, known names and patterns, ``eval``) and that
    is a symbolic link: writing it would write where the link points (``--overwrite``, a new
    run's lock, an evaluation). Reads only; a missing folder and a user's other links pass."""
    if not folder.is_dir():
        return
    recorded = read_manifest(folder)
    for entry in sorted(folder.iterdir()):
        if _is_known_name(entry.name, recorded) or entry.name == "eval":
            refuse_links(entry)


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
    data and model; the lock itself is taken later by :func:`hold_run_folder`. A lock file
    that is a link or not a plain file, or another entry emdlm writes that is a link, is
    :class:`emdlm._files.FolderEntryError` (:func:`refuse_linked_entries`)."""
    try:
        check_lock_free(folder / RUN_LOCK)
    except LockHeldError as err:
        raise _busy(folder, err, hint) from None
    refuse_linked_entries(folder)


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
        refuse_linked_entries(folder)  # checked again now that no other emdlm process writes
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


