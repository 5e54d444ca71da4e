"""Which vocabulary ids are numbers, and where the numbers are in a batch of labels.

Two data classes form the contract between tokenization and the numeric objectives:

* :class:`NumberVocab` — built once per tokenizer: for every vocab id, whether its text (after
  removing the byte-level space marker 'Ġ' or the SentencePiece '▁') is a run of ASCII digits,
  its digit count, value, marker, and its *class* (same digit count and same marker). Classes
  are the candidate sets of the multi-digit ordinal EMD.
* :class:`NumberSpans` — built per batch, vectorized over [B, T] with no Python loop over tokens:
  every scored number token (M of them) and every number (S of them).

Shape notation: V vocab rows, C number classes, K widest class, B batch, T time,
M number tokens in the batch, S numbers in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPACE_MARKERS = ("Ġ", "▁")


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
