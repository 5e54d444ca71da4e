"""Box geometry and answer formats of the VLM families, reading order, several-box matching.

A box is (x1, y1, x2, y2) (:data:`Box`); :func:`parse_box` reads one from an answer and
:func:`box_iou` compares two. :mod:`emdlm.metrics` scores one box per
answer with them; this module imports nothing else of emdlm.

Answer formats (``box_format``), for a box (x1, y1, x2, y2) in pixels of a W x H image:

* ``"qwen2vl"`` (default): ``(x1,y1),(x2,y2)`` with integers on a 0..1000 grid,
  ``round(1000 * x / W)`` (Qwen2-VL's grounding convention, as in the NTIL paper).
* ``"llava"``: ``[x1, y1, x2, y2]`` as fractions of W and H with 3 decimals (LLaVA-1.5).

Several boxes (text detection) are joined with ``"; "`` in reading order
(:func:`reading_order`); an answer with no box is ``"none"``. :func:`parse_boxes` reads that back
(``;`` or newlines separate boxes).

Several-box metric (:func:`boxes_metrics`): per image, predictions and gold boxes are matched
one-to-one at IoU >= threshold, maximizing first the number of matches and then their summed
IoU (Hungarian algorithm, ``scipy.optimize.linear_sum_assignment``). Precision, recall and F1
are micro-averaged over the test set (true positives, predicted and gold boxes summed over all
images); ``acc_at_0.5``, the NTIL paper's Acc@0.5 for several boxes, is the recall. A
prediction that does not parse counts as zero predicted boxes (its gold boxes are
misses) and in ``parse_failure_rate``; it is never dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from emdlm.config.errors import check_one_of

Box = tuple[float, float, float, float]  # x1, y1, x2, y2
BOX_FORMATS = ("qwen2vl", "llava")
GRID = 1000
NO_BOXES = "none"
BOX_SEPARATOR = "; "
_SPLIT_RE = re.compile(r"[;\n]")
_BOX_NUM_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
# Skeletons (the string with every number replaced by "#") accepted as a box.
_BOX_SKELETONS = frozenset(
    {
        "#,#,#,#",
        "[#,#,#,#]",
        "(#,#,#,#)",
        "(#,#),(#,#)",
        "[(#,#),(#,#)]",
        "((#,#),(#,#))",
        "[[#,#],[#,#]]",
        "[#,#],[#,#]",
    }
)


def check_box_format(box_format: str) -> None:
    """ValueError naming the known formats if ``box_format`` is not one of them."""
    check_one_of("box_format", box_format, BOX_FORMATS)


def box_problem(box: Sequence[float], width: int, height: int) -> str | None:
    """Why the pixel box (x1, y1, x2, y2) cannot be an answer for a ``width`` x ``height``
    image, or None when it can: a coordinate that is not a finite number (a NaN, or an
    overflow such as ``1e308 + 1e308``), or a box outside the image, which :func:`format_box`
    would clamp to a zero-area answer on the image's edge such as ``(1000,1000),(1000,1000)``.

    Per axis, a side of positive length must overlap the image by a positive length; a side of
    zero length (a degenerate box, legal) must lie within it. A box that pokes out of the image
    is fine: its answer is the part inside.

    >>> box_problem((10, 20, 30, 40), 100, 200) is None
    True
    >>> box_problem((150, 20, 180, 40), 100, 200)
    'box (150, 20, 180, 40) lies outside the 100x200 image'
    """
    if len(box) != 4 or not all(math.isfinite(v) for v in box):
        return f"box {_shown(box)} has a coordinate that is not a finite number"
    for lo, hi, size in ((box[0], box[2], width), (box[1], box[3], height)):
        if hi < lo:
            return f"box {_shown(box)} is inverted (x2 < x1 or y2 < y1)"
        inside = min(hi, size) - max(lo, 0)
        if not (inside > 0 or (hi == lo and 0 <= lo <= size)):
            return f"box {_shown(box)} lies outside the {width}x{height} image"
    return None


def _shown(box: Sequence[float]) -> str:
    return "(" + ", ".join(f"{float(v):g}" for v in box) + ")"


def format_box(box: Sequence[float], width: int, height: int, box_format: str = "qwen2vl") -> str:
    """The answer text of one pixel box (see the module docstring for the formats); ValueError
    for a box with no answer (:func:`box_problem`: not finite, or no area inside the image).

    >>> format_box((10, 20, 30, 40), 100, 200)
    '(100,100),(300,200)'
    >>> format_box((10, 20, 30, 40), 100, 200, "llava")
    '[0.100, 0.100, 0.300, 0.200]'
    """
    check_box_format(box_format)
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    problem = box_problem(box, width, height)
    if problem is not None:
        raise ValueError(problem)
    fx = [box[0] / width, box[1] / height, box[2] / width, box[3] / height]
    fx = [min(1.0, max(0.0, v)) for v in fx]  # boxes of datasets can poke out of the image
    if box_format == "qwen2vl":
        a, b, c, d = (round(GRID * v) for v in fx)
        return f"({a},{b}),({c},{d})"
    return "[" + ", ".join(f"{v:.3f}" for v in fx) + "]"


def format_boxes(
    boxes: Sequence[Sequence[float]], width: int, height: int, box_format: str = "qwen2vl"
) -> str:
    """Several pixel boxes, in the given order, joined by ``"; "`` (``"none"`` if empty)."""
    if not boxes:
        check_box_format(box_format)
        return NO_BOXES
    return BOX_SEPARATOR.join(format_box(b, width, height, box_format) for b in boxes)


def answer_box_to_pixels(box: Box, width: int, height: int, box_format: str = "qwen2vl") -> Box:
    """Inverse of :func:`format_box` (up to rounding): an answer's box in pixel coordinates."""
    check_box_format(box_format)
    scale = GRID if box_format == "qwen2vl" else 1.0
    return (
        box[0] / scale * width,
        box[1] / scale * height,
        box[2] / scale * width,
        box[3] / scale * height,
    )


