"""The metrics an experiment report knows: their report order and which way is better.

A leaf of :mod:`emdlm.experiments` (it imports nothing of the package), so that a config's
check (:mod:`emdlm.experiments.selection`) and the report read one table. ``<extra>.<metric>``
names an ``eval.extra`` evaluation of the final model (:func:`is_extra_metric`).
"""

from __future__ import annotations

# (metric, better) in report order: numeric errors lead, exact match follows
METRIC_ORDER: tuple[tuple[str, str], ...] = (
    ("abs_error_mean", "lower"),
    ("abs_error_median", "lower"),
    ("log10_error_mean", "lower"),
    ("within_1pct", "higher"),
    ("within_5pct", "higher"),
    ("rel_error_mean", "lower"),
    ("rel_error_median", "lower"),
    ("magnitude_error_rate", "lower"),
    ("sign_error_rate", "lower"),
    ("digit_accuracy", "higher"),
    ("leading_digit_accuracy", "higher"),
    ("parse_failure_rate", "lower"),
    ("exact_match", "higher"),
    ("perplexity", "lower"),
    # clocks (eval.kind clock: "H_MM") and boxes (eval.kind box / boxes)
    ("time_gap_mean_worst", "lower"),
    ("time_gap_mean", "lower"),
    ("time_gap_median", "lower"),
    ("time_gap_minutes_mean_worst", "lower"),
    ("time_gap_minutes_mean", "lower"),
    ("time_gap_minutes_median", "lower"),
    ("hour_accuracy", "higher"),
    ("minute_accuracy", "higher"),
    ("acc_iou50", "higher"),
    ("mean_iou", "higher"),
    ("acc_at_0.5", "higher"),  # several boxes: the NTIL paper's Acc@0.5 (recall at IoU 0.5)
    ("f1", "higher"),
    ("parse_failures", "lower"),  # eval.kind math: a count
    # text tasks (eval.kind text: EMO's protocol) and choice by perplexity
    ("mauve", "higher"),
    ("ppl_test", "lower"),
    ("ppl_oracle", "lower"),
    ("rouge1", "higher"),
    ("rougeL", "higher"),
    ("distinct_2", "higher"),
    ("rep_4", "lower"),
    ("accuracy", "higher"),
)


def is_extra_metric(name: str) -> bool:
    """True for ``<extra>.<metric>``: an ``eval.extra`` evaluation, of the final model only."""
    return "." in name


def base_metric(name: str) -> str:
    """``choice.accuracy`` -> ``accuracy``: the metric of an ``eval.extra`` evaluation."""
    return name.rsplit(".", 1)[-1]


def better_direction(name: str) -> str | None:
    """"lower" / "higher" for a known metric (extra evaluations' too), else None; the per-type
    exact match of eval.kind math (``exact_match_multi_choice``, ...) is higher-better."""
    base = base_metric(name)
    if base.startswith("exact_match_"):
        return "higher"
    return dict(METRIC_ORDER).get(base)
