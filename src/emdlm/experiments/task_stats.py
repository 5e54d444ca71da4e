"""A task's statistics, shared by its report section and its verdict: the final values and
learning curves per variant and seed, each variant paired by seed against the baseline
(:func:`emdlm.experiments.stats.compare_paired`, at the final checkpoint and over the area
under the curve), and the baseline's plateau check."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from emdlm.experiments.grid import Experiment
from emdlm.experiments.metric_names import better_direction, is_extra_metric
from emdlm.experiments.results import (
    Row,
    Table,
    auc_values,
    curves,
    final_values,
    key_metrics,
    ordered_metrics,
)
from emdlm.experiments.stats import (
    PairedComparison,
    compare_paired,
)


def paired_values(per_variant: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                   metrics: Sequence[str]) -> Iterator[tuple[str, str, list[float], list[float]]]:
    """(metric, variant, baseline values, variant values) over the seeds both have, for each
    metric and each variant other than the baseline that has it."""
    for metric in metrics:
        values = per_variant.get(metric, {})
        if exp.baseline not in values:
            continue
        for variant in exp.variants:
            if variant == exp.baseline or variant not in values:
                continue
            seeds = sorted(set(values[exp.baseline]) & set(values[variant]))
            yield (metric, variant, [values[exp.baseline][s] for s in seeds],
                   [values[variant][s] for s in seeds])


Comparison = tuple[str, str, PairedComparison]  # (metric, variant, variant − baseline)


def compare_variants(per_variant: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                 metrics: Sequence[str]) -> list[Comparison]:
    """Each variant against the baseline per metric (:func:`compare_paired`), in table order."""
    return [(metric, variant, compare_paired(base, other))
            for metric, variant, base, other in paired_values(per_variant, exp, metrics)]


# a key metric of the baseline that improves by more than this share of its value between the
# last two evaluated steps counts as still improving in the verdict
PLATEAU_TOLERANCE = 0.02


@dataclass
class Plateau:
    """The baseline's key metrics (mean over the seeds evaluated at both steps) at its last two
    evaluated steps: (metric, mean before, mean at the last step); ``span`` names the steps."""

    span: str
    changes: list[tuple[str, float, float]]

    def improving(self, tolerance: float = PLATEAU_TOLERANCE) -> list[tuple[str, float]]:
        """(metric, relative improvement) of the metrics with a known direction that improved
        by more than ``tolerance`` (relative to the earlier value; inf from an earlier 0)."""
        out = []
        for metric, a, b in self.changes:
            direction = better_direction(metric)
            if direction is None:
                continue
            gain = (a - b) if direction == "lower" else (b - a)
            rel = gain / abs(a) if a != 0 else (math.inf if gain > 0 else 0.0)
            if rel > tolerance:
                out.append((metric, rel))
        return out


def baseline_plateau(table: Table, exp: Experiment, metrics: Sequence[str]) -> Plateau | None:
    """Has the baseline stopped improving? Its ``metrics`` at the last two evaluated steps
    (:class:`Plateau`); None with fewer than two evaluated steps."""
    changes, span = [], ""
    for metric in metrics:
        by_seed = table.get(metric, {}).get(exp.baseline, {})
        steps = sorted({s for seed_steps in by_seed.values() for s in seed_steps})
        if len(steps) < 2:
            continue
        before, last = steps[-2], steps[-1]
        pairs = [(v[before], v[last]) for v in by_seed.values() if before in v and last in v]
        pairs = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
        if not pairs:
            continue
        a, b = (float(np.mean(x)) for x in zip(*pairs, strict=True))
        changes.append((metric, a, b))
        span = span or f"steps {before} → {last}"
    return Plateau(span, changes) if changes else None


@dataclass
class TaskStats:
    """What a task's section and its verdict share: the task's curves, its metrics in report
    order, the final values, the evaluated steps, the compared metrics, the comparisons at the
    final checkpoint and of the area under the curve, and the baseline's plateau check."""

    table: Table
    metrics: list[str]
    final: dict[str, dict[str, dict[int, float]]]
    steps: list[int]
    key: list[str]
    final_comparisons: list[Comparison]
    auc_comparisons: list[Comparison]
    plateau: Plateau | None


def task_stats(exp: Experiment, task: str, rows: Sequence[Row]) -> TaskStats | None:
    """Every statistic of one task (None when no finished cell has a metric of it)."""
    table = curves(rows, task)
    metrics = ordered_metrics(table)
    if not metrics:
        return None
    final = {m: {v: final_values(table[m][v]) for v in table[m]} for m in metrics}
    steps = sorted({r.step for r in rows if r.task == task})
    key = key_metrics(metrics) or metrics[:4]
    auc: list[Comparison] = []
    curve_key = [m for m in key if not is_extra_metric(m)]  # extras: final model only
    if len(steps) > 1:
        auc_values_ = {m: {v: auc_values(table[m][v]) for v in table[m]} for m in curve_key}
        auc = compare_variants(auc_values_, exp, curve_key)
    plateau = baseline_plateau(table, exp, [m for m in key_metrics(metrics)
                                            if not is_extra_metric(m)])
    return TaskStats(table, metrics, final, steps, key, compare_variants(final, exp, key), auc,
                     plateau)


