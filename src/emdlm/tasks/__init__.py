"""Named data generators (a registry), so new tasks plug in without touching the trainer.

A task is a function ``task(n, *, split, seed, **params) -> list[dict]`` returning examples with
"prompt" and "completion" fields (or "text"; extra fields pass through to the collator). The
"train" and "test" splits of a task (and "dev", for a task registered with it) must be
disjoint.

Register one with ``@register_task("name")``; build examples with
``generate_task("name", n=..., split="train", seed=0, **params)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

TaskFn = Callable[..., list[dict[str, Any]]]

_REGISTRY: dict[str, TaskFn] = {}
_SPLITS: dict[str, tuple[str, ...]] = {}  # the splits each task serves
# Built-in tasks live in these modules; they register on import (imported lazily).
_BUILTIN_MODULES = (
    "emdlm.tasks.arithmetic",
    "emdlm.tasks.mathematics",
    "emdlm.tasks.clock",
    "emdlm.tasks.grounding",
    "emdlm.tasks.text_detection",
    "emdlm.tasks.text_corpora",
)


def register_task(
    name: str, *, splits: tuple[str, ...] = ("train", "test")
) -> Callable[[TaskFn], TaskFn]:
    """Decorator: register ``fn`` under ``name`` (a second registration of a name is an error);
    ``splits``: the splits it serves (a task with a held-out "dev" split lists it)."""

    def wrap(fn: TaskFn) -> TaskFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = fn
        _SPLITS[name] = tuple(splits)
        return fn

    return wrap


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def available_tasks() -> list[str]:
    """Names of all registered tasks."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_task(name: str) -> TaskFn:
    """The generator registered under ``name`` (ValueError listing the known names if absent)."""
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def generate_task(
    name: str, *, n: int, split: str = "train", seed: int = 0, **params: Any
) -> list[dict[str, Any]]:
    """Generate ``n`` examples of task ``name`` for ``split`` ("train" or "test"; "dev" for
    tasks registered with it)."""
    fn = get_task(name)
    if split not in _SPLITS[name]:
        raise ValueError(
            f"task {name!r} has splits {', '.join(_SPLITS[name])}; got split={split!r}"
        )
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    try:
        return fn(n, split=split, seed=seed, **params)
    except TypeError as err:  # unknown parameter names: say which task
        raise ValueError(f"bad parameters for task {name!r}: {err}") from err


__all__ = ["available_tasks", "generate_task", "get_task", "register_task"]
