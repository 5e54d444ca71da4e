"""Aggregate a finished (or partly finished) grid into ``results.csv`` and ``report.md``.

``results.csv``: one row per cell x evaluated step x metric (task, variant, seed, step,
metric, value). Besides what ``emdlm eval`` writes to metrics.json, numeric tasks get metrics
computed here from predictions.jsonl (:func:`numeric_extras`): the mean log error and the
shares of answers within +-1% and +-5%.

``report.md``: per task, the final checkpoint's mean +- std over seeds of every metric
(numeric-error metrics first, exact match after them: it swings between seeds far more than
objectives differ), the paired difference of each variant against the baseline (95% bootstrap
CI, Wilcoxon signed-rank and paired-t p-values, number of seeds, a note when there are too
few seeds to reach significance), power planning figures from the seeds' spread (seeds
needed, smallest detectable difference), the same for the area under the learning curve, the steps
to reach 50% / 90% exact match, the training-loss components early / middle / late
(:mod:`emdlm.experiments.components`), and the plots.

Only whole outputs count: a cell is read when its ``cell_done.json`` parses and every one of
its evaluation folders has a metrics.json agreeing with the rows of its predictions.jsonl
(:func:`emdlm.experiments.runner.cell_problem`, :func:`emdlm.evaluation.read_eval_outputs`).
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
from emdlm.evaluation import EvalOutputError, read_eval_outputs, read_predictions
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
    POWER,
    compare_paired,
    detectable_difference,
    mean_std,
    normalized_auc,
    paired_differences,
    seeds_for_power,
    steps_to_reach,
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
    ("hour_accuracy", "higher"),
    ("minute_accuracy", "higher"),
    ("acc_iou50", "higher"),
    ("mean_iou", "higher"),
    ("f1", "higher"),
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
               "time_gap_mean_worst", "acc_iou50", "mean_iou", "f1",
               "mauve", "ppl_test", "ppl_oracle", "rougeL", "accuracy")
# settings and counts recorded in metrics.json, not outcomes: kept out of the report and csv
SKIP_METRICS = ("n", "n_predictions", "num_samples", "temperature", "top_p", "top_k",
                "max_new_tokens", "n_prompts", "n_samples", "mauve_num_buckets",
                "mauve_scaling_factor", "mauve_seed", "mauve_kmeans_num_redo",
                "mauve_kmeans_max_iter")
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
    which hand a model reads when exact match is low. Empty dict for other tasks."""
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


def _floor_lines(cells: Sequence[Cell], task: str) -> list[str]:
    """The constant-answer floor on the task's test set (from one finished cell's last
    predictions; every cell of a task is scored on the same test set)."""
    for cell in cells:
        if cell.task != task or not (cell.folder / CELL_DONE).is_file():
            continue
        path = final_predictions(cell.folder)
        if path is None:
            continue
        preds = read_predictions(path)
        if not preds or "abs_error" not in preds[0]:
            return []
        floor = constant_answer_floor([r["reference"] for r in preds])
        if not floor:
            return []
        zero, median = (
            f"abs_error_mean {_fmt(c['abs_error_mean'])}, median {_fmt(c['abs_error_median'])}, "
            f"log10_error_mean {_fmt(c['log10_error_mean'])}, exact_match "
            f"{_fmt(c['exact_match'])}" for c in (floor["0"], floor["median"]))
        distinct = len({r.get("prompt") for r in preds}) if "prompt" in preds[0] else None
        count = f"{len(preds)}" + (f" ({distinct} distinct)" if distinct is not None else "")
        return [f"Floor, the same {count} test problems answered with one constant: "
                f"0 gives {zero}; the test median ({floor['median']['constant']:g}, the best "
                f"constant for abs_error_mean) gives {median}. A variant that does not beat "
                "them has not learned the task."]
    return []


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan  # written as null by write_eval_outputs (NaN / inf)
    return float(value)


def cell_rows(cell: Cell) -> list[Row]:
    """Every (step, metric) of a finished cell; nothing for an unfinished one (no readable
    ``cell_done.json``). EvalOutputError, naming the file, for an evaluation folder that is
    not whole (:func:`emdlm.evaluation.read_eval_outputs`): never a metric from part of it."""
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
            metrics.update(clock_extras(preds))
            for name, value in metrics.items():
                if name in SKIP_METRICS or isinstance(value, (str, list, dict)):
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
    """"lower" / "higher" for a known metric (extra evaluations' too), else None."""
    return dict(METRIC_ORDER).get(base_metric(name))


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


