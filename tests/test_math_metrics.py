"""Eval kind ``math``: MathVista / MathVision answers scored as the benchmarks
score them, with hand-worked normalisation cases (emdlm.math_answers), and the text detection
Acc@0.5 of kind ``boxes``."""

from __future__ import annotations

import math

import pytest

from emdlm.eval_kinds import eval_kind
from emdlm.evaluation import ROW_FIELDS, evaluate_examples, per_example_fields
from emdlm.math_answers import (
    NO_NUMBERS,
    MathItem,
    infer_item,
    item_from_row,
    make_item,
    math_metrics,
    number_scope,
    parse_value,
    read_choice,
    read_number,
    score_answer,
)
from emdlm.metrics import compute_task_metrics
from emdlm.metrics.boxes import boxes_metrics
from emdlm.number_scope import scope_pattern

CHOICES = ["3", "4.5", "larger than", "smaller than"]
MC = make_item("multi_choice", "text", CHOICES)


def _row(question_type: str, answer_type: str, **more) -> dict:
    return {"question_type": question_type, "answer_type": answer_type, **more}


# ------------------------------------------------------------------------------ multiple choice
@pytest.mark.parametrize(
    ("pred", "want"),
    [
        ("B", 1), ("(B)", 1), ("b.", 1), ("B)", 1), (" c ", 2),
        ("4.5", 1), ("4.50", 1),  # the option text, and the same number written otherwise
        ("Larger than.", 2),  # the option text, normalised
        ("The answer is (B) 4.5", 1), ("The answer is D", 3),
        ("it is smaller than that", 3),  # exactly one option's text inside
        ("(A) or (B)", None), ("A or B", None),  # two letters: no one answer
        ("E", None), ("(F)", None),  # letters beyond the options
        ("larger than or smaller than", None), ("", None), ("seven", None),
    ],
)
def test_a_choice_is_a_letter_or_its_text(pred: str, want: int | None) -> None:
    assert read_choice(pred, CHOICES) == want


def test_multiple_choice_scores_letter_and_text_alike() -> None:
    assert score_answer("B", "B", MC).correct
    assert score_answer("4.5", "B", MC).correct  # text for letter
    assert score_answer("(B) 4.5", "4.5", MC).correct  # a gold given as the option's text
    wrong = score_answer("(C)", "B", MC)
    assert (wrong.correct, wrong.parsed) == (False, "C")
    failed = score_answer("(A) or (B)", "B", MC)
    assert (failed.correct, failed.parsed) == (False, None)
    with pytest.raises(ValueError, match="option letters or texts"):
        score_answer("B", "F", MC)  # the reference is not an option


def test_mathvision_options_that_are_letters() -> None:
    item = make_item("multi_choice", "text", ["A", "B", "C", "D", "E"])
    assert score_answer("D", "D", item).correct
    assert score_answer("(d)", "D", item).correct
    assert not score_answer("C", "D", item).correct


# ------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize(
    ("pred", "value"),
    [
        ("12", 12.0), ("-3.5", -3.5), ("1,234", 1234.0), ("1e3", 1000.0), (".5", 0.5),
        ("-6/11", -6 / 11), ("\\frac{1}{2}", 0.5), ("\u22125", -5.0),
        ("1,23", None), ("nan", None), ("inf", None), ("1/0", None), ("3/-4", None), ("", None),
    ],
)
def test_parse_value(pred: str, value: float | None) -> None:
    got = parse_value(pred)
    assert got == pytest.approx(value) if value is not None else got is None


@pytest.mark.parametrize(
    ("pred", "unit", "value"),
    [
        ("5 cm", "cm", 5.0), ("5cm", "cm", 5.0), ("5 CM.", "cm", 5.0), ("30°", None, 30.0),
        ("30^\\circ", None, 30.0), ("45%", None, 45.0), ("$12$", None, 12.0),
        ("x = 5.", None, 5.0), ("The answer is 7", None, 7.0), ("7 and 7", None, 7.0),
        ("3 or 4", None, None), ("5 m^2", None, None), ("five", None, None),
    ],
)
def test_read_number_takes_off_units_and_finds_the_one_number(
    pred: str, unit: str | None, value: float | None
) -> None:
    assert read_number(pred, unit) == value


def test_floats_are_compared_at_the_items_precision() -> None:
    item = make_item("free_form", "float", None, 2)
    assert score_answer("1.45", "1.45", item).correct
    assert score_answer("1.449", "1.45", item).correct  # both rounded to 2 decimals
    assert score_answer("1.450", "1.45", item).correct
    assert not score_answer("1.44", "1.45", item).correct
    one = make_item("free_form", "float", None, 1)
    assert score_answer("1.54", "1.5", one).correct
    assert not score_answer("1.56", "1.5", one).correct
    # precision as MathVista stores it (a float) is accepted
    assert make_item("free_form", "float", None, 2.0).precision == 2
    # without precision a float is compared at the gold's own decimals
    bare = make_item("free_form", "float")
    assert score_answer("0.333", "0.33", bare).correct
    assert not score_answer("0.34", "0.33", bare).correct


