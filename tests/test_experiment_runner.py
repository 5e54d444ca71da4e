"""`emdlm experiment` end to end on a tiny grid: cells, resume, failures, report, csv, plots."""

from __future__ import annotations

import csv
import json
import time

import pytest
import yaml
from typer.testing import CliRunner

from _experiment import TINY_BASE
from emdlm.cli import app
from emdlm.experiments import expand_grid, run_experiment
from emdlm.experiments.cell_folder import (
    CELL_DONE,
    ERROR_FILE,
    LOCK_FILE,
    WALL_TIME_FILE,
    WallLedger,
)
from emdlm.experiments.console import PrefixedLines, cell_console
from emdlm.experiments.grid import parse_experiment
from emdlm.experiments.runner import run_cells

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = TINY_BASE
VARIANTS = {
    "ce": ["objective.name=ce"],
    "ntil": ["objective.name=ntil", "objective.params.value_mode=expected"],
    # fails inside its cell (the objective rejects the parameter when it is built)
    "broken": ["objective.name=ntil", "objective.params.no_such_param=1"],
}


def _write_exp(tmp_path, **extra):
    data = {"name": "tiny", "base": BASE, "variants": VARIANTS, "baseline": "ce", "seeds": [0, 1],
            "workers": 1,
            "eval": {"checkpoints": "all"}, "output_dir": str(tmp_path / "grid"), **extra}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("experiment")
    path = _write_exp(tmp)
    result = run_experiment(path, progress=False, command=f"emdlm experiment -c {path}")
    return path, result


def test_cells_run_and_failure_is_isolated(grid):
    _, result = grid
    status = {o.key: o.status for o in result.outcomes}
    assert status == {
        "default/ce/seed0": "done", "default/ntil/seed0": "done", "default/broken/seed0": "failed",
        "default/ce/seed1": "done", "default/ntil/seed1": "done", "default/broken/seed1": "failed",
    }
    out = result.output_dir
    error = (out / "default" / "broken" / "seed0" / ERROR_FILE).read_text()
    assert "Traceback" in error and "no_such_param" in error
    assert not (out / "default" / "broken" / "seed0" / CELL_DONE).exists()
    done = json.loads((out / "default" / "ntil" / "seed1" / CELL_DONE).read_text())
    assert done["evaluated_steps"] == [10, 20] and done["final_step"] == 20
    for step in (10, 20):
        folder = out / "default" / "ntil" / "seed1" / "eval" / f"step-{step}"
        assert (folder / "metrics.json").is_file() and (folder / "predictions.jsonl").is_file()


def test_results_csv_rows(grid):
    _, result = grid
    with result.results_csv.open() as fh:
        rows = list(csv.DictReader(fh))
    keys = {(r["variant"], r["seed"], r["step"]) for r in rows}
    assert keys == {(v, s, st) for v in ("ce", "ntil") for s in ("0", "1") for st in ("10", "20")}
    metrics = {r["metric"] for r in rows}
    assert {"abs_error_mean", "log10_error_mean", "within_1pct", "within_5pct",
            "exact_match", "perplexity"} <= metrics
    per_cell_step = len(metrics)
    assert len(rows) == 2 * 2 * 2 * per_cell_step  # variants x seeds x steps x metrics
    # a csv value is the metrics.json value of that cell and step
    metrics_json = json.loads((result.output_dir / "default" / "ce" / "seed0" / "eval" /
                               "step-20" / "metrics.json").read_text())
    (em,) = [r for r in rows if (r["variant"], r["seed"], r["step"], r["metric"]) ==
             ("ce", "0", "20", "exact_match")]
    assert float(em["value"]) == pytest.approx(metrics_json["exact_match"])


def test_report_and_plots(grid):
    path, result = grid
    report = result.report.read_text()
    assert f"emdlm experiment -c {path}" in report
    assert "Cells finished: 4/6; failed: 2" in report
    assert "| abs_error_mean | ntil |" in report  # the paired comparison against ce
    assert "Wilcoxon cannot reach p < 0.05 (needs >= 6)" in report  # 2 seeds
    assert "Area under the learning curve" in report
    assert "`default/broken/seed0`" in report
    # numeric errors lead, exact match after them
    header = next(line for line in report.splitlines() if line.startswith("| variant | abs_"))
    assert header.index("abs_error_mean") < header.index("exact_match")
    names = sorted(p.name for p in result.plots)
    assert names == ["default_curves.png", "default_errors.png"]
    for p in result.plots:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
        assert f"plots/{p.name}" in report