def _comparison_table(per_variant: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                      metrics: Sequence[str]) -> list[str]:
    """Markdown rows: variant - baseline per metric with CI, p-values, n and note."""
    lines = ["| metric | variant | mean diff (variant − baseline) | 95% bootstrap CI | "
             "p Wilcoxon | p paired t | seeds | note |", "|---|---|---|---|---|---|---|---|"]
    for metric, variant, base, other in _paired_values(per_variant, exp, metrics):
        c = compare_paired(base, other)
        lines.append(
            f"| {metric} | {variant} | {_fmt(c.mean_diff)} | [{_fmt(c.ci_low)}, "
            f"{_fmt(c.ci_high)}] | {_fmt_p(c.p_wilcoxon)} | {_fmt_p(c.p_ttest)} | {c.n} | "
            f"{c.note} |"
        )
    return lines


def _power_lines(final: dict[str, dict[str, dict[int, float]]], exp: Experiment,
                 metrics: Sequence[str]) -> list[str]:
    """Planning figures from the seeds' spread: per metric and variant, the standard deviation
    of the paired differences, the smallest true difference these seeds detect with 80 % power,
    and the seeds needed for 80 % power if the true difference were the observed one."""
    rows = []
    header = ["### Power of the final comparison (planning figures for the next grid)", "",
              f"Paired t test, two-sided, alpha 0.05, power {POWER:.0%}, with the standard "
              "deviation of these seeds' paired differences. These size a future grid; they are "
              "not evidence of an effect (a small observed difference needs many seeds).", "",
              "| metric | variant | seeds | sd of differences | smallest detectable difference "
              "| seeds for the observed difference |", "|---|---|---|---|---|---|"]
    for metric, variant, base, other in _paired_values(final, exp, metrics):
        d = paired_differences(base, other)
        if d.size < 2:
            continue
        sd = float(d.std(ddof=1))
        need = seeds_for_power(float(d.mean()), sd)
        rows.append(f"| {metric} | {variant} | {d.size} | {_fmt(sd)} | "
                    f"{_fmt(detectable_difference(int(d.size), sd))} | "
                    f"{need if need is not None else '> 10000'} |")
    return [*header, *rows, ""] if rows else []


WITHIN_SCHEDULE_CAVEAT = (
    "Both steps lie in one learning-rate schedule, and a decaying one (cosine, linear) flattens "
    "the curve at its end whether or not the model has more to learn; the plateau test is a "
    "longer schedule, paired by seed (`base.train.max_steps=<2x>` into a new folder; "
    "docs/experiments.md).")


def _plateau_lines(table: Table, exp: Experiment, metrics: Sequence[str]) -> list[str]:
    """Has the baseline stopped improving? Its key metrics (mean over the seeds evaluated at
    both steps) at the last two evaluated steps and the relative change between them."""
    parts, span = [], ""
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
        change = f" ({(b - a) / abs(a):+.1%})" if a != 0 else ""
        parts.append(f"{metric} {_fmt(a)} → {_fmt(b)}{change}")
        span = span or f"steps {before} → {last}"
    if not parts:
        return []
    return [f"Plateau check, baseline `{exp.baseline}` (mean over seeds), {span}: "
            + "; ".join(parts) + ". " + WITHIN_SCHEDULE_CAVEAT]


def _task_section(exp: Experiment, task: str, rows: Sequence[Row],
                  plots: dict[str, list[str]], floor: Sequence[str] = (),
                  components: Sequence[str] = ()) -> list[str]:
    table = curves(rows, task)
    metrics = ordered_metrics(table)
    lines = [f"## Task `{task}`", ""]
    if not metrics:
        return [*lines, "No finished cell.", ""]
    final = {m: {v: final_values(table[m][v]) for v in table[m]} for m in metrics}
    steps = sorted({r.step for r in rows if r.task == task})
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
    lines += ["", *floor, *([""] if floor else []), *_plateau_lines(
        table, exp, [m for m in key_metrics(metrics) if not is_extra_metric(m)])]
    key = key_metrics(metrics) or metrics[:4]
    lines += ["", "### Final checkpoint: paired difference against the baseline", "",
              "Lower is better for "
              + ", ".join(m for m in key if better_direction(m) == "lower")
              + "; higher for " + ", ".join(m for m in key if better_direction(m) == "higher")
              + ".",
              "", *_comparison_table(final, exp, key), "",
              *_power_lines(final, exp, key)]
    if len(steps) > 1:
        curve_key = [m for m in key if not is_extra_metric(m)]  # extras: final model only
        auc = {m: {v: auc_values(table[m][v]) for v in table[m]} for m in curve_key}
        lines += ["### Area under the learning curve (trapezoid over steps / step range)", "",
                  *_comparison_table(auc, exp, curve_key), ""]
    if "exact_match" in table and len(steps) > 1:
        lines += _threshold_lines(table["exact_match"], exp)
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
            exp, task, rows, plots or {}, _floor_lines(done, task),
            [*place_accuracy_lines(done, task, list(exp.variants), read_predictions),
             *component_lines(done, task, list(exp.variants))])
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
