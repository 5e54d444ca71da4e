"""Folders of clock pictures -> clock rows, the time read from each file's or folder's name.

:func:`read_clock_folder` takes every image under a folder (``2_55.png``, ``2_55_003.jpg``,
``02-55.png``, or ``02-55/x.png``: the name starts with the time) and gives rows in the format
of the ``clock`` generator (:mod:`emdlm.tasks.clock`), each image decoded in full first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.reading import IMAGE_SUFFIXES, PathLike, image_size, natural_key
from emdlm.tasks.clock import PROMPT as CLOCK_PROMPT
from emdlm.tasks.clock import format_time

_CLOCK_NAME_RE = re.compile(r"^(\d{1,2})[_:\-.](\d{2})(?:$|[_\-. ])")


def clock_time_from_name(name: str) -> str | None:
    """The "H_MM" answer a file or folder name starts with (``2_55``, ``02-55``, ``2_55_003``,
    ``12.05``), or None. Hours 0..12 (0 is written 12), minutes 00..59."""
    m = _CLOCK_NAME_RE.match(name)
    if m is None:
        return None
    hour, minute = int(m.group(1)), int(m.group(2))
    if hour > 12 or minute > 59:
        return None
    return format_time(hour, minute)


def read_clock_folder(root: PathLike) -> list[dict[str, Any]]:
    """Clock rows from every image under ``root`` (recursively, sorted), the time taken from the
    file name's stem or else the nearest parent folder's name below ``root``.

    Rows: ``{"image", "prompt", "completion": "H_MM", "time": "H_MM"}``. An image whose names
    carry no time, or that cannot be read, is a ConfigError.
    """
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"{root}: not a folder")
    files = sorted(
        (p for p in base.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda p: [natural_key(part) for part in p.relative_to(base).parts],
    )
    if not files:
        raise ConfigError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)})")
    rows = []
    for path in files:
        names: Iterable[str] = [path.stem, *reversed(path.relative_to(base).parts[:-1])]
        answer = next((t for t in map(clock_time_from_name, names) if t is not None), None)
        if answer is None:
            raise ConfigError(
                f"{path}: no time (H_MM) in its file name or folder names, e.g. '2_55.png'"
            )
        image_size(path, str(path))
        rows.append(
            {
                "image": str(path.resolve()),
                "prompt": CLOCK_PROMPT,
                "completion": answer,
                "time": answer,
            }
        )
    return rows
