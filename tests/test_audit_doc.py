"""docs/audit.md names a test for every bad or unusual input it lists: each
named test must exist, so the table cannot drift from the suite."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AUDIT = ROOT / "docs" / "audit.md"
# `tests/file.py::name[params]`, `file.py::name`, or `::name` (the file of the previous reference)
REFERENCE = re.compile(r"`(?:tests/)?(test_\w+\.py)?::(test_\w+)(?:\[[^`]*\])?`")


def _rows() -> list[str]:
    return [line for line in AUDIT.read_text().splitlines() if re.match(r"\| [A-Z]\d+ \|", line)]


def test_every_named_test_exists() -> None:
    missing = []
    for row in _rows():
        current = None
        refs = REFERENCE.findall(row)
        assert refs, f"audit row names no test: {row[:80]}"
        for file, name in refs:
            current = file or current
            assert current is not None, f"'::{name}' without a file before it: {row[:80]}"
            source = (ROOT / "tests" / current).read_text()
            if not re.search(rf"^\s*def {name}\(", source, flags=re.MULTILINE):
                missing.append(f"{current}::{name}")
    assert not missing, f"docs/audit.md names tests that do not exist: {missing}"


def test_the_audit_covers_at_least_sixty_inputs() -> None:
    rows = _rows()
    ids = [row.split("|")[1].strip() for row in rows]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    assert len(rows) >= 60, len(rows)
