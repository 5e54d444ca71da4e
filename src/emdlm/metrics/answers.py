"""Reading answers: normalization, numbers, exact match and numeric error (pure functions).

Conventions (relied on by ``emdlm eval`` and every task kind):

* **Normalization** (:func:`normalize_answer`): lower-case, collapse runs of whitespace, strip
  the ends, then strip trailing sentence punctuation (``. , ; : ! ?``). Nothing else is removed
  (SQuAD-style article/punctuation removal would turn ``-6/11`` into ``611``).
* **Numbers** (:func:`parse_number`): the whole normalized string must be one number: an
  optionally signed integer (thousands separators allowed only in correct groups of three:
  ``1,234,567``), decimal (``3.``, ``.5``, ``-0.25``), scientific (``1e-3``) or fraction of two
  integers (``-6/11``, ``3/-4`` is rejected). ``4_35`` (a clock answer), ``nan``, ``inf`` and
  text around the number are not numbers. Values are parsed exactly as
  :class:`fractions.Fraction`, so exact match on 30-digit numbers is exact; magnitudes beyond
  the float range are treated as parse failures by the float-valued functions.
* **Exact match** (:func:`exact_match`): true when the normalized strings are equal, or when
  both parse as numbers of exactly equal rational value (``"3.0" == "3"``,
  ``"-12/22" == "-6/11"``, ``"0.5" == "1/2"``). Value equality, not form equality: a fraction
  not in lowest terms is accepted. Pass ``numeric=False`` for string equality only.
* **Relative error**: ``|p - r| / max(|r|, eps)`` with ``eps = 1`` by default, i.e. the scale
  is floored at 1 so that references at or near 0 do not dominate the mean (the same device
  as the ``+1`` in the denominators of the official NTIL code, github.com/xfey/NTIL
  ``ntil.py``). Pass ``eps=1e-12`` for the plain relative error.
* **Parse failures** of predictions are counted (``parse_failure_rate``) and left out of the
  error means; unparseable *references* raise ``ValueError`` (a data bug, never hidden).
"""

from __future__ import annotations

import re
import statistics
import unicodedata
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

_TRAILING_PUNCT = ".,;:!?"
#: Thousands separators :func:`parse_fraction` can read ("," by default: "1,234" is 1234).
THOUSANDS_SEPARATORS = (",", "_", "'")
# Characters NFKC leaves alone that still mean a sign or a decimal mark in a number.
_NUMBER_CHARS = str.maketrans({"\u2212": "-", "\u066b": ".", "\u066c": ","})
# NFKC would turn '2³' into '23' and '½' into '1⁄2': keep such characters as they are.
_KEEP_TAGS = ("<super>", "<sub>", "<fraction>")


# ----------------------------------------------------------------------------------------------
# Normalization and parsing
# ----------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Lower-case, collapse whitespace, strip the ends and trailing ``. , ; : ! ?``.

    Example: ``normalize_answer("  The  Answer. ") == "the answer"``.
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects a str, got {type(s).__name__}: {s!r}")
    out = " ".join(s.lower().split())
    return out.rstrip(_TRAILING_PUNCT).rstrip()


@lru_cache(maxsize=8)
def _number_patterns(separator: str | None) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(number, fraction) regexes; integers may use ``separator`` in correct 3-digit groups."""
    group = "" if separator is None else rf"\d{{1,3}}(?:{re.escape(separator)}\d{{3}})+|"
    integer = rf"(?:{group}\d+)"
    # Exponents are capped at 3 digits: Fraction("1e999999999") would build a gigantic integer.
    decimal = rf"(?:{integer}(?:\.\d*)?|\.\d+)(?:e[+-]?\d{{1,3}})?"
    return re.compile(rf"[+-]?{decimal}"), re.compile(rf"([+-]?{integer})/({integer})")


def normalize_number_text(s: str) -> str:
    """NFKC per character (fullwidth '１２３．５' -> '123.5'), plus the minus sign U+2212 and the
    Arabic decimal / thousands marks; superscripts, subscripts and vulgar fractions are kept
    ('2³' must not read as 23). Arabic-Indic and other Unicode decimal digits stay as they are:
    Python's ``int`` reads them."""
    if s.isascii():
        return s
    out = (
        c
        if unicodedata.decomposition(c).startswith(_KEEP_TAGS)
        else unicodedata.normalize("NFKC", c)
        for c in s
    )
    return "".join(out).translate(_NUMBER_CHARS)


