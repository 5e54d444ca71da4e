"""Answers of the visual math benchmarks (MathVista, MathVision), scored as the benchmarks score.

An item is described by a few fields its row carries (:class:`MathItem`, read by
:func:`item_from_row`): ``question_type`` ("multi_choice" / "free_form"), ``answer_type``
("integer", "float", "text", "list"), ``choices`` (the option texts of a multiple-choice item),
``precision`` (decimals a float answer is compared at) and ``unit``. The readers
(:mod:`emdlm.datasets.visual_math`) write them; a row without them is described from its reference
alone (:func:`infer_item`: a single capital letter is a choice letter, a number is a number at the
reference's own decimals, anything else is text). This module imports nothing of emdlm, so
:mod:`emdlm.metrics` (kind ``"math"``) sits on it.

How a prediction is read (MathVista's ``calculate_score.py`` normalisation; MathVision's
``evaluate.py`` the same way for options and numbers):

* **multiple choice** -> one option, or a parse failure: the option text itself (normalised:
  case, whitespace, trailing ``.``), a lone letter (``B``, ``(B)``, ``b.``), else exactly one
  distinct parenthesised letter (``"(B) 12"``), else exactly one distinct stand-alone capital
  letter (``"The answer is B"``), else a number equal to exactly one numeric option
  (``"3.50"`` -> option ``"3.5"``), else the text of exactly one option inside the prediction.
  Letters outside the item's options do not count. The gold answer is a letter (the completion)
  or an option's text. NOTE: MathVista maps every other prediction to the option nearest in edit
  distance; here it is a parse failure (counted, and wrong).
* **integer / float** (free form) -> a number: the whole prediction once the item's unit, ``%``,
  ``°`` / ``^\\circ`` and ``$`` are taken off (``"5 cm"`` -> 5, ``"1,234"`` -> 1234,
  ``"-6/11"``, ``"\\frac{1}{2}"``), else the one number inside it (``"x = 5."`` -> 5; two
  different numbers are a parse failure). Compared with the gold value:

  - ``precision`` given: both rounded to that many decimals (Python's ``round``), equal.
    MathVision's items have precision 2 (its ``is_equal`` rounds both to 2 decimals).
  - an integer item without precision (MathVista's integers): the prediction truncated to an
    integer equals the gold integer, as MathVista's ``int(float(prediction))`` does: ``"2.7"``
    reads as 2 (truncated, not rounded). NOTE: here both are read exactly
    (:func:`exact_value`), not through a float, which makes ``12345678901234567`` and
    ``12345678901234568`` equal.
  - a float item without precision: the gold answer's own number of decimals.

  NOTE: MathVista compares the rounded prediction's ``str`` with the gold string, so ``"0.50"``
  at precision 2 never matches there; here both sides are rounded numbers.
* **list** -> numbers separated by commas, in ``[]`` or ``()`` or bare; equal element by element
  (at ``precision`` when given). A gold list that does not parse is compared as text.
* **text** -> equal once normalised (lower case, whitespace collapsed, trailing ``. , ; : ! ?``
  and surrounding quotes removed). An empty prediction is a parse failure.

Metrics (:func:`math_metrics`): exact-match accuracy overall, per ``question_type`` and per
``answer_type`` (``exact_match_<type>``, NaN with no such item, beside ``n_<type>``); absolute and
relative error (``|p - g| / max(|g|, eps)``, as kind ``"number"``) of free-form integer and float
items whose prediction parsed; ``parse_failures`` (a count) and ``parse_failure_rate``; ``n``.

Number scope (:func:`number_scope`): an option label is not a quantity, so a multiple-choice row
(and a text row) gets ``number_scope`` :data:`NO_NUMBERS` and numeric losses score none of its
tokens; a free-form number or list is the whole answer (``"all"``).
"""

from __future__ import annotations

import math
import re
import statistics
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

