"""NumberVocab construction and find_number_spans: hand-worked span tables on the real
tokenizers, equality with a plain-Python scanner on random rows, properties and errors."""

from __future__ import annotations

import dataclasses
import re
import warnings
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from emdlm.number_spans import NumberSpans, SpanOptions, find_number_spans
from emdlm.numbers import NumberVocab, _token_strings

PAPER = {"join_decimal": True, "signed": True}
OFFICIAL = {"digits_only": True}


# ----------------------------------------------------------------------------- helpers
def table(tokenizer: Any, vocab: NumberVocab, text: str, **preset: bool) -> list[tuple]:
    """(value, token pieces, digits_right, place) for each number of ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = find_number_spans(torch.tensor([ids]), vocab, SpanOptions(**preset))
    pieces = tokenizer.convert_ids_to_tokens([ids[i] for i in spans.flat_index.tolist()])
    out = []
    for n in range(spans.n_numbers):
        sel = (spans.number_id == n).nonzero().flatten().tolist()
        out.append(
            (
                spans.gold_value[n].item(),
                [pieces[i] for i in sel],
                spans.digits_right[sel].tolist(),
                spans.place[sel].tolist(),
            )
        )
    return out


def values(rows: list[tuple]) -> list[float]:
    return [r[0] for r in rows]


def pieces(rows: list[tuple]) -> list[list[str]]:
    return [r[1] for r in rows]


BIG = "12345678901234567890"
MIXED = f"x=3.015, y=-42, t=2_55, {BIG}"


# ----------------------------------------------------------------------------- vocab
def test_gpt2_vocab_classes(gpt2_vocab: NumberVocab) -> None:
    v = gpt2_vocab
    assert v.vocab_size == 50257
    assert int(v.is_number.sum()) == 1691  # GPT-2's number tokens (' 12345' is 'Ġ123', '45')
    assert v.digit_ids.tolist() == list(range(15, 25))  # '0'..'9' are ids 15..24 in GPT-2
    ids = v.is_number.nonzero().flatten()
    # Every number token sits at its (class, column) and classes are sorted by value.
    assert torch.equal(v.class_members[v.token_class[ids], v.position_in_class[ids]], ids)
    vals = torch.where(v.class_mask, v.class_values, torch.inf)
    assert bool((vals[:, 1:] >= vals[:, :-1]).all())
    assert torch.equal(v.class_mask.sum(1), torch.bincount(v.token_class[ids]))
    keys = list(zip(v.class_num_digits.tolist(), v.class_has_space.tolist(), strict=True))
    assert keys == sorted(keys)
    assert bool((v.class_num_digits[v.token_class[ids]] == v.num_digits[ids]).all())
    assert bool((v.class_has_space[v.token_class[ids]] == v.has_space[ids]).all())
    assert bool((v.class_members[~v.class_mask] == 0).all())
    assert bool((v.class_values[~v.class_mask] == 0).all())
    # Padding and non-number rows.
    assert bool((v.token_class[~v.is_number] == -1).all())
    assert bool((v.value[~v.is_number] == 0).all())


def test_vocab_from_strings_details() -> None:
    toks = [
        "7",
        "Ġ007",
        "▁12",
        "²",
        "١",
        "Ġ",
        "",
        None,
        ".",
        "Ġ.",
        "▁.",
        "..",
        "-",
        "Ġ-",
        "=-",
        "Ġ3",
        "ĠĠ4",
        "0",
        "x-y",
    ]
    v = NumberVocab.from_token_strings(toks, vocab_size=25)
    num = [toks[i] for i in v.is_number.nonzero().flatten().tolist()]
    assert num == ["7", "Ġ007", "▁12", "Ġ3", "0"]  # not '²', '١', 'ĠĠ4' (one marker only)
    assert v.value[1].item() == 7.0 and v.num_digits[1].item() == 3
    assert v.digit_ids.tolist() == [17, -1, -1, -1, -1, -1, -1, 0, -1, -1]
    assert v.is_decimal_point.nonzero().flatten().tolist() == [8, 9, 10]
    assert v.is_minus.nonzero().flatten().tolist() == [12, 13, 14]
    assert v.has_space.nonzero().flatten().tolist() == [1, 2, 5, 9, 10, 13, 15, 16]
    # Classes: (1, no space) = {'0','7'}, (1, space) = {'Ġ3'}, (2, space) = {'▁12'},
    # (3, space) = {'Ġ007'}; rows past len(toks) are not numbers.
    assert v.class_num_digits.tolist() == [1, 1, 2, 3]
    assert v.class_has_space.tolist() == [False, True, True, True]
    assert v.class_members.tolist() == [[17, 0], [15, 0], [2, 0], [1, 0]]
    assert v.class_mask.tolist() == [[True, True], [True, False], [True, False], [True, False]]
    assert v.class_values.tolist() == [[0.0, 7.0], [3.0, 0.0], [12.0, 0.0], [7.0, 0.0]]
    assert v.position_in_class[[0, 17, 15]].tolist() == [1, 0, 0]
    assert not bool(v.is_number[len(toks) :].any())


def test_vocab_errors(gpt2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="no digit tokens"):
        NumberVocab.from_token_strings(["a", "Ġb", "²", None])
    with pytest.raises(ValueError, match=r"vocab_size=50000 .* 50257"):
        NumberVocab.from_tokenizer(gpt2_tokenizer, vocab_size=50000)


def test_qwen_vocab(qwen_tokenizer: Any, qwen_vocab: NumberVocab) -> None:
    assert len(qwen_tokenizer) == 151665
    assert qwen_vocab.vocab_size == 151936 and qwen_vocab.is_number.shape == (151936,)
    assert not bool(qwen_vocab.is_number[151665:].any())
    assert qwen_vocab.digit_ids.tolist() == qwen_tokenizer.convert_tokens_to_ids(list("0123456789"))


def test_vocab_to_device(gpt2_vocab: NumberVocab) -> None:
    assert gpt2_vocab.to("cpu") is gpt2_vocab
    meta = gpt2_vocab.to("meta")
    assert meta.class_members.device.type == "meta" and meta.vocab_size == 50257
    assert gpt2_vocab.to("meta") is meta  # cached copy
    assert gpt2_vocab.is_number.device.type == "cpu"  # original untouched


def test_vocab_cached_per_tokenizer(char_tokenizer: Any) -> None:
    assert NumberVocab.from_tokenizer(char_tokenizer) is NumberVocab.from_tokenizer(char_tokenizer)
    assert NumberVocab.from_tokenizer(char_tokenizer, 128).vocab_size == 128


# ----------------------------------------------------------------------------- real tables
def test_gpt2_tables(gpt2_tokenizer: Any, gpt2_vocab: NumberVocab) -> None:
    tok, v = gpt2_tokenizer, gpt2_vocab
    got = table(tok, v, MIXED, **PAPER)
    big_pieces = ["Ġ123", "45", "67", "89", "01", "23", "45", "678", "90"]
    assert got[0] == (3.015, ["3", "015"], [3, 2], [0, -3])
    assert got[1] == (-42.0, ["42"], [1], [0])  # '=-' signs it
    assert got[2:4] == [(2.0, ["2"], [0], [0]), (55.0, ["55"], [1], [0])]
    assert got[4][1:] == (
        big_pieces,
        [19, 16, 14, 12, 10, 8, 6, 4, 1],
        [17, 15, 13, 11, 9, 7, 5, 2, 0],
    )
    assert got[4][0] == pytest.approx(float(BIG), rel=1e-15)
    assert len(got) == 5
    # Official: only '0'..'9' tokens count; '015', '42', '55' and the Ġ/multi-digit pieces don't.
    assert table(tok, v, MIXED, **OFFICIAL) == [(3.0, ["3"], [0], [0]), (2.0, ["2"], [0], [0])]
    assert table(tok, v, "12345", **PAPER) == [(12345.0, ["123", "45"], [4, 1], [2, 0])]
    assert table(tok, v, "123 45", **PAPER) == [
        (123.0, ["123"], [2], [0]),
        (45.0, ["Ġ45"], [1], [0]),
    ]
    assert values(table(tok, v, "7 8 9", **PAPER)) == [7.0, 8.0, 9.0]
    assert pieces(table(tok, v, "7 8 9", **OFFICIAL)) == [["7"]]
    assert values(table(tok, v, "5 - 3", **PAPER)) == [5.0, 3.0]
    assert values(table(tok, v, "3-5", **PAPER)) == [3.0, 5.0]
    assert values(table(tok, v, "3-5", **OFFICIAL)) == [3.0, 5.0]
    assert values(table(tok, v, "a -5 and (-7)", **PAPER)) == [-5.0, -7.0]
    assert values(table(tok, v, "1.2.3", **PAPER)) == [1.2, 3.0]


def test_qwen_tables(qwen_tokenizer: Any, qwen_vocab: NumberVocab) -> None:
    tok, v = qwen_tokenizer, qwen_vocab
    got = table(tok, v, MIXED, **PAPER)
    assert got[0] == (3.015, ["3", "0", "1", "5"], [3, 2, 1, 0], [0, -1, -2, -3])
    assert got[1] == (-42.0, ["4", "2"], [1, 0], [1, 0])
    assert got[2:4] == [(2.0, ["2"], [0], [0]), (55.0, ["5", "5"], [1, 0], [1, 0])]
    assert got[4][1:] == (list(BIG), list(range(19, -1, -1)), list(range(19, -1, -1)))
    assert got[4][0] == pytest.approx(float(BIG), rel=1e-15)
    assert len(got) == 5
    off = table(tok, v, MIXED, **OFFICIAL)
    assert values(off)[:4] == [3.0, 15.0, 42.0, 2.0]  # "3.015" -> 3 and 15; no sign
    assert off[1] == (15.0, ["0", "1", "5"], [2, 1, 0], [2, 1, 0])
    assert values(off)[4] == 55.0 and len(off) == 6
    for preset in (PAPER, OFFICIAL):
        assert values(table(tok, v, "123 45", **preset)) == [123.0, 45.0]
        assert values(table(tok, v, "7 8 9", **preset)) == [7.0, 8.0, 9.0]
        assert values(table(tok, v, "5 - 3", **preset)) == [5.0, 3.0]
        assert values(table(tok, v, "3-5", **preset)) == [3.0, 5.0]


def test_llama3_tables(llama3_tokenizer: Any, llama3_vocab: NumberVocab) -> None:
    tok, v = llama3_tokenizer, llama3_vocab
    got = table(tok, v, MIXED, **PAPER)
    assert got[0] == (3.015, ["3", "015"], [3, 2], [0, -3])
    assert got[1] == (-42.0, ["42"], [1], [0])  # '=', '-', '42'
    assert got[2:4] == [(2.0, ["2"], [0], [0]), (55.0, ["55"], [1], [0])]
    big = ["123", "456", "789", "012", "345", "678", "90"]
    assert got[4][1:] == (big, [19, 16, 13, 10, 7, 4, 1], [17, 14, 11, 8, 5, 2, 0])
    assert len(got) == 5
    assert table(tok, v, MIXED, **OFFICIAL) == [(3.0, ["3"], [0], [0]), (2.0, ["2"], [0], [0])]
    assert values(table(tok, v, "123 45", **PAPER)) == [123.0, 45.0]
    assert values(table(tok, v, "7 8 9", **PAPER)) == [7.0, 8.0, 9.0]
    assert values(table(tok, v, "7 8 9", **OFFICIAL)) == [7.0, 8.0, 9.0]
    assert values(table(tok, v, "5 - 3", **PAPER)) == [5.0, 3.0]
    assert values(table(tok, v, "3-5", **PAPER)) == [3.0, 5.0]


def test_thirty_digit_number_is_finite(real_tokenizer: tuple) -> None:
    _, tok, v = real_tokenizer
    text = "n=" + "9" * 30 + ".5"
    (row,) = table(tok, v, text, **PAPER)
    assert row[0] == pytest.approx(1e30, rel=1e-12)
    assert row[2][0] == 30 and row[3][-1] == -1  # leading digit weight exponent; last place


# ----------------------------------------------------------------------------- reference
SYN_TOKENS = [
    "0",
    "1",
    "2",
    "3",
    "9",
    "12",
    "345",
    "007",
    "Ġ5",
    "Ġ42",
    "▁7",
    ".",
    "Ġ.",
    "-",
    "Ġ-",
    "=-",
    "x",
    "Ġy",
    "²",
    None,
]
SYN_VOCAB = NumberVocab.from_token_strings(SYN_TOKENS, vocab_size=len(SYN_TOKENS) + 3)


def _is_num(text: str | None, digits_only: bool) -> bool:
    if not text:
        return False
    if digits_only:
        return len(text) == 1 and text in "0123456789"
    rest = text[1:] if text[0] in "Ġ▁" else text
    return rest.isascii() and rest.isdigit()


def reference_spans(rows: list[list[int]], join: bool, signed: bool, digits_only: bool) -> dict:
    """Left-to-right scanner over each row; numbers as lists of (row, col, digit text, frac)."""
    T = max((len(r) for r in rows), default=0)
    numbers: list[dict] = []
    for b, row in enumerate(rows):
        texts = [
            None if lab == -100 else SYN_TOKENS[lab] if lab < len(SYN_TOKENS) else None
            for lab in row
        ]
        cur: dict | None = None
        last_num_col = -2  # column of the previous token if it was in `cur`
        dot_col = -2  # column of a '.' that may join the next run to `cur`
        for t, text in enumerate(texts):
            if _is_num(text, digits_only):
                marked = text[0] in "Ġ▁"
                digits = text[1:] if marked else text
                if cur is not None and last_num_col == t - 1 and not marked:
                    cur["tokens"].append((b, t, digits, cur["has_dot"]))
                elif cur is not None and dot_col == t - 1 and not marked:
                    cur["has_dot"] = True
                    cur["tokens"].append((b, t, digits, True))
                else:
                    # ".5": a bare '.' right before, and no number token before the '.'.
                    lead = (
                        join
                        and not marked
                        and t >= 1
                        and texts[t - 1] == "."
                        and not (t >= 2 and _is_num(texts[t - 2], digits_only))
                    )
                    k = 2 if lead else 1  # where a minus sign would sit: t-1, or t-2 for "-.5"
                    neg = (
                        signed
                        and not marked
                        and t >= k
                        and (texts[t - k] or "").endswith("-")
                        and not (t >= k + 1 and _is_num(texts[t - k - 1], False))
                    )
                    cur = {
                        "row": b,
                        "tokens": [(b, t, digits, lead)],
                        "neg": neg,
                        "has_dot": lead,
                    }
                    numbers.append(cur)
                last_num_col = t
            else:
                if join and text == "." and cur is not None and last_num_col == t - 1:
                    dot_col = t if not cur["has_dot"] else -2
                else:
                    dot_col = -2
                if dot_col != t:
                    cur = None
    out: dict[str, list] = {k: [] for k in ("flat", "nid", "nd", "dr", "place")}
    out.update(row=[], value=[], ntok=[], sign=[])
    for n, num in enumerate(numbers):
        int_str = "".join(d for _, _, d, f in num["tokens"] if not f)
        frac_str = "".join(d for _, _, d, f in num["tokens"] if f)
        total = len(int_str) + len(frac_str)
        seen = 0
        for b, t, d, _ in num["tokens"]:
            seen += len(d)
            out["flat"].append(b * T + t)
            out["nid"].append(n)
            out["nd"].append(len(d))
            out["dr"].append(total - seen + len(d) - 1)
            out["place"].append(len(int_str) - seen)
        mag = Fraction(int(int_str + frac_str), 10 ** len(frac_str))
        out["row"].append(num["row"])
        out["sign"].append(-1.0 if num["neg"] else 1.0)
        out["value"].append(float(-mag if num["neg"] else mag))
        out["ntok"].append(len(num["tokens"]))
    return out


def check_against_reference(rows: list[list[int]], spans: NumberSpans, **preset: bool) -> None:
    ref = reference_spans(
        rows,
        preset.get("join_decimal", False),
        preset.get("signed", False),
        preset.get("digits_only", False),
    )
    assert spans.flat_index.tolist() == ref["flat"]
    assert spans.number_id.tolist() == ref["nid"]
    assert spans.num_digits.tolist() == ref["nd"]
    assert spans.digits_right.tolist() == ref["dr"]
    assert spans.place.tolist() == ref["place"]
    assert spans.number_row.tolist() == ref["row"]
    assert spans.num_tokens.tolist() == ref["ntok"]
    assert spans.sign.tolist() == ref["sign"]
    assert spans.gold_value.tolist() == pytest.approx(ref["value"], rel=1e-14)
    labels = torch.tensor(rows)
    gold = labels.view(-1)[spans.flat_index]
    assert torch.equal(spans.token_class, SYN_VOCAB.token_class[gold])
    assert torch.equal(spans.gold_column, SYN_VOCAB.position_in_class[gold])
    for dt in (spans.flat_index, spans.number_id, spans.place, spans.num_tokens):
        assert dt.dtype == torch.long
    assert spans.gold_value.dtype == torch.float64 and spans.sign.dtype == torch.float64


label_st = st.one_of(st.integers(0, SYN_VOCAB.vocab_size - 1), st.just(-100))
# Weight the interesting tokens: digits, '.', '-'.
label_st = st.one_of(label_st, st.sampled_from([0, 1, 2, 3, 4, 11, 13, 5, 8]))
batch_st = st.integers(1, 14).flatmap(
    lambda T: st.lists(st.lists(label_st, min_size=T, max_size=T), min_size=1, max_size=4)
)
presets = st.sampled_from(
    [PAPER, OFFICIAL, {}, {"join_decimal": True}, {"signed": True}, {**PAPER, **OFFICIAL}]
)


@settings(max_examples=300, deadline=None)
@given(rows=batch_st, preset=presets)
def test_matches_reference(rows: list[list[int]], preset: dict) -> None:
    spans = find_number_spans(torch.tensor(rows), SYN_VOCAB, SpanOptions(**preset))
    check_against_reference(rows, spans, **preset)


@settings(max_examples=100, deadline=None)
@given(rows=batch_st, preset=presets, pad=st.integers(1, 5), data=st.data())
def test_padding_and_row_permutation(rows: list[list[int]], preset: dict, pad: int, data) -> None:
    labels = torch.tensor(rows)
    B, T = labels.shape
    base = find_number_spans(labels, SYN_VOCAB, SpanOptions(**preset))
    padded = find_number_spans(
        torch.cat([labels, torch.full((B, pad), -100)], 1), SYN_VOCAB, SpanOptions(**preset)
    )
    # Right padding: same numbers at the same (row, column).
    assert torch.equal(base.flat_index // T, padded.flat_index // (T + pad))
    assert torch.equal(base.flat_index % T, padded.flat_index % (T + pad))
    for name in (
        "number_id",
        "place",
        "digits_right",
        "token_class",
        "number_row",
        "gold_value",
        "sign",
        "num_tokens",
    ):
        assert torch.equal(getattr(base, name), getattr(padded, name)), name
    # Row permutation: the per-number results are permuted (numbers never span rows).
    perm = data.draw(st.permutations(list(range(B))))
    moved = find_number_spans(labels[perm], SYN_VOCAB, SpanOptions(**preset))
    inv = {new: old for new, old in enumerate(perm)}

    def per_row(s: NumberSpans, row_map: dict[int, int]) -> list[tuple]:
        return sorted(
            (row_map[r], v, n)
            for r, v, n in zip(
                s.number_row.tolist(), s.gold_value.tolist(), s.num_tokens.tolist(), strict=True
            )
        )

    assert per_row(moved, inv) == per_row(base, {b: b for b in range(B)})
    # Numbers are contiguous in flat order and never cross a row.
    rows_of_tokens = base.flat_index // T
    assert torch.equal(rows_of_tokens, base.number_row[base.number_id])


def test_decimal_and_sign_rules() -> None:
    ids = {t: i for i, t in enumerate(SYN_TOKENS) if t is not None}

    def run(seq: list[str], **preset: bool) -> list[float]:
        lab = torch.tensor([[ids[t] if t != "PAD" else -100 for t in seq]])
        return find_number_spans(lab, SYN_VOCAB, SpanOptions(**preset)).gold_value.tolist()

    assert run(["1", ".", "2", ".", "3"], **PAPER) == [1.2, 3.0]
    assert run(["1", ".", "2", ".", "3", ".", "9"], **PAPER) == [1.2, 3.9]
    assert run(["3", "Ġ.", "1"], **PAPER) == [3.0, 1.0]  # marked '.' never joins
    assert run(["3", ".", "Ġ5"], **PAPER) == [3.0, 5.0]  # marked fraction never joins
    assert run(["3", ".", "PAD", "1"], **PAPER) == [3.0, 1.0]
    assert run(["-", "3", ".", "1"], **PAPER) == [-3.1]
    assert run(["-", "Ġ5"], **PAPER) == [5.0]  # "- 5": the marked number is not signed
    assert run(["2", "-", "3"], **PAPER) == [2.0, 3.0]  # subtraction
    assert run(["12", "Ġ-", "3"], **PAPER) == [12.0, 3.0]  # after any number token
    assert run(["12", "Ġ-", "3"], signed=True, digits_only=True) == [3.0]  # '12' not scored
    assert run(["x", "=-", "007"], **PAPER) == [-7.0]
    assert run(["-", "PAD", "3"], **PAPER) == [3.0]
    assert run(["3", ".", "1"], **OFFICIAL) == [3.0, 1.0]
    assert run(["3", ".", "1"], **PAPER, digits_only=True) == [3.1]
    # A leading '.': ".5" is 0.5 with join_decimal, 5 in the official preset.
    assert run([".", "3"], **PAPER) == [0.3]
    assert run(["x", ".", "12", "3"], **PAPER) == [0.123]
    assert run(["-", ".", "3"], **PAPER) == [-0.3]
    assert run(["=-", ".", "007"], **PAPER) == [-0.007]
    assert run(["2", "-", ".", "3"], **PAPER) == [2.0, 0.3]  # subtraction, not a sign
    assert run(["PAD", ".", "3"], **PAPER) == [0.3]
    assert run([".", "Ġ5"], **PAPER) == [5.0]  # ". 5": a marked token never joins
    assert run(["Ġ.", "3"], **PAPER) == [3.0]
    assert run(["3", ".", ".", "1"], **PAPER) == [3.0, 0.1]
    assert run([".", "0", ".", "0"], **PAPER) == [0.0, 0.0]  # ".0" then "0": one '.' a number
    assert run([".", "3", ".", "2", ".", "9"], **PAPER) == [0.3, 2.9]
    assert run([".", "3"], **OFFICIAL) == [3.0]
    assert run([".", "3"], join_decimal=False) == [3.0]


def test_leading_point_places_and_weights() -> None:
    ids = {t: i for i, t in enumerate(SYN_TOKENS) if t is not None}
    lab = torch.tensor([[ids["."], ids["12"], ids["3"]]])
    s = find_number_spans(lab, SYN_VOCAB, SpanOptions(**PAPER))
    assert s.gold_value.tolist() == [pytest.approx(0.123, rel=1e-15)]
    assert s.place.tolist() == [-2, -3]  # '12' ends at 10^-2, '3' at 10^-3
    assert s.digits_right.tolist() == [2, 0]
    assert s.flat_index.tolist() == [1, 2]  # the '.' is never scored


SEP_TOKENS = [str(d) for d in range(10)] + ["12", "345", "Ġ678", ",", "Ġ,", ".", "-", "_", "x"]
SEP_VOCAB = NumberVocab.from_token_strings(SEP_TOKENS)


def _sep_run(seq: list[str], **options: Any) -> list[float]:
    lab = torch.tensor([[SEP_TOKENS.index(t) for t in seq]])
    return find_number_spans(lab, SEP_VOCAB, SpanOptions(**options)).gold_value.tolist()


def test_thousands_separator_is_an_option() -> None:
    one_234 = ["1", ",", "2", "3", "4"]
    assert _sep_run(one_234) == [1.0, 234.0]  # off by default
    assert _sep_run(one_234, **OFFICIAL, thousands_separator=",") == [1234.0]
    assert _sep_run(one_234, **PAPER, thousands_separator=",") == [1234.0]
    assert _sep_run(one_234, thousands_separator="_") == [1.0, 234.0]  # another separator
    big = ["12", ",", "345", ",", "9", "9", "9", ".", "5"]
    assert _sep_run(big, **PAPER, thousands_separator=",") == [12345999.5]
    assert _sep_run(["-", *big], **PAPER, thousands_separator=",") == [-12345999.5]
    assert _sep_run(["1", "_", "345"], thousands_separator="_") == [1345.0]


def test_thousands_separator_needs_three_digit_groups() -> None:
    on = {"thousands_separator": ",", **PAPER}
    assert _sep_run(["1", ",", "2", "3"], **on) == [1.0, 23.0]  # "1,23"
    assert _sep_run(["1", ",", "2", "3", "4", "5"], **on) == [1.0, 2345.0]  # "1,2345"
    assert _sep_run(["12", "3", "4", ",", "345"], **on) == [1234.0, 345.0]  # "1234,345"
    assert _sep_run(["1", "Ġ,", "345"], **on) == [1.0, 345.0]  # marked separator
    assert _sep_run(["1", ",", "Ġ678"], **on) == [1.0, 678.0]  # "1, 678": a list
    assert _sep_run(["1", ",", "345", ",", "2"], **on) == [1345.0, 2.0]
    # Never after a decimal point: "1.5,345" and ".5,345" are two numbers each.
    assert _sep_run(["1", ".", "5", ",", "345"], **on) == [1.5, 345.0]
    assert _sep_run([".", "5", ",", "345"], **on) == [0.5, 345.0]
    s = find_number_spans(
        torch.tensor([[SEP_TOKENS.index(t) for t in ["1", ",", "345"]]]),
        SEP_VOCAB,
        SpanOptions(thousands_separator=","),
    )
    assert s.place.tolist() == [3, 0] and s.digits_right.tolist() == [3, 2]
    assert s.flat_index.tolist() == [0, 2] and s.num_tokens.tolist() == [2]
    with pytest.raises(ValueError, match="thousands_separator"):
        SpanOptions(thousands_separator=" ")


def test_span_options_are_checked_once_where_they_are_built() -> None:
    """One SpanOptions holds the reading rules: a flag that is not a bool ("no" would read as
    True), a separator outside GROUP_SEPARATORS, or options given as a dict are refused in one
    line; the loss constructors build theirs from their keyword parameters."""
    from emdlm.losses.ntil import NTILLoss
    from emdlm.losses.ntl import NTLMSELoss

    with pytest.raises(TypeError, match="join_decimal must be True or False, got 'no'"):
        SpanOptions(join_decimal="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="signed must be True or False, got 1"):
        SpanOptions(signed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thousands_separator must be None or one of"):
        SpanOptions(thousands_separator=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options must be a SpanOptions, got dict"):
        find_number_spans(torch.tensor([[0]]), SEP_VOCAB, {"signed": True})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpanOptions().signed = True  # type: ignore[misc]
    with pytest.raises(TypeError, match="digits_only must be True or False"):
        NTILLoss(SEP_VOCAB, digits_only="yes")
    assert NTILLoss(SEP_VOCAB, preset="paper", thousands_separator=",").span_options == (
        SpanOptions(join_decimal=True, signed=True, thousands_separator=",")
    )
    assert NTILLoss(SEP_VOCAB, preset="official").span_options == SpanOptions(digits_only=True)
    assert NTLMSELoss(SEP_VOCAB, preset="ntloss").span_options == SpanOptions(digits_only=True)


def test_vocab_warns_about_non_ascii_digit_tokens() -> None:
    with pytest.warns(UserWarning, match=r"3 token\(s\) are runs of non-ASCII decimal digits"):
        vocab = NumberVocab.from_token_strings(["1", "٣", "▁３", "१२", "²", "x"])
    assert vocab.is_number.tolist() == [True, False, False, False, False, False]
    # Byte-level tokens (GPT-2 / Qwen alphabet) are decoded first: 'ï¼ĵ' is fullwidth '３'.
    with pytest.warns(UserWarning, match="'３'"):
        NumberVocab.from_token_strings(["1", "ï¼ĵ"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NumberVocab.from_token_strings(["1", "é", "Ġ²"])  # no decimal digits: no warning


def test_qwen_fullwidth_digits_are_reported(qwen_tokenizer: Any) -> None:
    with pytest.warns(UserWarning, match=r"12 token\(s\) are runs of non-ASCII"):
        NumberVocab.from_token_strings(_token_strings(qwen_tokenizer))


def test_empty_and_edge_inputs() -> None:
    for lab in (
        torch.full((3, 5), -100),
        torch.zeros((2, 0), dtype=torch.long),
        torch.tensor([[16, 17, 11]]),
    ):
        s = find_number_spans(lab, SYN_VOCAB, SpanOptions(**PAPER))
        assert s.n_tokens == 0 and s.n_numbers == 0
        assert s.gold_value.dtype == torch.float64 and s.flat_index.dtype == torch.long
    one_d = find_number_spans(torch.tensor([1, 2, 16, 3]), SYN_VOCAB)
    assert one_d.gold_value.tolist() == [12.0, 3.0] and one_d.number_row.tolist() == [0, 0]
    int32 = find_number_spans(torch.tensor([[1, 2, 16, 3]], dtype=torch.int32), SYN_VOCAB)
    assert int32.flat_index.tolist() == [0, 1, 3]


def test_label_errors() -> None:
    with pytest.raises(ValueError, match=r"out of range .* \[23\]"):
        find_number_spans(torch.tensor([[1, 23]]), SYN_VOCAB)
    with pytest.raises(ValueError, match=r"out of range .* \[-5\]"):
        find_number_spans(torch.tensor([[-5, 1]]), SYN_VOCAB)
    with pytest.raises(ValueError, match="shape"):
        find_number_spans(torch.zeros((2, 3, 4), dtype=torch.long), SYN_VOCAB)
    with pytest.raises(TypeError, match="integer"):
        find_number_spans(torch.zeros((2, 3)), SYN_VOCAB)
    # A custom ignore_index is honoured; -100 then counts as a label (and is out of range).
    s = find_number_spans(torch.tensor([[1, -1, 2]]), SYN_VOCAB, ignore_index=-1)
    assert s.gold_value.tolist() == [1.0, 2.0]


def test_huge_numbers_stay_finite() -> None:
    # '1' then 399 '0' tokens (0 * 10**400 must not become NaN), and 400 nines with a fraction.
    ones = [1] + [0] * 399
    nines = [4] * 400 + [11] + [4] * 400
    s = find_number_spans(torch.tensor([[*ones, 16, *nines]]), SYN_VOCAB, SpanOptions(**PAPER))
    assert s.n_numbers == 2 and bool(torch.isfinite(s.gold_value).all())
    assert bool((s.gold_value > 1e300).all())
    assert s.digits_right[0].item() == 399 and s.place[-1].item() == -400


@pytest.mark.parametrize("cls_name", ["NTILLoss", "DigitEMDLoss"])
def test_loss_span_option_thousands_separator(char_tokenizer: Any, cls_name: str) -> None:
    from emdlm.losses import ntil

    cls = getattr(ntil, cls_name)
    ids = torch.tensor([char_tokenizer.convert_tokens_to_ids(list("=1,234;.5"))])
    logits = torch.randn(1, ids.shape[1], len(char_tokenizer))

    def numbers(**options: Any) -> int:
        return int(cls(char_tokenizer, **options)(logits, ids).components["n_numbers"])

    assert numbers() == 3  # 1 | 234 | 0.5
    assert numbers(thousands_separator=",") == 2  # 1234 | 0.5
    assert numbers(preset="official") == 3  # 1 | 234 | 5: the official spans are unchanged
    assert numbers(preset="official", thousands_separator=",") == 2
    with pytest.raises(ValueError, match="thousands_separator"):
        cls(char_tokenizer, thousands_separator=".")


# ----------------------------------------------------------------------------- task answers
# Every built-in task's REAL answers (generate_task), read through the training pipeline
# (build_dataset -> DataCollator -> labels) with the span options NTILLoss uses by default, on
# every named tokenizer: the numbers (values and count per answer) must be the ones a reader
# sees. Image sizes are small: only the answers matter here.
TASK_ANSWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "clock": ("clock", {"image_size": 32}),
    "grounding-qwen2vl": ("grounding", {"image_size": 48}),
    "grounding-llava": ("grounding", {"image_size": 48, "box_format": "llava"}),
    "text_detection-qwen2vl": ("text_detection", {"max_words": 4}),
    "text_detection-llava": ("text_detection", {"max_words": 4, "box_format": "llava"}),
    "arithmetic": ("arithmetic", {}),
}
NAMED_TOKENIZERS = ("char", "gpt2", "qwen", "llama3-like")
_READ_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")  # what a reader sees: -12, 0.125, 55


@pytest.fixture(scope="module")
def task_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from emdlm.tasks import generate_task

    cache = tmp_path_factory.mktemp("images")
    rows = {}
    for key, (task, params) in TASK_ANSWERS.items():
        extra = {} if task == "arithmetic" else {"cache_dir": str(cache)}
        rows[key] = generate_task(task, n=12, split="train", seed=5, **params, **extra)
    return rows


def _answer_numbers(tokenizer: Any, rows: list[dict[str, Any]]) -> list[list[float]]:
    """Numbers found in each row's labels, as NTILLoss(tokenizer) reads them by default."""
    from emdlm.data import DataCollator, build_dataset
    from emdlm.losses.ntil import NTILLoss

    items = list(build_dataset(rows, tokenizer, max_length=512))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = DataCollator(pad)(items)
    vocab = NumberVocab.from_tokenizer(tokenizer)
    options = NTILLoss(vocab).span_options
    spans = find_number_spans(batch["labels"], vocab, options)
    found: list[list[float]] = [[] for _ in rows]
    for row, value in zip(spans.number_row.tolist(), spans.gold_value.tolist(), strict=True):
        found[row].append(value)
    return found


