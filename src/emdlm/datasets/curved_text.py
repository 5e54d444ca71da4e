"""Readers for the curved scene text datasets (CTW1500, Total-Text) -> text detection rows.

Their text regions are polygons with many points; the answer is each region's enclosing
axis-aligned box in the model family's box convention, in reading order, exactly as the other
text detection readers give it (:mod:`emdlm.datasets.text_detection`,
:mod:`emdlm.metrics.boxes`): rows ``{"image", "prompt", "completion", "boxes", "words",
"box_format"}``, ``"none"`` for an image with no box. "Don't care" regions are left out unless
``include_dont_care``.

* CTW1500 (:func:`read_ctw1500`), one label file per image (same stem; ``0001.txt`` or
  ``000001.txt`` for ``0001.jpg``), in either text format, or the XML labels:

  - ``text_label_curve`` ``.txt``: lines of 32 integers ``xmin, ymin, xmax, ymax`` then 14
    points as offsets ``dx, dy`` from (xmin, ymin); no transcription;
  - the polygon ``.txt`` (the test labels): ``x1,y1,...,xn,yn,####transcription``; the
    transcription ``###`` is "don't care";
  - ``.xml`` (``<Annotations><image file="0001.jpg"><box ...><label>text</label>
    <segs>x1,y1,...</segs></box></image></Annotations>``; without ``segs`` the ``box``'s
    ``left``, ``top``, ``width``, ``height``). A file with a DOCTYPE or ENTITY is refused.

* Total-Text (:func:`read_totaltext`): ``poly_gt_img11.txt`` (or ``gt_img11.txt``) for
  ``img11.jpg``, records ``x: [[115 503 494 115]], y: [[322 346 426 404]], ornt: [u'h'],
  transcriptions: [u'text']`` (a record may wrap onto further lines); ``ornt`` or transcription
  ``#`` is "don't care". The ``.mat`` files of the same folder layout are read with
  ``scipy.io.loadmat`` (which builds arrays and never unpickles): variable ``polygt`` or ``gt``,
  rows ``'x:', xs, 'y:', ys, transcription, orientation``.

Every malformed line or record (too few coordinates, a value that is not a finite number, a
box that is not finite once computed or lies outside its image) is a
:class:`emdlm.config.ConfigError` naming the file and line (or the entry); images are decoded in
full before anything trains. ``images_root`` refuses an image that resolves outside a folder
(an XML ``file`` attribute with ``../`` or an absolute path, a symlink in ``image_dir``;
:func:`emdlm.datasets.images.confine`), as the other readers do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.reading import PathLike, image_size, label_image, natural_key, read_text
from emdlm.datasets.text_detection import DONT_CARE, text_detection_row
from emdlm.metrics.boxes import Box, check_box_format, quad_bbox

CTW_OFFSET_VALUES = 32  # xmin, ymin, xmax, ymax + 14 (dx, dy) offsets
TOTALTEXT_DONT_CARE = "#"
_CTW_TEXT_MARK = "####"
_TT_FILE_RE = re.compile(r"^(?:poly_)?gt_(.+)\.(txt|mat)$", re.IGNORECASE)
_TT_RECORD_RE = re.compile(
    r"^x:\s*\[\[(?P<x>[^\]]*)\]\]\s*,\s*y:\s*\[\[(?P<y>[^\]]*)\]\]\s*,\s*"
    r"ornt:\s*\[u?(?P<q1>['\"])(?P<ornt>.*?)(?P=q1)\]\s*,\s*"
    r"transcriptions:\s*\[u?(?P<q2>['\"])(?P<text>.*)(?P=q2)\]\s*$"
)


def _numbers(values: Sequence[str], where: str, line: str) -> list[float]:
    try:
        out = [float(v) for v in values]
    except ValueError:
        out = []
    if not out or len(out) != len(values) or not all(math.isfinite(v) for v in out):
        raise ConfigError(f"{where}: coordinates must be finite numbers, got {line.strip()!r}")
    return out


def _polygon_box(coords: Sequence[float], where: str) -> Box:
    if len(coords) < 4 or len(coords) % 2:
        raise ConfigError(
            f"{where}: a polygon needs an even number (>= 4) of coordinates, got {len(coords)}"
        )
    return quad_bbox(coords)


def _image_for(folder: Path, stem: str, gt: Path) -> Path:
    """The image of a label file: the same stem, or the same number written with 4 digits or
    none (``000001.txt`` -> ``0001.jpg``)."""
    stems = [stem, f"{int(stem):04d}", str(int(stem))] if stem.isdigit() else [stem]
    return label_image(folder, stems, gt)


def _label_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder")
    files = sorted(
        (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes),
        key=lambda p: natural_key(p.name),
    )
    if not files:
        raise ConfigError(f"{folder}: no label files ({', '.join(suffixes)})")
    return files


# ----------------------------------------------------------------------------- CTW1500
def _ctw_line(line: str, where: str) -> tuple[Box, str]:
    """(enclosing box, transcription) of one CTW1500 text line (either format)."""
    if _CTW_TEXT_MARK in line:
        coords_part, text = line.split(_CTW_TEXT_MARK, 1)
        values = [v for v in coords_part.strip().rstrip(",").split(",")]
        return _polygon_box(_numbers(values, where, line), where), text.strip()
    values = line.strip().rstrip(",").split(",")
    if len(values) != CTW_OFFSET_VALUES:
        raise ConfigError(
            f"{where}: expected {CTW_OFFSET_VALUES} values (xmin, ymin, xmax, ymax and 14 offset "
            f"points) or 'x1,y1,...,xn,yn,####text', got {len(values)} values"
        )
    v = _numbers(values, where, line)
    xmin, ymin = v[0], v[1]
    points = [p + (xmin if j % 2 == 0 else ymin) for j, p in enumerate(v[4:])]
    return quad_bbox(points), ""


def _ctw_txt(gt: Path) -> tuple[list[Box], list[str], list[str]]:
    """(boxes, words, where each box was read) of a CTW1500 text label file."""
    boxes, words, wheres = [], [], []
    for lineno, line in enumerate(read_text(gt).splitlines(), 1):
        if line.strip():
            box, text = _ctw_line(line, f"{gt}:{lineno}")
            boxes.append(box)
            words.append(text)
            wheres.append(f"{gt}:{lineno}")
    return boxes, words, wheres


def _ctw_xml(gt: Path) -> list[tuple[str, list[Box], list[str], list[str]]]:
    """(image file, boxes, words, where each box was read) of each ``<image>`` of a CTW1500
    XML label file."""
    import xml.etree.ElementTree as ET

    text = read_text(gt)
    if re.search(r"<!\s*(DOCTYPE|ENTITY)", text, re.IGNORECASE):
        raise ConfigError(f"{gt}: refused: an XML label file with a DOCTYPE or ENTITY")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise ConfigError(f"{gt}: not valid XML: {err}") from err
    images = [root] if root.tag == "image" else root.iter("image")
    out = []
    for image in images:
        name = image.get("file")
        if not name:
            raise ConfigError(f"{gt}: an <image> without its file attribute")
        boxes, words, wheres = [], [], []
        for j, box in enumerate(image.iter("box")):
            where = f"{gt}: image {name!r} box {j}"
            segs = box.findtext("segs")
            if segs is not None and segs.strip():
                values = segs.strip().rstrip(",").split(",")
                boxes.append(_polygon_box(_numbers(values, where, segs), where))
            else:
                keys = ("left", "top", "width", "height")
                raw = [box.get(k) or "" for k in keys]
                x, y, w, h = _numbers(raw, where, str(dict(zip(keys, raw, strict=True))))
                if w < 0 or h < 0:
                    raise ConfigError(f"{where}: width and height must be >= 0")
                boxes.append((x, y, x + w, y + h))
            words.append((box.findtext("label") or "").strip())
            wheres.append(where)
        out.append((name, boxes, words, wheres))
    return out


def _keep(
    boxes: list[Box], words: list[str], wheres: list[str], dont_care: tuple[str, ...],
    include: bool,
) -> tuple[list[Box], list[str], list[str]]:
    """(boxes, words, wheres) without the "don't care" regions unless ``include``."""
    kept = [
        (b, w, at) for b, w, at in zip(boxes, words, wheres, strict=True)
        if include or w not in dont_care
    ]
    return [b for b, _, _ in kept], [w for _, w, _ in kept], [at for _, _, at in kept]


def read_ctw1500(
    image_dir: PathLike,
    gt_dir: PathLike,
    *,
    box_format: str = "qwen2vl",
    include_dont_care: bool = False,
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """SCUT-CTW1500 rows, one per image with a label file (``.txt`` or ``.xml``) in ``gt_dir``.

    Each text region (a 14-point or n-point polygon) becomes its enclosing box; ``###``
    regions are left out unless ``include_dont_care``. The 32-value format has no
    transcriptions (``words`` holds ""). ``images_root``: if set, an image (an XML ``file``
    with ``../`` or an absolute path, a symlink) that resolves outside this folder is a
    ConfigError naming the label file.
    """
    check_box_format(box_format)
    images = Path(image_dir)
    rows = []
    for gt in _label_files(Path(gt_dir), (".txt", ".xml")):
        if gt.suffix.lower() == ".xml":
            for name, boxes, words, wheres in _ctw_xml(gt):
                image = images / name
                width, height = image_size(image, f"{gt}: image {name!r}", images_root, name)
                kept = _keep(boxes, words, wheres, (DONT_CARE,), include_dont_care)
                rows.append(text_detection_row(image, kept[0], kept[1], width, height,
                                               box_format, kept[2]))
            continue
        image = _image_for(images, gt.stem, gt)
        width, height = image_size(image, f"{gt}:1", images_root)
        boxes, words, wheres = _keep(*_ctw_txt(gt), (DONT_CARE,), include_dont_care)
        rows.append(text_detection_row(image, boxes, words, width, height, box_format, wheres))
    return rows


# ----------------------------------------------------------------------------- Total-Text
def _tt_records(gt: Path) -> list[tuple[int, str]]:
    """(first line, text) of each record: a record starts at a line beginning with ``x:``."""
    records: list[tuple[int, str]] = []
    for lineno, line in enumerate(read_text(gt).splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("x:") or not records:
            records.append((lineno, line.strip()))
        else:
            first, text = records[-1]
            records[-1] = (first, f"{text} {line.strip()}")
    return records


def _tt_txt(gt: Path) -> tuple[list[Box], list[str], list[str], list[str]]:
    """(boxes, words, orientations, where each box was read) of a Total-Text text file."""
    boxes, words, ornts, wheres = [], [], [], []
    for lineno, record in _tt_records(gt):
        where = f"{gt}:{lineno}"
        m = _TT_RECORD_RE.match(record)
        if m is None:
            raise ConfigError(
                f"{where}: expected \"x: [[...]], y: [[...]], ornt: [u'.'], transcriptions: "
                f"[u'...']\", got {record[:120]!r}"
            )
        xs = _numbers(m.group("x").replace(",", " ").split(), where, record[:120])
        ys = _numbers(m.group("y").replace(",", " ").split(), where, record[:120])
        if len(xs) != len(ys):
            raise ConfigError(f"{where}: {len(xs)} x but {len(ys)} y coordinates")
        coords = [c for pair in zip(xs, ys, strict=True) for c in pair]
        boxes.append(_polygon_box(coords, where))
        words.append(m.group("text"))
        ornts.append(m.group("ornt"))
        wheres.append(where)
    return boxes, words, ornts, wheres


def _mat_text(value: Any) -> str:
    import numpy as np

    while isinstance(value, np.ndarray):
        if value.size == 0:
            return ""
        value = value.flat[0]
    return str(value).strip()


def _tt_mat(gt: Path) -> tuple[list[Box], list[str], list[str], list[str]]:
    """As :func:`_tt_txt`, for a ``.mat`` file (wheres name its entries)."""
    import numpy as np
    from scipy.io import loadmat

    try:
        mat = loadmat(str(gt))
    except Exception as err:  # a corrupt or hostile file fails in many ways
        raise ConfigError(f"{gt}: not a MATLAB file scipy reads: {err}") from err
    table = mat.get("polygt", mat.get("gt"))
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.shape[1] < 5:
        raise ConfigError(f"{gt}: expected a variable 'polygt' (or 'gt') of rows 'x:', xs, 'y:', "
                          "ys, transcription, orientation")
    boxes, words, ornts, wheres = [], [], [], []
    for i, row in enumerate(table):
        where = f"{gt}: entry {i}"
        try:
            xs = np.asarray(row[1], dtype=np.float64).ravel()
            ys = np.asarray(row[3], dtype=np.float64).ravel()
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: coordinates must be numbers: {err}") from err
        if xs.size != ys.size or not np.isfinite(xs).all() or not np.isfinite(ys).all():
            raise ConfigError(f"{where}: x and y must be as many finite numbers")
        coords = np.stack([xs, ys], axis=1).ravel().tolist()
        boxes.append(_polygon_box(coords, where))
        words.append(_mat_text(row[4]))
        ornts.append(_mat_text(row[5]) if table.shape[1] > 5 else "")
        wheres.append(where)
    return boxes, words, ornts, wheres


def read_totaltext(
    image_dir: PathLike,
    gt_dir: PathLike,
    *,
    box_format: str = "qwen2vl",
    include_dont_care: bool = False,
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """Total-Text rows, one per ``poly_gt_<name>.txt`` / ``.mat`` (or ``gt_<name>.*``) in
    ``gt_dir`` with its image ``<name>.*`` in ``image_dir``.

    Each polygon becomes its enclosing box; regions whose orientation or transcription is
    ``#`` are left out unless ``include_dont_care``. ``images_root``: if set, an image that
    resolves outside this folder (a symlink, an ``image_dir`` outside it) is a ConfigError
    naming the label file.
    """
    check_box_format(box_format)
    images = Path(image_dir)
    rows = []
    for gt in _label_files(Path(gt_dir), (".txt", ".mat")):
        m = _TT_FILE_RE.match(gt.name)
        if m is None:
            continue
        image = _image_for(images, m.group(1), gt)
        width, height = image_size(image, f"{gt}:1", images_root)
        boxes, words, ornts, wheres = (
            _tt_mat(gt) if gt.suffix.lower() == ".mat" else _tt_txt(gt)
        )
        kept = [
            (b, w, at) for b, w, o, at in zip(boxes, words, ornts, wheres, strict=True)
            if include_dont_care or (TOTALTEXT_DONT_CARE not in (w, o) and w != DONT_CARE)
        ]
        rows.append(text_detection_row(image, [b for b, _, _ in kept], [w for _, w, _ in kept],
                                       width, height, box_format, [at for _, _, at in kept]))
    if not rows:
        raise ConfigError(f"{gt_dir}: no Total-Text label files (poly_gt_<image>.txt or .mat)")
    return rows


__all__ = ["read_ctw1500", "read_totaltext"]
