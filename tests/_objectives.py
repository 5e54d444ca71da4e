"""Every registered objective, once, for the tests: what it needs, how to build it, and its
implementation paths and presets.

``SPECS`` names each objective of the registry (``emdlm.objective_specs``);
tests/test_objective_registry.py fails when an objective is registered without an entry here,
or when what an entry declares (digits, cost embedding, teacher, from-hidden path) is not what
the library says. The test files that run a check over every objective take their list from
``SPECS`` (and ``PATHS``), so a new objective cannot slip past them.

Build with ``SPECS[name].build(path, digits=..., cost_embedding=..., **options)``: the
registered class, given the number vocabulary or the cost embedding when it needs one (callers
may pass both for every objective; what an objective does not need is not passed), the keyword
arguments of ``path`` (None: the class defaults, the path training takes), then ``options``
(which win). ``fixed_teacher=True`` wraps a distillation objective so that it is called as
``fn(logits, labels)`` with fixed random teacher logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from emdlm.objectives import objective_class


class FixedTeacher(nn.Module):
    """A distillation loss called as ``fn(logits, labels)``: fixed random teacher logits of the
    logits' shape and dtype (the same on every call, clean at every position)."""

    def __init__(self, inner: nn.Module, seed: int = 5) -> None:
        super().__init__()
        self.inner = inner
        self.seed = seed
        self.reduction = inner.reduction

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> Any:
        gen = torch.Generator().manual_seed(self.seed)
        teacher = torch.randn(logits.shape, generator=gen).to(logits.dtype)
        return self.inner(logits, labels, teacher_logits=teacher)


def random_cost_embedding(vocab: int, width: int, seed: int) -> torch.Tensor:
    """A random cost embedding [vocab, width] (EMO, EMO distillation), the same for a seed."""
    return torch.randn(vocab, width, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective, as the tests see it.

    paths: implementation path / preset name -> constructor keyword arguments; the edge-input
        tests run every one (tests/test_padding_and_edge_inputs.py).
    reference: the path of the functional / plain-autograd implementation the fast path is
        tested against; None where the objective has one implementation.
    needs_digits: built from a tokenizer with digit tokens '0'..'9' or a ``NumberVocab``.
    needs_cost_embedding: built from a cost embedding [V, d].
    needs_teacher: called as ``fn(logits, labels, teacher_logits=u)``.
    from_hidden: has ``from_hidden(hidden, weight, labels, ...)`` (the fused-linear path).
    draws_noise: draws random noise by default (NTIL's Gumbel values): a test that calls it
        twice and compares passes a freshly seeded ``generator=`` to each build.
    """

    name: str
    paths: Mapping[str, Mapping[str, Any]]
    reference: str | None = None
    needs_digits: bool = False
    needs_cost_embedding: bool = False
    needs_teacher: bool = False
    from_hidden: bool = True
    draws_noise: bool = False

    @property
    def cls(self) -> type[nn.Module]:
        """The registered loss class."""
        return objective_class(self.name)

    def build(
        self,
        path: str | None = None,
        *,
        digits: Any = None,
        cost_embedding: torch.Tensor | None = None,
        fixed_teacher: bool = False,
        **options: Any,
    ) -> nn.Module:
        """The objective on ``path`` (None: the class defaults) with ``options`` on top; see
        the module docstring."""
        kwargs = {**(self.paths[path] if path is not None else {}), **options}
        args: list[Any] = []
        if self.needs_digits:
            if digits is None:
                raise TypeError(f"{self.name}: pass digits= (a tokenizer or a NumberVocab)")
            args.append(digits)
        if self.needs_cost_embedding:
            if cost_embedding is None:
                raise TypeError(f"{self.name}: pass cost_embedding= (a [V, d] tensor)")
            args.append(cost_embedding)
        module = self.cls(*args, **kwargs)
        if fixed_teacher and self.needs_teacher:
            return FixedTeacher(module)
        return module


SPECS: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            "ce",
            {
                "default": {},
                "smoothing-zloss-accuracy": {
                    "label_smoothing": 0.1, "z_loss": 1e-3, "token_accuracy": True,
                    "entropy": True,
                },
            },
        ),
        ObjectiveSpec(
            "emd",
            {"fused": {"implementation": "fused"}, "reference": {"implementation": "reference"}},
            reference="reference",
            needs_digits=True,
        ),
        ObjectiveSpec(
            "ntil",
            {
                "fused": {"implementation": "fused"},
                "reference": {"implementation": "reference"},
                "fused-official": {"preset": "official", "implementation": "fused"},
            },
            reference="reference",
            needs_digits=True,
            draws_noise=True,
        ),
        ObjectiveSpec(
            "emo",
            {
                "chunked": {"implementation": "chunked"},
                "reference": {"implementation": "reference"},
                "chunked-emo2": {"mode": "emo2", "implementation": "chunked", "chunk_size": 5},
            },
            reference="reference",
            needs_cost_embedding=True,
        ),
        ObjectiveSpec(
            "tailr",
            {
                "paper": {"label_smoothing": 0.1},
                "emo_repo": {"preset": "emo_repo", "mixing_ratio": 0.5},
            },
        ),
        ObjectiveSpec("mixce", {"default": {}}),
        ObjectiveSpec("dft", {"default": {}}),
        ObjectiveSpec(
            "ntl_mse",
            {
                "classes": {},
                "ntloss-l1": {"preset": "ntloss", "loss": "l1"},
                "huber-token-no-reweigh": {"loss": "huber", "averaging": "token", "reweigh": False},
            },
            needs_digits=True,
        ),
        ObjectiveSpec(
            "ntl_was",
            {
                "classes": {},
                "ntloss-no-reweigh": {"preset": "ntloss", "reweigh": False},
                "token": {"averaging": "token"},
            },
            needs_digits=True,
        ),
        ObjectiveSpec(
            "number_level",
            {
                "classes": {},
                "ntloss-float": {"preset": "ntloss", "float_level": True},
                "token-no-reweigh": {"averaging": "token", "reweigh": False},
            },
            needs_digits=True,
        ),
        ObjectiveSpec(
            "emo_distill",
            {
                "chunked": {"implementation": "chunked", "chunk_size": 5},
                "reference": {"implementation": "reference"},
                # implementation None: chunked, as the logits require grad
                "chunked-ce-emo1": {"base": "ce", "mode": "emo1", "temperature": 2.0},
            },
            reference="reference",
            needs_cost_embedding=True,
            needs_teacher=True,
            from_hidden=False,  # the target is the teacher's [N, V] logits
        ),
        ObjectiveSpec(
            "kl_distill",
            {"default": {"temperature": 2.0}},
            needs_teacher=True,
            from_hidden=False,
        ),
    )
}

#: (objective, path) for every path of every objective, in registry order.
PATHS: list[tuple[str, str]] = [(name, path) for name, spec in SPECS.items() for path in spec.paths]
