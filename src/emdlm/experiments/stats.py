"""Paired statistics over seeds: bootstrap or paired-t CI, Wilcoxon signed-rank, paired t, curve
summaries, and the paired t test's power (seeds needed, smallest detectable difference) to plan
a grid.

A pair is (baseline, variant) trained with the same seed (same data, order and initial
weights); every statistic works on the per-seed differences d_i = variant_i - baseline_i.
Pairs where either side is missing (NaN: a failed cell, no parsed answer) are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
# Fewest paired seeds whose interval is a percentile bootstrap; below it compare_paired gives the
# paired-t interval instead (replaced, not marked: a marked number still reads as an interval).
# With n seeds the bootstrap can only resample those n differences, so its interval is about
# their range: for n = 2 it is [min d, max d]. Simulated with normal differences (4000 samples,
# 2000 resamples each), the 95% percentile interval covers the true mean 51% of the time at
# n = 2, 75% at 3, 80% at 4 (84% at 5, 87% at 6); the paired-t interval covers it 95% at every n,
# and it excludes 0 exactly when the paired-t p-value printed beside it is below 0.05, so the row
# agrees with itself. The cut at 5, not higher, keeps every interval from >= 5 seeds in the
# reports of docs/results unchanged (their 2- and 3-seed pilots get t intervals when rebuilt).
MIN_BOOTSTRAP_SEEDS = 5


@dataclass
class PairedComparison:
    """Variant minus baseline over n paired seeds. ``ci_kind``: how the interval was made,
    "bootstrap" (percentile, n >= ``MIN_BOOTSTRAP_SEEDS``) or "t" (paired t, fewer seeds)."""

    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    p_wilcoxon: float
    p_ttest: float
    note: str
    ci_kind: str = "bootstrap"


def paired_differences(baseline: Sequence[float], variant: Sequence[float]) -> np.ndarray:
    """d_i = variant_i - baseline_i over the pairs where both are finite."""
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(variant, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples need equal 1-D shapes, got {a.shape} and {b.shape}")
    keep = np.isfinite(a) & np.isfinite(b)
    return b[keep] - a[keep]


def _check_open_unit(name: str, value: float) -> None:
    """ValueError unless 0 < ``value`` < 1 (a confidence level, a power)."""
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")


def bootstrap_ci(
    diffs: Sequence[float], *, level: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean paired difference (Efron & Tibshirani 1993, §13.3).

    Resamples the n seeds' differences with replacement ``n_boot`` times with a fixed RNG seed
    (reproducible), and returns the (1-level)/2 and (1+level)/2 quantiles of the resampled
    means. NaN for fewer than 2 pairs (one pair says nothing about the spread).
    """
    _check_open_unit("level", level)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_boot, d.size))  # [n_boot, n] resampled seeds
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def paired_t_ci(diffs: Sequence[float], *, level: float = 0.95) -> tuple[float, float]:
    """Paired-t interval of the mean difference: mean(d) -+ t_{n-1, (1+level)/2} · sd(d) / sqrt(n)
    (Student 1908; the interval that inverts :func:`paired_t_test`: at level 0.95 it excludes 0
    exactly when that test's p < 0.05). NaN for n < 2; (mean, mean) when every difference is
    equal."""
    from scipy import stats

    _check_open_unit("level", level)
    d = np.asarray(diffs, dtype=np.float64)
    n = d.size
    if n < 2:
        return math.nan, math.nan
    mean = float(d.mean())
    half = float(stats.t.ppf((1.0 + level) / 2.0, df=n - 1)) * float(d.std(ddof=1)) / math.sqrt(n)
    return mean - half, mean + half


def paired_t_test(diffs: Sequence[float]) -> tuple[float, float]:
    """Two-sided paired t test: t = mean(d) / (sd(d) / sqrt(n)), n-1 degrees of freedom.

    Returns (t, p). NaN for n < 2; with all differences equal, p = 1 when they are 0 and
    t = +-inf, p = 0 otherwise (no spread at all around a non-zero shift).
    """
    from scipy import stats

    d = np.asarray(diffs, dtype=np.float64)
    n = d.size
    if n < 2:
        return math.nan, math.nan
    mean = float(d.mean())
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (sd / math.sqrt(n))
    p = 2.0 * float(stats.t.sf(abs(t), df=n - 1))
    return t, p


