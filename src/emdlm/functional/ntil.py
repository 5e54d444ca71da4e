"""NTIL (Numerical Token Integrity Loss) and the digit-EMD baseline: the reference implementation.

Source: NTIL paper (Fei et al., ACL 2025) Eq. 1–4, Appendix A, C, D.3; official code
https://github.com/xfey/NTIL (ntil.py, emd.py).

    NTIL = emd_weight · (W·EMD) + α · relative + β · magnitude                      (Eq. 4)
    total = CE + λ · sg(CE / NTIL) · NTIL      (mix="dynamic", the official code)
    total = CE + λ · NTIL                      (mix="static")

CE is the mean token cross-entropy over every counted (non-ignored) label of the batch, as the
model's own loss in the official training code. Averaging of the NTIL terms (``averaging``):

* ``"batch"`` (paper preset): W·EMD averaged over all number tokens of the batch, relative and
  magnitude over all numbers of the batch.
* ``"row"`` (official): each term averaged within a batch row (over its number tokens / numbers;
  0 for a row without any), then over all B rows, rows without numbers included.
* ``"token"`` (emdlm's option for gradient accumulation and multi-process training): each term
  is a SUM over the batch divided by n, the number of counted labels (CE's denominator):

      emd = Σ_{number tokens m} W_m·EMD_m / n,   relative = Σ_{numbers s} rel_s / n,
      magnitude = Σ_s mag_s / n.

  With ``mix="static"`` the total is Σ_t CE_t / n + λ·(Σ NTIL terms) / n, where Σ NTIL terms =
  emd_weight·Σ_m W_m·EMD_m + α·Σ_s rel_s + β·Σ_s mag_s, and ``reduction="sum"`` returns
  Σ_t CE_t + λ·Σ NTIL terms: a plain sum over tokens and numbers, so dividing each
  micro-batch's sum by the token count of the whole accumulated (all-process) batch gives
  exactly the full batch's loss and gradient, however the rows are split (a number never
  straddles two rows). "batch" and "row" means depend on which items share a micro-batch, so
  they cannot be exact under accumulation. The scale of the terms differs: "token" ≈ "batch" ×
  (number tokens or numbers) / n, so λ (or α, β) may need retuning relative to the paper's.

Stabilisers (emdlm's; all off by default here, on in NTILLoss's "stable" preset (its
default), off in its "paper" and "official" presets; measured in
docs/results/ntil_grad_norms.md):

* ``max_ratio``: the dynamic ratio is capped, λ·min(sg(CE/NTIL), max_ratio)
  (:func:`mix_coefficient`).
* ``per_number``: the EMD term is Σ_i W_i·EMD_i / Σ_i W_i within each number, then averaged over
  numbers with ``averaging`` (:func:`number_emd`), instead of W·EMD averaged over number tokens.
* ``magnitude_floor`` ρ: the magnitude's smoothing is u = max(unit, ρ·|Y|)
  (:func:`emdlm.functional.number_value.floored_unit`).

Always on: numbers over 300 digits are read with their places shifted down, so the value terms
never clamp to the float64 maximum (:func:`emdlm.functional.number_value.value_place_shift`).

NOTE: the dynamic mix λ·sg(CE/NTIL) is a ratio of two batch means (with "token": of two batch
sums, Σ CE_t / Σ NTIL terms). A ratio of sums over a micro-batch is not the ratio over the whole
batch, so the dynamic mix is NOT exact under gradient accumulation or multi-process training
with any averaging; only ``mix="static", averaging="token"`` is.

All NTIL math runs on the small [M, K] tensor of the class-candidate logits of the M number
positions (float64), gathered once: :func:`ntil_terms` is shared by this reference and by the
fused fast path :mod:`emdlm.ops.objectives.ntil`. With no number in the batch, every NTIL term is an
explicit 0 and the loss equals CE.

``reduction="sum"`` returns n · (the mean-reduced total), n = number of counted labels: the CE
part is the exact CE sum. With ``mix="static", averaging="token"`` the NTIL part is λ · (sum of
the NTIL terms), a sum too, and dividing by a global token count (transformers'
``num_items_in_batch``) makes accumulation exact. Otherwise the NTIL part is n × its micro-batch
mean-based mix, so dividing by a global count gives each micro-batch's mean loss weighted by its
share of tokens: exact for CE, while the NTIL means and the ratio sg(CE/NTIL) stay per
micro-batch.

Shape notation: B batch rows, T time, V vocabulary rows, N = B·T, M number tokens, K candidates
per token, S numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    log_softmax_zero_ignored,
)
from emdlm.functional.digit_emd import weighted_digit_emd
from emdlm.functional.number_value import (
    Smoothing,
    ValueMode,
    floored_unit,
    gumbel_noise,
    magnitude_deviation,
    number_units,
    number_values,
    relative_deviation,
    token_values,
    value_place_shift,
)
from emdlm.number_spans import (
    NumberSpans,
    SpanDraft,
    SpanOptions,
    check_number_mask,
    draft_number_spans,
)
from emdlm.numbers import NumberVocab

Mix = Literal["dynamic", "static"]
Averaging = Literal["batch", "row", "token"]

#: Denominator guard of the dynamic mix (paper preset): ratio 0 where NTIL <= MIX_EPS.
MIX_EPS = 1e-12


@dataclass(frozen=True)
class NTILSettings:
    """Every knob of NTIL / digit EMD (the modules resolve presets into one of these).

    Attributes:
        lam: λ, weight of NTIL in the mix with CE (0.3).
        alpha: α, weight of the relative deviation (0.2).
        beta: β, weight of the magnitude deviation (0.2).
        sigma: σ, position weight W = (1+σ)^digits_right (0.2; 0 for the EMD baseline).
        emd_weight: weight of the W·EMD term (official ``digit_alpha``, 1.0).
        mix: "dynamic" (CE + λ·sg(CE/NTIL)·NTIL) or "static" (CE + λ·NTIL).
        value_mode: "gumbel", "argmax" or "expected" (see emdlm.functional.number_value).
        tau: Gumbel-softmax temperature (0.1).
        noise_scale: Gumbel noise multiplier (0.01).
        averaging: "batch" (paper), "row" (official) or "token" (sums over the batch / counted
            labels: exact under gradient accumulation with mix="static"; module docstring).
        smoothing: "paper" or "official" deviations (emdlm.functional.number_value).
        sequence_terms: compute relative / magnitude (False for the plain EMD baseline).
        reduction: "mean" or "sum" (module docstring).
        ignore_index: label value that is not scored.
        mix_eps: added to NTIL in the dynamic ratio (0: guarded CE/NTIL; official: 1e-10).
        max_ratio: cap of the dynamic ratio sg(CE/NTIL), so the coefficient is at most
            λ·max_ratio (None: no cap, the paper and the official code; stable preset of
            NTILLoss: 10).
        per_number: average W·EMD within each number with the weights normalised,
            Σ_i W_i·EMD_i / Σ_i W_i, then over numbers (True), instead of over all number tokens
            (False, the official code). See :func:`number_emd`.
        magnitude_floor: ρ in the magnitude's smoothing u = max(unit, ρ·|Y|) (0: unit only, the
            paper / official form; stable preset of NTILLoss: 0.1). See
            :func:`emdlm.functional.number_value.magnitude_deviation`.
    """

    lam: float = 0.3
    alpha: float = 0.2
    beta: float = 0.2
    sigma: float = 0.2
    emd_weight: float = 1.0
    mix: Mix = "dynamic"
    value_mode: ValueMode = "gumbel"
    tau: float = 0.1
    noise_scale: float = 0.01
    averaging: Averaging = "batch"
    smoothing: Smoothing = "paper"
    sequence_terms: bool = True
    reduction: Reduction = "mean"
    ignore_index: int = IGNORE_INDEX
    mix_eps: float = 0.0
    max_ratio: float | None = None
    per_number: bool = False
    magnitude_floor: float = 0.0

    def __post_init__(self) -> None:
        choices = {
            "mix": ("dynamic", "static"),
            "value_mode": ("gumbel", "argmax", "expected"),
            "averaging": ("batch", "row", "token"),
            "smoothing": ("paper", "official"),
            "reduction": ("mean", "sum"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.tau <= 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if not self.sigma > -1:  # (1+σ)^r needs a positive base; also refuses NaN
            raise ValueError(f"sigma must be > -1, got {self.sigma}")
        if self.max_ratio is not None and not self.max_ratio > 0:  # also refuses NaN
            raise ValueError(f"max_ratio must be > 0 or None (no cap), got {self.max_ratio}")
        if not 0 <= self.magnitude_floor < float("inf"):
            raise ValueError(f"magnitude_floor must be finite and >= 0, got {self.magnitude_floor}")


@dataclass(frozen=True)
class ClassCandidates:
    """Candidates of each number token's gold class, trimmed to the widest class present.

    Attributes:
        ids: [M, K] long vocab ids (padding 0).
        mask: [M, K] bool real members.
        values: [M, K] float64 member values.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class NTILTerms:
    """The NTIL terms of one batch (0-d float64 tensors carrying the graph to the logits).

    Attributes:
        emd: averaged W·EMD (before emd_weight).
        relative: averaged relative deviation (0 when not computed).
        magnitude: averaged magnitude deviation (0 when not computed).
        ntil: emd_weight·emd + α·relative + β·magnitude.
    """

    emd: torch.Tensor
    relative: torch.Tensor
    magnitude: torch.Tensor
    ntil: torch.Tensor


