"""Every list of objectives, eval kinds and demo tasks that is written out (command help,
docstrings, docs pages) holds exactly what its registry holds; the command help is derived."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from emdlm import eval_kinds, objective_specs
from emdlm.cli import app
from emdlm.config import EvalConfig, ObjectiveConfig
from emdlm.eval_kinds import EVAL_KINDS
from emdlm.objective_specs import OBJECTIVE_NAMES, OBJECTIVE_SPECS

ROOT = Path(__file__).resolve().parents[1]


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"},
                                terminal_width=400)
    assert result.exit_code == 0, result.output
    return result.output


def _listed(text: str) -> list[str]:
    """The names of an ``a | b | c`` list."""
    return [name.strip() for name in text.split("|")]


def _option_help(output: str, option: str) -> str:
    line = next(line for line in output.splitlines() if option in line)
    return line.split(option, 1)[1]


def test_train_help_names_every_objective_and_the_class_form() -> None:
    text = _option_help(_help("train"), "--objective")
    names = re.findall(r"[\w<>:]+(?= \||\s+\(a loss)", text)
    assert names == [*OBJECTIVE_NAMES, "<module>:<Class>"]


def test_eval_help_names_every_kind() -> None:
    listed = re.search(r"\w+(?: \| \w+)+", _option_help(_help("eval"), "--kind"))
    assert listed is not None and _listed(listed.group(0)) == list(EVAL_KINDS)


def test_demo_help_names_every_demo_task() -> None:
    from emdlm.training.demo import DEMO_TASKS

    text = _option_help(_help("demo"), "--task")
    assert re.findall(r"(\w+) \(tiny", text) == list(DEMO_TASKS)


def test_the_cli_page_lists_the_registered_objectives() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    listed = re.search(r"\(`(ce \|[^`]*)`", doc)
    assert listed is not None
    assert _listed(listed.group(1)) == list(OBJECTIVE_NAMES)
    numeric = re.search(r"for the numeric ones\s*\(([^)]*)\)", doc)
    assert numeric is not None
    numeric_names = [name for name, spec in OBJECTIVE_SPECS.items() if spec.numeric]
    assert re.findall(r"`(\w+)`", numeric.group(1)) == numeric_names


def test_the_objectives_page_table_has_every_objectives_class() -> None:
    doc = (ROOT / "docs" / "objectives.md").read_text(encoding="utf-8")
    table = doc.split("## The objectives", 1)[1].split("\n## ", 1)[0]
    classes = set(re.findall(r"^\| [^|]+ \| `emdlm\.(\w+)`", table, re.M))
    assert classes == {spec.class_name for spec in OBJECTIVE_SPECS.values()}


def _first_column(doc: str, header: str) -> list[str]:
    rows = re.findall(r"^\| *(\w+) *\|", doc.split(header, 1)[1], re.M)
    return [r for r in rows if not set(r) <= {"-"}]


def test_the_registry_modules_tables_are_the_registries() -> None:
    assert _first_column(objective_specs.__doc__ or "", "| name") == list(OBJECTIVE_NAMES)
    assert _first_column(eval_kinds.__doc__ or "", "| kind") == list(EVAL_KINDS)


def test_the_config_docstrings_name_every_kind() -> None:
    doc = EvalConfig.__doc__ or ""
    named = [k for k in re.findall(r"\b(\w+)\b(?= \||\s+\()", doc) if k in EVAL_KINDS]
    assert sorted(set(named)) == sorted(EVAL_KINDS)
    assert "OBJECTIVE_SPECS" in (ObjectiveConfig.__doc__ or "")
