"""MkDocs hooks of the documentation site (``mkdocs.yml``; ``make docs`` serves it).

- The repository's README becomes the site's ``overview.md`` page, served as the start page
  (``index.html``; the documentation index ``index.md`` moves to ``contents/``): its ``docs/...``
  links are made relative to the site, and the pages' ``../README.md`` links point to it.
- The API page's docstrings use Sphinx roles (``:class:`X```, ``:func:`~a.b```), which
  mkdocstrings' Google style leaves as text: they are rendered as the code span alone (``~``
  keeps the last dotted part, as Sphinx does).
- ``config.md``, the config reference, is generated from the config dataclasses of
  :mod:`emdlm.config` (every key, its type, its default and the comment written beside it in the
  source), so it cannot drift from the code.

Not part of the package; excluded from the site (``exclude_docs``).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
OVERVIEW = "overview.md"
CONFIG_PAGE = "config.md"
_README_LINK = re.compile(r"\]\(((?:\.\./)+)README\.md")
# a link to the docs/results/ folder (a listing on GitHub) -> results.md, which links every report
_RESULTS_FOLDER_LINK = re.compile(r"\]\(((?:\.\./)*)results/\)")
# a Sphinx role before the code span it names, as mkdocstrings renders ":class:`~a.B`"
_SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = readme.replace("](docs/results/)", "](results.md)").replace("](docs/", "](")
    overview = File.generated(config, OVERVIEW, content=readme)
    # the README is the site's start page; the documentation index moves to contents/
    overview.dest_uri = "index.html"
    index = files.get_file_from_path("index.md")
    if index is not None:
        index.dest_uri = "contents/index.html"
    files.append(overview)
    files.append(File.generated(config, CONFIG_PAGE, content=config_reference()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """``../README.md`` (from docs/) or ``../../README.md`` (from docs/results/) -> overview;
    a link to the ``results/`` folder -> ``results.md``."""

    def to_overview(match: re.Match[str]) -> str:
        ups = match.group(1).count("../") - 1  # README sits one level above the docs root
        return "](" + "../" * ups + OVERVIEW

    markdown = _RESULTS_FOLDER_LINK.sub(r"](\1results.md)", markdown)
    return _README_LINK.sub(to_overview, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Sphinx roles left in rendered docstrings -> the code span alone."""

    def code(match: re.Match[str]) -> str:
        name = match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2)
        return f"<code>{name}</code>"

    return _SPHINX_ROLE.sub(code, html)


def _field_comments(cls: type) -> dict[str, str]:
    """The comment on each field's line, or the comment lines right above it, in the source."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    found: dict[str, str] = {}
    lines = source.splitlines()
    for number, line in enumerate(lines, start=1):
        match = re.match(r"\s+(\w+)\s*:", line)
        if not match or line.strip().startswith(("def ", "#", '"')):
            continue
        text = [comments[number]] if number in comments and "#" in line else []
        above = number - 1
        block: list[str] = []
        while above in comments and lines[above - 1].strip().startswith("#"):
            block.insert(0, comments[above])
            above -= 1
        found[match.group(1)] = " ".join(block + text)
    return found


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{value!r}`"


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)


def config_reference() -> str:
    """The config reference page: one table per section of :class:`emdlm.config.RunConfig`."""
    from emdlm import config as cfg

    out = [
        "# Config reference",
        "",
        "Every key of an `emdlm train` / `emdlm eval` config, generated from the dataclasses "
        "of `emdlm.config` when the site is built (defaults and comments as in the source). "
        "A config file mirrors these sections; overrides use dotted paths "
        "(`train.max_steps=100`). Unknown keys are an error naming the valid ones.",
        "",
    ]
    sections: list[tuple[str, type]] = [("(top level)", cfg.RunConfig)]
    seen: set[type] = set()
    while sections:
        title, cls = sections.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        comments = _field_comments(cls)
        doc = inspect.getdoc(cls) or ""
        out += [f"## {title}: `{cls.__name__}`", ""]
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [doc.split("\n\n")[0].replace("\n", " "), ""]
        out += ["| key | type | default | what it is |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            hint = hints.get(f.name, f.type)
            inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
            nested = hint if dataclasses.is_dataclass(hint) else (inner[0] if inner else None)
            if nested is not None:
                prefix = f.name if title == "(top level)" else f"{title}.{f.name}"
                sections.append((prefix, nested))
            what = comments.get(f.name, "").replace("|", "\\|")
            out.append(
                f"| `{f.name}` | `{_type_name(hint)}` | {_default(f)} | {what} |"
            )
        out.append("")
    return "\n".join(out)
