"""A task's verdict, first in report.md: does the baseline beat the constant-answer floor,
has it stopped improving, how many paired seeds, what they allow one to conclude
(:func:`is_evidence`: the report's rule for a difference), and how many tests ran."""

from __future__ import annotations

import math

import numpy as np

from emdlm.experiments.floor import TaskFloor
from emdlm.experiments.grid import Experiment, task_title
from emdlm.experiments.results import fmt, fmt_p
from emdlm.experiments.stats import (
    ALPHA,
    MIN_BOOTSTRAP_SEEDS,
    PairedComparison,
    wilcoxon_min_p,
)
from emdlm.experiments.task_stats import PLATEAU_TOLERANCE, Plateau, TaskStats


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
    against = f"{fmt(best)} for always answering the test median ({constant:g})"
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
                f"abs_error_mean {fmt(mean)} ({seeds}, {below} of {len(values)} below it) "
                f"against {against}.{unparsed}", True)
    return (f"Floor: the baseline `{exp.baseline}` does NOT beat the constant-answer floor: "
            f"abs_error_mean {fmt(mean)} ({seeds}) against {against}. It has not learned "
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
            f"without multiplicity correction (the tables' \"p t Holm\" column corrects the "
            f"paired t within each metric, not across metrics): with no true difference "
            f"anywhere, expect about {n_tests * ALPHA:.2g} of them below 0.05 by chance; here "
            f"{nominal} {'is' if nominal == 1 else 'are'}.")
    if n_max < MIN_BOOTSTRAP_SEEDS:
        return [line + f" At {n_max} seeds none of them is evidence."]
    meeting = [(m, v, c) for m, v, c in st.final_comparisons if is_evidence(c)]
    meeting_auc = [(m, v, c) for m, v, c in st.auc_comparisons if is_evidence(c)]
    listed = [f"{m} {v} {fmt(c.mean_diff)} [{fmt(c.ci_low)}, {fmt(c.ci_high)}]"
              for m, v, c in meeting] + [
              f"{m} {v} (area under the curve) {fmt(c.mean_diff)} [{fmt(c.ci_low)}, "
              f"{fmt(c.ci_high)}]" for m, v, c in meeting_auc]
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
    lines = [f"**Task `{task_title(exp, task)}`** (baseline `{exp.baseline}`):", ""]
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





def _task_bottom_line(exp: Experiment, st: TaskStats | None) -> str:
    """One task's bottom line: on its primary metric (the first compared one, in report
    order), the variants whose final-checkpoint difference meets :func:`is_evidence`, with
    paired-t and Wilcoxon p; else that none does, with the closest comparison."""
    if st is None or not st.key:
        return "no finished cell to compare."
    metric = st.key[0]
    compared = [(v, c) for m, v, c in st.final_comparisons if m == metric]
    if not compared:
        return f"no variant beside baseline `{exp.baseline}` has results on {metric}."

    def described(variant: str, c: PairedComparison) -> str:
        return (f"`{variant}` Δ {fmt(c.mean_diff)}, paired-t p = {fmt_p(c.p_ttest)}, "
                f"Wilcoxon p = {fmt_p(c.p_wilcoxon)}, {c.n} seeds")

    differ = [(v, c) for v, c in compared if is_evidence(c)]
    if differ:
        return (f"{' and '.join(f'`{v}`' for v, _ in differ)} "
                f"{'differs' if len(differ) == 1 else 'differ'} from baseline "
                f"`{exp.baseline}` on {metric} at the final checkpoint ("
                + "; ".join(described(v, c) for v, c in differ) + ").")
    tested = [(v, c) for v, c in compared if math.isfinite(c.p_ttest)]
    closest = (f" (closest: {described(*min(tested, key=lambda vc: vc[1].p_ttest))})"
               if tested else f" ({max(c.n for _, c in compared)} paired seed(s): no test)")
    return (f"no variant differs from baseline `{exp.baseline}` on {metric} at the final "
            f"checkpoint by the report's rule{closest}.")


def bottom_line(exp: Experiment, stats: dict[str, TaskStats | None]) -> str:
    """report.md's first line under the title: per task, which variant differs from the
    baseline on the primary metric (see :func:`is_evidence`), or that none does."""
    if len(stats) == 1:
        return "**Bottom line:** " + _task_bottom_line(exp, next(iter(stats.values())))
    return "**Bottom line:** " + " ".join(
        f"Task `{task_title(exp, task)}`: {_task_bottom_line(exp, st)}"
        for task, st in stats.items())
