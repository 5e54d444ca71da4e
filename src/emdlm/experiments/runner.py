"""Run an experiment grid: every cell is ``run_training`` + ``evaluate_run`` on several
checkpoints, in worker processes, resumable, with one progress display for the grid.

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
* ``cell.lock``: held (``flock``) by the process working on the cell; a second invocation on
  the same folder leaves a held cell alone and reports it.

Every file the runner writes is written whole (a temporary file renamed into place,
:func:`emdlm._files.atomic_write`): a killed process leaves the old file or the new one.

A cell interrupted half-way continues where it stopped: training resumes from its newest
checkpoint (same result as an uninterrupted run) and evaluated steps are not evaluated again.

Workers: each cell runs in one of ``workers`` spawned processes (fork is unsafe once torch
has started its thread pools) with ``torch.set_num_threads(threads_per_worker)``. The default
is one single-thread worker per CPU core: on the 2-core development machine two 1-thread runs
side by side finish sooner than the same runs one after the other with 2 threads each (figures
in docs/experiments.md). ``workers=1`` runs the cells in this process.

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
import io
import json
import logging
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

from emdlm._files import LockHeldError, atomic_write, hold_lock_file
from emdlm.experiments.grid import Cell

CELL_DONE = "cell_done.json"
ERROR_FILE = "error.txt"
LOCK_FILE = "cell.lock"
EVAL_DIR = "eval"
WALL_TIME_FILE = "wall_time.json"
WALL_HEARTBEAT_S = 30.0
RUNNER_POLL_S = 1.0  # how often a worker checks that its runner is alive
ORPHAN_GRACE_S = 120.0  # how long an orphaned worker waits for its cell to save and unwind

_cell_running = threading.Event()  # set in a worker while run_cell works on a cell
_orphaned = threading.Event()  # set in a worker once its runner is gone


@dataclass
class CellOutcome:
    """What happened to one cell: "done", "skipped" (done earlier) or "failed"."""

    key: str
    status: str
    wall_s: float = 0.0
    error: str = ""


def default_workers() -> int:
    """One single-thread worker per available CPU core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def eval_dir(cell_folder: Path, step: int, extra: str | None = None) -> Path:
    """``<cell>/eval/step-<N>``, or ``<cell>/eval/<extra>/step-<N>`` for an extra evaluation."""
    base = cell_folder / EVAL_DIR
    return (base if extra is None else base / extra) / f"step-{step}"


def final_predictions(cell_folder: Path) -> Path | None:
    """``predictions.jsonl`` of a cell's last evaluated step (None when no step has one)."""
    files = sorted((cell_folder / EVAL_DIR).glob("step-*/predictions.jsonl"),
                   key=lambda p: int(p.parent.name.split("-")[-1]))
    return files[-1] if files else None


def _write_whole(path: Path, text: str) -> None:
    """``path`` := ``text``, through a temporary file renamed into place: never half-written."""
    with atomic_write(path) as fh:
        fh.write(text)


def _eval_folders(cell: Cell, record: dict[str, Any]) -> list[Path]:
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
    for folder in _eval_folders(cell, record):
        problem = eval_outputs_problem(folder)
        if problem is not None:
            return problem
    return None


def _saved_checkpoints(train_dir: Path) -> dict[int, Path]:
    """step -> checkpoint folder, for every checkpoint-<step> the run kept."""
    out: dict[int, Path] = {}
    for p in train_dir.glob("checkpoint-*"):
        tail = p.name.split("-")[-1]
        if p.is_dir() and tail.isdigit():
            out[int(tail)] = p
    return out


def _models_to_evaluate(cell: Cell, final_step: int) -> dict[int, Path]:
    """step -> model folder: the chosen checkpoints plus the final model (which replaces a
    checkpoint of the same step: the weights are the same).

    ``all`` means the scheduled checkpoints, every ``train.save_steps``: a checkpoint that an
    interrupted run saved at its stop (Ctrl-C, a killed session) is for resuming only, and
    would give that seed a learning-curve point the other seeds lack."""
    from emdlm.config import build_config

    saved = _saved_checkpoints(cell.train_dir)
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


