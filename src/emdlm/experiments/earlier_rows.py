"""Rows of an earlier run of the same grid, read back from its ``results.csv``.

A long grid may outlive the machine it ran on: its cells' folders are gone, the
``results.csv`` its report wrote (committed beside the report) is what is left. ``emdlm
experiment --earlier-results PATH`` reads that file and counts each cell it holds as finished,
with the rows as written, wherever the cell has no finished folder here; a cell finished here
is read from its folder and the file's rows for it are passed over (said in the report). The
report then covers both, and the ``results.csv`` it writes holds both, so a grid can be carried
across any number of machines by passing the last file each time.

What cannot be checked for such a cell, and what the report says of it: its outputs are not
here (so neither their wholeness, nor the definition it was trained with,
:mod:`emdlm.experiments.cell_record`, is re-checked) and nothing read per answer (error
distributions, digit places, loss components, the constant-answer floor) covers it.

Everything in the file is checked before it is used (:class:`EarlierRowsError`, naming the
file, the line and the problem): the header, every field, no row twice, and every row a cell
of this grid: rows of a cell the grid does not have would otherwise be dropped unsaid.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from emdlm.config import ConfigError
from emdlm.experiments.grid import Cell
from emdlm.experiments.results import CSV_FIELDS, GridRead, Row

MAX_NAMED_CELLS = 4  # cells named in a message (the rest are counted)


class EarlierRowsError(ConfigError):
    """An earlier ``results.csv`` that cannot be used as it is (the file, line and why)."""


@dataclass
class EarlierRows:
    """The earlier file's rows by cell key, and where they came from."""

    path: Path
    by_cell: dict[str, list[Row]] = field(default_factory=dict)


def _named(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:MAX_NAMED_CELLS])
    more = len(keys) - MAX_NAMED_CELLS
    return shown + (f" (and {more} more)" if more > 0 else "")


def _int_field(text: str, name: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise EarlierRowsError(f"{where}: {name} {text!r} is not an integer") from None


def _row(fields: list[str], where: str) -> Row:
    if len(fields) != len(CSV_FIELDS):
        raise EarlierRowsError(f"{where}: {len(fields)} fields, expected {len(CSV_FIELDS)} "
                               f"({', '.join(CSV_FIELDS)})")
    task, variant, seed, step, metric, value = fields
    if not task or not variant or not metric:
        raise EarlierRowsError(f"{where}: task, variant and metric must not be empty")
    try:
        number = float(value)
    except ValueError:
        raise EarlierRowsError(f"{where}: value {value!r} is not a number") from None
    if math.isinf(number):
        raise EarlierRowsError(f"{where}: value {value!r} is infinite (results.csv holds "
                               "finite values and nan)")
    return Row(task, variant, _int_field(seed, "seed", where), _int_field(step, "step", where),
               metric, number)


def read_earlier_rows(path: Path, cells: Sequence[Cell]) -> EarlierRows:
    """Read and check ``path`` (a ``results.csv`` as :func:`emdlm.experiments.results.write_csv`
    writes it) against the grid's ``cells``; EarlierRowsError for the first problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EarlierRowsError(f"--earlier-results {path} cannot be read: {err}") from err
    lines = list(csv.reader(text.splitlines()))
    if not lines or tuple(lines[0]) != CSV_FIELDS:
        got = ",".join(lines[0]) if lines else "an empty file"
        raise EarlierRowsError(f"{path}: not a results.csv: its header is {got!r}, expected "
                               f"{','.join(CSV_FIELDS)!r}")
    keys = {c.key for c in cells}
    out = EarlierRows(path)
    seen: set[tuple[str, int, str]] = set()
    unknown: dict[str, int] = {}
    for number, fields in enumerate(lines[1:], start=2):
        if not fields:
            continue
        row = _row(fields, f"{path}, line {number}")
        key = f"{row.task}/{row.variant}/seed{row.seed}"
        if key not in keys:
            unknown[key] = unknown.get(key, 0) + 1
            continue
        if (key, row.step, row.metric) in seen:
            raise EarlierRowsError(f"{path}, line {number}: {key} step {row.step} "
                                   f"{row.metric} appears twice")
        seen.add((key, row.step, row.metric))
        out.by_cell.setdefault(key, []).append(row)
    if unknown:
        raise EarlierRowsError(
            f"{path} holds rows of {len(unknown)} cell(s) this grid does not have "
            f"({sum(unknown.values())} rows: {_named(sorted(unknown))}): is it this grid's "
            "file, with the same tasks, variants and seeds?")
    return out


def add_earlier_rows(grid: GridRead, cells: Sequence[Cell], earlier: EarlierRows) -> GridRead:
    """``grid`` with the earlier rows of every cell that has none here: neither finished nor
    left out nor refused (a folder here that holds a problem is reported as such, not papered
    over). Sets ``grid.earlier`` (keys taken from the file, grid order) and
    ``grid.earlier_passed_over`` (keys in the file, read from their folders here instead)."""
    here = {c.key for c in grid.finished} | set(grid.left_out) | set(grid.refused)
    for cell in cells:
        rows = earlier.by_cell.get(cell.key)
        if rows is None:
            continue
        if cell.key in here:
            grid.earlier_passed_over.append(cell.key)
            continue
        grid.rows += rows
        grid.earlier.append(cell.key)
    return grid


def earlier_note(grid: GridRead, source: Path | None) -> str:
    """The report's sentence on cells read from an earlier results.csv ('' when none)."""
    if source is None:
        return ""
    text = (f" {len(grid.earlier)} of the finished cells were read from `{source}` (an earlier "
            "run's results.csv, its rows as written: their folders are not here, so their "
            "outputs and training definitions were not re-checked, their wall times are not "
            "in the sum, and what is read per answer (error distributions, digit places, loss "
            "components, the constant-answer floor) does not cover them).")
    if grid.earlier_passed_over:
        text += (f" {len(grid.earlier_passed_over)} cell(s) of that file were read from their "
                 f"folders here instead: {_named(grid.earlier_passed_over)}.")
    return text
