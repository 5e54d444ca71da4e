"""Is the work in a cell's folder the grid's cell? The definition a cell was trained and
evaluated with, against the one the grid gives it now.

A cell folder holds work of whatever definition wrote it: a folder copied from another variant,
or the cells of a variant whose overrides changed since, would otherwise be counted as done and
their numbers reported under the grid's names. Two records say what a cell's work was done with:

* ``train/run_config.yaml``: the resolved run config the training used, written by every emdlm
  version when training starts (:meth:`emdlm.training.folder_guard.FolderGuard.prepare`);
* ``cell_definition.json`` (:data:`DEFINITION_FILE`): written by the runner when it starts work
  on a cell, the resolved run config and the resolved config of each evaluation (the main one,
  with ``experiment.eval.overrides``, and each ``eval.extra``), which run_config.yaml does not
  hold. Cells begun before it existed have only run_config.yaml: they are checked on that.

Both sides are normalised the same way (the config built and validated,
:func:`emdlm.config.build_config`, then dumped and read back as YAML, as run_config.yaml was)
and compared key by key along :class:`emdlm.config.RunConfig`'s fields; a free-form mapping
(``model.params``, ``objective.params``, a data source's ``params``) is compared whole. Not
compared: the keys in :data:`NOT_DEFINING`, which change neither the weights nor the metrics
(the folder, threads, logging, the generation batch size). A field a record lacks (a setting
newer than the cell) is taken at its default, what older emdlm versions did; a field the
record has and the config no longer knows (a removed setting) is passed over.

A cell whose record differs is refused (:func:`definition_problem`): the runner neither skips
it as done nor runs it (running would resume or reuse the other definition's training), the
report leaves its numbers out and names the differing keys. emdlm never deletes its folder:
the user moves it away to have the cell run again under the grid's definition (or asks the
runner to, ``emdlm experiment --rerun-refused``: :func:`set_aside` renames it beside itself,
nothing lost), or restores the overrides it was trained with.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from emdlm.config import ConfigError, RunConfig, apply_overrides, build_config, read_yaml_file
from emdlm.experiments.cell_folder import CELL_DONE, EVAL_DIR, write_whole
from emdlm.experiments.cell_lock import HOLDER_FILE, hold_cell
from emdlm.experiments.grid import Cell

DEFINITION_FILE = "cell_definition.json"
RUN_CONFIG = "run_config.yaml"  # in the cell's train/ folder, written by training
#: Keys that define neither the weights nor the metrics: a cell that differs only there is the
#: same cell (the runner sets the first four; the rest are logging and batching).
NOT_DEFINING = (
    "output_dir", "train.save_total_limit", "train.progress_bar", "train.torch_threads",
    "train.tensorboard", "train.report_to", "train.logging_steps", "eval.batch_size",
    "eval.at_end",
)
MAX_NAMED_KEYS = 4  # differing keys named in the one-line message (the rest are counted)


def resolved(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` as training records it: built and validated, dumped and read back as YAML."""
    return yaml.safe_load(yaml.safe_dump(build_config(dict(raw)).to_dict(), sort_keys=False))


def cell_definition(cell: Cell) -> dict[str, Any]:
    """The resolved run config of ``cell`` and of each of its evaluations ("main": with
    ``experiment.eval.overrides``; then each ``eval.extra`` by name)."""
    evaluations = {"main": resolved(apply_overrides(cell.config, cell.eval_overrides))}
    for name, overrides in cell.extra_evals.items():
        evaluations[name] = resolved(apply_overrides(cell.config, overrides))
    return {"run_config": resolved(cell.config), "evaluations": evaluations}


def _field_defaults(cls: type) -> dict[str, Any]:
    return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cls())))


def _dataclass_of(hint: Any) -> type | None:
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
            return candidate
    return None


def differing_keys(
    recorded: Mapping[str, Any], wanted: Mapping[str, Any], cls: type = RunConfig,
    prefix: str = "",
) -> list[tuple[str, Any, Any]]:
    """(dotted key, recorded value, wanted value) for every field of dataclass ``cls`` whose
    values differ, in field order; see the module docstring for what is compared."""
    hints = typing.get_type_hints(cls)
    defaults = _field_defaults(cls)
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if key in NOT_DEFINING:
            continue
        new = wanted.get(f.name, defaults[f.name])
        old = recorded.get(f.name, defaults[f.name])  # a setting newer than the record
        sub = _dataclass_of(hints[f.name])
        if sub is not None and isinstance(old, dict) and isinstance(new, dict):
            out += differing_keys(old, new, sub, key + ".")
        elif old != new:
            out.append((key, old, new))
    return out


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(diffs: list[tuple[str, Any, Any]]) -> str:
    named = [f"{key} {_short(old)} there, {_short(new)} in the grid"
             for key, old, new in diffs[:MAX_NAMED_KEYS]]
    more = len(diffs) - MAX_NAMED_KEYS
    return "; ".join(named) + (f" (and {more} more key(s))" if more > 0 else "")