def class_candidates(
    vocab: NumberVocab, spans: NumberSpans, width: int | None = None
) -> ClassCandidates:
    """Gather the class rows of the M gold tokens, trimmed to the widest class present.

    ``width``: that widest class's size when the caller has read it already (the chunked
    NTIL objective reads it with the other sizes of its call); None reads it here, one host
    sync per batch (none when M == 0).
    """
    members = vocab.class_members[spans.token_class]  # [M, K_all]
    mask = vocab.class_mask[spans.token_class]  # [M, K_all]
    values = vocab.class_values[spans.token_class]  # [M, K_all]
    if spans.n_tokens > 0:
        if width is None:  # real members are left-aligned (sorted by value)
            width = int(mask.sum(dim=1).max())
        members, mask, values = members[:, :width], mask[:, :width], values[:, :width]
    return ClassCandidates(ids=members, mask=mask, values=values)


def _row_mean(
    per_item: torch.Tensor,
    item_row: torch.Tensor,
    n_rows: int,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Weighted) mean within each row (0 for an empty row), then mean over all ``n_rows``
    rows."""
    w = torch.ones_like(per_item) if weight is None else weight.to(per_item.dtype)
    sums = torch.zeros(n_rows, dtype=per_item.dtype, device=per_item.device)
    sums = sums.index_add(0, item_row, per_item * w if weight is not None else per_item)  # [R]
    counts = torch.zeros(n_rows, dtype=per_item.dtype, device=per_item.device)
    counts = counts.index_add(0, item_row, w)  # [R]
    return (sums / torch.where(counts > 0, counts, 1.0)).sum() / max(n_rows, 1)


def _average(
    per_item: torch.Tensor,
    item_row: torch.Tensor,
    n_rows: int,
    averaging: Averaging,
    n_tokens: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce [items] to 0-d: mean over items ("batch"), mean of row means ("row"), or sum over
    items / ``n_tokens`` counted labels ("token"; no host sync).

    With per-item weights ω (``weight`` [items], > 0): Σ ω·l / Σ ω ("batch"), Σ ω·l / Σ ω within
    each row, then the plain mean over rows ("row"), Σ ω·l / n ("token", n then the weighted
    count Σ_t w_t)."""
    if averaging == "row":
        return _row_mean(per_item, item_row, n_rows, weight)
    if averaging == "token":
        if n_tokens is None:
            raise ValueError('averaging="token" needs n_tokens, the number of counted labels')
        n = n_tokens.to(per_item.dtype)
        total = per_item.sum() if weight is None else (per_item * weight.to(per_item.dtype)).sum()
        return total / torch.where(n > 0, n, 1.0)  # n is a count (≥ 1) or a weight sum
    if weight is None:
        return per_item.sum() / max(per_item.numel(), 1)
    w = weight.to(per_item.dtype)
    norm = w.sum()
    return (per_item * w).sum() / torch.where(norm > 0, norm, 1.0)


