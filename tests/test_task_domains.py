"""The task generators' numeric parameters are checked by the one mechanism of legal values,
:mod:`emdlm.domains`: each task declares a :class:`~emdlm.domains.Domain` per numeric parameter
(``register_task(domains=...)``, kept on its :class:`~emdlm.tasks.TaskSpec`), and the
registered generator refuses a value outside it before it writes anything, with the domains'
words: a bool is no number (``supersample=True`` is not 1), NaN and ±inf lie in no domain, an
integer parameter takes no 2.5.

The cases iterate the task registry and the generators' signatures, so a new task or parameter
is covered by being registered.
"""

from __future__ import annotations

import inspect
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from emdlm import tasks
from emdlm.domains import MAX_GENERATED
from emdlm.tasks import generate_task, get_task, task_specs

NUMBER_ANNOTATION = re.compile(r"\b(float|int)\b")
# checked by generate_task (tasks.GENERATION_DOMAINS; a task's narrower seed rule, if any, is
# its own: math_arithmetic's 0 .. 2**31 - 1)
NOT_PARAMETERS = {"n", "seed"}


def _generators() -> dict[str, Any]:
    return {name: spec for name, spec in task_specs().items() if spec.generator is not None}


def _numeric_parameters() -> list[tuple[str, str]]:
    """(task, parameter) of every float or int parameter of every registered generator, read
    from the signatures (not from the declared domains)."""
    found = []
    for name, spec in _generators().items():
        for param in inspect.signature(spec.generator).parameters.values():
            annotation = param.annotation
            text = annotation if isinstance(annotation, str) else inspect.formatannotation(
                annotation)
            if param.name not in NOT_PARAMETERS and NUMBER_ANNOTATION.search(text):
                found.append((name, param.name))
    return found


def _declared(integer: bool | None = None) -> list[tuple[str, str]]:
    """(task, parameter) of every declared domain (only integer or only real ones if asked)."""
    return [(name, key) for name, spec in _generators().items()
            for key, domain in spec.domains.items()
            if integer is None or domain.integer == integer]


def _refused(tmp_path: Path, task: str, param: str, value: Any) -> str:
    """The message of generating ``task`` with ``param=value`` (nothing may be written), less
    its ``"task '<name>': "`` (a generator registered under a second name, arithmetic__mixed,
    says its first)."""
    folder = tmp_path / "cache"
    with pytest.raises(ValueError) as err:
        generate_task(task, n=1, cache_dir=folder, **{param: value}) if _caches(task) else \
            generate_task(task, n=1, **{param: value})
    assert not folder.exists()
    prefix = re.match(r"task '\w+': ", str(err.value))
    assert prefix, str(err.value)
    return str(err.value)[prefix.end():]


def _caches(task: str) -> bool:
    return "cache_dir" in inspect.signature(get_task(task)).parameters


def test_every_numeric_parameter_of_every_task_has_a_domain() -> None:
    params = _numeric_parameters()
    assert ("clock", "supersample") in params and ("arithmetic", "test_fraction") in params
    missing = [p for p in params if p not in set(_declared())]
    assert not missing, f"task parameters without a declared domain: {missing}"


@pytest.mark.parametrize("task,param", _declared())
def test_each_default_lies_in_its_domain(task: str, param: str) -> None:
    spec = task_specs()[task]
    default = inspect.signature(spec.generator).parameters[param].default
    assert spec.domains[param].problem(default) is None, (task, param, default)


@pytest.mark.parametrize("task,param", _declared())
def test_a_bool_is_no_number(tmp_path: Path, task: str, param: str) -> None:
    message = _refused(tmp_path, task, param, True)
    domain = task_specs()[task].domains[param]
    assert message == f"{param} must be {domain.describe()}, got True"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("task,param", _declared(integer=False))
def test_nan_and_inf_lie_in_no_domain(tmp_path: Path, task: str, param: str, value: float) -> None:
    message = _refused(tmp_path, task, param, value)
    assert message.startswith(f"{param} must be a finite number"), message
    assert message.endswith(f"got {value!r}")


@pytest.mark.parametrize("task,param", _declared(integer=True))
def test_an_integer_parameter_takes_no_fraction(tmp_path: Path, task: str, param: str) -> None:
    message = _refused(tmp_path, task, param, 2.5)
    assert message.startswith(f"{param} must be an integer"), message


def test_the_words_are_the_domains() -> None:
    with pytest.raises(ValueError) as err:
        generate_task("clock", n=1, jitter=0.6, noise=-1.0)
    assert str(err.value) == ("task 'clock': jitter must be a finite number in [0, 0.5], got 0.6; "
                              "noise must be a finite number >= 0, got -1.0")


