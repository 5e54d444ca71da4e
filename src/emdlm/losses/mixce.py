"""MixCELoss module: MixCE (ACL 2023), L_t = (η + (1-η)·sg(q_y))·CE_t.

Formula and official-code behaviour: :mod:`emdlm.functional.mixce`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, check_reduction
from emdlm.functional.mixce import check_mixce_options, mixce_loss
from emdlm.losses.base import EMDLMLoss

if TYPE_CHECKING:
    from emdlm.ops.chunk_objective import ChunkObjective


class MixCELoss(EMDLMLoss):
    """MixCE: (η + (1-η)·sg(q_y))·CE per token, averaged over counted tokens.

    Args:
        eta: mixing ratio η in [0, 1]; 1 is MLE. The paper tunes it per dataset (released
            models: 0.1 wikitext, 0.3 webtext, 0.7 writingPrompts); default 0.3.
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens or "sum".

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` (aligned labels).
    ``out.components``: "ce", "weight_mean", "n_tokens".
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(
        self, eta: float = 0.3, ignore_index: int = IGNORE_INDEX, reduction: Reduction = "mean"
    ) -> None:
        super().__init__()
        check_mixce_options(eta)
        check_reduction(reduction)
        self.eta = eta
        self.ignore_index = ignore_index
        self.reduction = reduction

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        return mixce_loss(
            logits, labels, eta=self.eta, ignore_index=self.ignore_index, reduction=self.reduction
        )

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[ChunkObjective, torch.Tensor]:
        """A :class:`~emdlm.ops.objectives.ce.WeightedCEObjective` (weight local to each token)."""
        from emdlm.ops.objectives.ce import WeightedCEObjective, mixce_weights

        return WeightedCEObjective(mixce_weights(self.eta)), labels

    def extra_repr(self) -> str:
        return f"eta={self.eta}, reduction={self.reduction!r}"


__all__ = ["MixCELoss"]
