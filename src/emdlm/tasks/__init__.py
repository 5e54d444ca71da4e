"""The one registry of tasks: named data generators with what evaluation needs to know of them.

A task is a function ``task(n, *, split, seed, **params) -> list[dict]`` returning examples with
"prompt" and "completion" fields (or "text"; extra fields pass through to the collator). The
"train" and "test" splits of a task (and "dev", for a task registered with it) must be
disjoint.

Register one once, next to its generator, with ``@register_task("name", splits=...,
answer_pattern=..., eval_kind=..., domains=...)``: its :class:`TaskSpec` holds the generator, its
splits, the regex of its answer (the numbers ``number_scope="answer"`` scores, :mod:`emdlm.data`),
the eval kind its answers are read as (:mod:`emdlm.eval_kinds`, which in turn names the parser,
the metrics and the picture of that kind) and the legal values of its numeric parameters
(:class:`emdlm.domains.Domain`, the mechanism of the objective parameters and the run settings
too: NaN and ±inf lie in no domain, a bool is no number, an integer parameter takes no 2.5).
The registered generator checks them before its body runs, whether it is called through
:func:`generate_task` or directly; how parameters combine (``min_digits <= max_digits``) the
body checks after. Build examples with
``generate_task("name", n=..., split="train", seed=0, **params)``; look a task up with
:func:`task_spec`. Adding a task touches its module (and ``_BUILTIN_MODULES`` for a new module)
and its tests, nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from emdlm.config.errors import did_you_mean
from emdlm.domains import GENERATED_COUNT, SEED, Domain, domain_problems
from emdlm.eval_kinds import EVAL_KINDS

TaskFn = Callable[..., list[dict[str, Any]]]


@dataclass(frozen=True)
class TaskSpec:
    """One task.

    name: the task's name (``data.train.task``, a row's ``"task"`` field).
    generator: ``fn(n, *, split, seed, **params) -> rows``; None for a task named only for its
        answer pattern (rows from files, :func:`register_answer_pattern`).
    splits: the splits it serves.
    answer_pattern: the regex of the answer inside a completion (``number_scope="answer"``
        scores only the numbers inside its matches); None when the task has none.
    eval_kind: the :mod:`emdlm.eval_kinds` kind its answers are read as, where there is one.
    domains: the legal values of each numeric parameter of the generator (``n`` and ``seed``
        aside: :data:`GENERATION_DOMAINS`, checked by :func:`generate_task`), checked by the
        registered generator before it generates anything.
    """

    name: str
    generator: TaskFn | None
    splits: tuple[str, ...] = ("train", "test")
    answer_pattern: re.Pattern[str] | None = None
    eval_kind: str | None = None
    domains: Mapping[str, Domain] = field(default_factory=dict, hash=False)


#: The share of a generated task's hash space held out for "test": in (0, 1).
TEST_FRACTION = Domain(low=0.0, high=1.0, low_open=True, high_open=True)
#: The share held out for "dev" (beside ``test_fraction``, :func:`check_dev_fraction`): in [0, 1).
DEV_FRACTION = Domain(low=0.0, high=1.0, high_open=True)


_REGISTRY: dict[str, TaskSpec] = {}
# Built-in tasks live in these modules; they register on import (imported lazily).
_BUILTIN_MODULES = (
    "emdlm.tasks.arithmetic",
    "emdlm.tasks.mathematics",
    "emdlm.tasks.clock",
    "emdlm.tasks.visual_math",
    "emdlm.tasks.grounding",
    "emdlm.tasks.text_detection",
    "emdlm.tasks.text_corpora",
)


def _compiled(pattern: str | re.Pattern[str] | None) -> re.Pattern[str] | None:
    return re.compile(pattern) if isinstance(pattern, str) else pattern


def register_task(
    name: str,
    *,
    splits: tuple[str, ...] = ("train", "test"),
    answer_pattern: str | re.Pattern[str] | None = None,
    eval_kind: str | None = None,
    domains: Mapping[str, Domain] | None = None,
) -> Callable[[TaskFn], TaskFn]:
    """Decorator: register ``fn`` under ``name`` (a second registration of a name is an error);
    ``splits``: the splits it serves (a task with a held-out "dev" split lists it);
    ``answer_pattern``: the regex of its answer (``number_scope="answer"``); ``eval_kind``: the
    eval kind its answers are read as (:data:`emdlm.eval_kinds.EVAL_KINDS`); ``domains``: the
    legal values of its numeric parameters by name. With domains it returns (and registers)
    ``fn`` wrapped so that every call checks them first (:func:`check_task_params`); a
    generator registered so before keeps its domains under a second name."""
    if eval_kind is not None and eval_kind not in EVAL_KINDS:
        raise ValueError(f"task {name!r}: unknown eval kind {eval_kind!r}; expected one of "
                         f"{EVAL_KINDS}")
    pattern = _compiled(answer_pattern)
    declared = dict(domains or {})

    def wrap(fn: TaskFn) -> TaskFn:
        unknown = sorted(set(declared) - set(inspect.signature(fn).parameters))
        if unknown:
            raise ValueError(f"task {name!r}: domains of parameters it does not take: "
                             f"{', '.join(unknown)}")
        old = _REGISTRY.get(name)
        if old is not None and old.generator not in (None, fn) and _body(old.generator) is not fn:
            raise ValueError(f"task {name!r} is already registered")
        if old is not None and old.generator is None and pattern is None:
            keep = old.answer_pattern  # named earlier for its answer pattern only
        else:
            keep = pattern
        generator = _checked(name, fn, declared) if declared else fn
        domains_of = declared or dict(getattr(fn, "task_domains", {}))
        _REGISTRY[name] = TaskSpec(name, generator, tuple(splits), keep, eval_kind, domains_of)
        return generator

    return wrap


def _checked(name: str, fn: TaskFn, domains: Mapping[str, Domain]) -> TaskFn:
    """``fn`` checking ``domains`` on each call before it runs (arguments given by position
    too: they are bound to their names first)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def generate(*args: Any, **params: Any) -> list[dict[str, Any]]:
        check_task_params(name, domains, signature.bind_partial(*args, **params).arguments)
        return fn(*args, **params)

    generate.task_domains = domains  # type: ignore[attr-defined]
    return generate


