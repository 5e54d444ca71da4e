"""Whole-or-nothing file writes and exclusive file locks for folders that several processes
share (image caches, experiment cells, run folders), and reading the JSON-lines logs they append
to (:func:`read_appended_jsonl`: a last line torn by a killed writer is left out, said once).

A lock file that names its holder (:func:`hold_lock_file`) holds one line, ``<pid>`` or
``<pid> <what it is doing>``, written once the lock is taken and cleared before it is released.
The line is only ever read while another process holds the lock, so the text a killed holder
leaves behind (SIGKILL: the OS drops the lock, the text stays) never blocks anyone.

Symbolic links: emdlm never writes, truncates, renames over or deletes through a link inside a
folder it writes (:func:`refuse_links`). The folder the user named may itself be a link, or lie
below one (``runs -> /big/disk/runs``): that is the user's choice. Below it, a link where emdlm
would write (a lock file pointing at ``~/.bashrc``, an ``eval/`` pointing at another run) is
refused in one line naming it: :func:`atomic_write` checks its target, a lock file is opened
with ``O_NOFOLLOW`` and must be a plain file (:func:`hold_lock_file`), and the folders' own
checks (run folders, evaluations, experiment cells) call :func:`refuse_links` before the first
write."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from emdlm.config import ConfigError

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


class FolderEntryError(ConfigError):
    """A path emdlm was about to write, lock or delete is not one it may use: a symbolic link
    inside a folder it writes, or a lock file that is not a plain file it can open. The message
    is one line naming the path and what it is."""


def _link_error(link: Path) -> FolderEntryError:
    try:
        target = f" (to {os.readlink(link)})"
    except OSError:
        target = ""
    return FolderEntryError(
        f"{link} is a symbolic link{target}: emdlm does not write through links inside the "
        "folders it writes; remove the link, or use another folder"
    )


def refuse_links(path: str | os.PathLike[str], *, within: str | os.PathLike[str] | None = None
                 ) -> None:
    """:class:`FolderEntryError` naming the link when ``path``, or a folder between ``within``
    and ``path``, is a symbolic link; reads only (``lstat``), a missing path is fine.

    ``within``: the folder the user named (a run folder, an experiment's output_dir, an
    ``--out``), which may itself be a link or lie below one; default ``path``'s parent, so that
    only ``path`` itself is checked. ``path`` must lie below ``within`` (compared as absolute
    paths, links not resolved)."""
    path = Path(path)
    root = path.parent if within is None else Path(within)
    if path.is_absolute() != root.is_absolute():
        path, root = path.absolute(), root.absolute()
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise _link_error(current)


def first_link_below(folder: str | os.PathLike[str]) -> Path | None:
    """The first symbolic link found anywhere below ``folder`` (links are not followed), or
    None; for folders whose every entry emdlm writes (an experiment cell)."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            if os.path.islink(os.path.join(root, name)):
                return Path(root, name)
    return None


def refuse_links_below(folder: str | os.PathLike[str]) -> None:
    """:class:`FolderEntryError` naming the first symbolic link below ``folder``
    (:func:`first_link_below`); nothing when there is none."""
    link = first_link_below(folder)
    if link is not None:
        raise _link_error(link)


class LockHeldError(BlockingIOError):
    """Another process holds the lock (raised by :func:`exclusive_lock` with ``blocking=False``).

    ``holder``: who holds it as its record says (:func:`lock_holder`), when the lock file has
    one (:func:`hold_lock_file`, :func:`check_lock_free`); empty otherwise."""

    holder: str = ""


@contextlib.contextmanager
def atomic_write(
    path: Path, *, binary: bool = False, within: Path | None = None
) -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file in the same folder, renamed into place when the
    ``with`` block ends without error (``os.replace`` is atomic on one file system), so a
    concurrent reader sees the old file or the whole new one, never a half-written one.

    The file is made readable by all (0644; ``mkstemp`` makes it private, and a cache may be
    shared). After an error the temporary file is removed and ``path`` is left as it was.
    ``path`` (and, with ``within``, every folder between ``within`` and it) must not be a
    symbolic link (:func:`refuse_links`): the link would be replaced, or (a linked folder)
    the file written where it points.
    """
    refuse_links(path, within=within)
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


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _not_a_plain_file(path: Path, mode: int) -> FolderEntryError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
    return FolderEntryError(
        f"the lock file {path} is {kind}, not a plain file: emdlm locks a plain file there; "
        "remove it (emdlm creates it again)"
    )


def _open_lock(path: Path, *, create: bool) -> IO[Any] | None:
    """``path`` opened for reading and writing, never through a link (``O_NOFOLLOW``), and only
    when it is a plain file; None when it is missing and ``create`` is False.

    :class:`FolderEntryError` naming the lock file when it is a link, a folder, a FIFO or
    another special file, or exists but cannot be opened (permissions); a missing file that
    cannot be created raises the OSError (the folder's problem, not the lock's)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
        if not create:
            return None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise _link_error(path)
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise _not_a_plain_file(path, info.st_mode)
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | (os.O_CREAT | os.O_APPEND if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if info is None:  # could not be created: the folder's problem
            raise
        if err.errno == getattr(os, "ELOOP", None):  # became a link since the lstat
            raise _link_error(path) from None
        raise FolderEntryError(
            f"the lock file {path} cannot be opened for reading and writing "
            f"({err.strerror or err}): give this user access to it, or remove it"
        ) from None
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise _not_a_plain_file(path, opened.st_mode)
    return os.fdopen(fd, "a+" if create else "r+", encoding="utf-8")


def open_lock_file(path: Path) -> IO[Any]:
    """``path`` opened (created if missing) for a lock, read and written but never through a
    symbolic link, and only when it is a plain file; :class:`FolderEntryError` naming it
    otherwise (see :func:`_open_lock`)."""
    fh = _open_lock(path, create=True)
    assert fh is not None  # created when missing
    return fh


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

    The lock file is never opened through a symbolic link and must be a plain file: anything
    else is :class:`FolderEntryError` naming it and what it is (:func:`open_lock_file`).
    """
    fh = open_lock_file(path)
    with fh, contextlib.ExitStack() as held:
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
    refused as if this one held it: a near-miss, not a way to get two holders.

    A lock file that is a link, not a plain file, or not open to this user is
    :class:`FolderEntryError` now, as :func:`hold_lock_file` would raise it later."""
    fh = _open_lock(path, create=False)
    if fh is None:  # missing: nothing to test
        return
    with fh:
        try:
            with exclusive_lock(fh, blocking=False):
                pass
        except LockHeldError:
            raise _held_error(fh, path) from None