def parse_box(s: str) -> Box | None:
    """Parse ``[x1, y1, x2, y2]``, ``(x1, y1, x2, y2)``, ``(x1,y1),(x2,y2)`` (and bracketed
    variants) into a 4-tuple of floats, or return None. Coordinates are kept as written."""
    t = "".join(s.split())
    nums = _BOX_NUM_RE.findall(t)
    if len(nums) != 4 or _BOX_NUM_RE.sub("#", t) not in _BOX_SKELETONS:
        return None
    x1, y1, x2, y2 = (float(v) for v in nums)
    return (x1, y1, x2, y2)


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two axis-aligned boxes (x1, y1, x2, y2).

    IoU = |A ∩ B| / (|A| + |B| - |A ∩ B|), with area = max(0, x2 - x1) * max(0, y2 - y1), so an
    inverted box has zero area. Two zero-area boxes: 1.0 if identical, else 0.0.
    """
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    union = area_a + area_b - inter
    if union <= 0.0:
        return 1.0 if tuple(a) == tuple(b) else 0.0
    return inter / union


def parse_boxes(s: str) -> list[Box] | None:
    """Boxes of an answer separated by ``;`` or newlines, or None if any part is not a box.

    ``"none"`` and the empty string are an empty list. Each part is read by
    :func:`parse_box`, so both answer formats (and their bracket variants) parse.
    """
    text = s.strip()
    if text == "" or text.lower().rstrip(".") == NO_BOXES:
        return []
    boxes: list[Box] = []
    for part in _SPLIT_RE.split(text):
        if not part.strip():
            continue
        box = parse_box(part)
        if box is None:
            return None
        boxes.append(box)
    return boxes


def quad_bbox(points: Sequence[float]) -> Box:
    """Axis-aligned bounding box of a polygon given as x1, y1, x2, y2, ... (ICDAR quads)."""
    if len(points) < 4 or len(points) % 2:
        raise ValueError(f"a polygon needs an even number (>= 4) of coordinates, got {points!r}")
    xs, ys = points[0::2], points[1::2]
    return (float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys)))


def rotated_rect_bbox(x: float, y: float, w: float, h: float, angle: float) -> Box:
    """Axis-aligned bounding box of a rectangle rotated by ``angle`` radians about its centre.

    (x, y) is the top-left corner and (w, h) the size of the rectangle before rotation (the
    MSRA-TD500 ground truth). The box's half-extents are
    (|w cos a| + |h sin a|) / 2 and (|w sin a| + |h cos a|) / 2 around the centre.
    """
    cx, cy = x + w / 2.0, y + h / 2.0
    c, s = abs(math.cos(angle)), abs(math.sin(angle))
    hw, hh = (w * c + h * s) / 2.0, (w * s + h * c) / 2.0
    return (cx - hw, cy - hh, cx + hw, cy + hh)


def reading_order(boxes: Sequence[Sequence[float]]) -> list[int]:
    """Indices of ``boxes`` in reading order: lines top to bottom, each left to right.

    Boxes are taken by their vertical centre; a box joins the current line when its centre lies
    within the vertical extent of the line's first box, else it starts a new line.
    """
    order = sorted(range(len(boxes)), key=lambda i: ((boxes[i][1] + boxes[i][3]) / 2.0, i))
    lines: list[list[int]] = []
    for i in order:
        cy = (boxes[i][1] + boxes[i][3]) / 2.0
        if lines and boxes[lines[-1][0]][1] <= cy <= boxes[lines[-1][0]][3]:
            lines[-1].append(i)
        else:
            lines.append([i])
    return [i for line in lines for i in sorted(line, key=lambda j: (boxes[j][0], j))]


def match_boxes(
    preds: Sequence[Box], golds: Sequence[Box], threshold: float = 0.5
) -> list[tuple[int, int, float]]:
    """One-to-one matches (pred index, gold index, IoU) with IoU >= ``threshold``.

    Maximizes the number of matches, then their summed IoU: the Hungarian algorithm on weights
    ``K + IoU`` (K = min(#pred, #gold) + 1, so one more match always outweighs any IoU gain)
    for pairs at or above the threshold and 0 otherwise.
    """
    if not preds or not golds:
        return []
    iou = np.array([[box_iou(p, g) for g in golds] for p in preds], dtype=np.float64)
    ok = iou >= threshold
    if not ok.any():
        return []
    from scipy.optimize import linear_sum_assignment

    weight = np.where(ok, min(len(preds), len(golds)) + 1.0 + iou, 0.0)
    rows, cols = linear_sum_assignment(weight, maximize=True)
    return [(int(r), int(c), float(iou[r, c])) for r, c in zip(rows, cols, strict=True) if ok[r, c]]


def as_box(b: Sequence[float]) -> Box:
    """A given box (x1, y1, x2, y2) as floats; ValueError unless it has 4 coordinates."""
    if len(b) != 4:
        raise ValueError(f"a box needs 4 coordinates (x1, y1, x2, y2), got {b!r}")
    return (float(b[0]), float(b[1]), float(b[2]), float(b[3]))


def _as_boxes(x: str | Sequence[Sequence[float]]) -> list[Box] | None:
    return parse_boxes(x) if isinstance(x, str) else [as_box(b) for b in x]


def _boxes_update(
    preds: Sequence[str | Sequence[Sequence[float]]],
    refs: Sequence[str | Sequence[Sequence[float]]],
    threshold: float,
) -> tuple[int, int, int, float, int, int, int]:
    """Sufficient statistics: (true positives, predicted boxes, gold boxes, summed IoU of the
    matches, images answered exactly, parse failures, n)."""
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions but {len(refs)} references")
    tp = n_pred = n_gold = exact = failures = 0
    iou_sum = 0.0
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        gold = _as_boxes(r)
        if gold is None:
            raise ValueError(f"reference {i} is not a list of boxes: {r!r}")
        pred = _as_boxes(p)
        parsed = pred is not None
        if pred is None:
            failures += 1
            pred = []
        matches = match_boxes(pred, gold, threshold)
        tp += len(matches)
        n_pred += len(pred)
        n_gold += len(gold)
        iou_sum += sum(m[2] for m in matches)
        exact += parsed and len(matches) == len(gold) == len(pred)
    return tp, n_pred, n_gold, iou_sum, exact, failures, len(preds)


def _ratio(num: int, den: int, empty: float) -> float:
    return num / den if den else empty


def _boxes_compute(
    tp: int, n_pred: int, n_gold: int, iou_sum: float, exact: int, failures: int, n: int
) -> dict[str, float]:
    # With nothing to find and nothing predicted the answer is perfect (1.0); otherwise an empty
    # denominator means every box was missed or invented (0.0).
    precision = _ratio(tp, n_pred, 1.0 if n_gold == 0 else 0.0)
    recall = _ratio(tp, n_gold, 1.0 if n_pred == 0 else 0.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "image_exact": _ratio(exact, n, 0.0),
        "mean_matched_iou": iou_sum / tp if tp else float("nan"),
        "parse_failure_rate": _ratio(failures, n, 0.0),
        "n_pred_boxes": n_pred,
        "n_gold_boxes": n_gold,
        "n": n,
    }


def boxes_metrics(
    preds: Sequence[str | Sequence[Sequence[float]]],
    refs: Sequence[str | Sequence[Sequence[float]]],
    threshold: float = 0.5,
) -> dict[str, float]:
    """Micro precision, recall and F1 of one-to-one box matching at IoU >= ``threshold``.

    ``acc_at_<threshold>`` (``acc_at_0.5`` by default) is the NTIL paper's Acc@0.5 read for
    several boxes: the share of gold boxes matched one-to-one at IoU >= threshold, i.e. the
    recall, under the name the paper reports (text detection is scored "with the identical
    metric as grounding").

    Also ``image_exact`` (share of images whose boxes all match with none extra),
    ``mean_matched_iou``, ``parse_failure_rate``, the box counts and ``n``. Answers are strings
    (:func:`parse_boxes`) or lists of (x1, y1, x2, y2); both sides must use the same coordinates.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    out = _boxes_compute(*_boxes_update(preds, refs, threshold))
    items = list(out.items())
    after_f1 = list(out).index("f1") + 1
    # the NTIL paper's Acc@0.5 read for several boxes: the share of gold boxes matched (recall)
    acc = (f"acc_at_{threshold:g}", out["recall"])
    return dict([*items[:after_f1], acc, *items[after_f1:]])
