"""The test counts that docs/verification.md states ("about 3,100 tests", the fast lane's "about
2,900") stay within 10% of what pytest collects: ``pytest --collect-only -q -m "not slow"`` in a
fresh process, whose last line is "<fast>/<all> tests collected (<slow> deselected)"."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "verification.md"
WHOLE = re.compile(r"the whole pytest suite, as CI does \(about ([\d,]+) tests\)")
FAST = re.compile(r"the tests not marked `slow` \(about ([\d,]+)\)")
COLLECTED = re.compile(r"^(\d+)/(\d+) tests collected", re.M)
TOLERANCE = 0.10


def stated_counts(text: str) -> tuple[int, int]:
    """(whole suite, fast lane) as the page states them."""
    found = [pattern.search(text) for pattern in (WHOLE, FAST)]
    missing = [p.pattern for p, m in zip((WHOLE, FAST), found, strict=True) if m is None]
    assert not missing, f"docs/verification.md no longer says {missing}: update this test"
    whole, fast = (int(m.group(1).replace(",", "")) for m in found if m is not None)
    return whole, fast


def count_problems(stated: tuple[int, int], collected: tuple[int, int]) -> list[str]:
    """One line per stated count more than :data:`TOLERANCE` off the collected one."""
    problems = []
    for what, said, real in zip(("the whole suite", "the fast lane"), stated, collected,
                                strict=True):
        if abs(said - real) > TOLERANCE * real:
            problems.append(f"docs/verification.md says about {said:,} tests for {what}; "
                            f"{real:,} are collected: write about {round(real, -2):,}")
    return problems


@pytest.mark.slow
def test_the_stated_test_counts_are_the_collected_ones() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not slow", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    match = COLLECTED.search(proc.stdout)
    assert proc.returncode == 0 and match, proc.stdout[-3000:] + proc.stderr[-3000:]
    fast, whole = int(match.group(1)), int(match.group(2))
    problems = count_problems(stated_counts(PAGE.read_text(encoding="utf-8")), (whole, fast))
    assert not problems, "\n".join(problems)


def test_a_stale_count_is_named_with_the_figure_to_write() -> None:
    text = ("the whole pytest suite, as CI does (about 1220 tests); ... the tests not marked "
            "`slow` (about 2,900): ...")
    stated = stated_counts(text)
    assert stated == (1220, 2900)
    assert count_problems(stated, (3084, 2865)) == [
        "docs/verification.md says about 1,220 tests for the whole suite; 3,084 are collected: "
        "write about 3,100"]
    assert count_problems((3100, 2900), (3084, 2865)) == []
