"""ICDAR2015 and MSRA-TD500 in their own on-disk formats -> text detection rows.

Rows ``{"image", "prompt", "completion", "boxes", "words", "box_format"}`` in the format of the
``text_detection`` generator (:mod:`emdlm.tasks.text_detection`): the answer lists every text
box in reading order (:func:`emdlm.metrics.boxes.reading_order`), ``"none"`` for an image with
no box to find. The curved text datasets are read by :mod:`emdlm.datasets.curved_text`.

* ICDAR2015 (:func:`read_icdar2015`): ``gt_img_N.txt`` beside ``img_N.jpg``; lines
  ``x1,y1,x2,y2,x3,y3,x4,y4,transcription`` (UTF-8 with BOM); ``###`` marks "don't care" text,
  left out of the gold boxes by default (as the official protocol ignores it). Each quad becomes
  its axis-aligned bounding box.
* MSRA-TD500 (:func:`read_td500`): ``IMG_N.gt`` beside ``IMG_N.JPG``; lines
  ``index difficult x y w h angle`` (a rectangle rotated by ``angle`` radians about its centre)
  -> its axis-aligned bounding box; difficult boxes are left out by default (the protocol
  ignores them).

A malformed or non-finite line, a box outside its image, a file that is not UTF-8 or an image
that does not decode in full is a :class:`emdlm.config.ConfigError` naming the file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.reading import (
    PathLike,
    all_finite,
    check_box,
    image_size,
    label_image,
    read_text,
    sorted_files,
)
from emdlm.metrics.boxes import (
    check_box_format,
    quad_bbox,
    rotated_rect_bbox,
)
from emdlm.tasks.text_detection import detection_row

#: The transcription of a "don't care" region in ICDAR2015 (and CTW1500's polygon labels).
DONT_CARE = "###"


def text_detection_row(
    image: Path,
    boxes: list[tuple[float, float, float, float]],
    words: list[str],
    width: int,
    height: int,
    box_format: str,
    wheres: list[str],
) -> dict[str, Any]:
    """The text detection row of one image; ConfigError naming the box's ``where`` (file:line
    or entry) for a box with no answer (:func:`emdlm.metrics.boxes.box_problem`: not finite
    after the reader's arithmetic, or outside the ``width`` x ``height`` image)."""
    for box, where in zip(boxes, wheres, strict=True):
        check_box(box, width, height, where, image)
    return {"image": str(image.resolve()),
            **detection_row(boxes, words, width, height, box_format)}


def read_icdar2015(
    image_dir: PathLike,
    gt_dir: PathLike,
    *,
    box_format: str = "qwen2vl",
    include_dont_care: bool = False,
) -> list[dict[str, Any]]:
    """ICDAR2015 incidental scene text rows, one per ``gt_img_N.txt`` (image ``img_N.*``).

    Each line ``x1,y1,...,x4,y4,transcription`` (the transcription may hold commas) becomes the
    quad's axis-aligned bounding box; ``###`` (don't care) lines are left out unless
    ``include_dont_care``. Rows: ``{"image", "prompt", "completion", "boxes", "words",
    "box_format"}``.
    """
    check_box_format(box_format)
    images = Path(image_dir)
    rows = []
    for gt in sorted_files(Path(gt_dir), "gt_*.txt"):
        stem = gt.stem[len("gt_") :]
        image = label_image(images, [stem], gt)
        width, height = image_size(image, f"{gt}:1")
        boxes, words, wheres = [], [], []
        for lineno, line in enumerate(read_text(gt).splitlines(), 1):
            if not line.strip():
                continue
            coords, text = _icdar_line(line, f"{gt}:{lineno}")
            if text == DONT_CARE and not include_dont_care:
                continue
            boxes.append(quad_bbox(coords))
            words.append(text)
            wheres.append(f"{gt}:{lineno}")
        rows.append(text_detection_row(image, boxes, words, width, height, box_format, wheres))
    return rows


def _icdar_line(line: str, where: str) -> tuple[list[float], str]:
    """(8 quad coordinates, transcription) of an ICDAR2015 line; ConfigError naming ``where``
    (file:line) for a malformed line or a coordinate that is NaN or infinite."""
    parts = line.strip().split(",", 8)
    try:
        coords = [float(v) for v in parts[:8]]
    except ValueError:
        coords = []
    if len(parts) < 9 or len(coords) != 8:
        raise ConfigError(
            f"{where}: expected 'x1,y1,x2,y2,x3,y3,x4,y4,transcription', got {line.strip()!r}"
        )
    if not all_finite(coords):
        raise ConfigError(f"{where}: coordinates must be finite numbers, got {line.strip()!r}")
    return coords, parts[8]


def _td500_line(line: str, where: str) -> tuple[float, float, float, float, float, float]:
    """(difficult, x, y, w, h, angle) of a TD500 line; ConfigError naming ``where``
    (file:line) for a malformed line, a NaN or infinite value, or a negative width or height."""
    try:
        _, difficult, x, y, w, h, angle = (float(v) for v in line.split())
    except ValueError as err:
        raise ConfigError(
            f"{where}: expected 'index difficult x y w h angle', got {line.strip()!r}"
        ) from err
    if not all_finite((difficult, x, y, w, h, angle)):
        raise ConfigError(f"{where}: values must be finite numbers, got {line.strip()!r}")
    if w < 0 or h < 0:
        raise ConfigError(f"{where}: width and height must be >= 0, got w={w:g} h={h:g}")
    return difficult, x, y, w, h, angle


def read_td500(
    folder: PathLike,
    *,
    box_format: str = "qwen2vl",
    include_difficult: bool = False,
) -> list[dict[str, Any]]:
    """MSRA-TD500 rows, one per ``*.gt`` file with its image (same stem) in ``folder``.

    Each line ``index difficult x y w h angle`` is a w x h rectangle with top-left (x, y)
    rotated by ``angle`` radians about its centre; it becomes its axis-aligned bounding box
    (:func:`emdlm.metrics.boxes.rotated_rect_bbox`). Lines with ``difficult == 1`` are left out
    unless ``include_difficult``. TD500 has no transcriptions: ``words`` holds "".
    """
    check_box_format(box_format)
    root = Path(folder)
    rows = []
    for gt in sorted_files(root, "*.gt"):
        image = label_image(root, [gt.stem], gt, ".JPG")
        width, height = image_size(image, f"{gt}:1")
        boxes, wheres = [], []
        for lineno, line in enumerate(read_text(gt).splitlines(), 1):
            if not line.strip():
                continue
            difficult, x, y, w, h, angle = _td500_line(line, f"{gt}:{lineno}")
            if difficult and not include_difficult:
                continue
            boxes.append(rotated_rect_bbox(x, y, w, h, angle))
            wheres.append(f"{gt}:{lineno}")
        words = [""] * len(boxes)
        rows.append(text_detection_row(image, boxes, words, width, height, box_format, wheres))
    return rows
