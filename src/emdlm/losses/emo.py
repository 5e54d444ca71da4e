"""EMOLoss module and ``cost_embedding_from``: EMO (ICLR 2024, Eq. 14 and Eq. 19) as a loss.

The formulas, their sources and the official codes' behaviour are documented in
:mod:`emdlm.functional.emo` (the reference). This module stores the row-normalized cost
embedding once and picks an implementation: the chunked fast path
(:class:`emdlm.ops.objectives.emo.EMOObjective` run by
:func:`emdlm.ops.chunked.chunked_logits_loss`, tested equal to the reference) or the reference;
``from_hidden`` runs the same objective from hidden states
(:func:`emdlm.ops.chunked.chunked_linear_loss`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels_shapes,
    check_reduction,
)
from emdlm.functional.emo import EMOMode, check_emo_options, emo_loss, normalize_cost_embedding
from emdlm.losses.base import EMDLMLoss
from emdlm.ops._chunking import check_chunk_size

if TYPE_CHECKING:
    from emdlm.ops.objectives.emo import EMOObjective

Implementation = Literal["chunked", "reference"]

#: Positions per chunk of the chunked logits path when the module is given no ``chunk_size``.
LOGITS_CHUNK_SIZE = 1024


def cost_embedding_from(model: nn.Module) -> torch.Tensor:
    """A frozen float32 copy of a model's output embedding (its LM head weight) [V, d].

    EMO's cost uses the *pre-trained* head (DRSY/EMO clones ``lm_head.weight`` before
    training), so call this before fine-tuning: the copy does not follow later updates, even
    when the head is tied to the input embedding.
    """
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None:
        raise TypeError(
            f"{type(model).__name__} has no get_output_embeddings(); pass the cost embedding "
            "[V, d'] to EMOLoss directly"
        )
    head = getter()
    weight = getattr(head, "weight", head)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() returned {type(head).__name__}, "
            "not a module with a weight tensor"
        )
    return weight.detach().to(torch.float32, copy=True)


def check_implementation(implementation: str | None, chunk_size: int | None) -> None:
    """ValueError unless ``implementation`` is "chunked", "reference" or None (chosen per call)
    and ``chunk_size`` is a positive int or None (each path's default): the options of the
    chunked EMO modules."""
    if implementation not in (None, "chunked", "reference"):
        raise ValueError(
            f"implementation must be 'chunked', 'reference' or None, got {implementation!r}"
        )
    if chunk_size is not None:
        check_chunk_size(chunk_size)


class EMOLoss(EMDLMLoss):
    """EMO mixed with MLE: per token 0.5·(CE + sg(CE/DEMD)·DEMD) by default (EMO Eq. 19).

    DEMD_t = 1 - (Êᵀ q_t)·ê_{y_t}, with q_t = softmax(z_t) and Ê the row-normalized cost
    embedding (EMO Eq. 14); the cost between tokens is 1 - cos(e_i, e_j).

    Args:
        cost_embedding: E [V, d'] (any width; e.g. ``cost_embedding_from(model)``). Normalized
            once and kept as a non-persistent float32 buffer ``cost_embedding_normalized``.
        mode: "emo1" (Eq. 19, DRSY/EMO), "emo2" (emoloss mode 2: DEMD + sg(DEMD/CE)·CE) or
            "static" (CE + mu·DEMD).
        mu: DEMD weight for "static".
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens, or "sum" (for integrations that divide by a
            global token count).
        implementation: "chunked" (fast path, less memory) or "reference"; ``None`` picks
            "chunked" when the logits require grad and "reference" otherwise.
        chunk_size: the loss's one chunk setting, positions per chunk of both chunked paths
            (scratch: one [chunk_size, V] float32 buffer beyond the gradient buffer on logits,
            two from hidden states; one more for half precision); None (default): 1024 on
            logits (:data:`LOGITS_CHUNK_SIZE`), ``DEFAULT_CHUNK_ELEMENTS // V`` rows from hidden
            states (:mod:`emdlm.ops.chunked`: a scratch of fixed size whatever the vocabulary).
        max_ratio: cap on the emo1 ratio sg(CE/DEMD); 3.0 reproduces the ``emoloss`` package
            (v0.0.3); ``None`` (default) is the paper / DRSY/EMO (no cap).

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` with labels aligned to the logits
    (no shift inside). ``out.components``: "ce", "demd" (means over counted tokens), "n_tokens".

    Per-token ``loss_weights=`` w (both routes, :class:`~emdlm.losses.base.EMDLMLoss`):
    Σ_t w_t·L_t ("sum") or Σ_t w_t·L_t / Σ_t w_t ("mean") over the counted tokens, "ce" and
    "demd" the same weighted means, "n_tokens" = Σ_t w_t; the mix sg(CE_t/DEMD_t) is per token
    and computed as without weights (:class:`emdlm.ops.objectives.emo.EMOObjective`).

    Example:
        >>> loss_fn = EMOLoss.from_model(model)
        >>> logits = model(input_ids).logits
        >>> out = loss_fn(logits[:, :-1], input_ids[:, 1:])
        >>> out.loss.backward()

    Shape notation: B batch, T time, V vocabulary, d' cost-embedding width.
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)
    cost_embedding_normalized: torch.Tensor

    def __init__(
        self,
        cost_embedding: torch.Tensor,
        mode: EMOMode = "emo1",
        mu: float = 1.0,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        implementation: Implementation | None = None,
        chunk_size: int | None = None,
        max_ratio: float | None = None,
    ) -> None:
        super().__init__()
        check_emo_options(mode, mu, max_ratio)
        check_reduction(reduction)
        check_implementation(implementation, chunk_size)
        self.mode = mode
        self.mu = mu
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.max_ratio = max_ratio
        self.register_buffer(
            "cost_embedding_normalized", normalize_cost_embedding(cost_embedding), persistent=False
        )

    def logged_loss_note(self) -> str | None:
        if self.mode != "emo1":
            return None
        return ("EMO mode emo1: the logged loss equals ce in value (EMO Eq. 19: "
                "0.5*(CE + sg(CE/DEMD)*DEMD)); half of its gradient comes from DEMD, logged as "
                "demd (docs/objectives.md)")

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs: Any) -> EMOLoss:
        """Build the loss from a frozen copy of ``model``'s output embedding."""
        return cls(cost_embedding_from(model), **kwargs)

    def resolved_implementation(self, logits: torch.Tensor) -> Implementation:
        """The implementation ``forward`` will use for these logits."""
        if self.implementation is not None:
            return self.implementation
        if logits.requires_grad:
            return "chunked"
        return "reference"

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        if self.resolved_implementation(logits) == "chunked":
            # Lazy import: the engine is loaded on first use, not with emdlm.losses.
            from emdlm.ops.chunked import chunked_logits_loss
            from emdlm.ops.head import HeadOptions

            check_logits_labels_shapes(logits, labels)  # label range: in the engine's one sync
            objective, labels = self.chunk_objective(logits, labels)
            options = HeadOptions(
                ignore_index=self.ignore_index,
                reduction=self.reduction,
                chunk_size=self.chunk_size or LOGITS_CHUNK_SIZE,
            )
            return chunked_logits_loss(logits, labels, objective, options)
        return emo_loss(
            logits,
            labels,
            self.cost_embedding_normalized,
            mode=self.mode,
            mu=self.mu,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            max_ratio=self.max_ratio,
        )

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[EMOObjective, torch.Tensor]:
        """:class:`emdlm.ops.objectives.emo.EMOObjective` (EMO Eq. 14, 19 per chunk) for logits
        ``logits`` [..., V] (or ``from_hidden``'s stand-in): Ê checked against V and cast for
        the S matmul (:func:`emdlm.ops.objectives.emo.emo_cost`); the options were checked at
        construction."""
        from emdlm.ops.objectives.emo import EMOObjective, emo_cost

        cost = emo_cost(self.cost_embedding_normalized, logits, logits.shape[-1])
        return EMOObjective(cost, self.mode, self.mu, self.max_ratio), labels

    def from_hidden_chunk_rows(self, vocab: int) -> int:
        """The module's ``chunk_size``, else the engine's ``DEFAULT_CHUNK_ELEMENTS // V``."""
        return self.chunk_size or super().from_hidden_chunk_rows(vocab)

    def extra_repr(self) -> str:
        vocab, width = self.cost_embedding_normalized.shape
        return (
            f"mode={self.mode!r}, mu={self.mu}, vocab={vocab}, width={width}, "
            f"reduction={self.reduction!r}, implementation={self.implementation!r}"
        )


__all__ = ["EMOLoss", "cost_embedding_from"]
