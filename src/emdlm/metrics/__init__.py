"""Task metrics on decoded answers: pure functions, no model; one entry point per task kind.

Metrics follow the torchmetrics habit where a metric aggregates: ``_<name>_update`` returns
sufficient statistics and ``_<name>_compute`` finishes them, so callers can stream batches.

The package, one job per module (every public name is importable from ``emdlm.metrics``):

* :mod:`emdlm.metrics.answers`: normalization, number parsing, exact match, numeric error, and
  the conventions every kind relies on (normalization, numbers as exact rationals, relative
  error floored at 1, parse failures counted, unparseable references an error);
* :mod:`emdlm.metrics.clock`: ``H_MM`` clock answers (cyclic 12-hour gap);
* :mod:`emdlm.metrics.text`: perplexity, ROUGE, MAUVE on offline MiniLM features, diversity;
* here: one box per answer (Acc@IoU), multiple choice, and :func:`compute_task_metrics`, which
  looks up each task kind's metrics in :data:`TASK_METRICS`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from emdlm.eval_kinds import EVAL_KINDS
from emdlm.math_answers import math_metrics
from emdlm.metrics.answers import (
    THOUSANDS_SEPARATORS,
    check_pairs,
    exact_match,
    exact_match_rate,
    normalize_answer,
    normalize_number_text,
    numeric_errors,
    parse_fraction,
    parse_number,
    reference_value,
)
from emdlm.metrics.boxes import Box, as_box, box_iou, boxes_metrics, parse_box
from emdlm.metrics.clock import MAX_CLOCK_GAP_HOURS, clock_metrics, clock_time_gap, parse_clock
from emdlm.metrics.text import (
    MAUVE_FLOOR,
    MAUVE_SATURATED,
    Featurizer,
    MiniLMFeaturizer,
    default_featurizer,
    distinct_n,
    diversity_metrics,
    mauve_from_features,
    mauve_num_buckets,
    mauve_over_runs,
    mauve_problem,
    mauve_score,
    perplexity,
    repeated_ngram_share,
    repetition_rate,
    rouge,
)

__all__ = [
    "MAUVE_FLOOR",
    "MAUVE_SATURATED",
    "MAX_CLOCK_GAP_HOURS",
    "TASK_KINDS",
    "TASK_METRICS",
    "THOUSANDS_SEPARATORS",
    "Featurizer",
    "MiniLMFeaturizer",
    "TaskKind",
    "acc_at_iou",
    "box_iou",
    "check_references",
    "choice_metrics",
    "clock_metrics",
    "clock_time_gap",
    "compute_task_metrics",
    "default_featurizer",
    "distinct_n",
    "diversity_metrics",
    "exact_match",
    "exact_match_rate",
    "mauve_from_features",
    "mauve_num_buckets",
    "mauve_over_runs",
    "mauve_problem",
    "mauve_score",
    "normalize_answer",
    "normalize_number_text",
    "numeric_errors",
    "parse_clock",
    "parse_fraction",
    "parse_number",
    "perplexity",
    "repeated_ngram_share",
    "repetition_rate",
    "rouge",
]

TaskKind = Literal["number", "clock", "box", "boxes", "text", "choice", "math"]

# ----------------------------------------------------------------------------------------------
# Boxes (visual grounding): one box per answer (parse_box and box_iou: emdlm.metrics.boxes)
# ----------------------------------------------------------------------------------------------


def _as_box(x: str | Sequence[float]) -> Box | None:
    return parse_box(x) if isinstance(x, str) else as_box(x)


def _box_update(
    preds: Sequence[str | Sequence[float]], refs: Sequence[str | Sequence[float]]
) -> tuple[list[float], int, int]:
    """Sufficient statistics: (IoU per pair with failures as 0, parse failures, n)."""
    check_pairs(preds, refs)
    ious: list[float] = []
    failures = 0
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref_box = reference_value(_as_box, r, i, "box") if isinstance(r, str) else _as_box(r)
        pred_box = _as_box(p)
        if pred_box is None:
            failures += 1
            ious.append(0.0)
            continue
        ious.append(box_iou(pred_box, ref_box))
    return ious, failures, len(preds)


def acc_at_iou(
    preds: Sequence[str | Sequence[float]],
    refs: Sequence[str | Sequence[float]],
    threshold: float = 0.5,
) -> float:
    """Fraction of predictions whose IoU with the reference is >= threshold (Acc@IoU).

    Unparseable predictions count as misses.
    """
    ious, _, n = _box_update(preds, refs)
    return sum(iou >= threshold for iou in ious) / n if n else 0.0



# ----------------------------------------------------------------------------------------------
# Choice (multiple-choice by perplexity)
# ----------------------------------------------------------------------------------------------


def choice_metrics(
    predicted: Sequence[int], gold: Sequence[int], n_choices: Sequence[int]
) -> dict[str, float]:
    """Accuracy of chosen candidate indices, beside the rates it should be read against.

    ``chance_rate``: mean of 1 / n_choices (uniform guessing); ``majority_rate``: accuracy of
    always answering the most frequent gold index. Keys: accuracy, chance_rate, majority_rate,
    n. Raises ValueError on a gold index outside its candidates.
    """
    check_pairs(predicted, gold)
    check_pairs(gold, n_choices)
    for i, (y, k) in enumerate(zip(gold, n_choices, strict=True)):
        if not 0 <= y < k:
            raise ValueError(f"example {i}: gold index {y} is not among its {k} candidates")
    n = len(gold)
    if n == 0:
        nan = float("nan")
        return {"accuracy": nan, "chance_rate": nan, "majority_rate": nan, "n": 0}
    hits = sum(p == y for p, y in zip(predicted, gold, strict=True))
    most = max(sum(y == v for y in gold) for v in set(gold))
    return {
        "accuracy": hits / n,
        "chance_rate": statistics.fmean(1.0 / k for k in n_choices),
        "majority_rate": most / n,
        "n": n,
    }


# ----------------------------------------------------------------------------------------------
# One entry point per task kind
# ----------------------------------------------------------------------------------------------

#: Every task kind (the registry's, :mod:`emdlm.eval_kinds`).
TASK_KINDS: tuple[str, ...] = EVAL_KINDS


def _number_metrics(
    preds: Sequence[str], refs: Sequence[str], *, rel_eps: float, **_: Any
) -> dict[str, float]:
    out = {"exact_match": exact_match_rate(preds, refs)}
    out.update(numeric_errors(preds, refs, eps=rel_eps))
    return out


def _clock_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    return clock_metrics(preds, refs)


def _box_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    ious, failures, n = _box_update(preds, refs)
    return {
        "acc_iou50": sum(i >= 0.5 for i in ious) / n if n else 0.0,
        "mean_iou": statistics.fmean(ious) if ious else float("nan"),
        "parse_failure_rate": failures / n if n else 0.0,
        "n": n,
    }


def _boxes_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    return boxes_metrics(preds, refs)


def _text_metrics(
    preds: Sequence[str],
    refs: Sequence[str],
    *,
    mauve: bool,
    featurizer: Featurizer | None,
    **_: Any,
) -> dict[str, float]:
    out = {"exact_match": exact_match_rate(preds, refs, numeric=False)}
    out.update(rouge(preds, refs))
    if mauve:
        out["mauve"] = mauve_score(preds, refs, featurizer=featurizer)
    out["n"] = len(preds)
    return out


def _choice_accuracy(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    n = len(preds)
    hits = sum(p == r for p, r in zip(preds, refs, strict=True))
    return {"accuracy": hits / n if n else float("nan"), "n": n}


def _math_metrics(
    preds: Sequence[str],
    refs: Sequence[str],
    *,
    rel_eps: float,
    rows: Sequence[Mapping[str, Any]] | None = None,
    **_: Any,
) -> dict[str, float]:
    return math_metrics(preds, refs, rows, eps=rel_eps)


#: The metrics of each task kind:
#: ``fn(predictions, references, *, mauve, featurizer, rel_eps, rows)`` (see
#: :func:`compute_task_metrics`). Exactly the registered kinds (tests/test_task_registry.py).
TASK_METRICS: dict[str, Callable[..., dict[str, float]]] = {
    "number": _number_metrics,
    "clock": _clock_metrics,
    "box": _box_metrics,
    "boxes": _boxes_metrics,
    "text": _text_metrics,
    "choice": _choice_accuracy,
    "math": _math_metrics,
}


def compute_task_metrics(
    predictions: Sequence[str],
    references: Sequence[str],
    kind: TaskKind,
    *,
    mauve: bool = False,
    featurizer: Featurizer | None = None,
    rel_eps: float = 1.0,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """All metrics of one task kind, as a flat dict of floats (:data:`TASK_METRICS`).

    ``rows``: the test rows, one per prediction, for kinds that read per-row metadata
    (``"math"``: ``question_type``, ``answer_type``, ``choices``, ``precision``, ``unit``); the
    other kinds read only the strings.

    * ``"number"``: exact_match (value equality), abs/rel error mean and median,
      parse_failure_rate, n.
    * ``"clock"``: exact_match, hour_accuracy, minute_accuracy (unparsed answers wrong),
      time_gap_mean_worst (failures as 6 h), time_gap_mean / _median (parsed answers), the same
      three in minutes (time_gap_minutes_*), parse_failures, parse_failure_rate, n
      (:func:`clock_metrics`).
    * ``"box"``: acc_iou50 (Acc@IoU>=0.5), mean_iou (failures as 0), parse_failure_rate, n.
    * ``"boxes"`` (several boxes per answer, "; "-separated): micro precision, recall, f1 of
      one-to-one matching at IoU>=0.5, image_exact, mean_matched_iou, parse_failure_rate,
      n_pred_boxes, n_gold_boxes, n, and acc_at_0.5 (the NTIL paper's Acc@0.5 for several
      boxes: the share of gold boxes matched one-to-one at IoU>=0.5, i.e. the recall)
      (:func:`emdlm.metrics.boxes.boxes_metrics`).
    * ``"text"``: exact_match (string), rouge1, rougeL (F-measure), and mauve (MiniLM
      features) when ``mauve=True``; n. (``emdlm eval`` scores open-ended text with
      :func:`emdlm.evaluation.evaluate_text`, which adds sampling, diversity and PPL metrics.)
    * ``"choice"``: accuracy (the chosen candidate's text equals the gold one), n; the chance
      and majority rates need the candidates: :func:`choice_metrics`.
    * ``"math"`` (MathVista / MathVision answers, :mod:`emdlm.math_answers`): exact_match
      overall and per question / answer type, abs/rel error of free-form numbers,
      parse_failures, parse_failure_rate, the counts per type, n.
    """
    check_pairs(predictions, references)
    metrics = TASK_METRICS.get(kind) if isinstance(kind, str) else None
    if metrics is None:
        raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")
    if rows is not None and len(rows) != len(predictions):
        raise ValueError(f"{len(rows)} rows for {len(predictions)} predictions")
    return metrics(predictions, references, mauve=mauve, featurizer=featurizer, rel_eps=rel_eps,
                   rows=rows)


def _shortened(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut to about ``limit`` characters with the length said."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(text)} characters)"


def check_references(
    references: Sequence[str], kind: TaskKind, rows: Sequence[Mapping[str, Any]] | None = None
) -> None:
    """ValueError naming the first reference that ``kind``'s metrics cannot read ("two" or
    "1e400" for a number, a box for a clock), before any answer is generated.

    The check is the kind's own metric function (:data:`TASK_METRICS`) run on the references
    as their own predictions: every reference is read exactly as the scoring will read it, by
    the same parser, so the check cannot drift from the scoring. ``rows``: the test rows (the
    kinds reading per-row metadata need them). Only on a failure are the references tried one
    by one, to name the row."""
    try:
        compute_task_metrics(references, references, kind, rows=rows)
    except ValueError:
        pass
    else:
        return
    for i, ref in enumerate(references):
        try:
            compute_task_metrics([ref], [ref], kind, rows=None if rows is None else [rows[i]])
        except ValueError as err:
            reason = str(err).replace(repr(ref), _shortened(ref)).replace("reference 0 ",
                                                                          "reference ")
            raise ValueError(f"row {i}: {reason} (eval.kind={kind})") from err
    compute_task_metrics(references, references, kind, rows=rows)  # raises as it did above
