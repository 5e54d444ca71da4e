"""MixCE: mixing forward and (approximate) reverse cross-entropy (reference implementation).

Source: Zhang et al., "MixCE: Training Autoregressive Language Models by Mixing Forward and
Reverse Cross-Entropies", ACL 2023; official code bloomberg/MixCE-acl2023 (gpt2.py).

Per token t, with q_t = exp(-CE_t) the model's probability of the gold token (no gradient):

    L_t = η·CE_t + (1 - η)·sg(q_t)·CE_t = (η + (1 - η)·sg(q_t))·CE_t

η = 1 is plain MLE. The paper picks η per dataset from {0, 0.01, 0.1, ..., 0.99, 1} by dev
MAUVE (released models: 0.1 wikitext, 0.3 webtext, 0.7 writingPrompts). Reduction: sum over
non-ignored tokens divided by their count (official: (loss * mask).sum() / (1e-15 + mask.sum())).

Shape notation: B batch, T time, V vocabulary, N = B*T positions.
"""

from __future__ import annotations

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    token_log_probs,
    token_weighted_ce_output,
)


def check_mixce_options(eta: float) -> None:
    """η must lie in [0, 1]."""
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta (MixCE mixing ratio) must lie in [0, 1], got {eta}")


def mixce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    eta: float,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> LossOutput:
    """MixCE loss (η + (1-η)·sg(q_y))·CE, averaged over counted tokens.

    Args:
        logits: z [B, T, V] (or [N, V]), any float dtype (computed in float32, float64 kept).
        labels: y [B, T] aligned with the logits; ``ignore_index`` positions are not scored.
        eta: mixing ratio η in [0, 1] (1 = MLE).
        reduction: "mean" over counted tokens or "sum".

    Returns:
        LossOutput with components "ce" (mean plain CE), "weight_mean" (mean detached multiplier
        η + (1-η)·q_y over counted tokens) and "n_tokens".
    """
    check_mixce_options(eta)
    check_logits_labels(logits, labels, ignore_index)
    tokens = token_log_probs(logits, labels, ignore_index)
    multiplier = eta + (1.0 - eta) * torch.exp(-tokens.ce.detach())  # η + (1-η)·sg(q_y): [N]
    return token_weighted_ce_output(tokens, multiplier * tokens.ce, multiplier, reduction)


__all__ = ["check_mixce_options", "mixce_loss"]