def _body(generator: TaskFn) -> TaskFn:
    """The function a registered generator wraps (itself when it wraps none)."""
    return getattr(generator, "__wrapped__", generator)


def check_task_params(task: str, domains: Mapping[str, Domain], params: Mapping[str, Any]) -> None:
    """ValueError naming each of ``params`` outside its domain (``"task 'clock': jitter must be
    a finite number in [0, 0.5], got nan"``); parameters without a domain pass unchecked."""
    problems = domain_problems(domains, params)
    if problems:
        raise ValueError(f"task {task!r}: {'; '.join(problems)}")


def register_answer_pattern(task: str, pattern: str | re.Pattern[str]) -> None:
    """Make ``number_scope="answer"`` work for ``task``: only numbers inside ``pattern``'s
    matches are scored (it replaces the task's pattern). ``task`` need not have a generator
    (e.g. the name in the ``"task"`` field of a JSONL file's rows)."""
    _load_builtins()  # a built-in task's registration must not overwrite the pattern later
    old = _REGISTRY.get(task) or TaskSpec(task, None)
    _REGISTRY[task] = dataclasses.replace(old, answer_pattern=_compiled(pattern))


def check_dev_fraction(split: str, test_fraction: float, dev_fraction: float) -> None:
    """ValueError unless ``dev_fraction`` fits beside ``test_fraction`` (in [0, 1 −
    test_fraction)) and a "dev" split has one (> 0): the rule of the generated tasks whose
    train / dev / test splits come from a content hash (arithmetic, visual_math). Each fraction
    alone lies in its domain (:data:`TEST_FRACTION`, :data:`DEV_FRACTION`), checked before."""
    if not 0.0 <= dev_fraction < 1.0 - test_fraction:
        raise ValueError(
            f"dev_fraction must be in [0, 1 - test_fraction) = [0, {1.0 - test_fraction:g}), "
            f"got {dev_fraction}"
        )
    if split == "dev" and dev_fraction == 0.0:
        raise ValueError(
            "split='dev' needs dev_fraction > 0 (give the same dev_fraction to the train split)"
        )


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _generators() -> list[str]:
    return sorted(name for name, spec in _REGISTRY.items() if spec.generator is not None)


