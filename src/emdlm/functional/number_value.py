"""Sequence-level terms of NTIL: the predicted value X of each number and its deviations from Y.

Source: NTIL paper Sec. 3.2 Eq. 2–3 and Appendix C; official code https://github.com/xfey/NTIL
(ntil.py).

Predicted value. At every number token the model's candidates (the gold token's class, see
:mod:`emdlm.functional.digit_emd`) give a token value t, and

    X = sign · Σ_tokens t · 10^place        (place = power of ten of the token's last digit),

with ``value_mode``:

* ``"gumbel"`` (official): h = softmax((z + s·g) / τ), g ~ Gumbel(0, 1), s = noise_scale (0.01),
  τ = 0.1, then straight-through: t = v[argmax h] in the forward pass, gradient of Σ h·v.
* ``"argmax"``: the same with no noise (deterministic): t = v[argmax z].
* ``"expected"``: t = Σ p·v with p = softmax(z) (smooth, no straight-through).

Deviations (float64, finite for every input; X and Y may be 0 or negative):

* relative, Eq. 2: |X − Y| / max(|X|, |Y|), taken as 0 when both are 0 (``smoothing="paper"``:
  the paper's formula with its ε → 0; the guard is the only smoothing), or
  |X − Y| / (max(|X|, |Y|) + 1) with the value 0 where X == Y (``smoothing="official"``).
* magnitude, Eq. 3: |log(|X| + u) − log(|Y| + u)| = log((max + u) / (min + u)), with u one unit
  in the number's last place (1 for integers, 0.01 for '1.00') for ``"paper"`` — the least
  smoothing that keeps it finite at 0 with a gradient bounded independently of the scale — and
  u = 1 for ``"official"``.

Stable magnitude (emdlm's, ``magnitude_floor`` ρ > 0, the stable preset of NTILLoss): the
smoothing becomes u = max(unit, ρ·|Y|). d/dX log(|X| + u) = 1/(|X| + u), so with u = unit a
prediction X ≈ 0 of a gold Y ≈ 2e5 puts a gradient of 10^5 on the leading digit's value (the
clipped gradient norms of 8824 in an audit, docs/results/ntil_grad_norms.md); with ρ·|Y| it is
at most 10^place/(ρ·|Y|) ≤ 1/ρ,
i.e. 1/ρ times the relative term's bound 10^place/|Y|. The term keeps its meaning, the log of
the ratio of magnitudes, down to about ρ·|Y|: for ρ = 0.1 (stable preset) X = Y/10 costs 1.7
(log 10 = 2.3 unsmoothed) and it saturates at log(1 + 1/ρ) = 2.4 for X → 0 (a prediction above
Y has at most Y's digits, X < 10·Y, and costs at most ≈ log 10). ρ = 0.1 rather than 0.01: on
random 6-digit cases the largest magnitude gradient was 6801 with u = unit, 72 with ρ = 0.01,
16 with ρ = 0.1, against 3 for the relative term (benchmarks/ntil_grad_norms.py --term-tails;
docs/results/ntil_grad_norms.md).
NOTE: a departure from Eq. 3 (whose ε is meant to be tiny); ρ = 0 restores it.

Numbers beyond float64 (emdlm's): values above 1e308 would clamp X and Y to the same
maximum and make both deviations 0 for any prediction. Relative and magnitude are invariant under
scaling X, Y and u by the same 10^−k, so the value terms read each number with its places
shifted down by k = max(0, leading place − 300) (:func:`value_place_shift`): exact math, no effect
on numbers of up to 301 integer digits, and the leading 300+ places of longer numbers are read
(places beyond 10^−308 after the shift underflow to 0, i.e. numbers of over ~600 digits are read
to their leading ~600 places).

Both are taken on the unsigned magnitudes |X|, |Y| (X carries the gold sign), with
d|X|/dX = 1 at X = 0, so a predicted 0 keeps the gradient that the official max/min of the
non-negative X gives it (checked against xfey/NTIL's own outputs in tests/test_ntil.py).

Shape notation: M number tokens, K candidates per token, S numbers.
"""

from __future__ import annotations

from typing import Literal

import torch

from emdlm.functional.digit_emd import masked_class_softmax

ValueMode = Literal["gumbel", "argmax", "expected"]
Smoothing = Literal["paper", "official"]


