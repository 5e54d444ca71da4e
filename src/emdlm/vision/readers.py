"""Readers for public vision datasets in their own on-disk formats -> image task rows.

Every reader returns rows ``{"image": absolute path, "prompt", "completion", ...metadata}`` in the
same format as the built-in generators (``clock``, ``grounding``, ``text_detection``), so training
and :func:`emdlm.metrics.compute_task_metrics` treat them alike. Bad rows (an image that is
missing or not an image, a malformed annotation line) raise :class:`emdlm.config.ConfigError`
naming the file and line (or entry) before anything trains.

* RefCOCO / RefCOCO+ / RefCOCOg (:func:`read_refcoco`): the ``refs(unc).p`` / ``refs(google).p``
  / ``refs(umd).p`` pickle of lichengunc/refer (a list of refs: ref_id, ann_id, image_id, split,
  sentences[{sent}]), COCO's ``instances.json`` (images and annotations, bbox = [x, y, w, h]) and
  the COCO image folder. One row per sentence. The pickle is read with a restricted unpickler
  that admits only builtin containers and scalars (never code: see :func:`safe_load_pickle`).
* ICDAR2015 (:func:`read_icdar2015`): ``gt_img_N.txt`` beside ``img_N.jpg``; lines
  ``x1,y1,x2,y2,x3,y3,x4,y4,transcription`` (UTF-8 with BOM); ``###`` marks "don't care" text,
  left out of the gold boxes by default (as the official protocol ignores it). Each quad becomes
  its axis-aligned bounding box.
* MSRA-TD500 (:func:`read_td500`): ``IMG_N.gt`` beside ``IMG_N.JPG``; lines
  ``index difficult x y w h angle`` (a rectangle rotated by ``angle`` radians about its centre)
  -> its axis-aligned bounding box; difficult boxes are left out by default (the protocol
  ignores them).
* Clock folders (:func:`read_clock_folder`): images whose file name (``2_55.png``,
  ``2_55_003.jpg``, ``02-55.png``) or a parent folder name (``02-55/x.png``) starts with the time.

Text detection answers list boxes in reading order (see :mod:`emdlm.vision.boxes`); a text image
with no box to find has the answer ``"none"``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.tasks.clock import PROMPT as CLOCK_PROMPT
from emdlm.tasks.clock import format_time
from emdlm.tasks.grounding import PROMPTS as GROUNDING_PROMPTS
from emdlm.tasks.text_detection import PROMPTS as TEXT_PROMPTS
from emdlm.vision.boxes import (
    check_box_format,
    format_box,
    format_boxes,
    quad_bbox,
    reading_order,
    rotated_rect_bbox,
)

PathLike = str | os.PathLike[str]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DONT_CARE = "###"
_CLOCK_NAME_RE = re.compile(r"^(\d{1,2})[_:\-.](\d{2})(?:$|[_\-. ])")

# Globals a refs pickle may name: builtin containers and scalars, nothing callable beyond them.
_SAFE_GLOBALS = frozenset(
    ("builtins", name)
    for name in (
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "str",
        "bytes",
        "bytearray",
        "int",
        "float",
        "complex",
        "bool",
    )
)
_PY2_MODULES = {"__builtin__": "builtins"}


# ----------------------------------------------------------------------------- helpers
def _image_size(path: Path, where: str) -> tuple[int, int]:
    """(width, height) from the image header; ConfigError naming ``where`` if it is missing or
    not an image Pillow can read."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise ConfigError(f"{where}: image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.size
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"{where}: unreadable image {path}: {err}") from err