def test_integers_without_precision_truncate_as_mathvista() -> None:
    item = make_item("free_form", "integer")
    assert score_answer("3", "3", item).correct
    assert score_answer("3.0", "3", item).correct  # float vs int
    assert score_answer("3.7", "3", item).correct  # int(float("3.7")) == 3, as MathVista
    assert not score_answer("2.9", "3", item).correct
    assert not score_answer("-3", "3", item).correct
    # with precision (MathVision: 2) both are rounded instead
    two = make_item("free_form", "integer", None, 2)
    assert score_answer("6.001", "6", two).correct
    assert not score_answer("6.4", "6", two).correct


def test_number_scores_carry_the_error() -> None:
    item = make_item("free_form", "float", None, 1, "cm")
    got = score_answer("2.5 cm", "2.0", item)
    assert (got.correct, got.parsed, got.abs_error, got.rel_error) == (False, "2.5", 0.5, 0.25)
    assert score_answer("x", "2.0", item).parsed is None
    with pytest.raises(ValueError, match="not a number"):
        score_answer("2", "two", item)


def test_lists_and_text() -> None:
    lst = make_item("free_form", "list")
    assert score_answer("[1, 2, 3]", "[1,2,3]", lst).correct
    assert score_answer("1, 2, 3", "[1, 2, 3]", lst).correct
    assert not score_answer("[1, 3, 2]", "[1, 2, 3]", lst).correct
    assert score_answer("[1, x]", "[1, 2]", lst).parsed is None
    text = make_item("free_form", "text")
    assert score_answer("  Blue. ", "blue", text).correct
    assert score_answer('"Blue"', "blue", text).correct
    assert not score_answer("dark blue", "blue", text).correct
    assert score_answer(" ", "blue", text).parsed is None


def test_items_from_rows_and_from_references() -> None:
    assert infer_item("B") == MathItem("multi_choice", "text")
    assert infer_item("12") == MathItem("free_form", "integer")
    assert infer_item("1.5") == MathItem("free_form", "float")
    assert infer_item("[1, 2]") == MathItem("free_form", "list")
    assert infer_item("blue") == MathItem("free_form", "text")
    row = _row("multi_choice", "text", choices=CHOICES, precision=None, unit="")
    assert item_from_row(row, "B") == MathItem("multi_choice", "text", tuple(CHOICES))
    assert item_from_row({"prompt": "x"}, "3") == MathItem("free_form", "integer")
    for bad, match in (
        (_row("essay", "text"), "question_type"),
        (_row("free_form", "complex"), "answer_type"),
        (_row("multi_choice", "text"), "needs its choices"),
        (_row("multi_choice", "text", choices="AB"), "choices must be a list"),
        (_row("multi_choice", "text", choices=["a", None]), r"choices\[1\]"),
        (_row("free_form", "float", precision=1.5), "precision"),
        (_row("free_form", "float", precision=-1), "precision"),
        (_row("free_form", "float", unit=3), "unit"),
    ):
        with pytest.raises(ValueError, match=match):
            item_from_row(bad, "1", "example 0")


def test_number_scope_leaves_option_labels_out() -> None:
    assert number_scope(MC) == NO_NUMBERS
    assert number_scope(make_item("free_form", "text")) == NO_NUMBERS
    assert number_scope(make_item("free_form", "integer")) == "all"
    assert number_scope(make_item("free_form", "list")) == "all"
    pattern = scope_pattern(NO_NUMBERS, None, "x")
    assert pattern is not None and pattern.search("B 12 3.5") is None


# ------------------------------------------------------------------------------ the metric
def test_math_metrics_hand_worked() -> None:
    rows = [
        _row("multi_choice", "text", choices=CHOICES),  # 0: text for letter, right
        _row("multi_choice", "float", choices=["1.5", "2.5"]),  # 1: wrong letter
        _row("multi_choice", "text", choices=CHOICES),  # 2: parse failure
        _row("free_form", "integer"),  # 3: right (3.0 vs 3)
        _row("free_form", "float", precision=2, unit="cm"),  # 4: wrong by 0.5
        _row("free_form", "float", precision=1),  # 5: parse failure
        _row("free_form", "text"),  # 6: right
    ]
    preds = ["larger than", "B", "A or B", "3.0", "2.5 cm", "many", "Blue"]
    refs = ["C", "A", "B", "3", "2.00", "1.5", "blue"]
    out = compute_task_metrics(preds, refs, "math", rows=rows)
    assert out["exact_match"] == pytest.approx(3 / 7)
    assert out["exact_match_multi_choice"] == pytest.approx(1 / 3)
    assert out["exact_match_free_form"] == pytest.approx(2 / 4)
    assert out["exact_match_integer"] == 1.0
    assert out["exact_match_float"] == 0.0  # items 1 and 4 (item 5's failure too)
    assert out["exact_match_text"] == pytest.approx(2 / 3)  # items 0, 2, 6
    assert math.isnan(out["exact_match_list"]) and out["n_list"] == 0
    assert (out["n_multi_choice"], out["n_free_form"], out["n_integer"], out["n_float"],
            out["n_text"], out["n_numeric"], out["n"]) == (3, 4, 1, 3, 3, 3, 7)
    # numeric errors of free-form numbers that parsed: item 3 (0) and item 4 (0.5, rel 0.25)
    assert out["abs_error_mean"] == pytest.approx(0.25)
    assert out["rel_error_mean"] == pytest.approx(0.125)
    assert out["abs_error_median"] == pytest.approx(0.25)
    assert (out["parse_failures"], out["parse_failure_rate"]) == (2, pytest.approx(2 / 7))