def _read_record(path: Path) -> Any:
    """The mapping in a record file (ConfigError naming it when it cannot be read)."""
    try:
        data = (read_yaml_file(path) if path.suffix == ".yaml"
                else json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as err:  # ConfigError is a ValueError
        raise ConfigError(f"{path} cannot be read ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a mapping")
    return data


def _has_work(cell: Cell) -> bool:
    """Anything in the folder that a definition produced: a training that started (its
    run_config.yaml), evaluations, a record of a finished cell. A cell that failed before its
    training started (a bad override, fixed since) has none: it simply runs."""
    return ((cell.train_dir / RUN_CONFIG).exists()
            or any((cell.folder / name).exists() for name in (EVAL_DIR, CELL_DONE)))


def _evaluated(cell: Cell, name: str) -> bool:
    """Whether the folder holds evaluations of ``name`` ("main" or an ``eval.extra`` name)."""
    folder = cell.folder / EVAL_DIR if name == "main" else cell.folder / EVAL_DIR / name
    return any(folder.glob("step-*"))


def definition_problem(cell: Cell) -> str | None:
    """Why the work in ``cell``'s folder is not this grid's cell, in one line naming the
    differing keys; None when it is (or when the folder holds no work, or no record: a cell
    written by hand). Never writes."""
    if not _has_work(cell):
        return None
    run_config = cell.train_dir / RUN_CONFIG
    record_path = cell.folder / DEFINITION_FILE
    try:
        record = _read_record(record_path) if record_path.is_file() else None
        wanted = cell_definition(cell)
        trained = _read_record(run_config) if run_config.is_file() else None
        if trained is None and record is not None:
            trained, run_config = record.get("run_config"), record_path
        if isinstance(trained, dict):
            diffs = differing_keys(trained, wanted["run_config"])
            if diffs:
                return (f"{run_config} was trained under another definition than this "
                        f"grid's cell: {_describe(diffs)}")
        evaluations = record.get("evaluations") if record is not None else None
        for name, config in (evaluations or {}).items():
            if _evaluated(cell, name) and name in wanted["evaluations"] and isinstance(
                    config, dict):
                diffs = differing_keys(config, wanted["evaluations"][name])
                if diffs:
                    return (f"{record_path} says the cell was evaluated ({name}) under another "
                            f"definition than the grid's: {_describe(diffs)}")
    except ConfigError as err:
        return f"its definition cannot be checked: {err}"
    return None


def refusal(cell: Cell) -> str | None:
    """:func:`definition_problem` as the runner and the report state it: what differs, and
    that the folder is left as it is, with what to do."""
    problem = definition_problem(cell)
    if problem is None:
        return None
    return (f"{problem}. Refused, its folder left as it is: move {cell.folder} elsewhere (or "
            "pass --rerun-refused) to run the cell again under the grid's definition, or "
            "restore the overrides it was trained with")


SET_ASIDE_SUFFIX = ".other-definition-"


def set_aside(cell: Cell) -> Path:
    """Rename a refused cell's folder to ``<folder>.other-definition-<k>`` (the first free k)
    beside it, under the cell's lock (:func:`emdlm.experiments.cell_lock.hold_cell`: a
    process working on it is not disturbed, CellInUseError), so that the cell runs again
    under the grid's definition; nothing in the folder is deleted. Returns the new path."""
    k = 1
    while (target := cell.folder.with_name(f"{cell.folder.name}{SET_ASIDE_SUFFIX}{k}")).exists():
        k += 1
    with hold_cell(cell.folder):
        cell.folder.rename(target)
    # the holder record our hold wrote moved with the folder; the hold released it, so it is
    # ours and stale (the cell lock deletes its record only where the folder was)
    (target / HOLDER_FILE).unlink(missing_ok=True)
    return target


def record_definition(cell: Cell) -> None:
    """Write ``cell_definition.json`` (whole: :func:`emdlm.experiments.cell_folder.write_whole`)
    for a cell the runner is about to work on, after :func:`definition_problem` passed."""
    write_whole(cell.folder / DEFINITION_FILE,
                json.dumps(cell_definition(cell), indent=1, sort_keys=False) + "\n")
