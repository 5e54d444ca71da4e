"""Print the tables of docs/results/number_losses.md from a results.csv of the runner.

Usage (from the repository root):

    .venv/bin/python docs/results/number_losses/tables.py \
        docs/results/number_losses/results.csv char [--curves OUT.png]

Prints, for one task at its final checkpoint: the headline table (mean ± sample std over seeds,
the best mean of each column in bold), the paired differences against CE at the same learning
rate and against the CE learning-rate control (the runner's own test,
``emdlm.experiments.stats.compare_paired``: 95 % percentile bootstrap over seeds, 10,000
resamples, seed 0, and the paired-t p-value; bold when p < 0.05 and the interval excludes 0,
with how many seeds lie on the difference's side), and the per-seed mean absolute error.
Only seeds every variant of the task finished are used (the comparison is paired).

``--curves OUT.png`` also draws the runner's learning-curve plot
(``emdlm.experiments.plots.plot_learning_curves``: mean over seeds, min-max band) from the CSV,
for a grid whose cells ran on different machines, so no one runner saw them all.
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from emdlm.experiments.plots import plot_learning_curves
from emdlm.experiments.results import Row
from emdlm.experiments.stats import compare_paired

VARIANTS = {
    "ce": "CE (lr 2e-3)",
    "ce_ntl_was": "CE + 0.3·NTL-WAS",
    "ce_ntl_mse": "CE + 0.3·NTL-MSE",
    "ntil": "NTIL (paper)",
    "ce_lr1e-3": "CE, lr 1e-3",
}
# metric, column title, decimals, higher is better
HEADLINE = [
    ("abs_error_mean", "mean abs error", 0, False),
    ("abs_error_median", "median abs error", 0, False),
    ("log10_error_mean", "log10 error", 3, False),
    ("within_5pct", "within ±5 %", 3, True),
    ("digit_accuracy", "digit accuracy", 3, True),
    ("exact_match", "exact match", 4, True),
]
PAIRED = [
    ("abs_error_mean", "Δ mean abs error", 0, False),
    ("log10_error_mean", "Δ log10 error", 3, False),
    ("within_5pct", "Δ within ±5 %", 3, True),
    ("digit_accuracy", "Δ digit accuracy", 3, True),
]


def read_rows(path: str, task: str) -> list[Row]:
    """The task's rows of a runner's results.csv (columns task, variant, seed, step, metric,
    value)."""
    with open(path, newline="") as f:
        rows = [Row(r["task"], r["variant"], int(r["seed"]), int(r["step"]), r["metric"],
                    float(r["value"])) for r in csv.DictReader(f) if r["task"] == task]
    if not rows:
        raise SystemExit(f"no rows for task {task!r} in {path}")
    return rows


def load(rows: list[Row]) -> tuple[dict[tuple[str, str], dict[int, float]], int, list[int]]:
    """Values at the final step as {(variant, metric): {seed: value}}, the step and the seeds
    every variant has."""
    step = max(r.step for r in rows)
    values: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.step == step:
            values[(r.variant, r.metric)][r.seed] = r.value
    seed_sets = [set(values[(v, "abs_error_mean")]) for v in VARIANTS]
    seeds = sorted(set.intersection(*seed_sets))
    return values, step, seeds


def fmt(x: float, decimals: int, signed: bool = False) -> str:
    text = f"{x:+.{decimals}f}" if signed else f"{x:.{decimals}f}"
    return text.replace("-", "−")


def headline(values, seeds) -> list[str]:
    stats = {
        (v, m): (float(np.mean(a)), float(np.std(a, ddof=1)))
        for v in VARIANTS for m, *_ in HEADLINE
        for a in [[values[(v, m)][s] for s in seeds]]
    }
    best = {m: (max if hi else min)(VARIANTS, key=lambda v, m=m: stats[(v, m)][0])
            for m, _, _, hi in HEADLINE}
    out = ["| variant | " + " | ".join(t for _, t, _, _ in HEADLINE) + " |",
           "|---|" + "---:|" * len(HEADLINE)]
    for v, name in VARIANTS.items():
        cells = []
        for m, _, d, _ in HEADLINE:
            mean, sd = stats[(v, m)]
            text = f"{fmt(mean, d)} ± {fmt(sd, d)}"
            cells.append(f"**{text}**" if best[m] == v else text)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def paired(values, seeds, reference: str) -> list[str]:
    out = ["| variant | " + " | ".join(t for _, t, _, _ in PAIRED) + " |",
           "|---|" + "---|" * len(PAIRED)]
    for v, name in VARIANTS.items():
        if v in {reference, "ce"}:  # against the control, CE itself is the first table's row
            continue
        cells = []
        for m, _, d, hi in PAIRED:
            base = [values[(reference, m)][s] for s in seeds]
            var = [values[(v, m)][s] for s in seeds]
            c = compare_paired(base, var)
            dd = 0 if d == 0 else max(d, 3)
            text = (f"{fmt(c.mean_diff, dd, signed=True)} [{fmt(c.ci_low, dd)}, "
                    f"{fmt(c.ci_high, dd)}], p = {c.p_ttest:#.2g}")
            if c.p_ttest < 0.05 and (c.ci_low > 0 or c.ci_high < 0):
                diffs = np.asarray(var) - np.asarray(base)
                same_side = int(np.sum(np.sign(diffs) == np.sign(c.mean_diff)))
                better = (c.mean_diff > 0) == hi
                text = f"**{text}, {same_side}/{len(seeds)} {'better' if better else 'worse'}**"
            cells.append(text)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def main(rows: list[Row], task: str) -> None:
    values, step, seeds = load(rows)
    print(f"Task {task}, step {step}, paired seeds {seeds}\n")
    print("\n".join(headline(values, seeds)) + "\n")
    print("Against CE at the same learning rate:\n")
    print("\n".join(paired(values, seeds, "ce")) + "\n")
    print("Against the CE learning-rate control (lr 1e-3):\n")
    print("\n".join(paired(values, seeds, "ce_lr1e-3")) + "\n")
    per_seed = "; ".join(
        f"{name} " + " / ".join(
            "nan" if math.isnan(x := values[(v, "abs_error_mean")][s]) else f"{x:.0f}"
            for s in seeds)
        for v, name in VARIANTS.items())
    print(f"Per seed, mean abs error at step {step} (seeds {seeds}): {per_seed}")


def curves(rows: list[Row], task: str, out: Path) -> None:
    """The runner's learning-curve PNG of ``task`` from the CSV's rows."""
    if not plot_learning_curves(rows, task, list(VARIANTS), out):
        raise SystemExit(f"no curve to draw for task {task!r}")
    print(f"written: {out}")


if __name__ == "__main__":
    args = sys.argv[1:]
    out = None
    if "--curves" in args:
        i = args.index("--curves")
        if i + 1 >= len(args):
            raise SystemExit(__doc__)
        out = Path(args.pop(i + 1))
        args.pop(i)
    if len(args) != 2:
        raise SystemExit(__doc__)
    csv_path, task_name = args
    task_rows = read_rows(csv_path, task_name)
    main(task_rows, task_name)
    if out is not None:
        curves(task_rows, task_name, out)
