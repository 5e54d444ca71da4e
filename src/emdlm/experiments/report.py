"""Aggregate a finished (or partly finished) grid into ``results.csv`` and ``report.md``.

``results.csv``: one row per cell x evaluated step x metric (task, variant, seed, step,
metric, value). Besides what ``emdlm eval`` writes to metrics.json, numeric tasks get metrics
computed here from predictions.jsonl (:func:`numeric_extras`): the mean log error and the
shares of answers within +-1% and +-5%.

``report.md``: per task, the final checkpoint's mean +- std over seeds of every metric
(numeric-error metrics first, exact match after them: it swings between seeds far more than
objectives differ), the paired difference of each variant against the baseline (95% interval:
percentile bootstrap from 5 paired seeds on, paired t below; Wilcoxon signed-rank and paired-t
p-values, number of seeds, a note when there are too few seeds to reach significance), power
planning figures from the seeds' spread (seeds needed, from 3 seeds on; smallest detectable
difference), the same for the area under the learning curve, the steps
to reach 50% / 90% exact match, the training-loss components early / middle / late
(:mod:`emdlm.experiments.components`), and the plots. Before the tasks, a verdict per task
(:func:`verdict_lines`): does the baseline beat the constant-answer floor, has it stopped
improving, how many paired seeds, what they allow one to conclude, and how many tests ran.

Only whole outputs count: a cell is read when its ``cell_done.json`` parses and every one of
its evaluation folders has a metrics.json agreeing with the rows of its predictions.jsonl
(:func:`emdlm.experiments.runner.cell_problem`, :func:`emdlm.eval_outputs.read_eval_outputs`).
A cell marked done whose outputs are not whole (a cut-off predictions.jsonl an older emdlm
took as evaluated) is left out of every table and plot, and named with the file and the
reason (:attr:`GridRead.left_out`): no metric is computed from part of a file.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from emdlm._files import atomic_write
from emdlm.eval_outputs import EvalOutputError, read_eval_outputs, read_predictions
from emdlm.experiments.components import component_lines
from emdlm.experiments.digits import digit_accuracies, parsed_answers, place_accuracy_lines
from emdlm.experiments.grid import Cell, Experiment
from emdlm.experiments.runner import (
    CELL_DONE,
    ERROR_FILE,
    EVAL_DIR,
    cell_problem,
    final_predictions,
    read_cell_record,
)
from emdlm.experiments.stats import (
    ALPHA,
    MIN_BOOTSTRAP_SEEDS,
    POWER,
    PairedComparison,
    compare_paired,
    detectable_difference,
    mean_std,
    normalized_auc,
    paired_differences,
    seeds_for_power,
    steps_to_reach,
    wilcoxon_min_p,
)

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
# the metrics compared pairwise in the report (the rest are in the mean +- std table and csv)
KEY_METRICS = ("abs_error_mean", "log10_error_mean", "within_5pct", "exact_match",
               "time_gap_mean_worst", "acc_iou50", "mean_iou", "acc_at_0.5", "f1",
               "mauve", "ppl_test", "ppl_oracle", "rougeL", "accuracy")
# settings and counts recorded in metrics.json, not outcomes: kept out of the report and csv
SKIP_METRICS = ("n", "n_predictions", "num_samples", "temperature", "top_p", "top_k",
                "max_new_tokens", "n_prompts", "n_samples", "mauve_num_buckets",
                "mauve_scaling_factor", "mauve_seed", "mauve_kmeans_num_redo",
                "mauve_kmeans_max_iter", "mauve_run_min", "mauve_run_max")
CSV_FIELDS = ("task", "variant", "seed", "step", "metric", "value")
THRESHOLDS = (0.5, 0.9)


@dataclass
class Row:
    task: str
    variant: str
    seed: int
    step: int
    metric: str
    value: float


def numeric_extras(predictions: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Metrics computed from predictions.jsonl rows of a numeric task.

    * ``log10_error_mean``: mean of log10(1 + |p - r|) over parsed answers (a tail-robust
      error: an answer off by 1000 counts 3, not 1000).
    * ``within_1pct`` / ``within_5pct``: share of ALL answers with |p - r| / max(|r|, 1) <=
      0.01 / 0.05 (unparsed answers count as misses; the floor of 1 matches the relative error
      of :func:`emdlm.metrics.numeric_errors`).
    * ``magnitude_error_rate``: share of parsed answers whose order of magnitude
      floor(log10(max(|x|, 1))) differs from the reference's: for integers, a wrong number of
      digits ('9+0=' answered '909'), an error the token-level digit terms cannot see.
    * ``sign_error_rate``: share of parsed answers negative where the reference is not, or
      the reverse.
    * ``digit_accuracy`` / ``leading_digit_accuracy``: how many of the reference's digits
      the answer has right at their place value (integer answers only; see
      :func:`emdlm.experiments.digits.digit_accuracies`): partial progress where exact match
      is near 0.
    Empty dict when the rows carry no ``abs_error`` (not a numeric task).
    """
    if not predictions or "abs_error" not in predictions[0]:
        return {}
    n = len(predictions)
    err = np.array([np.nan if r["abs_error"] is None else r["abs_error"] for r in predictions],
                   dtype=np.float64)
    pred, ref = parsed_answers(predictions)
    parsed = np.isfinite(err)
    rel = np.where(parsed, err / np.maximum(np.abs(ref), 1.0), np.inf)
    out = {
        "log10_error_mean": float(np.log10(1.0 + err[parsed]).mean()) if parsed.any() else math.nan,
        "within_1pct": float(np.count_nonzero(rel <= 0.01)) / n,
        "within_5pct": float(np.count_nonzero(rel <= 0.05)) / n,
        "magnitude_error_rate": math.nan,
        "sign_error_rate": math.nan,
    }
    both = parsed & np.isfinite(pred) & np.isfinite(ref)
    if both.any():
        p, r = pred[both], ref[both]
        order_p = np.floor(np.log10(np.maximum(np.abs(p), 1.0)))
        order_r = np.floor(np.log10(np.maximum(np.abs(r), 1.0)))
        out["magnitude_error_rate"] = float(np.mean(order_p != order_r))
        out["sign_error_rate"] = float(np.mean((p < 0) != (r < 0)))
    out["digit_accuracy"], out["leading_digit_accuracy"] = digit_accuracies(pred[both], ref[both])
    return out


