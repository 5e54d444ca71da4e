"""``from_hidden`` for the objectives whose per-token weight depends only on the token itself
(CE, TaiLr, MixCE): one method, each loss says which chunk objective it is."""

from __future__ import annotations

from typing import Any

import torch

from emdlm._output import LossOutput


class TokenWeightedFromHidden:
    """Mixin: ``loss_fn.from_hidden(hidden, lm_head_weight, labels, lm_head_bias=None)``.

    The class provides ``ignore_index``, ``reduction`` and :meth:`hidden_objective`, the
    :class:`emdlm.ops.from_hidden.WeightedCEObjective` of its per-token weight.
    """

    ignore_index: int
    reduction: str

    def hidden_objective(self) -> Any:
        """The chunk objective of :func:`emdlm.ops.from_hidden.loss_from_hidden`."""
        raise NotImplementedError

    def from_hidden(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        labels: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
        *,
        logit_scale: float | None = None,
        softcap: float | None = None,
        chunk_size: int | None = None,
    ) -> LossOutput:
        """The same loss from hidden states, never materializing the [N, V] logits.

        The per-token weight (1 for CE; TaiLr's and MixCE's functions of the token's own q_y)
        is local to each token, so each chunk of rows is scored on its own by
        :func:`emdlm.ops.chunked.chunked_linear_loss`; value and gradients (hidden, weight,
        bias) equal those of ``self(hidden @ W.T + b, labels)``.

        Args:
            hidden: [..., H] final hidden states, aligned with ``labels`` (no shift inside).
            lm_head_weight: [V, H] output embedding, same dtype as ``hidden``.
            labels: [...] integer labels.
            lm_head_bias: optional [V] head bias.
            logit_scale: s, logits s·(hWᵀ + b) (model families with a logit scale).
            softcap: cap, logits cap·tanh(z/cap) (Gemma-2's final logit soft-capping).
            chunk_size: rows per chunk (default: 2^26 / V rows, :mod:`emdlm.ops.chunked`).
        """
        from emdlm.ops.from_hidden import loss_from_hidden

        return loss_from_hidden(
            self.hidden_objective(),
            hidden,
            lm_head_weight,
            labels,
            lm_head_bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            chunk_size=chunk_size,
            logit_scale=logit_scale,
            softcap=softcap,
        )
