"""The cell lock across hosts: the holder record (host, pid, job, heartbeat), a record left by
a dead process taken over, a record of a live job on another host respected even where the
OS lock is not seen across hosts, a dead one there taken over."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from emdlm.experiments import cell_lock
from emdlm.experiments.cell_folder import LOCK_FILE
from emdlm.experiments.cell_lock import HOLDER_FILE, CellInUseError, hold_cell, read_holder


def _leave_record(folder, **fields) -> dict:
    """A holder record as a process that did not release the cell leaves it (no OS lock)."""
    record = {"host": "node7", "pid": 4242, "job": "slurm job 55_2", "token": "t", "beat": 3,
              "heartbeat_s": 0.05, "time": time.time(), **fields}
    (folder / HOLDER_FILE).write_text(json.dumps(record))
    return record


def test_the_holder_record_names_host_pid_and_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "55")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    with hold_cell(tmp_path, heartbeat_s=0.05):
        first = read_holder(tmp_path)
        assert {k: first[k] for k in ("host", "pid", "job")} == {
            "host": cell_lock.this_host(), "pid": os.getpid(), "job": "slurm job 55_2"}
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()} on {cell_lock.this_host()}\n"
        time.sleep(0.3)
        assert read_holder(tmp_path)["beat"] > first["beat"]  # the heartbeat goes on
        with pytest.raises(CellInUseError,
                           match=f"pid {os.getpid()} on host {cell_lock.this_host()}, slurm "
                                 "job 55_2"), hold_cell(tmp_path):
            pass
    assert not (tmp_path / HOLDER_FILE).exists()  # released: the record is gone
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_record_left_on_this_host_is_taken_over_at_once(tmp_path):
    """A worker killed mid-cell (SIGKILL: the OS dropped its lock, its record stayed): the next
    process on this host takes the cell without waiting (the OS lock on one host is exact)."""
    _leave_record(tmp_path, host=cell_lock.this_host(), heartbeat_s=60.0)
    start = time.monotonic()
    with hold_cell(tmp_path):
        assert read_holder(tmp_path)["pid"] == os.getpid()
    assert time.monotonic() - start < 5


def test_a_live_job_on_another_host_keeps_the_cell(tmp_path):
    """Where the OS lock is node-local (this process gets it although node7 holds the cell),
    a record from another host whose heartbeat goes on means the cell is held."""
    # the confirmation waits 2.5 heartbeats: 1 s, so that node7's 20 ms beats land in it even
    # on busy cores (at 0.05 s a starved beat thread made the cell look abandoned)
    record = _leave_record(tmp_path, heartbeat_s=0.4)
    stop = threading.Event()

    def beat() -> None:  # node7's heartbeat, written whole as the real one is (a rename): a
        # plain write_text truncates first, and a read in between found no record at all
        while not stop.wait(0.02):
            record["beat"] += 1
            record["time"] = time.time()
            part = tmp_path / f"{HOLDER_FILE}.part"
            part.write_text(json.dumps(record))
            os.replace(part, tmp_path / HOLDER_FILE)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        with pytest.raises(CellInUseError, match="pid 4242 on host node7, slurm job 55_2, whose "
                                                 "heartbeat goes on"), hold_cell(tmp_path):
            pass
    finally:
        stop.set()
        beating.join()
    assert read_holder(tmp_path)["host"] == "node7"  # left alone


def test_a_dead_job_on_another_host_is_taken_over(tmp_path):
    """node7's record does not change over 2.5 of its heartbeats: its job is gone."""
    _leave_record(tmp_path)
    with hold_cell(tmp_path):
        assert read_holder(tmp_path)["host"] == cell_lock.this_host()


def test_an_old_record_from_another_host_is_dead_without_waiting(tmp_path):
    record = _leave_record(tmp_path, heartbeat_s=10.0, time=time.time() - 3600)

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s for an hour-old record")

    assert not cell_lock.holder_is_alive(tmp_path, record, sleep=no_sleep)


def test_a_foreign_record_cannot_make_the_lock_wait_long(tmp_path):
    """A record claiming a day-long heartbeat is waited on for at most MAX_HEARTBEAT_S beats."""
    record = _leave_record(tmp_path, heartbeat_s=86400.0)
    waited: list[float] = []
    assert not cell_lock.holder_is_alive(tmp_path, record, sleep=waited.append)
    assert waited == [cell_lock.CONFIRM_BEATS * cell_lock.MAX_HEARTBEAT_S]