QUESTION_TYPES = ("multi_choice", "free_form")
ANSWER_TYPES = ("integer", "float", "text", "list")
NUMERIC_TYPES = ("integer", "float")
LETTERS = string.ascii_uppercase
#: a number scope (:func:`emdlm.number_scope.scope_pattern`) matching nothing: no token is a number
NO_NUMBERS = "regex:(?!)"
#: the number scope of a free-form numeric answer: the answer is the number
WHOLE_ANSWER = "all"
MAX_PRECISION = 15

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d{1,3})?|\.\d+(?:[eE][+-]?\d{1,3})?"
_NUMBER_RE = re.compile(rf"[+-]?(?:{_NUMBER})")
_FRACTION_RE = re.compile(r"([+-]?\d+)\s*/\s*(\d+)")
_LATEX_FRACTION_RE = re.compile(r"([+-]?)\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}")
_NUMBER_IN_TEXT_RE = re.compile(rf"(?<![\w.])[+-]?(?:{_NUMBER})(?![\w])")
_LONE_LETTER_RE = re.compile(r"\(?([A-Za-z])\)?[.:)]?")
_PAREN_LETTER_RE = re.compile(r"\(([A-Za-z])\)")
_CAPITAL_RE = re.compile(r"(?<![\w'])([A-Z])(?![\w'])")
_SYMBOLS = ("^{\\circ}", "^\\circ", "\\%", "%", "°", "\\$", "$")
_TRAILING = ".,;:!?"
_QUOTES = "\"'`"
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-"})


@dataclass(frozen=True)
class MathItem:
    """What scoring needs to know about one item (see the module docstring)."""

    question_type: str
    answer_type: str
    choices: tuple[str, ...] = ()
    precision: int | None = None
    unit: str | None = None


@dataclass(frozen=True)
class MathScore:
    """One prediction read against its item: ``parsed`` is the prediction as compared (an option
    letter, a number at the compared precision, a list or the normalised text), None for a parse
    failure; ``abs_error`` only for a free-form integer or float item whose prediction parsed."""

    correct: bool
    parsed: str | None
    abs_error: float | None = None
    rel_error: float | None = None


# ----------------------------------------------------------------------------- writing answers
def option_letter(index: int) -> str:
    """The letter of option ``index`` (0 -> "A")."""
    if not 0 <= index < len(LETTERS):
        raise ValueError(f"option index must be in 0..{len(LETTERS) - 1}, got {index}")
    return LETTERS[index]


def format_choices(choices: Sequence[str]) -> str:
    """The lettered options of a prompt: ``"(A) 3 (B) 4"``."""
    return " ".join(f"({option_letter(i)}) {c}" for i, c in enumerate(choices))


def format_number(value: float, answer_type: str, precision: int | None) -> str:
    """The completion of a free-form number: an integer as ``"12"``, a float with ``precision``
    decimals (``"1.50"`` at 2) or, without precision, as Python writes it (``"1.5"``)."""
    if answer_type == "integer" and float(value).is_integer():
        return str(int(value))
    if precision is not None:
        return f"{value:.{precision}f}"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def number_scope(item: MathItem) -> str:
    """The row's ``number_scope``: :data:`WHOLE_ANSWER` for a free-form number or list, else
    :data:`NO_NUMBERS` (an option letter or a word is not a quantity)."""
    numeric = item.question_type == "free_form" and item.answer_type in (*NUMERIC_TYPES, "list")
    return WHOLE_ANSWER if numeric else NO_NUMBERS


# ----------------------------------------------------------------------------- reading text
def normalize_text(s: str) -> str:
    """Lower case, whitespace collapsed, trailing ``. , ; : ! ?`` and surrounding quotes off."""
    out = " ".join(s.lower().split()).rstrip(_TRAILING).strip()
    while len(out) >= 2 and out[0] == out[-1] and out[0] in _QUOTES:
        out = out[1:-1].strip()
    return out


def parse_value(s: str) -> float | None:
    """The number a whole string is (``"1,234"``, ``"-0.5"``, ``"1e3"``, ``"-6/11"``,
    ``"\\frac{1}{2}"``), or None (also for NaN, infinities and a zero denominator)."""
    t = s.strip().translate(_MINUS)
    if _NUMBER_RE.fullmatch(t):
        value = float(t.replace(",", ""))
        return value if math.isfinite(value) else None
    m = _FRACTION_RE.fullmatch(t) or _LATEX_FRACTION_RE.fullmatch(t)
    if m is None:
        return None
    sign, num, den = ("", *m.groups()) if len(m.groups()) == 2 else m.groups()
    if int(den) == 0:
        return None
    return (-1.0 if sign == "-" else 1.0) * int(num) / int(den)


