"""NTILLoss and DigitEMDLoss: CE mixed with the NTIL numeric objectives (presets, checks, logging).

Source: NTIL paper (Fei et al., ACL 2025) Eq. 1–4 and Appendix A/C/D.3; official code
xfey/NTIL (ntil.py for NTIL, emd.py for the EMD baseline). Formulas live in
:mod:`emdlm.functional.ntil` (reference) and :mod:`emdlm.ops.objectives.ntil` (the chunk
objective of the fast logits path and of ``from_hidden``).

Presets (explicit keyword arguments override them):

* ``"stable"`` (the default): the ``"paper"`` preset below with three stabilisers (measured in
  docs/results/ntil_grad_norms.md; each can be switched off by its keyword):
  NOTE: the dynamic ratio sg(CE/NTIL) is capped at ``max_ratio`` = 10 (its unbounded growth as
  NTIL → 0 multiplied NTIL's gradient by up to thousands).
  NOTE: W·EMD is averaged within each number with normalised weights Σ W·EMD / Σ W, then over
  numbers (``per_number``): one long number no longer dominates the batch's EMD and, through
  the ratio, silences the other rows' numbers (433x in a unit case).
  NOTE: the magnitude's smoothing is u = max(unit, 0.1·|Y|) (``magnitude_floor``), bounding
  its gradient for a prediction near 0 (the per-term maximum fell from 630 to 18 over 200
  random 6-digit cases).
* ``"paper"``: the paper's formulas as written, no stabiliser: λ = 0.3, α = β = σ = 0.2,
  emd_weight = 1, dynamic mix; decimals joined into one number ('3', '.', '14' is 3.14, '.5' is
  0.5) and a leading minus makes a number negative; multi-digit tokens scored with the class
  EMD; W·EMD averaged over all number tokens of the batch, relative and magnitude over all
  numbers of the batch; the paper's Eq. 2–3 with the least smoothing that keeps them finite
  (relative: none, 0/0 := 0; magnitude: one unit in the number's last place).
* ``"official"``: reproduces xfey/NTIL: only the ten tokens '0'..'9' are scored, spans are
  maximal digit runs (any other token ends them); each term is averaged within a batch row and
  the rows are averaged (rows without digits count as 0); relative |X−Y|/(max(X,Y)+1) with 0
  where X == Y; magnitude log((max+1)/(min+1)); total = CE + λ·sg(CE/NTIL)·NTIL with CE the mean
  over all counted tokens. With ``value_mode="argmax"`` it is deterministic and equals the
  official outputs (see the ambiguities in the NOTE lines of this docstring).

``averaging="token"`` (either preset): every NTIL term is a sum over the batch divided by the
number n of counted labels, CE's denominator. With ``mix="static"`` and ``reduction="sum"`` the
loss is Σ_t CE_t + λ·Σ(NTIL terms), a plain sum over tokens and numbers, so dividing by the token
count of the whole accumulated / all-process batch (``make_compute_loss_func``) makes gradient
accumulation and DDP exact: 4 x 2 micro-batches give the gradient of 8 x 1. The dynamic mix
λ·sg(CE/NTIL) is a ratio of batch means (sums) and cannot be exact under accumulation with any
averaging; nor can the "batch" / "row" means. See :mod:`emdlm.functional.ntil`.

NOTE (official preset, resolved ambiguities):
  - X is built once per number and reused by relative and magnitude; the official code draws
    separate Gumbel noise for each (equal in argmax mode).
  - The dynamic ratio is sg(CE/(NTIL + 1e-10)) as the official code, but 0 where NTIL is
    exactly 0 (same value; no 1e10-sized factor then). The paper preset uses sg(CE/NTIL),
    0 where NTIL ≤ 1e-12 (emdlm.functional.ntil.mix_coefficient).
  - The NTIL terms are computed in float64 (the official code: in the logits' dtype). Its
    straight-through one-hot y_hard − y_soft + y_soft is exact in floating point, so X agrees
    exactly for runs of up to 7 digits; longer runs are rounded by its float32 sums, not here.
  - Rows are the leading dims of the labels ([B, T] -> B rows; 1-D labels are one row), not a
    batch size cached at the first call; bad inputs raise errors instead of returning 0.
  - value_mode defaults to "gumbel" (official τ = 0.1, noise 0.01·Gumbel, straight-through).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_logits_labels_shapes,
)
from emdlm.functional.ntil import (
    NTILSettings,
    class_candidates,
    draft_spans,
    ntil_loss,
    resolve_spans,
    sample_noise,
)
from emdlm.losses._number_vocab import NumberVocabSource, NumericLoss
from emdlm.number_spans import SpanOptions
from emdlm.ops.chunked import chunked_logits_loss
from emdlm.ops.head import DEFAULT_CHUNK_ELEMENTS, HeadOptions, default_chunk_rows
from emdlm.ops.objectives.ntil import NTILObjective

Preset = Literal["stable", "paper", "official"]
Implementation = Literal["fused", "reference"]

#: Stable preset's cap on the dynamic ratio sg(CE/NTIL) (docs/results/ntil_grad_norms.md).
STABLE_MAX_RATIO = 10.0
#: Stable preset's ρ in the magnitude smoothing u = max(unit, ρ·|Y|)
#: (docs/results/ntil_grad_norms.md).
STABLE_MAGNITUDE_FLOOR = 0.1
#: Default of ``max_ratio``: take the preset's value (None means "no cap", as in EMOLoss).
_FROM_PRESET = "preset"

# preset -> (settings overrides, span options)
_PAPER_SPANS = {"join_decimal": True, "signed": True, "digits_only": False}
_PRESETS: dict[str, tuple[dict[str, Any], dict[str, bool]]] = {
    "stable": (
        {
            "averaging": "batch",
            "smoothing": "paper",
            "mix_eps": 0.0,
            "max_ratio": STABLE_MAX_RATIO,
            "per_number": True,
            "magnitude_floor": STABLE_MAGNITUDE_FLOOR,
        },
        _PAPER_SPANS,
    ),
    "paper": (
        {
            "averaging": "batch",
            "smoothing": "paper",
            "mix_eps": 0.0,
            "max_ratio": None,
            "per_number": False,
            "magnitude_floor": 0.0,
        },
        _PAPER_SPANS,
    ),
    "official": (
        {
            "averaging": "row",
            "smoothing": "official",
            "mix_eps": 1e-10,
            "max_ratio": None,
            "per_number": False,
            "magnitude_floor": 0.0,
        },
        {"join_decimal": False, "signed": False, "digits_only": True},
    ),
}


class NTILLoss(NumericLoss):
    """CE + NTIL (NTIL paper Eq. 4, mixed with CE as in the official code).

        NTIL  = emd_weight · mean(W·EMD) + α · mean(relative) + β · mean(magnitude)
        total = CE + λ · sg(CE / NTIL) · NTIL      (mix="dynamic")   or   CE + λ · NTIL ("static")

    with W = (1+σ)^(digits to the right), EMD the (class) ordinal EMD of each number token
    (:mod:`emdlm.functional.digit_emd`), relative / magnitude the deviations of the predicted
    value X of each gold number from its value Y (:mod:`emdlm.functional.number_value`), and
    "mean" as set by ``averaging``: over the batch's items ("batch"), of row means ("row"), or
    Σ/n with n the counted labels ("token").

    Args:
        tokenizer_or_number_vocab: a transformers tokenizer or a :class:`NumberVocab`.
        preset: "stable" (default), "paper" or "official" (module docstring).
        lam, alpha, beta, sigma, emd_weight: λ, α, β, σ and the EMD weight (0.3, 0.2, 0.2, 0.2,
            1.0).
        mix: "dynamic" or "static".
        value_mode: "gumbel" (default), "argmax" (deterministic) or "expected".
        tau, noise_scale: Gumbel-softmax temperature (0.1) and noise scale (0.01).
        ignore_index: label value that is not scored.
        reduction: "mean" (CE mean + mix) or "sum" (n · the mean-reduced total, n = counted
            labels: exact CE sum; divide by a global token count such as transformers'
            ``num_items_in_batch`` to get each micro-batch's mean weighted by its token share;
            with mix="static", averaging="token" it is Σ CE_t + λ·Σ NTIL terms, exact under
            accumulation).
        vocab_size: logit rows V when building from a tokenizer (default: taken from the
            logits at the first call; must be ≥ the tokenizer's ids).
        join_decimal, signed, digits_only: span options overriding the preset
            (:func:`emdlm.number_spans.find_number_spans`).
        thousands_separator: None (default, every preset) or e.g. "," to read "1,234" as one
            number (:func:`emdlm.number_spans.find_number_spans`).
        averaging: "batch" (stable / paper: means over the batch's number tokens / numbers), "row"
            (official preset: means of row means) or "token" (sums over the batch divided by
            the counted labels n; with mix="static" the summed loss is a sum over items, exact
            under gradient accumulation), overriding the preset.
        smoothing: "paper"/"official" deviations, overriding the preset.
        implementation: "fused" (default; custom autograd sharing CE's gradient buffer, used
            when the logits require grad) or "reference" (plain autograd).
        generator: torch.Generator for the Gumbel noise (reproducible runs); a call may pass
            its own.
        chunk_elements: the loss's one chunk setting: about V x rows values per chunk of both
            chunked paths, the fused logits path and ``from_hidden`` (rows =
            chunk_elements // V; default ``DEFAULT_CHUNK_ELEMENTS`` = 2^26, 256 MiB of float32,
            :mod:`emdlm.ops.chunked`); a ``chunk_size`` given to ``from_hidden`` wins there.
        max_ratio: cap of the dynamic ratio sg(CE/NTIL) ("preset": 10 for "stable", no cap for
            "paper" and "official"; None: no cap).
        per_number: W·EMD averaged within each number with normalised weights, then over
            numbers (stable: True; paper / official: False, mean over number tokens).
        magnitude_floor: ρ in the magnitude smoothing u = max(unit, ρ·|Y|) (stable: 0.1;
            paper: 0, one unit in the last place; official: 0, u = 1).

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])``, labels aligned with the logits
    (no shift inside), any float dtype (computed in float32, NTIL in float64), non-contiguous
    views accepted. ``out.loss`` is the scalar to back-propagate; ``out.components`` holds
    detached 0-d tensors "ce", "emd" (averaged W·EMD before emd_weight), "relative",
    "magnitude", "ntil" (before mixing), "mix_coef" (λ·sg(CE/NTIL) or λ), "n_numbers",
    "n_digit_tokens" (number tokens), "n_tokens" (counted labels). With no number in the batch
    every NTIL component is an explicit 0 and the loss equals CE. ``number_mask=`` (bool,
    aligned with the labels, in ``forward`` and ``from_hidden``) says which tokens may be scored
    as numbers: a number counts only if all its tokens are in the mask (ntloss issue #65: leave
    option labels or years out); CE stays on every counted label.

    Per-token ``loss_weights=`` w (both routes; always the fused objective): a token of weight
    0 is an ignored label, also inside a number (the number ends or splits there, before the
    spans are found); with ω_s = the mean of the weights of number s's tokens and n = Σ_t w_t
    over the counted labels:

        CE = Σ_t w_t·CE_t / n,   emd = Σ_m w_m·(W·EMD)_m / Σ_m w_m   (per_number: Σ_s ω_s·EMD_s /
        Σ_s ω_s, EMD_s with W_i·w_i),   relative = Σ_s ω_s·rel_s / Σ_s ω_s  (magnitude alike)

    ("batch"; "row": the same within each row, rows then averaged; "token": Σ ω·l / n), the
    dynamic mix c = λ·sg(CE/NTIL) taken from these weighted terms, and "sum" = n·(CE + c·NTIL).
    "n_tokens" is n; "n_numbers" and "n_digit_tokens" count the scored numbers and tokens.

    Example:
        >>> loss_fn = NTILLoss(tokenizer)                          # doctest: +SKIP
        >>> out = loss_fn(logits[:, :-1], input_ids[:, 1:])       # doctest: +SKIP
        >>> out.loss.backward()                                   # doctest: +SKIP

    Shape notation: B batch, T time, V vocabulary rows.
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: Preset = "stable",
        lam: float = 0.3,
        alpha: float = 0.2,
        beta: float = 0.2,
        sigma: float = 0.2,
        emd_weight: float = 1.0,
        mix: Literal["dynamic", "static"] = "dynamic",
        value_mode: Literal["gumbel", "argmax", "expected"] = "gumbel",
        tau: float = 0.1,
        noise_scale: float = 0.01,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        vocab_size: int | None = None,
        *,
        join_decimal: bool | None = None,
        signed: bool | None = None,
        digits_only: bool | None = None,
        thousands_separator: str | None = None,
        averaging: Literal["batch", "row", "token"] | None = None,
        smoothing: Literal["paper", "official"] | None = None,
        implementation: Implementation = "fused",
        generator: torch.Generator | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        max_ratio: float | Literal["preset"] | None = _FROM_PRESET,
        per_number: bool | None = None,
        magnitude_floor: float | None = None,
    ) -> None:
        super().__init__()
        if preset not in _PRESETS:
            raise ValueError(f"preset must be one of {tuple(_PRESETS)}, got {preset!r}")
        if implementation not in ("fused", "reference"):
            raise ValueError(
                f"implementation must be 'fused' or 'reference', got {implementation!r}"
            )
        preset_settings, preset_spans = _PRESETS[preset]
        overrides = {
            "averaging": averaging,
            "smoothing": smoothing,
            "mix_eps": None,
            "per_number": per_number,
            "magnitude_floor": magnitude_floor,
        }
        resolved = {
            k: (overrides.get(k) if overrides.get(k) is not None else v)
            for k, v in preset_settings.items()
        }
        if max_ratio != _FROM_PRESET:
            resolved["max_ratio"] = max_ratio
        self.settings = NTILSettings(
            lam=lam,
            alpha=alpha,
            beta=beta,
            sigma=sigma,
            emd_weight=emd_weight,
            mix=mix,
            value_mode=value_mode,
            tau=tau,
            noise_scale=noise_scale,
            reduction=reduction,
            ignore_index=ignore_index,
            **resolved,
        )
        given = {"join_decimal": join_decimal, "signed": signed, "digits_only": digits_only}
        self.span_options = SpanOptions(
            **{k: (given[k] if given[k] is not None else v) for k, v in preset_spans.items()},
            thousands_separator=thousands_separator,
        )
        self.preset = preset
        self.implementation = implementation
        self.generator = generator
        self.chunk_elements = int(chunk_elements)
        self._numbers = NumberVocabSource(
            tokenizer_or_number_vocab, vocab_size, self.span_options.digits_only
        )

    def logged_loss_note(self) -> str | None:
        """The dynamic mix CE + λ·sg(CE/X)·X equals (1 + λ)·CE in value (X the numeric term),
        wherever X > 0 and the ratio is under its cap."""
        s = self.settings
        if s.mix != "dynamic":
            return None
        cap = (f", while the ratio CE/X stays under its cap {s.max_ratio:g}"
               if s.max_ratio is not None else "")
        return (f"{type(self).__name__}'s dynamic mix: the logged loss CE + {s.lam:g}*sg(CE/X)*X "
                f"equals {1 + s.lam:g}*ce in value on batches with numbers{cap}; compare "
                "objectives by ce and the evaluation")

    def chunk_objective(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        number_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[NTILObjective, torch.Tensor]:
        """The chunk engine's NTIL objective for ``labels`` against ``logits`` [..., V] (or a
        zero-stride stand-in of that shape) and the labels on the logits' device: the fused
        logits path and ``from_hidden`` run it. CE is chunked over rows; only the [M, K]
        class-candidate logits of the number positions are kept, and the NTIL terms and their
        gradient are computed on them after the pass with the global CE mean.

        Shape checks only, and the spans drafted without a host sync: the engine reads the
        label-range check, the span sizes and the chunk bounds in the one host sync of the call
        (:class:`emdlm.ops.objectives.ntil.NTILObjective`). ``number_mask`` and
        ``generator`` as in ``forward``."""
        settings = self.settings
        check_logits_labels_shapes(logits, labels)
        vocab = self._vocab_for(logits)
        labels = labels.to(logits.device)
        draft = draft_spans(
            labels, vocab, self.span_options, ignore_index=settings.ignore_index,
            number_mask=number_mask,
        )
        objective = NTILObjective(
            draft, vocab, self._n_rows(labels), settings, generator or self.generator
        )
        return objective, labels

    def logits_loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        number_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> LossOutput:
        """The loss of ``logits`` [..., T, V] against ``labels`` [..., T] (class docstring).

        ``number_mask`` (bool, the labels' shape; None = every token): True where a token may
        be scored as a number. A number enters the numeric terms only if ALL its number tokens
        are True; tokens outside the mask are non-number tokens there. CE is computed on every
        counted label either way. ``generator`` draws this call's Gumbel noise.
        """
        settings = self.settings
        use_fused = (
            self.implementation == "fused" and logits.requires_grad and torch.is_grad_enabled()
        )
        if use_fused:
            objective, labels = self.chunk_objective(
                logits, labels, number_mask=number_mask, generator=generator
            )
            options = HeadOptions(
                ignore_index=settings.ignore_index,
                reduction=settings.reduction,
                chunk_size=self.from_hidden_chunk_rows(logits.shape[-1]),
            )
            return chunked_logits_loss(logits, labels, objective, options)
        check_logits_labels(logits, labels, settings.ignore_index)
        vocab = self._vocab_for(logits)
        labels = labels.to(logits.device)
        spans = resolve_spans(
            labels, vocab, self.span_options, ignore_index=settings.ignore_index,
            number_mask=number_mask,
        )
        noise = sample_noise(class_candidates(vocab, spans), settings, generator or self.generator)
        loss, components = ntil_loss(logits, labels, vocab, spans, settings, noise=noise)
        return LossOutput(loss=loss, components=components)

    def from_hidden_chunk_rows(self, vocab: int) -> int:
        """Rows per chunk of both chunked paths: ``chunk_elements // V``."""
        return default_chunk_rows(vocab, self.chunk_elements)

    @staticmethod
    def _n_rows(labels: torch.Tensor) -> int:
        """B, the batch rows of the labels (1-D labels are one row; T may be 0)."""
        return math.prod(labels.shape[:-1]) if labels.dim() > 1 else 1

    def extra_repr(self) -> str:
        fields = dataclasses.asdict(self.settings)
        return f"preset={self.preset!r}, implementation={self.implementation!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in {**fields, **dataclasses.asdict(self.span_options)}.items()
        )


