"""``launcher: local`` (the default): the cells in worker processes on this machine."""

from __future__ import annotations

import dataclasses

from emdlm.experiments.grid import Cell, Experiment
from emdlm.experiments.launchers.base import Launcher
from emdlm.experiments.runner import CellOutcome, default_workers, run_cells


@dataclasses.dataclass(frozen=True)
class LocalLauncher(Launcher):
    """``experiment.workers`` spawned processes (default: one per CPU core) of
    ``threads_per_worker`` threads each; ``workers: 1`` runs the cells in this process. No
    options of its own."""

    name = "local"

    def run(self, exp: Experiment, cells: list[Cell], *, progress: bool) -> list[CellOutcome]:
        return run_cells(cells, workers=exp.workers or default_workers(),
                         threads=exp.threads_per_worker, progress=progress)
