"""Distillation losses: EMO's generalized DEMD to a teacher (EMO Eq. 15) and the CE + KL baseline.

Both are called as ``loss_fn(logits, labels, teacher_logits=u)`` with labels and teacher logits
aligned to the student logits (no shift inside) and carry ``needs_teacher = True``: the
``transformers`` integration (:class:`emdlm.integrations.transformers.ComputeLoss`) then passes
the teacher's logits, computed on the same inputs (``emdlm_trainer(..., teacher=...)`` there).
Formulas and sources: :mod:`emdlm.functional.emo_dense`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels_shapes,
    check_reduction,
)
from emdlm.functional.emo import EMOMode, normalize_cost_embedding
from emdlm.functional.emo_dense import (
    DistillBase,
    check_distill_options,
    check_teacher_logits,
    emo_distill_loss,
    kl_distill_loss,
)
from emdlm.losses.base import EMDLMLoss
from emdlm.losses.emo import Implementation, check_implementation, cost_embedding_from


class EMODistillLoss(EMDLMLoss):
    """EMO distillation: per token B + mu·DEMD by default, DEMD = |q - p|ᵀ C p (EMO Eq. 15).

    q = softmax(student logits), p = softmax(teacher logits / temperature), C = 1 - Ê Êᵀ with Ê
    the row-normalized cost embedding; B = KL(p ‖ q) ("kl", default), the gold CE ("ce") or 0
    ("none"). ``mode`` "emo1" / "emo2" mix B and DEMD with EMO's dynamic weights (Eq. 19 / the
    emoloss package's mode 2) instead of the static B + mu·DEMD.

    Args:
        cost_embedding: E [V, d'] (e.g. ``cost_embedding_from(teacher)``); normalized once.
        base: "kl", "ce" or "none"; mode: "static", "emo1" or "emo2"; mu: DEMD weight of
            "static"; temperature: τ of the teacher's softmax (the student is not softened);
            max_ratio: cap of emo1's ratio.
        ignore_index, reduction: as every emdlm loss ("sum" for the Trainer integration).
        implementation: "chunked" (:class:`emdlm.ops.objectives.emo_distill.EMODistillObjective`
            run by :func:`emdlm.ops.chunked.chunked_logits_loss`, O(chunk·V) scratch),
            "reference" (plain autograd) or None ("chunked" when the logits require grad).
        chunk_size: the loss's one chunk setting, positions per chunk of the chunked path
            (default 512: its scratch is about six [chunk_size, V] float32 tensors).

    The options are checked here, where the loss is built (the objective does not check them
    again). Call: ``out = loss_fn(logits [B, T, V], labels [B, T], teacher_logits=u [B, T, V])``;
    ``out.components``: "base", "demd" (means over scored tokens), "n_tokens". Per-token
    ``loss_weights=`` w (logits route; always the chunked objective): Σ_t w_t·L_t ("sum") or
    Σ_t w_t·L_t / Σ_t w_t ("mean"), "base" / "demd" the same weighted means, "n_tokens" Σ_t w_t,
    the emo1 / emo2 mix per token as without weights.

    Example:
        >>> loss_fn = EMODistillLoss(cost_embedding_from(teacher), reduction="mean")
        >>> with torch.no_grad():
        ...     t = teacher(input_ids).logits
        >>> out = loss_fn(student(input_ids).logits[:, :-1], input_ids[:, 1:], t[:, :-1])
    """

    needs_teacher = True
    has_from_hidden = False
    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)
    cost_embedding_normalized: torch.Tensor

    def __init__(
        self,
        cost_embedding: torch.Tensor,
        base: DistillBase = "kl",
        mode: EMOMode = "static",
        mu: float = 1.0,
        temperature: float = 1.0,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        implementation: Implementation | None = None,
        chunk_size: int = 512,
        max_ratio: float | None = None,
    ) -> None:
        super().__init__()
        check_distill_options(base, mode, mu, max_ratio, temperature)
        check_reduction(reduction)
        check_implementation(implementation, chunk_size)
        self.base = base
        self.mode = mode
        self.mu = mu
        self.temperature = float(temperature)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.max_ratio = max_ratio
        self.register_buffer(
            "cost_embedding_normalized", normalize_cost_embedding(cost_embedding), persistent=False
        )

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs: Any) -> EMODistillLoss:
        """Build the loss from a frozen copy of ``model``'s output embedding (e.g. the
        teacher's)."""
        return cls(cost_embedding_from(model), **kwargs)

    def logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, *, teacher_logits: torch.Tensor
    ) -> LossOutput:
        cost = self.cost_embedding_normalized
        impl = self.implementation or ("chunked" if logits.requires_grad else "reference")
        if impl == "chunked":
            from emdlm.ops.chunked import HeadOptions, chunked_logits_loss

            objective, labels = self.chunk_objective(logits, labels, teacher_logits=teacher_logits)
            options = HeadOptions(
                ignore_index=self.ignore_index,
                reduction=self.reduction,
                chunk_size=self.chunk_size,
            )
            return chunked_logits_loss(logits, labels, objective, options)
        return emo_distill_loss(
            logits, teacher_logits, labels, cost, base=self.base, mode=self.mode, mu=self.mu,
            temperature=self.temperature, ignore_index=self.ignore_index,
            reduction=self.reduction, max_ratio=self.max_ratio,
        )  # fmt: skip

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor, *, teacher_logits: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        """:class:`emdlm.ops.objectives.emo_distill.EMODistillObjective` for ``logits``
        [..., V] and the teacher's (shape checks only: the label range is read in the engine's
        one host sync); the chunked logits path and the weighted one run it."""
        from emdlm.ops.objectives.emo import emo_cost
        from emdlm.ops.objectives.emo_distill import EMODistillObjective

        check_logits_labels_shapes(logits, labels)
        check_teacher_logits(logits, teacher_logits)
        opts = {
            "base": self.base, "mode": self.mode, "mu": self.mu,
            "temperature": self.temperature, "max_ratio": self.max_ratio,
        }  # fmt: skip
        cost = emo_cost(self.cost_embedding_normalized, logits, logits.shape[-1])
        return EMODistillObjective(teacher_logits, cost, opts), labels

    def from_hidden_chunk_rows(self, vocab: int) -> int:
        """The module's ``chunk_size`` (the weighted logits route's chunks too)."""
        return self.chunk_size

    def extra_repr(self) -> str:
        vocab, width = self.cost_embedding_normalized.shape
        return (
            f"base={self.base!r}, mode={self.mode!r}, mu={self.mu}, "
            f"temperature={self.temperature}, vocab={vocab}, width={width}, "
            f"reduction={self.reduction!r}"
        )