def wilcoxon_test(diffs: Sequence[float]) -> float:
    """Two-sided Wilcoxon signed-rank p-value of the paired differences (scipy: exact
    distribution for small n without ties, normal approximation otherwise; zero differences
    dropped, Wilcoxon 1945). 1.0 when every difference is 0, NaN with no pair."""
    from scipy import stats

    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return math.nan
    if not np.any(d != 0.0):
        return 1.0
    return float(stats.wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)


def wilcoxon_min_p(n: int) -> float:
    """Smallest two-sided exact Wilcoxon p-value with n non-zero, untied differences: every
    sign the same gives P = 2 / 2^n. It is 0.0625 at n = 5 and 0.031 at n = 6, so fewer than
    6 seeds can never reach p < 0.05."""
    if n < 1:
        return 1.0
    return min(1.0, 2.0 / 2.0**n)


def seeds_note(n: int, alpha: float = ALPHA) -> str:
    """A warning when n pairs are too few for the tests to reach p < alpha ("" otherwise)."""
    if n < 2:
        return f"{n} paired seed(s): no test possible"
    if wilcoxon_min_p(n) >= alpha:
        need = next(k for k in range(n, 64) if wilcoxon_min_p(k) < alpha)
        return f"only {n} seeds: Wilcoxon cannot reach p < {alpha} (needs >= {need})"
    return ""


def compare_paired(
    baseline: Sequence[float], variant: Sequence[float], *, level: float = 0.95,
    n_boot: int = 10_000, seed: int = 0, min_bootstrap: int = MIN_BOOTSTRAP_SEEDS,
) -> PairedComparison:
    """Mean difference, its interval, Wilcoxon and paired-t p-values and a too-few-seeds note.

    The interval is the percentile bootstrap (:func:`bootstrap_ci`) from ``min_bootstrap``
    paired seeds on, the paired-t interval (:func:`paired_t_ci`) below that
    (``MIN_BOOTSTRAP_SEEDS`` says why); ``ci_kind`` says which.
    """
    d = paired_differences(baseline, variant)
    if d.size >= min_bootstrap:
        (lo, hi), kind = bootstrap_ci(d, level=level, n_boot=n_boot, seed=seed), "bootstrap"
    else:
        (lo, hi), kind = paired_t_ci(d, level=level), "t"
    return PairedComparison(
        n=int(d.size),
        mean_diff=float(d.mean()) if d.size else math.nan,
        ci_low=lo,
        ci_high=hi,
        # one pair is no test (scipy would give p = 1 for it): NaN like the t test's
        p_wilcoxon=wilcoxon_test(d) if d.size >= 2 else math.nan,
        p_ttest=paired_t_test(d)[1],
        note=seeds_note(int(d.size)),
        ci_kind=kind,
    )


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order; NaN entries (no test) stay NaN
    and do not count towards the family size m.

    With the m finite p-values sorted ascending, p_(1) <= ... <= p_(m):
    adj_(i) = max_{j <= i} min(1, (m - j + 1) * p_(j)). Rejecting where adj < alpha controls the
    family-wise error rate at alpha under any dependence. Source: S. Holm, "A Simple
    Sequentially Rejective Multiple Test Procedure", Scand. J. Statistics 6 (1979) 65-70.
    """
    finite = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    adjusted = [math.nan] * len(p_values)
    m, running = len(finite), 0.0
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample std with ddof=1, n) over the finite values; std NaN for n < 2."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, 0
    std = float(v.std(ddof=1)) if v.size > 1 else math.nan
    return float(v.mean()), std, int(v.size)


def normalized_auc(steps: Sequence[float], values: Sequence[float]) -> float:
    """Area under a learning curve divided by its step range: the trapezoid rule over the
    evaluated steps, (1 / (s_last - s_first)) * sum_k (s_k+1 - s_k) (v_k + v_k+1) / 2, i.e. the
    curve's average level. A single point is its own value; NaN if any value is missing."""
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1 or s.size == 0:
        raise ValueError(f"steps and values need equal non-empty 1-D shapes, got {s.shape}, "
                         f"{v.shape}")
    if np.any(np.diff(s) <= 0):
        raise ValueError(f"steps must be strictly increasing, got {s.tolist()}")
    if not np.all(np.isfinite(v)):
        return math.nan
    if s.size == 1:
        return float(v[0])
    area = float(np.sum(np.diff(s) * (v[1:] + v[:-1]) / 2.0))
    return area / float(s[-1] - s[0])