def clock_extras(predictions: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Hand-by-hand accuracy from predictions.jsonl rows of the clock task (rows with a
    ``time_gap``): ``hour_accuracy`` (same hour on the 12-hour dial) and ``minute_accuracy``
    (same minutes), each over ALL answers (an unparsed answer is wrong on both). They show
    which hand a model reads when exact match is low. Empty dict for other tasks. The clock
    metrics of :func:`emdlm.metrics.clock_metrics` hold them too; this reads them for
    evaluations written before they did."""
    from emdlm.metrics import parse_clock

    if not predictions or "time_gap" not in predictions[0]:
        return {}
    hour = minute = 0
    for row in predictions:
        pred, ref = parse_clock(str(row["prediction"])), parse_clock(str(row["reference"]))
        if pred is None or ref is None:
            continue
        hour += pred // 60 == ref // 60
        minute += pred % 60 == ref % 60
    n = len(predictions)
    return {"hour_accuracy": hour / n, "minute_accuracy": minute / n}


def constant_answer_floor(references: Sequence[str]) -> dict[str, dict[str, float]]:
    """Errors of answering every problem with one constant, on a numeric test set.

    Two constants: 0, and the references' median (the constant with the least mean absolute
    error over this set, chosen with the answers, so it flatters the constant). A model
    whose ``abs_error_mean`` does not beat them has learned nothing of its inputs that moves
    its answers closer (a learning floor, not a chance level). Per constant: ``abs_error_mean``,
    ``abs_error_median``, ``log10_error_mean`` (log10(1 + |c - r|)) and ``exact_match`` (share
    of references equal to it). References that do not parse are left out; empty dict when
    none parses.
    """
    from emdlm.metrics import parse_number

    values = np.array([v for v in (parse_number(str(r)) for r in references) if v is not None],
                      dtype=np.float64)
    if values.size == 0:
        return {}
    floor = {}
    for name, constant in (("0", 0.0), ("median", float(np.median(values)))):
        err = np.abs(values - constant)
        floor[name] = {"constant": constant, "abs_error_mean": float(err.mean()),
                       "abs_error_median": float(np.median(err)),
                       "log10_error_mean": float(np.log10(1.0 + err).mean()),
                       "exact_match": float(np.count_nonzero(err == 0)) / err.size}
    return floor


@dataclass
class TaskFloor:
    """The constant-answer floor of a task's test set (:func:`constant_answer_floor`), with the
    number of test problems it was computed on and how many of them are distinct by (prompt,
    reference) (None when the predictions carry no prompt)."""

    floor: dict[str, dict[str, float]]
    count: int
    distinct: int | None

    @property
    def best_abs_error(self) -> float:
        """The smaller abs_error_mean of the two constants (the median's, by construction)."""
        return min(c["abs_error_mean"] for c in self.floor.values())


def task_floor(cells: Sequence[Cell], task: str) -> TaskFloor | None:
    """The constant-answer floor on the task's test set, from one finished cell's last
    predictions (every cell of a task is scored on the same test set); None for a task whose
    answers are not numbers, or with no finished cell."""
    for cell in cells:
        if cell.task != task or not (cell.folder / CELL_DONE).is_file():
            continue
        path = final_predictions(cell.folder)
        if path is None:
            continue
        preds = read_predictions(path)
        if not preds or "abs_error" not in preds[0]:
            return None
        floor = constant_answer_floor([r["reference"] for r in preds])
        if not floor:
            return None
        # a problem is its question and its answer: an image task asks one question of many
        # figures ("What is the value of the red bar?"), the figure's answer tells them apart
        distinct = (len({(r.get("prompt"), r.get("reference")) for r in preds})
                    if "prompt" in preds[0] else None)
        return TaskFloor(floor, len(preds), distinct)
    return None


def _floor_lines(cells: Sequence[Cell], task: str, floor: TaskFloor | None = None) -> list[str]:
    """The constant-answer floor's line of the task section (:func:`task_floor`; pass
    ``floor`` when it is computed already)."""
    info = floor if floor is not None else task_floor(cells, task)
    if info is None:
        return []
    zero, median = (
        f"abs_error_mean {_fmt(c['abs_error_mean'])}, median {_fmt(c['abs_error_median'])}, "
        f"log10_error_mean {_fmt(c['log10_error_mean'])}, exact_match "
        f"{_fmt(c['exact_match'])}" for c in (info.floor["0"], info.floor["median"]))
    count = f"{info.count}" + (f" ({info.distinct} distinct)" if info.distinct is not None
                               else "")
    return [f"Floor, the same {count} test problems answered with one constant: "
            f"0 gives {zero}; the test median ({info.floor['median']['constant']:g}, the best "
            f"constant for abs_error_mean) gives {median}. A variant that does not beat "
            "them has not learned the task."]


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan  # written as null by write_eval_outputs (NaN / inf)
    return float(value)


def cell_rows(cell: Cell) -> list[Row]:
    """Every (step, metric) of a finished cell; nothing for an unfinished one (no readable
    ``cell_done.json``). EvalOutputError, naming the file, for an evaluation folder that is
    not whole (:func:`emdlm.eval_outputs.read_eval_outputs`): never a metric from part of it."""
    if read_cell_record(cell.folder) is None:
        return []
    rows: list[Row] = []
    sources = [("", cell.folder / EVAL_DIR)]  # learning-curve evaluations, then eval.extra ones
    sources += [(f"{name}.", cell.folder / EVAL_DIR / name) for name in cell.extra_evals]
    for prefix, folder in sources:
        for step_dir in sorted(folder.glob("step-*")):
            step = int(step_dir.name.split("-")[-1])
            metrics, preds = read_eval_outputs(step_dir)
            metrics.update(numeric_extras(preds))
            for name, value in clock_extras(preds).items():  # older metrics.json lack them
                metrics.setdefault(name, value)
            for name, value in metrics.items():
                # counts per answer / question type (eval.kind math) are not outcomes either
                if (name in SKIP_METRICS or (name.startswith("n_") and name != "n_scored")
                        or isinstance(value, (str, list, dict))):
                    continue
                rows.append(Row(cell.task, cell.variant, cell.seed, step, prefix + name,
                                _as_float(value)))
    return rows


@dataclass
class GridRead:
    """What the report may use of a grid: the rows of the finished cells, those cells, and
    the cells marked done (``cell_done.json``) that were left out: cell key -> the reason,
    one line naming the file (a cut-off or torn output)."""

    rows: list[Row] = field(default_factory=list)
    finished: list[Cell] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)