def exact_value(s: str) -> Fraction | None:
    """The number a whole string is, exactly (a :class:`fractions.Fraction`; no float on the
    way, so ``"12345678901234567"`` stays itself where ``float`` makes it
    ``12345678901234568``), or None where :func:`parse_value` gives None.

    >>> exact_value("12345678901234567")
    Fraction(12345678901234567, 1)
    >>> exact_value("-6/11"), exact_value("1,234.5")
    (Fraction(-6, 11), Fraction(2469, 2))
    """
    if parse_value(s) is None:
        return None
    t = s.strip().translate(_MINUS)
    if _NUMBER_RE.fullmatch(t):
        return Fraction(t.replace(",", ""))
    m = _FRACTION_RE.fullmatch(t) or _LATEX_FRACTION_RE.fullmatch(t)
    assert m is not None  # parse_value read it
    sign, num, den = ("", *m.groups()) if len(m.groups()) == 2 else m.groups()
    return Fraction(int(f"{sign}{num}"), int(den))


def _strip_unit(s: str, unit: str | None) -> str:
    t = s.strip().translate(_MINUS)
    for symbol in _SYMBOLS:
        t = t.replace(symbol, "")
    t = t.strip().rstrip(_TRAILING).strip()
    if unit and unit.strip():
        u = unit.strip()
        if t.lower().endswith(u.lower()):
            t = t[: len(t) - len(u)].strip()
    return t


def number_text(prediction: str, unit: str | None = None) -> str | None:
    """The text of the number a free-form prediction gives: the whole text without its unit and
    symbols, else the one number inside it (equal repeats count once), else None."""
    t = _strip_unit(prediction, unit)
    if parse_value(t) is not None:
        return t
    found: dict[Fraction, str] = {}
    for m in _NUMBER_IN_TEXT_RE.finditer(t):
        exact = exact_value(m.group(0))
        if exact is not None:
            found.setdefault(exact, m.group(0))
    return next(iter(found.values())) if len(found) == 1 else None


def read_number(prediction: str, unit: str | None = None) -> float | None:
    """The value of :func:`number_text`, or None."""
    text = number_text(prediction, unit)
    return None if text is None else parse_value(text)


def _read_list(s: str) -> list[float] | None:
    t = s.strip()
    if len(t) >= 2 and (t[0], t[-1]) in (("[", "]"), ("(", ")")):
        t = t[1:-1]
    parts = [p for p in (p.strip() for p in t.split(",")) if p]
    values = [parse_value(p) for p in parts]
    if not values or any(v is None for v in values):
        return None
    return [v for v in values if v is not None]


def read_choice(
    prediction: str, choices: Sequence[str], n_options: int | None = None
) -> int | None:
    """The option index a multiple-choice prediction names, or None (see the module docstring).
    ``n_options``: how many letters are options when the texts are unknown (default: the
    number of ``choices``, or every letter when there are none)."""
    n = n_options if n_options is not None else (len(choices) or len(LETTERS))
    valid = LETTERS[:n]
    norm = normalize_text(prediction)
    texts = [normalize_text(c) for c in choices]
    if norm and norm in texts:
        return texts.index(norm)
    m = _LONE_LETTER_RE.fullmatch(prediction.strip())
    if m and m.group(1).upper() in valid:
        return valid.index(m.group(1).upper())
    for pattern, text in ((_PAREN_LETTER_RE, prediction.upper()), (_CAPITAL_RE, prediction)):
        letters = {x for x in pattern.findall(text) if x in valid}
        if len(letters) == 1:
            return valid.index(letters.pop())
        if letters:
            return None  # several letters named: no one answer
    value = read_number(prediction)
    if value is not None:
        same = [i for i, c in enumerate(choices) if parse_value(c) == value]
        if len(same) == 1:
            return same[0]
    inside = [
        i for i, t in enumerate(texts)
        if t and re.search(rf"(?<!\w){re.escape(t)}(?!\w)", norm)
    ]
    return inside[0] if len(inside) == 1 else None


# ----------------------------------------------------------------------------- items
def _decimals(reference: str) -> int | None:
    t = reference.strip()
    if not _NUMBER_RE.fullmatch(t) or "e" in t.lower():
        return None
    return len(t.split(".", 1)[1]) if "." in t else 0


