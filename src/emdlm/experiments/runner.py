"""Run an experiment grid: every cell is ``run_training`` + ``evaluate_run`` on several
checkpoints, in worker processes, resumable, with one progress display for the grid.

A cell's folder (what it holds, when it is finished, its time ledger and lock):
:mod:`emdlm.experiments.cell_folder`. The console prefixes: :mod:`emdlm.experiments.console`.

A cell interrupted half-way continues where it stopped: training resumes from its newest
checkpoint (same result as an uninterrupted run) and evaluated steps are not evaluated again.

Workers: each cell runs in one of ``workers`` spawned processes (fork is unsafe once torch
has started its thread pools) with ``torch.set_num_threads(threads_per_worker)``. The default
is one single-thread worker per CPU core: on the 2-core development machine two 1-thread runs
side by side finish sooner than the same runs one after the other with 2 threads each (figures
in docs/experiments.md). ``workers=1`` runs the cells in this process. Cluster launchers (Ray
tasks, SLURM jobs: :mod:`emdlm.experiments.launchers`) run the same :func:`run_cell` in their
own processes.

Console: each line a cell prints (training log lines, the world-size line, warnings) starts
with the cell's ``[<task>/<variant>/seed<k>]`` (:func:`cell_console`), as the workers' lines
interleave.

Stopping: one folder, one writer. Ctrl-C reaches every process of the grid (the terminal
signals the whole process group); ``SIGTERM`` to the runner (``kill``, a scheduler's time
limit) is turned into the same thing: the runner passes SIGINT to its workers and to itself.
Each interrupted training run saves a checkpoint after its current step, no further cell
starts, and the runner exits with KeyboardInterrupt. A worker whose runner died
without a word (SIGKILL, the out-of-memory killer) notices within ``RUNNER_POLL_S`` seconds
that it was orphaned, interrupts its cell the same way and exits without starting another
one: otherwise it would go on training the queued cells, unseen, beside the next invocation
that resumes the same folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import active_children, get_context
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.experiments.cell_folder import (
    CELL_DONE,
    ERROR_FILE,
    EVAL_DIR,
    WallLedger,
    cell_problem,
    eval_dir,
    saved_checkpoints,
    write_whole,
)
from emdlm.experiments.cell_lock import CellInUseError, hold_cell
from emdlm.experiments.cell_record import record_definition, refusal
from emdlm.experiments.console import cell_console, set_hf_progress_bars
from emdlm.experiments.grid import Cell

RUNNER_POLL_S = 1.0  # how often a worker checks that its runner is alive
ORPHAN_GRACE_S = 120.0  # how long an orphaned worker waits for its cell to save and unwind

_cell_running = threading.Event()  # set in a worker while run_cell works on a cell
_orphaned = threading.Event()  # set in a worker once its runner is gone


@dataclass
class CellOutcome:
    """What happened to one cell: "done", "skipped" (done earlier), "failed", or "refused" (its
    folder holds work of another definition, :func:`emdlm.experiments.cell_record.refusal`:
    left as it is); ``log``: where a failed cell's failure is told in full (its ``error.txt``,
    or a batch job's log)."""

    key: str
    status: str
    error: str = ""
    log: str = ""


#: runs the unfinished cells, calling ``record(outcome, running)`` once per cell (run_cells)
Dispatch = Callable[[list[Cell], Callable[[CellOutcome, int], None]], None]

