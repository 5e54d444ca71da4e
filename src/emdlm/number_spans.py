"""Where the numbers are in a batch of labels: :class:`NumberSpans`, built per batch.

Vectorized over [B, T] with no Python loop over tokens: every scored number token (M of them)
and every number (S of them), read with a tokenizer's :class:`emdlm.numbers.NumberVocab`. How
numbers are read is one :class:`SpanOptions` (``digits_only``, ``join_decimal``,
``thousands_separator``, ``signed``); which labels count is ``ignore_index``, and which tokens may
be scored is the batch's ``number_mask``.

The rules, used by NTIL (Sec. 3.2 of the paper; xfey/NTIL ntil.py):

* A number is a maximal run of number tokens within one batch row. Any other token, an ignored
  label, the row end, or a number token that carries a space marker ('Ġ45' starts a new number)
  ends it. GPT-2 "123 45" -> '123','Ġ45' is two numbers; "7 8 9" is three.
* ``digits_only`` (the official preset): only the ten ids ``digit_ids`` ('0'..'9') are number
  tokens, so multi-digit tokens, 'Ġ5', '.' and '-' all end a number ("3.015" -> 3 and 15).
* ``join_decimal``: a bare '.' token (no space marker) directly between two runs joins them into
  one decimal number when the fraction run's first token has no space marker. A number holds at
  most one '.', scanning left to right: "1.2.3" is 1.2 and 3 ("192.168.1.1" is 192.168 and 1.1).
  'Ġ.' never joins, and neither does a space-marked fraction token ("3. 5" is 3 and 5).
* ``join_decimal`` also reads a leading '.': a bare '.' directly before a run whose first token
  has no space marker, with no number token right before the '.', makes the run a fraction
  (".5" is 0.5, "x=.25" is 0.25, "-.5" with ``signed`` is -0.5). The "official" preset does not
  join decimals, so its spans are unchanged (".5" is 5 there, as in xfey/NTIL).
* ``thousands_separator`` (off by default; one of :data:`emdlm.numbers.GROUP_SEPARATORS`): a
  bare separator token directly between two runs joins them when the run after it has exactly 3
  digits and the run before it at most 3 ("1,234,567" is one number; "1,23", "1234,567" and
  "1, 234" are two). A separator never joins after a decimal point ("1.5,000" is 1.5 and 0).
* ``signed``: a minus token (text ends in '-': '-', 'Ġ-', '=-', ...) directly before the number's
  first token makes the number negative, unless the number's first token has a space marker
  ("5 - 3": 'Ġ-','Ġ3' is subtraction) or the minus token directly follows a number token of the
  vocabulary ("3-5" is subtraction; this check uses all number tokens, also with ``digits_only``).
  Only the number's first run can be signed; the '-' itself is never scored.
* ``number_mask`` ([B, T] bool, aligned with the labels; None: every token): which tokens may
  be scored as numbers. Numbers are found on the labels as above (the mask never splits or joins
  a number), then a number is kept only if ALL its number tokens are in the mask; the tokens of
  a dropped number, and every token outside the mask, are non-number tokens to the objectives.
  Used to leave option labels, years or reference numbers out of the numeric terms (as asked of
  ntloss: https://github.com/AI4SD/number-token-loss/issues/65); CE is not affected (the losses
  score CE on every counted label).

Shape notation: V vocab rows, B batch, T time, M number tokens in the batch, S numbers in
the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from emdlm.numbers import GROUP_SEPARATORS, NumberVocab

_FLOAT64_MAX = float(torch.finfo(torch.float64).max)


@dataclass(frozen=True)
class SpanOptions:
    """How numbers are read from the labels (the rules in the module docstring).

    Attributes:
        join_decimal: join "int '.' frac" into one decimal number, and read a leading '.' (".5")
            as a fraction (paper preset).
        signed: a minus token before a number makes it negative (paper preset).
        digits_only: only '0'..'9' are number tokens (official xfey/NTIL preset).
        thousands_separator: None (a separator ends a number) or one of
            :data:`emdlm.numbers.GROUP_SEPARATORS`, e.g. "," to read "1,234" as 1234.

    Raises:
        TypeError: a flag that is not a bool.
        ValueError: a ``thousands_separator`` that is not None or one of the separators.
    """

    join_decimal: bool = False
    signed: bool = False
    digits_only: bool = False
    thousands_separator: str | None = None

    def __post_init__(self) -> None:
        for name in ("join_decimal", "signed", "digits_only"):
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise TypeError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        sep = self.thousands_separator
        if sep is not None and (not isinstance(sep, str) or sep not in GROUP_SEPARATORS):
            raise ValueError(
                f"thousands_separator must be None or one of {GROUP_SEPARATORS}, got {sep!r}"
            )


#: Every option off: a number is a maximal run of number tokens, unsigned, integer.
PLAIN_SPANS = SpanOptions()


@dataclass(frozen=True, eq=False)
class NumberSpans:
    """The numbers found in one batch of labels.

    Per number token (M, ordered row-major over the flattened [B*T]):
        flat_index: [M] long, position in the flattened [B*T] labels/logits.
        number_id: [M] long, which number in [0, S) the token belongs to.
        token_class: [M] long, class of the gold token (NumberVocab.token_class[label]).
        gold_column: [M] long, column of the gold token in its class row.
        num_digits: [M] long, digits of the gold token.
        digits_right: [M] long, digits of the whole number to the right of the token's LEADING
            digit (fraction digits included): the exponent of the position weight (1+σ)^k.
        place: [M] long, power of ten of the token's LAST digit within the number's value, so the
            token contributes token_value * 10**place (fraction digits have negative places).
    Per number (S):
        number_row: [S] long, batch row of the number.
        sign: [S] float64, -1.0 for a number preceded by a minus token (option `signed`), else 1.0.
        gold_value: [S] float64, signed value of the gold number.
        num_tokens: [S] long, number tokens in the number.
    """

    flat_index: torch.Tensor
    number_id: torch.Tensor
    token_class: torch.Tensor
    gold_column: torch.Tensor
    num_digits: torch.Tensor
    digits_right: torch.Tensor
    place: torch.Tensor
    number_row: torch.Tensor
    sign: torch.Tensor
    gold_value: torch.Tensor
    num_tokens: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.flat_index.numel())

    @property
    def n_numbers(self) -> int:
        return int(self.number_row.numel())


def _compact(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the True entries of a 1-D mask, given their count (no host sync).

    Scatters each position to its rank; non-members go to a dump slot past the end.
    """
    rank = torch.cumsum(mask, 0) - 1
    dest = torch.where(mask, rank, torch.full_like(rank, count))
    out = torch.zeros(count + 1, dtype=torch.long, device=mask.device)
    out.scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))
    return out[:count]


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.flatten()[index]`` with the shape of ``index``, via ``index_select``.

    ``index_select`` is much faster than advanced indexing on CPU (about 10x single-threaded,
    far more when threads contend); the gather is the hot path of span finding.
    """
    return table.reshape(-1).index_select(0, index.reshape(-1)).view(index.shape)


def _shift_right(x: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """x[:, t-1] at column t (``fill`` at t = 0): the previous token in the same row."""
    pad = torch.full_like(x[:, :1], fill)
    return torch.cat([pad, x[:, :-1]], dim=1)


def _thousands_joins(
    vocab: NumberVocab,
    idx: torch.Tensor,
    valid: torch.Tensor,
    num: torch.Tensor,
    space: torch.Tensor,
    run_start: torch.Tensor,
    num_before_prev: torch.Tensor,
    separator: str,
) -> torch.Tensor:
    """[B, T] bool: run starts that a thousands separator at t-1 joins to the run before it.

    Joined when the separator is a bare token, the run at t has exactly 3 digits and has no
    space marker, and the run ending at t-2 has at most 3 digits (a first group of 1-3 digits,
    or an earlier 3-digit group). Vectorized with run ids over the flattened batch.
    """
    code = GROUP_SEPARATORS.index(separator) + 1
    sep = (_take(vocab.group_separator, idx) == code) & valid & ~space  # [B, T]
    flat_num = num.reshape(-1)
    run_id = torch.cumsum(run_start.reshape(-1), 0) - 1  # [B*T] run of each number token
    digits = torch.where(flat_num, _take(vocab.num_digits, idx).reshape(-1), 0)
    run_digits = torch.zeros(flat_num.numel() + 1, dtype=torch.long, device=idx.device)
    run_digits.index_add_(0, torch.where(flat_num, run_id, flat_num.numel()), digits)
    own = _take(run_digits, run_id.clamp_min(0)).view(num.shape)  # digits of the run at t
    before = _shift_right(_shift_right(own, 0), 0)  # digits of the run that holds t-2
    return (
        run_start & ~space & _shift_right(sep, False) & num_before_prev & (own == 3) & (before <= 3)
    )


def check_number_mask(number_mask: Any, labels: torch.Tensor) -> None:
    """Raise a clear error unless ``number_mask`` is a bool tensor of the labels' shape."""
    if not isinstance(number_mask, torch.Tensor):
        raise TypeError(
            f"number_mask must be a bool torch.Tensor shaped like the labels, got "
            f"{type(number_mask).__name__}"
        )
    if number_mask.dtype != torch.bool:
        raise TypeError(
            f"number_mask must have dtype torch.bool (True = may be scored as a number), got "
            f"{number_mask.dtype}"
        )
    if tuple(number_mask.shape) != tuple(labels.shape):
        raise ValueError(
            f"number_mask shape {tuple(number_mask.shape)} does not match the labels' "
            f"{tuple(labels.shape)}: it must be aligned with the labels (shifted like them)"
        )


