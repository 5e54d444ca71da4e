"""One registry of eval kinds and one of tasks: no other list of either.

Eval kinds are data in :mod:`emdlm.eval_kinds`; the functions of each kind sit in a table keyed
by the kind in the module that owns them. Every table holds exactly the registered kinds, so a
new kind fails here until each has it; the tables give what the ``if kind == ...`` ladders they
replaced gave (the ladders are kept below as oracles). Tasks are registered once, next to their
generators, and ``emdlm.data``'s answer patterns are read from that registry.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, get_args

import pytest
from PIL import Image, ImageDraw

from emdlm import eval_kinds, metrics, number_scope, tasks
from emdlm.config import schema
from emdlm.contact_sheet import GOLD, SHEET_KINDS, SHEETS, WRONG
from emdlm.eval_kinds import EVAL_KIND_SPECS, EVAL_KINDS, GENERATION_KINDS, PICTURE_KINDS
from emdlm.evaluation import ROW_FIELDS, per_example_fields
from emdlm.metrics import (
    TASK_KINDS,
    TASK_METRICS,
    boxes_metrics,
    clock_metrics,
    clock_time_gap,
    compute_task_metrics,
    exact_match,
    exact_match_rate,
    numeric_errors,
    parse_number,
    rouge,
)
from emdlm.metrics.boxes import box_iou, parse_box

SRC = Path(__file__).resolve().parents[1] / "src" / "emdlm"

# a few hand-worked (prediction, reference) pairs that every kind is asked about
PAIRS = [
    ("3.0", "3"), ("-12/22", "-6/11"), ("7", "9"), ("x", "9"),
    ("4_35", "6_20"), ("4_35", "4:35"), ("nope", "4_35"),
    ("(0,0),(10,10)", "(0,0),(10,10)"), ("(0,0),(10,10)", "(0,0),(10,5)"),
    ("(0,0),(10,10)", "(0,0),(10,4)"), ("(0,0),(10,10); (20,20),(30,30)", "(0,0),(10,10)"),
    ("The cat.", "the cat"), (" a", " a"),
]


# ------------------------------------------------------------------------------ the old ladders
def _old_fields(pred: str, ref: str, kind: str) -> dict[str, Any]:
    """emdlm.evaluation.per_example_fields before the table."""
    fields: dict[str, Any] = {"correct": exact_match(pred, ref, numeric=kind == "number")}
    if kind == "number":
        p, r = parse_number(pred), parse_number(ref)
        fields["abs_error"] = abs(p - r) if p is not None and r is not None else None
    elif kind == "clock":
        gap = clock_time_gap(pred, ref)
        fields["time_gap"] = gap
        fields["correct"] = gap == 0.0
    elif kind == "box":
        p_box, r_box = parse_box(pred), parse_box(ref)
        iou = box_iou(p_box, r_box) if p_box is not None and r_box is not None else None
        fields["iou"] = iou
        fields["correct"] = iou is not None and iou >= 0.5
    return fields


def _old_metrics(preds: list[str], refs: list[str], kind: str) -> dict[str, float]:
    """emdlm.metrics.compute_task_metrics before the table (mauve off)."""
    if kind == "number":
        out = {"exact_match": exact_match_rate(preds, refs)}
        out.update(numeric_errors(preds, refs, eps=1.0))
        return out
    if kind == "clock":
        return clock_metrics(preds, refs)
    if kind == "box":
        ious, failures, n = metrics._box_update(preds, refs)
        return {
            "acc_iou50": sum(i >= 0.5 for i in ious) / n if n else 0.0,
            "mean_iou": sum(ious) / len(ious) if ious else float("nan"),
            "parse_failure_rate": failures / n if n else 0.0,
            "n": n,
        }
    if kind == "boxes":
        return boxes_metrics(preds, refs)
    if kind == "text":
        out = {"exact_match": exact_match_rate(preds, refs, numeric=False)}
        out.update(rouge(preds, refs))
        out["n"] = len(preds)
        return out
    assert kind == "choice"
    hits = sum(p == r for p, r in zip(preds, refs, strict=True))
    return {"accuracy": hits / len(preds), "n": len(preds)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal dicts (same keys in the same order), NaN equal to NaN, floats to 1e-12."""
    if list(a) != list(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float):
            if not (math.isnan(x) and math.isnan(y)) and not math.isclose(x, y, abs_tol=1e-12):
                return False
        elif x != y:
            return False
    return True


