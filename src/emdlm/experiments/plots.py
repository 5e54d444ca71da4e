"""PNG plots of an experiment (matplotlib, Agg backend: no display needed).

* ``<task>_curves.png``: learning curves of the key metrics, one line per variant (mean over
  seeds) with a band from the seeds' minimum to maximum.
* ``<task>_final.png``: the final models' key metrics, every seed a dot and the mean a bar, one
  panel per metric (extra evaluations included): the plot of a grid evaluated at one step.
* ``<task>_errors.png``: distribution of the numeric errors of the final models, pooled over
  seeds: CDF of |error| (symlog axis) and of log10(1 + |error|). Unparsed answers count in the
  denominator, so a curve's plateau below 1 is the share of answers that did not parse.

Each PNG is written whole (a temporary file renamed into place): a killed run never leaves a
truncated image for report.md to link.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from emdlm._files import atomic_write
from emdlm.eval_outputs import EvalOutputError, read_eval_outputs
from emdlm.experiments.cell_folder import EVAL_DIR, cell_problem
from emdlm.experiments.grid import Cell
from emdlm.experiments.metric_names import is_extra_metric
from emdlm.experiments.results import Row, curves, key_metrics, ordered_metrics


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    """``fig`` as a PNG at ``path``, written whole (temporary file renamed into place), then
    closed."""
    with atomic_write(path, binary=True) as fh:
        fig.savefig(fh, format="png", dpi=110)
    _pyplot().close(fig)


#: Metrics whose curves are drawn on a symmetric-log axis: absolute errors span decades.
LOG_SCALE_METRICS = ("abs_error_mean", "abs_error_median")


def variant_styles(n: int) -> list[tuple[Any, str]]:
    """(colour, line style) of each of ``n`` variants, no two alike: matplotlib's "tab10"
    colours up to 10 variants, "tab20" up to 20, then "tab20" again with dashed, dotted and
    dash-dot lines (a grid of 16 learning-rate variants would repeat the 10-colour cycle)."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if n <= 10 else "tab20"].colors
    styles = ("-", "--", ":", "-.")
    return [(palette[i % len(palette)], styles[(i // len(palette)) % len(styles)])
            for i in range(n)]


def _panels(plt: Any, n: int, *, columns: int, width: float, height: float,
            layout: str | None = None) -> tuple[Any, list]:
    """A figure of ``n`` panels at most ``columns`` a row (one long row shrank every panel to
    unreadable on a page), each ``width`` x ``height`` inches; the unused panels removed.
    ``layout``: matplotlib's layout engine ("constrained" makes room for a figure legend)."""
    cols = min(n, columns)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             layout=layout)
    axes = [ax for row in grid for ax in row]
    for ax in axes[n:]:
        ax.remove()
    return fig, axes[:n]


def plot_learning_curves(rows: Sequence[Row], task: str, variants: Sequence[str],
                         path: Path, title: str | None = None) -> bool:
    """Mean over seeds and min-max band per variant for each key metric; False if no data or
    a single evaluated step (no curve to draw)."""
    fig = learning_curves_figure(rows, task, variants, title)
    if fig is None:
        return False
    _save(fig, path)
    return True


def learning_curves_figure(rows: Sequence[Row], task: str, variants: Sequence[str],
                           title: str | None = None) -> Any:
    """The figure of :func:`plot_learning_curves` (None where it draws nothing): one panel per
    metric, the variants' legend below the panels, where it covers no curve and no title."""
    if len({r.step for r in rows if r.task == task}) < 2:
        return None
    table = curves(rows, task)
    metrics = ([m for m in key_metrics(table) if not is_extra_metric(m)]
               or ordered_metrics(table)[:4])
    if not metrics:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, len(metrics), columns=2, width=5.6, height=3.8, layout="constrained")
    legend: dict[str, Any] = {}  # label -> line, across panels (a variant may lack a metric)
    styles = dict(zip(variants, variant_styles(len(variants)), strict=True))
    for ax, metric in zip(axes, metrics, strict=False):
        for variant in variants:
            by_seed = table[metric].get(variant)
            if not by_seed:
                continue
            steps = sorted({s for seed_steps in by_seed.values() for s in seed_steps})
            # [seeds, steps] with NaN where a seed lacks a step
            grid = np.array([[seed_steps.get(s, np.nan) for s in steps]
                             for seed_steps in by_seed.values()], dtype=np.float64)
            with warnings.catch_warnings():  # a step no seed of this variant reached: NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(grid, axis=0)
                lo, hi = np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)
            label = f"{variant} (n={len(by_seed)})"
            color, style = styles[variant]
            line = ax.plot(steps, mean, marker="o", ms=3, label=label, color=color,
                           linestyle=style)
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
            legend.setdefault(label, line[0])
        ax.set_title(metric)
        ax.set_xlabel("step")
        if metric in LOG_SCALE_METRICS:  # one diverged seed would flatten every other curve
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_title(f"{metric} (symlog)")
        ax.grid(alpha=0.3)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center",
               ncol=min(len(legend), 4) or 1, fontsize=8, frameon=False)
    fig.suptitle(f"{title or task}: mean over seeds, band = min–max")
    return fig


