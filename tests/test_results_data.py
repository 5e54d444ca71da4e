"""Every figure in docs/results can be recomputed from a committed CSV.

- A report written by ``emdlm experiment`` names its grid ("Variants: ...; seeds: ...;"): the
  CSVs in the folder of the report's name must hold every (variant, seed) it names.
- A CSV a report names (``results.csv``, ``<folder>/results_16k.csv``, or a path from the
  repository root) must exist.
- The reports whose data is not published are listed in KNOWN_MISSING with the reason; the
  list must be exact, so publishing the data (or losing more) fails this test until it is
  updated.
- Intervals that docs/results.md quotes (QUOTED) are the ones the committed CSVs give by the
  reports' own test (paired t below 5 seeds), and the at-a-glance table's multiplicity note
  counts the table's p-values.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
GRID = re.compile(r"^Variants: (.*?) \(baseline `[^`]*`\); seeds: ([\d, ]+);", re.M)
CSV_NAME = re.compile(r"[\w./-]+\.csv")

KNOWN_MISSING: dict[str, str] = {}  # empty since the arithmetic_how_fast re-run
REPORTS = sorted(RESULTS.glob("*.md"))


def _rows(folder: Path) -> set[tuple[str, str]]:
    rows: set[tuple[str, str]] = set()
    for path in sorted(folder.glob("*.csv")) if folder.is_dir() else []:
        with path.open(newline="", encoding="utf-8") as fh:
            rows |= {(r["variant"], r["seed"]) for r in csv.DictReader(fh)}
    return rows


def _missing(report: Path, results: Path = RESULTS) -> list[str]:
    text = report.read_text(encoding="utf-8")
    folder = results / report.stem
    have = _rows(folder)
    missing = []
    for grid in GRID.finditer(text):
        variants = [v.strip() for v in grid.group(1).split(",")]
        seeds = [s.strip() for s in grid.group(2).split(",")]
        missing += [f"{v}/seed{s}" for v in variants for s in seeds if (v, s) not in have]
    for name in sorted(set(CSV_NAME.findall(text))):
        # "their results.csv" of a folder of grids: <grid>_results.csv counts
        prefixed = list(folder.glob(f"*_{name}")) if folder.is_dir() and "/" not in name else []
        # a path from the repository root (a command line in the report) counts too
        candidates = [results / name, folder / name, results.parents[1] / name, *prefixed]
        if not any(c.is_file() for c in candidates):
            missing.append(name)
    return missing


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.stem)
def test_every_report_has_its_data(report):
    missing = _missing(report)
    if report.stem in KNOWN_MISSING:
        assert missing, f"{report.name}: its data is published now: drop it from KNOWN_MISSING"
        return
    assert not missing, f"{report.name} names data no committed CSV holds: {missing[:8]}"


def test_known_missing_names_reports_that_exist():
    assert set(KNOWN_MISSING) <= {p.stem for p in REPORTS}


def test_the_reader_finds_a_missing_seed(tmp_path):
    """The check itself: a report naming a seed or a CSV that is not there is caught."""
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "results.csv").write_text(
        "task,variant,seed,step,metric,value\nt,ce,0,10,exact_match,0.5\n")
    report = tmp_path / "grid.md"
    report.write_text("Variants: ce (baseline `ce`); seeds: 0, 1; tasks: t.\n")
    assert _missing(report, tmp_path) == ["ce/seed1"]
    report.write_text("Variants: ce (baseline `ce`); seeds: 0; tasks: t.\nsee other.csv\n")
    assert _missing(report, tmp_path) == ["other.csv"]


@pytest.mark.parametrize(("csv_name", "task"), [("results.csv", "char"),
                                               ("gpt2_results.csv", "gpt2")])
def test_number_losses_tables_are_what_the_committed_script_prints(csv_name, task):
    """The tables of number_losses.md (both tokenizers) are the output of its committed script
    on its committed CSVs (docs/results/number_losses/tables.py), line for line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "number_losses_tables", RESULTS / "number_losses" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    rows = tables.read_rows(str(RESULTS / "number_losses" / csv_name), task)
    values, step, seeds = tables.load(rows)
    assert (step, seeds) == (8000, [0, 1, 2, 3, 4])
    lines = (tables.headline(values, seeds) + tables.paired(values, seeds, "ce")
             + tables.paired(values, seeds, "ce_lr1e-3"))
    doc = (RESULTS / "number_losses.md").read_text(encoding="utf-8").splitlines()
    absent = [line for line in lines if line not in doc]
    assert not absent, f"number_losses.md lacks what tables.py prints: {absent[:2]}"


