"""Experiment statistics against scipy and hand-worked numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from emdlm.experiments.report import numeric_extras
from emdlm.experiments.stats import (
    bootstrap_ci,
    compare_paired,
    mean_std,
    normalized_auc,
    paired_differences,
    paired_t_test,
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
    assert numeric_extras([{"reference": "a", "prediction": "a", "correct": True}]) == {}
