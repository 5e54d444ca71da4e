"""Experiment configs and their expansion into cells (task x variant x seed).

An experiment file (YAML) holds one base run config and what varies around it::

    name: arithmetic_objectives
    base: arithmetic_ce            # a run-config mapping, a YAML path or a packaged name
    base_overrides: [train.max_steps=8000]   # optional, applied to the base first
    variants:                      # name -> dotted overrides of the base; first = baseline
      ce: [objective.name=ce]
      ntil: [objective.name=ntil, objective.params.preset=paper]
    baseline: ce                   # optional (default: the first variant)
    seeds: [0, 1, 2, 3, 4]
    tasks:                         # optional; name -> dotted overrides (default: one task)
      add3: [data.train.params.max_digits=3, data.eval.params.max_digits=3]
    eval:
      checkpoints: all             # all | final | a list of steps (the final model always)
      overrides: [data.eval.n=2000]  # applied to the run config for evaluation only
      extra:                       # optional further evaluations of the final model only:
        choice: [eval.kind=choice, data.eval.task=polarity_choice]  # name -> overrides
    workers: 2                     # worker processes (default: CPU cores)
    threads_per_worker: 1
    keep_checkpoints: false        # delete checkpoint-* folders once a cell is evaluated
    launcher: local                # or {name: ray, num_gpus: 1}, {name: slurm, partition: gpu}
    output_dir: runs/experiments/arithmetic_objectives
    select:                        # optional: a dev sweep's rule, applied by the report
      metric: abs_error_mean       #   (emdlm.experiments.selection)
      groups: {ce: "ce_lr*", ntil: "ntil_lr*"}

Every cell is one ``emdlm train`` + ``emdlm eval`` per evaluated checkpoint, in
``<output_dir>/<task>/<variant>/seed<k>/``, plus one ``emdlm eval`` of the final model per
``eval.extra`` entry (its metrics are reported as ``<name>.<metric>``). The variants of one
seed share ``train.seed``, which fixes the generated data, its order and the initial weights
(the model is built right after ``set_seed(train.seed)``), so differences between variants of
a seed are paired.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

from emdlm.config import (
    MAX_SEED,
    ConfigError,
    RunConfig,
    apply_overrides,
    build_config,
    did_you_mean,
    load_config_dict,
    packaged_experiment,
    parse_override,
)
from emdlm.config.loading import read_yaml_mapping
from emdlm.data import check_task_sources
from emdlm.domains import SEED, shown_value
from emdlm.experiments.selection import SelectionRule, parse_selection

EXPERIMENT_KEYS = (
    "name", "base", "base_overrides", "variants", "baseline", "seeds", "tasks", "task_variants",
    "eval", "workers", "threads_per_worker", "keep_checkpoints", "output_dir", "launcher",
    "select",
)
EVAL_KEYS = ("checkpoints", "overrides", "extra")
DEFAULT_TASK = "default"
DEFAULT_LAUNCHER = "local"
# keys a variant or task may not change: they would break the pairing of seeds, or the layout
RESERVED_OVERRIDES = ("train.seed", "output_dir")


@dataclass
class EvalPlan:
    """Which checkpoints of a cell are evaluated, and the eval-only config overrides.

    ``checkpoints``: "all" (every ``checkpoint-<step>`` the run saved, i.e. every
    ``train.save_steps``), "final" (the final model only), or a list of steps (each a multiple
    of ``train.save_steps`` or the final step, none beyond ``train.max_steps``; checked for
    every cell by :func:`expand_grid` before any cell runs). The final model is always
    evaluated.
    ``extra``: name -> overrides (on top of ``overrides``) of a further evaluation of the final
    model, e.g. a second test set or another eval kind.
    """

    checkpoints: str | list[int] = "all"
    overrides: list[str] = field(default_factory=list)
    extra: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Experiment:
    """A validated experiment: the base run config (raw mapping) and the grid around it."""

    name: str
    base: dict[str, Any]
    variants: dict[str, list[str]]
    baseline: str
    seeds: list[int]
    tasks: dict[str, list[str]]
    eval: EvalPlan
    workers: int | None
    threads_per_worker: int
    keep_checkpoints: bool
    output_dir: Path
    #: how the cells run: ``{"name": <launcher>, <option>: <value>, ...}``, checked against
    #: the launcher registry (:mod:`emdlm.experiments.launchers`) before any cell runs
    launcher: dict[str, Any] = field(default_factory=lambda: {"name": DEFAULT_LAUNCHER})
    #: the config's selection rule (a dev sweep's), applied by the report; None without one
    select: SelectionRule | None = None
    #: task -> variant -> overrides applied after the variant's own in that task's cells only
    #: (each objective's learning rate chosen per task)
    task_variants: dict[str, dict[str, list[str]]] = field(default_factory=dict)


@dataclass
class Cell:
    """One (task, variant, seed) run: its folder and the raw run config it trains."""

    task: str
    variant: str
    seed: int
    folder: Path
    config: dict[str, Any]
    eval_overrides: list[str]
    checkpoints: str | list[int]
    extra_evals: dict[str, list[str]]
    keep_checkpoints: bool
    threads: int

    @property
    def key(self) -> str:
        return f"{self.task}/{self.variant}/seed{self.seed}"

    @property
    def train_dir(self) -> Path:
        return self.folder / "train"


def load_experiment_dict(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Raw mapping of an experiment file (or packaged experiment name) and its folder."""
    p = Path(path)
    if not p.is_file():
        packaged = packaged_experiment(str(path))
        if packaged is None:
            raise ConfigError(f"experiment config not found: {path}")
        p = packaged
    return read_yaml_mapping(p), p.parent


