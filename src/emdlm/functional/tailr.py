"""TaiLr: total-variation-guided token weighting of MLE (reference implementation).

Source: Ji et al., "Tailoring Language Generation Models under Total Variation Distance",
ICLR 2023; official code thu-coai/TaiLr (fairseq/criterions/tailr.py, examples/*/train_tailr.sh).

Per token t with model probability of the gold token q_t = exp(-CE_t) (taken from the model's
own softmax, no gradient):

* ``preset="paper"`` (TaiLr official criterion):
      w_t = clamp(sg(q_t / (γ + (1 - γ)·q_t)), w_min, 1)
      L_t = (1 - ε)·w_t·CE_t + (ε / V)·Σ_v (-log q_t(v))
  The label-smoothing term is unweighted and the weighted NLL is scaled by (1 - ε), exactly as
  in the official criterion (which differs from fairseq's usual (1 - ε - ε/V) factor). Their
  scripts for open-ended generation and the synthetic task use γ = 1e-7, w_min = 0.2, ε = 0.
  (The criterion's own CLI defaults, γ = 1 and w_min = 0, would make w = q.)

* ``preset="emo_repo"``: the "tvd" baseline of DRSY/EMO (language_modeling/gpt2.py), with
  mixing ratio η:
      L_t = η·CE_t + (1 - η)·clamp(sg(q_t / ((1 - η) + η·q_t)), w_min, 1)·CE_t
  i.e. γ := 1 - η in the weight (γ and 1 - γ swapped relative to TaiLr's γ := η reading) plus
  an extra η·CE. It agrees with ``"paper"`` only through that reparametrization; the official
  code hard-codes w_min = 0.2 and has no label smoothing.

Reduction: sum over non-ignored tokens, divided by their count for "mean" (fairseq divides the
summed loss by the token count; DRSY/EMO by mask.sum()).

Shape notation: B batch, T time, V vocabulary, N = B*T positions.
"""

from __future__ import annotations

from typing import Literal

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    token_log_probs,
    token_weighted_ce_output,
)

TaiLrPreset = Literal["paper", "emo_repo"]


def _check_unit(
    name: str, value: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    low_ok = value > 0 if open_low else value >= 0
    high_ok = value < 1 if open_high else value <= 1
    if not (low_ok and high_ok):
        lo = "(" if open_low else "["
        hi = ")" if open_high else "]"
        raise ValueError(f"{name} must lie in {lo}0, 1{hi}, got {value}")


def check_tailr_options(
    gamma: float,
    min_weight: float,
    label_smoothing: float,
    preset: str,
    mixing_ratio: float | None,
) -> None:
    """Validate TaiLr hyper-parameters (clear errors, no silent ignores)."""
    _check_unit("min_weight", min_weight)
    _check_unit("label_smoothing", label_smoothing, open_high=True)
    if preset == "paper":
        _check_unit("gamma", gamma, open_low=True)  # γ = 0 gives 0/0 where q underflows
        if mixing_ratio is not None:
            raise ValueError(
                f"mixing_ratio={mixing_ratio} only applies to preset='emo_repo' (TaiLr's own "
                "weight uses gamma)"
            )
    elif preset == "emo_repo":
        if mixing_ratio is None:
            raise ValueError("preset='emo_repo' needs mixing_ratio (η in DRSY/EMO's tvd loss)")
        _check_unit("mixing_ratio", mixing_ratio)
        if label_smoothing != 0.0:
            raise ValueError("preset='emo_repo' has no label smoothing (DRSY/EMO's tvd loss)")
    else:
        raise ValueError(f"preset must be 'paper' or 'emo_repo', got {preset!r}")


def tailr_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    gamma: float = 1e-7,
    min_weight: float = 0.2,
    label_smoothing: float = 0.0,
    preset: TaiLrPreset = "paper",
    mixing_ratio: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> LossOutput:
    """TaiLr-weighted cross-entropy (see the module docstring for both presets' formulas).

    Args:
        logits: z [B, T, V] (or [N, V]), any float dtype (computed in float32, float64 kept).
        labels: y [B, T] aligned with the logits; ``ignore_index`` positions are not scored.
        gamma: γ in (0, 1] of the TaiLr weight (preset "paper"; 1e-7 in the official scripts).
        min_weight: lower clamp w_min of the weight (0.2 in the official scripts / DRSY/EMO).
        label_smoothing: ε of the unweighted smoothing term (preset "paper" only).
        preset: "paper" (thu-coai/TaiLr) or "emo_repo" (DRSY/EMO's "tvd" baseline).
        mixing_ratio: η for preset "emo_repo" (required there, rejected for "paper").
        reduction: "mean" over counted tokens or "sum".

    Returns:
        LossOutput with components "ce" (mean plain CE), "weight_mean" (mean over counted tokens
        of the detached per-token multiplier of CE: w_t for "paper", η + (1-η)·w_t for
        "emo_repo") and "n_tokens".
    """
    check_tailr_options(gamma, min_weight, label_smoothing, preset, mixing_ratio)
    check_logits_labels(logits, labels, ignore_index)
    tokens = token_log_probs(logits, labels, ignore_index)
    log_q, ce, valid = tokens.log_q, tokens.ce, tokens.valid  # [N, V], [N], [N]
    dtype, zero = ce.dtype, ce.new_zeros(())
    q_gold = torch.exp(-ce.detach())  # q_t(y_t), no gradient: [N]

    if preset == "paper":
        weight = (q_gold / (gamma + (1.0 - gamma) * q_gold)).clamp(min_weight, 1.0)
        per_token = (1.0 - label_smoothing) * weight * ce
        if label_smoothing > 0.0:
            smooth = torch.where(valid, -log_q.sum(dim=-1), zero)  # Σ_v -log q(v): [N]
            per_token = per_token + (label_smoothing / logits.shape[-1]) * smooth
        multiplier = weight
    else:
        eta = float(mixing_ratio)  # validated above
        denom = (1.0 - eta) + eta * q_gold
        # η = 1 with q underflowing to 0 would give 0/0; the term is multiplied by 1-η = 0 anyway.
        ratio = torch.where(denom > 0, q_gold / denom.clamp_min(torch.finfo(dtype).tiny), 1.0)
        weight = ratio.clamp(min_weight, 1.0)
        multiplier = eta + (1.0 - eta) * weight
        per_token = multiplier * ce

    return token_weighted_ce_output(tokens, per_token, multiplier, reduction)


__all__ = ["TaiLrPreset", "check_tailr_options", "tailr_loss"]
