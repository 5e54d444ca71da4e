"""What every dataset reader shares: its files read strictly, its images found, checked and
measured, its boxes checked against their image.

Each check raises :class:`emdlm.config.ConfigError` naming the file and line (or entry) that is
wrong, so a bad dataset stops before anything trains: a text file that is not UTF-8 (a UTF-16
or one-byte file says which it looks like), an image that is missing, outside ``images_root``
or does not decode in full (:func:`emdlm.datasets.images.check_image_file`), a box that cannot
be an answer for its image (:func:`emdlm.metrics.boxes.box_problem`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.images import ImageCheckError, check_image_file, confine
from emdlm.json_io import JSONDataError, parse_json
from emdlm.metrics.boxes import Box, box_problem

PathLike = str | os.PathLike[str]
#: The image files a reader looks for beside a label file (either case).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def image_size(
    path: Path, where: str, images_root: PathLike | None = None, named: str | None = None
) -> tuple[int, int]:
    """Upright (width, height) of the image, decoded in full
    (:func:`emdlm.datasets.images.check_image_file`); ConfigError naming ``where`` if it is
    missing, outside ``images_root``, or not an image Pillow can decode in full (truncated,
    corrupt, an unsupported mode, a decompression bomb)."""
    confine_image(path, where, images_root, named)
    if not path.is_file():
        raise ConfigError(f"{where}: image not found: {path}")
    try:
        return check_image_file(path)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: unreadable image {path}: {err}") from err


def confine_image(
    path: Path, where: str, images_root: PathLike | None, named: str | None = None
) -> None:
    """ConfigError naming ``where`` and the path (as ``named`` in the data file) if
    ``images_root`` is set and the image resolves outside it
    (:func:`emdlm.datasets.images.confine`)."""
    try:
        confine(path, images_root, named)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: {err}") from err


def read_text(path: Path) -> str:
    """The text of a UTF-8 file (a byte-order mark is dropped, as the official ICDAR files
    start with one); ConfigError naming ``file:line`` and the encoding it looks like otherwise.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from err
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path}:1: not UTF-8: starts with a UTF-16 byte-order mark; "
                          "save it as UTF-8")
    if b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8: holds NUL bytes, it looks like UTF-16 "
                          "without a byte-order mark; save it as UTF-8")
    body = data.removeprefix(b"\xef\xbb\xbf")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 (byte 0x{body[err.start]:02x}); it looks like a "
            "one-byte encoding such as Latin-1 / Windows-1252: save it as UTF-8"
        ) from err


def jsonl_values(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, value) of each non-blank line of a JSONL file, read by :func:`read_text`
    and :func:`emdlm.json_io.parse_json`; ConfigError naming the line that is not JSON."""
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            value = parse_json(line)
        except JSONDataError as err:
            raise ConfigError(f"{where}: {err}") from None
        yield where, value


def all_finite(values: Iterable[float]) -> bool:
    """Every value is a finite number (no NaN, no infinity)."""
    return all(math.isfinite(v) for v in values)


def label_image(folder: Path, stems: Sequence[str], label: Path, shown: str = ".jpg") -> Path:
    """The image of label file ``label``: the first of ``stems`` found in ``folder`` with any
    known suffix (either case); ConfigError ``"<label>:1: image not found: <folder>/<first
    stem><shown>"`` when none is."""
    for stem in stems:
        for suffix in IMAGE_SUFFIXES:
            for s in (suffix, suffix.upper()):
                p = folder / f"{stem}{s}"
                if p.is_file():
                    return p
    raise ConfigError(f"{label}:1: image not found: {folder / stems[0]}{shown}")




def check_box(box: Box, width: int, height: int, where: str, image: Path) -> None:
    """ConfigError naming ``where`` and the image for a box that cannot be an answer for it
    (:func:`emdlm.metrics.boxes.box_problem`); the one geometry check of every reader."""
    problem = box_problem(box, width, height)
    if problem is not None:
        raise ConfigError(f"{where}: {problem} {image.name}")


def sorted_files(folder: Path, pattern: str) -> list[Path]:
    """The files of ``folder`` matching ``pattern`` in natural order (``img_2`` before
    ``img_10``); ConfigError when there is none."""
    files = sorted(folder.glob(pattern), key=lambda p: natural_key(p.name))
    if not files:
        raise ConfigError(f"{folder}: no files matching {pattern!r}")
    return files


def natural_key(name: str) -> list[Any]:
    """Sort key of a name with its digit runs compared as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
