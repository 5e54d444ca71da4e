"""A grid's results as rows: what each finished cell's evaluations measured, read whole.

``results.csv`` holds one :class:`Row` per cell x evaluated step x metric (task, variant, seed,
step, metric, value). Besides what ``emdlm eval`` writes to metrics.json, numeric tasks get
metrics computed here from predictions.jsonl (:func:`numeric_extras`): the mean log error, the
shares of answers within +-1% and +-5%, magnitude and sign errors, digit accuracy.

Only whole outputs count: a cell is read when its ``cell_done.json`` parses and every one of
its evaluation folders has a metrics.json agreeing with the rows of its predictions.jsonl
(:func:`emdlm.experiments.cell_folder.cell_problem`, :func:`emdlm.eval_outputs.read_eval_outputs`).
A cell marked done whose outputs are not whole is left out and named with the file and the
reason (:attr:`GridRead.left_out`): no metric is computed from part of a file.

Also here: the metrics' report order, learning-curve tables, and how a
value is printed (:func:`fmt`).
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from emdlm._files import atomic_write
from emdlm.eval_outputs import EvalOutputError, read_eval_outputs
from emdlm.experiments.cell_folder import CELL_DONE, EVAL_DIR, cell_problem, read_cell_record
from emdlm.experiments.cell_record import refusal
from emdlm.experiments.digits import digit_accuracies, parsed_answers
from emdlm.experiments.grid import Cell
from emdlm.experiments.metric_names import METRIC_ORDER, base_metric, is_extra_metric
from emdlm.experiments.stats import (
    normalized_auc,
)

# the metrics compared pairwise in the report (the rest are in the mean +- std table and csv)
KEY_METRICS = ("abs_error_mean", "log10_error_mean", "within_5pct", "exact_match",
               "time_gap_mean_worst", "acc_iou50", "mean_iou", "acc_at_0.5", "f1",
               "mauve", "ppl_test", "ppl_oracle", "rougeL", "accuracy")
# settings and counts recorded in metrics.json, not outcomes: kept out of the report and csv
SKIP_METRICS = ("n", "n_predictions", "num_samples", "temperature", "top_p", "top_k",
                "max_new_tokens", "n_prompts", "n_samples", "mauve_num_buckets",
                "mauve_scaling_factor", "mauve_seed", "mauve_kmeans_num_redo",
                "mauve_kmeans_max_iter", "mauve_run_min", "mauve_run_max", "mbr_samples",
                "mbr_temperature", "mbr_top_p")
CSV_FIELDS = ("task", "variant", "seed", "step", "metric", "value")


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
    one line naming the file (a cut-off or torn output); and the cells whose folder holds work
    of another definition (:func:`emdlm.experiments.cell_record.refusal`): key -> what differs."""

    rows: list[Row] = field(default_factory=list)
    finished: list[Cell] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    #: cells counted as finished from an earlier run's results.csv
    #: (:func:`emdlm.experiments.earlier_rows.add_earlier_rows`), and the cells of that file
    #: read from their folders here instead
    earlier: list[str] = field(default_factory=list)
    earlier_passed_over: list[str] = field(default_factory=list)


def read_grid(cells: Iterable[Cell]) -> GridRead:
    """Read every finished cell whole (:func:`emdlm.experiments.cell_folder.cell_problem`, then
    :func:`cell_rows`); a cell marked done whose outputs are not whole goes to ``left_out``
    with its reason instead of into the statistics, a cell holding another definition's work
    to ``refused``. Unfinished cells are passed over."""
    out = GridRead()
    for cell in cells:
        refused = refusal(cell)
        if refused is not None:  # done or not: none of its numbers are this cell's
            out.refused[cell.key] = refused
            continue
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


def fmt(x: float) -> str:
    """A metric value as the report prints it: 4 significant digits, "–" for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.4g}"


def fmt_p(p: float) -> str:
    """A p-value as the report prints it: 3 significant digits, "–" for NaN."""
    return "–" if math.isnan(p) else f"{p:.3g}"


