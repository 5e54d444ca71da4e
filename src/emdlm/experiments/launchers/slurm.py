"""``launcher: slurm``: each cell one SLURM job, all of them one job array, submitted and
watched through submitit (https://github.com/facebookincubator/submitit).

Options: ``partition``; ``time`` (a job's time limit: minutes, or SLURM's ``[days-]hours:
minutes:seconds`` forms; default 60); ``gpus_per_node`` (default 0); ``cpus_per_task``
(default ``threads_per_worker``); ``mem_gb``; ``array_parallelism`` (how many cells run at
once: the ``%N`` of ``--array``; default SLURM's queue decides, 256 at most, as submitit
sets it; with ``executor: local``, ``workers`` or one per CPU core); ``setup`` (shell lines run
before the job, e.g. ``module load cuda``); ``sbatch`` (any other ``#SBATCH`` option,
``{account: proj, qos: high}``); ``folder`` (submitit's job files and logs; default
``<output_dir>/.submitit``); ``python`` (the interpreter the jobs run; default this one,
``sys.executable``, whose path the nodes must have); ``executor``: ``slurm`` (sbatch) or
``local`` (submitit's LocalExecutor: each cell a job process on this machine, no SLURM needed).

A job that reaches its time limit or is preempted gets SIGUSR2 from SLURM (``--signal``, set by
submitit); submitit then requeues it (the job is :class:`~submitit.helpers.Checkpointable`),
and the requeued job resumes the cell from its newest checkpoint. A job that dies otherwise
fails its cell, naming the job's log; the next submission resumes the cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.experiments.cell_folder import ERROR_FILE, write_whole
from emdlm.experiments.grid import Cell, Experiment
from emdlm.experiments.launchers.base import (
    Launcher,
    non_negative_int,
    non_negative_number,
    one_of,
    option,
    positive_int,
    require,
    text,
    text_list,
)
from emdlm.experiments.runner import CellOutcome, default_workers, run_cells

#: submitit's folder in output_dir (no task can be named so: names cannot start with ".")
SUBMITIT_FOLDER = ".submitit"
#: how often the jobs' states are read: LocalExecutor reads its processes; SLURM's sacct is
#: asked less often (submitit caches its answer for a while anyway)
POLL_S = {"local": 1.0, "slurm": 20.0}
SLURM_TIME = re.compile(r"^(?:(?P<days>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def time_minutes(value: Any, where: str) -> int:
    """A SLURM time limit in whole minutes (rounded up): an integer of minutes, or one of
    sbatch's ``--time`` forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``
    (https://slurm.schedmd.com/sbatch.html#OPT_time)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    match = SLURM_TIME.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{where} must be minutes >= 1 or a SLURM time such as 90, '2:00:00' "
                          f"or '1-12:00:00', got {value!r}")
    days, a, b, c = (int(match[k]) if match[k] else None for k in ("days", "a", "b", "c"))
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = (a * 60 + (b or 0)) * 60 + c
    else:  # M or M:S
        seconds = a * 60 + (b or 0)
    if seconds < 1:
        raise ConfigError(f"{where} is zero: a job needs some time, got {value!r}")
    return math.ceil(seconds / 60)


def sbatch_options(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where} must be a mapping of sbatch option -> value, got {value!r}")
    return dict(value)


