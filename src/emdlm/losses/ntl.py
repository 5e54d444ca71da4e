"""NTLMSELoss, NTLWASLoss and NumberLevelLoss: CE + λ·NTL of ntloss (ICML 2025), on every emdlm
tokenizer.

Formulas, ntloss's semantics and emdlm's departures (NOTE lines): :mod:`emdlm.functional.ntl`.
The logits path is the plain-autograd reference (:func:`emdlm.functional.ntl.ntl_loss`); the
from-hidden path runs :class:`emdlm.ops.objectives.ntl.NTLObjective` through the chunked engine.

Presets (explicit keyword arguments override them):

* ``"classes"`` (default): every number token is scored over its class
  (:class:`emdlm.numbers.NumberVocab`: same digit count and space marker), so GPT-2's 'Ġ123' or
  a LLaMA-3-like '45' count as the ten digits do.
* ``"ntloss"``: only the ten bare tokens '0'..'9' are number tokens (ntloss's ``digit_level``
  default); with ``averaging="number"`` (ntloss's mean) the NTL term equals ntloss's own output
  (tests/test_ntl.py pins it on GPT-2's and the char tokenizer's vocabularies).

Per-token ``loss_weights=`` w (both routes; always the chunked objective,
:class:`emdlm.ops.objectives.ntl.NTLObjective`): CE is Σ_t w_t·CE_t / n with n = Σ_t w_t over
the counted labels, and with item weights ω (token level: ω_m = w_m; number level: ω_s = the
mean weight of the number's tokens)

    NTL = Σ ω·ℓ / Σ ω   (averaging="number")     or     Σ ω·ℓ / n   ("token"),

"number_mass" the same weighted mean of μ, "sum" = n·(CE + λ·NTL). A token of weight 0 is an
ignored label before the numbers are found. Against ntloss's ``loss_weights`` (pinned in
tests/test_ntl.py): at token level the same Σ w·ℓ / Σ w over number tokens (ntloss divides by
max(Σ w, eps), emdlm's all-zero weights give an exact 0 from CE as well); ntloss refuses only
negative weights (emdlm also NaN and ±inf, and a non-float tensor); ntloss keeps a weight-0
token inside its number (number level: "123" with the "2" weighted 0 is still 123 there),
emdlm ends the number there (1 and 3, as with the "2" ignored); and
ntloss weighs a number by its first digit's weight, emdlm by its tokens' mean weight (equal when
a number's tokens share one weight).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels_shapes,
    compute_dtype,
)
from emdlm.functional.ntil import draft_spans
from emdlm.functional.ntl import (
    DistanceKind,
    NTLAveraging,
    NTLLevel,
    NTLSettings,
    TokenLoss,
    first_tokens,
    ntl_loss,
    resolve_with_width,
)
from emdlm.losses._number_vocab import NumberVocabSource, NumericLoss
from emdlm.number_spans import SpanOptions
from emdlm.numbers import NumberVocab
from emdlm.ops.chunk_objective import count_divisor
from emdlm.ops.head import head_logits
from emdlm.ops.objectives.ntl import NTLObjective

NTLPreset = Literal["classes", "ntloss"]
_DIGITS_ONLY = {"classes": False, "ntloss": True}


class _NTLBase(NumericLoss):
    """What the NTL losses share: the number vocabulary, presets, settings and the two paths.

    Each subclass fixes the ``level`` ("token" or "number") and passes its own options (the
    token distance ``loss``, number level's ``join_decimal``) to this one constructor.
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)
    level: ClassVar[NTLLevel]
    settings: NTLSettings
    span_options: SpanOptions

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: str,
        lam: float,
        reweigh: bool,
        averaging: NTLAveraging,
        ignore_index: int,
        reduction: Reduction,
        vocab_size: int | None,
        digits_only: bool | None,
        *,
        loss: TokenLoss = "mse",
        join_decimal: bool = False,
        squash_factor: float | None = None,
    ) -> None:
        super().__init__()
        if preset not in _DIGITS_ONLY:
            raise ValueError(f"preset must be one of {tuple(_DIGITS_ONLY)}, got {preset!r}")
        self.preset = preset
        self.settings = NTLSettings(
            lam=lam,
            level=self.level,
            loss=loss,
            reweigh=bool(reweigh),
            averaging=averaging,
            reduction=reduction,
            ignore_index=ignore_index,
            squash_factor=squash_factor,
        )
        self.span_options = SpanOptions(
            digits_only=_DIGITS_ONLY[preset] if digits_only is None else bool(digits_only),
            join_decimal=bool(join_decimal),
            signed=False,  # the sign cancels in every NTL term
        )
        self._numbers = NumberVocabSource(
            tokenizer_or_number_vocab, vocab_size, self.span_options.digits_only
        )

    def _draft(
        self, logits: torch.Tensor, labels: torch.Tensor, number_mask: torch.Tensor | None
    ) -> tuple[Any, NumberVocab, torch.Tensor]:
        """Shape checks (no host sync), the vocabulary, and the labels' span draft."""
        check_logits_labels_shapes(logits, labels)
        vocab = self._vocab_for(logits)
        labels = labels.to(logits.device)
        draft = draft_spans(
            labels,
            vocab,
            self.span_options,
            ignore_index=self.settings.ignore_index,
            number_mask=number_mask,
        )
        return draft, vocab, labels

    def logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, *, number_mask: torch.Tensor | None = None
    ) -> LossOutput:
        """CE + λ·NTL of ``logits`` [..., V] against ``labels`` [...] (aligned, no shift).

        ``number_mask`` (bool, the labels' shape; None = every token): a number is scored only
        if all its number tokens are True (:func:`emdlm.number_spans.find_number_spans`); CE is
        taken on every counted label. One host sync (sizes and the label-range check).
        """
        draft, vocab, labels = self._draft(logits, labels, number_mask)
        spans, candidates = resolve_with_width(draft, vocab)
        return ntl_loss(logits, labels, spans, candidates, self.settings)

    def chunk_objective(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        number_mask: torch.Tensor | None = None,
    ) -> tuple[NTLObjective, torch.Tensor]:
        """:class:`emdlm.ops.objectives.ntl.NTLObjective` of ``labels`` against ``logits`` [..., V]
        (or ``from_hidden``'s stand-in) and the labels on the logits' device; ``number_mask``
        as in ``forward``."""
        draft, vocab, labels = self._draft(logits, labels, number_mask)
        return NTLObjective(draft, vocab, self.settings), labels

    def _after_from_hidden(
        self,
        out: LossOutput,
        objective: Any,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None,
        head: Any,
    ) -> LossOutput:
        """Adds number level's reweigh term through the head (value 0, :meth:`_lse_term`)."""

        def rows_logits(rows: torch.Tensor) -> torch.Tensor:
            h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [S, H]
            return head_logits(h, lm_head_weight, lm_head_bias, head)  # [S, V], as the engine's

        return self._lse_term(out, objective, rows_logits)

    def _after_logits(self, out: LossOutput, objective: Any, logits: torch.Tensor) -> LossOutput:
        """The same term on the chunked logits route (per-token weights)."""

        def rows_logits(rows: torch.Tensor) -> torch.Tensor:
            flat = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
            return flat.to(compute_dtype(logits.dtype))

        return self._lse_term(out, objective, rows_logits)

    def _lse_term(self, out: LossOutput, objective: Any, rows_logits: Any) -> LossOutput:
        """Number level with reweigh: ∂L/∂lse at each number's first token reaches every logit
        of that row (∂lse/∂z = q). Those S rows are scored again (``rows_logits``), with value
        0 and gradient g·q (no host sync: S was read in the engine's one sync)."""
        if objective.lse_grad is None:
            return out
        spans = objective.kept.spans
        assert spans is not None and objective.count is not None
        rows = spans.flat_index.index_select(0, first_tokens(spans))  # [S]
        grad = objective.lse_grad.index_select(0, first_tokens(spans))  # [S] sum units
        if self.settings.reduction == "mean":
            grad = grad / count_divisor(objective.count, torch.float64)
        lse = torch.logsumexp(rows_logits(rows), dim=-1)  # [S]
        term = (grad.to(lse.dtype) * (lse - lse.detach())).sum()  # value 0
        return LossOutput(loss=out.loss + term.to(out.loss.dtype), components=out.components)

    def extra_repr(self) -> str:
        fields = dataclasses.asdict(self.settings)
        return f"preset={self.preset!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in {**fields, **dataclasses.asdict(self.span_options)}.items()
        )