class DigitEMDLoss(NTILLoss):
    """The paper's EMD baseline: CE mixed with the position-weighted digit EMD alone.

        total = CE + λ · sg(CE / EMD) · emd_weight·mean(W·EMD)     (mix="dynamic")
        total = CE + λ · emd_weight · Σ(W·EMD) / n       (mix="static", averaging="token")

    where n is the number of counted labels: with ``reduction="sum"`` the latter is
    Σ_t CE_t + λ·emd_weight·Σ W·EMD, exact under gradient accumulation (:class:`NTILLoss`).

    With the stable preset (default) the mean is over numbers of each number's (weighted) mean
    EMD (``per_number``, :class:`NTILLoss`) and the ratio is capped at ``max_ratio`` = 10; the
    paper preset averages over the batch's digit tokens, the official one over digit tokens per
    row, both uncapped as emd.py.

    σ = 0 by default (W = 1; official emd.py uses digit_exp = 1.0). α = β = 0: "relative" and
    "magnitude" are still reported as diagnostics of the predicted numbers (computed with
    ``value_mode``, "argmax" by default, on the same small [M, K] tensor; they add nothing to
    the loss or its gradient), so EMD and NTIL runs log the same components. Same presets,
    arguments, call and components as :class:`NTILLoss` otherwise.
    """

    def __init__(
        self,
        tokenizer_or_number_vocab: Any,
        preset: Preset = "stable",
        lam: float = 0.3,
        sigma: float = 0.0,
        emd_weight: float = 1.0,
        mix: Literal["dynamic", "static"] = "dynamic",
        value_mode: Literal["gumbel", "argmax", "expected"] = "argmax",
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        vocab_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        for name in ("alpha", "beta"):
            if kwargs.pop(name, 0.0) != 0.0:
                raise ValueError(f"DigitEMDLoss has no {name} term; use NTILLoss")
        super().__init__(
            tokenizer_or_number_vocab,
            preset=preset,
            lam=lam,
            alpha=0.0,
            beta=0.0,
            sigma=sigma,
            emd_weight=emd_weight,
            mix=mix,
            value_mode=value_mode,
            ignore_index=ignore_index,
            reduction=reduction,
            vocab_size=vocab_size,
            **kwargs,
        )
