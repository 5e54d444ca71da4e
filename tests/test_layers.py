"""Layers that only look down (docs/architecture.md): no import circle, no import from a lower
layer up to a higher one.

The import graph is read from the source with ``ast`` (nothing is imported): ``import`` and
``from ... import`` at any depth (inside functions too), relative imports resolved, an import of
a package counted as an import of its ``__init__``. ``EMDLM_LAYERS_SRC`` points the check at
another tree's ``src`` folder (e.g. an older checkout: ``EMDLM_LAYERS_SRC=/old/src pytest
tests/test_layers.py``); by default it reads this repository's ``src``.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("EMDLM_LAYERS_SRC") or ROOT / "src")

# Bottom to top. A module may import modules of its own layer (without a circle) or of the layers
# below it, never above. "pkg.*" is the package and every module in it. Keep in step with
# docs/architecture.md (checked below).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("emdlm._files", "emdlm._output", "emdlm._extras", "emdlm.yaml_io",
                     "emdlm.json_io", "emdlm.domains",
                     "emdlm.objective_specs",
                     "emdlm.eval_kinds", "emdlm.config.*", "emdlm.weights")),
    ("vocabularies", ("emdlm.numbers", "emdlm.number_spans", "emdlm.tokenizers")),
    ("functional", ("emdlm.functional.*",)),
    ("ops", ("emdlm.ops.*",)),
    ("losses", ("emdlm.losses.*",)),
    ("objectives", ("emdlm.objectives",)),
    ("integrations", ("emdlm.integrations.*",)),
    ("answers", ("emdlm.math_answers", "emdlm.metrics.*")),
    ("tasks", ("emdlm.tasks.*",)),
    ("data", ("emdlm.number_scope", "emdlm.data", "emdlm.datasets.*", "emdlm.generation",
              "emdlm.decoding", "emdlm.evaluation", "emdlm.eval_outputs", "emdlm.contact_sheet")),
    ("models", ("emdlm.models", "emdlm.vlm.*")),
    # the framework plugins (Axolotl, ms-swift, LLaMA-Factory) read number scopes (data); their
    # package's __init__ (a docstring) sits with its lowest modules, in integrations
    ("frameworks", ("emdlm.integrations.framework_objective", "emdlm.integrations.axolotl",
                    "emdlm.integrations.swift", "emdlm.integrations.llamafactory")),
    ("training", ("emdlm.training.*",)),
    ("experiments", ("emdlm.experiments.*",)),
    ("cli", ("emdlm.cli", "emdlm._console")),
    ("package", ("emdlm",)),
]


def layer_of(module: str) -> int | None:
    """Index of ``module``'s layer in :data:`LAYERS` (the exact name wins over a ``pkg.*``)."""
    for exact in (True, False):
        for index, (_, patterns) in enumerate(LAYERS):
            for pattern in patterns:
                if exact and pattern == module:
                    return index
                if not exact and pattern.endswith(".*") and (
                    module == pattern[:-2] or module.startswith(pattern[:-1])
                ):
                    return index
    return None


def modules_of(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src`` (a package is its __init__)."""
    mods: dict[str, Path] = {}
    for file in sorted(src.rglob("*.py")):
        parts = list(file.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = file
    return mods


def import_graph(src: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, for the modules under ``src``."""
    mods = modules_of(src)

    def resolve(name: str) -> str | None:  # the longest known module that ``name`` is in
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, dict[str, int]] = {}
    for mod, file in mods.items():
        package = mod if file.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base]) if base else ".".join(up)
                # ``from pkg import name``: the submodule pkg.name if there is one, else pkg
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is not None and found != mod:
                    edges[found] = min(edges.get(found, node.lineno), node.lineno)
        graph[mod] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """``"a (layer) imports b (higher layer), line n"`` for each import that climbs."""
    out = []
    for mod, edges in sorted(graph.items()):
        here = layer_of(mod)
        for target, line in sorted(edges.items()):
            there = layer_of(target)
            if here is not None and there is not None and there > here:
                out.append(f"{mod} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]}), "
                           f"line {line}")
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    assert (SRC / "emdlm").is_dir(), f"no emdlm package under {SRC}"
    return import_graph(SRC)


def test_every_module_has_a_layer(graph):
    missing = [m for m in graph if layer_of(m) is None]
    assert not missing, f"give each a layer in LAYERS and docs/architecture.md: {missing}"


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_reaches_a_higher_layer(graph):
    found = upward_imports(graph)
    assert not found, "imports from a lower layer up:\n" + "\n".join(found)


#: Packages whose modules sit in more than one layer, and why (every other package holds one role).
SPANNING_PACKAGES = {
    "emdlm.integrations": "the framework plugins read number scopes (data); the loss glue does not",
}


def test_each_package_sits_in_one_layer(graph):
    """A folder holds modules of one role: every module of a subpackage of emdlm is in one layer
    (dataset readers in datasets, box geometry in metrics), save :data:`SPANNING_PACKAGES`."""
    layers: dict[str, set[str]] = {}
    for module in graph:
        parts = module.split(".")
        if len(parts) >= 2 and (SRC / "emdlm" / parts[1] / "__init__.py").is_file():
            index = layer_of(module)
            if index is not None:
                layers.setdefault(".".join(parts[:2]), set()).add(LAYERS[index][0])
    spread = {pkg: sorted(names) for pkg, names in sorted(layers.items())
              if len(names) > 1 and pkg not in SPANNING_PACKAGES}
    assert not spread, f"packages across layers (split them by role): {spread}"
    for pkg in SPANNING_PACKAGES:
        assert len(layers.get(pkg, ())) > 1, f"{pkg} sits in one layer now: drop it from the list"


def test_architecture_doc_lists_every_layer_and_module():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(emdlm[\w.]*)`", doc))
    missing = sorted(m for m in modules_of(ROOT / "src") if m not in named)
    assert not missing, f"docs/architecture.md names no line for: {missing}"
    for name, _ in LAYERS:
        assert re.search(rf"^#+ .*\b{re.escape(name)}\b", doc, re.M | re.I), name


def test_the_check_sees_circles_and_climbs_inside_functions(tmp_path):
    """The reader itself: a relative import inside a function closes a circle and climbs."""
    pkg = tmp_path / "emdlm"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "numbers.py").write_text("def f():\n    from .ops import fast\n")
    (pkg / "ops" / "fast.py").write_text("from emdlm import numbers\n")
    g = import_graph(tmp_path)
    assert g["emdlm.numbers"] == {"emdlm.ops.fast": 2}
    assert g["emdlm.ops.fast"] == {"emdlm.numbers": 1}
    assert circles(g) == [["emdlm.numbers", "emdlm.ops.fast"]]
    assert upward_imports(g) == [
        "emdlm.numbers (vocabularies) imports emdlm.ops.fast (ops), line 2"
    ]
