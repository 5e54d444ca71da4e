"""Experiment statistics against scipy and hand-worked numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from emdlm.experiments.results import numeric_extras
from emdlm.experiments.stats import (
    bootstrap_ci,
    compare_paired,
    detectable_difference,
    holm_adjust,
    mean_std,
    normalized_auc,
    paired_differences,
    paired_t_power,
    paired_t_test,
    seeds_for_power,
    seeds_note,
    steps_to_reach,
    wilcoxon_min_p,
    wilcoxon_test,
)

# a fixed paired sample: baseline and variant per seed (no tied |differences|)
BASE = [5.3, 7.6, 5.3, 6.1, 8.0, 4.4, 6.6, 5.9]
VAR = [5.0, 4.7, 7.1, 3.3, 6.5, 4.3, 5.1, 5.2]


def test_paired_t_equals_scipy_and_hand_formula():
    d = paired_differences(BASE, VAR)
    t, p = paired_t_test(d)
    ref = stats.ttest_rel(VAR, BASE)
    assert t == pytest.approx(ref.statistic, rel=1e-12)
    assert p == pytest.approx(ref.pvalue, rel=1e-10)
    # t = mean(d) / (sd(d) / sqrt(n)) by hand
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    assert t == pytest.approx(mean / (sd / math.sqrt(n)), rel=1e-12)


def test_wilcoxon_equals_scipy_and_exact_distribution():
    d = paired_differences(BASE, VAR)
    assert wilcoxon_test(d) == pytest.approx(stats.wilcoxon(VAR, BASE).pvalue, rel=1e-12)
    # six differences of one sign: the exact two-sided p is 2 / 2^6 (only the all-negative and
    # all-positive sign patterns are as extreme)
    assert wilcoxon_test([-1.0, -2.0, -3.0, -4.0, -5.0, -6.5]) == pytest.approx(2 / 64)
    assert wilcoxon_test([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32)


def test_too_few_seeds_note():
    assert wilcoxon_min_p(5) == pytest.approx(0.0625)
    assert wilcoxon_min_p(6) == pytest.approx(0.03125)
    assert "needs >= 6" in seeds_note(3)
    assert "needs >= 6" in seeds_note(5)
    assert seeds_note(6) == ""
    assert "no test" in seeds_note(1)


def test_bootstrap_ci_reproducible_and_contains_mean():
    d = paired_differences(BASE, VAR)
    lo, hi = bootstrap_ci(d, seed=0)
    assert (lo, hi) == bootstrap_ci(d, seed=0)  # fixed RNG: the same interval every time
    assert lo < float(np.mean(d)) < hi
    assert bootstrap_ci(d, seed=1) != (lo, hi)
    # the percentile interval by hand with the same resamples
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, d.size, size=(10_000, d.size))].mean(axis=1)
    assert lo == pytest.approx(np.quantile(means, 0.025))
    assert hi == pytest.approx(np.quantile(means, 0.975))
    # a wider level gives a wider interval
    lo99, hi99 = bootstrap_ci(d, level=0.99, seed=0)
    assert lo99 <= lo and hi99 >= hi


def test_compare_paired_and_edge_cases():
    c = compare_paired(BASE, VAR)
    assert c.n == 8 and c.note == ""
    assert c.mean_diff == pytest.approx(np.mean(np.subtract(VAR, BASE)))
    assert c.ci_low < c.mean_diff < c.ci_high
    # a missing value (failed cell) drops the pair, not the whole comparison
    c7 = compare_paired([*BASE[:-1], float("nan")], VAR)
    assert c7.n == 7
    assert c7.p_ttest == pytest.approx(stats.ttest_rel(VAR[:-1], BASE[:-1]).pvalue)
    # identical variants: no difference, p = 1, finite everything
    same = compare_paired(BASE, BASE)
    assert same.mean_diff == 0.0 and same.p_wilcoxon == 1.0 and same.p_ttest == 1.0
    assert (same.ci_low, same.ci_high) == (0.0, 0.0)
    # one seed: a difference but no interval or test
    one = compare_paired([1.0], [2.0])
    assert one.mean_diff == 1.0 and math.isnan(one.ci_low) and math.isnan(one.p_ttest)
    # constant non-zero shift: no spread, t infinite
    assert paired_t_test([2.0, 2.0, 2.0]) == (math.inf, 0.0)
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        paired_differences([1.0, 2.0], [1.0])


def test_holm_adjust_hand_worked():
    # sorted 0.01, 0.03, 0.04 -> 3 * 0.01, 2 * 0.03, max(0.06, 1 * 0.04); back in input order
    assert holm_adjust([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjust([0.4, 0.5]) == pytest.approx([0.8, 0.8])  # 2 * 0.4, then max(0.8, 1 * 0.5)
    assert holm_adjust([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # min(1, 2 * 0.6)
    adjusted = holm_adjust([math.nan, 0.02, 0.01])  # NaN: no test, not in the family (m = 2)
    assert math.isnan(adjusted[0]) and adjusted[1:] == pytest.approx([0.02, 0.02])
    assert holm_adjust([]) == [] and holm_adjust([0.03]) == [0.03]


def test_mean_std_and_auc_hand_worked():
    assert mean_std([1.0, 2.0, 3.0, float("nan")]) == (2.0, 1.0, 3)
    mean, std, n = mean_std([4.0])
    assert (mean, n) == (4.0, 1) and math.isnan(std)
    # trapezoid: steps 0, 10, 30; values 1, 3, 3 -> (10*2 + 20*3) / 30
    assert normalized_auc([0, 10, 30], [1.0, 3.0, 3.0]) == pytest.approx(80 / 30)
    assert normalized_auc([5], [0.7]) == 0.7
    assert math.isnan(normalized_auc([1, 2], [0.1, float("nan")]))
    with pytest.raises(ValueError, match="strictly increasing"):
        normalized_auc([2, 1], [0.0, 1.0])
    assert steps_to_reach([100, 200, 300], [0.2, 0.6, 0.95], 0.5) == 200
    assert math.isnan(steps_to_reach([100, 200], [0.2, 0.3], 0.9))


def test_numeric_extras_from_predictions():
    rows = [
        {"reference": "100", "prediction": "100", "abs_error": 0.0},
        {"reference": "100", "prediction": "103", "abs_error": 3.0},  # 3%: within 5% only
        {"reference": "-200", "prediction": "-201", "abs_error": 1.0},  # 0.5%: within 1%
        {"reference": "0", "prediction": "1", "abs_error": 1.0},  # |r| floored at 1: 100%
        {"reference": "7", "prediction": "x", "abs_error": None},  # unparsed: a miss
    ]
    out = numeric_extras(rows)
    assert out["within_1pct"] == pytest.approx(2 / 5)
    assert out["within_5pct"] == pytest.approx(3 / 5)
    logs = [math.log10(1 + e) for e in (0.0, 3.0, 1.0, 1.0)]
    assert out["log10_error_mean"] == pytest.approx(sum(logs) / 4)
    assert out["magnitude_error_rate"] == 0.0 and out["sign_error_rate"] == 0.0
    assert numeric_extras([{"reference": "a", "prediction": "a", "correct": True}]) == {}


def test_magnitude_and_sign_errors_by_hand():
    rows = [
        {"reference": "9", "prediction": "909", "abs_error": 900.0},  # 1 digit -> 3: magnitude
        {"reference": "1004", "prediction": "104", "abs_error": 900.0},  # 4 -> 3 digits
        {"reference": "0", "prediction": "5", "abs_error": 5.0},  # |x| < 10 both: same order
        {"reference": "-12", "prediction": "12", "abs_error": 24.0},  # sign only
        {"reference": "-1/11", "prediction": "-2/3", "abs_error": 0.576},  # both below 1
        {"reference": "7", "prediction": "x", "abs_error": None},  # unparsed: not counted
    ]
    out = numeric_extras(rows)
    assert out["magnitude_error_rate"] == pytest.approx(2 / 5)
    assert out["sign_error_rate"] == pytest.approx(1 / 5)
    unparsed_only = numeric_extras([{"reference": "7", "prediction": "x", "abs_error": None}])
    assert math.isnan(unparsed_only["magnitude_error_rate"])


@pytest.mark.parametrize(("dz", "n", "power_at_n"), [
    (0.2, 199, 0.8017), (0.5, 34, 0.8078), (0.8, 15, 0.8213), (1.0, 10, 0.8031),
])
def test_seeds_for_power_matches_gpower(dz, n, power_at_n):
    # G*Power 3.1, t tests, "means: difference between two dependent means (matched pairs)",
    # a priori, two tails, alpha 0.05, power 0.8: total sample size and actual power
    for sd in (1.0, 3.5):  # only diff / sd matters
        assert seeds_for_power(dz * sd, sd) == n
        assert seeds_for_power(-dz * sd, sd) == n
        assert paired_t_power(n, dz * sd, sd) == pytest.approx(power_at_n, abs=5e-5)
        assert paired_t_power(n - 1, dz * sd, sd) < 0.8


def test_paired_t_power_against_simulation():
    # independent truth: the share of simulated paired samples that the paired t test rejects
    rng = np.random.default_rng(0)
    n, diff, sd, reps = 6, 1.2, 1.5, 40_000
    d = rng.normal(diff, sd, size=(reps, n))
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    simulated = float(np.mean(p < 0.05))
    assert paired_t_power(n, diff, sd) == pytest.approx(simulated, abs=0.01)


def test_detectable_difference_inverts_power():
    for n, sd in ((5, 2.0), (10, 1.0), (40, 0.3)):
        mde = detectable_difference(n, sd)
        assert paired_t_power(n, mde, sd) == pytest.approx(0.8, abs=1e-9)
        assert seeds_for_power(mde * 1.0001, sd) <= n < seeds_for_power(mde * 0.99, sd)
    # just below dz = 1, where 10 pairs have power 0.803 (G*Power, above)
    assert detectable_difference(10, 1.0) == pytest.approx(0.996, abs=1e-3)


@pytest.mark.parametrize(("n", "dz"), [(2, 7.0), (2, 10.0), (3, 8.0)])
def test_paired_t_power_with_few_seeds_and_a_large_effect(n, dz):
    # nc = dz·sqrt(n) = 9.9 / 14.1 / 13.9, where scipy 1.17's noncentral t is NaN in patches
    # (its cdf at the first); the simulated share of rejections is the independent truth
    rng = np.random.default_rng(1)
    d = rng.normal(dz, 1.0, size=(100_000, n))
    simulated = float(np.mean(stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05))
    assert paired_t_power(n, dz, 1.0) == pytest.approx(simulated, abs=0.006)


def test_paired_t_power_equals_scipy_nct_where_scipy_is_finite():
    for n in (2, 3, 5, 10):
        df = n - 1
        crit = float(stats.t.ppf(0.975, df))
        for nc in (0.0, 0.5, 2.0, 4.0, 7.0):
            expected = float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
            assert paired_t_power(n, nc / math.sqrt(n), 1.0) == pytest.approx(expected, abs=1e-9)


def test_two_seeds_give_finite_planning_figures():
    # two seeds is a common pilot; for df = 1 the 80 %-power root lies beyond nc = 9, where
    # scipy's noncentral t is NaN in patches: the simulated rejection rate at the root is the check
    for sd in (0.001, 1.0, 5.0):
        mde = detectable_difference(2, sd)
        assert math.isfinite(mde)
        assert paired_t_power(2, mde, sd) == pytest.approx(0.8, abs=1e-9)
    d = np.random.default_rng(2).normal(detectable_difference(2, 1.0), 1.0, size=(100_000, 2))
    assert float(np.mean(stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05)) == pytest.approx(
        0.8, abs=0.006)
    assert seeds_for_power(20.0, 1.0) == 2   # power 0.974 with two seeds
    need = seeds_for_power(6.0, 1.0)         # two seeds are not enough for dz = 6
    assert paired_t_power(need - 1, 6.0, 1.0) < 0.8 <= paired_t_power(need, 6.0, 1.0)
    assert need == 3


def test_power_edge_cases():
    assert math.isnan(paired_t_power(1, 1.0, 1.0))
    assert math.isnan(paired_t_power(5, 1.0, 0.0))
    assert paired_t_power(5, 0.0, 1.0) == pytest.approx(0.05)  # no effect: the test's alpha
    assert seeds_for_power(0.0, 1.0) is None
    assert seeds_for_power(1e-6, 1.0, max_seeds=100) is None
    assert seeds_for_power(1.0, 0.0) is None
    assert math.isnan(detectable_difference(1, 1.0))
    with pytest.raises(ValueError, match="power"):
        seeds_for_power(1.0, 1.0, power=1.0)


def test_digit_accuracies_by_hand():
    from emdlm.experiments.digits import digit_accuracies

    pred = np.array([104.0, 1004.0, 909.0, -57.0, 0.0, 2.5])
    ref = np.array([1004.0, 1004.0, 9.0, 67.0, 10.0, 3.0])
    digit, lead = digit_accuracies(pred, ref)
    # 104 vs 1004: units 4=4, tens 0=0, hundreds 1!=0, thousands missing -> 2 of 4, lead wrong
    # 1004 vs 1004: 4 of 4, lead right;  909 vs 9: units 9=9 -> 1 of 1, lead right
    # -57 vs 67 (signs not compared): units 7=7, tens 5!=6 -> 1 of 2, lead wrong
    # 0 vs 10: units 0=0, tens missing -> 1 of 2, lead wrong;  2.5 vs 3: not integers, left out
    assert digit == pytest.approx((2 + 4 + 1 + 1 + 1) / (4 + 4 + 1 + 2 + 2))
    assert lead == pytest.approx(2 / 5)
    assert all(math.isnan(x) for x in digit_accuracies(np.array([0.5]), np.array([1.0])))


def test_numeric_extras_report_digit_accuracies():
    rows = [
        {"reference": "12345", "prediction": "12355", "abs_error": 10.0},
        {"reference": "-6/11", "prediction": "-2/3", "abs_error": 0.12},  # not integers
        {"reference": "7", "prediction": "x", "abs_error": None},  # unparsed: not counted
    ]
    out = numeric_extras(rows)
    assert out["digit_accuracy"] == pytest.approx(4 / 5)
    assert out["leading_digit_accuracy"] == 1.0


def test_place_accuracies_by_hand():
    from emdlm.experiments.digits import place_accuracies

    # units: 4=4, 4=4, 9=9 -> 3/3; tens: 0=0, 0=0 (909 vs 9: the reference has no tens) -> 2/2;
    # hundreds: 1!=0, 0=0 -> 1/2; thousands: missing, 1=1 -> 1/2
    pred = np.array([104.0, 1004.0, 909.0])
    ref = np.array([1004.0, 1004.0, 9.0])
    assert place_accuracies(pred, ref) == pytest.approx([1.0, 1.0, 0.5, 0.5])
    assert place_accuracies(np.array([np.nan]), np.array([3.0])) == []
