"""A contact sheet: a PNG grid of test images with the gold and the predicted answers drawn.

Layout (all in pixels): a legend strip of ``LEGEND_H`` on top, then ``ceil(n / columns)`` rows of
cells. Each cell is ``thumb + 2 * PAD`` wide and ``thumb + 2 * PAD + CAPTION_H`` tall: the image
scaled to fit a ``thumb`` square, and two caption lines under it. So the sheet is
``columns * (thumb + 2 PAD)`` by ``LEGEND_H + rows * (thumb + 2 PAD + CAPTION_H)``
(:func:`sheet_size`).

Kinds: ``"box"`` / ``"boxes"`` draw gold boxes in green and predicted boxes in magenta (the
answer parsed and mapped back to pixels with the row's ``box_format``); the caption gives the
IoU (one box) or matched / gold / predicted counts. ``"clock"`` writes the gold and the predicted
time under each image, green when they match, red otherwise. ``"math"`` writes the question
(shortened to the cell) and the gold and predicted answers, green when the prediction is right
by the math scoring (:func:`emdlm.math_answers.score_answer`: an option letter or its text,
numbers at the item's precision), red otherwise. Unparseable predictions say so.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image, ImageDraw

from emdlm._files import atomic_write
from emdlm.config.errors import check_one_of
from emdlm.datasets.images import open_rgb
from emdlm.eval_kinds import PICTURE_KINDS
from emdlm.math_answers import LETTERS, item_from_row, score_answer
from emdlm.metrics import clock_time_gap
from emdlm.metrics.boxes import (
    Box,
    answer_box_to_pixels,
    box_iou,
    match_boxes,
    parse_box,
    parse_boxes,
)
from emdlm.tasks.render import load_font

PAD = 4
CAPTION_H = 30
LEGEND_H = 22
RGB = tuple[int, int, int]
GOLD = (0, 190, 0)
PRED = (255, 0, 255)
WRONG = (220, 0, 0)
_BLACK = (0, 0, 0)
SHEET_KINDS = PICTURE_KINDS  # the kinds with a picture (emdlm.eval_kinds)


def sheet_size(n_items: int, columns: int, thumb: int) -> tuple[int, int]:
    """(width, height) of a sheet of ``n_items`` cells (see the module docstring)."""
    cell = thumb + 2 * PAD
    rows = math.ceil(n_items / columns)
    return columns * cell, LEGEND_H + rows * (cell + CAPTION_H)


def _fit(image: Image.Image, thumb: int) -> tuple[Image.Image, float]:
    """The image scaled to fit a ``thumb`` square (aspect kept), and the scale factor."""
    scale = thumb / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.convert("RGB").resize(size, Image.Resampling.BILINEAR), scale


def _gold_boxes(row: dict[str, Any], size: tuple[int, int], fmt: str) -> list[tuple]:
    if "boxes" in row:  # pixel boxes kept by the generators and readers
        return [tuple(b) for b in row["boxes"]]
    boxes = parse_boxes(row["completion"]) or []
    return [answer_box_to_pixels(b, size[0], size[1], fmt) for b in boxes]


def _one_box(pred: str) -> list[Box] | None:
    box = parse_box(pred)
    return None if box is None else [box]


def _pred_boxes(
    pred: str, parse: Callable[[str], list[Box] | None], size: tuple[int, int], fmt: str
) -> list[tuple] | None:
    boxes = parse(pred)
    if boxes is None:
        return None
    return [answer_box_to_pixels(b, size[0], size[1], fmt) for b in boxes]


def _shorten(text: str, font: Any, width: int) -> str:
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def _iou_caption(preds: list[tuple], gold: list[tuple]) -> tuple[str, RGB]:
    iou = box_iou(preds[0], gold[0]) if gold else 0.0
    return f"IoU {iou:.2f}", GOLD if iou >= 0.5 else WRONG


def _match_caption(preds: list[tuple], gold: list[tuple]) -> tuple[str, RGB]:
    matched = len(match_boxes(preds, gold, 0.5))
    ok = matched == len(gold) == len(preds)
    return f"matched {matched}/{len(gold)}, pred {len(preds)}", GOLD if ok else WRONG


def _box_cell(
    draw: ImageDraw.ImageDraw,
    row: dict[str, Any],
    pred: str,
    size: tuple[int, int],
    origin: tuple[int, int],
    scale: float,
    *,
    parse: Callable[[str], list[Box] | None],
    caption: Callable[[list[tuple], list[tuple]], tuple[str, RGB]],
) -> tuple[str, str, RGB]:
    """Draw gold and predicted boxes on the cell; returns the caption lines (the referring
    expression or the words, then the score) and the score's colour."""
    fmt = row.get("box_format", "qwen2vl")
    gold = _gold_boxes(row, size, fmt)
    preds = _pred_boxes(pred, parse, size, fmt)
    ox, oy = origin
    line1 = str(row.get("expression") or " ".join(row.get("words", [])) or "")

    def rect(b: Sequence[float], color: RGB, width: int) -> None:
        x1, y1, x2, y2 = ox + b[0] * scale, oy + b[1] * scale, ox + b[2] * scale, oy + b[3] * scale
        draw.rectangle(
            [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)], outline=color, width=width
        )

    for b in gold:
        rect(b, GOLD, 2)
    if preds is None:
        return line1, "unparsed prediction", WRONG
    for b in preds:
        rect(b, PRED, 1)
    return (line1, *caption(preds, gold))


def _clock_cell(
    _draw: ImageDraw.ImageDraw, row: dict[str, Any], pred: str, *_thumbnail: Any
) -> tuple[str, str, RGB]:
    """The gold and the predicted time; green when they match (it draws nothing)."""
    gap = clock_time_gap(pred, row["completion"])
    line1 = f"gold {row['completion']}"
    line2 = f"pred {pred.strip() or '(empty)'}" + ("  (unparsed)" if gap is None else "")
    return line1, line2, GOLD if gap == 0.0 else WRONG