def default_workers() -> int:
    """One single-thread worker per available CPU core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def _models_to_evaluate(cell: Cell, final_step: int) -> dict[int, Path]:
    """step -> model folder: the chosen checkpoints plus the final model (which replaces a
    checkpoint of the same step: the weights are the same).

    ``all`` means the scheduled checkpoints, every ``train.save_steps``: a checkpoint that an
    interrupted run saved at its stop (Ctrl-C, a killed session) is for resuming only, and
    would give that seed a learning-curve point the other seeds lack."""
    from emdlm.config import build_config

    saved = saved_checkpoints(cell.train_dir)
    if cell.checkpoints == "all":
        every = build_config(cell.config).train.save_steps
        chosen = {step: path for step, path in saved.items() if step % every == 0}
    elif cell.checkpoints == "final":
        chosen = {}
    else:
        missing = [s for s in cell.checkpoints if s not in saved and s != final_step]
        if missing:
            raise RuntimeError(
                f"eval.checkpoints {missing} were not saved (saved: {sorted(saved)}, final "
                f"{final_step}); use multiples of train.save_steps"
            )
        chosen = {s: saved[s] for s in cell.checkpoints if s in saved}
    chosen[final_step] = cell.train_dir
    return dict(sorted(chosen.items()))


def _train(cell: Cell) -> dict[str, Any]:
    """Train the cell (or finish an interrupted run); returns the train summary."""
    summary_path = cell.train_dir / "train_summary.json"
    if summary_path.is_file():  # trained by an earlier invocation
        return json.loads(summary_path.read_text())
    from emdlm.config import apply_overrides, build_config
    from emdlm.training import latest_checkpoint, run_training

    cfg = build_config(cell.config)
    # the cell's evaluations, checked against the built model before any training step
    evals = [build_config(apply_overrides(cell.config, o))
             for o in (cell.eval_overrides, *cell.extra_evals.values())]
    has_ckpt = cell.train_dir.is_dir() and latest_checkpoint(cell.train_dir) is not None
    return run_training(cfg, resume=has_ckpt, overwrite=not has_ckpt, eval_configs=evals)


def _evaluate_once(model_dir: Path, cfg: Any, target: Path) -> dict[str, Any]:
    """Metrics of ``model_dir`` under ``cfg`` in ``target``: read back when an earlier
    invocation finished them (metrics.json agreeing with the rows of predictions.jsonl), else
    evaluated now (a folder an interrupted write left is evaluated again)."""
    from emdlm.eval_outputs import EvalOutputError, read_eval_outputs

    try:
        return read_eval_outputs(target)[0]
    except (EvalOutputError, OSError):  # not evaluated yet, or cut off: evaluate
        pass
    from emdlm.training import evaluate_run

    return evaluate_run(model_dir, cfg, out_dir=target)["metrics"]


def _check_unfinished_evaluations(cell: Cell, models: dict[int, Path]) -> None:
    """RuntimeError for an ``eval/step-<N>`` folder that is not a whole evaluation and whose
    model is no longer saved (``keep_checkpoints: false`` deleted it after an older emdlm took
    the cut-off folder as evaluated): it cannot be evaluated again, and would otherwise stay
    in the cell and keep it unfinished."""
    from emdlm.eval_outputs import eval_outputs_problem

    for folder in sorted((cell.folder / EVAL_DIR).glob("step-*")):
        tail = folder.name.split("-")[-1]
        problem = eval_outputs_problem(folder)
        if tail.isdigit() and int(tail) not in models and problem is not None:
            raise RuntimeError(
                f"{problem}; the model of step {tail} is no longer saved, so it cannot be "
                f"evaluated again: delete {folder} to finish the cell without that step"
            )


def _evaluate(cell: Cell, final_step: int) -> dict[int, dict[str, Any]]:
    """Evaluate every chosen model not evaluated yet, then the final model under each
    ``eval.extra`` config; returns step -> metrics of the main evaluation."""
    from emdlm.config import apply_overrides, build_config

    models = _models_to_evaluate(cell, final_step)  # a step that was never saved fails here
    _check_unfinished_evaluations(cell, models)
    cfg = build_config(apply_overrides(cell.config, cell.eval_overrides))
    results = {step: _evaluate_once(model_dir, cfg, eval_dir(cell.folder, step))
               for step, model_dir in models.items()}
    for name, overrides in cell.extra_evals.items():
        extra_cfg = build_config(apply_overrides(cell.config, overrides))
        _evaluate_once(cell.train_dir, extra_cfg, eval_dir(cell.folder, final_step, name))
    return results


def run_cell(cell: Cell) -> CellOutcome:
    """Train and evaluate one cell; never raises (a failure goes to ``error.txt``), except
    for an interrupt (Ctrl-C, SIGTERM to the runner, an orphaned worker), which stops the grid.
    A worker whose runner is gone starts no cell: nobody would collect it. A cell another
    process holds (``cell.lock``) is left alone and reported as failed."""
    if _orphaned.is_set():
        return CellOutcome(cell.key, "failed", error="the experiment runner is gone")
    with contextlib.ExitStack() as held:
        try:
            cell.folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(hold_cell(cell.folder))
        except (CellInUseError, ConfigError) as err:  # held, or its lock file not a plain file
            return CellOutcome(cell.key, "failed", error=str(err))
        except OSError as err:  # no folder: nowhere to write error.txt either
            return CellOutcome(cell.key, "failed", error=f"cannot create {cell.folder}: {err}")
        _cell_running.set()
        try:
            with cell_console(cell.key):
                return _run_cell(cell)
        finally:
            _cell_running.clear()


def _run_cell(cell: Cell) -> CellOutcome:
    done = cell.folder / CELL_DONE
    refused = refusal(cell)  # work of another definition: neither done nor resumed
    if refused is not None:
        return CellOutcome(cell.key, "refused", error=refused)
    if cell_problem(cell) is None:  # under the lock: another invocation may have just finished
        return CellOutcome(cell.key, "skipped")
    resumed = cell.train_dir.exists()  # an earlier invocation did part of the work
    try:
        done.unlink(missing_ok=True)  # a record of outputs that are not whole: the cell reruns
        (cell.folder / ERROR_FILE).unlink(missing_ok=True)
        record_definition(cell)  # what this cell's work is done under
        ledger = WallLedger(cell.folder, resumed=resumed)
        ledger.write()  # the first write fails here, not in the heartbeat thread
    except OSError as err:  # no folder: nowhere to write error.txt either
        return CellOutcome(cell.key, "failed", error=f"cannot create {cell.folder}: {err}")
    try:
        with ledger:
            summary = _train(cell)
            metrics = _evaluate(cell, int(summary["global_step"]))
            if not cell.keep_checkpoints:
                for ckpt in saved_checkpoints(cell.train_dir).values():
                    shutil.rmtree(ckpt)
        record = {
            "task": cell.task, "variant": cell.variant, "seed": cell.seed,
            "final_step": int(summary["global_step"]),
            "evaluated_steps": sorted(metrics), "wall_s": ledger.total_s,
            "wall_s_this_invocation": ledger.this_s, "resumed": resumed,
            "wall_complete": ledger.complete, "train_summary": summary,
        }
        write_whole(done, json.dumps(record, indent=2, default=str) + "\n")
        return CellOutcome(cell.key, "done")
    except Exception as err:  # a failed cell is recorded and the grid goes on
        if _is_interrupt(err):
            raise  # Ctrl-C stops the grid; its checkpoint lets the next invocation resume
        write_whole(cell.folder / ERROR_FILE, traceback.format_exc())
        return CellOutcome(cell.key, "failed", error=f"{type(err).__name__}: {err}")


def _is_interrupt(err: BaseException) -> bool:
    """True for emdlm's TrainingInterrupted (Ctrl-C during training, checkpoint saved)."""
    train = sys.modules.get("emdlm.training.train")  # not imported: cannot be the cause
    return train is not None and isinstance(err, train.TrainingInterrupted)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """While the grid runs in the main thread, SIGTERM to the runner acts as a Ctrl-C to the
    whole grid (see :func:`_forward_sigterm`)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, _forward_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _forward_sigterm(signum: int, frame: Any) -> None:
    """SIGINT to every worker process, then the runner's own SIGINT handler (a training
    running in this process saves a checkpoint at its stop); where SIGINT has no Python
    handler (ignored since the process started, as for ``cmd &`` from a non-interactive
    shell, where re-sending SIGINT did nothing), KeyboardInterrupt all the same."""
    for worker in active_children():
        if worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGINT)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def _watch_runner(runner_pid: int, poll_s: float = RUNNER_POLL_S,
                  grace_s: float = ORPHAN_GRACE_S) -> None:
    """A worker's watchdog thread: once the worker's parent is no longer ``runner_pid`` (the
    runner died; the worker was re-parented), start no further cell, interrupt the running one
    as a Ctrl-C would (its training saves a checkpoint after the current step), wait up to
    ``grace_s`` for it to unwind and end the process."""
    while os.getppid() == runner_pid:
        time.sleep(poll_s)
    _orphaned.set()
    if _cell_running.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while _cell_running.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(1)


def _init_worker(threads: int) -> None:
    """Pin a worker's intra-op threads before any torch work; watch the runner."""
    threading.Thread(target=_watch_runner, args=(os.getppid(),), daemon=True,
                     name="emdlm-runner-watch").start()
    prepare_worker(threads)


