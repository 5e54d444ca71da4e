"""Write a finished (or partly finished) grid's ``report.md``.

Before the tasks, a verdict per task (:mod:`emdlm.experiments.verdict`): does the baseline beat
the constant-answer floor, has it stopped improving, how many paired seeds, what they allow one
to conclude, and how many tests ran. Then per task: the final checkpoint's mean +- std over
seeds of every metric (numeric-error metrics first, exact match after them: it swings between
seeds far more than objectives differ), the paired difference of each variant against the
baseline (95% interval: percentile bootstrap from 5 paired seeds on, paired t below; Wilcoxon
signed-rank and paired-t p-values, number of seeds, a note when there are too few seeds to
reach significance), power planning figures from the seeds' spread (seeds needed, from 3 seeds
on; smallest detectable difference), the same for the area under the learning curve, the steps
to reach 50% / 90% exact match, place-value digit accuracy, the training-loss components early /
middle / late (:mod:`emdlm.experiments.components`), and the plots.

The numbers come from :mod:`emdlm.experiments.results` (rows of whole outputs only),
:mod:`emdlm.experiments.task_stats` (paired comparisons, plateau) and
:mod:`emdlm.experiments.floor` (the constant-answer floor); this module only lays them out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from emdlm._files import atomic_write
from emdlm.eval_outputs import read_predictions
from emdlm.experiments.cell_folder import CELL_DONE, ERROR_FILE, cell_problem, read_cell_record
from emdlm.experiments.cell_record import refusal
from emdlm.experiments.components import component_lines
from emdlm.experiments.digits import place_accuracy_lines
from emdlm.experiments.floor import TaskFloor, task_floor
from emdlm.experiments.grid import DEFAULT_TASK, Cell, Experiment, task_title
from emdlm.experiments.metric_names import better_direction
from emdlm.experiments.results import Row, fmt, fmt_p
from emdlm.experiments.selection import SelectionRule, pick_group
from emdlm.experiments.stats import (
    ALPHA,
    MIN_BOOTSTRAP_SEEDS,
    POWER,
    detectable_difference,
    holm_adjust,
    mean_std,
    paired_differences,
    seeds_for_power,
    steps_to_reach,
)
from emdlm.experiments.task_stats import Comparison, Plateau, TaskStats, paired_values, task_stats
from emdlm.experiments.verdict import bottom_line, count_tests, verdict_lines

THRESHOLDS = (0.5, 0.9)


def _floor_lines(cells: Sequence[Cell], task: str, floor: TaskFloor | None = None) -> list[str]:
    """The constant-answer floor's line of the task section (:func:`task_floor`; pass
    ``floor`` when it is computed already)."""
    info = floor if floor is not None else task_floor(cells, task)
    if info is None:
        return []
    zero, median = (
        f"abs_error_mean {fmt(c['abs_error_mean'])}, median {fmt(c['abs_error_median'])}, "
        f"log10_error_mean {fmt(c['log10_error_mean'])}, exact_match "
        f"{fmt(c['exact_match'])}" for c in (info.floor["0"], info.floor["median"]))
    count = f"{info.count}" + (f" ({info.distinct} distinct)" if info.distinct is not None
                               else "")
    return [f"Floor, the same {count} test problems answered with one constant: "
            f"0 gives {zero}; the test median ({info.floor['median']['constant']:g}, the best "
            f"constant for abs_error_mean) gives {median}. A variant that does not beat "
            "them has not learned the task."]


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


def _holm_by_metric(comparisons: Sequence[Comparison]) -> list[float]:
    """Each row's paired-t p-value Holm-adjusted over the rows of its metric (the variants
    compared with the baseline on that metric: :func:`emdlm.experiments.stats.holm_adjust`)."""
    adjusted = [math.nan] * len(comparisons)
    by_metric: dict[str, list[int]] = {}
    for i, (metric, _, _) in enumerate(comparisons):
        by_metric.setdefault(metric, []).append(i)
    for rows in by_metric.values():
        for i, p in zip(rows, holm_adjust([comparisons[i][2].p_ttest for i in rows]), strict=True):
            adjusted[i] = p
    return adjusted


HOLM_NOTE = (
    "p t Holm: the paired-t p-value Holm-adjusted over the variants compared on the same "
    "metric (one family per metric and table; the other metrics are not in the family).")


def _comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """Markdown rows: variant - baseline per metric with CI, p-values (the paired t also
    Holm-adjusted within its metric), n and note; then a note when an interval is a paired-t
    one (:func:`emdlm.experiments.stats.compare_paired`)."""
    header, mark = _ci_header(comparisons)
    lines = [f"| metric | variant | mean diff (variant − baseline) | {header} | "
             "p Wilcoxon | p paired t | p t Holm | seeds | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (metric, variant, c), p_holm in zip(comparisons, _holm_by_metric(comparisons),
                                             strict=True):
        kind = " (t)" if mark and c.ci_kind == "t" and c.n >= 2 else ""
        lines.append(
            f"| {metric} | {variant} | {fmt(c.mean_diff)} | [{fmt(c.ci_low)}, "
            f"{fmt(c.ci_high)}]{kind} | {fmt_p(c.p_wilcoxon)} | {fmt_p(c.p_ttest)} | "
            f"{fmt_p(p_holm)} | {c.n} | {c.note} |"
        )
    lines += ["", HOLM_NOTE]
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
    for metric, variant, base, other in paired_values(final, exp, metrics):
        d = paired_differences(base, other)
        if d.size < 2:
            continue
        sd = float(d.std(ddof=1))
        if d.size < MIN_POWER_SEEDS:
            few, need_text = True, f"not estimated from {d.size} seeds"
        else:
            need = seeds_for_power(float(d.mean()), sd)
            need_text = f"{need if need is not None else '> 10000'}"
        rows.append(f"| {metric} | {variant} | {d.size} | {fmt(sd)} | "
                    f"{fmt(detectable_difference(int(d.size), sd))} | {need_text} |")
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


def _plateau_lines(plateau: Plateau | None, exp: Experiment) -> list[str]:
    """The task section's plateau-check line (:func:`baseline_plateau`)."""
    if plateau is None:
        return []
    parts = []
    for metric, a, b in plateau.changes:
        change = f" ({(b - a) / abs(a):+.1%})" if a != 0 else ""
        parts.append(f"{metric} {fmt(a)} → {fmt(b)}{change}")
    return [f"Plateau check, baseline `{exp.baseline}` (mean over seeds), {plateau.span}: "
            + "; ".join(parts) + ". " + WITHIN_SCHEDULE_CAVEAT]