def read_grid(cells: Iterable[Cell]) -> GridRead:
    """Read every finished cell whole (:func:`emdlm.experiments.runner.cell_problem`, then
    :func:`cell_rows`); a cell marked done whose outputs are not whole goes to ``left_out``
    with its reason instead of into the statistics. Unfinished cells are passed over."""
    out = GridRead()
    for cell in cells:
        if not (cell.folder / CELL_DONE).exists():
            continue  # not finished: counted as such by the report, nothing to warn about
        problem = cell_problem(cell)
        rows: list[Row] = []
        if problem is None:
            try:
                rows = cell_rows(cell)
            except EvalOutputError as err:  # e.g. a broken line in a file of the right length
                problem = str(err)
        if problem is not None:
            out.left_out[cell.key] = problem
            continue
        out.rows += rows
        out.finished.append(cell)
    return out


def collect_rows(cells: Iterable[Cell]) -> list[Row]:
    """The rows of every finished cell whose outputs are whole (:func:`read_grid`)."""
    return read_grid(cells).rows


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """results.csv, written whole (temporary file renamed into place). Built in memory and
    written as bytes: the csv module ends rows with CRLF itself, which a text-mode file would
    translate again on Windows."""
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(CSV_FIELDS)
    for r in sorted(rows, key=lambda r: (r.task, r.variant, r.seed, r.step, r.metric)):
        writer.writerow([r.task, r.variant, r.seed, r.step, r.metric, repr(r.value)])
    with atomic_write(path, binary=True) as fh:
        fh.write(buffer.getvalue().encode("utf-8"))


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


def key_metrics(names: Iterable[str]) -> list[str]:
    """The metrics compared pairwise, in report order (extra evaluations' after the main ones)."""
    return [m for m in ordered_metrics(names) if base_metric(m) in KEY_METRICS]


def ordered_metrics(names: Iterable[str]) -> list[str]:
    """Known metrics in report order (main evaluation first, then each extra evaluation), then
    any others alphabetically."""
    present = set(names)
    prefixes = sorted({m.rsplit(".", 1)[0] + "." if is_extra_metric(m) else "" for m in present})
    known = [p + m for p in prefixes for m, _ in METRIC_ORDER if p + m in present]
    return known + sorted(present - set(known))


Table = dict[str, dict[str, dict[int, dict[int, float]]]]  # metric -> variant -> seed -> step


def curves(rows: Sequence[Row], task: str) -> Table:
    """metric -> variant -> seed -> step -> value for one task."""
    out: Table = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        if r.task == task:
            out[r.metric][r.variant][r.seed][r.step] = r.value
    return out


def final_values(by_seed: dict[int, dict[int, float]]) -> dict[int, float]:
    """seed -> value at that seed's last evaluated step (the final model)."""
    return {seed: steps[max(steps)] for seed, steps in by_seed.items() if steps}


def auc_values(by_seed: dict[int, dict[int, float]]) -> dict[int, float]:
    """seed -> normalized area under that seed's learning curve."""
    out = {}
    for seed, steps in by_seed.items():
        s = sorted(steps)
        out[seed] = normalized_auc(s, [steps[k] for k in s])
    return out


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.4g}"


def _fmt_p(p: float) -> str:
    return "–" if math.isnan(p) else f"{p:.3g}"