def plot_final_values(rows: Sequence[Row], task: str, variants: Sequence[str],
                      path: Path, title: str | None = None) -> bool:
    """Per key metric: each variant's final value per seed (dots) and their mean (bar, with
    the value written on it); False if no data."""
    table = curves(rows, task)
    metrics = key_metrics(table) or ordered_metrics(table)[:4]
    if not metrics:
        return False
    plt = _pyplot()
    fig, axes = _panels(plt, len(metrics), columns=3, width=4.0, height=3.6)
    colors = [color for color, _ in variant_styles(len(variants))]
    for ax, metric in zip(axes, metrics, strict=False):
        for x, variant in enumerate(variants):
            by_seed = table[metric].get(variant, {})
            values = [seed_steps[max(seed_steps)] for seed_steps in by_seed.values()]
            values = [v for v in values if np.isfinite(v)]
            if not values:
                continue
            mean = float(np.mean(values))
            ax.bar(x, mean, color=colors[x], alpha=0.35, width=0.6)
            ax.scatter([x] * len(values), values, color=[colors[x]], s=14, zorder=3)
            ax.annotate(f"{mean:.3g}", (x, mean), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(variants)), list(variants), rotation=45, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title or task}: final models, dots = seeds, bars = mean")
    fig.tight_layout()
    _save(fig, path)
    return True


def final_errors(cell: Cell) -> tuple[np.ndarray, int] | None:
    """(|error| of the parsed answers, number of answers) of a cell's final model; None for a
    cell that is not finished or whose outputs are not whole (never a partial file's rows)."""
    if cell_problem(cell) is not None:
        return None
    steps = sorted(
        (int(p.name.split("-")[-1]), p) for p in (cell.folder / EVAL_DIR).glob("step-*")
    )
    if not steps:
        return None
    try:
        preds = read_eval_outputs(steps[-1][1])[1]
    except EvalOutputError:
        return None
    if not preds or "abs_error" not in preds[0]:
        return None
    err = np.array([r["abs_error"] for r in preds if r["abs_error"] is not None],
                   dtype=np.float64)
    return err, len(preds)


def plot_error_distribution(cells: Sequence[Cell], task: str, variants: Sequence[str],
                            path: Path, title: str | None = None) -> bool:
    """CDFs of |error| and log10(1+|error|) per variant (final models, seeds pooled)."""
    pooled: dict[str, tuple[list[np.ndarray], int]] = {}
    for cell in cells:
        if cell.task != task:
            continue
        got = final_errors(cell)
        if got is None:
            continue
        errs, n = pooled.get(cell.variant, ([], 0))
        pooled[cell.variant] = ([*errs, got[0]], n + got[1])
    if not pooled:
        return False
    plt = _pyplot()
    fig, (ax_abs, ax_log) = plt.subplots(1, 2, figsize=(9, 3.6))
    for variant in variants:
        if variant not in pooled:
            continue
        parts, total = pooled[variant]
        err = np.sort(np.concatenate(parts))
        share = np.arange(1, err.size + 1) / max(total, 1)  # unparsed answers: never reached
        label = f"{variant} ({total - err.size} unparsed / {total})"
        ax_abs.step(err, share, where="post", label=label)
        ax_log.step(np.log10(1.0 + err), share, where="post", label=label)
    ax_abs.set_xscale("symlog", linthresh=1.0)
    ax_abs.set_xlabel("|error|")
    ax_log.set_xlabel("log10(1 + |error|)")
    for ax in (ax_abs, ax_log):
        ax.set_ylabel("share of answers ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    ax_abs.legend(fontsize=8)
    fig.suptitle(f"{title or task}: numeric errors of the final models, seeds pooled")
    fig.tight_layout()
    _save(fig, path)
    return True


def make_plots(cells: Sequence[Cell], rows: Sequence[Row], tasks: Sequence[str],
               variants: Sequence[str], folder: Path,
               titles: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Write every plot into ``folder``; returns task -> file names written. ``titles``: how a
    plot names each task (default: the task; files are always named after the task)."""
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[str]] = {}
    for task in tasks:
        names = []
        title = (titles or {}).get(task, task)
        if plot_learning_curves(rows, task, variants, folder / f"{task}_curves.png", title):
            names.append(f"{task}_curves.png")
        elif plot_final_values(rows, task, variants, folder / f"{task}_final.png", title):
            names.append(f"{task}_final.png")  # one evaluated step: no curve to draw
        if plot_error_distribution(cells, task, variants, folder / f"{task}_errors.png", title):
            names.append(f"{task}_errors.png")
        written[task] = names
    return written
