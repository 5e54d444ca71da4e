"""Readers for public vision datasets in their own on-disk formats -> image task rows.

Every reader returns rows ``{"image": absolute path, "prompt", "completion", ...metadata}`` in the
same format as the built-in generators (``clock``, ``grounding``, ``text_detection``), so training
and :func:`emdlm.metrics.compute_task_metrics` treat them alike. Bad rows (an image that is
missing or does not decode in full, a malformed or non-finite annotation, a box outside its
image, a file that is not UTF-8) raise :class:`emdlm.config.ConfigError` naming the file and
line (or entry) before anything trains. Every box passes one geometry check
(:func:`emdlm.vision.boxes.box_problem`, after the reader's arithmetic: finite, and inside the
image), and JSON files are read by :func:`emdlm.json_io.parse_json` (a key given twice, deep
nesting and lone surrogates are refused). ``images_root`` (RefCOCO, image JSONL) refuses
images outside a folder. Images are measured upright (EXIF orientation applied), as
:mod:`emdlm.vision.images` feeds them to the model.

* RefCOCO / RefCOCO+ / RefCOCOg (:func:`read_refcoco`): the ``refs(unc).p`` / ``refs(google).p``
  / ``refs(umd).p`` pickle of lichengunc/refer (a list of refs: ref_id, ann_id, image_id, split,
  sentences[{sent}]), COCO's ``instances.json`` (images and annotations, bbox = [x, y, w, h]) and
  the COCO image folder. One row per sentence. The pickle is read with a restricted unpickler
  that admits only builtin containers and scalars: no global but set / frozenset, no object
  building, nothing allocated beyond the file's size (see :func:`safe_load_pickle`).
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

import functools
import io
import math
import os
import pickle
import pickletools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.json_io import JSONDataError, parse_json
from emdlm.tasks.clock import PROMPT as CLOCK_PROMPT
from emdlm.tasks.clock import format_time
from emdlm.tasks.grounding import PROMPTS as GROUNDING_PROMPTS
from emdlm.tasks.text_detection import PROMPTS as TEXT_PROMPTS
from emdlm.vision.boxes import (
    Box,
    box_problem,
    check_box_format,
    format_box,
    format_boxes,
    quad_bbox,
    reading_order,
    rotated_rect_bbox,
)
from emdlm.vision.images import ImageCheckError, check_image_file, confine

PathLike = str | os.PathLike[str]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DONT_CARE = "###"
_CLOCK_NAME_RE = re.compile(r"^(\d{1,2})[_:\-.](\d{2})(?:$|[_\-. ])")

# A refs file is a list of dicts of str / int / float / list: pickled at any protocol 0..5 it
# needs no global at all. set / frozenset (protocols 0..3 pickle them as a call) are the only
# callables admitted, and the items they build are capped by the file's size (see
# _RestrictedUnpickler). Everything else that calls or mutates objects is refused up front.
_SET_TYPES: dict[str, type] = {"set": set, "frozenset": frozenset}
_PICKLE_OPCODES = frozenset(
    (
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE",
        "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
        "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
        "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "BYTEARRAY8", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE",
        "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET",
        "ADDITEMS", "FROZENSET", "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT",
        "MEMOIZE", "GLOBAL", "STACK_GLOBAL", "REDUCE",
    )
)
_OPCODES_BY_CODE = {op.code.encode("latin-1"): op for op in pickletools.opcodes}
_PY2_MODULES = {"__builtin__": "builtins"}


# ----------------------------------------------------------------------------- helpers
def _image_size(
    path: Path, where: str, images_root: PathLike | None = None, named: str | None = None
) -> tuple[int, int]:
    """Upright (width, height) of the image, decoded in full
    (:func:`emdlm.vision.images.check_image_file`); ConfigError naming ``where`` if it is
    missing, outside ``images_root``, or not an image Pillow can decode in full (truncated,
    corrupt, an unsupported mode, a decompression bomb)."""
    _confine(path, where, images_root, named)
    if not path.is_file():
        raise ConfigError(f"{where}: image not found: {path}")
    try:
        return check_image_file(path)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: unreadable image {path}: {err}") from err


def _confine(
    path: Path, where: str, images_root: PathLike | None, named: str | None = None
) -> None:
    """ConfigError naming ``where`` and the path (as ``named`` in the data file) if
    ``images_root`` is set and the image resolves outside it
    (:func:`emdlm.vision.images.confine`)."""
    try:
        confine(path, images_root, named)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: {err}") from err


def _read_text(path: Path) -> str:
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


def _finite(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _find_image(folder: Path, stem: str) -> Path | None:
    """The image named ``stem`` with any known suffix (either case), or None."""
    for suffix in IMAGE_SUFFIXES:
        for s in (suffix, suffix.upper()):
            p = folder / f"{stem}{s}"
            if p.is_file():
                return p
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits no global but ``set`` / ``frozenset``, and those build at most as many items in
    all as the file has bytes: a few bytes that call ``set`` on one big list again and again
    would otherwise allocate without bound. Any other global (``os.system``, ``bytearray``
    whose ``bytearray(10**9)`` takes 1 GB from a 33-byte file) is refused."""

    def __init__(self, data: bytes) -> None:
        # Python 2 pickles (the RefCOCO refs files): byte strings decoded as UTF-8
        super().__init__(io.BytesIO(data), encoding="utf-8", errors="replace")
        self._items_left = len(data)

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 pickles (and protocol <= 2) name the builtins module "__builtin__".
        if _PY2_MODULES.get(module, module) == "builtins" and name in _SET_TYPES:
            return functools.partial(self._build_set, _SET_TYPES[name])
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def _build_set(self, kind: type, items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple)):
            raise pickle.UnpicklingError(
                f"{kind.__name__}() of {type(items).__name__} is not allowed"
            )
        self._items_left -= len(items)
        if self._items_left < 0:
            raise pickle.UnpicklingError(
                "set/frozenset calls build more items than the file has bytes"
            )
        return kind(items)