class _WallLedger:
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
        _write_whole(self.path, json.dumps({"earlier_s": self.earlier_s, "this_s": self.this_s})
                     + "\n")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):  # a full disk must not kill the cell
                self.write()

    def __enter__(self) -> _WallLedger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = time.perf_counter()
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.write()


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
            held.enter_context(_hold_cell(cell.folder))
        except CellInUseError as err:
            return CellOutcome(cell.key, "failed", error=str(err))
        except OSError as err:  # no folder: nowhere to write error.txt either
            return CellOutcome(cell.key, "failed", 0.0, f"cannot create {cell.folder}: {err}")
        _cell_running.set()
        try:
            with cell_console(cell.key):
                return _run_cell(cell)
        finally:
            _cell_running.clear()


class PrefixedLines(io.TextIOBase):
    """A text stream that writes every line it is given to ``stream`` with ``prefix`` in front
    (a line ends at "\n" or "\r"): a cell's console output, told apart from other cells'."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        parts = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                parts.append(self._prefix)
            parts.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self._stream.write("".join(parts))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", None) or "utf-8")


@contextlib.contextmanager
def cell_console(key: str) -> Iterator[None]:
    """While a cell runs, every line it prints to ``sys.stdout`` / ``sys.stderr`` (the training
    log lines, the world-size line, warnings) starts with ``[<task>/<variant>/seed<k>] ``: the
    workers' output interleaves on one console."""
    prefix = f"[{key}] "
    out, err = PrefixedLines(sys.stdout, prefix), PrefixedLines(sys.stderr, prefix)
    # logging handlers (transformers' own among them) hold the stream they were made with:
    # point those on the console streams at the prefixed ones for the cell, then back
    swapped = _console_log_handlers({id(sys.stdout): out, id(sys.stderr): err})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
        with contextlib.suppress(Exception):
            out.flush()
            err.flush()


def _console_log_handlers(
    targets: dict[int, Any],
) -> list[tuple[logging.StreamHandler[Any], Any]]:
    """Point every logging ``StreamHandler`` (not a file handler) that writes to one of the
    streams keyed by id in ``targets`` at its replacement; returns (handler, old stream) pairs
    to restore."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    swapped = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if (isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                # a handler whose stream is a property follows sys.stderr by itself
                and not isinstance(getattr(type(handler), "stream", None), property)
                and id(handler.stream) in targets):
            swapped.append((handler, handler.setStream(targets[id(handler.stream)])))
    return swapped


class CellInUseError(RuntimeError):
    """Another process holds the cell's lock (the same grid started twice on one folder)."""