def _paired(csv_path: Path, baseline: str, variant: str, metric: str, step: int):
    """compare_paired (the reports' own test: bootstrap from 5 seeds, paired t below) of
    ``variant`` against ``baseline`` at ``step`` over the seeds both have."""
    from emdlm.experiments.stats import compare_paired

    values: dict[tuple[str, int], float] = {}
    with csv_path.open(newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            if r["metric"] == metric and int(r["step"]) == step:
                values[(r["variant"], int(r["seed"]))] = float(r["value"])
    seeds = sorted({s for v, s in values if v == baseline} & {s for v, s in values if v == variant})
    return compare_paired([values[(baseline, s)] for s in seeds],
                          [values[(variant, s)] for s in seeds]), len(seeds)


def _minus(x: str) -> str:
    return x.replace("-", "\u2212")


# (csv under docs/results, baseline, variant, metric, step, seeds): comparisons that
# docs/results.md quotes with their interval, 3-seed ones with the paired-t interval
QUOTED = [
    ("arithmetic_objectives/results_32k.csv", "ce", "ntil_static", "exact_match", 32000, 3),
    ("arithmetic_objectives/results_32k.csv", "ce", "ntil_static", "exact_match", 4000, 3),
    ("arithmetic_objectives/results_32k.csv", "ce", "ce_lr1e-3", "exact_match", 32000, 3),
    ("math_mixed/results.csv", "ce", "emd", "abs_error_mean", 1000, 3),
    ("arithmetic_how_far_replication/results.csv", "ce", "ntil", "log10_error_mean", 8000, 3),
    ("objectives_at_tuned_lr_replication/results.csv", "ce", "ntil", "log10_error_mean", 8000, 3),
    ("arithmetic_tokenizers/results_llama3_like_16k.csv", "ce_lr1e-3", "ntil_static",
     "log10_error_mean", 16000, 5),
    ("arithmetic_objectives/results_16k.csv", "ce", "emd", "within_5pct", 16000, 5),
]


@pytest.mark.parametrize(("csv_name", "baseline", "variant", "metric", "step", "n"), QUOTED)
def test_results_page_quotes_the_intervals_the_csvs_give(csv_name, baseline, variant, metric,
                                                         step, n):
    """The interval docs/results.md prints is the one the committed CSV gives by the project's
    rule (paired t below 5 seeds, so no percentile bootstrap of 3 differences)."""
    c, seeds = _paired(RESULTS / csv_name, baseline, variant, metric, step)
    assert seeds == n
    assert c.ci_kind == ("t" if n < 5 else "bootstrap")
    text = (f"{c.mean_diff:+.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}], p = {c.p_ttest:.2g}")
    doc = (RESULTS.parent / "results.md").read_text(encoding="utf-8")
    assert _minus(text) in doc, f"results.md does not quote {_minus(text)}"


def test_at_a_glance_counts_its_p_values():
    """The multiplicity note under the at-a-glance table counts the table's p-values."""
    doc = (RESULTS.parent / "results.md").read_text(encoding="utf-8")
    table = doc[doc.index("**At a glance**"):].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    counted = sum(len(re.findall(r"p [=<] \d", row)) for row in rows)
    stated = re.search(r"the (\d+) p-values in this table", doc)
    assert stated is not None and int(stated.group(1)) == counted
