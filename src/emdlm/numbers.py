"""Which vocabulary ids are numbers, and where the numbers are in a batch of labels.

Two data classes form the contract between tokenization and the numeric objectives:

* :class:`NumberVocab` — built once per tokenizer: for every vocab id, whether its text (after
  removing the byte-level space marker 'Ġ' or the SentencePiece '▁') is a run of ASCII digits,
  its digit count, value, marker, and its *class* (same digit count and same marker). Classes
  are the candidate sets of the multi-digit ordinal EMD.
* :class:`NumberSpans` — built per batch, vectorized over [B, T] with no Python loop over tokens:
  every scored number token (M of them) and every number (S of them).

Span rules (:func:`find_number_spans`), used by NTIL (Sec. 3.2 of the paper; xfey/NTIL ntil.py):

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
* ``thousands_separator`` (off by default; one of :data:`GROUP_SEPARATORS`): a bare separator
  token directly between two runs joins them when the run after it has exactly 3 digits and
  the run before it at most 3 ("1,234,567" is one number; "1,23", "1234,567" and "1, 234"
  are two). A separator never joins after a decimal point ("1.5,000" is 1.5 and 0).
* ``signed``: a minus token (text ends in '-': '-', 'Ġ-', '=-', ...) directly before the number's
  first token makes the number negative, unless the number's first token has a space marker
  ("5 - 3": 'Ġ-','Ġ3' is subtraction) or the minus token directly follows a number token of the
  vocabulary ("3-5" is subtraction; this check uses all number tokens, also with ``digits_only``).
  Only the number's first run can be signed; the '-' itself is never scored.
* ``number_mask`` ([B, T] bool, aligned with the labels; None: every token): which tokens may
  be scored as numbers. Numbers are found on the labels as above (the mask never splits or joins
  a number), then a number is kept only if ALL its number tokens are in the mask; the tokens of
  a dropped number, and every token outside the mask, are non-number tokens to the objectives.
  Used to leave option labels, years or reference numbers out of the numeric terms (ntloss
  issue #65); CE is not affected (the losses score CE on every counted label).

Shape notation: V vocab rows, C number classes, K widest class, B batch, T time,
M number tokens in the batch, S numbers in the batch.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

SPACE_MARKERS = ("Ġ", "▁")
#: Thousands separators that :func:`find_number_spans` can join on (bare tokens only).
GROUP_SEPARATORS = (",", "_", "'")
_DIGITS = frozenset("0123456789")
_FLOAT64_MAX = float(torch.finfo(torch.float64).max)


def _strip_marker(token: str) -> tuple[str, bool]:
    """Remove ONE leading space marker; return (rest, had_marker)."""
    if token[:1] in SPACE_MARKERS:
        return token[1:], True
    return token, False


@dataclass(frozen=True, eq=False)
class NumberVocab:
    """Number tokens of one vocabulary (all tensors on one device).

    Attributes:
        vocab_size: V, the number of logit rows (may exceed the tokenizer's length: extra rows
            are not numbers).
        is_number: [V] bool, token text minus a leading space marker is 1+ ASCII digits.
        num_digits: [V] long, digit count of number tokens (0 elsewhere).
        value: [V] float64, integer value of the digit string ('007' -> 7; 0 elsewhere).
        has_space: [V] bool, token starts with a space marker ('Ġ' or '▁').
        token_class: [V] long, class index in [0, C) for number tokens, -1 elsewhere. A class is
            all number tokens with the same digit count and the same has_space.
        position_in_class: [V] long, column of the token in its class row, -1 elsewhere.
        class_members: [C, K] long, vocab ids of each class sorted by value; padding is 0.
        class_mask: [C, K] bool, True where class_members holds a real member.
        class_values: [C, K] float64, values of the members (padding 0).
        class_num_digits: [C] long, digit count of each class.
        class_has_space: [C] bool.
        digit_ids: [10] long, ids of the tokens '0'..'9' without marker (-1 where absent).
        is_decimal_point: [V] bool, token is '.', optionally with a space marker.
        is_minus: [V] bool, token text ends in '-' (e.g. '-', 'Ġ-', '=-').
        group_separator: [V] long, 1 + index in :data:`GROUP_SEPARATORS` for a token that is
            exactly a thousands separator (no marker), 0 elsewhere.

    Classes are ordered by (digit count, has_space): (1, False), (1, True), (2, False), ...;
    within a class, members are ordered by value (ties, e.g. duplicate strings, by id).
    has_space is set for every token that starts with a marker, number or not.
    """

    vocab_size: int
    is_number: torch.Tensor
    num_digits: torch.Tensor
    value: torch.Tensor
    has_space: torch.Tensor
    token_class: torch.Tensor
    position_in_class: torch.Tensor
    class_members: torch.Tensor
    class_mask: torch.Tensor
    class_values: torch.Tensor
    class_num_digits: torch.Tensor
    class_has_space: torch.Tensor
    digit_ids: torch.Tensor
    is_decimal_point: torch.Tensor
    is_minus: torch.Tensor
    group_separator: torch.Tensor

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_token_strings(
        cls, tokens: Sequence[str | None], vocab_size: int | None = None
    ) -> NumberVocab:
        """Build from the token text of every id (``tokens[i]`` is id i; None = no token).

        One pass over the strings in Python (fast for a 152k vocabulary), then numpy.

        Args:
            tokens: token strings as the tokenizer stores them (byte-level 'Ġ' / SentencePiece
                '▁' markers kept).
            vocab_size: logit rows V; defaults to ``len(tokens)``. Rows past ``len(tokens)``
                are not numbers.

        Raises:
            ValueError: if ``vocab_size < len(tokens)`` or no token is a run of ASCII digits.
        """
        n_tok = len(tokens)
        if vocab_size is None:
            vocab_size = n_tok
        vocab_size = int(vocab_size)
        if vocab_size < n_tok:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the tokenizer's {n_tok} tokens: the "
                f"logits need at least {n_tok} rows"
            )
        num_ids: list[int] = []
        num_text: list[str] = []
        space_ids: list[int] = []
        dot_ids: list[int] = []
        minus_ids: list[int] = []
        separator_codes: dict[int, int] = {}
        digit_ids = [-1] * 10
        for i, tok in enumerate(tokens):
            if not tok:
                continue
            rest, marked = _strip_marker(tok)
            if marked:
                space_ids.append(i)
            if tok in GROUP_SEPARATORS:
                separator_codes[i] = GROUP_SEPARATORS.index(tok) + 1
            if rest and rest.isascii() and rest.isdigit():  # ASCII digits only ('²' is not)
                num_ids.append(i)
                num_text.append(rest)
                if not marked and len(rest) == 1 and digit_ids[int(rest)] < 0:
                    digit_ids[int(rest)] = i
            elif rest == ".":
                dot_ids.append(i)
            if tok.endswith("-"):
                minus_ids.append(i)
        _warn_unscored_digits(tokens)
        if not num_ids:
            raise ValueError(
                f"the tokenizer has no digit tokens: none of its {n_tok} tokens is a run of "
                "ASCII digits 0-9 (optionally after one 'Ġ'/'▁' marker), so there is nothing "
                "for a number objective to score"
            )

        ids = np.asarray(num_ids, dtype=np.int64)
        nd = np.fromiter((len(t) for t in num_text), dtype=np.int64, count=len(num_text))
        val = np.fromiter((float(t) for t in num_text), dtype=np.float64, count=len(num_text))
        has_space = np.zeros(vocab_size, dtype=bool)
        has_space[np.asarray(space_ids, dtype=np.int64)] = True
        sp = has_space[ids]

        # Classes keyed by (digit count, has_space), in that order.
        key = nd * 2 + sp.astype(np.int64)
        class_keys, cls_of = np.unique(key, return_inverse=True)
        n_cls = len(class_keys)
        # Sort members by (class, value, id) -> position within the class row.
        order = np.lexsort((ids, val, cls_of))
        cls_sorted = cls_of[order]
        counts = np.bincount(cls_of, minlength=n_cls)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        col_sorted = np.arange(len(order)) - starts[cls_sorted]
        width = int(counts.max())

        class_members = np.zeros((n_cls, width), dtype=np.int64)
        class_mask = np.zeros((n_cls, width), dtype=bool)
        class_values = np.zeros((n_cls, width), dtype=np.float64)
        class_members[cls_sorted, col_sorted] = ids[order]
        class_mask[cls_sorted, col_sorted] = True
        class_values[cls_sorted, col_sorted] = val[order]

        def full(fill: Any, dtype: Any) -> np.ndarray:
            return np.full(vocab_size, fill, dtype=dtype)

        is_number, num_digits, value = full(False, bool), full(0, np.int64), full(0.0, np.float64)
        token_class, position = full(-1, np.int64), full(-1, np.int64)
        is_number[ids], num_digits[ids], value[ids] = True, nd, val
        token_class[ids] = cls_of
        position[ids[order]] = col_sorted
        is_dot, is_minus = full(False, bool), full(False, bool)
        is_dot[np.asarray(dot_ids, dtype=np.int64)] = True
        is_minus[np.asarray(minus_ids, dtype=np.int64)] = True
        group_separator = full(0, np.int64)
        group_separator[np.asarray(list(separator_codes), dtype=np.int64)] = list(
            separator_codes.values()
        )

        t = torch.from_numpy
        return cls(
            vocab_size=vocab_size,
            is_number=t(is_number),
            num_digits=t(num_digits),
            value=t(value),
            has_space=t(has_space),
            token_class=t(token_class),
            position_in_class=t(position),
            class_members=t(class_members),
            class_mask=t(class_mask),
            class_values=t(class_values),
            class_num_digits=t(class_keys // 2),
            class_has_space=t(class_keys % 2 == 1),
            digit_ids=torch.tensor(digit_ids, dtype=torch.long),
            is_decimal_point=t(is_dot),
            is_minus=t(is_minus),
            group_separator=t(group_separator),
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> NumberVocab:
        """Build from a transformers tokenizer (id -> token text over ``range(len(tokenizer))``).

        Results are cached per tokenizer object (weakly), keyed by its length and vocab_size.
        """
        n_tok = len(tokenizer)
        key = (n_tok, vocab_size)
        try:
            per_tok = _VOCAB_CACHE.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable / hashable: no cache
            per_tok = {}
        if key not in per_tok:
            per_tok[key] = cls.from_token_strings(_token_strings(tokenizer), vocab_size)
        return per_tok[key]

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.is_number.device

    @property
    def num_classes(self) -> int:
        """C, the number of classes."""
        return int(self.class_members.shape[0])

    @property
    def is_digit_token(self) -> torch.Tensor:
        """[V] bool, True exactly at the ten ``digit_ids`` (computed once, cached)."""
        cached = self.__dict__.get("_is_digit_token")
        if cached is None:
            ids = self.digit_ids[self.digit_ids >= 0]
            cached = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            cached[ids] = True
            self.__dict__["_is_digit_token"] = cached
        return cached

    def to(self, device: torch.device | str) -> NumberVocab:
        """A copy with every tensor on ``device`` (``self`` if already there; copies cached)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device == device:
            return self
        cache: dict[torch.device, NumberVocab] = self.__dict__.setdefault("_to_cache", {})
        if device not in cache:
            moved = {
                f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
                for f in fields(self)
                for v in [getattr(self, f.name)]
            }
            cache[device] = type(self)(**moved)
        return cache[device]