@contextlib.contextmanager
def _hold_cell(folder: Path) -> Iterator[None]:
    """Hold ``<folder>/cell.lock`` while this process works on the cell: an exclusive lock
    (``flock``; ``msvcrt.locking`` on Windows), which the OS releases when the process ends,
    however it ends (so a killed run leaves no stale lock). Raises :class:`CellInUseError`
    naming the holder's pid (the lock and its holder record: :func:`emdlm._files.hold_lock_file`,
    shared with the run folder's lock)."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(hold_lock_file(folder / LOCK_FILE))
        except LockHeldError as err:
            raise CellInUseError(
                f"{folder} is in use by another process ({err.holder}); is the same grid "
                "running twice on this output_dir? The cell was left alone"
            ) from None
        yield


def _run_cell(cell: Cell) -> CellOutcome:
    done = cell.folder / CELL_DONE
    if cell_problem(cell) is None:  # under the lock: another invocation may have just finished
        return CellOutcome(cell.key, "skipped")
    resumed = cell.train_dir.exists()  # an earlier invocation did part of the work
    try:
        done.unlink(missing_ok=True)  # a record of outputs that are not whole: the cell reruns
        (cell.folder / ERROR_FILE).unlink(missing_ok=True)
        ledger = _WallLedger(cell.folder, resumed=resumed)
        ledger.write()  # the first write fails here, not in the heartbeat thread
    except OSError as err:  # no folder: nowhere to write error.txt either
        return CellOutcome(cell.key, "failed", 0.0, f"cannot create {cell.folder}: {err}")
    try:
        with ledger:
            summary = _train(cell)
            metrics = _evaluate(cell, int(summary["global_step"]))
            if not cell.keep_checkpoints:
                for ckpt in _saved_checkpoints(cell.train_dir).values():
                    shutil.rmtree(ckpt)
        record = {
            "task": cell.task, "variant": cell.variant, "seed": cell.seed,
            "final_step": int(summary["global_step"]),
            "evaluated_steps": sorted(metrics), "wall_s": ledger.total_s,
            "wall_s_this_invocation": ledger.this_s, "resumed": resumed,
            "wall_complete": ledger.complete, "train_summary": summary,
        }
        _write_whole(done, json.dumps(record, indent=2, default=str) + "\n")
        return CellOutcome(cell.key, "done", ledger.this_s)
    except Exception as err:  # a failed cell is recorded and the grid goes on
        if _is_interrupt(err):
            raise  # Ctrl-C stops the grid; its checkpoint lets the next invocation resume
        _write_whole(cell.folder / ERROR_FILE, traceback.format_exc())
        return CellOutcome(cell.key, "failed", ledger.this_s,
                           f"{type(err).__name__}: {err}")


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
    """SIGINT to every worker process, then to the runner itself."""
    for worker in active_children():
        if worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGINT)
    signal.raise_signal(signal.SIGINT)


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
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    _set_hf_progress_bars(False)  # per-shard bars of many cells would bury the grid display


def _set_hf_progress_bars(enabled: bool) -> bool:
    """Turn transformers' own progress bars (weights loading / saving) on or off; returns
    the previous state."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return previous


class _Progress:
    """Grid progress: cells done / skipped / failed / running of total, elapsed time."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.counts = {"done": 0, "skipped": 0, "failed": 0}
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
                f"{c['failed']} failed, {self.running} running")

    def update(self, running: int, outcome: CellOutcome | None = None) -> None:
        self.running = running
        if outcome is not None:
            self.counts[outcome.status] += 1
        if self._bar is not None:
            finished = sum(self.counts.values())
            self._bar.update(self._task, completed=finished, description=self._text())
            if outcome is not None and outcome.status == "failed":
                self._bar.console.print(f"[red]failed[/red] {outcome.key}: {outcome.error}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_cells(
    cells: list[Cell], *, workers: int, threads: int, progress: bool = True,
    on_outcome: Callable[[CellOutcome], None] | None = None,
) -> list[CellOutcome]:
    """Run every cell (finished ones are skipped) with ``workers`` processes; returns the
    outcomes in the cells' order. Ctrl-C, or SIGTERM to this process, stops the grid with
    KeyboardInterrupt (an interrupted cell keeps its checkpoint and resumes from it on the next
    invocation)."""
    if workers < 1 or threads < 1:
        raise ValueError(f"workers and threads must be >= 1, got {workers}, {threads}")
    display = _Progress(len(cells), progress)
    by_key: dict[str, CellOutcome] = {}

    def record(outcome: CellOutcome, running: int) -> None:
        by_key[outcome.key] = outcome
        display.update(running, outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    todo = []
    for cell in cells:  # finished cells never reach a worker
        if cell_problem(cell) is None:
            record(CellOutcome(cell.key, "skipped"), 0)
        else:
            todo.append(cell)
    display.update(min(workers, len(todo)))
    try:
        with _sigterm_as_ctrl_c():
            if workers == 1 or len(todo) <= 1:
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
    bars = _set_hf_progress_bars(False)
    torch.set_num_threads(threads)
    try:
        for left, cell in enumerate(cells, start=1):
            record(run_cell(cell), 1 if left < len(cells) else 0)
    finally:
        torch.set_num_threads(previous)
        _set_hf_progress_bars(bars)


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
        _write_whole(cell.folder / ERROR_FILE, f"worker process died: {err!r}\n")
    return CellOutcome(cell.key, "failed", error=repr(err))