def prepare_worker(threads: int) -> None:
    """Set up a process that runs cells (a pool worker, a Ray task, a batch job): ``threads``
    intra-op threads, pinned before any torch work, and no per-shard progress bars."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    set_hf_progress_bars(False)  # per-shard bars of many cells would bury the grid display


class _Progress:
    """Grid progress: cells done / skipped / failed / running of total, elapsed time."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.counts = {"done": 0, "skipped": 0, "failed": 0, "refused": 0}
        self.running = 0
        self.start = time.perf_counter()
        self._bar: Any = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("[bold]grid"), BarColumn(), TextColumn("{task.description}"),
                TimeElapsedColumn(),
            )
            self._task = self._bar.add_task(self._text(), total=total)
            self._bar.start()

    def _text(self) -> str:
        c = self.counts
        return (f"{c['done'] + c['skipped']}/{self.total} done ({c['skipped']} earlier), "
                f"{c['failed']} failed, "
                + (f"{c['refused']} refused (another definition), " if c["refused"] else "")
                + f"{self.running} running")

    def update(self, running: int, outcome: CellOutcome | None = None) -> None:
        self.running = running
        if outcome is not None:
            self.counts[outcome.status] += 1
        if self._bar is not None:
            finished = sum(self.counts.values())
            self._bar.update(self._task, completed=finished, description=self._text())
            if outcome is not None and outcome.status in ("failed", "refused"):
                self._bar.console.print(f"[red]{outcome.status}[/red] {outcome.key}: "
                                        f"{outcome.error}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_cells(
    cells: list[Cell], *, workers: int, threads: int, progress: bool = True,
    on_outcome: Callable[[CellOutcome], None] | None = None, dispatch: Dispatch | None = None,
) -> list[CellOutcome]:
    """Run every cell (finished ones are skipped) with ``workers`` processes; returns the
    outcomes in the cells' order. Ctrl-C, or SIGTERM to this process, stops the grid with
    KeyboardInterrupt (an interrupted cell keeps its checkpoint and resumes from it on the next
    invocation).

    ``dispatch(cells, record)``: another way to run the unfinished cells (a cluster launcher,
    :mod:`emdlm.experiments.launchers`), each through :func:`run_cell`, calling
    ``record(outcome, running)`` once per cell as it ends."""
    if workers < 1 or threads < 1:
        raise ValueError(f"workers and threads must be >= 1, got {workers}, {threads}")
    display = _Progress(len(cells), progress)
    by_key: dict[str, CellOutcome] = {}

    folders = {cell.key: cell.folder for cell in cells}

    def record(outcome: CellOutcome, running: int) -> None:
        error_file = folders[outcome.key] / ERROR_FILE
        if outcome.status == "failed" and not outcome.log and error_file.is_file():
            outcome.log = str(error_file)
        by_key[outcome.key] = outcome
        display.update(running, outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    todo = []
    for cell in cells:  # finished cells never reach a worker, nor cells of another definition
        refused = refusal(cell)
        if refused is not None:
            record(CellOutcome(cell.key, "refused", error=refused), 0)
        elif cell_problem(cell) is None:
            record(CellOutcome(cell.key, "skipped"), 0)
        else:
            todo.append(cell)
    display.update(min(workers, len(todo)))
    try:
        with _sigterm_as_ctrl_c():
            if dispatch is not None:
                dispatch(todo, record)
            elif workers == 1 or len(todo) <= 1:
                _run_here(todo, threads, record)
            else:
                _run_pool(todo, min(workers, len(todo)), threads, record)
    except Exception as err:
        if _is_interrupt(err):  # one Ctrl-C reaches training as TrainingInterrupted
            raise KeyboardInterrupt(str(err)) from err
        raise
    finally:
        display.close()
    return [by_key[c.key] for c in cells]


def _run_here(cells: list[Cell], threads: int, record: Callable[..., None]) -> None:
    import torch

    previous = torch.get_num_threads()
    bars = set_hf_progress_bars(False)
    torch.set_num_threads(threads)
    try:
        for left, cell in enumerate(cells, start=1):
            record(run_cell(cell), 1 if left < len(cells) else 0)
    finally:
        torch.set_num_threads(previous)
        set_hf_progress_bars(bars)


def _run_pool(
    cells: list[Cell], workers: int, threads: int, record: Callable[..., None]
) -> None:
    """Run the cells in ``workers`` spawned processes. Only as many cells as there are workers
    are handed to the pool at a time: ProcessPoolExecutor counts a queued call as running (it
    cannot be cancelled), so after a Ctrl-C a worker would start the queued cells."""
    queued = list(reversed(cells))  # pop() hands them over in the cells' order
    pending: dict[Future[CellOutcome], Cell] = {}
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker,
        initargs=(threads,),
    ) as pool:
        try:
            while queued or pending:
                while queued and len(pending) < workers:
                    cell = queued.pop()
                    try:
                        pending[pool.submit(run_cell, cell)] = cell
                    except BrokenProcessPool as err:  # a worker died: no cell can start
                        record(_worker_died(cell, err), len(pending))
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    cell = pending.pop(fut)
                    record(_pool_outcome(fut, cell), min(workers, len(pending) + len(queued)))
        except BaseException:  # Ctrl-C / SIGTERM: start no further cell
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _pool_outcome(fut: Future[CellOutcome], cell: Cell) -> CellOutcome:
    """The outcome of a finished future; a worker that died (e.g. killed for memory) fails
    its cell. An interrupt is raised."""
    try:
        return fut.result()
    except Exception as err:
        if _is_interrupt(err):
            raise
        return _worker_died(cell, err)


def _worker_died(cell: Cell, err: Exception) -> CellOutcome:
    with contextlib.suppress(OSError):
        write_whole(cell.folder / ERROR_FILE, f"worker process died: {err!r}\n")
    return CellOutcome(cell.key, "failed", error=repr(err))