def _resolve_base(base: Any, folder: Path) -> dict[str, Any]:
    """The base run config as a mapping: inline, a YAML path (relative to the experiment
    file first) or a packaged run-config name."""
    if base is None:
        raise ConfigError("experiment: 'base' (the run config every cell starts from) is missing")
    if isinstance(base, dict):
        return copy.deepcopy(base)
    if isinstance(base, str):
        local = folder / base
        return load_config_dict(local if local.is_file() else base)
    raise ConfigError(f"experiment.base must be a mapping or a config path, got {base!r}")


def _override_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):  # {objective.name: ntil} is accepted as well as a list
        value = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                 if not isinstance(v, str) else f"{k}={v}" for k, v in value.items()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of key=value strings, got {value!r}")
    for item in value:
        key = ".".join(parse_override(item)[0])
        if key in RESERVED_OVERRIDES:
            raise ConfigError(
                f"{where}: {key!r} may not be overridden per variant or task (seeds are paired "
                f"through train.seed and folders are laid out by the runner)"
            )
    return list(value)


def _named_overrides(value: Any, where: str, *, required: bool) -> dict[str, list[str]]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where} must be a non-empty mapping of name -> overrides")
    out: dict[str, list[str]] = {}
    for name, items in value.items():
        name = str(name)
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"{where}: {name!r} is not a usable folder name")
        out[name] = _override_list(items, f"{where}.{name}")
    return out


def _task_variants(
    value: Any, tasks: list[str], variants: list[str]
) -> dict[str, dict[str, list[str]]]:
    """experiment.task_variants: ``{task: {variant: [key=value, ...]}}``, each task one of
    ``tasks`` and each variant one of ``variants`` (a misspelt one would silently leave the
    variant's own settings in place), the overrides as a variant's (no reserved keys)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("experiment.task_variants must be a mapping of task -> variant -> "
                          f"overrides, got {value!r}")
    out: dict[str, dict[str, list[str]]] = {}
    for task, per_variant in value.items():
        where = f"experiment.task_variants.{task}"
        if str(task) not in tasks:
            raise ConfigError(f"{where}: {str(task)!r} is not a task of this experiment: "
                              f"{', '.join(tasks)}{did_you_mean(str(task), tasks)}")
        named = _named_overrides(per_variant, where, required=True)
        unknown = [v for v in named if v not in variants]
        if unknown:
            raise ConfigError(f"{where}: {unknown[0]!r} is not a variant: "
                              f"{', '.join(variants)}{did_you_mean(unknown[0], variants)}")
        out[str(task)] = named
    return out


def launcher_mapping(value: Any) -> dict[str, Any]:
    """experiment.launcher as ``{"name": ..., <options>}``: a launcher name alone (``ray``) or
    a mapping with a ``name``; missing means the local launcher. Its options are checked by
    the launcher itself (:func:`emdlm.experiments.launchers.make_launcher`)."""
    if value is None:
        return {"name": DEFAULT_LAUNCHER}
    if isinstance(value, str):
        return {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ConfigError(f"experiment.launcher must be a launcher name or a mapping with a "
                          f"'name' and its options, got {value!r}")
    return dict(value)


def _launcher_override(item: str) -> str:
    """``launcher=ray`` replaces the launcher and its options (``launcher={name: ray}``), so a
    file's SLURM options do not follow a switch to Ray; ``launcher.<option>=...`` sets one."""
    path, value = parse_override(item)
    if path == ["launcher"] and isinstance(value, str):
        return "launcher=" + json.dumps({"name": value})  # JSON: a YAML flow mapping
    return item