class KLDistillLoss(EMDLMLoss):
    """The usual distillation baseline: per token (1 - alpha)·CE(y) + alpha·τ²·KL(p_τ ‖ q_τ).

    Hinton, Vinyals & Dean 2015 (Sec. 2): teacher and student both softened by τ, the KL scaled
    by τ². Plain autograd (:func:`emdlm.functional.emo_dense.kl_distill_loss`). Called as
    ``loss_fn(logits, labels, teacher_logits=u)``; components "ce", "kl", "n_tokens".

    Per-token ``loss_weights=`` w (logits route: the chunk objective
    :class:`emdlm.ops.objectives.emo_distill.KLDistillObjective`, run by
    :meth:`EMDLMLoss.weighted_logits_loss`): Σ_t w_t·L_t ("sum") or Σ_t w_t·L_t / Σ_t w_t
    ("mean", 0 when Σ w = 0), "ce" / "kl" the same weighted means, "n_tokens" Σ_t w_t. No
    from-hidden path (``has_from_hidden = False``, as EMO distillation): the teacher's target
    is its [N, V] logits. ``chunk_size``: positions per chunk of that weighted route (None: the
    engine's default for the vocabulary).
    """

    needs_teacher = True
    has_from_hidden = False
    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(
        self,
        alpha: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        # α, τ and chunk_size: their registry domains, checked in EMDLMLoss.__new__
        check_reduction(reduction)
        self.alpha = float(alpha)
        self.temperature = float(temperature)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_size = chunk_size

    def logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, *, teacher_logits: torch.Tensor
    ) -> LossOutput:
        return kl_distill_loss(
            logits, teacher_logits, labels, alpha=self.alpha, temperature=self.temperature,
            ignore_index=self.ignore_index, reduction=self.reduction,
        )  # fmt: skip

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor, *, teacher_logits: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        """:class:`emdlm.ops.objectives.emo_distill.KLDistillObjective` for ``logits`` [..., V]
        and the teacher's (shape checks only: the label range is read in the engine's one
        host sync); the weighted logits route runs it."""
        from emdlm.ops.objectives.emo_distill import KLDistillObjective

        check_logits_labels_shapes(logits, labels)
        check_teacher_logits(logits, teacher_logits)
        return KLDistillObjective(teacher_logits, self.alpha, self.temperature), labels

    def from_hidden_chunk_rows(self, vocab: int) -> int:
        """Positions per chunk of the weighted logits route: ``chunk_size``, else the engine's
        default for a ``vocab``-token vocabulary (scratch: about six [chunk, V] float32
        tensors)."""
        return self.chunk_size or super().from_hidden_chunk_rows(vocab)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, temperature={self.temperature}, reduction={self.reduction!r}"


__all__ = ["EMODistillLoss", "KLDistillLoss"]