def number_weights(
    token_weight: torch.Tensor, number_id: torch.Tensor, n_numbers: int
) -> torch.Tensor:
    """ω_s = the mean of the weights w_m of the tokens of number s: [S] from [M]."""
    zeros = torch.zeros(n_numbers, dtype=token_weight.dtype, device=token_weight.device)
    total = zeros.index_add(0, number_id, token_weight)  # [S]
    size = zeros.index_add(0, number_id, torch.ones_like(token_weight))  # [S], ≥ 1
    return total / size.clamp_min(1.0)


def number_emd(
    emd: torch.Tensor,
    digits_right: torch.Tensor,
    number_id: torch.Tensor,
    n_numbers: int,
    sigma: float,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-number weighted mean of the token EMDs (``per_number=True``); [S] float64.

        EMD_s = Σ_{i in s} W_i·EMD_i / Σ_{i in s} W_i,     W_i = (1+σ)^{r_i}

    (with per-token weights w_i, ``token_weight`` [M] > 0: W_i·w_i in place of W_i)

    with r_i the digits right of token i (NTIL Eq. 4's exponential weights, normalised within
    the number). Why: averaged over all number tokens, a 40-digit number's weights (1.2^39 ≈
    1470) dominate the batch's EMD; through the dynamic ratio sg(CE/NTIL) that cut another row's
    5-digit gradient over 400x (tests/test_ntil.py). Normalised, every number's EMD lies in the
    range of its tokens' EMDs, the weights still rank the digits within a number, and one long
    number weighs as one number. The weights are computed as (1+σ)^{r_i − max_s r} (the same
    ratios; no overflow for any length).
    """
    log_base = torch.log1p(torch.full((), sigma, dtype=torch.float64, device=emd.device))
    r = digits_right.to(torch.float64)  # [M]
    top = torch.zeros(n_numbers, dtype=torch.float64, device=emd.device).scatter_reduce(
        0, number_id, r, reduce="amax", include_self=False
    )  # [S]
    weight = torch.exp((r - top[number_id]) * log_base)  # [M] in (0, 1], 1 at the leading token
    if token_weight is not None:
        weight = weight * token_weight.to(weight.dtype)
    zeros = torch.zeros(n_numbers, dtype=emd.dtype, device=emd.device)
    total = zeros.index_add(0, number_id, weight.to(emd.dtype) * emd)  # [S]
    norm = zeros.index_add(0, number_id, weight.to(emd.dtype))  # [S], > 0 for every number
    return total / norm


def ntil_terms(
    class_logits: torch.Tensor,
    candidates: ClassCandidates,
    spans: NumberSpans,
    n_rows: int,
    settings: NTILSettings,
    noise: torch.Tensor | None = None,
    n_tokens: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
) -> NTILTerms:
    """NTIL terms from the [M, K] class-candidate logits (shared by reference and fused path).

    Per-token weights (``token_weight`` [M] > 0, the weights w_m of the number tokens; tokens
    of weight 0 were made ignored labels before the spans were found): the token-level W·EMD
    is averaged with weights w_m, and the number-level terms (relative, magnitude, and the
    per-number EMD of ``per_number``, within which W_i·w_i replace W_i) with the number's
    weight ω_s = mean of its tokens' w_m (:func:`number_weights`), as :func:`_average` says:
    "batch" Σ ω·l / Σ ω, "row" the same within each row then the mean over rows, "token"
    Σ ω·l / n with n = Σ_t w_t over the counted labels (``n_tokens``).

    Args:
        class_logits: [M, K] logits of the candidates (cast to float64 here).
        candidates: the matching :class:`ClassCandidates`.
        spans: the batch's :class:`emdlm.number_spans.NumberSpans`.
        n_rows: B, the number of batch rows (for ``averaging="row"``).
        settings: the knobs.
        noise: [M, K] standard Gumbel samples for ``value_mode="gumbel"``.
        n_tokens: 0-d count of counted labels n (needed for ``averaging="token"``).
        token_weight: per-token weights of the M number tokens, or None (unweighted).

    Returns:
        :class:`NTILTerms`; every term is an explicit 0 when M == 0.
    """
    z = class_logits.double()  # [M, K]
    token_row = spans.number_row[spans.number_id]  # [M]
    wemd = weighted_digit_emd(
        z,
        candidates.mask,
        candidates.values,
        spans.gold_column,
        spans.num_digits,
        spans.digits_right,
        0.0 if settings.per_number else settings.sigma,
    )  # [M] W·EMD, or the plain EMD when the weights are normalised per number below
    token_w = None if token_weight is None else token_weight.to(z.dtype)  # [M]
    number_w = (
        None if token_w is None else number_weights(token_w, spans.number_id, spans.n_numbers)
    )  # [S]
    if settings.per_number:
        per_number = number_emd(
            wemd, spans.digits_right, spans.number_id, spans.n_numbers, settings.sigma, token_w
        )  # [S]
        emd = _average(
            per_number, spans.number_row, n_rows, settings.averaging, n_tokens, number_w
        )
    else:
        emd = _average(wemd, token_row, n_rows, settings.averaging, n_tokens, token_w)
    zero = z.sum() * 0.0  # a 0 that keeps the graph (and the dtype/device)
    relative, magnitude = zero, zero
    if settings.sequence_terms and spans.n_numbers > 0:
        t = token_values(
            z,
            candidates.mask,
            candidates.values,
            settings.value_mode,
            tau=settings.tau,
            noise=noise,
            noise_scale=settings.noise_scale,
        )  # [M]
        # X carries the gold number's sign (token values are >= 0), so the deviations, which
        # depend only on |X|, |Y| and |X - Y| = ||X| - |Y||, are taken on the magnitudes: a
        # predicted 0 then keeps the gradient of the official max/min (d|X|/dX = 1 at 0).
        unsigned = torch.ones_like(spans.sign)
        # Numbers over 300 digits are read 10^-k_s lower (X, Y and u alike: the deviations are
        # scale-free), so they never clamp to the float64 maximum (number_value docstring).
        shift = value_place_shift(
            spans.place, spans.num_digits, spans.number_id, spans.n_numbers
        )  # [S]
        place = spans.place - shift[spans.number_id]  # [M]
        x = number_values(t, place, spans.number_id, unsigned)  # [S] |X|, built once
        gold_t = candidates.values.gather(1, spans.gold_column.unsqueeze(1)).squeeze(1)  # [M]
        y_shifted = number_values(gold_t, place, spans.number_id, unsigned)  # [S]
        # |Y| as parsed (exact for decimals) unless shifted; no host sync to pick the case
        y = torch.where(shift > 0, y_shifted, spans.gold_value.double().abs())  # [S] |Y|
        rel = relative_deviation(x, y, settings.smoothing)  # [S]
        if settings.smoothing == "paper":
            unit = number_units(place, spans.number_id, spans.n_numbers)  # [S]
        else:
            unit = torch.pow(10.0, -shift.double())  # [S] 1, scaled like X and Y
        unit = floored_unit(unit, y, settings.magnitude_floor)
        mag = magnitude_deviation(x, y, unit)  # [S]
        average = settings.averaging
        relative = _average(rel, spans.number_row, n_rows, average, n_tokens, number_w)
        magnitude = _average(mag, spans.number_row, n_rows, average, n_tokens, number_w)
    ntil = settings.emd_weight * emd + settings.alpha * relative + settings.beta * magnitude
    return NTILTerms(emd=emd, relative=relative, magnitude=magnitude, ntil=ntil)


def mix_coefficient(
    ce_mean: torch.Tensor, ntil: torch.Tensor, settings: NTILSettings
) -> torch.Tensor:
    """The detached factor c with total = CE + c·NTIL, 0-d float64.

    static: λ. dynamic: λ·sg(CE/NTIL), 0 where NTIL ≤ 1e-12 (MIX_EPS;
    no 1e12-sized factor); with ``settings.mix_eps > 0`` (official preset: 1e-10)
    λ·sg(CE/(NTIL + mix_eps)) as xfey/NTIL, still 0 where NTIL is exactly 0.
    With ``settings.max_ratio`` the ratio is capped: λ·min(sg(CE/NTIL), max_ratio).

    NOTE: the cap is emdlm's (EMOLoss's ``max_ratio`` is the same idea). Without it, the ratio grows
    without bound as NTIL → 0 while CE stays (49.8 and 7187 were seen in an audit,
    docs/results/ntil_grad_norms.md), multiplying NTIL's gradient, whose direction is then dominated
    by nearly-solved numbers, by that factor. Capped, NTIL's share of the loss value is at most λ·CE
    and is λ·max_ratio·NTIL below it.
    """
    ce_d, ntil_d = ce_mean.detach().double(), ntil.detach().double()
    if settings.mix == "static":
        return torch.full_like(ntil_d, settings.lam)
    if settings.mix_eps > 0:  # official: sg(CE / (NTIL + 1e-10)), and 0 when NTIL is 0
        ratio = torch.where(ntil_d > 0, ce_d / (ntil_d + settings.mix_eps), 0.0)
    else:
        ratio = torch.where(ntil_d > MIX_EPS, ce_d / ntil_d.clamp_min(MIX_EPS), 0.0)
    if settings.max_ratio is not None:
        ratio = ratio.clamp_max(settings.max_ratio)
    return settings.lam * ratio


def draft_spans(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: SpanOptions,
    *,
    ignore_index: int = IGNORE_INDEX,
    number_mask: torch.Tensor | None = None,
) -> SpanDraft:
    """:func:`resolve_spans` before its host sync (:func:`emdlm.number_spans.draft_number_spans`):
    the chunked NTIL objective reads the sizes with the rest of its call's."""
    # Explicit row count: reshape(-1, 0) fails for a time dimension of 0.
    n_rows = math.prod(labels.shape[:-1]) if labels.dim() > 1 else 1
    rows = labels.reshape(n_rows, labels.shape[-1])
    if number_mask is not None:
        check_number_mask(number_mask, labels)  # before the reshape: the error shows the shapes
        number_mask = number_mask.reshape(rows.shape)
    return draft_number_spans(
        rows.long(), vocab, options, ignore_index=ignore_index, number_mask=number_mask
    )


