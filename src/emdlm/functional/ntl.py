"""Number Token Loss, regression-like (NTL-MSE / NTL-L1 / NTL-Huber) and number-level: reference.

Source: Zausinger et al., "Regress, Don't Guess: A Regression-like Loss on Number Tokens for
Language Models", ICML 2025; official package ``ntloss`` 0.3.2 (ai4sd/number-token-loss,
ntloss/core.py: ``NTLossDotProduct``, ``NumberLevelLoss``, ``AbstractNTLoss.reweigh_fn``).

Token level (``NTLossDotProduct``, "NTL-MSE", and ``NTLoss``, "NTL-WAS"). For every number
token m of the labels, with c_m = z_m[candidates] the logits of its candidate set (ntloss: the
ten digit tokens; emdlm: the class of the gold token, :class:`emdlm.numbers.NumberVocab`),
p_m = softmax(c_m) and u the candidates' values in units of the token's leading place
(value / 10^(L−1), L its digit count):

    ŷ_m = Σ_k p_mk · u_k,         ℓ_m = f(ŷ_m − u_y)      f: (·)² "mse" | |·| "l1" | Huber, δ = 1
    ℓ_m = Σ_k p_mk · |u_k − u_y|                           "was": the Wasserstein-1 distance
                                                            of p_m to the gold point mass

NTL-WAS on the ten digits is the digit EMD of the NTIL paper's baseline (``emdlm.DigitEMDLoss``);
ntloss averages it over number tokens and adds ``reweigh``.

Number level (``NumberLevelLoss``). For every gold number s (a span of number tokens,
:func:`emdlm.number_spans.find_number_spans`) with its tokens' expected values t_m = Σ_k p_mk·v_k:

    Ŷ_s = Σ_{m∈s} t_m · 10^place_m,   Y_s = Σ_{m∈s} v_y(m) · 10^place_m,
    ℓ_s = |Ŷ_s − Y_s| / (|Ŷ_s| + |Y_s| + ε),   ε = 2^-23 (float32's eps, as ntloss's y dtype)

``reweigh`` (ntloss's default True): with μ = Σ_k softmax(z_m)_k over the candidates (the mass
the model puts on them; for the number level at the number's first token) and R the largest
value ℓ can take (token level: f(class range in leading-place units), the range itself for
"was"; number level: 1),

    ℓ ← ℓ·μ + 1.01·R·(1 − μ)

so a gold number whose mass went to text tokens costs more than the worst number. The gradient
flows through μ (ntloss does not detach it).

Averaging and mixing (ntloss recommends CE + 0.3·NTL):

    total = CE + λ · NTL,   NTL = Σ ℓ / D,   D = items scored ("number": number tokens / numbers,
    ntloss's mean) or n, the counted labels ("token": ``reduction="sum"`` is then Σ CE_t + λ·Σ ℓ,
    exact under gradient accumulation).

``reduction="sum"`` returns n · total (the CE sum plus n·λ·NTL).

NOTE (departures from ntloss, all where ntloss has no answer): multi-digit tokens ('Ġ123',
'45') are scored over their class (``digits_only=False``, the "classes" preset); ntloss scores
only the bare '0'..'9' (its ``digit_level`` default; preset "ntloss" and ``digits_only=True``
reproduce it). The token-level R is per class (f of the class's value range); for the ten
digits it is ntloss's global max distance. Number values are taken in float64, shifted per
number above 300 digits (no overflow); ntloss caps the place at 10^19. ``join_decimal``
(ntloss's ``float_level``) reads "12.34" as 12.34 where ntloss reads 1234: ℓ_s is scale-free,
so the two agree, except for a chain "1.2.3" (ntloss: one number, emdlm: 1.2 and 3).

Shape notation: B batch, T time, V vocabulary, N = B*T positions, M number tokens, K candidates
per token (widest class present), S numbers.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_reduction,
    token_log_probs,
)
from emdlm.functional.digit_emd import masked_class_softmax
from emdlm.functional.ntil import ClassCandidates, class_candidates
from emdlm.functional.number_value import number_values, value_place_shift
from emdlm.number_spans import NumberSpans, SpanDraft
from emdlm.numbers import NumberVocab

DistanceKind = Literal["mse", "l1", "huber"]
#: The token-level loss: a distance f of ŷ − u_y ("mse" / "l1" / "huber", NTL-MSE family) or
#: "was", the Wasserstein-1 distance Σ_k p_k·|u_k − u_y| (NTL-WAS).
TokenLoss = Literal["mse", "l1", "huber", "was"]
NTLLevel = Literal["token", "number"]
NTLAveraging = Literal["number", "token"]
#: ntloss's ε in the number-level ratio: ``torch.finfo(y.dtype).eps`` with y float32.
NUMBER_LEVEL_EPS = float(torch.finfo(torch.float32).eps)
#: ntloss's factor on the worst distance in ``reweigh_fn``.
REWEIGH_FACTOR = 1.01


@dataclass(frozen=True)
class NTLSettings:
    """The knobs of both NTL objectives (``lam`` is what ``objective.lam_schedule`` sets).

    Attributes:
        lam: λ, weight of NTL in CE + λ·NTL (ntloss's recommendation: 0.3).
        level: "token" (NTL-MSE family) or "number" (number-level).
        loss: the token level's loss: f of ŷ − u_y, "mse", "l1" or "huber" (δ = 1,
            ``F.huber_loss``'s default), or "was" (Σ_k p_k·|u_k − u_y|, NTL-WAS).
        reweigh: scale by the candidates' mass μ (module docstring).
        averaging: "number" (mean over the scored items, ntloss) or "token" (Σ / n).
        reduction: "mean" or "sum".
        ignore_index: label value that is not scored.
        squash_factor: "was" only (ntloss ``NTLoss``'s ``squash_factor``): None keeps the
            distances |u_k − u_y|; a number s > 1 maps them affinely so that the closest wrong
            candidate costs 1 and the farthest s (:func:`squash_distance`).
    """

    lam: float = 0.3
    level: NTLLevel = "token"
    loss: TokenLoss = "mse"
    reweigh: bool = True
    averaging: NTLAveraging = "number"
    reduction: Reduction = "mean"
    ignore_index: int = IGNORE_INDEX
    squash_factor: float | None = None

    def __post_init__(self) -> None:
        check_reduction(self.reduction)
        if self.level not in ("token", "number"):
            raise ValueError(f"level must be 'token' or 'number', got {self.level!r}")
        if self.loss not in ("mse", "l1", "huber", "was"):
            raise ValueError(f"loss must be 'mse', 'l1', 'huber' or 'was', got {self.loss!r}")
        if self.averaging not in ("number", "token"):
            raise ValueError(f"averaging must be 'number' or 'token', got {self.averaging!r}")
        if not (float(self.lam) >= 0.0 and float(self.lam) < float("inf")):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam!r}")
        check_squash_factor(self.squash_factor, self.loss)


def check_squash_factor(squash_factor: float | None, loss: TokenLoss) -> None:
    """Raises ValueError unless ``squash_factor`` is None or a finite real > 1 with loss "was"
    (ntloss takes it on ``NTLoss`` only, and asserts > 1: at 1 every wrong digit costs the same,
    the loss of CE's shape)."""
    if squash_factor is None:
        return
    real = isinstance(squash_factor, numbers.Real) and not isinstance(squash_factor, bool)
    if not (real and math.isfinite(float(squash_factor)) and float(squash_factor) > 1.0):
        raise ValueError(
            f"squash_factor must be a finite number > 1, or None, got {squash_factor!r}"
        )
    if loss != "was":
        raise ValueError(f"squash_factor applies to NTL-WAS (loss 'was') only, got loss {loss!r}")


@dataclass(frozen=True)
class SquashTable:
    """Per number token m, the affine map of :func:`squash_distance`: d_min [M] (the smallest
    nonzero distance between two candidates of its class) and scale [M] (s − 1)/(d_max − d_min),
    d_max the class's value range (0 when d_max = d_min: every wrong candidate then costs 1)."""

    d_min: torch.Tensor
    scale: torch.Tensor

    def row_slice(self, lo: int, hi: int) -> SquashTable:
        """The rows [lo, hi) (a chunk's number tokens)."""
        return SquashTable(d_min=self.d_min[lo:hi], scale=self.scale[lo:hi])


def squash_table(
    values: torch.Tensor, mask: torch.Tensor, squash_factor: float
) -> SquashTable:
    """The :class:`SquashTable` of candidate values u [M, K] (sorted within the class, real
    members left, ``mask`` [M, K]) for factor s.

    ntloss 0.3.2 (``NTLoss.setup_distance_lookup``) takes d_min and d_max over its one table of
    number tokens (1 and 9 on the ten digits); emdlm takes them per class (the NOTE above). The
    smallest nonzero distance of sorted values is the smallest positive gap of neighbours."""
    gaps = values[:, 1:] - values[:, :-1]  # [M, K-1]
    real = mask[:, 1:] & mask[:, :-1] & (gaps > 0)
    d_min = gaps.masked_fill(~real, float("inf")).amin(dim=1) if gaps.shape[1] else (
        values.new_full(values.shape[:1], float("inf")))
    top = values.masked_fill(~mask, float("-inf")).amax(dim=1)  # [M]
    low = values.masked_fill(~mask, float("inf")).amin(dim=1)  # [M]
    d_max = top - low
    has_gap = torch.isfinite(d_min)
    d_min = torch.where(has_gap, d_min, torch.zeros_like(d_min))
    spread = d_max - d_min
    scale = torch.where(
        spread > 0, (squash_factor - 1.0) / spread.clamp_min(1e-300), torch.zeros_like(spread)
    )
    return SquashTable(d_min=d_min, scale=scale)


def squash_distance(d: torch.Tensor, table: SquashTable) -> torch.Tensor:
    """ntloss's squashed distance: 0 at d = 0, else 1 + (d − d_min)·(s − 1)/(d_max − d_min), so
    d_min ↦ 1 and d_max ↦ s (Zausinger et al., ICML 2025; ntloss 0.3.2
    ``NTLoss.setup_distance_lookup``). ``d`` [M, K] or [M]; the table's rows broadcast."""
    d_min, scale = table.d_min, table.scale
    if d.dim() == 2:
        d_min, scale = d_min.unsqueeze(1), scale.unsqueeze(1)
    return torch.where(d > 0, 1.0 + (d - d_min) * scale, torch.zeros_like(d))


def distance(d: torch.Tensor, kind: DistanceKind) -> torch.Tensor:
    """f(d): d² ("mse"), |d| ("l1") or Huber with δ = 1 (0.5·d² below 1, |d| − 0.5 above)."""
    if kind == "mse":
        return d * d
    if kind == "l1":
        return d.abs()
    small = d.abs() < 1.0
    return torch.where(small, 0.5 * d * d, d.abs() - 0.5)


def distance_slope(d: torch.Tensor, kind: DistanceKind) -> torch.Tensor:
    """f'(d), the subgradient autograd takes (sign(0) = 0)."""
    if kind == "mse":
        return 2.0 * d
    if kind == "l1":
        return torch.sign(d)
    return d.clamp(-1.0, 1.0)


def leading_units(candidates: ClassCandidates, spans: NumberSpans) -> torch.Tensor:
    """[M, 1] float64 10^(L − 1): one unit in the gold token's leading place."""
    return torch.pow(10.0, (spans.num_digits - 1).double()).unsqueeze(1)


def worst_distance(
    candidates: ClassCandidates,
    unit: torch.Tensor,
    kind: TokenLoss,
    squash: SquashTable | None = None,
) -> torch.Tensor:
    """[M] R = f((max − min of the class values) / unit): the largest value ℓ can take ("was":
    the range itself, as "l1"; squashed by ``squash`` if given).

    ntloss: max(|f(min, max)|, |f(max, min)|) over its number tokens (81 for MSE on 0..9); its
    ``NTLoss``: the largest entry of its distance table (9 on 0..9, s when squashed)."""
    values = candidates.values  # [M, K] sorted by value within the class, real members left
    top = values.masked_fill(~candidates.mask, float("-inf")).amax(dim=1)  # [M]
    low = values.masked_fill(~candidates.mask, float("inf")).amin(dim=1)  # [M]
    worst = distance((top - low) / unit.squeeze(1), "l1" if kind == "was" else kind)
    return worst if squash is None else squash_distance(worst, squash)


def token_base(
    p: torch.Tensor,
    values: torch.Tensor,
    gold: torch.Tensor,
    kind: TokenLoss,
    *,
    grad: bool,
    squash: SquashTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ℓ⁰_m before reweigh and, if ``grad``, ∂ℓ⁰/∂c [M, K] (c the candidates' logits,
    p = softmax(c)) in closed form:

        f(ŷ − u_y):          ∂/∂c_k = f'(ŷ − u_y) · p_k (u_k − ŷ)       ("mse" / "l1" / "huber")
        Σ_k p_k·d_k:         ∂/∂c_k = p_k (d_k − ℓ⁰)                    ("was")

    with d_k = |u_k − u_y|, or its :func:`squash_distance` when ``squash`` is given ("was").

    Args (float64): p [M, K] (0 on padding), values u [M, K], gold u_y [M], kind, squash.
    """
    if kind == "was":
        cost = (values - gold.unsqueeze(1)).abs()  # [M, K]
        if squash is not None:
            cost = squash_distance(cost, squash)
        base = (p * cost).sum(dim=-1)  # [M]
        return base, p * (cost - base.unsqueeze(1)) if grad else None
    y_hat = (p * values).sum(dim=-1)  # [M]
    d = y_hat - gold  # [M]
    if not grad:
        return distance(d, kind), None
    dy = p * (values - y_hat.unsqueeze(1))  # [M, K] ∂ŷ/∂c
    return distance(d, kind), distance_slope(d, kind).unsqueeze(1) * dy


def token_squash(
    values: torch.Tensor, candidates: ClassCandidates, settings: NTLSettings
) -> SquashTable | None:
    """The :class:`SquashTable` of the candidates' values u [M, K] when ``settings`` squash
    (None otherwise)."""
    if settings.squash_factor is None:
        return None
    return squash_table(values, candidates.mask, float(settings.squash_factor))


def log_mass(class_logits: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[M] log μ = logsumexp(z[candidates]) − logsumexp(z): log of the candidates' mass."""
    masked = class_logits.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(masked, dim=-1) - lse


def token_ntl(
    class_logits: torch.Tensor,
    lse: torch.Tensor,
    candidates: ClassCandidates,
    spans: NumberSpans,
    settings: NTLSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per number token ℓ_m (reweighed if asked) and μ_m; both [M] float64.

    Args:
        class_logits: [M, K] logits of the candidates (or log-probabilities, with lse = 0).
        lse: [M] logsumexp of the full logit row (0 for log-probabilities).
        candidates, spans: the batch's class candidates and number spans.
        settings: loss, reweigh.
    """
    z = class_logits.double()
    unit = leading_units(candidates, spans)  # [M, 1]
    values = candidates.values / unit  # [M, K] u, leading-place units
    gold = values.gather(1, spans.gold_column.unsqueeze(1)).squeeze(1)  # [M]
    p = masked_class_softmax(z, candidates.mask)  # [M, K]
    squash = token_squash(values, candidates, settings)
    per_token, _ = token_base(p, values, gold, settings.loss, grad=False, squash=squash)  # [M]
    mass = torch.exp(log_mass(z, candidates.mask, lse.double()))  # [M]
    if settings.reweigh:
        worst = REWEIGH_FACTOR * worst_distance(candidates, unit, settings.loss, squash)  # [M]
        per_token = per_token * mass + worst * (1.0 - mass)
    return per_token, mass


def first_tokens(spans: NumberSpans) -> torch.Tensor:
    """[S] long: index in [0, M) of each number's first token (no host sync)."""
    arange = torch.arange(spans.number_id.numel(), device=spans.number_id.device)
    start = torch.zeros(spans.n_numbers, dtype=torch.long, device=arange.device)
    return start.scatter_reduce(0, spans.number_id, arange, reduce="amin", include_self=False)


def number_ntl(
    class_logits: torch.Tensor,
    lse: torch.Tensor,
    candidates: ClassCandidates,
    spans: NumberSpans,
    settings: NTLSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per number ℓ_s (reweighed at the first token if asked) and μ at that token; [S] float64.

    Arguments as :func:`token_ntl`.
    """
    z = class_logits.double()
    p = masked_class_softmax(z, candidates.mask)  # [M, K]
    t = (p * candidates.values).sum(dim=-1)  # [M] expected token value
    gold_t = candidates.values.gather(1, spans.gold_column.unsqueeze(1)).squeeze(1)  # [M]
    # Scale-free ratio: places shifted per number above 300 digits (no overflow).
    shift = value_place_shift(spans.place, spans.num_digits, spans.number_id, spans.n_numbers)
    place = spans.place - shift[spans.number_id]  # [M]
    ones = torch.ones(spans.n_numbers, dtype=torch.float64, device=z.device)
    x = number_values(t, place, spans.number_id, ones)  # [S] Ŷ
    y = number_values(gold_t, place, spans.number_id, ones)  # [S] Y
    per_number = (x - y).abs() / (x.abs() + y.abs() + NUMBER_LEVEL_EPS)  # [S]
    first = first_tokens(spans)  # [S]
    mass = torch.exp(log_mass(z[first], candidates.mask[first], lse.double()[first]))  # [S]
    if settings.reweigh:
        per_number = per_number * mass + REWEIGH_FACTOR * (1.0 - mass)
    return per_number, mass


def ntl_terms(
    class_logits: torch.Tensor,
    lse: torch.Tensor,
    candidates: ClassCandidates,
    spans: NumberSpans,
    settings: NTLSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ, μ) per scored item of ``settings.level``: number tokens [M] or numbers [S]."""
    fn = token_ntl if settings.level == "token" else number_ntl
    return fn(class_logits, lse, candidates, spans, settings)


def class_width(draft: SpanDraft, vocab: NumberVocab) -> torch.Tensor:
    """0-d long: the size of the widest class among the draft's number tokens (0 with none),
    read with the call's other sizes (no host sync here)."""
    is_num = draft.num.reshape(-1)  # [N]
    n_cls = vocab.num_classes
    token_class = vocab.token_class.index_select(0, draft.idx.reshape(-1))  # [N]
    slot = torch.where(is_num, token_class, n_cls)
    per_class = torch.zeros(n_cls + 1, dtype=torch.long, device=is_num.device)
    per_class.index_add_(0, slot, torch.ones_like(slot))
    present = per_class[:n_cls] > 0  # [C]
    return (vocab.class_mask.sum(dim=1) * present).amax()


def resolve_with_width(
    draft: SpanDraft, vocab: NumberVocab
) -> tuple[NumberSpans, ClassCandidates]:
    """The spans and class candidates of a draft in ONE host sync (sizes, the widest class and
    the label-range check read together); raises the range error for labels outside [0, V)."""
    n_tok, n_num, n_bad, width = torch.cat(
        [draft.sizes(), class_width(draft, vocab).reshape(1)]
    ).tolist()  # the host sync of the call
    if n_bad:
        raise draft.range_error()
    spans = draft.finish(n_tok, n_num)
    return spans, class_candidates(vocab, spans, width=width)


def ntl_denominator(n_items: int, n_tokens: torch.Tensor, averaging: NTLAveraging) -> torch.Tensor:
    """D of NTL = Σℓ / D: the items scored ("number") or the counted labels n ("token"), ≥ 1."""
    if averaging == "token":
        return n_tokens.double().clamp_min(1)
    return torch.full((), float(max(n_items, 1)), dtype=torch.float64, device=n_tokens.device)


def ntl_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    spans: NumberSpans,
    candidates: ClassCandidates,
    settings: NTLSettings,
) -> LossOutput:
    """CE + λ·NTL on full logits with plain autograd (the oracle of the chunked paths).

    Args:
        logits: z [..., V], any float dtype (CE in float32, float64 kept; NTL in float64).
        labels: y [...] aligned with the logits, already checked (shapes, range).
        spans: the labels' number spans (:func:`emdlm.functional.ntil.resolve_spans`).
        candidates: their class candidates (:func:`emdlm.functional.ntil.class_candidates`).
        settings: :class:`NTLSettings`.

    Returns:
        LossOutput; components "ce", "ntl" (Σℓ/D, before λ), "number_mass" (mean μ over the
        scored items), "n_digit_tokens" (M), "n_numbers" (S, number level) and "n_tokens".
        With no number in the batch NTL is an explicit 0 and the loss is CE's.
    """
    tokens = token_log_probs(logits, labels, settings.ignore_index)
    ce, count = tokens.ce, tokens.count
    # log q at the candidates: softmax over them equals softmax over their logits, and the
    # candidates' mass is Σ exp(log q); the backward of log q carries the lse term.
    rows = spans.flat_index.unsqueeze(1).expand_as(candidates.ids)  # [M, K]
    class_log_q = tokens.log_q[rows, candidates.ids]  # [M, K]
    lse = torch.zeros(spans.n_tokens, dtype=torch.float64, device=ce.device)
    per_item, mass = ntl_terms(class_log_q, lse, candidates, spans, settings)
    n_items = per_item.numel()
    denom = ntl_denominator(n_items, count, settings.averaging)
    ntl = per_item.sum() / denom  # 0-d float64 (an explicit 0 with no number)
    count_f = count.to(ce.dtype)
    ce_sum = ce.sum()
    scale = count_f if settings.reduction == "sum" else torch.ones_like(count_f)
    ce_part = ce_sum if settings.reduction == "sum" else ce_sum / count_f.clamp_min(1)
    loss = ce_part + (settings.lam * ntl * scale.double()).to(ce.dtype)
    components = ntl_components(
        ce_sum.detach() / count_f.clamp_min(1), ntl, mass, spans, count, settings
    )
    return LossOutput(loss=loss, components=components)


def ntl_components(
    ce_mean: torch.Tensor,
    ntl: torch.Tensor,
    mass: torch.Tensor,
    spans: NumberSpans,
    count: torch.Tensor,
    settings: NTLSettings,
) -> dict[str, torch.Tensor | float]:
    """The components both paths report (detached, in CE's dtype)."""
    dtype = ce_mean.dtype
    components: dict[str, torch.Tensor | float] = {
        "ce": ce_mean.detach(),
        "ntl": ntl.detach().to(dtype),
        "number_mass": (mass.detach().sum() / max(mass.numel(), 1)).to(dtype),
        "n_digit_tokens": torch.tensor(spans.n_tokens),
        "n_tokens": count,
    }
    if settings.level == "number":
        components["n_numbers"] = torch.tensor(spans.n_numbers)
    return components


__all__ = [
    "NUMBER_LEVEL_EPS",
    "REWEIGH_FACTOR",
    "DistanceKind",
    "NTLSettings",
    "SquashTable",
    "TokenLoss",
    "check_squash_factor",
    "class_width",
    "distance",
    "distance_slope",
    "first_tokens",
    "leading_units",
    "log_mass",
    "ntl_components",
    "ntl_denominator",
    "ntl_loss",
    "ntl_terms",
    "number_ntl",
    "resolve_with_width",
    "squash_distance",
    "squash_table",
    "token_base",
    "token_ntl",
    "token_squash",
    "worst_distance",
]