def _keep_masked_numbers(
    num: torch.Tensor, num_start: torch.Tensor, number_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num, num_start) [B, T] without the numbers that have a token outside ``number_mask``.

    Each number token gets its number's index (cumsum of starts over the flattened batch); a
    scatter marks the numbers with a token outside the mask, and a gather drops all their tokens.
    No host sync.
    """
    flat_num = num.reshape(-1)
    number_of = torch.cumsum(num_start.reshape(-1), 0) - 1  # [B*T], valid at number tokens
    outside = flat_num & ~number_mask.reshape(-1)  # [B*T] number tokens out of scope
    dump = flat_num.numel()  # slot for the non-number positions
    target = torch.where(flat_num, number_of, torch.full_like(number_of, dump))
    n_out = torch.zeros(dump + 1, dtype=torch.long, device=num.device)
    n_out = n_out.index_add(0, target, outside.long())  # [B*T + 1] tokens out, per number
    keep = flat_num & (_take(n_out, target) == 0)  # [B*T]
    keep = keep.view(num.shape)
    return num & keep, num_start & keep


@dataclass(frozen=True, eq=False)
class SpanDraft:
    """The masks of :func:`draft_number_spans`: a batch's numbers before their sizes are read.

    Attributes (all [B, T] on the labels' device):
        lab: long labels; idx: safe gather ids (0 where ignored or out of range); bad: counted
            labels outside [0, V); num: number tokens (after ``number_mask``); num_start: each
            number's first token; fraction_start: first token after a number's '.';
            negative: first tokens of negative numbers.
    """

    labels_shape: tuple[int, ...]
    vocab: NumberVocab
    ignore_index: int
    lab: torch.Tensor
    idx: torch.Tensor
    bad: torch.Tensor
    num: torch.Tensor
    num_start: torch.Tensor
    fraction_start: torch.Tensor
    negative: torch.Tensor

    def sizes(self) -> torch.Tensor:
        """[3] long on the labels' device: M number tokens, S numbers, bad labels."""
        return torch.stack([self.num.sum(), self.num_start.sum(), self.bad.sum()])

    def range_error(self) -> ValueError:
        """The error for labels outside [0, V) (reads them: error path only)."""
        V = self.vocab.vocab_size
        bad_values = self.lab[self.bad].unique()[:5].tolist()
        return ValueError(
            f"labels out of range for a vocabulary of {V} rows: found {bad_values} (labels "
            f"must be in [0, {V}) or equal ignore_index={self.ignore_index}); labels shape "
            f"{self.labels_shape}"
        )

    def resolve(self) -> NumberSpans:
        """The :class:`NumberSpans` on their own: the one host sync (sizes and the label-range
        check), then :meth:`finish`. Callers with more sizes to read use those two instead."""
        n_tok, n_num, n_bad = self.sizes().tolist()
        if n_bad:
            raise self.range_error()
        return self.finish(n_tok, n_num)

    def finish(self, n_tok: int, n_num: int) -> NumberSpans:
        """The :class:`NumberSpans`, given the sizes read from :meth:`sizes` (no host sync)."""
        vocab, idx, num, num_start = self.vocab, self.idx, self.num, self.num_start
        fraction_start, negative = self.fraction_start, self.negative
        device = idx.device
        n_cols = idx.shape[1]
        flat_index = _compact(num.reshape(-1), n_tok)  # [M]
        tok_id = _take(idx, flat_index)  # [M]
        start_m = _take(num_start, flat_index)  # [M]
        frac_start_m = _take(fraction_start, flat_index).long()  # [M] first token after a '.'
        neg_m = _take(negative, flat_index)  # [M]
        number_id = torch.cumsum(start_m, 0) - 1  # [M]
        first = _compact(start_m, n_num)  # [S] position in [M] of each number's first token
        nd_m = _take(vocab.num_digits, tok_id)  # [M]
        val_m = _take(vocab.value, tok_id)  # [M]

        def within_number(cum: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            """Inclusive running sum restarted at each number: cum - (cum - own) at its start."""
            return cum - _take(_take(cum - own, first), number_id)

        frac_m = within_number(torch.cumsum(frac_start_m, 0), frac_start_m) > 0  # [M]
        upto = within_number(torch.cumsum(nd_m, 0), nd_m)  # [M] digits up to and incl. token

        zeros_s = torch.zeros(n_num, dtype=torch.long, device=device)
        total_digits = zeros_s.index_add(0, number_id, nd_m)  # [S]
        frac_digits = zeros_s.index_add(0, number_id, torch.where(frac_m, nd_m, 0))  # [S]
        int_digits = total_digits - frac_digits  # [S]
        num_tokens = zeros_s.index_add(0, number_id, torch.ones_like(nd_m))  # [S]

        place = _take(int_digits, number_id) - upto  # [M]
        digits_right = _take(total_digits, number_id) - upto + nd_m - 1  # [M]

        # Gold value: the integer part and the fraction part (as an integer, i.e. shifted by F
        # places) are each sums of integers, exact in float64 below 2**53. Exponents are capped at
        # 308 so that > 308-digit numbers give a huge finite value, never inf or 0 * inf = NaN.
        f64 = torch.float64
        ten = torch.full((), 10.0, dtype=f64, device=device)  # no host-to-device copy
        shift = torch.where(frac_m, _take(frac_digits, number_id), 0)  # F for fraction tokens
        term = val_m * torch.pow(ten, (place + shift).clamp(max=308).to(f64))  # [M]
        term = term.clamp(max=_FLOAT64_MAX)
        zeros_f = torch.zeros(n_num, dtype=f64, device=device)
        int_part = zeros_f.index_add(0, number_id, torch.where(frac_m, 0.0, term))  # [S]
        frac_part = zeros_f.index_add(0, number_id, torch.where(frac_m, term, 0.0))  # [S]
        frac_scale = torch.pow(ten, frac_digits.clamp(max=308).to(f64))  # [S]
        frac_value = frac_part.clamp(max=_FLOAT64_MAX) / frac_scale
        magnitude = int_part.clamp(max=_FLOAT64_MAX) + frac_value
        magnitude = magnitude.clamp(max=_FLOAT64_MAX)  # [S]

        sign = 1.0 - 2.0 * _take(neg_m, first).to(f64)  # [S] the sign sits on the first token
        number_row = torch.div(_take(flat_index, first), n_cols, rounding_mode="floor")  # [S]

        return NumberSpans(
            flat_index=flat_index,
            number_id=number_id,
            token_class=_take(vocab.token_class, tok_id),
            gold_column=_take(vocab.position_in_class, tok_id),
            num_digits=nd_m,
            digits_right=digits_right,
            place=place,
            number_row=number_row,
            sign=sign,
            gold_value=sign * magnitude,
            num_tokens=num_tokens,
        )


def draft_number_spans(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: SpanOptions = PLAIN_SPANS,
    *,
    ignore_index: int = -100,
    number_mask: torch.Tensor | None = None,
) -> SpanDraft:
    """:func:`find_number_spans` up to its host sync: the checks and the [B, T] masks.

    No host sync. Read :meth:`SpanDraft.sizes` (with whatever else the caller needs on the
    host: the chunked NTIL objective folds them into the one read of its loss call), raise
    :meth:`SpanDraft.range_error` if labels are out of range, then :meth:`SpanDraft.finish`.
    Arguments and the other errors as :func:`find_number_spans`.
    """
    if not isinstance(options, SpanOptions):
        raise TypeError(f"options must be a SpanOptions, got {type(options).__name__}")
    join_decimal, signed, digits_only = options.join_decimal, options.signed, options.digits_only
    thousands_separator = options.thousands_separator
    if number_mask is not None:
        check_number_mask(number_mask, labels)
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape [B, T] or [T], got {tuple(labels.shape)}")
    if number_mask is not None:
        number_mask = number_mask.to(labels.device).reshape(labels.shape)
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    device = labels.device
    vocab = vocab.to(device)
    n_rows, n_cols = labels.shape
    lab = labels.long()
    V = vocab.vocab_size

    valid = lab != ignore_index  # [B, T]
    in_range = (lab >= 0) & (lab < V)
    bad = valid & ~in_range
    idx = torch.where(valid & in_range, lab, torch.zeros_like(lab))  # safe gather index

    any_number = _take(vocab.is_number, idx) & valid  # [B, T] any number token of the vocab
    num = any_number
    if digits_only:  # only the ten ids of '0'..'9' (vocab.digit_ids)
        num = _take(vocab.is_digit_token, idx) & valid
    space = _take(vocab.has_space, idx) & valid  # [B, T]

    # Runs: a number token continues the previous one unless it carries a space marker.
    prev_num = _shift_right(num, False)
    run_start = num & ~(prev_num & ~space)  # [B, T]
    num_before_prev = _shift_right(prev_num, False)  # a number token at t-2

    grouped = torch.zeros_like(num)  # run starts joined to the previous run by a separator
    if thousands_separator is not None:
        grouped = _thousands_joins(
            vocab, idx, valid, num, space, run_start, num_before_prev, thousands_separator
        )
    group_start = run_start & ~grouped  # runs that a separator did not join

    lead_fraction = torch.zeros_like(num)  # ".5": a number that starts after its '.'
    if join_decimal:
        plain_dot = _take(vocab.is_decimal_point, idx) & ~space & valid
        after_dot = group_start & ~space & _shift_right(plain_dot, False)  # '.' at t-1
        # A join candidate at a run start t: '.' at t-1 and a number token at t-2.
        cand = after_dot & num_before_prev
        lead_fraction = after_dot & ~num_before_prev
        # Chains of consecutive candidate joins (in run order) after a chain's first run;
        # accept the 1st, 3rd, ... of a chain, so that each number holds at most one '.'
        # (greedy left to right) - the 2nd, 4th, ... when the first run is a leading fraction
        # (".5"), whose number holds its '.' already (".0.0" is 0.0 then 0).
        flat_start = group_start.reshape(-1)
        flat_cand = cand.reshape(-1)
        cs = torch.cumsum(flat_cand.long(), 0)
        pos = torch.arange(flat_cand.numel(), device=flat_cand.device)
        chain_first = torch.cummax(
            torch.where(flat_start & ~flat_cand, pos, torch.zeros_like(pos)), 0
        ).values  # [B*T] position of the chain's first run
        offset = lead_fraction.reshape(-1)[chain_first].long()
        accepted = (flat_cand & ((cs - cs[chain_first] + offset) % 2 == 1)).view(n_rows, n_cols)
    else:
        accepted = torch.zeros_like(num)
    fraction_start = accepted | lead_fraction  # first token after a number's '.'
    num_start = group_start & ~accepted  # [B, T]
    if thousands_separator is not None:
        # A separator never joins after a decimal point: such a group starts a new number.
        flat_frac = fraction_start.reshape(-1).long()
        frac_seen = torch.cumsum(flat_frac, 0)  # [B*T] fraction starts so far (inclusive)
        # Fraction starts before the current number's first token (non-decreasing: cummax).
        before_number = torch.where(num_start.reshape(-1), frac_seen - flat_frac, 0)
        in_fraction = frac_seen > torch.cummax(before_number, 0).values
        num_start = num_start | (grouped & in_fraction.view(n_rows, n_cols))

    if signed:
        minus = _take(vocab.is_minus, idx) & valid
        after_number = _shift_right(any_number, False)  # token before the minus is a number
        sign_ok = _shift_right(minus & ~after_number, False)  # a minus at t-1
        negative = num_start & ~space & sign_ok
        # "-.5": the minus sits before the '.' (t-2).
        negative = negative | (lead_fraction & _shift_right(sign_ok, False))
    else:
        negative = torch.zeros_like(num)

    if number_mask is not None:
        num, num_start = _keep_masked_numbers(num, num_start, number_mask)

    return SpanDraft(
        labels_shape=tuple(labels.shape),
        vocab=vocab,
        ignore_index=ignore_index,
        lab=lab,
        idx=idx,
        bad=bad,
        num=num,
        num_start=num_start,
        fraction_start=fraction_start,
        negative=negative,
    )


def find_number_spans(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: SpanOptions = PLAIN_SPANS,
    *,
    ignore_index: int = -100,
    number_mask: torch.Tensor | None = None,
) -> NumberSpans:
    """Find every gold number in a batch of labels (rules in the module docstring).

    Vectorized over [B, T] with masks, cumsums and scatters; one host sync per call (the
    token/number counts, which fix the output sizes). Works on any device; ``vocab`` is moved
    to the labels' device (cached).

    Per token, with D the number's digit count, I its integer-part digits and c the digits of
    the number up to and including the token: ``place = I - c`` and
    ``digits_right = D - c + num_digits - 1``. The gold value is
    ``sign * (int_part + frac_part / 10**F)`` with both parts summed as integers in float64
    (exact below 2**53) and F the fraction digits; huge values are clamped to the float64 max.

    Args:
        labels: [B, T] (or [T]) integer labels, ``ignore_index`` where nothing is scored.
        vocab: the :class:`emdlm.numbers.NumberVocab` of the tokenizer.
        options: how numbers are read (:class:`SpanOptions`; default: every option off).
        ignore_index: label value that is never scored.
        number_mask: None, or a bool tensor of the labels' shape: True where a token may be
            scored as a number. A number is kept only if all its number tokens are True; the
            others are left out entirely (module docstring).

    Raises:
        ValueError: labels of the wrong rank, a label outside [0, V) other than ignore_index,
            or a number_mask whose shape is not the labels'.
        TypeError: non-integer labels, ``options`` that is not a :class:`SpanOptions`, or a
            number_mask that is not a bool tensor.
    """
    return draft_number_spans(
        labels, vocab, options, ignore_index=ignore_index, number_mask=number_mask
    ).resolve()  # the single host sync: output sizes (and the label-range check)