def gumbel_noise(
    shape: tuple[int, ...],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Standard Gumbel(0, 1) samples −log(E), E ~ Exponential(1) (the official code's recipe)."""
    expo = torch.empty(shape, device=device, dtype=dtype).exponential_(generator=generator)
    return expo.log_().neg_()


def token_values(
    class_logits: torch.Tensor,
    class_mask: torch.Tensor,
    class_values: torch.Tensor,
    mode: ValueMode = "gumbel",
    *,
    tau: float = 0.1,
    noise: torch.Tensor | None = None,
    noise_scale: float = 0.01,
) -> torch.Tensor:
    """Predicted value t of each number token over its class candidates.

    Args:
        class_logits: [M, K] candidate logits (float64 recommended).
        class_mask: [M, K] bool real-member mask.
        class_values: [M, K] float64 candidate values.
        mode: "gumbel", "argmax" or "expected" (module docstring).
        tau: Gumbel-softmax temperature for "gumbel"/"argmax".
        noise: [M, K] standard Gumbel samples, required for "gumbel" (ignored otherwise).
        noise_scale: multiplier of the noise (0.01 in the official code).

    Returns:
        [M] token values in ``class_logits.dtype``; in the hard modes the forward value is
        exactly a candidate's value (straight-through estimator for the gradient).
    """
    values = class_values.to(class_logits.dtype)  # [M, K]
    if mode == "expected":
        probs = masked_class_softmax(class_logits, class_mask)  # [M, K]
        return (probs * values).sum(dim=-1)
    if mode not in ("gumbel", "argmax"):
        raise ValueError(f"value_mode must be 'gumbel', 'argmax' or 'expected', got {mode!r}")
    perturbed = class_logits
    if mode == "gumbel":
        if noise is None:
            raise ValueError("value_mode='gumbel' needs a noise tensor of Gumbel samples")
        perturbed = class_logits + noise_scale * noise.to(class_logits.dtype)
    soft = masked_class_softmax(perturbed, class_mask, tau)  # [M, K]
    hard_value = values.gather(1, soft.detach().argmax(dim=-1, keepdim=True)).squeeze(1)  # [M]
    soft_value = (soft * values).sum(dim=-1)  # [M]
    # Straight-through: forward = the hard value exactly, gradient = that of the soft value.
    return hard_value + (soft_value - soft_value.detach())


def number_values(
    token_value: torch.Tensor,
    place: torch.Tensor,
    number_id: torch.Tensor,
    sign: torch.Tensor,
) -> torch.Tensor:
    """X_s = sign_s · Σ_{tokens of s} t · 10^place, in float64 (exact up to 2^53, no overflow
    below 1e308).

    Args:
        token_value: [M] token values.
        place: [M] long, power of ten of each token's last digit.
        number_id: [M] long, number of each token in [0, S).
        sign: [S] float64, ±1.

    Returns:
        [S] float64 predicted values.
    """
    big = torch.finfo(torch.float64).max
    scaled = token_value.double() * torch.pow(10.0, place.double()).clamp(max=big)  # [M]
    total = torch.zeros_like(sign, dtype=torch.float64).index_add(0, number_id, scaled)  # [S]
    return sign.double() * total.clamp(-big, big)


#: Highest power of ten the value terms read; longer numbers are shifted down (module docstring).
MAX_VALUE_PLACE = 300


def value_place_shift(
    place: torch.Tensor, num_digits: torch.Tensor, number_id: torch.Tensor, n_numbers: int
) -> torch.Tensor:
    """k_s = max(0, leading place of number s − MAX_VALUE_PLACE); [S] long.

    The leading place of a token is ``place + num_digits − 1`` (its first digit's power of ten).
    Reading every place of number s as place − k_s keeps X, Y and u below 10^301, so no value
    clamps to the float64 maximum; relative and magnitude are unchanged by the common scale.
    """
    lead = torch.zeros(n_numbers, dtype=torch.long, device=place.device).scatter_reduce(
        0, number_id, place + num_digits - 1, reduce="amax", include_self=False
    )  # [S]
    return (lead - MAX_VALUE_PLACE).clamp_min(0)


def number_units(place: torch.Tensor, number_id: torch.Tensor, n_numbers: int) -> torch.Tensor:
    """One unit in each number's last place, 10^(min place of its tokens); [S] float64."""
    min_place = torch.zeros(n_numbers, dtype=torch.long, device=place.device).scatter_reduce(
        0, number_id, place, reduce="amin", include_self=False
    )  # [S]
    return torch.pow(10.0, min_place.double())


def floored_unit(
    unit: torch.Tensor | float, y: torch.Tensor, floor: float = 0.0
) -> torch.Tensor | float:
    """The magnitude's smoothing u = max(unit, ρ·|Y|) with ρ = ``floor`` (``unit`` when ρ = 0).

    Bounds d log(|X| + u)/dX by 1/(ρ·|Y|) (module docstring, "Stable magnitude"). [S] float64.
    """
    if floor == 0:
        return unit
    scaled = floor * y.double().abs()  # [S]
    if isinstance(unit, torch.Tensor):
        return torch.maximum(unit.double(), scaled)
    return scaled.clamp_min(unit)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with the derivative +1 at x = 0 (``Tensor.abs`` has 0 there).

    A predicted value of exactly 0 (every predicted digit '0') must still receive the value
    gradient: the official code takes max/min of the non-negative X itself, whose derivative at
    X = 0 < Y is 1, so a 0 prediction is pushed up. Callers pass unsigned magnitudes.
    """
    return torch.where(x < 0, -x, x)


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (and a zero, not NaN, gradient there)."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), 0.0)


def relative_deviation(
    x: torch.Tensor, y: torch.Tensor, smoothing: Smoothing = "paper"
) -> torch.Tensor:
    """Relative deviation per number (NTIL Eq. 2); [S] float64, finite, in [0, 2].

    ``"paper"``: |X − Y| / max(|X|, |Y|) (0 when both are 0).
    ``"official"``: |X − Y| / (max(|X|, |Y|) + 1), and exactly 0 (no gradient) where X == Y.
    """
    x, y = x.double(), y.double()
    diff = (x - y).abs()
    top = torch.maximum(_magnitude(x), _magnitude(y))
    if smoothing == "paper":
        return _safe_ratio(diff, top)
    if smoothing == "official":
        return torch.where(x == y, 0.0, diff / (top + 1.0))
    raise ValueError(f"smoothing must be 'paper' or 'official', got {smoothing!r}")


def magnitude_deviation(
    x: torch.Tensor, y: torch.Tensor, unit: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Magnitude deviation per number (NTIL Eq. 3): log((max(|X|,|Y|) + u) / (min(|X|,|Y|) + u)).

    Written as |log(|X| + u) − log(|Y| + u)| (equal, and overflow-free); u > 0 keeps it finite
    at 0 (pass :func:`number_units` for the paper preset, 1.0 for the official one).
    Returns [S] float64, ≥ 0.
    """
    x, y = x.double(), y.double()
    u = unit.double() if isinstance(unit, torch.Tensor) else unit
    return (torch.log(_magnitude(x) + u) - torch.log(_magnitude(y) + u)).abs()
