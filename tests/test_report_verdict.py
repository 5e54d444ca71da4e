"""The verdict block of report.md and the interval / power rules for few seeds, on hand-made
cell folders (no training): 1-, 2- and 5-seed grids, a numeric task with a constant-answer floor
and a text task without one.

The 2-seed grid is a pilot's case: without these rules, its percentile bootstrap
printed [−137, −130] (the range of the two differences), its paired t gave p = 0.016, and
its power table said 2 seeds suffice for the observed difference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from _experiment import FAKE_BASE, finished_text_grid
from emdlm.experiments import expand_grid, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.grid import parse_experiment

# the test problems of every fake cell: references 2 and 18, so the best constant answer (the
# median, 10) has abs_error_mean 8 and answering 0 has 10
PREDICTIONS = [{"prompt": "1+1=", "reference": "2", "prediction": "2", "correct": True,
                "abs_error": 0.0},
               {"prompt": "9+9=", "reference": "18", "prediction": "x", "correct": False,
                "abs_error": None}]
FLOOR = 8.0


def _grid(tmp_path, errors, *, steps=(10, 20), name="g"):
    """A grid of variants ce (baseline) and ntil whose cells hold ``errors[variant][step]``
    (one abs_error_mean per seed) and the fixed PREDICTIONS; returns the report's text."""
    n_seeds = len(errors["ce"][steps[-1]])
    exp = parse_experiment({"name": name, "base": FAKE_BASE, "seeds": list(range(n_seeds)),
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "output_dir": str(tmp_path / name)})
    cells = expand_grid(exp)
    for cell in cells:
        for step in steps:
            folder = eval_dir(cell.folder, step)
            folder.mkdir(parents=True)
            metrics = {"exact_match": 0.5, "abs_error_mean": errors[cell.variant][step][cell.seed],
                       "n": len(PREDICTIONS)}
            (folder / "metrics.json").write_text(json.dumps(metrics))
            (folder / "predictions.jsonl").write_text(
                "".join(json.dumps(p) + "\n" for p in PREDICTIONS))
        (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    return write_outputs(exp, cells, command=f"emdlm experiment -c {name}").report.read_text()


def _verdict(report):
    """The verdict block: from its heading to the grid description that follows it."""
    assert "## Verdict: what this grid can and cannot show" in report
    return report.split("## Verdict: what this grid can and cannot show")[1].split("Variants:")[0]


def _row(report, table_heading, metric="abs_error_mean"):
    section = report.split(table_heading)[1].split("###")[0]
    return next(ln for ln in section.splitlines() if ln.startswith(f"| {metric} | ntil |"))


FINAL = "### Final checkpoint: paired difference against the baseline"


def test_one_seed_verdict_has_no_paired_statistics(tmp_path):
    report = _grid(tmp_path, {"ce": {10: [6.0], 20: [3.0]}, "ntil": {10: [5.0], 20: [2.0]}})
    verdict = _verdict(report)
    # right after the title, the bottom line and the produced-by lines
    assert report.startswith(
        "# Experiment `g`\n\n**Bottom line:** no variant differs from baseline `ce` on "
        "abs_error_mean at the final checkpoint by the report's rule (1 paired seed(s): no "
        "test).\n\nProduced by:\n\n```\nemdlm experiment -c g\n"
        "```\n\n## Verdict: what this grid can and cannot show\n")
    assert "- Paired seeds: 1," in verdict
    assert "1 seed: no paired statistics at all (no interval, no test, no power figure)" in verdict
    assert "- Tests: none run (a test needs 2 paired seeds)." in verdict
    # nothing paired is printed: no interval, no p-value of either test, no power table
    assert _row(report, FINAL) == ("| abs_error_mean | ntil | -1 | [–, –] | – | – | – | 1 | "
                                   "1 paired seed(s): no test possible |")
    assert "### Power of the final comparison" not in report
    # the floor and plateau sentences hold for one seed too
    assert ("- Floor: the baseline `ce` beats the constant-answer floor: abs_error_mean 3 "
            "(mean of 1 seed, 1 of 1 below it) against 8 for always answering the test "
            "median (10).") in verdict


# the pilot: ntil - ce = -137 and -130 on the two seeds; the baseline is flat between
# its last two steps and far above the floor
TWO = {"ce": {10: [200.0, 190.0], 20: [200.0, 190.0]}, "ntil": {10: [80.0, 70.0], 20: [63.0, 60.0]}}


def test_two_seed_verdict_calls_nothing_significant(tmp_path):
    report = _grid(tmp_path, TWO)
    verdict = _verdict(report)
    assert "- Paired seeds: 2," in verdict
    assert ("- Conclusions: 2 seeds: no difference can be called significant; treat every Δ as "
            "a pilot.") in verdict
    assert "Wilcoxon cannot go below p = 0.5" in verdict
    # 4 key metrics x 1 variant, final and area under the curve, x 2 p-values; the paired t of
    # abs_error_mean at both is below 0.05, and still not evidence
    assert ("- Tests: 16 (4 final-checkpoint rows + 4 area-under-curve rows, each with a "
            "Wilcoxon and a paired-t p-value), run without multiplicity correction (the "
            "tables' \"p t Holm\" column corrects the paired t within each metric, not across "
            "metrics): with no true difference anywhere, expect about 0.8 of them below 0.05 by "
            "chance; here 2 "
            "are. At 2 seeds none of them is evidence.") in verdict
    assert ("- Floor: the baseline `ce` does NOT beat the constant-answer floor: abs_error_mean "
            "195 (mean of 2 seeds) against 8 for always answering the test median (10). It has "
            "not learned the task") in verdict
    assert ("- Plateau: no key metric of the baseline `ce` improved by more than 2% over steps "
            "10 → 20 (mean over seeds)") in verdict


def test_two_seed_interval_is_paired_t_not_bootstrap(tmp_path):
    report = _grid(tmp_path, TWO)
    d = np.array([63.0 - 200.0, 60.0 - 190.0])
    # the paired-t interval from scipy (the oracle): mean +- t_{1, 0.975} sd / sqrt(2)
    lo, hi = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    p_t = stats.ttest_1samp(d, 0.0).pvalue
    assert p_t == pytest.approx(0.0167, abs=1e-4)
    row = _row(report, FINAL)
    assert row.startswith(f"| abs_error_mean | ntil | -133.5 | [{lo:.4g}, {hi:.4g}] | 0.5 | "
                          f"{p_t:.3g} | {p_t:.3g} | 2 |")  # one variant: Holm = raw
    # ten times wider than the two differences' range, which the bootstrap printed; it
    # excludes 0 exactly as the paired t beside it has p < 0.05
    assert lo < -137.0 and hi > -130.0 and hi - lo > 10 * 7.0 and hi < 0.0
    # the bootstrap's range-of-the-differences interval is not printed, as such or at all
    assert "[-137, -130]" not in report and "bootstrap CI" not in report
    assert "| 95% paired-t CI |" in report
    assert "Intervals from fewer than 5 paired seeds are paired-t intervals" in report


def test_two_seed_power_table_does_not_size_from_the_observed_difference(tmp_path):
    from emdlm.experiments.stats import detectable_difference

    report = _grid(tmp_path, TWO)
    sd = float(np.std([-137.0, -130.0], ddof=1))
    row = _row(report, "### Power of the final comparison")
    assert row == (f"| abs_error_mean | ntil | 2 | {sd:.4g} | "
                   f"{detectable_difference(2, sd):.4g} | not estimated from 2 seeds |")
    assert "| 2 |" not in row.split("|", 6)[-1]  # no "seeds for the observed difference: 2"


FIVE = {"ce": {10: [7.0, 7.4, 6.9, 7.6, 7.1], 20: [3.0, 3.4, 2.9, 3.6, 3.1]},
        "ntil": {10: [6.5, 7.0, 6.6, 7.1, 6.4], 20: [2.5, 3.0, 2.6, 3.1, 2.4]}}


def test_five_seed_verdict_and_unchanged_bootstrap(tmp_path):
    from emdlm.experiments.stats import bootstrap_ci, seeds_for_power

    report = _grid(tmp_path, FIVE)
    verdict = _verdict(report)
    d = np.subtract(FIVE["ntil"][20], FIVE["ce"][20])  # all five negative
    lo, hi = bootstrap_ci(d)  # the percentile bootstrap, as every earlier report printed it
    assert "| 95% bootstrap CI |" in report and "paired-t CI" not in report
    assert _row(report, FINAL).startswith(
        f"| abs_error_mean | ntil | {d.mean():.4g} | [{lo:.4g}, {hi:.4g}] | 0.0625 | "
        f"{stats.ttest_1samp(d, 0.0).pvalue:.3g} | {stats.ttest_1samp(d, 0.0).pvalue:.3g} | 5 |")
    assert "Intervals from fewer than 5 paired seeds" not in report
    assert "- Paired seeds: 5," in verdict
    assert ("- Conclusions: 5 seeds: a difference with paired-t p < 0.05, an interval excluding "
            "0 and every seed on the same side (Wilcoxon p = 0.0625, its smallest with 5 seeds) "
            "is evidence; no other difference is.") in verdict
    assert "expect about 0.8 of them below 0.05 by chance; here 2 are." in verdict
    assert (f"Rows meeting the rule: 2 of 8: abs_error_mean ntil {d.mean():.4g} [{lo:.4g}, "
            f"{hi:.4g}]; abs_error_mean ntil (area under the curve)") in verdict
    assert ("- Floor: the baseline `ce` beats the constant-answer floor: abs_error_mean 3.2 "
            "(mean of 5 seeds, 5 of 5 below it) against 8 for always answering the test median "
            "(10).") in verdict
    assert ("- Plateau: the baseline `ce` is still improving (steps 10 → 20: abs_error_mean "
            "56% better; mean over seeds)") in verdict
    # 5 seeds: the power table still sizes a grid from the observed difference
    need = seeds_for_power(float(d.mean()), float(d.std(ddof=1)))
    assert _row(report, "### Power of the final comparison").endswith(f" | {need} |")


def test_text_task_verdict_has_no_floor_and_no_plateau(tmp_path):
    verdict = _text_grid_verdict(
        tmp_path, lambda v, s: 0.5 + 0.01 * s + (0.02 if v == "emo" else 0.0))
    assert ("- Floor: the constant-answer floor is not computed (numeric tasks only; this task's "
            "answers are not numbers).") in verdict
    assert "- Plateau: not checked (one evaluated step)" in verdict
    assert "3 seeds: no difference can be called significant" in verdict
    # mauve and ppl_test, final checkpoint only (no curve), 2 p-values each
    assert "- Tests: 4 (2 final-checkpoint rows, each with" in verdict


def _text_grid_verdict(tmp_path, mauve_of):
    """The verdict of a hand-built 2-variant, 3-seed text grid whose final MAUVE is
    ``mauve_of(variant, seed)``."""
    exp, cells = finished_text_grid(tmp_path / "out", [0, 1, 2], lambda v, s: {
        "mauve": mauve_of(v, s), "ppl_test": 30.0 - s})
    return _verdict(write_outputs(exp, cells).report.read_text())


def test_mauve_that_cannot_rank_the_variants_is_said_in_the_verdict(tmp_path):
    """MAUVE saturated for every model (seen with 4 buckets on a small set) or at its
    floor for every model (the EMO fine-tuning grid) cannot rank them: the verdict says so."""
    saturated = _text_grid_verdict(tmp_path / "a", lambda v, s: 0.985 + 0.001 * s)
    assert "- MAUVE is saturated for every variant (ce 0.986, emo 0.986; >= 0.98)" in saturated
    floor = _text_grid_verdict(tmp_path / "b", lambda v, s: 0.015 + (0.004 if v == "emo" else 0))
    assert "- MAUVE is at its floor for every variant (ce 0.015, emo 0.019; <= 0.02)" in floor
    ranked = _text_grid_verdict(tmp_path / "c", lambda v, s: 0.97 if v == "ce" else 0.995)
    assert "- MAUVE is" not in ranked


def test_paired_t_interval_and_which_interval_compare_paired_gives():
    from emdlm.experiments.stats import (
        MIN_BOOTSTRAP_SEEDS,
        bootstrap_ci,
        compare_paired,
        paired_t_ci,
    )

    d = np.array([-1.3, 0.4, -2.2, -0.9])
    ref = stats.ttest_1samp(d, 0.0).confidence_interval(0.9)
    assert paired_t_ci(d, level=0.9) == pytest.approx((ref.low, ref.high), rel=1e-12)
    assert all(math.isnan(x) for x in paired_t_ci([1.0]))
    assert paired_t_ci([2.0, 2.0]) == (2.0, 2.0)
    assert MIN_BOOTSTRAP_SEEDS == 5
    base = [5.3, 7.6, 5.3, 6.1, 8.0, 4.4]
    var = [5.0, 4.7, 7.1, 3.3, 6.5, 4.3]
    for n in (2, 3, 4):  # fewer than 5: the paired-t interval
        c = compare_paired(base[:n], var[:n])
        assert c.ci_kind == "t"
        assert (c.ci_low, c.ci_high) == paired_t_ci(np.subtract(var[:n], base[:n]))
    for n in (5, 6):  # 5 and more: the bootstrap, unchanged
        c = compare_paired(base[:n], var[:n])
        assert c.ci_kind == "bootstrap"
        assert (c.ci_low, c.ci_high) == bootstrap_ci(np.subtract(var[:n], base[:n]))
    one = compare_paired([1.0], [2.0])  # one pair: no test of either kind
    assert math.isnan(one.p_wilcoxon) and math.isnan(one.p_ttest)


def test_evidence_rule_by_seed_count():
    from emdlm.experiments.stats import PairedComparison
    from emdlm.experiments.verdict import is_evidence, seeds_verdict

    def comp(n, lo, hi, p_w, p_t):
        return PairedComparison(n, (lo + hi) / 2, lo, hi, p_w, p_t, "")

    assert not is_evidence(comp(4, -3.0, -1.0, 0.125, 0.001))      # 4 seeds: a pilot
    assert is_evidence(comp(5, -3.0, -1.0, 0.0625, 0.01))          # 5: all seeds one side
    assert not is_evidence(comp(5, -3.0, -1.0, 0.125, 0.01))
    assert is_evidence(comp(6, -3.0, -1.0, 0.031, 0.01))
    assert not is_evidence(comp(6, -3.0, 0.5, 0.031, 0.01))        # interval spans 0
    assert not is_evidence(comp(8, -3.0, -1.0, 0.2, 0.01))         # Wilcoxon disagrees
    assert "no paired statistics at all" in seeds_verdict(1)
    assert "treat every Δ as a pilot" in seeds_verdict(4)
    assert "p < 0.05 in both tests and an interval excluding 0 are evidence" in seeds_verdict(6)


def test_rows_meeting_the_rule_under_the_floor_are_flagged(tmp_path):
    above = {v: {s: [x + 10.0 for x in vals] for s, vals in by_step.items()}
             for v, by_step in FIVE.items()}  # every baseline seed above the floor of 8
    verdict = _verdict(_grid(tmp_path, above))
    assert "- Floor: the baseline `ce` does NOT beat the constant-answer floor" in verdict
    assert ("Rows meeting the rule: 2 of 8" in verdict
            and "The baseline is not past the floor, though: none of this is about the "
                "objectives." in verdict)


def test_two_task_verdict_counts_every_test(tmp_path):
    exp = parse_experiment({"name": "two", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "tasks": {"a": [], "b": ["data.eval.n=5"]},
                            "output_dir": str(tmp_path / "two")})
    cells = expand_grid(exp)
    for cell in cells:
        for step in (10, 20):
            folder = eval_dir(cell.folder, step)
            folder.mkdir(parents=True)
            err = TWO[cell.variant][step][cell.seed]
            (folder / "metrics.json").write_text(json.dumps(
                {"exact_match": 0.5, "abs_error_mean": err, "n": len(PREDICTIONS)}))
            (folder / "predictions.jsonl").write_text(
                "".join(json.dumps(p) + "\n" for p in PREDICTIONS))
        (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    verdict = _verdict(write_outputs(exp, cells).report.read_text())
    assert "**Task `a`** (baseline `ce`):" in verdict and "**Task `b`** (baseline `ce`):" in verdict
    assert verdict.count("- Tests: 16 (") == 2
    assert ("Across the 2 tasks: 32 tests, none corrected for the others: about 1.6 below 0.05 "
            "by chance alone.") in verdict


def test_verdict_names_a_metric_empty_for_every_cell_and_pairs_the_others(tmp_path):
    """A new user's 20-step grid: no answer parsed, so abs_error_mean was empty in every cell,
    and the verdict said "no seed is shared ... nothing is paired" above a table pairing
    exact_match over 2 seeds. It names the empty metric and what is compared instead."""
    exp, cells = finished_text_grid(tmp_path / "out", [0, 1], lambda v, s: {
        "abs_error_mean": None, "parse_failure_rate": 1.0,
        "exact_match": 0.0 if v == "ce" else 0.1 * s})
    verdict = _verdict(write_outputs(exp, cells).report.read_text())
    assert "no seed is shared" not in verdict and "nothing is paired" not in verdict
    assert ("- Empty metrics: abs_error_mean is empty for every cell (no answer parsed: "
            "parse_failure_rate 1 in all 4 cells): nothing can be concluded from it; the paired "
            "comparison below uses exact_match.") in verdict
    assert "- Paired seeds: 2, the seeds the baseline and a variant share" in verdict
    assert "- Conclusions: 2 seeds: no difference can be called significant" in verdict


def test_verdict_when_no_compared_metric_pairs_a_seed_says_so(tmp_path):
    # every compared metric empty: seeds are shared, nothing can be concluded
    exp, cells = finished_text_grid(tmp_path / "a", [0, 1], lambda v, s: {
        "abs_error_mean": None, "parse_failure_rate": 0.5})
    verdict = _verdict(write_outputs(exp, cells).report.read_text())
    assert ("- Empty metrics: abs_error_mean is empty for every cell (no finite value): no "
            "compared metric pairs a seed, so nothing can be concluded.") in verdict
    assert ("- Paired seeds: 2 shared by the baseline and a variant, but no compared metric "
            "has a value on both sides of any of them.") in verdict
    assert "no seed is shared" not in verdict
    # a value on one side only (the variant parses, the baseline never does)
    exp, cells = finished_text_grid(tmp_path / "b", [0, 1], lambda v, s: {
        "abs_error_mean": None if v == "ce" else 3.0, "exact_match": 0.1 * s})
    verdict = _verdict(write_outputs(exp, cells).report.read_text())
    assert ("- Empty metrics: abs_error_mean has no seed with a value for both the baseline "
            "`ce` and a variant: nothing can be concluded from it; the paired comparison below "
            "uses exact_match.") in verdict
    assert "- Paired seeds: 2," in verdict


def _bottom_line(report):
    lines = report.splitlines()
    assert lines[0].startswith("# Experiment") and lines[1] == ""
    return lines[2]


def test_bottom_line_names_the_variant_that_differs_with_its_paired_p(tmp_path):
    report = _grid(tmp_path, FIVE)
    d = np.subtract(FIVE["ntil"][20], FIVE["ce"][20])
    p_t = stats.ttest_1samp(d, 0.0).pvalue
    assert _bottom_line(report) == (
        "**Bottom line:** `ntil` differs from baseline `ce` on abs_error_mean at the final "
        f"checkpoint (`ntil` Δ {d.mean():.4g}, paired-t p = {p_t:.3g}, Wilcoxon p = 0.0625, "
        "5 seeds).")
    # the same numbers as the final-checkpoint table's row
    assert _row(report, FINAL).startswith(f"| abs_error_mean | ntil | {d.mean():.4g} |")


def test_bottom_line_says_no_variant_differs_and_gives_the_closest(tmp_path):
    report = _grid(tmp_path, TWO)  # paired-t p = 0.0167, but 2 seeds are no evidence
    assert _bottom_line(report) == (
        "**Bottom line:** no variant differs from baseline `ce` on abs_error_mean at the final "
        "checkpoint by the report's rule (closest: `ntil` Δ -133.5, paired-t p = 0.0167, "
        "Wilcoxon p = 0.5, 2 seeds).")


def test_grid_without_tasks_names_its_task_after_the_experiment(tmp_path):
    report = _grid(tmp_path, TWO, name="arith")
    assert "`default`" not in report and "tasks: default" not in report
    assert "## Task `arith`" in report and "**Task `arith`** (baseline `ce`):" in report
    assert "; seeds: 0, 1.\n" in report  # no task list for the one implicit task
    assert (tmp_path / "arith" / "default").is_dir()  # the folder layout is unchanged


def test_two_task_bottom_line_has_one_clause_per_task(tmp_path):
    exp = parse_experiment({"name": "two", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "tasks": {"a": [], "b": []}, "output_dir": str(tmp_path / "two")})
    report = write_outputs(exp, expand_grid(exp)).report.read_text()
    assert _bottom_line(report) == ("**Bottom line:** Task `a`: no finished cell to compare. "
                                    "Task `b`: no finished cell to compare.")