def test_math_metrics_without_rows_read_the_references() -> None:
    out = compute_task_metrics(["B", "3.0", "blue"], ["B", "3", "Blue"], "math")
    assert out["exact_match"] == 1.0
    # a lone letter is read as a choice letter, whose answer_type is text
    assert (out["n_multi_choice"], out["n_integer"], out["n_text"]) == (1, 1, 2)
    empty = math_metrics([], [])
    assert empty["exact_match"] == 0.0 and empty["n"] == 0


def test_math_metrics_errors_name_the_example() -> None:
    with pytest.raises(ValueError, match="example 1: reference not a number"):
        math_metrics(["1", "2"], ["1", "two"], [_row("free_form", "integer")] * 2)
    with pytest.raises(ValueError, match="example 0: question_type"):
        math_metrics(["1"], ["1"], [_row("essay", "text")])
    with pytest.raises(ValueError, match="2 rows for 1 predictions"):
        compute_task_metrics(["1"], ["1"], "math", rows=[{}, {}])


def test_math_row_fields() -> None:
    row = _row("multi_choice", "text", choices=CHOICES)
    assert per_example_fields("4.5", "B", "math", row) == {
        "correct": True, "parsed": "B", "abs_error": None}
    assert ROW_FIELDS["math"]("2.5", "2", _row("free_form", "float", precision=1)) == {
        "correct": False, "parsed": "2.5", "abs_error": 0.5}
    assert ROW_FIELDS["math"]("3.0", "3") == {"correct": True, "parsed": "3", "abs_error": 0.0}


def test_the_math_kind() -> None:
    spec = eval_kind("math")
    assert spec.generates and spec.short_answer and spec.picture and not spec.numeric
    assert spec.stop_at == ("\n",)


# ------------------------------------------------------------------------------ Acc@0.5
def test_acc_at_half_is_the_share_of_gold_boxes_matched() -> None:
    """Hand-worked: image 1 has gold boxes g1 (0,0,10,10) and g2 (20,0,30,10); the prediction
    (0,0,10,5) has IoU 0.5 with g1 (matched), (21,0,31,10) IoU 9/11 with g2 (matched), and an
    extra (50,50,60,60). Image 2 has gold (0,0,10,10) and the prediction (0,0,10,4) (IoU 0.4,
    a miss). Gold 3, matched 2: Acc@0.5 = recall = 2/3; precision 2/4; F1 = 4/7."""
    preds = ["(0,0),(10,5); (21,0),(31,10); (50,50),(60,60)", "(0,0),(10,4)"]
    refs = ["(0,0),(10,10); (20,0),(30,10)", "(0,0),(10,10)"]
    out = compute_task_metrics(preds, refs, "boxes")
    assert out["acc_at_0.5"] == pytest.approx(2 / 3) == out["recall"]
    assert out["precision"] == pytest.approx(0.5)
    assert out["f1"] == pytest.approx(4 / 7)  # kept
    assert list(out)[:4] == ["precision", "recall", "f1", "acc_at_0.5"]
    assert boxes_metrics(preds, refs, threshold=0.4)["acc_at_0.4"] == 1.0
    assert boxes_metrics(["none"], ["none"])["acc_at_0.5"] == 1.0  # nothing to find


def test_evaluate_examples_hands_the_rows_to_the_math_kind() -> None:
    """emdlm eval of a text model: the rows' metadata reaches the metric and the row fields."""
    from tests.test_evaluation import char_tokenizer, constant_model

    tok = char_tokenizer()
    sevens = constant_model(tok, "7")  # answers "7" to everything
    examples = [
        {"prompt": "a?", "completion": "B", **_row("multi_choice", "integer", choices=["5", "7"])},
        {"prompt": "b?", "completion": "7", **_row("free_form", "integer")},
        {"prompt": "c?", "completion": "8", **_row("free_form", "integer")},
    ]
    metrics, rows = evaluate_examples(sevens, tok, examples, kind="math", max_new_tokens=1,
                                      with_perplexity=False)
    assert [r["prediction"] for r in rows] == ["7"] * 3
    assert [(r["correct"], r["parsed"]) for r in rows] == [(True, "B"), (True, "7"), (False, "7")]
    assert metrics["exact_match"] == pytest.approx(2 / 3)
    assert metrics["exact_match_multi_choice"] == 1.0 and metrics["abs_error_mean"] == 0.5
