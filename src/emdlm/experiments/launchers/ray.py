"""``launcher: ray``: each cell one Ray task (https://docs.ray.io/en/latest/ray-core/tasks.html).

Options: ``address`` (passed to ``ray.init``: ``auto``, ``ray://head:10001``, ``local`` for a new
local cluster; default Ray's own rule: ``RAY_ADDRESS``, else the cluster last started on this
machine, else a new local one; a process that already called ``ray.init`` keeps its cluster),
``num_cpus`` per cell (default ``threads_per_worker``), ``num_gpus`` per cell (default 0) and
``max_retries`` (default 3): how many times Ray runs a cell again whose worker process died
(a node lost, a process killed); the retry resumes the cell from its newest checkpoint, as
the next invocation would (https://docs.ray.io/en/latest/ray-core/fault_tolerance/tasks.html).
An exception inside a cell is not retried: the cell fails with its ``error.txt`` as locally.

Every node must see the grid's ``output_dir`` at the same path and have emdlm installed; the
outcomes come back to this process, which builds the report from the folders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable
from typing import Any

from emdlm.experiments.cell_folder import ERROR_FILE, write_whole
from emdlm.experiments.grid import Cell, Experiment
from emdlm.experiments.launchers.base import (
    Launcher,
    non_negative_int,
    non_negative_number,
    option,
    require,
    text,
)
from emdlm.experiments.launchers.cell_task import run_cell_task
from emdlm.experiments.runner import CellOutcome, run_cells

#: how often the dispatch loop returns from ``ray.wait`` to Python (where signals are handled)
WAIT_POLL_S = 0.5
#: how long a cancelled grid waits for its running cells to save their checkpoint
CANCEL_GRACE_S = 120.0


@dataclasses.dataclass(frozen=True)
class RayLauncher(Launcher):
    """The cells as Ray tasks, ``num_cpus`` / ``num_gpus`` each, retried ``max_retries`` times
    when their worker dies."""

    name = "ray"
    address: str | None = option(None, text, optional=True)
    num_cpus: float | None = option(None, non_negative_number, optional=True)
    num_gpus: float = option(0, non_negative_number)
    max_retries: int = option(3, non_negative_int)

    def check_installed(self) -> None:
        require("ray", self.name)

    def run(self, exp: Experiment, cells: list[Cell], *, progress: bool) -> list[CellOutcome]:
        ray = require("ray", self.name)
        threads = exp.threads_per_worker
        started: list[bool] = []  # whether this call started Ray (and so shuts it down)

        def dispatch(todo: list[Cell], record: Callable[[CellOutcome, int], None]) -> None:
            if not todo:
                return  # every cell finished earlier: no cluster needed
            if not ray.is_initialized():
                _init_keeping_sigterm(ray, self.address)
                started.append(True)
            task = ray.remote(run_cell_task).options(
                num_cpus=threads if self.num_cpus is None else self.num_cpus,
                num_gpus=self.num_gpus, max_retries=self.max_retries, retry_exceptions=False,
            )
            _dispatch(ray, task, todo, threads, record)

        try:
            # workers: what the progress display counts as running (Ray may run fewer)
            return run_cells(cells, workers=max(1, len(cells)), threads=threads,
                             progress=progress, dispatch=dispatch)
        finally:
            if started:
                ray.shutdown()


def _init_keeping_sigterm(ray: Any, address: str | None) -> None:
    """``ray.init``, then the SIGTERM handler that was in place again: ray.init sets its own
    (exit at once), and the runner's turns SIGTERM into a Ctrl-C of the grid, which cancels
    the tasks and shuts the cluster this process started down (``ray.shutdown``)."""
    previous = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, include_dashboard=False)
    if threading.current_thread() is threading.main_thread() and previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _dispatch(ray: Any, task: Any, cells: list[Cell], threads: int,
              record: Callable[[CellOutcome, int], None]) -> None:
    """Submit every cell, record each outcome as its task ends. Ctrl-C (or SIGTERM to this
    process) cancels the tasks (https://docs.ray.io/en/latest/ray-core/api/doc/ray.cancel.html):
    Ray raises KeyboardInterrupt in a running one, whose training saves a checkpoint at its
    stop (waited for up to ``CANCEL_GRACE_S``), from which the next invocation resumes it."""
    refs = {task.remote(cell, threads): cell for cell in cells}
    pending = list(refs)
    try:
        while pending:
            # a timeout, so that the main thread is back in Python twice a second: a signal
            # (Ctrl-C, SIGTERM) is handled only there, and a wait for the next task to finish
            # could otherwise hold it until that cell has trained to its end
            finished, pending = ray.wait(pending, num_returns=1, timeout=WAIT_POLL_S)
            for ref in finished:
                record(_outcome(ray, ref, refs[ref]), len(pending))
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        # let the cancelled cells save their checkpoint before the cluster may be shut down
        # (a second Ctrl-C ends the wait)
        with contextlib.suppress(Exception):
            ray.wait(pending, num_returns=len(pending), timeout=CANCEL_GRACE_S)
        raise


def _outcome(ray: Any, ref: Any, cell: Cell) -> CellOutcome:
    """The outcome a task returned; a task whose worker died past its retries (or that Ray
    could not run) fails its cell, the error in its ``error.txt``. An interrupted cell's
    TrainingInterrupted is raised (the grid stops, as locally)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:  # raised inside the cell: only an interrupt
        from emdlm.training.callbacks import TrainingInterrupted

        if isinstance(err.cause, (KeyboardInterrupt, TrainingInterrupted)):
            raise KeyboardInterrupt(str(err.cause)) from err
        return _failed(cell, f"the Ray task raised: {err.cause!r}")
    except ray.exceptions.RayError as err:  # the worker or its node died, retries used up
        return _failed(cell, f"the Ray task did not finish: {type(err).__name__}: {err}")


def _failed(cell: Cell, error: str) -> CellOutcome:
    """A cell whose task ended without an outcome: the error in its error.txt, with where the
    worker's own output is (Ray keeps it per node)."""
    path = cell.folder / ERROR_FILE
    try:
        write_whole(path, f"{error}\nThe worker's console output: the driver's console, and "
                    "<ray temp dir>/session_latest/logs/worker-*.out|err on its node\n")
    except OSError:
        return CellOutcome(cell.key, "failed", error=error)
    return CellOutcome(cell.key, "failed", error=error, log=str(path))
