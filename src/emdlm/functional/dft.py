"""DFT, dynamic fine-tuning: CE weighted by the model's own gold probability (reference).

Source: Wu et al., "On the Generalization of SFT: A Reinforcement Learning Perspective with
Reward Rectification", 2025 (arXiv:2508.05629); TRL 1.16 ``SFTTrainer.compute_loss``
with ``loss_type="dft"`` (trl/trainer/sft_trainer.py).

Per counted token t, with q_t(y_t) = exp(-CE_t) the model's probability of the gold token:

    L_t = sg(q_t(y_t)) · CE_t

TRL: ``per_token_loss = -log_probs * log_probs.exp().detach()``, summed over the counted tokens
and divided by their count clamped to ≥ 1 (or by ``num_items_in_batch``, the token count of the
accumulated batch: emdlm's ``reduction="sum"`` divided by the integration). Gradient:
dL_t/dz_t = q_y · (q_t − onehot(y_t)).

Shape notation: B batch, T time, V vocabulary, N = B*T positions.
"""

from __future__ import annotations

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_reduction,
    token_log_probs,
    token_weighted_ce_output,
)


def dft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> LossOutput:
    """DFT loss Σ_t sg(q_t(y_t))·CE_t over counted tokens, divided by their count for "mean".

    Args:
        logits: z [B, T, V] (or [N, V]), any float dtype (computed in float32, float64 kept).
        labels: y [B, T] aligned with the logits; ``ignore_index`` positions are not scored.
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens (TRL's loss without ``num_items_in_batch``) or
            "sum".

    Returns:
        LossOutput with components "ce" (mean plain CE), "weight_mean" (mean sg(q_y) over
        counted tokens) and "n_tokens". With every label ignored the loss is an explicit 0.
    """
    check_reduction(reduction)
    check_logits_labels(logits, labels, ignore_index)
    tokens = token_log_probs(logits, labels, ignore_index)
    ce = tokens.ce  # [N]
    weight = torch.where(tokens.valid, torch.exp(-ce.detach()), ce.new_zeros(()))  # sg(q_y): [N]
    return token_weighted_ce_output(tokens, weight * ce, weight, reduction)


__all__ = ["dft_loss"]