# ------------------------------------------------------------------------------ completeness
def test_every_table_of_kinds_holds_exactly_the_registered_kinds() -> None:
    """A new kind in emdlm.eval_kinds fails here until every per-kind table has it."""
    assert list(EVAL_KIND_SPECS) == list(EVAL_KINDS)
    assert set(TASK_METRICS) == set(EVAL_KINDS)
    assert set(ROW_FIELDS) == set(EVAL_KINDS)
    assert set(SHEETS) == set(PICTURE_KINDS)
    assert get_args(metrics.TaskKind) == EVAL_KINDS  # the static type, spelled out


def test_the_old_names_are_the_registrys() -> None:
    assert TASK_KINDS == EVAL_KINDS
    assert schema.EVAL_KINDS is EVAL_KINDS  # what the config validates eval.kind against
    assert GENERATION_KINDS == ("number", "clock", "box", "boxes", "text", "math")
    assert SHEET_KINDS == PICTURE_KINDS
    assert set(PICTURE_KINDS) == {"box", "boxes", "clock", "math"}
    for name in ("emdlm.training.train", "emdlm.training.adapters"):  # wherever it lives
        module = pytest.importorskip(name)
        if hasattr(module, "GENERATION_KINDS"):
            assert module.GENERATION_KINDS is eval_kinds.GENERATION_KINDS


