"""Place-value digit accuracy of integer answers: which digits of a number a model gets right.

Where exact match stays near 0 (a task the model cannot master), the mean absolute error says
*how far* the answers are, not *where* they go wrong. NTIL's exponential position weights
(1 + σ)^(n − i − 1) (paper Eq. 3) put more weight on the higher places, so the question "does
an objective fix the digits that carry the error" is answered per place: the digits of |answer|
and |reference| aligned from the units place (place k is floor(|x| / 10^k) mod 10, for k below
the number's digit count; 0 has one digit). Signs are not compared (``sign_error_rate`` is).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from emdlm.experiments.cell_folder import CELL_DONE, final_predictions
from emdlm.experiments.grid import Cell
from emdlm.experiments.stats import mean_std

_EXACT_INT = 2.0**53  # floats below this hold every integer exactly


def parsed_answers(predictions: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(answers, references) as float arrays from predictions.jsonl rows of a numeric task; NaN
    where the row was not scored (``abs_error`` null) or the text does not parse."""
    from emdlm.metrics import parse_number

    def value(text: Any, scored: bool) -> float:
        number = parse_number(str(text)) if scored else None
        return math.nan if number is None else number

    pred = np.array([value(r["prediction"], r.get("abs_error") is not None)
                     for r in predictions], dtype=np.float64)
    ref = np.array([value(r["reference"], True) for r in predictions], dtype=np.float64)
    return pred, ref


def place_matches(pred: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([N, K] digit equal at place k, [N, K] the reference has place k) over the N pairs where
    both values are integers below 2^53 (K = the longest reference's digit count). An answer
    with fewer digits than the reference misses the places it lacks."""
    p, r = np.abs(pred), np.abs(ref)
    ok = (np.isfinite(p) & np.isfinite(r) & (p == np.floor(p)) & (r == np.floor(r))
          & (p < _EXACT_INT) & (r < _EXACT_INT))
    p, r = p[ok].astype(np.int64), r[ok].astype(np.int64)
    if not r.size:
        return np.zeros((0, 0), dtype=bool), np.zeros((0, 0), dtype=bool)
    digits_p = np.array([len(str(x)) for x in p.tolist()])
    digits_r = np.array([len(str(x)) for x in r.tolist()])
    places = np.arange(int(digits_r.max()), dtype=np.int64)[None, :]  # [1, K]
    scale = np.power(np.int64(10), places)
    has_place = places < digits_r[:, None]
    same = ((p[:, None] // scale) % 10) == ((r[:, None] // scale) % 10)
    return same & has_place & (places < digits_p[:, None]), has_place


def digit_accuracies(pred: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(``digit_accuracy``, ``leading_digit_accuracy``) of integer answers.

    ``digit_accuracy`` = the reference digits the answers have right at their place / all
    reference digits (pooled over answers); ``leading_digit_accuracy`` = share of answers with
    the reference's most significant digit at its place. NaN when no integer pair is left.
    Example: reference 1004, answer 104, (reference, answer) digit per place from the units:
    (4, 4), (0, 0), (0, 1), (1, none): 2 of 4 digits right, leading digit wrong.
    """
    same, has_place = place_matches(pred, ref)
    if not same.size:
        return math.nan, math.nan
    leading = has_place.sum(axis=1) - 1
    return (float(same.sum() / has_place.sum()),
            float(same[np.arange(len(same)), leading].mean()))


def place_accuracies(pred: np.ndarray, ref: np.ndarray) -> list[float]:
    """Per place k = 0 (units), 1, ...: share of the references with that place whose digit
    the answer has right there (empty list when no integer pair is left)."""
    same, has_place = place_matches(pred, ref)
    return (same.sum(axis=0) / has_place.sum(axis=0)).tolist() if same.size else []


def place_accuracy_lines(cells: Sequence[Cell], task: str, variants: Sequence[str],
                         read: Callable[[Path], list[dict[str, Any]]]) -> list[str]:
    """A Markdown table: per variant, the final checkpoint's accuracy at each place value, mean
    ± std over seeds (n). ``read(path)`` gives a predictions file's rows. Empty when the task's
    answers are not integers."""
    per_variant: dict[str, list[list[float]]] = defaultdict(list)
    for cell in cells:
        finished = cell.task == task and (cell.folder / CELL_DONE).is_file()
        path = final_predictions(cell.folder) if finished else None
        rows = read(path) if path is not None else []
        if rows and "abs_error" in rows[0]:
            accuracy = place_accuracies(*parsed_answers(rows))
            if accuracy:
                per_variant[cell.variant].append(accuracy)
    if not per_variant:
        return []
    n_places = max(len(a) for seeds in per_variant.values() for a in seeds)
    lines = ["### Digit accuracy by place value (final checkpoint, integer answers)", "",
             "Share of the references having a place whose digit the answer has right at that "
             "place (10^0 = units), mean ± std over seeds (n). A digit wrong at place k costs "
             "about 10^k in absolute error.", "",
             "| variant | " + " | ".join(f"10^{k}" for k in range(n_places)) + " |",
             "|---" * (n_places + 1) + "|"]
    for variant in variants:
        seeds = per_variant.get(variant)
        if not seeds:
            continue
        row = []
        for k in range(n_places):
            mean, std, n = mean_std([a[k] for a in seeds if len(a) > k])
            if not n:  # no reference of this variant's runs has the place
                row.append("–")
                continue
            row.append(f"{mean:.3f} ± " + ("–" if math.isnan(std) else f"{std:.3f}"))
        lines.append(f"| {variant} ({len(seeds)}) | " + " | ".join(row) + " |")
    return [*lines, ""]
