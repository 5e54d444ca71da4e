"""The callable a SLURM (or submitit local) job runs: one cell. Imported only where submitit
is installed (by the job, and by :mod:`emdlm.experiments.launchers.slurm` when it submits)."""

from __future__ import annotations

from submitit.helpers import Checkpointable

from emdlm.experiments.grid import Cell
from emdlm.experiments.launchers.cell_task import run_cell_task
from emdlm.experiments.runner import CellOutcome


class CellJob(Checkpointable):
    """Runs one cell with ``threads`` intra-op threads. Checkpointable: on SLURM's time-out or
    preemption signal submitit requeues the same call (``checkpoint`` returns it), and the
    requeued job resumes the cell from its newest training checkpoint
    (https://github.com/facebookincubator/submitit/blob/main/docs/checkpointing.md)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __call__(self, cell: Cell) -> CellOutcome:
        return run_cell_task(cell, self.threads)