def _check_opcodes(data: bytes) -> None:
    """UnpicklingError for an opcode outside :data:`_PICKLE_OPCODES` (object building, BUILD,
    extensions, persistent ids), an unknown opcode, or an argument that runs past the end of
    the file (ValueError from ``pickletools``' readers). Nothing is called here, and nothing
    larger than the file is allocated: this walks the opcodes before the unpickler runs."""
    stream = io.BytesIO(data)
    while True:
        pos = stream.tell()
        code = stream.read(1)
        op = _OPCODES_BY_CODE.get(code)
        if op is None:
            raise pickle.UnpicklingError(
                f"truncated: the file ends at byte {pos} before its STOP opcode" if not code
                else f"unknown opcode {code!r} at byte {pos}"
            )
        if op.name not in _PICKLE_OPCODES:
            raise pickle.UnpicklingError(
                f"opcode {op.name} at byte {pos} is not allowed (a refs file holds only lists, "
                "dicts, strings and numbers)"
            )
        if op.name == "STRING":  # Python 2 str: pickletools decodes it as ASCII, Python 2
            if not stream.readline().endswith(b"\n"):  # escaped UTF-8 bytes are not
                raise pickle.UnpicklingError(f"STRING at byte {pos} is truncated")
        elif op.arg is not None:
            op.arg.reader(stream)
        if op.name == "STOP":
            return


