"""Stopping a grid that runs in worker processes: one cell folder, one writer.

SIGTERM to the runner must stop the grid as a Ctrl-C does (each training run saves a checkpoint
after its step, no queued cell starts), and workers whose runner was killed outright must stop
too: otherwise they go on training, unseen, beside the next invocation that resumes the same
folders. Real processes and real (tiny) training: the runner is the `emdlm experiment` command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _experiment import TINY_BASE

pytestmark = pytest.mark.slow
psutil = pytest.importorskip("psutil")  # installed with accelerate

# far more steps than the test waits for: only a stop ends these runs
BASE = {**TINY_BASE,
        "train": {"batch_size": 8, "max_steps": 1_000_000, "save_steps": 5, "logging_steps": 1,
                  "tensorboard": False}}


def _start_grid(tmp_path: Path) -> tuple[subprocess.Popen, list[Path]]:
    """Three cells on two workers: two start, the third waits for a free worker."""
    exp = {"base": BASE, "variants": {"ce": []}, "seeds": [0, 1, 2], "workers": 2,
           "output_dir": str(tmp_path / "grid")}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    # the user's command, `emdlm experiment -c exp.yaml --no-progress`, as its own process
    proc = subprocess.Popen([sys.executable, "-m", "emdlm.cli", "experiment", "-c",
                             str(tmp_path / "exp.yaml"), "--no-progress"], cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    folders = [tmp_path / "grid" / "default" / "ce" / f"seed{k}" for k in range(3)]
    return proc, folders


def _wait_until_training(proc: subprocess.Popen, folders: list[Path]) -> list[int]:
    """Wait until both running cells saved a checkpoint; returns the workers' pids."""
    deadline = time.monotonic() + 180
    while not all(any((f / "train").glob("checkpoint-*")) for f in folders[:2]):
        assert proc.poll() is None, f"the runner ended early (exit {proc.returncode})"
        assert time.monotonic() < deadline, "the cells never reached their first checkpoint"
        time.sleep(0.2)
    workers = [c.pid for c in psutil.Process(proc.pid).children()
               if "multiprocessing" in " ".join(c.cmdline()) and "spawn_main" in " ".join(
                   c.cmdline())]
    assert len(workers) == 2, "expected two worker processes"
    return workers


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.2)
    return False


def _logged_steps(folder: Path) -> int:
    """The last step in the cell's train_log.jsonl (0 before the first)."""
    log = folder / "train" / "train_log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    steps = [json.loads(line)["step"] for line in lines if '"step"' in line]
    return max(steps, default=0)


def _assert_stopped(folders: list[Path], steps_at_stop: list[int]) -> None:
    """No writer is left: the logs stop growing, the waiting cell never started, and each
    interrupted cell saved a checkpoint at the step it stopped in (as after a Ctrl-C, not only
    the scheduled ones) and is not marked done or failed."""
    before = [_logged_steps(f) for f in folders[:2]]
    time.sleep(2.0)
    assert [_logged_steps(f) for f in folders[:2]] == before, "a worker is still training"
    assert not folders[2].exists(), "the waiting cell was started after the stop"
    for f, at_stop in zip(folders[:2], steps_at_stop, strict=True):
        newest = max(int(p.name.split("-")[-1]) for p in (f / "train").glob("checkpoint-*"))
        assert newest >= at_stop
        assert not (f / "cell_done.json").exists() and not (f / "error.txt").exists()


def _kill_all(proc: subprocess.Popen, workers: list[int]) -> None:
    """Never leave a process behind a failed test."""
    proc.kill()
    for pid in workers:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


@pytest.mark.parametrize(
    ("sig", "exit_code"),
    [
        (signal.SIGTERM, 130),  # handled: SIGINT to the workers; the CLI's interrupted exit
        (signal.SIGKILL, -signal.SIGKILL),  # no handler runs: the orphaned workers must notice
    ],
    ids=["sigterm", "sigkill"],
)
def test_a_stopped_runner_leaves_no_writer(tmp_path, sig, exit_code):
    proc, folders = _start_grid(tmp_path)
    workers: list[int] = []
    try:
        workers = _wait_until_training(proc, folders)
        steps_at_stop = [_logged_steps(f) for f in folders[:2]]
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == exit_code
        assert _gone(workers, timeout=60), "worker processes outlived the runner"
        _assert_stopped(folders, steps_at_stop)
    finally:
        _kill_all(proc, workers)
