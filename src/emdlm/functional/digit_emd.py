"""Token-level digit EMD of NTIL, extended to multi-digit number tokens.

Source: NTIL paper (Fei et al., ACL 2025), Sec. 3.1 Eq. 1 and Appendix D.3 Eq. 7–8.

Single-digit tokens (the paper): with p = softmax(z[digit ids]) ordered 0..9 and a one-hot
target y, the exact 1-D Wasserstein-1 distance is

    EMD_t = Σ_k p_k · |k − y_t|,

weighted by (1 + σ)^(digits to the right of the digit within its number).

Multi-digit tokens (our extension, NOTE: not in the paper): a token such as 'Ġ123' is scored by
an ordinal EMD over the *candidates of its class* (every number token with the same digit count
and the same space marker, :attr:`emdlm.numbers.NumberVocab.class_members`):

    EMD_t = Σ_j p_j · |v_j − v_y| / 10^(L − 1),     p = softmax(z[class members of y]),

with v the members' integer values and L the token's digit count, i.e. the distance is counted
in units of the token's *leading* place. The weight is (1 + σ)^r with r the digits of the whole
number to the right of the token's leading digit
(:attr:`emdlm.number_spans.NumberSpans.digits_right`).
For one-digit tokens (L = 1, members '0'..'9') this is exactly the paper's formula, and a closer
value always costs less.

Shape notation: M number tokens in the batch, K candidates per token (widest class present).
"""

from __future__ import annotations

import torch


def masked_class_softmax(
    class_logits: torch.Tensor, class_mask: torch.Tensor, tau: float = 1.0
) -> torch.Tensor:
    """softmax(z / tau) over the real members of each row; padding columns get probability 0.

    Args:
        class_logits: [M, K] candidate logits (any float dtype; the result keeps it).
        class_mask: [M, K] bool, True where the column is a real class member.
        tau: temperature.
    """
    masked = class_logits.masked_fill(~class_mask, float("-inf"))  # [M, K]
    if tau != 1.0:
        masked = masked / tau
    return torch.softmax(masked, dim=-1)


def class_emd(
    probs: torch.Tensor,
    class_values: torch.Tensor,
    gold_column: torch.Tensor,
    num_digits: torch.Tensor,
) -> torch.Tensor:
    """Per-token ordinal EMD Σ_j p_j·|v_j − v_y| / 10^(L−1) against the one-hot gold token.

    Args:
        probs: [M, K] candidate distribution (rows sum to 1, zero on padding).
        class_values: [M, K] float64 integer values of the candidates.
        gold_column: [M] long, column of the gold token.
        num_digits: [M] long, digit count L of the gold token.

    Returns:
        [M] EMD per token in ``probs.dtype`` (float64 inputs give float64).
    """
    values = class_values.to(probs.dtype)  # [M, K]
    gold = values.gather(1, gold_column.unsqueeze(1))  # [M, 1]
    unit = torch.pow(10.0, (num_digits - 1).to(probs.dtype)).unsqueeze(1)  # [M, 1]
    cost = (values - gold).abs() / unit  # [M, K]
    return (probs * cost).sum(dim=-1)  # [M]


def position_weight(
    digits_right: torch.Tensor, sigma: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Exponential position weight W = (1 + σ)^r (NTIL Eq. 4 / Appendix D.3); [M] in ``dtype``."""
    # torch.full, not torch.tensor: no host-to-device copy (a sync on CUDA).
    base = torch.full((), 1.0 + sigma, dtype=dtype, device=digits_right.device)
    return torch.pow(base, digits_right.to(dtype))


def weighted_digit_emd(
    class_logits: torch.Tensor,
    class_mask: torch.Tensor,
    class_values: torch.Tensor,
    gold_column: torch.Tensor,
    num_digits: torch.Tensor,
    digits_right: torch.Tensor,
    sigma: float,
) -> torch.Tensor:
    """W·EMD per number token: ``(1+σ)^digits_right · class_emd(softmax(z_class), ...)``.

    Args:
        class_logits: [M, K] logits of the candidates of each gold token's class.
        class_mask, class_values, gold_column, num_digits: as in :func:`class_emd`.
        digits_right: [M] long, exponent of the position weight.
        sigma: position weight growth, σ (0.2 in NTIL, 0 for the plain EMD baseline).

    Returns:
        [M] weighted EMD in ``class_logits.dtype``.
    """
    probs = masked_class_softmax(class_logits, class_mask)  # [M, K]
    emd = class_emd(probs, class_values, gold_column, num_digits)  # [M]
    return emd * position_weight(digits_right, sigma, emd.dtype)
