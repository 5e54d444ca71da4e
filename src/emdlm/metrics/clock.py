"""Clock answers ``H_MM`` (the NTIL paper's clock-reading task): parsing and time gaps.

The gap is cyclic over 12 hours, ``min(d, 720 - d) / 60`` hours with ``d`` the absolute
difference in minutes modulo 720, so it lies in [0, 6]. ``"4_35"`` vs ``"6_20"`` is 1.75 h.
Answers are read after :func:`emdlm.metrics.answers.normalize_answer`.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from emdlm.metrics.answers import check_pairs, normalize_answer, reference_value

_CLOCK_RE = re.compile(r"(\d{1,2})[_:](\d{2})")

# ----------------------------------------------------------------------------------------------
# Clock answers
# ----------------------------------------------------------------------------------------------

_HALF_DAY_MIN = 12 * 60
MAX_CLOCK_GAP_HOURS = 6.0


def parse_clock(s: str) -> int | None:
    """Minutes past 12:00 (0..719) of an ``H_MM`` (or ``H:MM``) answer, or None.

    H in 0..12 (12 and 0 are the same hand position), MM in 00..59, exactly two minute digits.
    """
    m = _CLOCK_RE.fullmatch(normalize_answer(s))
    if m is None:
        return None
    hours, minutes = int(m.group(1)), int(m.group(2))
    if hours > 12 or minutes > 59:
        return None
    return (hours % 12) * 60 + minutes


def clock_time_gap(pred: str, ref: str) -> float | None:
    """Cyclic gap in hours between two clock answers: min(d, 720 - d) / 60, d in minutes.

    Source: the NTIL paper's clock-reading evaluation (time gap on a 12-hour dial, so the
    largest gap is 6 h). ``clock_time_gap("4_35", "6_20") == 1.75``. Returns None when the
    prediction does not parse; raises ValueError when the reference does not.
    """
    r = parse_clock(ref)
    if r is None:
        raise ValueError(f"reference is not a valid clock time (H_MM): {ref!r}")
    p = parse_clock(pred)
    if p is None:
        return None
    d = abs(p - r) % _HALF_DAY_MIN
    return min(d, _HALF_DAY_MIN - d) / 60.0


@dataclass
class ClockStats:
    """Sufficient statistics of clock answers: the gaps (hours) of the parsed predictions,
    exact hits, right hours and right minutes (each over every answer), parse failures, n."""

    gaps: list[float]
    hits: int
    hours: int
    minutes: int
    failures: int
    n: int


def _clock_update(preds: Sequence[str], refs: Sequence[str]) -> ClockStats:
    check_pairs(preds, refs)
    stats = ClockStats([], 0, 0, 0, 0, len(preds))
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref = reference_value(parse_clock, r, i, "clock time (H_MM)")
        pred = parse_clock(p)
        if pred is None:
            stats.failures += 1  # wrong on every reading; the worst gap in the _worst means
            continue
        gap = clock_time_gap(p, r)
        assert gap is not None
        stats.gaps.append(gap)
        stats.hits += gap == 0.0
        stats.hours += pred // 60 == ref // 60  # the hour on the 12-hour dial (12 = 0)
        stats.minutes += pred % 60 == ref % 60
    return stats


def _clock_compute(c: ClockStats) -> dict[str, float]:
    nan = float("nan")
    n = c.n

    def share(k: int) -> float:
        return k / n if n else 0.0

    # Failures scored as the largest possible gap (6 h = 360 min): a model cannot look better
    # by failing to answer the hard cases.
    worst = (sum(c.gaps) + c.failures * MAX_CLOCK_GAP_HOURS) / n if n else nan
    mean = statistics.fmean(c.gaps) if c.gaps else nan  # parsed answers only
    median = statistics.median(c.gaps) if c.gaps else nan
    return {
        "exact_match": share(c.hits),
        "hour_accuracy": share(c.hours),
        "minute_accuracy": share(c.minutes),
        "time_gap_mean_worst": worst,
        "time_gap_mean": mean,
        "time_gap_median": median,
        "time_gap_minutes_mean_worst": worst * 60.0,
        "time_gap_minutes_mean": mean * 60.0,
        "time_gap_minutes_median": median * 60.0,
        "parse_failures": c.failures,
        "parse_failure_rate": share(c.failures),
        "n": n,
    }


def clock_metrics(preds: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Metrics of ``H_MM`` answers, every share over ALL answers (an unparsed answer is wrong):

    * ``exact_match`` (same dial position), ``hour_accuracy`` (same hour on the 12-hour dial),
      ``minute_accuracy`` (same minutes): 0 when nothing parsed;
    * ``time_gap_mean_worst``: the mean cyclic gap in hours with each unparsed answer counted as
      the largest gap, 6 h (never NaN for n > 0); ``time_gap_mean`` / ``time_gap_median``: over
      the parsed answers only (NaN when none parsed);
    * the same three in minutes: ``time_gap_minutes_mean_worst`` (unparsed = 360 min),
      ``time_gap_minutes_mean``, ``time_gap_minutes_median``;
    * ``parse_failures`` (a count), ``parse_failure_rate``, ``n``.
    """
    return _clock_compute(_clock_update(preds, refs))