def steps_to_reach(
    steps: Sequence[float], values: Sequence[float], threshold: float
) -> float:
    """The first evaluated step whose value is >= threshold (NaN if never reached)."""
    for s, v in zip(steps, values, strict=True):
        if math.isfinite(v) and v >= threshold:
            return float(s)
    return math.nan


# ------------------------------------------------------------------------ power (planning)
POWER = 0.8


def paired_t_power(n: int, diff: float, sd: float, *, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t test with n pairs when the true mean difference is
    ``diff`` and the differences' standard deviation is ``sd``.

    With T ~ noncentral t(df = n-1, nc = diff·sqrt(n)/sd) and c = t_{1-alpha/2, n-1}, power =
    P(T > c) + P(T < -c) (Cohen 1988, ch. 2; the matched-pairs t test of G*Power). Computed
    from T = (Z + nc) / S with Z standard normal and S = sqrt(chi2_df / df) independent:
    power = E_S[Phi(nc - c·S) + Phi(-nc - c·S)], one integral over S's (scaled chi) density.
    Not scipy's ``nct``: scipy 1.17 returns NaN in patches of nc above ~9 (measured: df = 1..9),
    which is where few seeds and a large effect land. NaN for n < 2 or sd <= 0.
    """
    from scipy import integrate, special, stats

    if n < 2 or not sd > 0.0 or not math.isfinite(diff):
        return math.nan
    df = n - 1
    crit = float(stats.t.ppf(1.0 - alpha / 2.0, df))
    nc = abs(diff) * math.sqrt(n) / sd
    scale = stats.chi(df, scale=1.0 / math.sqrt(df))

    def integrand(s: float) -> float:
        return float((special.ndtr(nc - crit * s) + special.ndtr(-nc - crit * s)) * scale.pdf(s))

    value, _ = integrate.quad(integrand, 0.0, math.inf, epsabs=1e-13, epsrel=1e-11, limit=200)
    return min(max(float(value), 0.0), 1.0)


def seeds_for_power(diff: float, sd: float, *, power: float = POWER, alpha: float = ALPHA,
                    max_seeds: int = 10_000) -> int | None:
    """Smallest number of paired seeds n >= 2 whose paired t test reaches ``power`` for a true
    mean difference ``diff`` with differences of standard deviation ``sd``; None when even
    ``max_seeds`` do not (a zero or vanishing difference). Power grows with n, so the search
    doubles n, then bisects."""
    _check_open_unit("power", power)
    if not sd > 0.0 or not math.isfinite(diff) or diff == 0.0:
        return None
    hi = 2
    while paired_t_power(hi, diff, sd, alpha=alpha) < power:
        if hi >= max_seeds:
            return None
        hi = min(2 * hi, max_seeds)
    lo = max(2, hi // 2)
    if paired_t_power(lo, diff, sd, alpha=alpha) >= power:
        return lo
    while hi - lo > 1:  # power(lo) < target <= power(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if paired_t_power(mid, diff, sd, alpha=alpha) >= power else (mid, hi)
    return hi


def detectable_difference(n: int, sd: float, *, power: float = POWER,
                          alpha: float = ALPHA) -> float:
    """The smallest true mean difference that n paired seeds detect with the given power
    (two-sided paired t test at ``alpha``; differences of standard deviation ``sd``): the
    root of paired_t_power(n, diff, sd) = power. NaN for n < 2 or sd <= 0."""
    from scipy import optimize

    _check_open_unit("power", power)
    if n < 2 or not sd > 0.0:
        return math.nan
    hi = sd
    while paired_t_power(n, hi, sd, alpha=alpha) < power:
        hi *= 2.0
    return float(optimize.brentq(
        lambda x: paired_t_power(n, x, sd, alpha=alpha) - power, 0.0, hi, xtol=1e-12 * sd))