def infer_item(reference: str) -> MathItem:
    """An item described by its reference alone (a row without the metadata)."""
    ref = reference.strip()
    if len(ref) == 1 and ref in LETTERS:
        return MathItem("multi_choice", "text")
    if parse_value(ref) is not None:
        has_point = "." in ref or "/" in ref or "frac" in ref
        return MathItem("free_form", "float" if has_point else "integer")
    if _read_list(ref) is not None and ("," in ref or ref[:1] in "[("):
        return MathItem("free_form", "list")
    return MathItem("free_form", "text")


def _check_precision(value: Any, where: str) -> int | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or not 0 <= value <= MAX_PRECISION:
        raise ValueError(
            f"{where}: precision must be null or a whole number 0..{MAX_PRECISION}, got {value!r}"
        )
    return int(value)


def check_choices(value: Any, where: str) -> tuple[str, ...]:
    """The option texts (numbers written as text), or ValueError naming ``where``."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: choices must be a list or null, got {type(value).__name__}")
    out = []
    for j, c in enumerate(value):
        if isinstance(c, bool) or not isinstance(c, (str, int, float)):
            raise ValueError(f"{where}: choices[{j}] must be text, got {type(c).__name__} {c!r}")
        out.append(c if isinstance(c, str) else str(c))
    if len(out) > len(LETTERS):
        raise ValueError(f"{where}: {len(out)} choices, at most {len(LETTERS)} have a letter")
    return tuple(out)


def make_item(
    question_type: Any, answer_type: Any, choices: Any = None, precision: Any = None,
    unit: Any = None, *, where: str = "item",
) -> MathItem:
    """A checked :class:`MathItem`; ValueError naming ``where`` for a field out of range."""
    if question_type not in QUESTION_TYPES:
        raise ValueError(f"{where}: question_type must be one of {QUESTION_TYPES}, got "
                         f"{question_type!r}")
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"{where}: answer_type must be one of {ANSWER_TYPES}, got "
                         f"{answer_type!r}")
    options = check_choices(choices, where)
    if question_type == "multi_choice" and not options:
        raise ValueError(f"{where}: a multi_choice item needs its choices")
    if unit is not None and not isinstance(unit, str):
        raise ValueError(f"{where}: unit must be text or null, got {type(unit).__name__}")
    unit_text = (unit.strip() or None) if isinstance(unit, str) else None
    return MathItem(question_type, answer_type, options, _check_precision(precision, where),
                    unit_text)


def item_from_row(row: Mapping[str, Any] | None, reference: str, where: str = "row") -> MathItem:
    """The item of a row with ``question_type`` / ``answer_type`` (and ``choices``,
    ``precision``, ``unit``), else :func:`infer_item` of the reference."""
    if not row or ("question_type" not in row and "answer_type" not in row):
        return infer_item(reference)
    inferred = infer_item(reference)
    return make_item(
        row.get("question_type", inferred.question_type),
        row.get("answer_type", inferred.answer_type),
        row.get("choices"), row.get("precision"), row.get("unit"), where=where,
    )


# ----------------------------------------------------------------------------- scoring
def _gold_choice(reference: str, item: MathItem) -> int:
    ref = reference.strip()
    n = len(item.choices) or len(LETTERS)
    if len(ref) == 1 and ref in LETTERS[:n]:
        return LETTERS.index(ref)
    texts = [normalize_text(c) for c in item.choices]
    if normalize_text(ref) in texts:
        return texts.index(normalize_text(ref))
    raise ValueError(f"not one of the {n} option letters or texts: {reference!r}")


def _same_at(a: float, b: float, precision: int | None) -> bool:
    return a == b if precision is None else round(a, precision) == round(b, precision)


def _score_number(prediction: str, reference: str, item: MathItem, eps: float) -> MathScore:
    gold = parse_value(reference)
    if gold is None:
        raise ValueError(f"not a number: {reference!r}")
    text = number_text(prediction, item.unit)
    value = None if text is None else parse_value(text)
    if text is None or value is None:
        return MathScore(False, None)
    err = abs(value - gold)
    rel = err / max(abs(gold), eps)
    if item.answer_type == "integer" and item.precision is None:  # MathVista: int(float(x))
        # truncated exactly: through a float, 17-digit integers a unit apart compare equal
        shown, want = (math.trunc(exact_value(t) or 0) for t in (text, reference))
        return MathScore(shown == want, str(shown), err, rel)
    precision = item.precision if item.precision is not None else _decimals(reference)
    shown = repr(value) if precision is None else f"{round(value, precision):.{precision}f}"
    return MathScore(_same_at(value, gold, precision), shown, err, rel)


def _score_list(prediction: str, reference: str, item: MathItem) -> MathScore:
    gold = _read_list(reference)
    if gold is None:
        return _score_text(prediction, reference)
    got = _read_list(prediction)
    if got is None:
        return MathScore(False, None)
    same = len(got) == len(gold) and all(
        _same_at(a, b, item.precision) for a, b in zip(got, gold, strict=True)
    )
    return MathScore(same, "[" + ", ".join(f"{v:g}" for v in got) + "]")


def _score_text(prediction: str, reference: str) -> MathScore:
    got = normalize_text(prediction)
    if not got:
        return MathScore(False, None)
    return MathScore(got == normalize_text(reference), got)


def score_answer(prediction: str, reference: str, item: MathItem, *, eps: float = 1.0) -> MathScore:
    """Read ``prediction`` as ``item``'s answer and compare it with ``reference`` (the gold
    completion). ValueError when the reference itself does not read (a data bug)."""
    if item.question_type == "multi_choice":
        gold = _gold_choice(reference, item)
        got = read_choice(prediction, item.choices)
        return MathScore(got == gold, None if got is None else LETTERS[got])
    if item.answer_type in NUMERIC_TYPES:
        return _score_number(prediction, reference, item, eps)
    if item.answer_type == "list":
        return _score_list(prediction, reference, item)
    return _score_text(prediction, reference)


def _share(hits: int, n: int) -> float:
    return hits / n if n else float("nan")


def math_metrics(
    preds: Sequence[str],
    refs: Sequence[str],
    rows: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    eps: float = 1.0,
) -> dict[str, float]:
    """Exact match overall, per question and answer type, numeric errors and parse failures
    (see the module docstring). ``rows``: one per prediction (the items' metadata), or None to
    describe every item by its reference. ValueError on a reference or row field that does not
    read, naming the example."""
    if len(preds) != len(refs) or (rows is not None and len(rows) != len(refs)):
        raise ValueError(
            f"predictions, references and rows differ in length: {len(preds)}, {len(refs)}, "
            f"{'-' if rows is None else len(rows)}"
        )
    types = (*QUESTION_TYPES, *ANSWER_TYPES)
    hits = dict.fromkeys(types, 0)
    counts = dict.fromkeys(types, 0)
    abs_errors: list[float] = []
    rel_errors: list[float] = []
    correct = failures = numeric = 0
    for i, (pred, ref) in enumerate(zip(preds, refs, strict=True)):
        where = f"example {i}"
        try:
            item = item_from_row(None if rows is None else rows[i], ref, where)
            score = score_answer(pred, ref, item, eps=eps)
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith(where) else f"{where}: reference {msg}") from err
        for t in (item.question_type, item.answer_type):
            counts[t] += 1
            hits[t] += score.correct
        correct += score.correct
        failures += score.parsed is None
        if item.question_type == "free_form" and item.answer_type in NUMERIC_TYPES:
            numeric += 1
            if score.abs_error is not None and score.rel_error is not None:
                abs_errors.append(score.abs_error)
                rel_errors.append(score.rel_error)
    n = len(preds)
    nan = float("nan")
    out: dict[str, float] = {"exact_match": correct / n if n else 0.0}
    out.update({f"exact_match_{t}": _share(hits[t], counts[t]) for t in types})
    out.update({
        "abs_error_mean": statistics.fmean(abs_errors) if abs_errors else nan,
        "abs_error_median": statistics.median(abs_errors) if abs_errors else nan,
        "rel_error_mean": statistics.fmean(rel_errors) if rel_errors else nan,
        "rel_error_median": statistics.median(rel_errors) if rel_errors else nan,
        "parse_failures": failures,
        "parse_failure_rate": failures / n if n else 0.0,
    })
    out.update({f"n_{t}": counts[t] for t in types})
    out["n_numeric"] = numeric
    out["n"] = n
    return out


__all__ = [
    "ANSWER_TYPES", "LETTERS", "NO_NUMBERS", "NUMERIC_TYPES", "QUESTION_TYPES", "WHOLE_ANSWER",
    "MathItem", "MathScore", "check_choices", "exact_value", "format_choices", "format_number",
    "infer_item",
    "item_from_row", "make_item", "math_metrics", "normalize_text", "number_scope", "number_text",
    "option_letter", "parse_value", "read_choice", "read_number", "score_answer",
]
