"""The documentation site builds with ``mkdocs build --strict`` (offline), so a page missing
from the site, a bad nav entry, an absolute link or an API entry whose object is gone fails CI;
relative links between the Markdown files are checked by tests/test_readme_snippets.py."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs")


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    from emdlm.config import DataConfig, RunConfig

    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        # no -q: mkdocs then drops warnings before --strict counts them, and passes
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the README is the start page, its docs/ links made relative to the site (the docs/results/
    # folder link -> results.md); the documentation index moves to contents/
    overview = (site / "index.html").read_text()
    assert "Three complete examples" in overview
    assert 'href="data/"' in overview and 'href="docs/' not in overview
    assert 'href="results/"' in overview and "emdlm documentation" not in overview
    assert "emdlm documentation" in (site / "contents" / "index.html").read_text()
    # pages' ../README.md links lead to it
    assert '<a href="../">README</a>' in (site / "data" / "index.html").read_text()
    # offline: no Google Fonts request
    assert "fonts.googleapis.com" not in overview
    # the config reference is generated from the dataclasses: every key is on it
    config = (site / "config" / "index.html").read_text()
    for cls in (RunConfig, DataConfig):
        for f in dataclasses.fields(cls):
            assert f"<code>{f.name}</code>" in config, f.name
    # the API reference rendered the loss contract's docstring, without raw Sphinx roles
    api = (site / "api" / "index.html").read_text()
    assert "needs_teacher" in api
    assert not re.search(r":(class|func|meth|mod|data|attr|exc):", api)
    assert "<code>WeightedCEObjective</code>" in api  # ":class:`~emdlm.ops...Objective`"


@pytest.mark.slow
def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    """mkdocs.yml's validation makes a link to a missing heading a warning, which --strict
    turns into a failed build (mkdocs' default, info, lets it pass)."""
    import yaml

    validation = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["validation"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": str(docs),
                                      "validation": validation}))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "-d", str(tmp_path / "site")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "no-such-heading" in proc.stdout + proc.stderr

