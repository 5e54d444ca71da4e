"""tests/INDEX.md, the page that says which test files cover each module, is kept true to the tree.

Read from the files alone (``ast``, nothing imported): the modules are the ``.py`` files under
``src/emdlm`` (a package's ``__init__.py`` counts only when it defines something beyond imports
and ``__all__``), the index lines are ``- <dotted module>: <test file>, <test file>, ...``.
``EMDLM_INDEX_SRC`` points the check at another tree's ``src`` folder (as tests/test_layers.py's
``EMDLM_LAYERS_SRC`` does).
"""

from __future__ import annotations

import ast
import os
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("EMDLM_INDEX_SRC") or ROOT / "src")
TESTS = ROOT / "tests"
INDEX = TESTS / "INDEX.md"
LINE = re.compile(r"^- (?P<module>emdlm(?:\.\w+)*): (?P<files>.*)$")


def _only_reexports(tree: ast.Module) -> bool:
    """True if a module holds nothing but a docstring, imports and ``__all__``."""
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
        return False
    return True


def source_modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted name -> file (relative to ``src``) of every module that needs a line in the index."""
    modules = {}
    for path in sorted((src / "emdlm").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            if _only_reexports(ast.parse(path.read_text(encoding="utf-8"))):
                continue
        modules[".".join(parts)] = path.relative_to(src)
    return modules


def index_lines(text: str) -> tuple[list[tuple[int, str, list[str]]], list[str]]:
    """(line number, module, test files) per index line, and the problems of malformed lines."""
    entries, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("- "):
            continue
        match = LINE.match(line)
        if match is None:
            problems.append(f"tests/INDEX.md:{number}: {line!r} is not "
                            "'- emdlm.<module>: test_<name>.py, ...'")
            continue
        files = [f.strip() for f in match["files"].split(",") if f.strip()]
        entries.append((number, match["module"], files))
    return entries, problems


def mirror_name(module: str, modules: set[str]) -> list[str]:
    """The test file names that mirror ``module``: ``test_<path after emdlm>.py`` joined by
    ``_``, and ``test_<file name>.py`` when no other module has that file name."""
    parts = module.split(".")[1:]
    if not parts:
        return []
    names = [f"test_{'_'.join(parts)}.py"]
    leaf = parts[-1]
    if sum(m.rsplit(".", 1)[-1] == leaf for m in modules) == 1:
        names.append(f"test_{leaf}.py")
    return list(dict.fromkeys(names))


def _suggestion(module: str, modules: set[str]) -> str:
    mirrors = [n for n in mirror_name(module, modules) if (TESTS / n).exists()]
    first = mirrors[0] if mirrors else "test_<the file that covers it>.py"
    return f"- {module}: {first}"


def index_problems(modules: dict[str, Path], text: str) -> list[str]:
    """Every way the index disagrees with ``modules`` and the test folder, one line each."""
    entries, problems = index_lines(text)
    names = set(modules)
    seen = Counter(module for _, module, _ in entries)
    problems += [f"tests/INDEX.md: {module} has {count} lines; keep one"
                 for module, count in seen.items() if count > 1]
    for module in sorted(names - set(seen)):
        problems.append(f"{module} (src/{modules[module]}) has no line in tests/INDEX.md: add "
                        f"'{_suggestion(module, names)}' (the test files that cover it, "
                        "the first being where its tests live)")
    for number, module, files in entries:
        where = f"tests/INDEX.md:{number}"
        if module not in names:
            problems.append(f"{where}: {module} is not a module of src/emdlm (moved, split or "
                            "deleted?): rename the line to the module's new name, or delete it")
            continue
        if not files:
            problems.append(f"{where}: {module} names no test file")
        for name in files:
            if not re.fullmatch(r"test_\w+\.py", name):
                problems.append(f"{where}: {name!r} is not a test file name (test_<name>.py)")
            elif not (TESTS / name).is_file():
                problems.append(f"{where}: tests/{name} does not exist (renamed?): name the "
                                f"file that covers {module}")
        mirrors = [n for n in mirror_name(module, names) if (TESTS / n).is_file()]
        if mirrors and files and files[0] not in mirrors:
            problems.append(f"{where}: {module}'s mirror-named test file tests/{mirrors[0]} "
                            "exists: put it first")
    return problems


def test_every_module_has_a_line_and_every_line_a_module_and_files() -> None:
    problems = index_problems(source_modules(), INDEX.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the check itself, on a toy tree
def _toy_tree(tmp_path: Path) -> dict[str, Path]:
    pkg = tmp_path / "emdlm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Docs."""\nfrom emdlm.alpha import f\n__all__ = ["f"]\n')
    (pkg / "alpha.py").write_text("def f():\n    return 1\n")
    (pkg / "sub" / "__init__.py").write_text("REGISTRY = {}\n")
    (pkg / "sub" / "index.py").write_text("X = 1\n")
    return source_modules(tmp_path)


def test_reexport_only_packages_need_no_line_packages_with_code_do(tmp_path: Path) -> None:
    assert set(_toy_tree(tmp_path)) == {"emdlm.alpha", "emdlm.sub", "emdlm.sub.index"}


def test_a_missing_module_says_which_line_to_add(tmp_path: Path) -> None:
    modules = _toy_tree(tmp_path)
    text = "- emdlm.alpha: test_layers.py\n- emdlm.sub: test_layers.py\n"
    (problem,) = index_problems(modules, text)
    assert problem.startswith("emdlm.sub.index (src/emdlm/sub/index.py) has no line")
    # tests/test_test_index.py is this file: the mirror of a module emdlm.test_index
    assert "'- emdlm.sub.index: test_<the file that covers it>.py'" in problem


def test_a_gone_module_a_missing_file_a_duplicate_and_a_bad_line_are_named(
        tmp_path: Path) -> None:
    modules = _toy_tree(tmp_path)
    text = ("- emdlm.alpha: test_layers.py, test_no_such_file.py\n"
            "- emdlm.sub: test_layers.py\n- emdlm.sub: test_layers.py\n"
            "- emdlm.sub.index: layers.py\n"
            "- emdlm.beta: test_layers.py\n"
            "- emdlm.alpha test_layers.py\n")
    problems = "\n".join(index_problems(modules, text))
    assert "tests/INDEX.md:1: tests/test_no_such_file.py does not exist" in problems
    assert "emdlm.sub has 2 lines" in problems
    assert "tests/INDEX.md:4: 'layers.py' is not a test file name" in problems
    assert "tests/INDEX.md:5: emdlm.beta is not a module of src/emdlm" in problems
    assert "tests/INDEX.md:6: '- emdlm.alpha test_layers.py' is not" in problems


def test_the_mirror_named_file_goes_first(tmp_path: Path) -> None:
    pkg = tmp_path / "emdlm"
    pkg.mkdir()
    (pkg / "layers.py").write_text("X = 1\n")  # its mirror, tests/test_layers.py, exists
    modules = source_modules(tmp_path)
    problems = index_problems(modules, "- emdlm.layers: test_cli.py, test_layers.py\n")
    assert problems == ["tests/INDEX.md:1: emdlm.layers's mirror-named test file "
                        "tests/test_layers.py exists: put it first"]
    assert index_problems(modules, "- emdlm.layers: test_layers.py, test_cli.py\n") == []
