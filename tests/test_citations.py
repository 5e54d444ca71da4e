"""The code, the tests and the documentation cite only what a reader can open: a paper and its
equation, an upstream file or issue, a docs page. Never the project's own design notes ("GUIDE",
"GUIDE §2") or its own issue tracker ("issue 12", "issues 8 and 10", "the issue-12 fix", "#12"),
which a user of emdlm does not have. A test says the behaviour it pins, not where the request
came from.

The rule, precisely:

- A reference is "issue N" / "issues N" / "issue-N" / "issue #N" (any case), or a bare "#N": a
  "#" followed by digits that end the word (so "#1f77b4", "#L120" and a heading anchor such as
  "page.md#3-results" are not references), not part of an HTML entity ("&#39;").
- A reference is upstream, and passes, when the word right before it (whitespace and backticks
  between are fine, nothing else) names the repository: an ``owner/repo`` path
  ("pytorch/pytorch#179291", also a URL's path) or one of ``UPSTREAM`` ("Liger-Kernel #338",
  "Liger-Kernel#338", "ntloss issue #65", "`ntloss` issue #65"). Any other reference is ours
  and fails. "GUIDE" as a word always fails. A URL such as ".../Liger-Kernel/issues/338" has no
  reference in it ("issues/" is not "issues N").
- Lines are read joined: each line's leading whitespace and leading comment marks ("#", "##"
  followed by a space) are dropped and the lines are joined with a newline, which counts as
  whitespace, so a citation split across a line break ("see issue\\n# 50") is still one.

Searched: every text file under src/, docs/, benchmarks/, examples/ and tests/ (but this file,
whose examples are the rule's), and README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("src", "docs", "benchmarks", "examples", "tests", "README.md")
NOT_SEARCHED = {Path("tests/test_citations.py")}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}
# Upstream repositories cited by short name; an owner/repo path needs no entry.
UPSTREAM = frozenset({"ntloss", "liger-kernel", "ntil", "transformers", "trl", "pytorch",
                      "accelerate", "peft", "datasets", "mauve", "pot", "ray", "emo"})
GUIDE = re.compile(r"\bGUIDE\b")
REFERENCE = re.compile(r"\b(?i:issues?)[ \t\n-]*(?:#[ \t\n]*)?\d+(?![\w-])|(?<!&)#\d+(?![\w-])")
NAME_BEFORE = re.compile(r"([\w./-]+)`*[ \t\n]*$")
COMMENT_MARK = re.compile(r"^[ \t]*(?:#+(?=[ \t]|$))?[ \t]*")


def _files(root: Path) -> list[Path]:
    found = []
    for name in SEARCHED:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        found += [p for p in candidates if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and p.relative_to(root) not in NOT_SEARCHED]
    return found


def _joined(text: str) -> str:
    """The lines without their indentation and comment marks, joined with newlines."""
    return "\n".join(COMMENT_MARK.sub("", line, count=1) for line in text.splitlines())


def _is_upstream(before: str) -> bool:
    name = NAME_BEFORE.search(before)
    if name is None:
        return False
    word = name.group(1).strip("./-")
    return "/" in word or word.lower() in UPSTREAM


def citations_in(text: str) -> list[tuple[int, str]]:
    """(line, citation) for every citation of ours in ``text`` (the module docstring's rule)."""
    joined = _joined(text)
    found = [(m.start(), m.group(0)) for m in GUIDE.finditer(joined)]
    found += [(m.start(), m.group(0)) for m in REFERENCE.finditer(joined)
              if not _is_upstream(joined[:m.start()])]
    return [(joined.count("\n", 0, start) + 1, cited) for start, cited in sorted(found)]


def internal_citations(root: Path = ROOT) -> list[str]:
    """"<file>:<line>: <the citation>" for every internal citation under ``root``."""
    hits = []
    for path in _files(root):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        hits += [f"{path.relative_to(root)}:{n}: {cited!r} in {lines[n - 1].strip()[:120]!r}"
                 for n, cited in citations_in(text)]
    return hits


def test_no_citation_of_the_design_notes_or_our_own_issues() -> None:
    hits = internal_citations()
    assert not hits, (f"{len(hits)} citations a reader cannot open; cite the paper and its "
                      "equation, the upstream file, or a docs page instead, or say the behaviour "
                      "a test pins:\n" + "\n".join(hits))


def test_the_check_tells_ours_from_upstream(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "README.md").write_text(
        "Stable preset (issue 12).\nSee GUIDE §2.1.\nScope: ntloss issue #65, Liger-Kernel #338,\n"
        "https://github.com/linkedin/Liger-Kernel/issues/338; GUIDED tour; tissue 3.\n"
        "Issues 8 and 10; the issue-12 fix.\n")
    (tmp_path / "docs" / "page.md").write_text("fine\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Pinned for\n    issue 40."""\nx = 1  # see issue\n# 50, and (#51)\n')
    assert [h.split(" in ")[0] for h in internal_citations(tmp_path)] == [
        "tests/test_x.py:2: 'issue 40'", "tests/test_x.py:3: 'issue\\n50'",
        "tests/test_x.py:4: '#51'",
        "README.md:1: 'issue 12'", "README.md:2: 'GUIDE'", "README.md:5: 'Issues 8'",
        "README.md:5: 'issue-12'"]


def test_the_rule_on_hand_made_strings() -> None:
    ours = {
        "fixed in #12.": "#12",
        "(#7)": "#7",
        "see issue #50": "issue #50",
        "see issue # 50": "issue # 50",
                "see issue\n# 50 for the case": "issue\n50",
        "see issue\n    #50": "issue\n#50",
        "cf. ISSUE 3": "ISSUE 3",
        "GUIDE §1.3": "GUIDE",
        "the emdlm #4 fix": "#4",
    }
    assert [c for _, c in citations_in("issues #8 and #9")] == ["issues #8", "#9"]
    for text, cited in ours.items():
        assert [c for _, c in citations_in(text)] == [cited], text
    upstream = [
        "Liger-Kernel #338", "Liger-Kernel#338", "ntloss issue #65", "`ntloss` issue #65",
        "pytorch/pytorch#179291 describes the crash", "huggingface/transformers issue #123",
        "https://github.com/linkedin/Liger-Kernel/issues/338", "https://x.org/a#12",
        "[EMO](results/emo_protocol.md#3-continual-fine-tuning)", "color #1f77b4", "&#39;",
        "# 50 tokens per row", "x = 3  # 2 of them", "## 3. Results", "GUIDED tour", "tissue 3",
        "a #L120 anchor",
    ]
    for text in upstream:
        assert citations_in(text) == [], text
    assert citations_in("one\ntwo issue 9\n") == [(2, "issue 9")]