def _byte_level_table() -> dict[int, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2, Qwen, LLaMA-3), for ``str.translate``:
    code point of the character -> the byte it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to 256 + k in
    byte order (Radford et al. 2019, the GPT-2 encoder).
    """
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in set(kept)]
    table = {b: b for b in kept}
    table.update({256 + k: b for k, b in enumerate(shifted)})
    return table


_BYTE_LEVEL = _byte_level_table()


def _token_text(token: str) -> str:
    """The text a token stands for: byte-level tokens decoded (UTF-8), others as they are."""
    if token.isascii():
        return token
    try:  # every character of a byte-level token maps to one byte
        return token.translate(_BYTE_LEVEL).encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):  # not byte-level (or a partial character)
        return token


def _warn_unscored_digits(tokens: Sequence[str | None]) -> None:
    """Warn (once per vocabulary) about tokens made of non-ASCII decimal digits.

    Arabic-Indic '٣', Devanagari '३', fullwidth '３' (Qwen has 12 such tokens) are digits to a
    reader but are not number tokens here: the number objectives never score them. The text
    side (:func:`emdlm.metrics.parse_number`) reads them after NFKC normalization.
    """
    found: list[str] = []
    for tok in tokens:
        if not tok or tok.isascii():
            continue
        text, _ = _strip_marker(_token_text(tok).replace(" ", "▁", 1))
        if text and text.isdecimal() and not text.isascii():
            found.append(text)
    if found:
        shown = ", ".join(repr(t) for t in found[:6]) + (", ..." if len(found) > 6 else "")
        warnings.warn(
            f"{len(found)} token(s) are runs of non-ASCII decimal digits ({shown}); the number "
            "objectives score ASCII digits 0-9 only, so these tokens are not scored as numbers",
            UserWarning,
            stacklevel=3,
        )


_VOCAB_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[int, int | None], NumberVocab]] = (
    weakref.WeakKeyDictionary()
)


def _token_strings(tokenizer: Any) -> list[str | None]:
    """id -> token text for ids in ``range(len(tokenizer))`` (None where an id has no token)."""
    n_tok = len(tokenizer)
    try:
        toks = tokenizer.convert_ids_to_tokens(list(range(n_tok)))
        if len(toks) == n_tok:
            return [t if isinstance(t, str) else None for t in toks]
    except Exception:  # some tokenizers lack the batch form: fall back to the vocab dict
        pass
    out: list[str | None] = [None] * n_tok
    for tok, i in tokenizer.get_vocab().items():
        if 0 <= i < n_tok:
            out[i] = tok
    return out


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
    *,
    join_decimal: bool = False,
    signed: bool = False,
    digits_only: bool = False,
    ignore_index: int = -100,
    thousands_separator: str | None = None,
    number_mask: torch.Tensor | None = None,
) -> SpanDraft:
    """:func:`find_number_spans` up to its host sync: the checks and the [B, T] masks.

    No host sync. Read :meth:`SpanDraft.sizes` (with whatever else the caller needs on the
    host: the chunked NTIL objective folds them into the one read of its loss call), raise
    :meth:`SpanDraft.range_error` if labels are out of range, then :meth:`SpanDraft.finish`.
    Arguments and the other errors as :func:`find_number_spans`.
    """
    if thousands_separator is not None and thousands_separator not in GROUP_SEPARATORS:
        raise ValueError(
            f"thousands_separator must be None or one of {GROUP_SEPARATORS}, got "
            f"{thousands_separator!r}"
        )
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
    *,
    join_decimal: bool = False,
    signed: bool = False,
    digits_only: bool = False,
    ignore_index: int = -100,
    thousands_separator: str | None = None,
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
        vocab: the :class:`NumberVocab` of the tokenizer.
        join_decimal: join "int '.' frac" into one decimal number (paper preset).
        signed: a minus token before a number makes it negative (paper preset).
        digits_only: only '0'..'9' are number tokens (official xfey/NTIL preset).
        ignore_index: label value that is never scored.
        thousands_separator: None (default: a separator ends a number) or one of
            :data:`GROUP_SEPARATORS`, e.g. "," to read "1,234" as 1234.
        number_mask: None, or a bool tensor of the labels' shape: True where a token may be
            scored as a number. A number is kept only if all its number tokens are True; the
            others are left out entirely (module docstring).

    Raises:
        ValueError: labels of the wrong rank, a label outside [0, V) other than ignore_index,
            an unknown thousands_separator, or a number_mask whose shape is not the labels'.
        TypeError: non-integer labels or a number_mask that is not a bool tensor.
    """
    return draft_number_spans(
        labels,
        vocab,
        join_decimal=join_decimal,
        signed=signed,
        digits_only=digits_only,
        ignore_index=ignore_index,
        thousands_separator=thousands_separator,
        number_mask=number_mask,
    ).resolve()  # the single host sync: output sizes (and the label-range check)