def test_second_invocation_skips_finished_cells(grid, tmp_path):
    path, result = grid
    done = result.output_dir / "default" / "ce" / "seed0" / CELL_DONE
    before = done.stat().st_mtime_ns
    # a cell that lost its marker and one evaluation: training is not repeated, only the
    # missing evaluation is redone
    half = result.output_dir / "default" / "ntil" / "seed0"
    (half / CELL_DONE).unlink()
    step3 = half / "eval" / "step-10" / "metrics.json"
    old = json.loads(step3.read_text())
    step3.unlink()
    summary_mtime = (half / "train" / "train_summary.json").stat().st_mtime_ns
    again = run_experiment(path, progress=False)
    status = {o.key: o.status for o in again.outcomes}
    assert status["default/ce/seed0"] == "skipped" and status["default/ce/seed1"] == "skipped"
    assert status["default/ntil/seed0"] == "done"
    assert status["default/broken/seed1"] == "failed"  # retried, fails again
    assert done.stat().st_mtime_ns == before
    assert (half / "train" / "train_summary.json").stat().st_mtime_ns == summary_mtime
    assert json.loads(step3.read_text()) == old  # same model, greedy decoding: same metrics
    # its wall time adds this invocation's to the time the first one left in the ledger
    first = json.loads(done.read_text())
    assert first["resumed"] is False and first["wall_complete"] is True
    assert first["wall_s"] == pytest.approx(first["wall_s_this_invocation"])
    record = json.loads((half / CELL_DONE).read_text())
    ledger = json.loads((half / WALL_TIME_FILE).read_text())
    assert record["resumed"] is True and record["wall_complete"] is True
    assert ledger["earlier_s"] > 0 and record["wall_s"] == pytest.approx(
        ledger["earlier_s"] + record["wall_s_this_invocation"])
    assert "resumed an interrupted run" not in again.report.read_text()


def test_resumed_cell_without_ledger_is_reported_as_under_counted(grid):
    """A cell begun before the time ledger existed (or whose ledger is gone): its earlier
    time is unknown, and the report says the sum under-counts."""
    path, result = grid
    half = result.output_dir / "default" / "ce" / "seed1"
    (half / CELL_DONE).unlink()
    (half / WALL_TIME_FILE).unlink()
    again = run_experiment(path, progress=False)
    record = json.loads((half / CELL_DONE).read_text())
    assert record["resumed"] is True and record["wall_complete"] is False
    assert record["wall_s"] == pytest.approx(record["wall_s_this_invocation"])
    assert "1 of them resumed an interrupted run whose time was not recorded" in (
        again.report.read_text())


def test_wall_ledger_survives_a_killed_invocation(tmp_path):
    """The heartbeat rewrites the ledger while the cell runs; an invocation killed without
    warning (no __exit__) leaves its time, which the next invocation adds."""
    folder = tmp_path / "cell"
    folder.mkdir()
    killed = WallLedger(folder, resumed=False, heartbeat_s=0.01)
    killed.write()
    killed._thread.start()
    deadline = time.monotonic() + 10
    while json.loads((folder / WALL_TIME_FILE).read_text())["this_s"] < 0.05:
        assert time.monotonic() < deadline, "the heartbeat never rewrote the ledger"
        time.sleep(0.01)
    killed._stop.set()  # the process dies here: no final write
    killed._thread.join()
    left = json.loads((folder / WALL_TIME_FILE).read_text())
    assert left["earlier_s"] == 0.0
    with WallLedger(folder, resumed=True) as next_one:
        assert next_one.complete and next_one.earlier_s == pytest.approx(left["this_s"])
    final = json.loads((folder / WALL_TIME_FILE).read_text())
    assert final["earlier_s"] == pytest.approx(left["this_s"]) and final["this_s"] > 0
    # a torn ledger: the time is unknown, not zero
    (folder / WALL_TIME_FILE).write_text('{"earlier_s": 1.0')
    assert not WallLedger(folder, resumed=True).complete


