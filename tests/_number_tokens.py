"""A small synthetic vocabulary with every kind of number token (single digits, space-marked
digits, multi-digit tokens, '.', '-', words), shared by the tests of the from-hidden and
chunked paths: V = len(TOKENS) + 5 rows (the last 5 are not tokens of the vocabulary)."""

from __future__ import annotations

from emdlm.numbers import NumberVocab

TOKENS = (
    [str(d) for d in range(10)]
    + [f"Ġ{d}" for d in range(10)]
    + ["12", "34", "00", "99", "Ġ123", "Ġ45", ".", "-", "Ġ-", "a", "b", "Ġc", "=", "Ġ."]
)
V = len(TOKENS) + 5
VOCAB = NumberVocab.from_token_strings(TOKENS, V)
