"""TaiLrLoss module: TV-guided token weighting of MLE (TaiLr, ICLR 2023) and DRSY/EMO's variant.

Formulas and official-code behaviour: :mod:`emdlm.functional.tailr`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, check_reduction
from emdlm.functional.tailr import TaiLrPreset, check_tailr_options, tailr_loss
from emdlm.losses.base import EMDLMLoss

if TYPE_CHECKING:
    from emdlm.ops.chunk_objective import ChunkObjective


class TaiLrLoss(EMDLMLoss):
    """TaiLr: L_t = (1-ε)·clamp(sg(q_y/(γ + (1-γ)·q_y)), w_min, 1)·CE_t + ε/V·Σ_v -log q_t(v).

    ``preset="emo_repo"`` gives DRSY/EMO's "tvd" baseline instead:
    η·CE + (1-η)·clamp(sg(q_y/((1-η) + η·q_y)), w_min, 1)·CE, with η = ``mixing_ratio``.

    Args:
        gamma: γ of the TaiLr weight (official scripts: 1e-7); preset "paper".
        min_weight: lower clamp of the weight (official scripts and DRSY/EMO: 0.2).
        label_smoothing: ε, unweighted smoothing term (preset "paper").
        preset: "paper" (thu-coai/TaiLr) or "emo_repo" (DRSY/EMO).
        mixing_ratio: η, required by "emo_repo".
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens or "sum".

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` (aligned labels).
    ``out.components``: "ce", "weight_mean", "n_tokens".
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(
        self,
        gamma: float = 1e-7,
        min_weight: float = 0.2,
        label_smoothing: float = 0.0,
        preset: TaiLrPreset = "paper",
        mixing_ratio: float | None = None,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
    ) -> None:
        super().__init__()
        check_tailr_options(gamma, min_weight, label_smoothing, preset, mixing_ratio)
        check_reduction(reduction)
        self.gamma = gamma
        self.min_weight = min_weight
        self.label_smoothing = label_smoothing
        self.preset = preset
        self.mixing_ratio = mixing_ratio
        self.ignore_index = ignore_index
        self.reduction = reduction

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        return tailr_loss(
            logits,
            labels,
            gamma=self.gamma,
            min_weight=self.min_weight,
            label_smoothing=self.label_smoothing,
            preset=self.preset,
            mixing_ratio=self.mixing_ratio,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[ChunkObjective, torch.Tensor]:
        """A :class:`~emdlm.ops.objectives.ce.WeightedCEObjective` (weight local to each token)."""
        from emdlm.ops.objectives.ce import WeightedCEObjective, tailr_weights

        weights = tailr_weights(
            self.preset, self.gamma, self.min_weight, self.label_smoothing, self.mixing_ratio
        )
        return WeightedCEObjective(weights, self.label_smoothing), labels

    def extra_repr(self) -> str:
        if self.preset == "emo_repo":
            return f"preset='emo_repo', mixing_ratio={self.mixing_ratio}, w_min={self.min_weight}"
        return (
            f"preset='paper', gamma={self.gamma}, w_min={self.min_weight}, "
            f"label_smoothing={self.label_smoothing}"
        )


__all__ = ["TaiLrLoss"]
