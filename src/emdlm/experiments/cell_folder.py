"""A grid cell's folder: what it holds, when it is finished, its time ledger and its lock.

Cell folder ``<output_dir>/<task>/<variant>/seed<k>/``:

* ``train/``: the training run (``checkpoint-<step>`` folders, final model, train_log.jsonl).
* ``eval/step-<N>/``: ``metrics.json`` and ``predictions.jsonl`` of the model at step N
  (metrics.json written last and counting the rows: a step is evaluated when it agrees with
  them, :func:`emdlm.eval_outputs.eval_outputs_problem`; otherwise it is evaluated again).
* ``eval/<name>/step-<N>/``: the same for each ``eval.extra`` evaluation of the final model.
* ``cell_done.json``: written last; a cell whose record parses and whose evaluations are whole
  (:func:`cell_problem`) is skipped by later invocations, any other runs again. Its
  ``wall_s`` is the cell's time over every invocation that worked on it (see ``wall_time.json``);
  ``resumed`` says an earlier invocation did part of the work, ``wall_complete`` whether the
  earlier invocations' time is in ``wall_s`` (False for a cell begun before the ledger existed).
* ``wall_time.json``: the cell's time ledger, ``{"earlier_s", "this_s"}``, rewritten every
  ``WALL_HEARTBEAT_S`` seconds while the cell runs, so a killed invocation (a session stop,
  SIGKILL) leaves its time behind, short by at most one heartbeat.
* ``error.txt``: the traceback of a failed cell (the other cells go on).
* ``cell.lock`` and ``cell.holder.json``: the cell's lock and its holder's record (pid, host,
  heartbeat), held by the process working on the cell, on whichever host
  (:mod:`emdlm.experiments.cell_lock`); a second invocation leaves a held cell alone and
  reports it.

Every file the runner writes is written whole (a temporary file renamed into place,
:func:`emdlm._files.atomic_write`): a killed process leaves the old file or the new one.

"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from emdlm._files import atomic_write
from emdlm.experiments.grid import Cell

CELL_DONE = "cell_done.json"
ERROR_FILE = "error.txt"
LOCK_FILE = "cell.lock"
EVAL_DIR = "eval"
WALL_TIME_FILE = "wall_time.json"
WALL_HEARTBEAT_S = 30.0


def eval_dir(cell_folder: Path, step: int, extra: str | None = None) -> Path:
    """``<cell>/eval/step-<N>``, or ``<cell>/eval/<extra>/step-<N>`` for an extra evaluation."""
    base = cell_folder / EVAL_DIR
    return (base if extra is None else base / extra) / f"step-{step}"


def final_predictions(cell_folder: Path) -> Path | None:
    """``predictions.jsonl`` of a cell's last evaluated step (None when no step has one)."""
    files = sorted((cell_folder / EVAL_DIR).glob("step-*/predictions.jsonl"),
                   key=lambda p: int(p.parent.name.split("-")[-1]))
    return files[-1] if files else None


def write_whole(path: Path, text: str) -> None:
    """``path`` := ``text``, through a temporary file renamed into place: never half-written."""
    with atomic_write(path) as fh:
        fh.write(text)


def eval_folders(cell: Cell, record: dict[str, Any]) -> list[Path]:
    """Every evaluation folder a finished cell must have whole: the ``eval/step-<N>`` (and
    ``eval/<extra>/step-<N>``) folders on disk and those of the steps ``record`` lists."""
    folders = set((cell.folder / EVAL_DIR).glob("step-*"))
    for name in cell.extra_evals:
        folders.update((cell.folder / EVAL_DIR / name).glob("step-*"))
    steps = record.get("evaluated_steps")
    if isinstance(steps, list):
        folders.update(eval_dir(cell.folder, s) for s in steps if isinstance(s, int))
    return sorted(folders)


def read_cell_record(cell_folder: Path) -> dict[str, Any] | None:
    """The cell's ``cell_done.json`` as a dict, or None when it is missing, torn (an older
    emdlm wrote it in place) or not a JSON object."""
    try:
        record = json.loads((cell_folder / CELL_DONE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def cell_problem(cell: Cell) -> str | None:
    """Why ``cell`` is not finished, in one line; None when it is.

    Finished: ``cell_done.json`` parses as a JSON object, and every evaluation folder of the
    cell holds a whole evaluation (:func:`emdlm.eval_outputs.eval_outputs_problem`: metrics.json
    present and counting the rows of predictions.jsonl). Older emdlm versions took "both
    files exist" as evaluated, so a cell they marked done may hold a cut-off predictions.jsonl:
    such a cell is not finished (the runner evaluates it again, the report leaves it out).
    """
    from emdlm.eval_outputs import eval_outputs_problem

    done = cell.folder / CELL_DONE
    if not done.is_file():
        return f"{done} is missing: the cell has not finished"
    record = read_cell_record(cell.folder)
    if record is None:
        return f"{done} is not a JSON object (a cut-off write?)"
    for folder in eval_folders(cell, record):
        problem = eval_outputs_problem(folder)
        if problem is not None:
            return problem
    return None


def saved_checkpoints(train_dir: Path) -> dict[int, Path]:
    """step -> checkpoint folder, for every checkpoint-<step> the run kept."""
    out: dict[int, Path] = {}
    for p in train_dir.glob("checkpoint-*"):
        tail = p.name.split("-")[-1]
        if p.is_dir() and tail.isdigit():
            out[int(tail)] = p
    return out



class WallLedger:
    """The time one cell has taken over all invocations, kept in ``wall_time.json``.

    A daemon thread rewrites the file every ``heartbeat_s`` seconds (atomically: temp file +
    ``os.replace``), so an invocation killed without warning still leaves its time for the
    next one to add. ``complete`` is False when an earlier invocation left work (a train
    folder) but no ledger: its time is unknown."""

    def __init__(self, folder: Path, *, resumed: bool, heartbeat_s: float = WALL_HEARTBEAT_S):
        self.path = folder / WALL_TIME_FILE
        self.heartbeat_s = heartbeat_s
        self.earlier_s = 0.0
        self.complete = True
        if self.path.is_file():
            try:
                old = json.loads(self.path.read_text())
                self.earlier_s = float(old["earlier_s"]) + float(old["this_s"])
            except (ValueError, KeyError, TypeError):  # torn or foreign file: time unknown
                self.complete = False
        elif resumed:
            self.complete = False
        self._start = time.perf_counter()
        self._end: float | None = None  # set when the invocation's work ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    @property
    def this_s(self) -> float:
        end = self._end if self._end is not None else time.perf_counter()
        return end - self._start

    @property
    def total_s(self) -> float:
        return self.earlier_s + self.this_s

    def write(self) -> None:
        write_whole(self.path, json.dumps({"earlier_s": self.earlier_s, "this_s": self.this_s})
                     + "\n")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):  # a full disk must not kill the cell
                self.write()

    def __enter__(self) -> WallLedger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = time.perf_counter()
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.write()