def _paired_values(per_variant: dict[str, dict[str, dict[int, float]]], exp: Experiment,
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


def _comparisons(per_variant: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                 metrics: Sequence[str]) -> list[Comparison]:
    """Each variant against the baseline per metric (:func:`compare_paired`), in table order."""
    return [(metric, variant, compare_paired(base, other))
            for metric, variant, base, other in _paired_values(per_variant, exp, metrics)]


def _ci_header(comparisons: Sequence[Comparison]) -> tuple[str, bool]:
    """The interval column's header, and whether each paired-t interval is marked "(t)" (a
    table holding both kinds). Rows with fewer than 2 seeds have no interval and do not count."""
    kinds = {c.ci_kind for _, _, c in comparisons if c.n >= 2}
    if kinds == {"t"}:
        return "95% paired-t CI", False
    if kinds == {"t", "bootstrap"}:
        return f"95% CI (bootstrap; (t): paired t, < {MIN_BOOTSTRAP_SEEDS} seeds)", True
    return ("95% bootstrap CI" if kinds else "95% CI"), False


T_INTERVAL_NOTE = (
    f"Intervals from fewer than {MIN_BOOTSTRAP_SEEDS} paired seeds are paired-t intervals, "
    "mean ± t_{n−1, 0.975}·sd/√n, not percentile bootstraps: over so few seeds a bootstrap "
    "interval is about the range of the differences and covers the true mean far less often "
    "than 95% (about half the time at 2 seeds).")


def _comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """Markdown rows: variant - baseline per metric with CI, p-values, n and note; then a note
    when an interval is a paired-t one (:func:`emdlm.experiments.stats.compare_paired`)."""
    header, mark = _ci_header(comparisons)
    lines = [f"| metric | variant | mean diff (variant − baseline) | {header} | "
             "p Wilcoxon | p paired t | seeds | note |", "|---|---|---|---|---|---|---|---|"]
    for metric, variant, c in comparisons:
        kind = " (t)" if mark and c.ci_kind == "t" and c.n >= 2 else ""
        lines.append(
            f"| {metric} | {variant} | {_fmt(c.mean_diff)} | [{_fmt(c.ci_low)}, "
            f"{_fmt(c.ci_high)}]{kind} | {_fmt_p(c.p_wilcoxon)} | {_fmt_p(c.p_ttest)} | {c.n} | "
            f"{c.note} |"
        )
    if any(c.ci_kind == "t" and c.n >= 2 for _, _, c in comparisons):
        lines += ["", T_INTERVAL_NOTE]
    return lines


# Fewest paired seeds from which the power table estimates the seeds needed for the observed
# difference. From 2 seeds, mean / sd of the differences is t-distributed with 1 degree of
# freedom (Cauchy) even when there is no true difference, so it often "needs" 2 or 3 seeds: a
# figure that invites reading a pilot as conclusive. From 3 on, the documented pilot size, it
# is rough but finite in expectation.
MIN_POWER_SEEDS = 3


def _power_lines(final: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                 metrics: Sequence[str]) -> list[str]:
    """Planning figures from the seeds' spread: per metric and variant, the standard deviation
    of the paired differences, the smallest true difference these seeds detect with 80 % power,
    and the seeds needed for 80 % power if the true difference were the observed one (not
    estimated from fewer than ``MIN_POWER_SEEDS`` seeds)."""
    rows = []
    header = ["### Power of the final comparison (planning figures for the next grid)", "",
              f"Paired t test, two-sided, alpha 0.05, power {POWER:.0%}, with the standard "
              "deviation of these seeds' paired differences. These size a future grid; they are "
              "not evidence of an effect (a small observed difference needs many seeds).", "",
              "| metric | variant | seeds | sd of differences | smallest detectable difference "
              "| seeds for the observed difference |", "|---|---|---|---|---|---|"]
    few = False
    for metric, variant, base, other in _paired_values(final, exp, metrics):
        d = paired_differences(base, other)
        if d.size < 2:
            continue
        sd = float(d.std(ddof=1))
        if d.size < MIN_POWER_SEEDS:
            few, need_text = True, f"not estimated from {d.size} seeds"
        else:
            need = seeds_for_power(float(d.mean()), sd)
            need_text = f"{need if need is not None else '> 10000'}"
        rows.append(f"| {metric} | {variant} | {d.size} | {_fmt(sd)} | "
                    f"{_fmt(detectable_difference(int(d.size), sd))} | {need_text} |")
    if few:
        rows += ["", f"The seeds for the observed difference are not estimated from fewer than "
                 f"{MIN_POWER_SEEDS} seeds: the mean / sd ratio of two differences swings as "
                 "wildly as a Cauchy variable even with no true difference. The smallest "
                 "detectable difference says what a grid of this size can resolve."]
    return [*header, *rows, ""] if rows else []


WITHIN_SCHEDULE_CAVEAT = (
    "Both steps lie in one learning-rate schedule, and a decaying one (cosine, linear) flattens "
    "the curve at its end whether or not the model has more to learn; the plateau test is a "
    "longer schedule, paired by seed (`base.train.max_steps=<2x>` into a new folder; "
    "docs/experiments.md).")
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


def _plateau_lines(plateau: Plateau | None, exp: Experiment) -> list[str]:
    """The task section's plateau-check line (:func:`baseline_plateau`)."""
    if plateau is None:
        return []
    parts = []
    for metric, a, b in plateau.changes:
        change = f" ({(b - a) / abs(a):+.1%})" if a != 0 else ""
        parts.append(f"{metric} {_fmt(a)} → {_fmt(b)}{change}")
    return [f"Plateau check, baseline `{exp.baseline}` (mean over seeds), {plateau.span}: "
            + "; ".join(parts) + ". " + WITHIN_SCHEDULE_CAVEAT]


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
        auc = _comparisons(auc_values_, exp, curve_key)
    plateau = baseline_plateau(table, exp, [m for m in key_metrics(metrics)
                                            if not is_extra_metric(m)])
    return TaskStats(table, metrics, final, steps, key, _comparisons(final, exp, key), auc,
                     plateau)


def _task_section(exp: Experiment, task: str, rows: Sequence[Row],
                  plots: dict[str, list[str]], floor: Sequence[str] = (),
                  components: Sequence[str] = (), stats: TaskStats | None = None) -> list[str]:
    """One task's section; ``stats`` when :func:`task_stats` was computed already."""
    st = stats if stats is not None else task_stats(exp, task, rows)
    lines = [f"## Task `{task}`", ""]
    if st is None:
        return [*lines, "No finished cell.", ""]
    metrics, final, steps, key = st.metrics, st.final, st.steps, st.key
    lines += [f"Evaluated steps: {', '.join(map(str, steps))}. Baseline: `{exp.baseline}`.", "",
              "### Final checkpoint: mean ± std over seeds (n seeds)", ""]
    lines.append("| variant | " + " | ".join(metrics) + " |")
    lines.append("|---" * (len(metrics) + 1) + "|")
    for variant in exp.variants:
        cells = []
        for m in metrics:
            mean, std, n = mean_std(list(final[m].get(variant, {}).values()))
            cells.append(f"{_fmt(mean)} ± {_fmt(std)} ({n})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", *floor, *([""] if floor else []), *_plateau_lines(st.plateau, exp)]
    lines += ["", "### Final checkpoint: paired difference against the baseline", "",
              "Lower is better for "
              + ", ".join(m for m in key if better_direction(m) == "lower")
              + "; higher for " + ", ".join(m for m in key if better_direction(m) == "higher")
              + ".",
              "", *_comparison_table(st.final_comparisons), "",
              *_power_lines(final, exp, key)]
    if len(steps) > 1:
        lines += ["### Area under the learning curve (trapezoid over steps / step range)", "",
                  *_comparison_table(st.auc_comparisons), ""]
    if "exact_match" in st.table and len(steps) > 1:
        lines += _threshold_lines(st.table["exact_match"], exp)
    lines += components
    for name in plots.get(task, []):
        lines += [f"![{name}](plots/{name})", ""]
    return lines


def _threshold_lines(em: dict[str, dict[int, dict[int, float]]], exp: Experiment) -> list[str]:
    lines = ["### Steps to reach an exact-match level (mean over the seeds that reached it)", "",
             "| variant | " + " | ".join(f"{t:.0%}" for t in THRESHOLDS) + " |",
             "|---" * (len(THRESHOLDS) + 1) + "|"]
    for variant in exp.variants:
        cells = []
        for thr in THRESHOLDS:
            reached = []
            for steps in em.get(variant, {}).values():
                s = sorted(steps)
                reached.append(steps_to_reach(s, [steps[k] for k in s], thr))
            hit = [x for x in reached if not math.isnan(x)]
            mean = _fmt(float(np.mean(hit))) if hit else "–"
            cells.append(f"{mean} ({len(hit)}/{len(reached)} seeds)")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def is_evidence(c: PairedComparison) -> bool:
    """The report's rule for a difference that counts as evidence: at least
    ``MIN_BOOTSTRAP_SEEDS`` paired seeds, paired-t p < 0.05, an interval excluding 0, and
    Wilcoxon p < 0.05, or, where the seeds are too few for that (5: its smallest p is
    2 / 2^5 = 0.0625), Wilcoxon at its smallest (every seed on the same side)."""
    if c.n < MIN_BOOTSTRAP_SEEDS or not c.p_ttest < ALPHA:
        return False
    if not (c.ci_low > 0.0 or c.ci_high < 0.0):
        return False
    least = wilcoxon_min_p(c.n)
    return c.p_wilcoxon < ALPHA or (least >= ALPHA and c.p_wilcoxon <= least * (1.0 + 1e-9))


def seeds_verdict(n: int) -> str:
    """What n paired seeds allow one to conclude (the verdict's conclusions line)."""
    if n < 1:
        return "no seed is shared by the baseline and a variant: nothing is paired."
    if n < 2:
        return ("1 seed: no paired statistics at all (no interval, no test, no power figure): "
                "each Δ is one seed's difference, as likely seed noise as an effect. Run 5 or "
                "more seeds (6 for the Wilcoxon test to be able to reach p < 0.05).")
    if n < MIN_BOOTSTRAP_SEEDS:
        return (f"{n} seeds: no difference can be called significant; treat every Δ as a "
                f"pilot. Wilcoxon cannot go below p = {wilcoxon_min_p(n):.3g}, the paired t "
                f"rests on a spread measured from {n} differences, and the intervals are "
                "paired-t ones, wide on purpose. Size the next grid from the power table.")
    if wilcoxon_min_p(n) >= ALPHA:
        return (f"{n} seeds: a difference with paired-t p < 0.05, an interval excluding 0 and "
                f"every seed on the same side (Wilcoxon p = {wilcoxon_min_p(n):.3g}, its "
                f"smallest with {n} seeds) is evidence; no other difference is.")
    return (f"{n} seeds: differences with p < 0.05 in both tests and an interval excluding 0 "
            "are evidence; the others are not (which is not evidence of no difference).")


def _floor_verdict(exp: Experiment, floor: TaskFloor | None,
                   st: TaskStats) -> tuple[str, bool | None]:
    """The verdict's floor sentence, and whether the baseline beats the floor (None: not
    compared)."""
    if floor is None:
        return ("Floor: the constant-answer floor is not computed (numeric tasks only; this "
                "task's answers are not numbers).", None)
    best, constant = floor.best_abs_error, floor.floor["median"]["constant"]
    values = [v for v in st.final.get("abs_error_mean", {}).get(exp.baseline, {}).values()
              if math.isfinite(v)]
    against = f"{_fmt(best)} for always answering the test median ({constant:g})"
    if not values:
        return (f"Floor: the baseline `{exp.baseline}` has no abs_error_mean (no finished cell, "
                f"or no answer that parses), so it cannot be set against the constant-answer "
                f"floor, {against}.", None)
    mean, below = float(np.mean(values)), sum(v < best for v in values)
    seeds = f"mean of {len(values)} seed{'s' if len(values) > 1 else ''}"
    # abs_error_mean is over the answers that parse, the floor over every reference: say so
    # when a share of the baseline's answers did not parse
    failures = [v for v in st.final.get("parse_failure_rate", {}).get(exp.baseline, {}).values()
                if math.isfinite(v)]
    unparsed = (f" Its abs_error_mean is over the answers that parse; "
                f"{float(np.mean(failures)):.0%} did not." if failures and np.mean(failures) > 0
                else "")
    if mean < best:
        return (f"Floor: the baseline `{exp.baseline}` beats the constant-answer floor: "
                f"abs_error_mean {_fmt(mean)} ({seeds}, {below} of {len(values)} below it) "
                f"against {against}.{unparsed}", True)
    return (f"Floor: the baseline `{exp.baseline}` does NOT beat the constant-answer floor: "
            f"abs_error_mean {_fmt(mean)} ({seeds}) against {against}. It has not learned "
            "the task, and differences between variants say nothing about the objectives."
            + unparsed, False)


def _plateau_verdict(exp: Experiment, plateau: Plateau | None) -> str:
    if plateau is None:
        return ("Plateau: not checked (one evaluated step); evaluate several checkpoints "
                "(`eval.checkpoints: all`) to see whether the baseline has stopped improving.")
    improving = plateau.improving()
    if improving:
        gains = ", ".join(f"{m} {'up from 0' if math.isinf(r) else f'{r:.0%} better'}"
                          for m, r in improving)
        return (f"Plateau: the baseline `{exp.baseline}` is still improving ({plateau.span}: "
                f"{gains}; mean over seeds): the variants are compared before it has stopped "
                "learning, and a longer schedule may change their order.")
    return (f"Plateau: no key metric of the baseline `{exp.baseline}` improved by more than "
            f"{PLATEAU_TOLERANCE:.0%} over {plateau.span} (mean over seeds); within one "
            "learning-rate schedule that does not prove a plateau (see the task's plateau "
            "check).")


def count_tests(st: TaskStats) -> int:
    """The p-values a task's tables hold: comparison rows with 2 or more paired seeds (final
    checkpoint and area under the curve, metrics x variants) x 2 (Wilcoxon, paired t)."""
    return 2 * sum(c.n >= 2 for _, _, c in (*st.final_comparisons, *st.auc_comparisons))


def _tests_verdict(st: TaskStats, n_max: int) -> list[str]:
    """The multiplicity line: how many p-values the task's tables hold, how many of them a
    grid with no true difference would put below 0.05, and which rows meet the rule."""
    tested = [c for _, _, c in (*st.final_comparisons, *st.auc_comparisons) if c.n >= 2]
    if not tested:
        return ["Tests: none run (a test needs 2 paired seeds)."]
    n_final = sum(c.n >= 2 for _, _, c in st.final_comparisons)
    rows = (f"{n_final} final-checkpoint rows + {len(tested) - n_final} area-under-curve rows"
            if st.auc_comparisons else f"{n_final} final-checkpoint rows")
    n_tests = count_tests(st)
    nominal = sum(p < ALPHA for c in tested for p in (c.p_wilcoxon, c.p_ttest))
    line = (f"Tests: {n_tests} ({rows}, each with a Wilcoxon and a paired-t p-value), run "
            f"without multiplicity correction: with no true difference anywhere, expect about "
            f"{n_tests * ALPHA:.2g} of them below 0.05 by chance; here "
            f"{nominal} {'is' if nominal == 1 else 'are'}.")
    if n_max < MIN_BOOTSTRAP_SEEDS:
        return [line + f" At {n_max} seeds none of them is evidence."]
    meeting = [(m, v, c) for m, v, c in st.final_comparisons if is_evidence(c)]
    meeting_auc = [(m, v, c) for m, v, c in st.auc_comparisons if is_evidence(c)]
    listed = [f"{m} {v} {_fmt(c.mean_diff)} [{_fmt(c.ci_low)}, {_fmt(c.ci_high)}]"
              for m, v, c in meeting] + [
              f"{m} {v} (area under the curve) {_fmt(c.mean_diff)} [{_fmt(c.ci_low)}, "
              f"{_fmt(c.ci_high)}]" for m, v, c in meeting_auc]
    total = len(meeting) + len(meeting_auc)
    return [line + f" Rows meeting the rule: {total} of {len(tested)}"
            + (f": {'; '.join(listed)}." if listed else ".")]


def _mauve_verdict(st: TaskStats) -> str | None:
    """A line when MAUVE cannot rank the variants: every variant's mean final MAUVE saturated
    (>= :data:`emdlm.metrics.MAUVE_SATURATED`) or every one at the floor (<=
    :data:`emdlm.metrics.MAUVE_FLOOR`); None otherwise or without MAUVE."""
    from emdlm.metrics import MAUVE_FLOOR, MAUVE_SATURATED

    per_variant = st.final.get("mauve", {})
    means = {v: float(np.mean(list(s.values()))) for v, s in per_variant.items() if s}
    if not means:
        return None
    shown = ", ".join(f"{v} {m:.3f}" for v, m in means.items())
    if all(m >= MAUVE_SATURATED for m in means.values()):
        return (f"MAUVE is saturated for every variant ({shown}; >= {MAUVE_SATURATED}): it cannot "
                "rank them here; more prompts (more k-means buckets) would be needed.")
    if all(m <= MAUVE_FLOOR for m in means.values()):
        return (f"MAUVE is at its floor for every variant ({shown}; <= {MAUVE_FLOOR}): it cannot "
                "rank them here (samples far from the references at this model size).")
    return None


def _has_value(values: dict[int, float]) -> bool:
    return any(math.isfinite(v) for v in values.values())


def _all_unparsed(st: TaskStats) -> int:
    """The number of cells when every cell of the task has parse_failure_rate 1 at its final
    checkpoint (no answer parsed anywhere), else 0."""
    rates = [v for per_seed in st.final.get("parse_failure_rate", {}).values()
             for v in per_seed.values()]
    return len(rates) if rates and all(v >= 1.0 for v in rates) else 0


def _empty_metrics_verdict(exp: Experiment, st: TaskStats) -> str | None:
    """A line naming the compared metrics that pair no seed (empty for every cell, e.g. no
    answer parsed, or with a value on one side only) and what the comparison uses instead;
    None when every compared metric pairs at least one seed."""
    unpaired = list(dict.fromkeys(m for m, _, c in st.final_comparisons if c.n == 0))
    if not unpaired:
        return None
    used = list(dict.fromkeys(m for m, _, c in st.final_comparisons if c.n > 0))
    parts = []
    empty = [m for m in unpaired
             if not any(_has_value(s) for s in st.final.get(m, {}).values())]
    if empty:
        n_cells = _all_unparsed(st)
        why = (f" (no answer parsed: parse_failure_rate 1 in all {n_cells} cells)"
               if n_cells else " (no finite value)")
        parts.append(f"{', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty for "
                     f"every cell{why}")
    one_sided = [m for m in unpaired if m not in empty]
    if one_sided:
        parts.append(f"{', '.join(one_sided)} {'has' if len(one_sided) == 1 else 'have'} no "
                     f"seed with a value for both the baseline `{exp.baseline}` and a variant")
    head = "Empty metrics: " + "; ".join(parts)
    if used:
        return (f"{head}: nothing can be concluded from {'it' if len(unpaired) == 1 else 'them'}; "
                f"the paired comparison below uses {', '.join(used)}.")
    return f"{head}: no compared metric pairs a seed, so nothing can be concluded."


def _shared_seeds(exp: Experiment, st: TaskStats) -> set[int]:
    """Seeds with a finished cell of the baseline and of some variant (any metric, values or
    not)."""
    shared: set[int] = set()
    for per_variant in st.final.values():
        base = set(per_variant.get(exp.baseline, {}))
        for variant, per_seed in per_variant.items():
            if variant != exp.baseline:
                shared |= base & set(per_seed)
    return shared


def verdict_lines(exp: Experiment, task: str, st: TaskStats | None,
                  floor: TaskFloor | None) -> list[str]:
    """One task's verdict: does the baseline beat the constant-answer floor, has it stopped
    improving, how many paired seeds, what they allow to conclude, and how many tests ran."""
    lines = [f"**Task `{task}`** (baseline `{exp.baseline}`):", ""]
    if st is None:
        return [*lines, "- No finished cell: nothing to conclude.", ""]
    floor_line, beaten = _floor_verdict(exp, floor, st)
    lines += [f"- {floor_line}", f"- {_plateau_verdict(exp, st.plateau)}"]
    mauve = _mauve_verdict(st)
    if mauve:
        lines.append(f"- {mauve}")
    if not st.final_comparisons:
        return [*lines, "- Paired seeds: none compared (no variant beside the baseline has "
                "results).", ""]
    empty = _empty_metrics_verdict(exp, st)
    if empty:
        lines.append(f"- {empty}")
    # a metric that pairs no seed (empty, or one-sided) is named above, not counted here
    ns = [c.n for _, _, c in st.final_comparisons if c.n > 0]
    if not ns:
        shared = _shared_seeds(exp, st)
        if not shared:
            return [*lines, f"- Conclusions: {seeds_verdict(0)}", ""]
        return [*lines, f"- Paired seeds: {len(shared)} shared by the baseline and a variant, "
                "but no compared metric has a value on both sides of any of them.",
                "- Conclusions: nothing can be concluded from this grid.", ""]
    n_min, n_max = min(ns), max(ns)
    count = (f"{n_min}" if n_min == n_max else
             f"{n_min}–{n_max} (per comparison; this verdict goes by the fewest)")
    lines += [f"- Paired seeds: {count}, the seeds the baseline and a variant share at the "
              "final checkpoint.", f"- Conclusions: {seeds_verdict(n_min)}"]
    tests = _tests_verdict(st, n_max)
    if beaten is False and n_max >= MIN_BOOTSTRAP_SEEDS:
        tests = [t + " The baseline is not past the floor, though: none of this is about "
                 "the objectives." for t in tests]
    lines += [f"- {t}" for t in tests]
    return [*lines, ""]


def _eval_data_note(cells: Sequence[Cell]) -> str:
    """Which data the metrics are on, e.g. "task arithmetic (dev)": a grid evaluated on the
    dev split must not read as a test result."""
    from emdlm.config import apply_overrides, build_config

    sources = sorted({
        build_config(apply_overrides(c.config, c.eval_overrides)).data.eval.describe()
        for c in cells
    })
    return f"Metric values are on {' / '.join(sources) or 'no evaluation data'} (data.eval)."


def _metrics_note(metrics: set[str]) -> str:
    """How to read the metrics present: numeric errors, and / or the text protocol's."""
    note = ""
    if "abs_error_mean" in metrics:
        note += (" Numeric errors come first, exact match after them. Absolute, log and relative "
                 "errors are over the answers that parse: read them with parse_failure_rate (the "
                 "±1% / ±5% shares count unparsed answers as misses).")
    if "mauve" in metrics or "ppl_test" in metrics:
        note += (" Text metrics (eval.kind=text): MAUVE of the sampled continuations against the "
                 "references, ppl_test of the references, ppl_oracle of the samples under the "
                 "oracle, ROUGE of each sample against its reference, distinct-n and rep-n of "
                 "the samples (docs/emo_protocol.md).")
    return note


def write_report(exp: Experiment, cells: Sequence[Cell], rows: Sequence[Row], path: Path,
                 *, command: str = "", plots: dict[str, list[str]] | None = None,
                 left_out: dict[str, str] | None = None) -> None:
    """report.md (written whole): header (command, grid, cost), one section per task, the
    cells left out (``left_out``: key -> reason, from :func:`read_grid`; found here when not
    given) and the failed cells."""
    if left_out is None:
        left_out = {c.key: p for c in cells
                    if (c.folder / CELL_DONE).exists() and (p := cell_problem(c)) is not None}
    done = [c for c in cells if c.key not in left_out and read_cell_record(c.folder) is not None]
    failed = [c for c in cells if (c.folder / ERROR_FILE).is_file()]
    records = [record for c in done if (record := read_cell_record(c.folder)) is not None]
    wall = sum(r.get("wall_s", 0.0) for r in records)
    unknown = sum(not r.get("wall_complete", not r.get("resumed")) for r in records)
    resumed_note = (f" {unknown} of them resumed an interrupted run whose time was not recorded: "
                    "their wall times count only the part after the resume, so the sum "
                    "under-counts." if unknown else "")
    lines = [f"# Experiment `{exp.name}`", ""]
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
    stats = {task: task_stats(exp, task, rows) for task in exp.tasks}
    floors = {task: task_floor(done, task) for task in exp.tasks}
    lines += ["## Verdict: what this grid can and cannot show", ""]
    for task in exp.tasks:
        lines += verdict_lines(exp, task, stats[task], floors[task])
    n_tests = sum(count_tests(st) for st in stats.values() if st is not None)
    if len(exp.tasks) > 1 and n_tests:
        lines += [f"Across the {len(exp.tasks)} tasks: {n_tests} tests, none corrected for the "
                  f"others: about {n_tests * ALPHA:.2g} below 0.05 by chance alone.", ""]
    lines += [
        "Read the task sections below for the numbers. The interval rule: "
        f"from {MIN_BOOTSTRAP_SEEDS} paired seeds on, a 95% percentile bootstrap over seeds; "
        "below that, a paired-t interval (docs/experiments.md).", ""]
    lines += [
        f"Variants: {', '.join(exp.variants)} (baseline `{exp.baseline}`); seeds: "
        f"{', '.join(map(str, exp.seeds))}; tasks: {', '.join(exp.tasks)}.",
        f"Cells finished: {len(done)}/{len(cells)}; failed: {len(failed)}"
        + (f"; left out, outputs not whole: {len(left_out)}" if left_out else "")
        + ". Sum of the finished "
        f"cells' wall times: {wall:.0f} s at {exp.threads_per_worker} thread(s) each "
        f"(CPU time ≈ {wall * exp.threads_per_worker:.0f} s).{resumed_note}",
        "",
        "The variants of one seed share the training data, its order and the initial weights: "
        "differences are paired by seed. " + _eval_data_note(cells)
        + _metrics_note({r.metric for r in rows}),
        "",
    ]
    for task in exp.tasks:
        lines += _task_section(
            exp, task, rows, plots or {}, _floor_lines(done, task, floors[task]),
            [*place_accuracy_lines(done, task, list(exp.variants), read_predictions),
             *component_lines(done, task, list(exp.variants))], stats[task])
    if left_out:
        lines += ["## Cells left out (outputs not whole)", "",
                  "Marked done, but an output is missing, cut off or disagrees with its "
                  "metrics.json, so none of their numbers are used. Run the same command again "
                  "to evaluate them again.", ""]
        lines += [f"- `{key}`: {why}" for key, why in left_out.items()]
        lines.append("")
    if failed:
        lines += ["## Failed cells", ""]
        for c in failed:
            last = (c.folder / ERROR_FILE).read_text().strip().splitlines()[-1:] or [""]
            lines.append(f"- `{c.key}`: {last[0]} (see `{c.folder / ERROR_FILE}`)")
        lines.append("")
    with atomic_write(path) as fh:
        fh.write("\n".join(lines))
