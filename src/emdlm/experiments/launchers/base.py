"""What every launcher is: a set of checked options and ``run(exp, cells)``; the checks its
options use; the one-line error for a cluster package that is not installed."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

from emdlm.config import ConfigError
from emdlm.config.errors import check_one_of
from emdlm.experiments.grid import Cell, Experiment
from emdlm.experiments.grid import positive_int as positive_int  # the grid's count check
from emdlm.experiments.runner import CellOutcome

CLUSTER_EXTRA = "pip install 'emdlm[cluster]'"


def require(package: str, launcher: str) -> ModuleType:
    """Import ``package`` (``ray``, ``submitit``), or a ConfigError saying how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"launcher={launcher} needs the {package} package, which is not "
                          f"installed: {CLUSTER_EXTRA}") from None


# option checks: (value, "launcher.<option>") -> the value to use, or ConfigError
Check = Callable[[Any, str], Any]


def non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def non_negative_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{where} must be a number >= 0, got {value!r}")
    return value


def text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def text_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


def one_of(*choices: str) -> Check:
    def check(value: Any, where: str) -> str:
        check_one_of(where, value, choices, ConfigError)
        return str(value)
    return check


def option(default: Any, check: Check, *, optional: bool = False) -> Any:
    """A launcher option: a dataclass field with its check (``optional``: None is allowed)."""
    return dataclasses.field(default=default, metadata={"check": check, "optional": optional})


@dataclasses.dataclass(frozen=True)
class Launcher:
    """Runs the unfinished cells of a grid, each through the runner's own
    :func:`emdlm.experiments.runner.run_cell` (in this process, a Ray task or a batch job),
    and returns one outcome per cell (:func:`emdlm.experiments.runner.run_cells`)."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Launcher:
        """The launcher with ``options`` (the ``experiment.launcher`` mapping less its name),
        each checked; ConfigError naming the first bad or unknown one."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ConfigError(f"launcher={cls.name} has no option(s) {unknown}; its options: "
                              f"{', '.join(fields) or 'none'}")
        values = {}
        for key, value in options.items():
            meta = fields[key].metadata
            where = f"experiment.launcher.{key}"
            values[key] = None if value is None and meta["optional"] else meta["check"](value,
                                                                                       where)
        return cls(**values)

    def check_installed(self) -> None:
        """ConfigError when a package this launcher needs is missing (before any cell runs)."""

    def run(self, exp: Experiment, cells: list[Cell], *, progress: bool) -> list[CellOutcome]:
        raise NotImplementedError