def _unknown_task(name: str) -> ValueError:
    return ValueError(f"unknown task {name!r}; available tasks: {', '.join(_generators())}")


def available_tasks() -> list[str]:
    """Names of all registered tasks (those with a generator)."""
    _load_builtins()
    return _generators()


def task_spec(name: str) -> TaskSpec:
    """The :class:`TaskSpec` registered under ``name`` (ValueError listing the known tasks)."""
    _load_builtins()
    if name not in _REGISTRY:
        raise _unknown_task(name)
    return _REGISTRY[name]


def task_specs() -> dict[str, TaskSpec]:
    """Every registered task's spec by name (a copy), generator-less ones included."""
    _load_builtins()
    return dict(_REGISTRY)


def answer_patterns() -> dict[str, re.Pattern[str]]:
    """The answer pattern of every task that has one, by task name."""
    return {n: s.answer_pattern for n, s in task_specs().items() if s.answer_pattern is not None}


def get_task(name: str) -> TaskFn:
    """The generator registered under ``name`` (ValueError listing the known names if absent)."""
    fn = task_spec(name).generator
    if fn is None:
        raise _unknown_task(name)
    return fn


#: The legal values of the two parameters every generator takes: ``n`` examples (at least one,
#: at most :data:`emdlm.domains.MAX_GENERATED`) and the ``seed`` of its random draws (one numpy
#: accepts).
GENERATION_DOMAINS: Mapping[str, Domain] = {"n": GENERATED_COUNT, "seed": SEED}


def check_task_call(
    name: str, *, n: Any, split: str = "train", seed: Any = 0, **params: Any
) -> None:
    """ValueError for anything :func:`generate_task` would refuse, found without generating
    anything: an unknown task, a split it lacks, ``n`` / ``seed`` outside
    :data:`GENERATION_DOMAINS`, a parameter name its generator does not take (with the nearest
    one it does), a value outside its domain. An experiment checks every cell's task sources
    with it before the first cell runs."""
    generator, spec = get_task(name), task_spec(name)
    if split not in spec.splits:
        raise ValueError(f"task {name!r} has splits {', '.join(spec.splits)}; got split={split!r}")
    check_task_params(name, GENERATION_DOMAINS, {"n": n, "seed": seed})
    signature = inspect.signature(generator)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    named = [key for key, p in signature.parameters.items()
             if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD]
    settable = [key for key in named if key not in GENERATION_DOMAINS and key != "split"]
    unknown = [] if takes_any else [key for key in params if key not in named]
    if unknown:
        words = ", ".join(f"{key!r}{did_you_mean(key, settable)}" for key in unknown)
        raise ValueError(f"bad parameters for task {name!r}: it takes no parameter {words} "
                         f"(its parameters: {', '.join(settable) or 'none'})")
    check_task_params(name, spec.domains, params)


def generate_task(
    name: str, *, n: int, split: str = "train", seed: int = 0, **params: Any
) -> list[dict[str, Any]]:
    """Generate ``n`` examples of task ``name`` for ``split`` ("train" or "test"; "dev" for
    tasks registered with it), every argument checked first (:func:`check_task_call`)."""
    check_task_call(name, n=n, split=split, seed=seed, **params)
    try:
        return get_task(name)(n, split=split, seed=seed, **params)
    except TypeError as err:  # a value of the wrong type deep inside: say which task
        raise ValueError(f"bad parameters for task {name!r}: {err}") from err


__all__ = [
    "DEV_FRACTION",
    "GENERATION_DOMAINS",
    "TEST_FRACTION",
    "TaskSpec",
    "answer_patterns",
    "available_tasks",
    "check_dev_fraction",
    "check_task_call",
    "check_task_params",
    "generate_task",
    "get_task",
    "register_answer_pattern",
    "register_task",
    "task_spec",
    "task_specs",
]
