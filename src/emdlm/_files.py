"""Whole-or-nothing file writes and exclusive file locks for folders that several processes
share (image caches, experiment cells, run folders), and reading the JSON-lines logs they append
to (:func:`read_appended_jsonl`: a last line torn by a killed writer is left out, said once).

A lock file that names its holder (:func:`hold_lock_file`) holds one line, ``<pid>`` or
``<pid> <what it is doing>``, written once the lock is taken and cleared before it is released.
The line is only ever read while another process holds the lock, so the text a killed holder
leaves behind (SIGKILL: the OS drops the lock, the text stays) never blocks anyone."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt
except ImportError:  # not on Windows
    msvcrt = None  # type: ignore[assignment]

#: Windows locks a byte range, and a locked range cannot be read by other processes; the lock
#: sits on one byte far past any content, so the holder's pid written at the start stays readable.
WINDOWS_LOCK_OFFSET = 1 << 30
#: How often a blocking lock is retried on Windows (msvcrt has no wait-forever mode).
WINDOWS_RETRY_S = 0.1


def read_appended_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that a process appends to (train_log.jsonl).

    A process killed while appending leaves its last line incomplete (no newline at the end,
    not valid JSON): that line is left out with one line on stderr saying so. Any other line
    that is not a JSON object is an error naming the file and the line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):  # torn by a killed writer
                print(f"emdlm: {path}: its last line is incomplete (a run stopped while writing "
                      f"it); {len(line)} characters left out", file=sys.stderr)
                break
            raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}: a JSON object was expected")
        records.append(record)
    return records


class LockHeldError(BlockingIOError):
    """Another process holds the lock (raised by :func:`exclusive_lock` with ``blocking=False``).

    ``holder``: who holds it as its record says (:func:`lock_holder`), when the lock file has
    one (:func:`hold_lock_file`, :func:`check_lock_free`); empty otherwise."""

    holder: str = ""


@contextlib.contextmanager
def atomic_write(path: Path, *, binary: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file in the same folder, renamed into place when the
    ``with`` block ends without error (``os.replace`` is atomic on one file system), so a
    concurrent reader sees the old file or the whole new one, never a half-written one.

    The file is made readable by all (0644; ``mkstemp`` makes it private, and a cache may be
    shared). After an error the temporary file is removed and ``path`` is left as it was.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        fh = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with fh:
            yield fh
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def exclusive_lock(fh: IO[Any], *, blocking: bool) -> Iterator[None]:
    """Hold an exclusive advisory lock on the open file ``fh`` for the ``with`` block.

    POSIX: ``flock`` on the whole file. Windows: ``msvcrt.locking`` on one byte at
    :data:`WINDOWS_LOCK_OFFSET`. Either way the OS drops the lock when the process ends,
    however it ends, so a killed holder leaves no stale lock. ``blocking=False`` raises
    :class:`LockHeldError` at once if another process holds it; ``blocking=True`` waits.
    Where neither exists the block runs unlocked (the atomic writes still keep files whole).
    """
    if fcntl is not None:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockHeldError(f"{getattr(fh, 'name', fh)} is locked by another process") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
        return
    if msvcrt is None:  # pragma: no cover - neither POSIX nor Windows
        yield
        return
    fh.flush()
    fd = fh.fileno()
    while True:
        try:
            _locking_at(fd, msvcrt.LK_NBLCK)
            break
        except OSError:
            if not blocking:
                raise LockHeldError(
                    f"{getattr(fh, 'name', fh)} is locked by another process") from None
            time.sleep(WINDOWS_RETRY_S)
    try:
        yield
    finally:
        fh.flush()
        _locking_at(fd, msvcrt.LK_UNLCK)


def _locking_at(fd: int, mode: int) -> None:
    """``msvcrt.locking`` of the byte at :data:`WINDOWS_LOCK_OFFSET`, leaving the descriptor's
    position where it was (msvcrt locks from the current position)."""
    position = os.lseek(fd, 0, os.SEEK_CUR)
    os.lseek(fd, WINDOWS_LOCK_OFFSET, os.SEEK_SET)
    try:
        msvcrt.locking(fd, mode, 1)
    finally:
        os.lseek(fd, position, os.SEEK_SET)


def lock_holder(fh: IO[Any]) -> str:
    """Who holds the lock on ``fh``, from the record its holder wrote (see the module note):
    ``"pid 123 (emdlm train)"``, ``"pid 123"``, or ``"pid unknown"`` when the holder has not
    written its record yet. Read only while another process holds the lock: the record of a
    holder that died is never taken for a live one (its lock is gone with it)."""
    fh.seek(0)
    words = fh.read().strip().split(maxsplit=1)
    if not words:
        return "pid unknown"
    return f"pid {words[0]}" + (f" ({words[1]})" if len(words) > 1 else "")


def _held_error(fh: IO[Any], path: Path) -> LockHeldError:
    err = LockHeldError(f"{path} is locked by another process")
    err.holder = lock_holder(fh)
    return err


@contextlib.contextmanager
def hold_lock_file(path: Path, doing: str = "") -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing, never deleted) for the ``with``
    block, recording this process as its holder: ``<pid>`` or ``<pid> <doing>`` (e.g.
    ``"emdlm train"``), cleared again before the lock is released.

    Never waits: raises :class:`LockHeldError` at once, its ``holder`` naming the process that
    holds the lock. The OS drops the lock when the process ends however it ends, so a killed
    holder leaves no stale lock. The file is kept so that every process locks the same file
    (a lock file deleted and created again could be held by two processes at once).
    """
    with open(path, "a+", encoding="utf-8") as fh, contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(fh, blocking=False))
        except LockHeldError:
            raise _held_error(fh, path) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {doing}".rstrip() + "\n")
        fh.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # a full disk cannot fail the release
                fh.seek(0)
                fh.truncate()
                fh.flush()


def check_lock_free(path: Path) -> None:
    """Raise :class:`LockHeldError` (naming the holder) if another process holds the lock on
    ``path``; writes nothing (a missing ``path`` is free and is not created). For failing early,
    before the work that leads up to taking the lock with :func:`hold_lock_file`.

    The lock is taken for an instant to test it, so a process taking it in that instant is
    refused as if this one held it: a near-miss, not a way to get two holders."""
    try:
        fh = open(path, "r+", encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError:  # missing, or not ours to open: nothing to test
        return
    with fh:
        try:
            with exclusive_lock(fh, blocking=False):
                pass
        except LockHeldError:
            raise _held_error(fh, path) from None
