"""DFTLoss module: dynamic fine-tuning, L_t = sg(q_t(y_t))·CE_t (arXiv:2508.05629, TRL's
``loss_type="dft"``).

Formula and TRL's normalisation: :mod:`emdlm.functional.dft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, check_reduction
from emdlm.functional.dft import dft_loss
from emdlm.losses.base import EMDLMLoss

if TYPE_CHECKING:
    from emdlm.ops.chunk_objective import ChunkObjective


class DFTLoss(EMDLMLoss):
    """DFT: sg(q_t(y_t))·CE_t per token, averaged over counted tokens (Wu et al. 2025).

    Equal to TRL 1.16's ``SFTTrainer`` loss with ``loss_type="dft"`` (tests/test_dft.py pins it
    against TRL's own ``compute_loss``).

    Args:
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens or "sum" (divide by a global token count, as TRL
            does with ``num_items_in_batch``).

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` (aligned labels, no shift inside).
    ``out.components``: "ce" (mean plain CE), "weight_mean" (mean sg(q_y)), "n_tokens".

    Example:
        >>> loss_fn = DFTLoss()
        >>> out = loss_fn(torch.zeros(1, 2, 4), torch.tensor([[1, -100]]))
        >>> round(float(out.loss), 4)  # q_y = 1/4, CE = log 4
        0.3466
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: Reduction = "mean") -> None:
        super().__init__()
        check_reduction(reduction)
        self.ignore_index = ignore_index
        self.reduction = reduction

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        return dft_loss(logits, labels, ignore_index=self.ignore_index, reduction=self.reduction)

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[ChunkObjective, torch.Tensor]:
        """A :class:`~emdlm.ops.objectives.ce.WeightedCEObjective` (weight local to each token)."""
        from emdlm.ops.objectives.ce import WeightedCEObjective, dft_weights

        return WeightedCEObjective(dft_weights()), labels

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


__all__ = ["DFTLoss"]