class NTLMSELoss(_NTLBase):
    """CE + λ·NTL-MSE (ntloss ``NTLossDotProduct``): the expected value of each number token
    under the predicted distribution over its candidates against the gold token's value.

        ŷ_m = Σ_k softmax(z_m[candidates])_k · u_k,   ℓ_m = f(ŷ_m − u_y),
        ℓ_m ← ℓ_m·μ_m + 1.01·R·(1 − μ_m)    (reweigh; μ_m the candidates' mass)
        total = CE + λ · Σ_m ℓ_m / D

    with f the squared ("mse"), absolute ("l1") or Huber (δ = 1) distance and u the candidates'
    values in units of the token's leading place (:mod:`emdlm.functional.ntl`).

    Args:
        tokenizer_or_number_vocab: a transformers tokenizer or a :class:`NumberVocab`.
        preset: "classes" (default: every number token over its class) or "ntloss" (the ten
            digits only, as ntloss's default).
        lam: λ (ntloss's recommendation: 0.3); ``objective.lam_schedule`` schedules it.
        loss: "mse" (NTL-MSE), "l1" or "huber".
        reweigh: scale by the candidates' mass (ntloss's default True).
        averaging: "number" (mean over number tokens, ntloss) or "token" (Σℓ / counted labels:
            with ``reduction="sum"`` exact under gradient accumulation).
        ignore_index: label value that is not scored.
        reduction: "mean" or "sum" (n · the mean-reduced total).
        vocab_size: logit rows V when building from a tokenizer (default: the logits').
        digits_only: override the preset's choice of number tokens.

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T], number_mask=None)``;
    ``out.components``: "ce", "ntl" (Σℓ/D), "number_mass" (mean μ), "n_digit_tokens" (M),
    "n_tokens". With no number in the batch the loss is CE's.

    Example:
        >>> loss_fn = NTLMSELoss(tokenizer, preset="ntloss")        # doctest: +SKIP
        >>> out = loss_fn(logits[:, :-1], input_ids[:, 1:])       # doctest: +SKIP

    Shape notation: B batch, T time, V vocabulary rows, M number tokens.
    """

    level: ClassVar[NTLLevel] = "token"

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: NTLPreset = "classes",
        lam: float = 0.3,
        loss: DistanceKind = "mse",
        reweigh: bool = True,
        averaging: NTLAveraging = "number",
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        vocab_size: int | None = None,
        *,
        digits_only: bool | None = None,
    ) -> None:
        super().__init__(
            tokenizer_or_number_vocab, preset, lam, reweigh, averaging, ignore_index, reduction,
            vocab_size, digits_only, loss=loss,
        )


