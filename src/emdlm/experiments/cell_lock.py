"""The lock of a grid cell's folder, which may sit on a file system that several hosts share
(a cluster's network file system): one process works on a cell at a time, on any host.

Two guards, both in the cell's folder:

1. ``cell.lock``: an OS file lock (:func:`emdlm._files.exclusive_lock`, ``flock``), which the
   OS drops when its holder ends however it ends, so a killed worker leaves no stale lock. It
   holds one line, ``<pid> on <host>``, for readers of the lock (:func:`emdlm._files.lock_holder`).
   On a local file system it is exact. On NFS the Linux client turns ``flock`` into a
   byte-range lock that the server keeps, seen by every client, unless the mount says
   ``local_lock=flock`` / ``local_lock=all`` or ``nolock`` (``nfs(5)``,
   https://man7.org/linux/man-pages/man5/nfs.5.html); a Lustre client mounted with
   ``localflock`` keeps it node-local too.
2. ``cell.holder.json``: who holds the cell, ``{"host", "pid", "job", "token", "beat",
   "heartbeat_s", "time"}``, rewritten whole every ``heartbeat_s`` seconds (``beat`` counts
   up) while the cell is held, deleted when it is released. Where the OS lock is node-local,
   a process on another host can take the OS lock of a held cell: the record tells it so.

Taking the OS lock and finding a record left in place (its writer did not release it):

* written on this host: its writer is dead, since the OS lock on one host is exact; the
  cell is taken over (a worker killed mid-cell, resumed by the next one);
* written on another host: the pid means nothing here, so the writer is judged by its
  heartbeat. A record whose ``time`` is older than :data:`STALE_AFTER_BEATS` heartbeats is
  dead at once; otherwise it is read again after :data:`CONFIRM_BEATS` heartbeats: if it
  changed, a live job holds the cell (:class:`CellInUseError`), if not, its writer is gone (a
  killed job, a node that went away) and the cell is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from emdlm._files import LockHeldError, exclusive_lock, lock_holder, open_lock_file
from emdlm.experiments.cell_folder import LOCK_FILE, write_whole

HOLDER_FILE = "cell.holder.json"
HEARTBEAT_S = 10.0
#: a record from another host is read again after this many of its heartbeats
CONFIRM_BEATS = 2.5
#: a record from another host this many heartbeats old is dead without waiting (far beyond
#: the clock skew of an NTP-synchronised cluster)
STALE_AFTER_BEATS = 30
#: the longest heartbeat a record may claim (a torn or foreign record cannot make us wait long)
MAX_HEARTBEAT_S = 60.0


class CellInUseError(RuntimeError):
    """Another process, on this host or another, holds the cell (the same grid running twice
    on one output folder, or a job of an earlier submission still at work)."""


def this_host() -> str:
    return socket.gethostname()


def job_label() -> str:
    """The batch job this process runs in, for the holder record: ``slurm job 123_4`` for a
    SLURM array task, ``slurm job 123`` for a job, "" outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"slurm job {array}_{task}"
    job = os.environ.get("SLURM_JOB_ID")
    return f"slurm job {job}" if job else ""


def read_holder(folder: Path) -> dict[str, Any] | None:
    """The cell's holder record, or None when there is none (or it is not one: torn, foreign)."""
    try:
        record = json.loads((folder / HOLDER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("host"), str):
        return None
    return record


def describe_holder(record: dict[str, Any]) -> str:
    """``pid 123 on host node7, slurm job 55_2``."""
    job = record.get("job")
    return f"pid {record.get('pid')} on host {record['host']}" + (f", {job}" if job else "")


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def holder_is_alive(folder: Path, record: dict[str, Any], *, sleep: Any = time.sleep) -> bool:
    """Whether the writer of ``record`` (left in ``folder`` by a process that did not release
    the cell, found by one that holds the OS lock) still works on the cell; see the module
    note. ``sleep`` is for tests."""
    if record["host"] == this_host():
        return False  # the OS lock on one host is exact: its writer has ended
    beat_s = min(_number(record, "heartbeat_s") or HEARTBEAT_S, MAX_HEARTBEAT_S)
    written = _number(record, "time")
    if written is None or time.time() - written > STALE_AFTER_BEATS * beat_s:
        return False
    sleep(CONFIRM_BEATS * beat_s)
    again = read_holder(folder)
    return again is not None and again != record


class _Heartbeat:
    """This process's holder record, written now and then every ``heartbeat_s`` seconds by a
    daemon thread until the cell is released; deleted then if it is still ours."""

    def __init__(self, folder: Path, heartbeat_s: float) -> None:
        self.path = folder / HOLDER_FILE
        self.record = {"host": this_host(), "pid": os.getpid(), "job": job_label(),
                       "token": uuid.uuid4().hex, "beat": 0, "heartbeat_s": heartbeat_s,
                       "time": time.time()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="emdlm-cell-heartbeat")

    def write(self) -> None:
        self.record["time"] = time.time()
        write_whole(self.path, json.dumps(self.record) + "\n")

    def _beat(self) -> None:
        while not self._stop.wait(self.record["heartbeat_s"]):
            self.record["beat"] += 1
            with contextlib.suppress(OSError):  # a full disk must not kill the cell
                self.write()

    def __enter__(self) -> _Heartbeat:
        self.write()  # the first write fails here (no folder, full disk), not in the thread
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        left = read_holder(self.path.parent)
        if left is not None and left.get("token") == self.record["token"]:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _in_use(folder: Path, holder: str) -> CellInUseError:
    return CellInUseError(
        f"{folder} is in use by another process ({holder}); is the same grid running twice on "
        "this output_dir, or a job of an earlier submission still at work? The cell was left "
        "alone"
    )


def _write_lock_line(fh: IO[str], line: str) -> None:
    fh.seek(0)
    fh.truncate()
    fh.write(line)
    fh.flush()


@contextlib.contextmanager
def hold_cell(folder: Path, *, heartbeat_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Hold the cell in ``folder`` while this process works on it (both guards of the module
    note). Raises :class:`CellInUseError` naming the holder (pid and host, and its batch job)
    when another process holds it; writes nothing then."""
    # never through a link, and only a plain file (emdlm._files.open_lock_file)
    with open_lock_file(folder / LOCK_FILE) as fh, contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(fh, blocking=False))
        except LockHeldError:
            record = read_holder(folder)
            raise _in_use(folder, describe_holder(record) if record else lock_holder(fh)) from None
        left = read_holder(folder)
        if left is not None and holder_is_alive(folder, left):
            raise _in_use(folder, f"{describe_holder(left)}, whose heartbeat goes on: this "
                          "file system's lock is not seen across hosts")
        _write_lock_line(fh, f"{os.getpid()} on {this_host()}\n")
        try:
            with _Heartbeat(folder, heartbeat_s):
                yield
        finally:
            with contextlib.suppress(OSError):  # a full disk cannot fail the release
                _write_lock_line(fh, "")