@dataclasses.dataclass(frozen=True)
class SlurmLauncher(Launcher):
    """The cells as one SLURM job array (or submitit's local jobs), one cell per job."""

    name = "slurm"
    executor: str = option("slurm", one_of("slurm", "local"))
    partition: str | None = option(None, text, optional=True)
    time: int = option(60, time_minutes)
    gpus_per_node: int = option(0, non_negative_int)
    cpus_per_task: int | None = option(None, positive_int, optional=True)
    mem_gb: float | None = option(None, non_negative_number, optional=True)
    array_parallelism: int | None = option(None, positive_int, optional=True)
    setup: tuple[str, ...] = option((), text_list)
    sbatch: dict[str, Any] | None = option(None, sbatch_options, optional=True)  # noqa: RUF009
    folder: str | None = option(None, text, optional=True)
    python: str | None = option(None, text, optional=True)

    def check_installed(self) -> None:
        require("submitit", self.name)
        missing = [cmd for cmd in ("sbatch", "srun") if shutil.which(cmd) is None]
        if self.executor == "slurm" and missing:
            raise ConfigError(f"launcher=slurm: {' and '.join(missing)} not found, so this is "
                              "no SLURM machine: submit from a login node of the cluster, or "
                              "set launcher.executor=local to run the jobs here")

    def job_folder(self, exp: Experiment) -> Path:
        return Path(self.folder) if self.folder else exp.output_dir / SUBMITIT_FOLDER

    def make_executor(self, exp: Experiment) -> Any:
        """The submitit executor with this launcher's parameters."""
        submitit = require("submitit", self.name)
        folder = self.job_folder(exp)
        if self.executor == "local":
            executor = submitit.LocalExecutor(folder, python=self.python)
            params: dict[str, Any] = {"timeout_min": self.time, "setup": list(self.setup)}
            if self.gpus_per_node:
                params["gpus_per_node"] = self.gpus_per_node
            executor.update_parameters(**params)
            return executor
        executor = submitit.SlurmExecutor(folder, python=self.python)
        params = {
            "job_name": f"emdlm-{exp.name}", "time": self.time, "nodes": 1,
            "ntasks_per_node": 1, "cpus_per_task": self.cpus_per_task or exp.threads_per_worker,
            "setup": list(self.setup),
        }
        if self.partition:
            params["partition"] = self.partition
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        if self.mem_gb is not None:
            params["mem"] = f"{self.mem_gb:g}GB"
        if self.array_parallelism:
            params["array_parallelism"] = self.array_parallelism
        if self.sbatch:
            params["additional_parameters"] = dict(self.sbatch)
        executor.update_parameters(**params)
        return executor

    def submit(self, exp: Experiment, executor: Any, cells: list[Cell]) -> list[Any]:
        """Submit ``cells`` as one job array (task i runs ``cells[i]``); the submitit jobs."""
        from emdlm.experiments.launchers.slurm_job import CellJob

        self.job_folder(exp).mkdir(parents=True, exist_ok=True)
        return list(executor.map_array(CellJob(exp.threads_per_worker), cells))

    def run(self, exp: Experiment, cells: list[Cell], *, progress: bool) -> list[CellOutcome]:
        at_once = len(cells)  # SLURM queues the array and applies its %N itself
        if self.executor == "local":  # each local job is a process started at submission
            at_once = self.array_parallelism or exp.workers or default_workers()

        def dispatch(todo: list[Cell], record: Callable[[CellOutcome, int], None]) -> None:
            if not todo:
                return  # every cell finished earlier: nothing to submit
            # made here: only a grid with cells to run gets a job folder
            self._dispatch(exp, self.make_executor(exp), todo, max(1, at_once), record)

        # workers: what the progress display counts as running (SLURM may run fewer)
        return run_cells(cells, workers=max(1, min(at_once, len(cells))),
                         threads=exp.threads_per_worker, progress=progress, dispatch=dispatch)

    def _dispatch(self, exp: Experiment, executor: Any, cells: list[Cell], at_once: int,
                  record: Callable[[CellOutcome, int], None]) -> None:
        """Submit the cells ``at_once`` at a time (SLURM: all of them, one array), record each
        outcome as its job ends. Ctrl-C (or SIGTERM to this process) cancels the jobs
        (``scancel``; a local job gets SIGINT): a cancelled cell keeps its newest checkpoint,
        from which the next submission resumes it."""
        queued = list(cells)
        running: dict[Any, Cell] = {}
        try:
            while queued or running:
                if queued and len(running) < at_once:
                    batch, queued = queued[:at_once - len(running)], queued[at_once - len(running):]
                    running.update(zip(self.submit(exp, executor, batch), batch, strict=True))
                for job in [j for j in running if j.done()]:
                    cell = running.pop(job)
                    record(_outcome(job, cell), len(running))
                if running:
                    time.sleep(POLL_S[self.executor])
        except BaseException:
            for job in running:
                with contextlib.suppress(Exception):
                    job.cancel(check=False)
            raise


def _outcome(job: Any, cell: Cell) -> CellOutcome:
    """The outcome the job returned, its log named when the cell failed; a job that ended
    without one (killed, out of memory, cancelled, out of time) fails its cell, the reason and
    the log in its error.txt."""
    log = str(job.paths.stderr)
    try:
        outcome: CellOutcome = job.result()
    except Exception as err:  # submitit's FailedJobError / UncompletedJobError
        error = f"batch job {job.job_id} ended without an outcome: {type(err).__name__}: " + (
            str(err).strip().splitlines() or [""])[0]
        with contextlib.suppress(OSError):
            write_whole(cell.folder / ERROR_FILE, f"{error}\nits log: {log} (and "
                        f"{job.paths.stdout})\n\n{err}\n")
        return CellOutcome(cell.key, "failed", error=error, log=log)
    if outcome.status == "failed":
        outcome.log = log
    return outcome