def _find_image(folder: Path, stem: str) -> Path | None:
    """The image named ``stem`` with any known suffix (either case), or None."""
    for suffix in IMAGE_SUFFIXES:
        for s in (suffix, suffix.upper()):
            p = folder / f"{stem}{s}"
            if p.is_file():
                return p
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global outside :data:`_SAFE_GLOBALS` (a pickle naming ``os.system`` or any
    other callable would run it on load)."""

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 pickles (and protocol <= 2) name the builtins module "__builtin__".
        if (_PY2_MODULES.get(module, module), name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def safe_load_pickle(path: PathLike) -> Any:
    """Load a pickle of builtin containers and scalars (dict, list, str, int, ...) only.

    Python 2 pickles (the RefCOCO refs files) load too: their byte strings are decoded as UTF-8
    (invalid bytes replaced). Raises ConfigError for any other global (e.g. ``os.system``) or a
    corrupt file.
    """
    data = Path(path).read_bytes()
    try:
        return _RestrictedUnpickler(io.BytesIO(data), encoding="utf-8", errors="replace").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise ConfigError(f"{path}: refused or unreadable pickle: {err}") from err


# ----------------------------------------------------------------------------- RefCOCO
def read_refcoco(
    refs_path: PathLike,
    instances_path: PathLike,
    image_dir: PathLike,
    *,
    split: str | None = "val",
    box_format: str = "qwen2vl",
) -> list[dict[str, Any]]:
    """RefCOCO / RefCOCO+ / RefCOCOg rows, one per referring sentence.

    Args:
        refs_path: the ``refs(unc).p`` / ``refs(google).p`` / ``refs(umd).p`` pickle.
        instances_path: the dataset's COCO ``instances.json``.
        image_dir: the folder of the COCO images (``train2014``), named as in instances.json.
        split: keep refs of this split ("train", "val", "test", "testA", "testB"); None for all.
        box_format: "qwen2vl" or "llava" (see :mod:`emdlm.vision.boxes`).

    Returns:
        rows ``{"image", "prompt", "completion", "expression", "boxes": [[x1, y1, x2, y2]],
        "box_format", "ref_id", "split"}`` (boxes in pixels).
    """
    check_box_format(box_format)
    refs = safe_load_pickle(refs_path)
    if not isinstance(refs, list):
        raise ConfigError(f"{refs_path}: expected a list of refs, got {type(refs).__name__}")
    try:
        instances = json.loads(Path(instances_path).read_text(encoding="utf-8"))
        images = {int(im["id"]): im for im in instances["images"]}
        anns = {int(a["id"]): a for a in instances["annotations"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{instances_path}: not a COCO instances file: {err}") from err
    folder = Path(image_dir)
    rows: list[dict[str, Any]] = []
    for i, ref in enumerate(refs):
        where = f"{refs_path}[{i}]"
        try:
            if split is not None and ref["split"] != split:
                continue
            image = images[int(ref["image_id"])]
            x, y, w, h = (float(v) for v in anns[int(ref["ann_id"])]["bbox"])
            sentences = [s["sent"] for s in ref["sentences"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"{where}: malformed ref or unknown image/annotation: {err!r}"
            ) from err
        path = folder / image["file_name"]
        width, height = _image_size(path, where)
        box = (x, y, x + w, y + h)
        answer = format_box(box, width, height, box_format)
        for sent in sentences:
            rows.append(
                {
                    "image": str(path.resolve()),
                    "prompt": GROUNDING_PROMPTS[box_format].format(expr=sent.strip()),
                    "completion": answer,
                    "expression": sent.strip(),
                    "boxes": [list(box)],
                    "box_format": box_format,
                    "ref_id": ref.get("ref_id"),
                    "split": ref["split"],
                }
            )
    return rows


# ----------------------------------------------------------------------------- text detection
def _text_row(
    image: Path,
    boxes: list[tuple[float, float, float, float]],
    words: list[str],
    width: int,
    height: int,
    box_format: str,
) -> dict[str, Any]:
    order = reading_order(boxes)
    boxes = [boxes[i] for i in order]
    return {
        "image": str(image.resolve()),
        "prompt": TEXT_PROMPTS[box_format],
        "completion": format_boxes(boxes, width, height, box_format),
        "boxes": [list(b) for b in boxes],
        "words": [words[i] for i in order],
        "box_format": box_format,
    }


def _sorted_files(folder: Path, pattern: str) -> list[Path]:
    files = sorted(folder.glob(pattern), key=lambda p: _natural_key(p.name))
    if not files:
        raise ConfigError(f"{folder}: no files matching {pattern!r}")
    return files


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


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
    for gt in _sorted_files(Path(gt_dir), "gt_*.txt"):
        stem = gt.stem[len("gt_") :]
        image = _find_image(images, stem)
        if image is None:
            raise ConfigError(f"{gt}:1: image not found: {images / stem}.jpg")
        width, height = _image_size(image, f"{gt}:1")
        boxes, words = [], []
        # utf-8-sig drops the byte-order mark the official files start with.
        for lineno, line in enumerate(gt.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            parts = line.strip().split(",", 8)
            try:
                coords = [float(v) for v in parts[:8]]
            except ValueError:
                coords = []
            if len(parts) < 9 or len(coords) != 8:
                raise ConfigError(
                    f"{gt}:{lineno}: expected 'x1,y1,x2,y2,x3,y3,x4,y4,transcription', "
                    f"got {line.strip()!r}"
                )
            text = parts[8]
            if text == DONT_CARE and not include_dont_care:
                continue
            boxes.append(quad_bbox(coords))
            words.append(text)
        rows.append(_text_row(image, boxes, words, width, height, box_format))
    return rows


def read_td500(
    folder: PathLike,
    *,
    box_format: str = "qwen2vl",
    include_difficult: bool = False,
) -> list[dict[str, Any]]:
    """MSRA-TD500 rows, one per ``*.gt`` file with its image (same stem) in ``folder``.

    Each line ``index difficult x y w h angle`` is a w x h rectangle with top-left (x, y)
    rotated by ``angle`` radians about its centre; it becomes its axis-aligned bounding box
    (:func:`emdlm.vision.boxes.rotated_rect_bbox`). Lines with ``difficult == 1`` are left out
    unless ``include_difficult``. TD500 has no transcriptions: ``words`` holds "".
    """
    check_box_format(box_format)
    root = Path(folder)
    rows = []
    for gt in _sorted_files(root, "*.gt"):
        image = _find_image(root, gt.stem)
        if image is None:
            raise ConfigError(f"{gt}:1: image not found: {root / gt.stem}.JPG")
        width, height = _image_size(image, f"{gt}:1")
        boxes = []
        for lineno, line in enumerate(gt.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                _, difficult, x, y, w, h, angle = (float(v) for v in parts)
            except ValueError as err:
                raise ConfigError(
                    f"{gt}:{lineno}: expected 'index difficult x y w h angle', got {line.strip()!r}"
                ) from err
            if difficult and not include_difficult:
                continue
            boxes.append(rotated_rect_bbox(x, y, w, h, angle))
        rows.append(_text_row(image, boxes, [""] * len(boxes), width, height, box_format))
    return rows


# ----------------------------------------------------------------------------- clocks
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
        key=lambda p: [_natural_key(part) for part in p.relative_to(base).parts],
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
        _image_size(path, str(path))
        rows.append(
            {
                "image": str(path.resolve()),
                "prompt": CLOCK_PROMPT,
                "completion": answer,
                "time": answer,
            }
        )
    return rows


# ----------------------------------------------------------------------------- JSONL
def read_image_jsonl(path: PathLike, *, check_images: bool = True) -> list[dict[str, Any]]:
    """Rows of an image+text JSONL file: ``{"image", "prompt", "completion", ...}`` per line.

    Relative ``image`` paths are resolved against the JSONL file's folder (returned absolute).
    Missing fields, a non-object line, or (with ``check_images``) a missing or unreadable image
    raise ConfigError with ``file:line``.
    """
    src = Path(path)
    folder = src.resolve().parent
    rows = []
    for lineno, line in enumerate(src.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{src}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON: {err}") from err
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in ("image", "prompt", "completion") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{where}: missing or non-string field(s) {missing}")
        image = Path(row["image"])
        image = image if image.is_absolute() else folder / image
        if check_images:
            _image_size(image, where)
        rows.append({**row, "image": str(image)})
    return rows
