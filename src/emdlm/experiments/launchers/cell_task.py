"""The work of one cell in a process that a cluster launcher started (a Ray worker, a batch
job): the set-up of a local worker (:func:`emdlm.experiments.runner.prepare_worker`), then
the local worker's own :func:`emdlm.experiments.runner.run_cell`, so a cell gives the same
folder, whichever launcher ran it."""

from __future__ import annotations

from emdlm.experiments.grid import Cell
from emdlm.experiments.runner import CellOutcome, prepare_worker, run_cell


def run_cell_task(cell: Cell, threads: int) -> CellOutcome:
    """Run ``cell`` here with ``threads`` intra-op threads; the outcome goes back to the
    submitting machine (its report is built from the folders there)."""
    prepare_worker(threads)
    return run_cell(cell)