@pytest.mark.parametrize("tok_name", NAMED_TOKENIZERS)
def test_task_answers_read_as_their_numbers(
    tok_name: str, task_rows: dict[str, list[dict[str, Any]]], request: pytest.FixtureRequest
) -> None:
    prefix = {"char": "char", "gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}[tok_name]
    tokenizer = request.getfixturevalue(f"{prefix}_tokenizer")
    for key, rows in task_rows.items():
        expected = [[float(x) for x in _READ_NUMBER.findall(r["completion"])] for r in rows]
        assert all(expected), key  # every answer has numbers
        got = _answer_numbers(tokenizer, rows)
        for row, want, have in zip(rows, expected, got, strict=True):
            assert have == want, (tok_name, key, row["completion"])


def test_task_answers_expected_shapes(task_rows: dict[str, list[dict[str, Any]]]) -> None:
    # The reference reading above is itself pinned: 2 numbers per time, 4 per box.
    for row in task_rows["clock"]:
        assert len(_READ_NUMBER.findall(row["completion"])) == 2
    for key in ("grounding-qwen2vl", "grounding-llava"):
        assert all(len(_READ_NUMBER.findall(r["completion"])) == 4 for r in task_rows[key])
    for key in ("text_detection-qwen2vl", "text_detection-llava"):
        counts = [len(_READ_NUMBER.findall(r["completion"])) for r in task_rows[key]]
        assert all(c % 4 == 0 for c in counts) and max(counts) > 4  # several boxes
    llava = task_rows["grounding-llava"][0]["completion"]
    assert re.fullmatch(r"\[\d\.\d{3}(, \d\.\d{3}){3}\]", llava)  # 3-decimal fractions


def test_char_tokenizer_has_no_brackets(char_tokenizer: Any) -> None:
    # A limit of the char tokenizer, not of the span finder: '[' and ']' of LLaVA boxes become
    # <unk> (the numbers between them still read right, test above), so a char-tokenizer model
    # cannot write LLaVA brackets.
    ids = char_tokenizer("[0.5]", add_special_tokens=False)["input_ids"]
    unk = char_tokenizer.unk_token_id
    assert ids[0] == unk and ids[-1] == unk and unk not in ids[1:-1]


def test_thousands_separator_misreads_grid_boxes(gpt2_tokenizer: Any, gpt2_vocab: Any) -> None:
    # Why thousands_separator stays off for box answers: "(123,456)" becomes one number.
    ids = torch.tensor([gpt2_tokenizer("(123,456),(7,890)", add_special_tokens=False)["input_ids"]])
    plain = find_number_spans(ids, gpt2_vocab, SpanOptions(**PAPER))
    joined = find_number_spans(
        ids, gpt2_vocab, SpanOptions(**PAPER, thousands_separator=",")
    )
    assert plain.gold_value.tolist() == [123.0, 456.0, 7.0, 890.0]
    assert joined.gold_value.tolist() == [123456.0, 7890.0]


@pytest.mark.parametrize(
    ("tok_name", "expected"),
    [
        # digit tokenizers: every digit is scored, decimals are not joined
        ("char", [[0, 750, 0, 458, 0, 875, 0, 583], [750, 458, 875, 583], [2, 55]]),
        ("qwen", [[0, 750, 0, 458, 0, 875, 0, 583], [750, 458, 875, 583], [2, 55]]),
        # multi-digit tokenizers: only the lone single-digit tokens ('0', '2'); 'Ġ0', '750',
        # '55' are not among the ten digit ids, so most of a box / time is never scored
        ("gpt2", [[0], [], [2]]),
        ("llama3-like", [[0, 0, 0, 0], [], [2]]),
    ],
)
def test_official_preset_on_task_answers(
    tok_name: str, expected: list[list[int]], request: pytest.FixtureRequest
) -> None:
    # A limit of preset="official" (xfey/NTIL scores only the ten tokens '0'..'9'), pinned:
    # on GPT-2 / LLaMA-3-like tokenizers use the "stable" or "paper" preset for these tasks.
    prefix = {"char": "char", "gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}[tok_name]
    tokenizer = request.getfixturevalue(f"{prefix}_tokenizer")
    vocab = request.getfixturevalue(f"{prefix}_vocab")
    answers = ["[0.750, 0.458, 0.875, 0.583]", "(750,458),(875,583)", "2_55"]
    for text, want in zip(answers, expected, strict=True):
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        got = find_number_spans(ids, vocab, SpanOptions(**OFFICIAL)).gold_value.tolist()
        assert got == [float(x) for x in want], (tok_name, text)


# ----------------------------------------------------------------------------- number_mask
def test_number_mask_drops_whole_numbers(char_tokenizer: Any, char_vocab: Any) -> None:
    text = "a 123 b 4.5 c 67"
    ids = torch.tensor([char_tokenizer(text, add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, text.index("123") + 1] = False  # the '2' of 123: the whole number goes, not "1","3"
    mask[0, text.index("5")] = False  # the fraction digit of 4.5: 4.5 goes, no "4" is left
    spans = find_number_spans(ids, char_vocab, SpanOptions(**PAPER), number_mask=mask)
    assert spans.gold_value.tolist() == [67.0]
    assert spans.n_tokens == 2 and spans.place.tolist() == [1, 0]
    full = find_number_spans(ids, char_vocab, SpanOptions(**PAPER))
    assert full.gold_value.tolist() == [123.0, 4.5, 67.0]
    all_true = find_number_spans(
        ids, char_vocab, SpanOptions(**PAPER), number_mask=torch.ones_like(mask)
    )
    for field in dataclasses.fields(NumberSpans):
        assert torch.equal(getattr(all_true, field.name), getattr(full, field.name)), field.name
    none = find_number_spans(
        ids, char_vocab, SpanOptions(**PAPER), number_mask=torch.zeros_like(mask)
    )
    assert none.n_numbers == 0 and none.n_tokens == 0


def test_number_mask_rows_and_1d(char_tokenizer: Any, char_vocab: Any) -> None:
    rows = torch.tensor(
        [char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12 3", "45 6")]
    )
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    spans = find_number_spans(rows, char_vocab, number_mask=mask)
    assert spans.gold_value.tolist() == [12.0, 6.0] and spans.number_row.tolist() == [0, 1]
    one = find_number_spans(rows[1], char_vocab, number_mask=mask[1])
    assert one.gold_value.tolist() == [6.0]


def test_number_mask_errors(char_vocab: Any) -> None:
    labels = torch.tensor([[15, 16, 17]])
    with pytest.raises(ValueError, match=r"number_mask shape \(1, 2\).*\(1, 3\)"):
        find_number_spans(labels, char_vocab, number_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"dtype torch\.bool"):
        find_number_spans(labels, char_vocab, number_mask=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"bool torch\.Tensor"):
        find_number_spans(labels, char_vocab, number_mask=[[True, True, True]])
