"""The fast lane (``make test-fast``: ``pytest -m "not slow"``) holds no test that starts a
process or compiles with ``torch.compile``: every such test is marked ``slow`` (the whole suite,
``make test`` and CI, still runs them).

Read from the test files with ``ast`` (nothing imported). A test starts a process or compiles
when its body, a function of its own file that it calls (at any depth), or a fixture of its own
file that it takes, calls ``subprocess.run`` / ``Popen`` / ``check_output`` / ``check_call`` /
``call``, ``torch.compile`` or ``torch._dynamo.explain`` / ``optimize``, or when it carries the
``needs_dynamo`` mark (tests/_compile_marks.py: it compiles, maybe through another module). It is
marked ``slow`` by a decorator, its class's decorator, or the file's ``pytestmark``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}
COMPILE_CALLS = {("torch", "compile"), ("_dynamo", "explain"), ("_dynamo", "optimize")}


def _dotted(node: ast.AST) -> tuple[str, ...]:
    """``a.b.c`` -> ("a", "b", "c"); anything else -> ()."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return (node.id, *reversed(parts))
    return ()


def _marks(expressions: list[ast.expr], aliases: dict[str, str]) -> set[str]:
    """The mark names among decorators / a ``pytestmark`` value: "slow", "needs_dynamo", ...
    (``pytest.mark.<name>`` gives <name>; a bare name gives the mark it stands for, or itself)."""
    names = set()
    for expr in expressions:
        for node in ast.walk(expr):
            dotted = _dotted(node)
            if len(dotted) >= 2 and dotted[-2] == "mark":
                names.add(dotted[-1])
            elif len(dotted) == 1:
                names.add(aliases.get(dotted[0], dotted[0]))
    return names


class _File:
    """One test file: its functions, fixtures, marks and what each function calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.from_subprocess = {alias.asname or alias.name
                                for node in ast.walk(self.tree)
                                if isinstance(node, ast.ImportFrom) and node.module == "subprocess"
                                for alias in node.names}
        # ``slow = pytest.mark.slow`` and the like: a name that stands for a mark
        self.aliases: dict[str, str] = {}
        self.module_marks: set[str] = set()
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name):
                target = node.targets[0].id
                if target == "pytestmark":
                    self.module_marks = _marks([node.value], self.aliases)
                elif isinstance(node.value, ast.Attribute) and _dotted(node.value)[-2:-1] == (
                        "mark",):
                    self.aliases[target] = _dotted(node.value)[-1]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = node

    def _starts_or_compiles_here(self, fn: ast.AST) -> str | None:
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func)
            if (dotted[:1] == ("subprocess",) and dotted[-1] in SUBPROCESS_CALLS) or (
                    len(dotted) == 1 and dotted[0] in self.from_subprocess):
                return ".".join(dotted)
            if len(dotted) >= 2 and tuple(dotted[-2:]) in COMPILE_CALLS:
                return ".".join(dotted)
        return None

    def _reached(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
        """What ``fn`` (or a function / fixture of this file it reaches) calls that starts a
        process or compiles, as "<function>: <call>"; None if nothing."""
        todo, seen = [fn], {fn.name}
        while todo:
            current = todo.pop()
            found = self._starts_or_compiles_here(current)
            if found:
                return found if current is fn else f"{current.name}() -> {found}"
            names = {node.id for node in ast.walk(current) if isinstance(node, ast.Name)}
            names |= {a.arg for a in current.args.args}  # fixtures taken by argument
            for name in sorted(names - seen):
                if name in self.functions:
                    seen.add(name)
                    todo.append(self.functions[name])
        return None

    def unmarked(self) -> list[str]:
        """"<file>::<test>: <why>" for every test that should be ``slow`` and is not."""
        problems = []
        holders: list[tuple[list[ast.expr], list[ast.AST]]] = [([], self.tree.body)]
        holders += [(node.decorator_list, node.body) for node in self.tree.body
                    if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
        for class_marks, body in holders:
            for fn in body:
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or not (
                        fn.name.startswith("test")):
                    continue
                marks = self.module_marks | _marks(class_marks + fn.decorator_list, self.aliases)
                if "slow" in marks:
                    continue
                why = self._reached(fn)
                if why is None and "needs_dynamo" in marks:
                    why = "the needs_dynamo mark (it compiles)"
                if why is not None:
                    problems.append(f"tests/{self.path.name}::{fn.name}: {why}; mark it "
                                    "@pytest.mark.slow (or the file: pytestmark)")
        return problems


def unmarked_tests(folder: Path = TESTS) -> list[str]:
    return [p for path in sorted(folder.glob("test_*.py")) for p in _File(path).unmarked()]


def test_every_process_starting_or_compiling_test_is_marked_slow() -> None:
    problems = unmarked_tests()
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the check itself, on toy files
def _toy(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "test_toy.py").write_text(text)
    return unmarked_tests(tmp_path)


def test_a_subprocess_through_a_helper_or_fixture_is_found(tmp_path: Path) -> None:
    problems = _toy(tmp_path, (
        "import subprocess\nimport pytest\nfrom subprocess import Popen\n"
        "def _helper():\n    return _deeper()\n"
        "def _deeper():\n    subprocess.run(['true'])\n"
        "@pytest.fixture\ndef started():\n    return Popen(['true'])\n"
        "def test_direct():\n    subprocess.check_output(['true'])\n"
        "def test_helper():\n    _helper()\n"
        "def test_fixture(started):\n    pass\n"
        "def test_plain():\n    assert 1\n"
        "@pytest.mark.slow\ndef test_marked():\n    subprocess.run(['true'])\n"))
    assert problems == [
        "tests/test_toy.py::test_direct: subprocess.check_output; mark it @pytest.mark.slow "
        "(or the file: pytestmark)",
        "tests/test_toy.py::test_helper: _deeper() -> subprocess.run; mark it "
        "@pytest.mark.slow (or the file: pytestmark)",
        "tests/test_toy.py::test_fixture: started() -> Popen; mark it @pytest.mark.slow "
        "(or the file: pytestmark)",
    ]


def test_compiling_and_needs_dynamo_tests_are_found_marks_of_file_and_class_count(
        tmp_path: Path) -> None:
    compiling = ("import torch\nimport pytest\nfrom _compile_marks import needs_dynamo\n"
                 "def test_compiles():\n    torch.compile(abs)\n"
                 "def test_explains():\n    torch._dynamo.explain(abs)(1)\n"
                 "@needs_dynamo\ndef test_elsewhere():\n    pass\n"
                 "@pytest.mark.slow\nclass TestSlow:\n"
                 "    def test_in_class(self):\n        torch.compile(abs)\n")
    assert [p.split(":")[2] for p in _toy(tmp_path, compiling)] == [
        "test_compiles", "test_explains", "test_elsewhere"]
    assert _toy(tmp_path, "import pytest\npytestmark = [pytest.mark.slow]\n" + compiling) == []
