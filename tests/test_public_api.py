"""Every name the package advertises resolves, and importing emdlm stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import emdlm


def test_every_exported_name_resolves() -> None:
    for name in emdlm.__all__:
        assert getattr(emdlm, name) is not None, name


@pytest.mark.slow
def test_import_does_not_pull_transformers() -> None:
    code = "import sys, emdlm; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_api_reference_documents_every_exported_name() -> None:
    """docs/api.md (the generated reference) has a ``::: module.Name`` entry for each name
    ``emdlm`` exports, at the module that defines it, and no entry that does not resolve."""
    import importlib
    import re
    from pathlib import Path

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    entries = set(re.findall(r"^::: ([\w.]+)$", api, flags=re.M))
    exported = {name: emdlm._EXPORTS[name] for name in emdlm.__all__ if name in emdlm._EXPORTS}
    missing = sorted(name for name, module in exported.items() if f"{module}.{name}" not in entries)
    assert not missing, f"add to docs/api.md: {missing}"
    for entry in sorted(entries):
        module, _, name = entry.rpartition(".")
        assert hasattr(importlib.import_module(module), name), f"docs/api.md: {entry}"