def _selection_lines(rule: SelectionRule, final: dict[str, dict[int, float]],
                     seeds: list[int], task: str, variants: dict[str, list[str]]) -> list[str]:
    """The "Selection" subsection of a task (:mod:`emdlm.experiments.selection`): a row per
    group with every variant's mean over the seeds (the pick in bold), the pick, and whether
    it is an edge of the sweep; "not yet" while a cell of the group is unfinished. Then the
    decided picks as a test grid's ``task_variants`` entry (group name -> the picked variant's
    overrides, ``variants``), to copy rather than retype."""
    picked: dict[str, str] = {}
    lines = [f"### Selection by the config's rule: the {rule.better} mean `{rule.metric}` at "
             f"the final checkpoint over seeds {', '.join(map(str, seeds))}", "",
             "| group | mean per variant, in sweep order | pick |", "|---|---|---|"]
    for group, members in rule.groups.items():
        res = pick_group(rule, group, final, seeds)
        shown = []
        for v in members:
            if v not in res.means:
                shown.append(f"{v} ({res.seeds[v]}/{len(seeds)} seeds)")
                continue
            text = f"{v} {fmt(res.means[v])}"
            shown.append(f"**{text}**" if v == res.pick else text)
        if res.pick is not None:
            picked[group] = res.pick
            verdict = f"`{res.pick}`" + (" (edge of the sweep)" if res.edge else "")
        elif res.missing:
            verdict = f"not yet: {res.missing} cell(s) unfinished"
        else:
            verdict = "none: every mean is NaN"
        lines.append(f"| {group} | " + "; ".join(shown) + f" | {verdict} |")
    lines.append("")
    if picked:
        undecided = [g for g in rule.groups if g not in picked]
        lines += ["The picks as a test grid's `task_variants` entry (each group as a variant "
                  "of that name, with the picked variant's overrides)"
                  + (f"; not yet decided: {', '.join(undecided)}" if undecided else "") + ":",
                  "", "```yaml", "task_variants:", f"  {task}:"]
        lines += [f"    {group}: {json.dumps(variants[pick])}  # {pick}"  # valid YAML too
                  for group, pick in picked.items()]
        lines += ["```", ""]
    return lines


