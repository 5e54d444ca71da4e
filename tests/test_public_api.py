"""Every name the package advertises resolves, and importing emdlm stays light."""

from __future__ import annotations

import subprocess
import sys

import emdlm


def test_every_exported_name_resolves() -> None:
    for name in emdlm.__all__:
        assert getattr(emdlm, name) is not None, name


def test_import_does_not_pull_transformers() -> None:
    code = "import sys, emdlm; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