class NTLWASLoss(_NTLBase):
    """CE + λ·NTL-WAS (ntloss ``NTLoss``, the ICML paper's default NTL): the Wasserstein-1
    distance between the predicted distribution over each number token's candidates and the
    gold token.

        ℓ_m = Σ_k softmax(z_m[candidates])_k · |u_k − u_y|,
        ℓ_m ← ℓ_m·μ_m + 1.01·R·(1 − μ_m)    (reweigh; μ_m the candidates' mass, R the range)
        total = CE + λ · Σ_m ℓ_m / D

    with u the candidates' values in units of the token's leading place
    (:mod:`emdlm.functional.ntl`). On the ten digits without reweigh, ℓ_m is the digit EMD of the
    NTIL paper's baseline (:class:`emdlm.DigitEMDLoss`); this class adds ntloss's averaging
    (the mean over number tokens) and ``reweigh``.

    Takes the arguments of :class:`NTLMSELoss` except ``loss``, and:

    Args:
        squash_factor: None (default: the distances |u_k − u_y|) or s > 1 (ntloss ``NTLoss``'s
            ``squash_factor``): each distance d > 0 becomes 1 + (d − d_min)·(s − 1)/(d_max −
            d_min), so the closest wrong candidate costs 1 and the farthest s (R becomes s);
            d_min, d_max per class (on the ten digits 1 and 9, ntloss's table; s = 9 there is
            the unsquashed loss).

    Components: those of :class:`NTLMSELoss`.

    Example:
        >>> loss_fn = NTLWASLoss(tokenizer, preset="ntloss")        # doctest: +SKIP
        >>> out = loss_fn(logits[:, :-1], input_ids[:, 1:])       # doctest: +SKIP
    """

    level: ClassVar[NTLLevel] = "token"

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: NTLPreset = "classes",
        lam: float = 0.3,
        reweigh: bool = True,
        averaging: NTLAveraging = "number",
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        vocab_size: int | None = None,
        *,
        digits_only: bool | None = None,
        squash_factor: float | None = None,
    ) -> None:
        super().__init__(
            tokenizer_or_number_vocab, preset, lam, reweigh, averaging, ignore_index, reduction,
            vocab_size, digits_only, loss="was", squash_factor=squash_factor,
        )


class NumberLevelLoss(_NTLBase):
    """CE + λ·number-level NTL (ntloss ``NumberLevelLoss``): a symmetric relative error of each
    gold number's value against the value built from the expected token values.

        Ŷ_s = Σ_{m∈s} t_m·10^place_m,   ℓ_s = |Ŷ_s − Y_s| / (|Ŷ_s| + |Y_s| + ε),
        ℓ_s ← ℓ_s·μ_first + 1.01·(1 − μ_first)    (reweigh)
        total = CE + λ · Σ_s ℓ_s / D

    Takes the arguments of :class:`NTLMSELoss` except ``loss``, and:

    Args:
        float_level: a bare '.' between two runs joins them into one number (ntloss's
            ``float_level``; :func:`emdlm.number_spans.find_number_spans`'s ``join_decimal``).

    ``averaging="number"`` is the mean over numbers (ntloss). Components: those of
    :class:`NTLMSELoss` plus "n_numbers" (S); "number_mass" is the mean μ at first tokens.
    """

    level: ClassVar[NTLLevel] = "number"

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: NTLPreset = "classes",
        lam: float = 0.3,
        reweigh: bool = True,
        float_level: bool = False,
        averaging: NTLAveraging = "number",
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        vocab_size: int | None = None,
        *,
        digits_only: bool | None = None,
    ) -> None:
        super().__init__(
            tokenizer_or_number_vocab, preset, lam, reweigh, averaging, ignore_index, reduction,
            vocab_size, digits_only, join_decimal=float_level,
        )


__all__ = ["NTLMSELoss", "NTLWASLoss", "NumberLevelLoss"]