def positive_int(value: Any, where: str) -> int:
    """``value`` if it is an int >= 1 (not a bool), else a ConfigError naming ``where``: the
    check of the grid's counts and of the launchers' (:mod:`emdlm.experiments.launchers`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be an integer >= 1, got {value!r}")
    return value


#: More seeds than this in one grid is a typo (e.g. ``seeds: 1000000000``), not a grid to run.
MAX_SEED_COUNT = 10_000


def _seeds(value: Any) -> list[int]:
    """experiment.seeds: a count n (seeds 0 .. n-1, n >= 1) or a list of distinct seeds, each
    one ``transformers.set_seed`` accepts (0 .. MAX_SEED: numpy refuses negative ones), checked
    here so that no cell starts with a seed that fails, and the message says which is wrong."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"experiment.seeds={value}: a count n means seeds 0 .. n-1 and "
                              "must be >= 1 (or give a list of seeds, e.g. [0, 1, 2])")
        if value > MAX_SEED_COUNT:
            raise ConfigError(f"experiment.seeds={value}: at most {MAX_SEED_COUNT} seeds (each "
                              "seed trains a model per variant and task); give fewer")
        return list(range(value))  # "seeds: 5" means seeds 0..4
    if not isinstance(value, list) or not value:
        raise ConfigError(f"experiment.seeds must be a count >= 1 or a non-empty list of seeds, "
                          f"got {value!r}")
    if len(value) > MAX_SEED_COUNT:
        raise ConfigError(f"experiment.seeds lists {len(value)} seeds: at most {MAX_SEED_COUNT} "
                          "(each seed trains a model per variant and task)")
    for i, seed in enumerate(value):
        if SEED.problem(seed) is not None:
            raise ConfigError(f"experiment.seeds[{i}]={shown_value(seed)}: a seed must be an "
                              f"integer from 0 to {MAX_SEED} (transformers.set_seed seeds "
                              "numpy, which refuses others)")
    repeated = sorted(s for s, k in Counter(value).items() if k > 1)
    if repeated:
        raise ConfigError(f"experiment.seeds has duplicates: {repeated} more than once in "
                          f"{value} (each seed is one paired run)")
    return list(value)


def _eval_plan(value: Any) -> EvalPlan:
    if value is None:
        return EvalPlan()
    if not isinstance(value, dict):
        raise ConfigError(f"experiment.eval must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(EVAL_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) experiment.eval.{unknown}; valid: {EVAL_KEYS}")
    checkpoints = value.get("checkpoints", "all")
    if isinstance(checkpoints, list):
        if not checkpoints or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in checkpoints
        ):
            raise ConfigError(f"experiment.eval.checkpoints: steps must be ints >= 1, got "
                              f"{checkpoints!r}")
        checkpoints = sorted(set(checkpoints))
    elif checkpoints not in ("all", "final"):
        raise ConfigError(
            f"experiment.eval.checkpoints must be 'all', 'final' or a list of steps, got "
            f"{checkpoints!r}"
        )
    overrides = _override_list(value.get("overrides"), "experiment.eval.overrides")
    extra = _named_overrides(value.get("extra"), "experiment.eval.extra", required=False)
    clash = [name for name in extra if name.startswith("step-")]
    if clash:  # eval/step-<N>/ holds the learning-curve evaluations
        raise ConfigError(f"experiment.eval.extra: names may not start with 'step-': {clash}")
    return EvalPlan(checkpoints, overrides, extra)