def resolve_spans(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: SpanOptions,
    *,
    ignore_index: int = IGNORE_INDEX,
    number_mask: torch.Tensor | None = None,
) -> NumberSpans:
    """Find the number spans of labels viewed as [B, T] (1-D labels are one row).

    ``number_mask`` (bool, the labels' shape; None = every token): a number is scored only if
    all its tokens are True; tokens outside the mask are non-number tokens to NTIL / digit EMD
    (:func:`emdlm.number_spans.find_number_spans`). CE is not affected: :func:`ntil_loss` scores CE
    on every counted label whatever the spans. One host sync (the sizes and the range check).
    """
    return draft_spans(
        labels, vocab, options, ignore_index=ignore_index, number_mask=number_mask
    ).resolve()


def sample_noise(
    candidates: ClassCandidates, settings: NTILSettings, generator: torch.Generator | None
) -> torch.Tensor | None:
    """[M, K] float64 standard Gumbel noise when value_mode is "gumbel" (else None)."""
    if settings.value_mode != "gumbel" or not settings.sequence_terms:
        return None
    return gumbel_noise(
        tuple(candidates.ids.shape), device=candidates.ids.device, generator=generator
    )


def ntil_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    spans: NumberSpans,
    settings: NTILSettings,
    *,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reference CE + NTIL with plain autograd (the oracle of :mod:`emdlm.ops.objectives.ntil`).

    Args:
        logits: [..., T, V] any float dtype (CE in float32, or float64 for float64 logits;
            NTIL in float64).
        labels: [..., T] integer, aligned with the logits (no shift), ``ignore_index`` skipped.
        vocab: the vocabulary's :class:`NumberVocab` (on the logits' device, V rows).
        spans: :class:`NumberSpans` of ``labels`` viewed as [B, T] (:func:`resolve_spans`; its
            ``number_mask`` leaves numbers out of the NTIL terms, CE stays on every label).
        settings: the knobs.
        noise: [M, K] standard Gumbel noise (value_mode "gumbel"); drawn with ``generator``
            when None.

    Returns:
        (loss, components): the 0-d loss (float32; float64 for float64 logits) and detached
        components "ce", "emd", "relative", "magnitude", "ntil", "mix_coef", "n_numbers",
        "n_digit_tokens", "n_tokens".
    """
    check_logits_labels(logits, labels, settings.ignore_index)
    vocab_rows = logits.shape[-1]
    flat = logits.reshape(-1, vocab_rows)  # [N, V]
    flat_labels = labels.reshape(-1).long()  # [N]
    n_rows = math.prod(labels.shape[:-1]) if labels.dim() > 1 else 1
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    valid = flat_labels != settings.ignore_index  # [N]
    # Zero gradient on ignored rows even where their logits are NaN / ±inf (padding).
    log_q = log_softmax_zero_ignored(flat.to(compute), valid)  # [N, V]
    ce_sum = F.nll_loss(log_q, flat_labels, ignore_index=settings.ignore_index, reduction="sum")
    count = valid.sum()
    ce_mean = ce_sum / count.clamp_min(1)
    candidates = class_candidates(vocab, spans)
    if noise is None:
        noise = sample_noise(candidates, settings, generator)
    class_logits = flat[spans.flat_index.unsqueeze(1), candidates.ids]  # [M, K]
    terms = ntil_terms(class_logits, candidates, spans, n_rows, settings, noise, count)
    coef = mix_coefficient(ce_mean, terms.ntil, settings)
    mixed = (coef * terms.ntil).to(compute)
    if settings.reduction == "sum":
        loss = ce_sum + count.to(mixed.dtype) * mixed
    else:
        loss = ce_mean + mixed
    return loss, _components(ce_mean, terms, coef, spans, count)


def _components(
    ce_mean: torch.Tensor,
    terms: NTILTerms,
    coef: torch.Tensor,
    spans: NumberSpans,
    count: torch.Tensor,
) -> dict[str, torch.Tensor]:
    return {
        "ce": ce_mean.detach(),
        "emd": terms.emd.detach(),
        "relative": terms.relative.detach(),
        "magnitude": terms.magnitude.detach(),
        "ntil": terms.ntil.detach(),
        "mix_coef": coef.detach(),
        "n_numbers": torch.tensor(spans.n_numbers),
        "n_digit_tokens": torch.tensor(spans.n_tokens),
        "n_tokens": count.detach(),
    }
