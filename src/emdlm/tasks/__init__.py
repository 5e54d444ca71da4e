"""Named data generators (a registry), so new tasks plug in without touching the trainer.

A task is a function ``task(n, *, split, seed, **params) -> list[dict]`` returning examples with
"prompt" and "completion" fields (or "text"; extra fields pass through to the collator). The
"train" and "test" splits of a task must be disjoint.

Register one with ``@register_task("name")``; build examples with
``generate_task("name", n=..., split="train", seed=0, **params)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

TaskFn = Callable[..., list[dict[str, Any]]]

_REGISTRY: dict[str, TaskFn] = {}
# Built-in tasks live in these modules; they register on import (imported lazily).
_BUILTIN_MODULES = ("emdlm.tasks.arithmetic", "emdlm.tasks.mathematics")


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator: register ``fn`` under ``name`` (a second registration of a name is an error)."""

    def wrap(fn: TaskFn) -> TaskFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = fn
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
    """Generate ``n`` examples of task ``name`` for ``split`` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    fn = get_task(name)
    try:
        return fn(n, split=split, seed=seed, **params)
    except TypeError as err:  # unknown parameter names: say which task
        raise ValueError(f"bad parameters for task {name!r}: {err}") from err


__all__ = ["available_tasks", "generate_task", "get_task", "register_task"]
