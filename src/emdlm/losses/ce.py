"""Plain cross-entropy with the emdlm loss interface (the MLE / CE baseline)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_reduction,
    compute_dtype,
    log_softmax_zero_ignored,
)
from emdlm.losses._from_hidden import TokenWeightedFromHidden
from emdlm.losses.base import EMDLMLoss


class CrossEntropyLoss(TokenWeightedFromHidden, EMDLMLoss):
    """Token-level cross-entropy, CE_t = -log softmax(z_t)[y_t], computed in float32.

    float64 logits are computed and returned in float64, as every other emdlm loss does
    (:func:`emdlm.functional._common.compute_dtype`). Ignored positions get an exact zero
    gradient even when their logits are NaN or infinite (padding never leaks).

    Args:
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens, or "sum" (for integrations that divide by a
            global token count, e.g. transformers' ``num_items_in_batch``).

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` with labels aligned to the logits
    (no shift inside). ``out.components``: "ce" (mean CE over counted tokens), "n_tokens".
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: Reduction = "mean") -> None:
        super().__init__()
        check_reduction(reduction)
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        check_logits_labels(logits, labels, self.ignore_index)
        flat_logits = logits.reshape(-1, logits.shape[-1]).to(compute_dtype(logits.dtype))
        flat_labels = labels.reshape(-1).long()  # [N]
        valid = flat_labels != self.ignore_index  # [N]
        log_q = log_softmax_zero_ignored(flat_logits, valid)  # [N, V]
        # F.cross_entropy is exactly nll_loss(log_softmax); ours zeroes ignored rows' gradient.
        total = F.nll_loss(log_q, flat_labels, ignore_index=self.ignore_index, reduction="sum")
        count = valid.sum()
        mean = total / count.clamp_min(1)
        loss = total if self.reduction == "sum" else mean
        return LossOutput(loss=loss, components={"ce": mean.detach(), "n_tokens": count})

    def hidden_objective(self) -> Any:
        from emdlm.ops.from_hidden import WeightedCEObjective

        return WeightedCEObjective()