def safe_load_pickle(path: PathLike) -> Any:
    """Load a pickle of builtin containers and scalars (dict, list, str, int, ...) only.

    Python 2 pickles (the RefCOCO refs files) load too: their byte strings are decoded as UTF-8
    (invalid bytes replaced). The opcodes are checked first (:func:`_check_opcodes`), then
    loaded by :class:`_RestrictedUnpickler`. Every failure (a forbidden global or opcode, a
    truncated or corrupt file, running out of memory) is a one-line ConfigError naming the file.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from err
    try:
        _check_opcodes(data)
        return _RestrictedUnpickler(data).load()
    except Exception as err:  # every way a hostile file can fail, MemoryError included
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{path}: refused or unreadable pickle: {reason}") from err


# ----------------------------------------------------------------------------- RefCOCO
def read_refcoco(
    refs_path: PathLike,
    instances_path: PathLike,
    image_dir: PathLike,
    *,
    split: str | None = "val",
    box_format: str = "qwen2vl",
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """RefCOCO / RefCOCO+ / RefCOCOg rows, one per referring sentence.

    Args:
        refs_path: the ``refs(unc).p`` / ``refs(google).p`` / ``refs(umd).p`` pickle.
        instances_path: the dataset's COCO ``instances.json``.
        image_dir: the folder of the COCO images (``train2014``), named as in instances.json.
        split: keep refs of this split ("train", "val", "test", "testA", "testB"); None for all.
        box_format: "qwen2vl" or "llava" (see :mod:`emdlm.vision.boxes`).
        images_root: if set, refuse an image (``file_name`` with ``../``, an absolute path, a
            symlink) that resolves outside this folder (:func:`emdlm.vision.images.confine`).

    Returns:
        rows ``{"image", "prompt", "completion", "expression", "boxes": [[x1, y1, x2, y2]],
        "box_format", "ref_id", "split"}`` (boxes in pixels).

    A bbox that is not 4 finite numbers with w, h >= 0, a non-string ``file_name`` or sentence
    is a ConfigError naming the file and the annotation, image or ref.
    """
    check_box_format(box_format)
    refs = safe_load_pickle(refs_path)
    if not isinstance(refs, list):
        raise ConfigError(f"{refs_path}: expected a list of refs, got {type(refs).__name__}")
    images, anns = _load_instances(instances_path)
    folder = Path(image_dir)
    sizes: dict[Path, tuple[int, int]] = {}  # refs share images: decode each once
    rows: list[dict[str, Any]] = []
    for i, ref in enumerate(refs):
        where = f"{refs_path}[{i}]"
        try:
            if split is not None and ref["split"] != split:
                continue
            image_id, ann_id = int(ref["image_id"]), int(ref["ann_id"])
            image, ann = images[image_id], anns[ann_id]
            raw_sentences = ref["sentences"]
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"{where}: malformed ref or unknown image/annotation: {err!r}"
            ) from err
        sentences = _ref_sentences(raw_sentences, where)
        ann_where = f"{instances_path}: annotation id {ann_id}"
        box = _coco_box(ann, ann_where)
        path = folder / _file_name(image, f"{instances_path}: image id {image_id}")
        if path not in sizes:
            sizes[path] = _image_size(path, where, images_root)
        width, height = sizes[path]
        _check_box(box, width, height, ann_where, path)
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


def _load_instances(path: PathLike) -> tuple[dict[int, Any], dict[int, Any]]:
    """(images by id, annotations by id) of a COCO instances.json; ConfigError if it is not
    one (unreadable, not JSON, nested too deeply, missing keys)."""
    try:
        instances = parse_json(Path(path).read_text(encoding="utf-8"))
        images = {int(im["id"]): im for im in instances["images"]}
        anns = {int(a["id"]): a for a in instances["annotations"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{path}: not a COCO instances file: {reason}") from err
    return images, anns


def _coco_box(ann: Any, where: str) -> tuple[float, float, float, float]:
    """(x1, y1, x2, y2) of a COCO annotation's ``bbox`` [x, y, w, h]; ConfigError naming
    ``where`` unless it is 4 finite numbers with w, h >= 0 (NaN or a negative size would
    become an answer like ``(0,0),(0,0)`` or one with x2 < x1)."""
    bbox = ann.get("bbox") if isinstance(ann, dict) else None
    numbers = (
        isinstance(bbox, list) and len(bbox) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)
    )
    if not numbers or not _finite(bbox) or bbox[2] < 0 or bbox[3] < 0:
        raise ConfigError(
            f"{where}: bbox must be [x, y, w, h], 4 finite numbers with w, h >= 0, got {bbox!r}"
        )
    x, y, w, h = (float(v) for v in bbox)
    return (x, y, x + w, y + h)


def _file_name(image: Any, where: str) -> str:
    """A COCO image's ``file_name``; ConfigError naming ``where`` unless it is a string."""
    name = image.get("file_name") if isinstance(image, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: file_name must be a non-empty string, got {name!r}")
    return name


def _ref_sentences(sentences: Any, where: str) -> list[str]:
    """The ``sent`` strings of a ref's ``sentences``; ConfigError naming ``where`` and the
    sentence for one that is not a string (``"sent": 5``)."""
    if not isinstance(sentences, list):
        raise ConfigError(f"{where}: sentences must be a list, got {type(sentences).__name__}")
    out = []
    for j, s in enumerate(sentences):
        sent = s.get("sent") if isinstance(s, dict) else None
        if not isinstance(sent, str):
            raise ConfigError(
                f"{where}: sentences[{j}].sent must be a string, got {type(sent).__name__} "
                f"{sent!r}"
            )
        out.append(sent)
    return out


def _check_box(box: Box, width: int, height: int, where: str, image: Path) -> None:
    """ConfigError naming ``where`` and the image for a box that cannot be an answer for it
    (:func:`emdlm.vision.boxes.box_problem`); the one geometry check of every reader."""
    problem = box_problem(box, width, height)
    if problem is not None:
        raise ConfigError(f"{where}: {problem} {image.name}")


# ----------------------------------------------------------------------------- text detection
def _text_row(
    image: Path,
    boxes: list[tuple[float, float, float, float]],
    words: list[str],
    width: int,
    height: int,
    box_format: str,
    wheres: list[str],
) -> dict[str, Any]:
    """The text detection row of one image; ConfigError naming the box's ``where`` (file:line
    or entry) for a box with no answer (:func:`emdlm.vision.boxes.box_problem`: not finite
    after the reader's arithmetic, or outside the ``width`` x ``height`` image)."""
    for box, where in zip(boxes, wheres, strict=True):
        _check_box(box, width, height, where, image)
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
        boxes, words, wheres = [], [], []
        for lineno, line in enumerate(_read_text(gt).splitlines(), 1):
            if not line.strip():
                continue
            coords, text = _icdar_line(line, f"{gt}:{lineno}")
            if text == DONT_CARE and not include_dont_care:
                continue
            boxes.append(quad_bbox(coords))
            words.append(text)
            wheres.append(f"{gt}:{lineno}")
        rows.append(_text_row(image, boxes, words, width, height, box_format, wheres))
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
    if not _finite(coords):
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
    if not _finite((difficult, x, y, w, h, angle)):
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
        boxes, wheres = [], []
        for lineno, line in enumerate(_read_text(gt).splitlines(), 1):
            if not line.strip():
                continue
            difficult, x, y, w, h, angle = _td500_line(line, f"{gt}:{lineno}")
            if difficult and not include_difficult:
                continue
            boxes.append(rotated_rect_bbox(x, y, w, h, angle))
            wheres.append(f"{gt}:{lineno}")
        rows.append(_text_row(image, boxes, [""] * len(boxes), width, height, box_format, wheres))
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
def read_image_jsonl(
    path: PathLike, *, check_images: bool = True, images_root: PathLike | None = None
) -> list[dict[str, Any]]:
    """Rows of an image+text JSONL file: ``{"image", "prompt", "completion", ...}`` per line.

    Relative ``image`` paths are resolved against the JSONL file's folder (returned absolute).
    Missing fields, a non-object line, an image outside ``images_root`` (when set; absolute and
    ``../`` paths are allowed otherwise) or (with ``check_images``) a missing image or one that
    does not decode in full raise ConfigError with ``file:line``.
    """
    src = Path(path)
    folder = src.resolve().parent
    rows = []
    for lineno, line in enumerate(_read_text(src).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{src}:{lineno}"
        try:
            row = parse_json(line)
        except JSONDataError as err:
            raise ConfigError(f"{where}: {err}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in ("image", "prompt", "completion") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{where}: missing or non-string field(s) {missing}")
        image = Path(row["image"])
        image = image if image.is_absolute() else folder / image
        if check_images:
            _image_size(image, where, images_root, row["image"])
        else:
            _confine(image, where, images_root, row["image"])
        rows.append({**row, "image": str(image)})
    return rows
