"""emdlm._files.exclusive_lock: the one lock behind experiment cells (cell.lock) and image caches
(.lock). POSIX flock is tested for real; the Windows branch (msvcrt.locking on one byte far past
the content) against a stand-in msvcrt that enforces byte-range locks between file handles the
way Windows does, since no Windows machine runs these tests."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from emdlm import _files
from emdlm._files import WINDOWS_LOCK_OFFSET, LockHeldError, exclusive_lock


class FakeMsvcrt:
    """Byte-range locks keyed by (file, offset): a second handle's LK_NBLCK on a locked byte
    raises OSError, LK_UNLCK by the holder releases it. Records where each call locked."""

    LK_NBLCK = 2
    LK_UNLCK = 0

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.calls: list[tuple[int, int, int]] = []
        self.guard = threading.Lock()

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        self.calls.append((mode, offset, nbytes))
        key = (os.fstat(fd).st_ino, offset)
        with self.guard:
            if mode == self.LK_NBLCK:
                if key in self.held:
                    raise OSError(36, "Resource deadlock avoided")
                self.held[key] = fd
            elif mode == self.LK_UNLCK:
                assert self.held.pop(key) == fd, "unlocked by a handle that does not hold it"


@pytest.fixture(params=["posix", "windows"])
def platform_lock(request, monkeypatch):
    if request.param == "posix":
        pytest.importorskip("fcntl")
        return None
    fake = FakeMsvcrt()
    monkeypatch.setattr(_files, "fcntl", None)
    monkeypatch.setattr(_files, "msvcrt", fake)
    return fake


def test_a_second_handle_is_refused_then_admitted_after_release(tmp_path: Path, platform_lock):
    path = tmp_path / "cell.lock"
    with open(path, "a+") as first, open(path, "a+") as second:
        with (exclusive_lock(first, blocking=False),
              pytest.raises(LockHeldError, match="locked by another process"),
              exclusive_lock(second, blocking=False)):
            pass
        with (exclusive_lock(second, blocking=False),  # released: admitted
              pytest.raises(LockHeldError),
              exclusive_lock(first, blocking=False)):
            pass


def test_a_blocking_lock_waits_for_the_holder(tmp_path: Path, platform_lock, monkeypatch):
    monkeypatch.setattr(_files, "WINDOWS_RETRY_S", 0.01)
    path = tmp_path / ".lock"
    order: list[str] = []
    holding = threading.Event()

    def holder() -> None:
        with open(path, "a") as fh, exclusive_lock(fh, blocking=True):
            holding.set()
            threading.Event().wait(0.2)
            order.append("holder released")

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(5)
    with open(path, "a") as fh, exclusive_lock(fh, blocking=True):
        order.append("waiter acquired")
    thread.join()
    assert order == ["holder released", "waiter acquired"]


def test_the_windows_lock_sits_past_the_content_and_keeps_the_position(tmp_path: Path,
                                                                         monkeypatch):
    """The pid written at the start of cell.lock stays readable to other processes (Windows
    blocks reads of a locked range), and the file position is the caller's."""
    fake = FakeMsvcrt()
    monkeypatch.setattr(_files, "fcntl", None)
    monkeypatch.setattr(_files, "msvcrt", fake)
    path = tmp_path / "cell.lock"
    with open(path, "a+") as fh:
        fh.write("123\n")
        position = fh.tell()
        with exclusive_lock(fh, blocking=False):
            assert fh.tell() == position
            fh.seek(0)
            fh.truncate()
            fh.write("4242\n")
        assert fake.held == {}
    assert path.read_text() == "4242\n"
    assert fake.calls == [(fake.LK_NBLCK, WINDOWS_LOCK_OFFSET, 1),
                          (fake.LK_UNLCK, WINDOWS_LOCK_OFFSET, 1)]


def test_a_held_cell_names_its_holder_on_windows_too(tmp_path: Path, monkeypatch):
    """The runner's cell lock through the Windows branch: the second holder gets
    CellInUseError naming the first one's pid, read from the unlocked start of the file."""
    from emdlm.experiments import cell_folder, cell_lock

    monkeypatch.setattr(_files, "fcntl", None)
    monkeypatch.setattr(_files, "msvcrt", FakeMsvcrt())
    with cell_lock.hold_cell(tmp_path):
        assert (tmp_path / cell_folder.LOCK_FILE).read_text() == (
            f"{os.getpid()} on {cell_lock.this_host()}\n")
        (tmp_path / cell_lock.HOLDER_FILE).unlink()  # the lock file's own line names the holder
        with (pytest.raises(cell_lock.CellInUseError, match=f"pid {os.getpid()}"),
              cell_lock.hold_cell(tmp_path)):
            pass
    with cell_lock.hold_cell(tmp_path):  # released
        pass