def parse_fraction(s: str, *, thousands_separator: str | None = ",") -> Fraction | None:
    """Parse a whole answer string as an exact rational number, or return None.

    Accepts integers (``-12``, ``1,234``), decimals (``3.``, ``.5``), scientific notation
    (``1e-3``) and fractions of integers (``-6/11``; zero denominators give None). The string
    is normalized first (:func:`normalize_number_text`, then :func:`normalize_answer`); nothing
    else may surround the number. ``thousands_separator``: "," (default) reads correctly
    grouped thousands ("1,234"; "1,23" is not a number), None reads none, "_" or "'" another.
    """
    if thousands_separator is not None and thousands_separator not in THOUSANDS_SEPARATORS:
        raise ValueError(
            f"thousands_separator must be None or one of {THOUSANDS_SEPARATORS}, got "
            f"{thousands_separator!r}"
        )
    t = normalize_answer(normalize_number_text(s))
    if not t:
        return None
    number_re, fraction_re = _number_patterns(thousands_separator)
    sep = thousands_separator or ""
    try:
        if number_re.fullmatch(t):
            return Fraction(t.replace(sep, "") if sep else t)
        m = fraction_re.fullmatch(t)
        if m:
            den = int(m.group(2).replace(sep, "") if sep else m.group(2))
            if den == 0:
                return None
            return Fraction(int(m.group(1).replace(sep, "") if sep else m.group(1)), den)
    except ValueError:  # more digits than Python's int/str conversion limit (4300)
        return None
    return None


def parse_number(s: str, *, thousands_separator: str | None = ",") -> float | None:
    """Parse a whole answer string as a number (see :func:`parse_fraction`), as a float.

    Returns None when the string is not a number or its magnitude overflows a float.
    Examples: ``"-6/11" -> -0.5454...``, ``"1,234" -> 1234.0``, ``"4_35" -> None``,
    ``"１２３．５" -> 123.5``, ``"−5" -> -5.0``.
    """
    value = parse_fraction(s, thousands_separator=thousands_separator)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def exact_match(pred: str, ref: str, *, numeric: bool = True) -> bool:
    """Normalized string equality, or (``numeric=True``) exact equality of parsed values.

    ``exact_match("3.0", "3")``, ``exact_match("-12/22", "-6/11")`` and
    ``exact_match(" Paris.", "paris")`` are all True.
    """
    if normalize_answer(pred) == normalize_answer(ref):
        return True
    if not numeric:
        return False
    p, r = parse_fraction(pred), parse_fraction(ref)
    return p is not None and r is not None and p == r


def exact_match_rate(preds: Sequence[str], refs: Sequence[str], *, numeric: bool = True) -> float:
    """Fraction of pairs for which :func:`exact_match` holds."""
    check_pairs(preds, refs)
    if not preds:
        return 0.0
    return sum(exact_match(p, r, numeric=numeric) for p, r in zip(preds, refs, strict=True)) / len(
        preds
    )


def check_pairs(preds: Sequence[Any], refs: Sequence[Any]) -> None:
    if len(preds) != len(refs):
        raise ValueError(
            f"predictions and references differ in length: {len(preds)} vs {len(refs)}"
        )


def reference_value(parse: Callable[[str], Any], ref: str, index: int, what: str) -> Any:
    value = parse(ref)
    if value is None:
        raise ValueError(f"reference {index} is not a valid {what}: {ref!r}")
    return value


# ----------------------------------------------------------------------------------------------
# Numeric errors
# ----------------------------------------------------------------------------------------------


def _numeric_errors_update(
    preds: Sequence[str], refs: Sequence[str], eps: float = 1.0
) -> tuple[list[float], list[float], int, int]:
    """Sufficient statistics: (absolute errors, relative errors, parse failures, n)."""
    check_pairs(preds, refs)
    abs_errors: list[float] = []
    rel_errors: list[float] = []
    failures = 0
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref_value = reference_value(parse_number, r, i, "number")
        pred_value = parse_number(p)
        if pred_value is None:
            failures += 1
            continue
        err = abs(pred_value - ref_value)
        abs_errors.append(err)
        rel_errors.append(err / max(abs(ref_value), eps))
    return abs_errors, rel_errors, failures, len(preds)


def _numeric_errors_compute(
    abs_errors: Sequence[float], rel_errors: Sequence[float], failures: int, n: int
) -> dict[str, float]:
    """Finish :func:`numeric_errors`; means/medians are NaN when no prediction parsed."""
    nan = float("nan")
    return {
        "abs_error_mean": statistics.fmean(abs_errors) if abs_errors else nan,
        "abs_error_median": statistics.median(abs_errors) if abs_errors else nan,
        "rel_error_mean": statistics.fmean(rel_errors) if rel_errors else nan,
        "rel_error_median": statistics.median(rel_errors) if rel_errors else nan,
        "parse_failure_rate": failures / n if n else 0.0,
        "n": n,
    }


def numeric_errors(
    preds: Sequence[str], refs: Sequence[str], *, eps: float = 1.0
) -> dict[str, float]:
    """Absolute and relative error of parsed numeric predictions against references.

    abs_error = |p - r|; rel_error = |p - r| / max(|r|, eps) (eps = 1 floors the scale, see
    the module docstring). Means and medians are over predictions that parse; the rest are
    counted in ``parse_failure_rate`` = failures / n. Returns keys ``abs_error_mean``,
    ``abs_error_median``, ``rel_error_mean``, ``rel_error_median``, ``parse_failure_rate``,
    ``n``. Raises ValueError if a reference does not parse.
    """
    return _numeric_errors_compute(*_numeric_errors_update(preds, refs, eps))


