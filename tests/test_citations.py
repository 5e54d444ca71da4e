"""The code and the documentation cite only what a reader can open: a paper and its equation,
an upstream file or issue, a docs page. Never the project's own design notes ("GUIDE", "GUIDE
§2") or its own issue tracker ("issue 12", "issues 8 and 10", "the issue-12 fix"), which a user
of emdlm does not have.

Our own issues are written "issue N"; an upstream one names its repository and a "#":
"ntloss issue #65", "Liger-Kernel #338", or is a URL. The first fail here, the second pass.
Searched: every text file under src/, docs/, benchmarks/ and examples/, and README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("src", "docs", "benchmarks", "examples", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}
INTERNAL = re.compile(r"\bGUIDE\b|\b[Ii]ssues?[ -]\d+")


def _files(root: Path) -> list[Path]:
    found = []
    for name in SEARCHED:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        found += [p for p in candidates if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return found


def internal_citations(root: Path = ROOT) -> list[str]:
    """"<file>:<line>: <the citation>" for every internal citation under ``root``."""
    hits = []
    for path in _files(root):
        rel = path.relative_to(root)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{rel}:{number}: {m.group(0)!r} in {line.strip()[:120]!r}"
                     for m in INTERNAL.finditer(line)]
    return hits


def test_no_citation_of_the_design_notes_or_our_own_issues() -> None:
    hits = internal_citations()
    assert not hits, (f"{len(hits)} citations a reader cannot open; cite the paper and its "
                      "equation, the upstream file, or a docs page instead:\n" + "\n".join(hits))


def test_the_check_tells_ours_from_upstream(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Stable preset (issue 12).\nSee GUIDE §2.1.\nScope: ntloss issue #65, Liger-Kernel #338,\n"
        "https://github.com/linkedin/Liger-Kernel/issues/338; GUIDED tour; tissue 3.\n"
        "Issues 8 and 10; the issue-12 fix.\n")
    (tmp_path / "docs" / "page.md").write_text("fine\n")
    assert [h.split(" in ")[0] for h in internal_citations(tmp_path)] == [
        "README.md:1: 'issue 12'", "README.md:2: 'GUIDE'", "README.md:5: 'Issues 8'",
        "README.md:5: 'issue-12'"]