def test_worker_processes_record_failures(tmp_path):
    """Two spawned workers; each cell fails inside its worker and is reported. (The cells'
    training is marked finished and they ask for a scheduled checkpoint that is not on disk,
    so they fail before any model is loaded: this test is about the pool, not about training.
    A step that is no multiple of train.save_steps is refused before any cell starts.)"""
    data = {"base": BASE, "variants": {"ce": []}, "seeds": [0, 1],
            "eval": {"checkpoints": [10]}, "output_dir": str(tmp_path / "grid")}
    cells = expand_grid(parse_experiment(data))
    for cell in cells:
        cell.train_dir.mkdir(parents=True)
        (cell.train_dir / "train_summary.json").write_text('{"global_step": 20}')
    outcomes = run_cells(cells, workers=2, threads=1, progress=False)
    assert [o.status for o in outcomes] == ["failed", "failed"]
    for cell in cells:
        assert "eval.checkpoints [10] were not saved" in (cell.folder / ERROR_FILE).read_text()
        assert not (cell.folder / CELL_DONE).exists()


def test_cell_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    data = {"base": BASE, "variants": {"ce": []}, "output_dir": str(tmp_path / "file" / "x")}
    (outcome,) = run_cells(expand_grid(parse_experiment(data)), workers=1, threads=1,
                           progress=False)
    assert outcome.status == "failed" and "cannot create" in outcome.error


def test_cli_experiment_report_only(grid):
    path, _ = grid
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--report-only"])
    assert res.exit_code == 0, res.output
    assert "report.md" in res.output
    bad = CliRunner().invoke(app, ["experiment", "-c", str(path), "varaints=1"])
    assert bad.exit_code == 2 and "unknown experiment key" in bad.output


def test_ctrl_c_stops_the_grid_without_marking_the_cell_failed(tmp_path, monkeypatch):
    """A Ctrl-C inside training (TrainingInterrupted, checkpoint saved) ends the grid with
    KeyboardInterrupt: no error.txt, no marker, and the next cell is not started."""
    from emdlm.experiments import runner
    from emdlm.training import TrainingInterrupted

    started = []

    def interrupted(cell):
        started.append(cell.key)
        raise TrainingInterrupted(cell.train_dir / "checkpoint-3")

    monkeypatch.setattr(runner, "_train", interrupted)
    data = {"base": BASE, "variants": {"ce": []}, "seeds": [0, 1],
            "output_dir": str(tmp_path / "grid")}
    cells = expand_grid(parse_experiment(data))
    with pytest.raises(KeyboardInterrupt, match="checkpoint-3"):
        run_cells(cells, workers=1, threads=1, progress=False)
    assert started == ["default/ce/seed0"]
    assert not (cells[0].folder / ERROR_FILE).exists()
    assert not (cells[0].folder / CELL_DONE).exists()


def test_a_cell_whose_eval_cannot_generate_fails_before_training(tmp_path):
    """eval.overrides asking for more new tokens than the model's positions hold: the cell
    fails at once, naming the problem, with no training step run."""
    path = _write_exp(tmp_path, variants={"ce": ["objective.name=ce"]}, seeds=[0],
                      eval={"checkpoints": "final", "overrides": ["eval.max_new_tokens=40"]})
    result = run_experiment(path, progress=False)
    assert [o.status for o in result.outcomes] == ["failed"]
    cell = tmp_path / "grid" / "default" / "ce" / "seed0"
    assert "eval.max_new_tokens=40 exceeds the model's context length 32" in (
        cell / ERROR_FILE).read_text()
    assert not (cell / "train" / "train_summary.json").exists()
    assert not list((cell / "train").glob("checkpoint-*"))


def test_a_cell_another_process_holds_is_left_alone(tmp_path):
    """The same grid started twice on one folder: the second invocation reports the held cell
    (naming the holder's pid) and writes nothing into it; once released, the cell runs."""
    fcntl = pytest.importorskip("fcntl")

    data = {"base": BASE, "variants": {"ce": []}, "output_dir": str(tmp_path / "grid")}
    (cell,) = expand_grid(parse_experiment(data))
    cell.folder.mkdir(parents=True)
    with open(cell.folder / LOCK_FILE, "w") as other:  # the "other process"
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (outcome,) = run_cells([cell], workers=1, threads=1, progress=False)
        assert outcome.status == "failed"
        assert "in use by another process (pid 4242)" in outcome.error
        assert sorted(p.name for p in cell.folder.iterdir()) == [LOCK_FILE]
    (outcome,) = run_cells([cell], workers=1, threads=1, progress=False)  # released
    assert outcome.status == "done" and (cell.folder / CELL_DONE).is_file()