def parse_experiment(data: dict[str, Any], folder: Path = Path(".")) -> Experiment:
    """Validate a raw experiment mapping (ConfigError naming the first problem)."""
    unknown = sorted(set(data) - set(EXPERIMENT_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown experiment key(s) {unknown}; valid keys: {', '.join(EXPERIMENT_KEYS)}"
        )
    variants = _named_overrides(data.get("variants"), "experiment.variants", required=True)
    baseline = str(data.get("baseline", next(iter(variants))))
    if baseline not in variants:
        raise ConfigError(f"experiment.baseline {baseline!r} is not a variant: {list(variants)} "
                          "(to run only some cells of a grid, keep its variants and pass "
                          "--only task/variant/seed<k> instead)")
    seeds = _seeds(data.get("seeds", [0]))
    tasks = _named_overrides(data.get("tasks"), "experiment.tasks", required=False) or {
        DEFAULT_TASK: []}
    output_dir = data.get("output_dir")
    if not isinstance(output_dir, str) or not output_dir:
        raise ConfigError("experiment.output_dir (where the grid and report go) is missing")
    keep = data.get("keep_checkpoints", True)
    if not isinstance(keep, bool):
        raise ConfigError(f"experiment.keep_checkpoints must be true/false, got {keep!r}")
    workers = data.get("workers")
    return Experiment(
        name=str(data.get("name") or Path(output_dir).name),
        base=apply_overrides(
            _resolve_base(data.get("base"), folder),
            _override_list(data.get("base_overrides"), "experiment.base_overrides"),
        ),
        variants=variants,
        baseline=baseline,
        seeds=list(seeds),
        tasks=tasks,
        eval=_eval_plan(data.get("eval")),
        workers=None if workers is None else positive_int(workers, "experiment.workers"),
        threads_per_worker=positive_int(
            data.get("threads_per_worker", 1), "experiment.threads_per_worker"
        ),
        keep_checkpoints=keep,
        output_dir=Path(output_dir),
        launcher=launcher_mapping(data.get("launcher")),
        select=parse_selection(data.get("select"), list(variants)),
        task_variants=_task_variants(data.get("task_variants"), list(tasks), list(variants)),
    )


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    """Load an experiment file (or packaged name), apply dotted overrides, validate.

    Overrides address the experiment mapping: ``seeds=[0,1] workers=1
    base.train.max_steps=20 output_dir=runs/x``. Order: the base (a name or path is read
    first), then the file's ``base_overrides``, then the command line's ``base.*`` overrides,
    so what the user types wins over what the file sets (``base_overrides=[...]`` on the
    command line replaces the file's list).
    """
    data, folder = load_experiment_dict(path)
    overrides = [_launcher_override(item) for item in overrides or []]
    reaches_base = [item for item in overrides if _reaches_into_base(item)]
    data = {**data, "launcher": launcher_mapping(data.get("launcher"))}
    data = apply_overrides(data, [item for item in overrides if item not in reaches_base])
    base = apply_overrides(
        _resolve_base(data.get("base"), folder),
        _override_list(data.get("base_overrides"), "experiment.base_overrides"),
    )
    # applied to the base mapping itself, so that base.objective.name=ce switches the objective
    # as objective.name=ce does on a run config (emdlm.config.switch_objective)
    data["base"] = apply_overrides(base, [_inside_base(item) for item in reaches_base])
    data["base_overrides"] = []
    return parse_experiment(data, folder)


def _inside_base(item: str) -> str:
    """``base.train.max_steps=20`` -> ``train.max_steps=20``."""
    key, _, value = item.partition("=")
    return f"{key.strip().lstrip('-').removeprefix('base.')}={value}"


def _reaches_into_base(item: str) -> bool:
    """``base.train.max_steps=20`` changes the base run config (``base=name`` replaces it)."""
    path, _ = parse_override(item)
    return len(path) > 1 and path[0] == "base"


def expand_grid(exp: Experiment) -> list[Cell]:
    """All cells (task-major, then seed, then variant), each trained with the base config and
    the task's, the variant's and the (task, variant)'s ``task_variants`` overrides in that
    order, each with its run config checked by
    :func:`emdlm.config.build_config` so a bad override fails before anything runs."""
    cells: list[Cell] = []
    for task, task_overrides in exp.tasks.items():
        for seed in exp.seeds:
            for variant, variant_overrides in exp.variants.items():
                folder = exp.output_dir / task / variant / f"seed{seed}"
                runner_overrides = [
                    f"train.seed={seed}",
                    f"output_dir={folder / 'train'}",
                    # learning curves need every checkpoint until the cell is evaluated
                    "train.save_total_limit=null",
                    "train.progress_bar=false",
                    f"train.torch_threads={exp.threads_per_worker}",
                ]
                own = exp.task_variants.get(task, {}).get(variant, [])  # after the variant's
                raw = apply_overrides(
                    exp.base, [*task_overrides, *variant_overrides, *own, *runner_overrides]
                )
                where = f"cell {task}/{variant}/seed{seed}"
                _check_checkpoints(exp.eval.checkpoints, check_run_config(raw, where), where)
                eval_cfg = check_run_config(apply_overrides(raw, exp.eval.overrides),
                                            f"{where} (eval)")
                if eval_cfg.data.eval is None:
                    raise ConfigError(f"{where}: no test set (set data.eval in the base config "
                                      f"or in experiment.eval.overrides)")
                extra = {name: [*exp.eval.overrides, *items]
                         for name, items in exp.eval.extra.items()}
                for name, items in extra.items():
                    check_run_config(apply_overrides(raw, items), f"{where} (eval.extra.{name})")
                cells.append(Cell(task, variant, seed, folder, raw, list(exp.eval.overrides),
                                  exp.eval.checkpoints, extra, exp.keep_checkpoints,
                                  exp.threads_per_worker))
    return cells


def select_cells(cells: list[Cell], patterns: list[str]) -> list[Cell]:
    """The cells whose key (``task/variant/seed<k>``) matches one of the shell-style patterns
    (``fnmatch``: ``*/ce_lr1e-3/seed4``, ``add3/*/seed[01]``), in grid order.

    Lets one invocation run part of a grid (one late seed, one variant) while the report still
    covers every finished cell. A pattern that matches no cell is an error (a typo would
    otherwise run nothing and say nothing).
    """
    unmatched = [p for p in patterns if not any(fnmatchcase(c.key, p) for c in cells)]
    if unmatched:
        sample = ", ".join(c.key for c in cells[:4]) + (", ..." if len(cells) > 4 else "")
        raise ConfigError(f"--only {', '.join(map(repr, unmatched))} matches no cell of this "
                          f"grid (cell keys are task/variant/seed<k>: {sample})")
    return [c for c in cells if any(fnmatchcase(c.key, p) for p in patterns)]


def _check_checkpoints(checkpoints: str | list[int], cfg: RunConfig, where: str) -> None:
    """A list of eval.checkpoints against the cell's training: each step must be a saved one
    (a multiple of ``train.save_steps``) or the final step, and none beyond ``train.max_steps``.
    Checked before any cell starts: the runner would find out only after training every cell.
    With an epoch-based run (``max_steps`` <= 0) the final step is not known here, so only
    multiples of save_steps are accepted (the final model is evaluated anyway)."""
    if not isinstance(checkpoints, list):
        return  # "all" / "final": whatever the run saves
    every, last = cfg.train.save_steps, cfg.train.max_steps
    for step in checkpoints:
        if last > 0 and step > last:
            raise ConfigError(f"{where}: experiment.eval.checkpoints step {step} is beyond "
                              f"train.max_steps={last}")
        if step % every and step != last:
            final = f" nor the final step {last}" if last > 0 else ""
            raise ConfigError(
                f"{where}: experiment.eval.checkpoints step {step} is not a multiple of "
                f"train.save_steps={every}{final}, so no checkpoint is saved there; use "
                f"multiples of {every} (the final model is always evaluated)")


def check_run_config(raw: dict[str, Any], where: str) -> RunConfig:
    """build_config, and its task sources' parameters checked (a typo in a later task's
    overrides would otherwise fail only when its first cell starts, hours into a grid), with
    the cell named in the error."""
    try:
        cfg = build_config(raw)
        check_task_sources(cfg)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err
    return cfg


def task_title(exp: Experiment, task: str) -> str:
    """How report prose names ``task``: the experiment's own name for the one task of a grid
    without ``tasks:`` (its cells stay under ``default/``), else the task's name."""
    return exp.name if task == DEFAULT_TASK and list(exp.tasks) == [DEFAULT_TASK] else task
