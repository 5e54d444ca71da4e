"""``emdlm experiment``: paired multi-seed grids of run configs, with statistics and plots.

:func:`run_experiment` loads an experiment config (:mod:`emdlm.experiments.grid`), runs its
cells (:mod:`emdlm.experiments.runner`: ``run_training`` + ``evaluate_run`` per checkpoint,
resumable; in worker processes, Ray tasks or SLURM jobs: :mod:`emdlm.experiments.launchers`)
and writes ``results.csv``, ``report.md`` and ``plots/*.png`` (:mod:`emdlm.experiments.report`,
:mod:`emdlm.experiments.plots`) into its output folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from emdlm._files import refuse_links, refuse_links_below
from emdlm.experiments.grid import (
    Cell,
    Experiment,
    expand_grid,
    load_experiment,
    select_cells,
    task_title,
)
from emdlm.experiments.launchers import make_launcher
from emdlm.experiments.runner import CellOutcome, run_cells

if TYPE_CHECKING:
    from emdlm.experiments.earlier_rows import EarlierRows

#: What an experiment writes into its output folder besides the cells.
RESULTS_CSV, REPORT_MD, PLOTS_DIR = "results.csv", "report.md", "plots"


@dataclass
class ExperimentResult:
    """Where the report went and what happened to each cell."""

    output_dir: Path
    report: Path
    results_csv: Path
    plots: list[Path]
    outcomes: list[CellOutcome] = field(default_factory=list)
    #: cells marked done but left out of the report, their outputs not whole: key -> reason
    left_out: dict[str, str] = field(default_factory=dict)
    #: cells whose folders hold another definition's work, left as they are: key -> what differs
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[CellOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def write_outputs(exp: Experiment, cells: list[Cell], *, command: str = "",
                  earlier: EarlierRows | None = None) -> ExperimentResult:
    """Aggregate whatever cells are finished into results.csv, report.md and plots/ (each
    written whole). Only cells whose outputs read back whole count; the others marked done
    are named in the report and in ``left_out`` (:func:`emdlm.experiments.results.read_grid`).
    ``earlier``: an earlier run's rows (:func:`~emdlm.experiments.earlier_rows.read_earlier_rows`),
    counted for the cells that have no folder of their own here."""
    from emdlm.experiments.earlier_rows import add_earlier_rows, earlier_note
    from emdlm.experiments.plots import make_plots
    from emdlm.experiments.report import write_report
    from emdlm.experiments.results import read_grid, write_csv

    out = exp.output_dir
    out.mkdir(parents=True, exist_ok=True)
    grid = read_grid(cells)
    if earlier is not None:
        grid = add_earlier_rows(grid, cells, earlier)
    write_csv(grid.rows, out / RESULTS_CSV)
    plots = make_plots(grid.finished, grid.rows, list(exp.tasks), list(exp.variants),
                       out / PLOTS_DIR, titles={t: task_title(exp, t) for t in exp.tasks})
    write_report(exp, cells, grid.rows, out / REPORT_MD, command=command, plots=plots,
                 left_out=grid.left_out, refused=grid.refused, earlier=grid.earlier,
                 earlier_note=earlier_note(grid, earlier.path if earlier else None))
    files = [out / PLOTS_DIR / name for names in plots.values() for name in names]
    return ExperimentResult(out, out / REPORT_MD, out / RESULTS_CSV, files,
                            left_out=dict(grid.left_out), refused=dict(grid.refused))


def refuse_experiment_links(exp: Experiment, cells: list[Cell]) -> None:
    """:class:`emdlm._files.FolderEntryError` naming the first symbolic link where the
    experiment would write: its report files and plots, the folders from its output_dir down to
    each of ``cells`` (``<task>/<variant>/seed<k>``), and anything inside those cells (every
    entry of a cell is the runner's). Reads only; the output_dir itself may be a link."""
    out = exp.output_dir
    for name in (RESULTS_CSV, REPORT_MD, PLOTS_DIR):
        refuse_links(out / name)
    if (out / PLOTS_DIR).is_dir():
        refuse_links_below(out / PLOTS_DIR)
    for cell in cells:
        refuse_links(cell.folder, within=out)
        if cell.folder.is_dir():
            refuse_links_below(cell.folder)


def run_experiment(
    config: str | Path, overrides: list[str] | None = None, *, progress: bool = True,
    report_only: bool = False, command: str = "", only: list[str] | None = None,
    rerun_refused: bool = False, echo: Callable[[str], None] = print,
    earlier_results: str | Path | None = None,
) -> ExperimentResult:
    """Load, expand (every cell's config is checked first), run the unfinished cells, report.

    ``report_only``: skip running and only aggregate what is finished. ``only``: run just the
    cells whose ``task/variant/seed<k>`` key matches one of these shell-style patterns
    (:func:`~emdlm.experiments.grid.select_cells`); the report still covers every finished cell.
    ``rerun_refused``: a cell to run whose folder holds another definition's work
    (:func:`~emdlm.experiments.cell_record.refusal`) has its folder renamed beside it
    (:func:`~emdlm.experiments.cell_record.set_aside`, said through ``echo``) and runs again;
    otherwise it is refused and reported. ``earlier_results``: an earlier run's results.csv
    (:mod:`emdlm.experiments.earlier_rows`), read and checked before anything runs.
    """
    exp = load_experiment(config, overrides)
    launcher = make_launcher(exp.launcher)  # a bad launcher option stops here
    cells = expand_grid(exp)
    earlier = None
    if earlier_results is not None:
        from emdlm.experiments.earlier_rows import read_earlier_rows

        earlier = read_earlier_rows(Path(earlier_results), cells)
    to_run = select_cells(cells, only) if only else cells
    refuse_experiment_links(exp, [] if report_only else to_run)  # before the first write
    outcomes: list[CellOutcome] = []
    if rerun_refused and not report_only:
        from emdlm.experiments.cell_lock import CellInUseError
        from emdlm.experiments.cell_record import refusal, set_aside

        for cell in to_run:
            if refusal(cell) is None:
                continue
            try:
                echo(f"{cell.key}: its folder held another definition's work, moved to "
                     f"{set_aside(cell)}; the cell runs again")
            except (CellInUseError, OSError) as err:  # left as it is, and refused below
                echo(f"{cell.key}: its folder could not be moved aside: {err}")
    if not report_only:
        launcher.check_installed()
        outcomes = launcher.run(exp, to_run, progress=progress)
    result = write_outputs(exp, cells, command=command, earlier=earlier)
    result.outcomes = outcomes
    return result


__all__ = [
    "Cell",
    "CellOutcome",
    "Experiment",
    "ExperimentResult",
    "expand_grid",
    "load_experiment",
    "run_cells",
    "run_experiment",
    "select_cells",
    "write_outputs",
]