def test_a_direct_call_checks_too(tmp_path: Path) -> None:
    """The registered generator is the checked one: calling it outside generate_task checks."""
    from emdlm.tasks.clock import clock
    from emdlm.tasks.visual_math import visual_math

    with pytest.raises(ValueError, match=r"supersample must be an integer in \[1, 4\], got True"):
        clock(1, supersample=True, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"noise must be a finite number >= 0, got inf"):
        visual_math(1, noise=math.inf, cache_dir=tmp_path / "v")
    assert not any(tmp_path.iterdir())
    assert clock is get_task("clock")
    assert pickle.loads(pickle.dumps(clock)) is clock  # importable by name (worker processes)


def test_register_task_refuses_a_domain_of_no_parameter(monkeypatch) -> None:
    monkeypatch.setattr(tasks, "_REGISTRY", dict(task_specs()))
    from emdlm.domains import COUNT

    def _task(n: int, *, split: str = "train", seed: int = 0, width: int = 3) -> list[dict]:
        return [{"text": "x" * width}] * n

    with pytest.raises(ValueError, match="domains of parameters it does not take: widht"):
        tasks.register_task("_typo_task", domains={"widht": COUNT})(_task)
    checked = tasks.register_task("_checked_task", domains={"width": COUNT})(_task)
    assert inspect.signature(checked) == inspect.signature(_task)
    assert generate_task("_checked_task", n=2, width=2) == [{"text": "xx"}] * 2
    with pytest.raises(ValueError, match=r"task '_checked_task': width must be an integer >= 1"):
        checked(1, width=0)
    tasks.register_task("_checked_task", domains={"width": COUNT})(_task)  # the same: no error
    tasks.register_task("_second_name")(checked)  # a second name keeps the domains and the check
    assert task_specs()["_second_name"].domains == {"width": COUNT}
    assert get_task("_second_name") is checked


def test_a_parameter_given_by_position_is_checked_too(monkeypatch) -> None:
    """A user task whose numeric parameter may be given by position: bound to its name and
    checked as a keyword is (before, only keywords were seen)."""
    monkeypatch.setattr(tasks, "_REGISTRY", dict(task_specs()))
    from emdlm.domains import COUNT

    def _task(n: int, width: int = 3, *, split: str = "train", seed: int = 0) -> list[dict]:
        return [{"text": "x" * width}] * n

    checked = tasks.register_task("_positional_task", domains={"width": COUNT})(_task)
    assert checked(2, 2) == [{"text": "xx"}] * 2
    with pytest.raises(ValueError, match=r"task '_positional_task': width must be an integer"):
        checked(1, 0)


@pytest.mark.parametrize("value", [True, 0, -1, 2.5, math.nan, "3", MAX_GENERATED + 1, 10**12],
                         ids=repr)
@pytest.mark.parametrize("task", sorted(_generators()))
def test_generate_task_checks_n(tmp_path: Path, task: str, value: Any) -> None:
    """``n`` (every generator's count) is checked by generate_task with the domains' words: a
    bool is no count (``n=True`` made one example), 2.5 none either; a count past
    MAX_GENERATED (10**12 once ended in numpy's MemoryError after a long wait) is refused
    before anything is generated."""
    with pytest.raises(ValueError) as err:
        generate_task(task, n=value, cache_dir=tmp_path / "c") if _caches(task) else \
            generate_task(task, n=value)
    assert str(err.value) == (f"task {task!r}: n must be an integer in [1, {MAX_GENERATED}], "
                              f"got {value!r}")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("value", [True, -1, 2**32, 2.0, "a"], ids=repr)
@pytest.mark.parametrize("task", sorted(_generators()))
def test_generate_task_checks_the_seed(tmp_path: Path, task: str, value: Any) -> None:
    """``seed`` must be one numpy accepts (0 .. 2**32 - 1), as the run config's seeds."""
    with pytest.raises(ValueError) as err:
        generate_task(task, n=1, seed=value, cache_dir=tmp_path / "c") if _caches(task) else \
            generate_task(task, n=1, seed=value)
    assert str(err.value) == (f"task {task!r}: seed must be an integer in [0, 4294967295], "
                              f"got {value!r}")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("task", sorted(_generators()))
def test_an_unknown_parameter_name_is_named_with_the_nearest(tmp_path: Path, task: str) -> None:
    """A misspelt parameter is refused by check_task_call, before anything is generated, with
    the nearest name the generator takes and the list of all of them."""
    from emdlm.tasks import check_task_call

    settable = [p for p in inspect.signature(get_task(task)).parameters
                if p not in {"n", "split", "seed"}]
    name = settable[0]
    typo = name[:-1] if len(name) > 2 else name + "x"
    with pytest.raises(ValueError) as err:
        check_task_call(task, n=1, **{typo: 1})
    assert str(err.value) == (
        f"bad parameters for task {task!r}: it takes no parameter {typo!r} (did you mean "
        f"{name!r}?) (its parameters: {', '.join(settable)})")
    with pytest.raises(ValueError, match=re.escape(f"it takes no parameter {typo!r}")):
        generate_task(task, n=1, cache_dir=tmp_path / "c", **{typo: 1}) if _caches(task) else \
            generate_task(task, n=1, **{typo: 1})
    assert not (tmp_path / "c").exists()
