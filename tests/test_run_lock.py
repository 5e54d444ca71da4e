"""One writer per run folder: `emdlm train` (new run, `--overwrite`, `--resume`) and `emdlm eval`
writing into a run folder hold the folder's lock (`.emdlm.lock`, an flock); a second process is
refused at once with one line naming the holder's pid and what it is doing, and writes or deletes
nothing. The OS drops the lock of a killed holder, so the pid text it leaves blocks nobody.

The "other process" is a real process: a small holder script that takes the lock as emdlm does
(flock, then `<pid> emdlm train` in the file), or real `emdlm train` subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from emdlm.cli import app

pytest.importorskip("fcntl")  # the holder script locks with flock (POSIX)

LOCK = ".emdlm.lock"  # the lock file's name in a run folder, as users see it
runner = CliRunner()
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval=null",
    "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
]
EVAL = ["--task", "arithmetic", "--n", "2", "eval.max_new_tokens=2"]
# takes the lock the way emdlm does, says so, and holds it until its stdin closes
HOLDER = """
import fcntl, os, sys
fh = open(sys.argv[1], "a+")
fcntl.flock(fh, fcntl.LOCK_EX)
fh.seek(0)
fh.truncate()
fh.write(f"{os.getpid()} emdlm train\\n")
fh.flush()
print("held", flush=True)
sys.stdin.read()
"""


def _cli(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@contextlib.contextmanager
def _held(folder: Path) -> Iterator[subprocess.Popen[str]]:
    """Another live process holds ``folder``'s lock for the ``with`` block."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / LOCK)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def _refused(code: int, text: str, holder_pid: int) -> None:
    """Exit 2 and one line naming the holder's pid and what it is doing; no traceback."""
    assert code == 2, text
    (line,) = _error_lines(text)
    assert f"is in use by another process, pid {holder_pid} (emdlm train)" in line, text
    assert "Traceback" not in text


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run with checkpoints (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=2",
                      "train.save_steps=1", f"output_dir={out}")
    assert code == 0, text
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["new", "overwrite", "resume"])
def test_train_on_a_folder_another_process_holds_is_refused(tmp_path, trained_run, mode):
    """A new run into a folder whose run just started, `--overwrite` and `--resume` of a folder
    another process is training in: exit 2 at once, one line naming the holder; nothing in the
    folder is written or deleted."""
    out = tmp_path / "run"
    if mode != "new":
        shutil.copytree(trained_run, out)
    flags = {"new": [], "overwrite": ["--overwrite"], "resume": ["--resume"]}[mode]
    with _held(out) as holder:
        before = _snapshot(out)
        code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=3",
                          f"output_dir={out}", *flags)
        _refused(code, text, holder.pid)
        assert _snapshot(out) == before
        assert (out / LOCK).read_text() == f"{holder.pid} emdlm train\n"  # left alone


@pytest.mark.slow
def test_eval_into_a_held_run_folder_is_refused_but_may_write_elsewhere(
    tmp_path, trained_run, monkeypatch
):
    """Refused at once: before the model is loaded or a single answer generated."""
    import emdlm.training.evaluate as evaluate

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    real_evaluate = evaluate._evaluate
    evaluated: list[Path] = []

    def spy(run_dir, cfg, target):
        evaluated.append(target)
        return real_evaluate(run_dir, cfg, target)

    monkeypatch.setattr(evaluate, "_evaluate", spy)
    with _held(out) as holder:
        before = _snapshot(out)
        code, text = _cli("eval", out, *EVAL)
        _refused(code, text, holder.pid)
        assert evaluated == []  # nothing was evaluated before the refusal
        assert "--out" in _error_lines(text)[0]  # says how to evaluate meanwhile
        assert _snapshot(out) == before and not (out / "eval").exists()
        # the evaluation written outside the run folder needs no lock
        code, text = _cli("eval", out, *EVAL, "--out", tmp_path / "elsewhere")
        assert code == 0, text
        assert (tmp_path / "elsewhere" / "metrics.json").is_file()
        assert evaluated == [tmp_path / "elsewhere"]
        assert _snapshot(out) == before


@pytest.mark.slow
def test_a_lock_left_by_a_killed_holder_does_not_block(tmp_path):
    """The holder is killed with SIGKILL: its pid stays in the lock file, the lock does not. A
    folder holding nothing but that lock file counts as empty, and the next run trains."""
    out = tmp_path / "run"
    with _held(out) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (out / LOCK).read_text() == f"{holder.pid} emdlm train\n"  # the stale record
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=2",
                      f"output_dir={out}")
    assert code == 0, text
    assert (out / "train_summary.json").is_file()
    assert (out / LOCK).read_text() == ""  # released: no holder recorded


def _train_process(out: Path, *extra: str) -> subprocess.Popen[str]:
    """`emdlm train` as its own process (the user's command in another terminal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "emdlm.cli", "train", "-c", "arithmetic_ce", *TINY,
         "train.logging_steps=1", f"output_dir={out}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow
def test_overwrite_while_a_run_trains_is_refused_and_sigkill_frees_the_folder(tmp_path):
    """A real `emdlm train` is training: `--overwrite` and `--resume` from another process are
    refused naming its pid and delete nothing (it goes on training). Killed with SIGKILL, it
    leaves its pid in the lock file; `--resume` then continues the run."""
    out = tmp_path / "run"
    proc = _train_process(out, "train.max_steps=1000000", "train.save_steps=2")
    try:
        deadline = time.monotonic() + 240
        while not any(out.glob("checkpoint-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never saved a checkpoint"
            time.sleep(0.2)
        for flags in (["--overwrite"], ["--resume"]):
            code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=3",
                              f"output_dir={out}", *flags)
            assert code == 2, text
            (line,) = _error_lines(text)
            assert f"in use by another process, pid {proc.pid} (emdlm train)" in line, text
            assert (out / "run_config.yaml").is_file() and (out / "train_log.jsonl").is_file()
        assert proc.poll() is None  # the run was not disturbed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert (out / LOCK).read_text() == f"{proc.pid} emdlm train\n"  # stale, not a holder
    step = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, f"train.max_steps={step + 1}",
                      "train.save_steps=2", f"output_dir={out}", "--resume")
    assert code == 0, text
    assert json.loads((out / "train_summary.json").read_text())["global_step"] == step + 1


@pytest.mark.slow
def test_two_trains_started_together_on_one_folder(tmp_path):
    """Two `emdlm train` on one folder at the same time: exactly one trains, the other exits 2
    with one line naming the first one's pid; the log holds each step once, in order."""
    out = tmp_path / "run"
    steps = 150
    procs = [_train_process(out, f"train.max_steps={steps}", "train.save_steps=50")
             for _ in range(2)]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err[-2000:]) for p, _, err in results]
    (winner, won_out, _), = [r for r in results if r[0].returncode == 0]
    (_, _, lost_err), = [r for r in results if r[0].returncode == 2]
    (line,) = _error_lines(lost_err)
    assert f"in use by another process, pid {winner.pid} (emdlm train" in line, lost_err
    assert "Traceback" not in lost_err
    assert won_out.count("saved: ") == 1  # the CLI's last line, once
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == steps