def _question(text: str) -> str:
    """The question of a prompt: its first line up to the first ``?`` (without the choices
    and the answer instruction that follow), else the whole first line."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    m = re.match(r".*?\?", first)
    return " ".join((m.group(0) if m else first).split())


def _math_cell(
    _draw: ImageDraw.ImageDraw, row: dict[str, Any], pred: str, *_thumbnail: Any
) -> tuple[str, str, RGB]:
    """The question, then the gold and the predicted answer; green when the math scoring
    (:mod:`emdlm.math_answers`, the row's ``question_type`` / ``answer_type`` / ``choices`` /
    ``precision`` / ``unit``) counts the prediction right. A gold option letter shows its
    text (``B=7``). It draws nothing."""
    gold = row["completion"].strip()
    item = item_from_row(row, gold, "contact sheet row")
    score = score_answer(pred, gold, item)
    question = _question(str(row.get("question") or row.get("prompt") or ""))
    shown = gold
    if item.question_type == "multi_choice" and gold in LETTERS[: len(item.choices)]:
        shown = f"{gold}={item.choices[LETTERS.index(gold)]}"
    line2 = f"gold {shown} pred {pred.strip() or '(empty)'}"
    if score.parsed is None:
        line2 += " (unparsed)"
    return question, line2, GOLD if score.correct else WRONG


class Sheet(NamedTuple):
    """How a contact sheet draws one task kind.

    legend: the legend strip on top, as (x offset from ``PAD``, text, colour) pieces.
    cell(draw, row, prediction, image size, origin, scale) -> (line1, line2, colour of line2):
        draws on the cell's thumbnail (placed at ``origin``, scaled by ``scale``) and returns
        its two caption lines.
    """

    legend: tuple[tuple[int, str, RGB], ...]
    cell: Callable[..., tuple[str, str, RGB]]


_BOX_LEGEND = ((0, "gold box", GOLD), (70, "predicted box", PRED))


#: The drawing of each task kind with a picture (:data:`emdlm.eval_kinds.PICTURE_KINDS`;
#: pinned by tests/test_task_registry.py).
SHEETS: dict[str, Sheet] = {
    "clock": Sheet(((0, "gold / predicted time (green: exact, red: wrong)", _BLACK),), _clock_cell),
    "box": Sheet(_BOX_LEGEND, partial(_box_cell, parse=_one_box, caption=_iou_caption)),
    "boxes": Sheet(_BOX_LEGEND, partial(_box_cell, parse=parse_boxes, caption=_match_caption)),
    "math": Sheet(
        ((0, "question; gold / predicted answer (green: right, red: wrong)", _BLACK),), _math_cell
    ),
}


def make_contact_sheet(
    rows: Sequence[dict[str, Any]],
    predictions: Sequence[str],
    path: str | os.PathLike[str],
    *,
    kind: str = "boxes",
    columns: int = 4,
    thumb: int = 160,
    max_items: int | None = 32,
) -> Path:
    """Write a PNG grid of ``rows``' images with gold and predicted answers; returns its path.

    Args:
        rows: test rows with ``image`` (a path), ``completion`` (the gold answer) and, for boxes,
            optionally ``boxes`` (gold pixel boxes) and ``box_format``; for math, ``prompt``
            (or ``question``) and the item fields of :mod:`emdlm.math_answers`
            (``question_type``, ``answer_type``, ``choices``, ``precision``, ``unit``; without
            them the item is inferred from the completion).
        predictions: the model's answers, one per row.
        path: the PNG to write (parent folders are created).
        kind: "box" (one box), "boxes" (several), "clock" or "math".
        columns: cells per row of the grid (>= 1).
        thumb: side of the square each image is fitted into (>= 32).
        max_items: draw only the first ``max_items`` rows (None for all).
    """
    check_one_of("kind", kind, SHEET_KINDS)
    drawer = SHEETS[kind]
    if len(rows) != len(predictions):
        raise ValueError(f"{len(rows)} rows but {len(predictions)} predictions")
    if not rows:
        raise ValueError("a contact sheet needs at least one row")
    if columns < 1 or thumb < 32:
        raise ValueError(f"need columns >= 1 and thumb >= 32, got {columns}, {thumb}")
    items = list(zip(rows, predictions, strict=True))[: max_items or None]
    sheet = Image.new("RGB", sheet_size(len(items), columns, thumb), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = load_font(11)
    for dx, text, color in drawer.legend:
        draw.text((PAD + dx, 4), text, fill=color, font=font)
    cell = thumb + 2 * PAD
    for i, (row, pred) in enumerate(items):
        x0 = (i % columns) * cell
        y0 = LEGEND_H + (i // columns) * (cell + CAPTION_H)
        im = open_rgb(row["image"])  # as the model saw it: upright, 16-bit and alpha handled
        small, scale = _fit(im, thumb)
        origin = (x0 + PAD + (thumb - small.width) // 2, y0 + PAD + (thumb - small.height) // 2)
        sheet.paste(small, origin)
        text_y = y0 + cell
        line1, line2, color = drawer.cell(draw, row, pred, im.size, origin, scale)
        draw.text(
            (x0 + PAD, text_y), _shorten(line1, font, cell - 2 * PAD), fill=_BLACK, font=font
        )
        draw.text(
            (x0 + PAD, text_y + 14), _shorten(line2, font, cell - 2 * PAD), fill=color, font=font
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out, binary=True) as fh:  # whole or not at all, like the eval outputs
        sheet.save(fh, format="PNG")
    return out
