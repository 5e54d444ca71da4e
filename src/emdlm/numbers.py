"""Which vocabulary ids are numbers: :class:`NumberVocab`, built once per tokenizer.

For every vocab id: whether its text (after removing the byte-level space marker 'Ġ' or the
SentencePiece '▁') is a run of ASCII digits, its digit count, value, marker, and its *class* (same
digit count and same marker). Classes are the candidate sets of the multi-digit ordinal EMD. Where
the numbers are in a batch of labels is :mod:`emdlm.number_spans`'s job.

Shape notation: V vocab rows, C number classes, K widest class.
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
#: Thousands separators that :func:`emdlm.number_spans.find_number_spans` can join on (bare
#: tokens only).
GROUP_SEPARATORS = (",", "_", "'")
_DIGITS = frozenset("0123456789")


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
