"""Whole-or-nothing file writes for caches that several processes share."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


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
