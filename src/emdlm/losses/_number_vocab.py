"""What the numeric losses (NTIL, digit EMD, NTL-MSE, number-level) share: their number
vocabulary, given as a :class:`~emdlm.numbers.NumberVocab` or built from a tokenizer (at
construction when the vocabulary size is known, else at the first call from the logits' number
of rows), and the base class that reads it and their settings."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from emdlm.losses.base import EMDLMLoss
from emdlm.numbers import NumberVocab


def scored_number_problem(vocab: NumberVocab, digits_only: bool) -> str | None:
    """Why a numeric loss would score no token of ``vocab`` (None when it scores some; a
    NumberVocab always has a number token): ``digits_only`` (only the ten tokens '0'..'9' are
    numbers) and none of those ten. Multi-digit tokens alone ('00'..'99') are scored when
    ``digits_only`` is off: their classes are the EMD's candidate sets."""
    if digits_only and bool((vocab.digit_ids < 0).all()):
        return ("digits_only scores only the single-digit tokens '0'..'9' and the vocabulary has "
                "none of them (its number tokens have several digits): use digits_only=False "
                "(a preset that scores multi-digit tokens) or a tokenizer with digit tokens")
    return None


class NumberVocabSource:
    """Where a numeric loss gets its :class:`NumberVocab` for a call's logits.

    Args:
        tokenizer_or_number_vocab: a tokenizer (the vocabulary is built from it) or a
            NumberVocab (used as is: its size is fixed).
        vocab_size: the logits' vocabulary rows, when known up front (a model's head may have
            more rows than the tokenizer has ids); None: taken from each call's logits.
        digits_only: the loss scores only '0'..'9' (see :func:`scored_number_problem`).

    Raises:
        ValueError: when the vocabulary is built (here when its size is known, else at the
            first call), if the loss would score none of its tokens.
    """

    def __init__(
        self, tokenizer_or_number_vocab: Any, vocab_size: int | None, digits_only: bool = False
    ) -> None:
        self.digits_only = bool(digits_only)
        if isinstance(tokenizer_or_number_vocab, NumberVocab):
            self.tokenizer = None
            self.vocab: NumberVocab | None = tokenizer_or_number_vocab
            if vocab_size is not None and vocab_size != self.vocab.vocab_size:
                raise ValueError(
                    f"vocab_size={vocab_size} disagrees with the NumberVocab's "
                    f"{self.vocab.vocab_size} rows"
                )
            self.fixed_size = True
            self._check(self.vocab)
        else:
            self.tokenizer = tokenizer_or_number_vocab
            self.vocab = (
                NumberVocab.from_tokenizer(self.tokenizer, vocab_size)
                if vocab_size is not None
                else None
            )
            self.fixed_size = vocab_size is not None
            if self.vocab is not None:
                self._check(self.vocab)

    def _check(self, vocab: NumberVocab) -> None:
        problem = scored_number_problem(vocab, self.digits_only)
        if problem is not None:
            name = getattr(self.tokenizer, "name_or_path", None)  # None: given a NumberVocab
            raise ValueError(f"tokenizer {name!r}: {problem}" if name else problem)

    def for_logits(self, logits: torch.Tensor) -> NumberVocab:
        """The vocabulary for ``logits`` [..., V] on their device; ValueError when a fixed-size
        vocabulary does not have V rows."""
        rows = logits.shape[-1]
        if self.vocab is None or (not self.fixed_size and self.vocab.vocab_size != rows):
            # Raises a clear error when the logits have fewer rows than the tokenizer's ids.
            self.vocab = NumberVocab.from_tokenizer(self.tokenizer, rows)
            self._check(self.vocab)
        if self.vocab.vocab_size != rows:
            raise ValueError(
                f"logits have {rows} vocabulary rows (shape {tuple(logits.shape)}) but the "
                f"NumberVocab was built for {self.vocab.vocab_size}: build it with "
                f"vocab_size={rows}"
            )
        return self.vocab.to(logits.device)


class NumericLoss(EMDLMLoss):
    """Base of the losses that score numbers: they take a ``number_mask``, keep their options
    in ``self.settings`` (``reduction`` and ``ignore_index`` read from it, read-only: the
    integrations check them as every loss's) and their vocabulary in ``self._numbers``."""

    takes_number_mask: ClassVar[bool] = True
    settings: Any
    _numbers: NumberVocabSource

    @property
    def reduction(self) -> str:  # type: ignore[override]
        """"mean" or "sum" (read-only, from the settings)."""
        return self.settings.reduction

    @property
    def ignore_index(self) -> int:  # type: ignore[override]
        """The label value that is not scored (read-only, from the settings)."""
        return self.settings.ignore_index

    @property
    def number_vocab(self) -> NumberVocab | None:
        """The :class:`NumberVocab` in use (None until the first call when built lazily)."""
        return self._numbers.vocab

    def _vocab_for(self, logits: torch.Tensor) -> NumberVocab:
        return self._numbers.for_logits(logits)