def _kind_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each literal list of kind names and each ``kind == "<a kind>"`` test."""
    kinds = set(EVAL_KINDS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
            isinstance(e, ast.Constant) and e.value in kinds for e in node.elts
        ):
            found.append((node.lineno, "a list of kinds"))
        if isinstance(node, ast.Compare):
            left = node.left
            name = getattr(left, "id", None) or getattr(left, "attr", None) or ""
            if "kind" in name:
                for c in node.comparators:
                    elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                    if any(isinstance(e, ast.Constant) and e.value in kinds for e in elts):
                        found.append((node.lineno, f"{name} compared with a kind name"))
    return found


# The Literal type spells the kinds out for type checkers (pinned above).
_ALLOWED = {("metrics/__init__.py", "a list of kinds")}


def test_no_second_list_of_kinds_and_no_ladder_on_a_kind_name() -> None:
    found = []
    for file in sorted(SRC.rglob("*.py")):
        if file.name == "eval_kinds.py":
            continue
        rel = file.relative_to(SRC).as_posix()
        for line, what in _kind_literals(ast.parse(file.read_text(encoding="utf-8"))):
            if (rel, what) not in _ALLOWED:
                found.append(f"{rel}:{line}: {what}")
    assert not found, "look the kind up in emdlm.eval_kinds instead:\n" + "\n".join(found)


def test_the_ladder_reader_sees_a_ladder() -> None:
    tree = ast.parse('if e.kind == "clock":\n    pass\nK = ("box", "boxes")\n')
    assert _kind_literals(tree) == [(1, "kind compared with a kind name"), (3, "a list of kinds")]


# ------------------------------------------------------------------------------ lookups = ladders
# the kinds the ladders were written for; a kind added later has its own tests
# (math: tests/test_math_metrics.py)
LADDER_KINDS = ("number", "clock", "box", "boxes", "text", "choice")


def test_the_ladder_kinds_are_registered_first() -> None:
    assert EVAL_KINDS[: len(LADDER_KINDS)] == LADDER_KINDS


@pytest.mark.parametrize("kind", LADDER_KINDS)
def test_row_fields_equal_the_old_ladder(kind: str) -> None:
    for pred, ref in PAIRS:  # the same fields, or the same error (a bad reference)
        try:
            want = _old_fields(pred, ref, kind)
        except ValueError as err:
            with pytest.raises(ValueError, match=re.escape(str(err))):
                per_example_fields(pred, ref, kind)
            continue
        got = per_example_fields(pred, ref, kind)
        assert _same(got, want), (kind, pred, ref, got, want)


def test_row_fields_hand_worked() -> None:
    assert per_example_fields("3.0", "3", "number") == {"correct": True, "abs_error": 0}
    assert per_example_fields("x", "9", "number") == {"correct": False, "abs_error": None}
    assert per_example_fields("3.0", "3", "text") == {"correct": False}  # strings
    assert per_example_fields("4_35", "6_20", "clock") == {"correct": False, "time_gap": 1.75}
    assert per_example_fields("(0,0),(10,10)", "(0,0),(10,5)", "box") == {
        "correct": True, "iou": 0.5}
    assert per_example_fields("(0,0),(10,10)", "(0,0),(10,4)", "box")["correct"] is False
    assert per_example_fields("The cat.", "the cat", "choice") == {"correct": True}


@pytest.mark.parametrize("kind", LADDER_KINDS)
def test_task_metrics_equal_the_old_ladder(kind: str) -> None:
    preds, refs = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    if kind == "box":  # a reference must be one box
        preds, refs = preds[7:10], refs[7:10]
    if kind == "boxes":
        preds, refs = preds[7:11], refs[7:11]
    if kind == "clock":
        preds, refs = ["4_35", "4_35", "nope"], ["6_20", "4:35", "4_35"]
    if kind == "number":
        preds, refs = preds[:4], refs[:4]
    got = compute_task_metrics(preds, refs, kind)  # type: ignore[arg-type]
    assert _same(got, _old_metrics(preds, refs, kind)), kind


def test_task_metrics_hand_worked() -> None:
    assert compute_task_metrics(["3.0", "-12/22", "7"], ["3", "-6/11", "9"], "number")[
        "exact_match"] == pytest.approx(2 / 3)
    assert compute_task_metrics(["4_35"], ["6_20"], "clock")["time_gap_mean"] == 1.75
    out = compute_task_metrics(["(0,0),(10,10)", "(0,0),(10,10)"],
                               ["(0,0),(10,5)", "(0,0),(10,4)"], "box")
    assert out["acc_iou50"] == 0.5 and out["mean_iou"] == pytest.approx(0.45)
    assert compute_task_metrics([" a", " b"], [" a", " a"], "choice") == {"accuracy": 0.5, "n": 2}
    with pytest.raises(ValueError, match="unknown task kind 'speech'"):
        compute_task_metrics(["a"], ["a"], "speech")  # type: ignore[arg-type]


def test_kind_facts_equal_the_old_ladders() -> None:
    for name, spec in EVAL_KIND_SPECS.items():
        assert spec.stop_at == (() if name == "text" else ("\n",))  # evaluate_examples' default
        assert spec.numeric == (name == "number")  # exact match by value
        assert spec.generates == (name != "choice")
        assert spec.open_ended == (name == "text")
        assert spec.short_answer == (name not in ("text", "choice"))  # what a VLM is scored on
        assert spec.picture == (name in ("clock", "box", "boxes", "math"))
        assert spec.summary and "\n" not in spec.summary
    assert eval_kinds.eval_kind("box") is EVAL_KIND_SPECS["box"]
    with pytest.raises(ValueError, match=r"unknown task kind 'speech'; expected one of \("):
        eval_kinds.eval_kind("speech")


def _cell(kind: str, row: dict[str, Any], pred: str) -> tuple[str, str, tuple[int, int, int]]:
    image = Image.new("RGB", (120, 120))
    return SHEETS[kind].cell(ImageDraw.Draw(image), row, pred, (100, 100), (0, 0), 1.0)


def test_sheet_cells_hand_worked() -> None:
    clock = {"completion": "4_35"}
    assert _cell("clock", clock, "4_35") == ("gold 4_35", "pred 4_35", GOLD)
    assert _cell("clock", clock, " ") == ("gold 4_35", "pred (empty)  (unparsed)", WRONG)
    row = {"completion": "(0,0),(1000,1000)", "expression": "the red circle"}
    assert _cell("box", row, "(0,0),(1000,1000)") == ("the red circle", "IoU 1.00", GOLD)
    assert _cell("box", row, "(0,0),(1000,500)") == ("the red circle", "IoU 0.50", GOLD)
    assert _cell("box", row, "(0,0),(400,1000)")[1:] == ("IoU 0.40", WRONG)
    assert _cell("box", row, "nope") == ("the red circle", "unparsed prediction", WRONG)
    words = {"completion": "(0,0),(500,500); (500,500),(1000,1000)", "words": ["a", "b"]}
    assert _cell("boxes", words, "(0,0),(500,500); (500,500),(1000,1000)") == (
        "a b", "matched 2/2, pred 2", GOLD)
    assert _cell("boxes", words, "(0,0),(500,500)") == ("a b", "matched 1/2, pred 1", WRONG)
    # math: the question up to its "?", gold (an option letter with its text) and prediction,
    # coloured by the math scoring
    mc = {"completion": "B", "prompt": "Which is larger?\n(A) 3 (B) 4.5",
          "question_type": "multi_choice", "answer_type": "float", "choices": ["3", "4.5"]}
    assert _cell("math", mc, "4.5") == ("Which is larger?", "gold B=4.5 pred 4.5", GOLD)
    assert _cell("math", mc, "(A)") == ("Which is larger?", "gold B=4.5 pred (A)", WRONG)
    assert _cell("math", mc, "C") == ("Which is larger?", "gold B=4.5 pred C (unparsed)", WRONG)
    free = {"completion": "1.50", "prompt": "How long is it? Answer with a number.",
            "question_type": "free_form", "answer_type": "float", "precision": 2, "unit": "cm"}
    assert _cell("math", free, "1.5 cm") == ("How long is it?", "gold 1.50 pred 1.5 cm", GOLD)
    assert _cell("math", free, "1.56")[1:] == ("gold 1.50 pred 1.56", WRONG)
    assert _cell("math", free, " ")[1:] == ("gold 1.50 pred (empty) (unparsed)", WRONG)
    # a row without item fields: the item is inferred from the completion (an integer here)
    assert _cell("math", {"completion": "12", "prompt": "Count them"}, "12.0") == (
        "Count them", "gold 12 pred 12.0", GOLD)


# ------------------------------------------------------------------------------ tasks
def _registered_names() -> Counter[str]:
    """Task names of every ``register_task("<name>", ...)`` call in the source."""
    names: Counter[str] = Counter()
    for file in sorted((SRC / "tasks").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_task"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                names[node.args[0].value] += 1
    return names


def test_each_builtin_task_is_registered_once() -> None:
    names = _registered_names()
    assert names and all(count == 1 for count in names.values()), names
    specs = tasks.task_specs()
    builtin = {n for n, s in specs.items()
               if s.generator is not None and s.generator.__module__.startswith("emdlm.")}
    assert builtin == set(names)
    for name in names:
        spec = specs[name]
        assert spec.name == name and spec.generator is tasks.get_task(name)
        assert spec.eval_kind is None or spec.eval_kind in EVAL_KINDS
    assert {n: specs[n].eval_kind for n in names} == {
        "arithmetic": "number", "math_arithmetic": "number", "arithmetic__mixed": "number",
        "clock": "clock", "grounding": "box", "text_detection": "boxes", "english_text": None,
        "english_continuation": "text", "polarity_choice": "choice", "visual_math": "math",
    }


_OLD_BOX = (r"\(\s*\d+\s*,\s*\d+\s*\)\s*,\s*\(\s*\d+\s*,\s*\d+\s*\)"
            r"|\[\s*\d*\.?\d+(?:\s*,\s*\d*\.?\d+){3}\s*\]")


def test_answer_patterns_are_the_task_registrys() -> None:
    """number_scope keeps no table of its own: ANSWER_PATTERNS reads the task specs."""
    specs = tasks.task_specs()
    want = {n: s.answer_pattern for n, s in specs.items() if s.answer_pattern is not None}
    assert dict(number_scope.ANSWER_PATTERNS) == want == tasks.answer_patterns()
    # the patterns emdlm.data held before, moved next to their tasks unchanged
    assert {n: want[n].pattern for n in ("clock", "grounding", "text_detection")} == {
        "clock": r"\b\d{1,2}_\d{2}\b", "grounding": _OLD_BOX, "text_detection": _OLD_BOX}
    assert "arithmetic" not in number_scope.ANSWER_PATTERNS
    assert number_scope.scope_pattern("answer:clock", None, "x") is want["clock"]
    assert number_scope.scope_pattern("answer", "grounding", "x") is want["grounding"]
    detection = number_scope.ANSWER_PATTERNS["text_detection"]
    hits = detection.findall("(0,0),(5,5); [0.1, 0.2, 0.3, 0.4] 7")
    assert hits == ["(0,0),(5,5)", "[0.1, 0.2, 0.3, 0.4]"]
    with pytest.raises(TypeError):
        number_scope.ANSWER_PATTERNS["mine"] = re.compile("x")  # type: ignore[index]


def test_register_answer_pattern_goes_to_the_task_registry(monkeypatch) -> None:
    monkeypatch.setattr(tasks, "_REGISTRY", dict(tasks.task_specs()))
    tasks.register_answer_pattern("_rows_from_a_file", r"\d+")
    spec = tasks.task_spec("_rows_from_a_file")
    assert spec.generator is None and spec.answer_pattern.pattern == r"\d+"
    assert number_scope.scope_pattern("answer:_rows_from_a_file", None, "x") is spec.answer_pattern
    assert "_rows_from_a_file" not in tasks.available_tasks()
    with pytest.raises(ValueError, match="unknown task '_rows_from_a_file'"):
        tasks.get_task("_rows_from_a_file")

    @tasks.register_task("_rows_from_a_file", eval_kind="number")  # a generator added later
    def _gen(n, *, split, seed):
        return [{"prompt": "1+1=", "completion": "2"}] * n

    spec = tasks.task_spec("_rows_from_a_file")
    assert spec.generator is _gen and spec.answer_pattern.pattern == r"\d+"  # kept
    tasks.register_answer_pattern("clock", r"\d+_\d+")  # replaces a built-in task's
    assert tasks.task_spec("clock").answer_pattern.pattern == r"\d+_\d+"
    assert tasks.task_spec("clock").generator is not None
    with pytest.raises(ValueError, match="unknown eval kind 'speech'"):
        tasks.register_task("_bad", eval_kind="speech")
    with pytest.raises(ValueError, match="already registered"):
        tasks.register_task("clock")(_gen)


def test_a_tasks_gold_answers_score_perfectly_under_its_kind(tmp_path: Path) -> None:
    for name, params in (("arithmetic", {"max_digits": 3}),
                         ("clock", {"image_size": 48, "cache_dir": tmp_path})):
        rows = tasks.generate_task(name, n=4, split="test", seed=3, **params)
        kind = tasks.task_spec(name).eval_kind
        assert kind is not None
        gold = [r["completion"].strip() for r in rows]
        assert compute_task_metrics(gold, gold, kind)["exact_match"] == 1.0
        assert all(ROW_FIELDS[kind](g, g)["correct"] for g in gold)
