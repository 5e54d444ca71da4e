"""The tests' one table of objectives (tests/_objectives.py) against the registry.

Every registered objective has an entry, and what the entry declares is what the library says:
the test files that run a check over every objective take their list from that table. The
library's registry (emdlm.objective_specs) declares each objective's settable parameters as
data; they are pinned here to the class signature, and every other table of objectives to it.
"""

from __future__ import annotations

from typing import Any

import pytest

from _objectives import PATHS, SPECS, random_cost_embedding
from emdlm import config
from emdlm.losses.base import EMDLMLoss
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.objectives import (
    _CLASSES,
    COST_EMBEDDING,
    DISTILL,
    NUMERIC,
    objective_class,
    settable_parameters,
)


def test_every_registered_objective_has_a_spec() -> None:
    """A new objective in ``emdlm.objectives._CLASSES`` needs its entry in tests/_objectives.py
    (and with it, the cases of every file that runs a check over every objective)."""
    assert set(SPECS) == set(_CLASSES)


def test_every_table_of_objectives_is_the_registrys() -> None:
    """config.py and objectives.py keep no list of their own: theirs is the registry's."""
    names = tuple(OBJECTIVE_SPECS)
    assert names == config.OBJECTIVES == tuple(_CLASSES)
    teacher = tuple(n for n in names if OBJECTIVE_SPECS[n].teacher)
    assert teacher == config.DISTILL_OBJECTIVES == DISTILL
    numeric = tuple(n for n in names if OBJECTIVE_SPECS[n].numeric)
    assert numeric == config.NUMERIC_OBJECTIVES == NUMERIC
    cost = tuple(n for n in names if OBJECTIVE_SPECS[n].cost_embedding)
    assert cost == COST_EMBEDDING


@pytest.mark.parametrize("name", list(OBJECTIVE_SPECS))
def test_declared_params_are_the_class_signatures(name: str) -> None:
    """The registry's ``params`` (what config.py may rely on without importing the class) are
    exactly the keyword arguments the factory lets ``objective.params`` set, in order."""
    spec = OBJECTIVE_SPECS[name]
    cls = objective_class(name)
    assert spec.name == name and f"{cls.__module__}.{cls.__name__}" == spec.path
    assert spec.params == tuple(settable_parameters(name, cls))
    assert spec.summary and "\n" not in spec.summary
    assert spec.numeric == bool(getattr(cls, "takes_number_mask", False))
    assert spec.teacher == bool(getattr(cls, "needs_teacher", False))


@pytest.mark.parametrize("name", list(SPECS))
def test_declared_needs_are_the_librarys(name: str) -> None:
    spec = SPECS[name]
    assert spec.name == name
    assert spec.needs_digits == (name in NUMERIC)
    assert spec.needs_cost_embedding == (name in COST_EMBEDDING)
    assert spec.needs_teacher == (name in DISTILL)
    # the class declares its needs (emdlm.losses.base.EMDLMLoss): nothing is probed
    assert issubclass(spec.cls, EMDLMLoss)
    assert spec.needs_teacher == spec.cls.needs_teacher
    assert spec.needs_digits == spec.cls.takes_number_mask
    assert spec.from_hidden == spec.cls.has_from_hidden
    # a declared from-hidden path is the base's one from_hidden on the class's own chunk
    # objective; a class without one gets the refusal by name. A chunk objective also runs
    # the weighted logits route, so a class may have one without a from-hidden path
    # (emo_distill), and every class that takes loss weights has one.
    own_chunks = spec.cls.chunk_objective is not EMDLMLoss.chunk_objective
    assert own_chunks or not spec.from_hidden
    assert own_chunks or not spec.cls.takes_loss_weights
    assert spec.from_hidden == (spec.cls.from_hidden is EMDLMLoss.from_hidden)
    assert spec.paths, "at least one implementation path"
    assert spec.reference is None or spec.reference in spec.paths


@pytest.mark.parametrize(("name", "path"), PATHS)
def test_every_path_builds_the_registered_class(
    char_tokenizer: Any, name: str, path: str
) -> None:
    spec = SPECS[name]
    vocab = len(char_tokenizer)
    emb = random_cost_embedding(vocab, 4, seed=0)
    module = spec.build(path, digits=char_tokenizer, cost_embedding=emb, reduction="sum")
    assert type(module) is spec.cls
    assert module.reduction == "sum"
    wrapped = spec.build(path, digits=char_tokenizer, cost_embedding=emb, fixed_teacher=True)
    assert (type(wrapped) is not spec.cls) == spec.needs_teacher


def test_a_misspelt_objective_name_gets_the_nearest_one() -> None:
    from emdlm.objectives import objective_class

    with pytest.raises(config.ConfigError, match=r"'ntill' \(did you mean 'ntil'\?\)"):
        objective_class("ntill")
    with pytest.raises(config.ConfigError, match=r"got 'ntill' \(did you mean 'ntil'\?\)"):
        config.load_config("arithmetic_ntil", ["objective.name=ntill"])