def _task_section(exp: Experiment, task: str, rows: Sequence[Row],
                  plots: dict[str, list[str]], floor: Sequence[str] = (),
                  components: Sequence[str] = (), stats: TaskStats | None = None) -> list[str]:
    """One task's section; ``stats`` when :func:`task_stats` was computed already."""
    st = stats if stats is not None else task_stats(exp, task, rows)
    lines = [f"## Task `{task_title(exp, task)}`", ""]
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
            cells.append(f"{fmt(mean)} ± {fmt(std)} ({n})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines.append("")
    if exp.select is not None:
        lines += _selection_lines(exp.select, st.final.get(exp.select.metric, {}), exp.seeds,
                                  task, exp.variants)
    lines += [*floor, *([""] if floor else []), *_plateau_lines(st.plateau, exp)]
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
            mean = fmt(float(np.mean(hit))) if hit else "–"
            cells.append(f"{mean} ({len(hit)}/{len(reached)} seeds)")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _task_variants_note(task_variants: dict[str, dict[str, list[str]]]) -> str:
    """`` Per task (after the variant's own): add_sub_4to5: ce `optim.lr=5e-4`; ...`` or ""."""
    if not task_variants:
        return ""
    parts = [f"{task}: " + ", ".join(f"{variant} `{' '.join(items)}`"
                                     for variant, items in per_variant.items())
             for task, per_variant in task_variants.items()]
    return " Per task, after the variant's own overrides: " + "; ".join(parts) + "."


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


def _cells_section(title: str, why: str, reasons: dict[str, str]) -> list[str]:
    """A report section listing the cells of ``reasons`` (key -> reason) under ``title`` and the
    paragraph ``why``; no lines when there is none."""
    if not reasons:
        return []
    return [f"## {title}", "", why, "", *(f"- `{key}`: {r}" for key, r in reasons.items()), ""]


def write_report(exp: Experiment, cells: Sequence[Cell], rows: Sequence[Row], path: Path,
                 *, command: str = "", plots: dict[str, list[str]] | None = None,
                 left_out: dict[str, str] | None = None,
                 refused: dict[str, str] | None = None, earlier: Sequence[str] = (),
                 earlier_note: str = "") -> None:
    """report.md (written whole): header (command, grid, cost), one section per task, the
    cells left out (``left_out``: key -> reason, from :func:`read_grid`; found here when not
    given), the cells refused as another definition's work (``refused``, likewise) and the
    failed cells. ``earlier``: the keys of the cells whose rows (in ``rows``) come from an
    earlier run's results.csv, counted as finished; ``earlier_note``: the header's sentence on
    them (:func:`emdlm.experiments.earlier_rows.earlier_note`)."""
    if refused is None:
        refused = {c.key: why for c in cells if (why := refusal(c)) is not None}
    if left_out is None:
        left_out = {c.key: p for c in cells
                    if (c.folder / CELL_DONE).exists() and (p := cell_problem(c)) is not None}
    done = [c for c in cells if c.key not in left_out and c.key not in refused
            and read_cell_record(c.folder) is not None]
    failed = [c for c in cells if (c.folder / ERROR_FILE).is_file()]
    records = [record for c in done if (record := read_cell_record(c.folder)) is not None]
    wall = sum(r.get("wall_s", 0.0) for r in records)
    unknown = sum(not r.get("wall_complete", not r.get("resumed")) for r in records)
    resumed_note = (f" {unknown} of them resumed an interrupted run whose time was not recorded: "
                    "their wall times count only the part after the resume, so the sum "
                    "under-counts." if unknown else "")
    stats = {task: task_stats(exp, task, rows) for task in exp.tasks}
    lines = [f"# Experiment `{exp.name}`", "", bottom_line(exp, stats), ""]
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
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
        f"{', '.join(map(str, exp.seeds))}"
        + ("." if list(exp.tasks) == [DEFAULT_TASK] else f"; tasks: {', '.join(exp.tasks)}.")
        + _task_variants_note(exp.task_variants),
        f"Cells finished: {len(done) + len(earlier)}/{len(cells)}; failed: {len(failed)}"
        + (f"; left out, outputs not whole: {len(left_out)}" if left_out else "")
        + (f"; refused, another definition's work: {len(refused)}" if refused else "")
        + (f". Sum of the wall times of the {len(done)} cells finished here: " if earlier
           else ". Sum of the finished cells' wall times: ")
        + f"{wall:.0f} s at {exp.threads_per_worker} thread(s) each "
        f"(CPU time ≈ {wall * exp.threads_per_worker:.0f} s).{resumed_note}{earlier_note}",
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
    lines += _cells_section(
        "Cells left out (outputs not whole)",
        "Marked done, but an output is missing, cut off or disagrees with its metrics.json, so "
        "none of their numbers are used. Run the same command again to evaluate them again.",
        left_out)
    lines += _cells_section(
        "Cells refused (their folders hold another definition's work)",
        "Trained or evaluated under another definition than this grid gives the cell (a folder "
        "copied from another cell, or overrides changed since), so none of their numbers are "
        "used; emdlm leaves their folders as they are. Move a folder elsewhere to run its cell "
        "again under this definition.",
        refused)
    if failed:
        lines += ["## Failed cells", ""]
        for c in failed:
            last = (c.folder / ERROR_FILE).read_text().strip().splitlines()[-1:] or [""]
            lines.append(f"- `{c.key}`: {last[0]} (see `{c.folder / ERROR_FILE}`)")
        lines.append("")
    with atomic_write(path) as fh:
        fh.write("\n".join(lines))