def test_only_runs_the_matching_cells_and_reports_what_is_finished(tmp_path):
    """`--only` runs part of the grid (here one late seed of a non-baseline variant, with the
    baseline's cells not yet run): the other cells stay untouched and the report is written
    over the finished ones; a pattern that matches no cell stops before anything runs."""
    path = _write_exp(tmp_path, variants={k: VARIANTS[k] for k in ("ce", "ntil")})
    out = tmp_path / "grid" / "default"
    bad = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress",
                                   "--only", "*/ntil/seed7"])
    assert bad.exit_code == 2 and "matches no cell" in bad.output
    assert not (tmp_path / "grid").exists()
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress",
                                   "--only", "*/ntil/seed1"])
    assert res.exit_code == 0, res.output
    assert (out / "ntil" / "seed1" / CELL_DONE).is_file()
    assert not any((out / v / f"seed{s}").exists()
                   for v, s in [("ce", 0), ("ce", 1), ("ntil", 0)])
    with (tmp_path / "grid" / "results.csv").open() as fh:
        cells = {(r["variant"], r["seed"]) for r in csv.DictReader(fh)}
    assert cells == {("ntil", "1")}
    report = (tmp_path / "grid" / "report.md").read_text()
    assert "--only */ntil/seed1" in report and "Cells finished: 1/4" in report


def test_a_cells_console_lines_carry_its_name(tmp_path, monkeypatch, capsys):
    """`emdlm experiment` printed its cells' training logs with no cell name: every line a
    cell prints (stdout and stderr, partial writes and \\r included) starts with its key."""
    import io
    import sys

    from emdlm.experiments import runner

    def noisy(cell):
        print(f"emdlm: world size 1 (single process) for {cell.seed}", file=sys.stderr)
        sys.stdout.write("step 1/2: loss 3")
        sys.stdout.write(".5\nstep 2/2: loss 3\n")
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner, "_train", noisy)
    data = {"base": BASE, "variants": {"ce": [], "ntil": ["objective.name=ntil"]}, "seeds": [3],
            "output_dir": str(tmp_path / "grid")}
    outcomes = run_cells(expand_grid(parse_experiment(data)), workers=1, threads=1,
                         progress=False)
    assert [o.status for o in outcomes] == ["failed", "failed"]
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "[default/ce/seed3] step 1/2: loss 3.5", "[default/ce/seed3] step 2/2: loss 3",
        "[default/ntil/seed3] step 1/2: loss 3.5", "[default/ntil/seed3] step 2/2: loss 3"]
    assert captured.err.splitlines() == [
        "[default/ce/seed3] emdlm: world size 1 (single process) for 3",
        "[default/ntil/seed3] emdlm: world size 1 (single process) for 3"]
    assert sys.stdout is not None and not isinstance(sys.stdout, PrefixedLines)
    stream = io.StringIO()
    bar = PrefixedLines(stream, "[k] ")
    bar.write("\r 50%|#   |\r100%|####|\n")
    assert stream.getvalue() == "[k] \r[k]  50%|#   |\r[k] 100%|####|\n"


def test_cell_console_prefixes_logging_handlers_made_before_the_cell() -> None:
    """A logging handler created on the console's stderr before the cell (transformers makes
    its own at import) writes through the cell's prefix while the cell runs, and to the
    console again after it; a file handler is left alone."""
    import io
    import logging
    import sys


    console = io.StringIO()
    old_stderr, sys.stderr = sys.stderr, console
    logger = logging.getLogger("emdlm_test_cell_console")
    logger.propagate = False
    handler = logging.StreamHandler()  # holds the console stream it was made with
    logger.addHandler(handler)
    try:
        logger.warning("before")
        with cell_console("t/ce/seed0"):
            logger.warning("tokenizer has new PAD/BOS/EOS tokens")
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        sys.stderr = old_stderr
    assert console.getvalue().splitlines() == [
        "before", "[t/ce/seed0] tokenizer has new PAD/BOS/EOS tokens", "after"]
    assert handler.stream is console


def test_sigterm_stops_the_grid_even_where_sigint_is_ignored(tmp_path):
    """SIGTERM to the runner is a Ctrl-C of the grid also in a process started with SIGINT
    ignored (a command put in the background by a non-interactive shell, ``cmd &``, inherits
    SIG_IGN for SIGINT, and Python then installs no KeyboardInterrupt handler): re-sending
    SIGINT to itself did nothing there, and the grid ran on to its end."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "from emdlm.experiments.runner import _sigterm_as_ctrl_c\n"
        "try:\n"
        "    with _sigterm_as_ctrl_c():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(50):\n"
        "            __import__('time').sleep(0.1)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted'); sys.exit(0)\n"
        "print('ran on'); sys.exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_IGN))
    assert (proc.returncode, proc.stdout.strip()) == (0, "interrupted"), proc.stderr[-2000:]
