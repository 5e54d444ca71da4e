"""Visual math at CPU scale: a number read off a rendered figure (the NTIL paper's MathVista /
MathVision family, generated so a tiny VLM can learn it on a CPU).

Sub-tasks (``subtasks``), each an integer answer drawn in or computed from the figure:

* ``bar_value``: a bar chart with ``n_bars`` bars of distinct named colours on a y grid
  (value labels above the bars when ``value_labels``); "What is the value of the red bar?";
* ``bar_difference``: the same chart; "How much greater is the red bar than the blue bar?"
  (always a positive difference);
* ``line_value``: a straight line ``f(x) = a x + b`` on a grid, x in 0..4, integer slope, one
  point marked (dot and dashed drop line); "What is f(3) on the plotted line?";
* ``count``: up to 16 coloured circles / squares / triangles / diamonds on a 4x4 grid of cells;
  "How many green shapes are there?";
* ``perimeter``: a rectangle with both side lengths written beside its sides; its perimeter;
* ``side``: a rectangle with one side written, the other marked "?", and "P=<perimeter>"
  inside; the missing side.

Values (bar heights, side lengths, line values, counts) are integers in 1..``max_value``
(0..``max_value`` on the line; counts at most 12), so answers are small integers (a perimeter
is at most ``4 * max_value``). Each row is free form ("Answer with a number.", the completion is
the number) or, with probability ``multiple_choice``, multiple choice: ``n_choices`` lettered
options "(A) 12 (B) 15 ..." (the answer among them exactly once, the others integers near it)
and the completion is the letter, as MathVista's ``multi_choice`` questions.

Rows: ``{"image", "prompt", "completion", "answer" (the number, a string), "choices" (the option
texts, None for free form), "answer_type": "integer", "question_type": "free_form" |
"multi_choice", "number_scope", "subtask", "figure" (the drawn values)}``. ``number_scope`` is
"all" for free-form rows and ``"regex:(?!)"`` (never matches) for multiple choice, so the
numeric objectives (digit EMD, NTIL) score free-form numeric answers only: an option letter is
no quantity (:mod:`emdlm.data`).

Difficulty knobs: ``subtasks`` (``bar_value`` alone is the easiest), ``n_bars``,
``value_labels`` (off: the height must be read against the grid), ``max_value``, ``noise``,
``multiple_choice`` / ``n_choices``.

Train/dev/test disjointness: a figure's content (sub-task, drawn values, the queried item and,
for bar charts, the bars' colours; not the layout: :data:`CONTENT_KEYS`) is hashed,
seed-independently, to u in [0, 1); content with u < ``test_fraction`` belongs to the test split
only, with u in [test_fraction, test_fraction + dev_fraction) to the dev split only, the rest to
the train split only (:func:`split_of`), so a test or dev question never shows a figure content
seen in training (with any seed). Example k depends only on (seed, split, k). ``dev_fraction``
is 0 by default: no dev split, and the train and test streams are those of before the dev split
existed; a run tuned on "dev" gives the same ``dev_fraction`` to its train split, or training
would still show the dev figures ("dev" with ``dev_fraction=0`` is an error), as
:mod:`emdlm.tasks.arithmetic` does.

Images are rendered once into the cache (:func:`emdlm.tasks.render.cached_rows`).
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from emdlm.config.errors import check_one_of
from emdlm.domains import UNIT, Domain
from emdlm.tasks import DEV_FRACTION, check_dev_fraction, register_task
from emdlm.tasks.render import (
    COLORS,
    NOISE,
    SHAPE_NAMES,
    SUPERSAMPLE,
    add_noise,
    draw_shape,
    generated_rows,
    image_task_domains,
    load_font,
    unit_hash,
)

SPLITS = ("train", "dev", "test")
SUBTASKS = ("bar_value", "bar_difference", "line_value", "count", "perimeter", "side")
FREE_FORM, MULTI_CHOICE = "free_form", "multi_choice"
#: number_scope of a multiple-choice row: a regex that never matches (no number is scored).
NO_NUMBERS = "regex:(?!)"
LINE_X = (0, 1, 2, 3, 4)  # the x ticks of ``line_value``
GRID = 4  # ``count``: shapes sit in a GRID x GRID grid of cells
MAX_COUNT = 12
MAX_DISTRACTORS = 6
_WHITE, _INK, _GRID_INK = (255, 255, 255), (0, 0, 0), (205, 205, 205)
_MAX_TRIES = 10_000

Figure = dict[str, Any]


# ---------------------------------------------------------------------------------- contents
# Each sampler draws a figure's content (what is hashed for the split and what the answer is
# computed from); the renderers below draw it, with colours and layout from the same rng.


def _sample_bars(rng: np.random.Generator, p: dict[str, Any], difference: bool) -> Figure:
    n = p["n_bars"]
    values = [int(v) for v in rng.integers(1, p["max_value"] + 1, size=n)]
    names = list(COLORS)
    colors = [names[int(i)] for i in rng.permutation(len(names))[:n]]
    if difference:
        pairs = [(i, j) for i in range(n) for j in range(n) if values[i] > values[j]]
        if not pairs:
            return {}  # all equal: no positive difference; draw again
        i, j = pairs[int(rng.integers(len(pairs)))]
        return {"values": values, "colors": colors, "query": [i, j]}
    return {"values": values, "colors": colors, "query": [int(rng.integers(n))]}


def _line_pairs(max_value: int) -> list[tuple[int, int]]:
    """(slope, intercept) pairs whose line stays in 0..max_value over :data:`LINE_X`."""
    last = LINE_X[-1]
    return [(a, b) for a in (-2, -1, 0, 1, 2) for b in range(max_value + 1)
            if 0 <= b + a * last <= max_value]


def _sample_line(rng: np.random.Generator, p: dict[str, Any]) -> Figure:
    pairs = _line_pairs(p["max_value"])
    a, b = pairs[int(rng.integers(len(pairs)))]
    return {"slope": a, "intercept": b, "x": int(LINE_X[int(rng.integers(len(LINE_X)))])}


def _sample_count(rng: np.random.Generator, p: dict[str, Any]) -> Figure:
    target = int(rng.integers(1, min(p["max_value"], MAX_COUNT) + 1))
    others = int(rng.integers(0, min(MAX_DISTRACTORS, GRID * GRID - target) + 1))
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    return {"color": color, "count": target, "others": others}


def _sample_rect(rng: np.random.Generator, p: dict[str, Any]) -> Figure:
    w, h = (int(v) for v in rng.integers(1, p["max_value"] + 1, size=2))
    return {"width": w, "height": h}


SAMPLERS: dict[str, Callable[[np.random.Generator, dict[str, Any]], Figure]] = {
    "bar_value": lambda rng, p: _sample_bars(rng, p, difference=False),
    "bar_difference": lambda rng, p: _sample_bars(rng, p, difference=True),
    "line_value": _sample_line,
    "count": _sample_count,
    "perimeter": _sample_rect,
    "side": _sample_rect,
}


#: The fields of each sub-task's figure that its split is decided by: the bars' values and
#: colours (so that with ``n_bars=1`` every value still occurs in training, with other
#: colours), the line, the target colour and both counts, the rectangle's sides.
CONTENT_KEYS: dict[str, tuple[str, ...]] = {
    "bar_value": ("values", "colors", "query"),
    "bar_difference": ("values", "colors", "query"),
    "line_value": ("slope", "intercept", "x"),
    "count": ("color", "count", "others"),
    "perimeter": ("width", "height"),
    "side": ("width", "height"),
}


def _unknown_subtask(subtask: str) -> ValueError:
    return ValueError(f"unknown subtask {subtask!r}; expected one of {SUBTASKS}")


def figure_answer(subtask: str, fig: Figure) -> int:
    """The answer to ``subtask``'s question about figure content ``fig`` (the ground truth every
    row's completion is built from)."""
    if subtask == "bar_value":
        return fig["values"][fig["query"][0]]
    if subtask == "bar_difference":
        i, j = fig["query"]
        return fig["values"][i] - fig["values"][j]
    if subtask == "line_value":
        return fig["slope"] * fig["x"] + fig["intercept"]
    if subtask == "count":
        return fig["count"]
    if subtask == "perimeter":
        return 2 * (fig["width"] + fig["height"])
    if subtask == "side":
        return fig["height"]
    raise _unknown_subtask(subtask)


def content_id(subtask: str, fig: Figure) -> list[Any]:
    """What decides a figure's split: the sub-task and its :data:`CONTENT_KEYS` (not the
    layout, nor the colours of a line, a rectangle or the distractor shapes)."""
    return ["visual_math", subtask, *[fig[k] for k in CONTENT_KEYS[subtask]]]


def split_of(subtask: str, fig: Figure, test_fraction: float, dev_fraction: float = 0.0) -> str:
    """The split figure content ``fig`` belongs to: "test" if its seed-independent hash u is
    below ``test_fraction``, "dev" if below ``test_fraction + dev_fraction``, else "train"."""
    u = unit_hash(content_id(subtask, fig))
    return "test" if u < test_fraction else "dev" if u < test_fraction + dev_fraction else "train"


def in_split(subtask: str, fig: Figure, split: str, test_fraction: float,
             dev_fraction: float = 0.0) -> bool:
    """Whether figure content ``fig`` belongs to ``split`` (:func:`split_of`)."""
    return split_of(subtask, fig, test_fraction, dev_fraction) == split


# ---------------------------------------------------------------------------------- drawing


def _font(s: int, frac: float):
    return load_font(round(s * frac), "sans", True)


def _y_axis(draw: ImageDraw.ImageDraw, box: tuple[float, float, float, float], top: int,
            s: int, bottom_value: int = 0) -> Callable[[float], float]:
    """Grid lines and tick labels of a y axis from ``bottom_value`` to ``top`` inside ``box``;
    returns value -> pixel row."""
    x1, y1, x2, y2 = box

    def row(v: float) -> float:
        return y2 - (v - bottom_value) / (top - bottom_value) * (y2 - y1)

    step = 1 if top - bottom_value <= 10 else -(-(top - bottom_value) // 5)
    font = _font(s, 0.075)
    for v in range(bottom_value, top + 1, step):
        draw.line([(x1, row(v)), (x2, row(v))], fill=_GRID_INK, width=1)
        draw.text((x1 - 0.02 * s, row(v)), str(v), fill=_INK, font=font, anchor="rm")
    draw.line([(x1, y1), (x1, y2)], fill=_INK, width=max(1, s // 112))
    draw.line([(x1, y2), (x2, y2)], fill=_INK, width=max(1, s // 112))
    return row


def _render_bars(rng: np.random.Generator, fig: Figure, s: int, p: dict[str, Any]) -> Figure:
    colors = fig["colors"]
    draw = fig["_draw"]
    box = (0.16 * s, 0.1 * s, 0.96 * s, 0.92 * s)
    row = _y_axis(draw, box, p["max_value"], s)
    n = len(fig["values"])
    slot = (box[2] - box[0]) / n
    font = _font(s, 0.08)
    for k, (v, c) in enumerate(zip(fig["values"], colors, strict=True)):
        left = box[0] + slot * (k + 0.2)
        right = box[0] + slot * (k + 0.8)
        draw.rectangle([left, row(v), right, box[3]], fill=COLORS[c])
        if p["value_labels"]:
            draw.text(((left + right) / 2, row(v) - 0.01 * s), str(v), fill=_INK, font=font,
                      anchor="mb")
    return {}


def _render_line(rng: np.random.Generator, fig: Figure, s: int, p: dict[str, Any]) -> Figure:
    draw = fig["_draw"]
    box = (0.16 * s, 0.06 * s, 0.94 * s, 0.86 * s)
    row = _y_axis(draw, box, p["max_value"], s)
    span = box[2] - box[0]

    def col(x: float) -> float:
        return box[0] + x / LINE_X[-1] * span

    font = _font(s, 0.075)
    for x in LINE_X:
        draw.text((col(x), box[3] + 0.02 * s), str(x), fill=_INK, font=font, anchor="mt")
    a, b, x0 = fig["slope"], fig["intercept"], fig["x"]
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    draw.line([(col(0), row(b)), (col(LINE_X[-1]), row(b + a * LINE_X[-1]))],
              fill=COLORS[color], width=max(2, s // 56))
    y0 = row(a * x0 + b)
    for t in np.arange(y0, box[3], 0.04 * s):  # dashed drop line to the x axis
        draw.line([(col(x0), t), (col(x0), min(t + 0.02 * s, box[3]))], fill=_INK, width=1)
    r = 0.03 * s
    draw.ellipse([col(x0) - r, y0 - r, col(x0) + r, y0 + r], fill=_INK)
    return {"colors": [color]}


def _render_count(rng: np.random.Generator, fig: Figure, s: int, p: dict[str, Any]) -> Figure:
    draw = fig["_draw"]
    others = [c for c in COLORS if c != fig["color"]]
    kinds = [fig["color"]] * fig["count"] + [
        others[int(i)] for i in rng.integers(len(others), size=fig["others"])
    ]
    cells = rng.permutation(GRID * GRID)[: len(kinds)]
    cell = s / GRID
    for c, at in zip(kinds, cells, strict=True):
        gx, gy = int(at) % GRID, int(at) // GRID
        size = cell * rng.uniform(0.45, 0.7)
        x1 = gx * cell + rng.uniform(0.08 * cell, cell - size - 0.08 * cell)
        y1 = gy * cell + rng.uniform(0.08 * cell, cell - size - 0.08 * cell)
        shape = SHAPE_NAMES[int(rng.integers(len(SHAPE_NAMES)))]
        draw_shape(draw, shape, (x1, y1, x1 + size, y1 + size), COLORS[c])
    return {"colors": kinds, "cells": [int(c) for c in cells]}


def _render_rect(rng: np.random.Generator, fig: Figure, s: int, p: dict[str, Any],
                 missing: bool) -> Figure:
    draw = fig["_draw"]
    w, h, top = fig["width"], fig["height"], p["max_value"]
    unit = 0.62 * s / top  # drawn to scale
    rw, rh = max(w * unit, 0.06 * s), max(h * unit, 0.06 * s)
    x1 = 0.1 * s + rng.uniform(0, 0.68 * s - rw)
    y1 = 0.08 * s + rng.uniform(0, 0.68 * s - rh)
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    draw.rectangle([x1, y1, x1 + rw, y1 + rh], outline=COLORS[color], width=max(2, s // 56))
    font = _font(s, 0.1)
    draw.text((x1 + rw / 2, y1 + rh + 0.03 * s), str(w), fill=_INK, font=font, anchor="mt")
    draw.text((x1 + rw + 0.03 * s, y1 + rh / 2), "?" if missing else str(h), fill=_INK,
              font=font, anchor="lm")
    if missing:
        draw.text((0.5 * s, 0.97 * s), f"P={2 * (w + h)}", fill=_INK, font=font, anchor="mb")
    return {"colors": [color]}


RENDERERS: dict[str, Callable[[np.random.Generator, Figure, int, dict[str, Any]], Figure]] = {
    "bar_value": _render_bars,
    "bar_difference": _render_bars,
    "line_value": _render_line,
    "count": _render_count,
    "perimeter": lambda rng, fig, s, p: _render_rect(rng, fig, s, p, missing=False),
    "side": lambda rng, fig, s, p: _render_rect(rng, fig, s, p, missing=True),
}


def question(subtask: str, fig: Figure) -> str:
    """The question text of ``subtask`` about the rendered figure (colours included)."""
    colors = fig.get("colors", [])
    if subtask == "bar_value":
        return f"What is the value of the {colors[fig['query'][0]]} bar?"
    if subtask == "bar_difference":
        i, j = fig["query"]
        return f"How much greater is the {colors[i]} bar than the {colors[j]} bar?"
    if subtask == "line_value":
        return f"What is f({fig['x']}) on the plotted line?"
    if subtask == "count":
        return f"How many {fig['color']} shapes are there?"
    if subtask == "perimeter":
        return "What is the perimeter of the rectangle?"
    if subtask == "side":
        return "The perimeter is P. What is the side marked ?"
    raise _unknown_subtask(subtask)


def make_choices(rng: np.random.Generator, answer: int, n_choices: int) -> list[int]:
    """``n_choices`` distinct non-negative integers near ``answer``, ``answer`` among them once,
    in random order."""
    pool = [v for v in range(max(0, answer - n_choices), answer + n_choices + 1) if v != answer]
    picked = [int(v) for v in rng.choice(pool, size=n_choices - 1, replace=False)]
    picked.insert(int(rng.integers(n_choices)), answer)
    return picked


def format_choices(choices: list[int]) -> str:
    """``"(A) 12 (B) 15 ..."``."""
    return " ".join(f"({string.ascii_uppercase[i]}) {v}" for i, v in enumerate(choices))


def render_figure(
    rng: np.random.Generator, subtask: str, fig: Figure, params: dict[str, Any]
) -> tuple[Image.Image, Figure]:
    """Draw ``fig`` (layout and colours from ``rng``); returns the image and the figure with
    what was drawn (``colors``, and ``cells`` for ``count``)."""
    s = params["image_size"] * params["supersample"]
    img = Image.new("RGB", (s, s), _WHITE)
    drawn = RENDERERS[subtask](rng, {**fig, "_draw": ImageDraw.Draw(img)}, s, params)
    if params["supersample"] > 1:
        size = (params["image_size"], params["image_size"])
        img = img.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)
    img = add_noise(img, rng, params["noise"] * rng.random())
    return img, {**fig, **drawn}


#: The legal values of the visual-math task's numeric parameters (emdlm.domains); how they
#: combine (``bar_difference`` needs two bars, ``dev_fraction`` fits beside ``test_fraction``) is
#: checked in :func:`visual_math`.
VISUAL_MATH_DOMAINS: dict[str, Domain] = {
    **image_task_domains(64),
    "max_value": Domain(low=2, high=50, integer=True),
    "n_bars": Domain(low=1, high=len(COLORS), integer=True),
    "multiple_choice": UNIT,
    "n_choices": Domain(low=2, high=6, integer=True),
    "noise": NOISE,
    "supersample": SUPERSAMPLE,
    "dev_fraction": DEV_FRACTION,
}


def _check(subtasks: tuple[str, ...], n_bars: int) -> None:
    if not subtasks or set(subtasks) - set(SUBTASKS) or len(set(subtasks)) != len(subtasks):
        raise ValueError(f"subtasks must be a non-empty subset of {SUBTASKS} without repeats, "
                         f"got {subtasks}")
    if "bar_difference" in subtasks and n_bars < 2:
        raise ValueError(f"bar_difference needs n_bars >= 2, got {n_bars}")


@register_task("visual_math", splits=SPLITS, answer_pattern=r"\b\d+\b", eval_kind="math",
               domains=VISUAL_MATH_DOMAINS)
def visual_math(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    subtasks: tuple[str, ...] | list[str] = SUBTASKS,
    image_size: int = 112,
    max_value: int = 9,
    n_bars: int = 3,
    value_labels: bool = True,
    multiple_choice: float = 0.0,
    n_choices: int = 4,
    noise: float = 0.0,
    supersample: int = 2,
    test_fraction: float = 0.2,
    dev_fraction: float = 0.0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows of numbers read off rendered figures (see the module docstring).

    Args:
        n: number of examples.
        split: "train", "dev" or "test" (disjoint figure contents; see the module
            docstring); "dev" needs ``dev_fraction > 0``.
        seed: the same arguments give the same images and questions.
        subtasks: subset of :data:`SUBTASKS`; each row draws one uniformly.
        image_size: side of the square image in pixels (>= 64).
        max_value: largest bar value, side length and line value (2..50; counts stop at 12).
        n_bars: bars per chart (1..6; >= 2 with ``bar_difference``).
        value_labels: write each bar's value above it.
        multiple_choice: probability that a row is multiple choice (else free form).
        n_choices: options of a multiple-choice row (2..6).
        noise: largest standard deviation of the Gaussian pixel noise (0..255 units); each
            image draws its own in [0, noise].
        supersample: render at this multiple of ``image_size`` and downscale (anti-aliasing).
        test_fraction: share of figure contents reserved for the test split, in (0, 1).
        dev_fraction: share reserved for the dev split, in [0, 1 - test_fraction); 0 (the
            default) keeps the train and test streams as they were before the dev split. Give
            the same value to the train split of a run that is tuned on "dev".
        cache_dir: folder for the PNGs (default: under ``$EMDLM_CACHE/images/visual_math``).
    """
    check_one_of("split", split, SPLITS)
    check_dev_fraction(split, test_fraction, dev_fraction)
    subs = tuple(subtasks)
    _check(subs, n_bars)
    params = {"image_size": image_size, "max_value": max_value, "n_bars": n_bars,
              "value_labels": bool(value_labels), "noise": noise, "supersample": supersample}
    # dev_fraction enters the key only when set: the caches of the sets made before it existed
    # (the same rows) stay valid
    dev = {"dev_fraction": dev_fraction} if dev_fraction else {}
    key_params = {**params, "subtasks": subs, "multiple_choice": multiple_choice,
                  "n_choices": n_choices, **dev}

    def make(rng: np.random.Generator) -> tuple[Image.Image, dict[str, Any]]:
        subtask = subs[int(rng.integers(len(subs)))]
        for _ in range(_MAX_TRIES):
            fig = SAMPLERS[subtask](rng, params)
            if fig and in_split(subtask, fig, split, test_fraction, dev_fraction):
                break
        else:
            raise ValueError(f"no {subtask} figure falls in split {split!r} with "
                             f"test_fraction={test_fraction}, dev_fraction={dev_fraction}, "
                             f"max_value={max_value}")
        image, fig = render_figure(rng, subtask, fig, params)
        answer = figure_answer(subtask, fig)
        text = question(subtask, fig)
        if rng.random() < multiple_choice:
            choices = make_choices(rng, answer, n_choices)
            letter = string.ascii_uppercase[choices.index(answer)]
            row = {"prompt": f"{text} Choices: {format_choices(choices)}. Answer with the "
                             "letter.",
                   "completion": letter, "choices": [str(c) for c in choices],
                   "question_type": MULTI_CHOICE, "number_scope": NO_NUMBERS}
        else:
            row = {"prompt": f"{text} Answer with a number.", "completion": str(answer),
                   "choices": None, "question_type": FREE_FORM, "number_scope": "all"}
        return image, {**row, "answer": str(answer), "answer_type": "integer",
                       "subtask": subtask, "figure": fig}

    return generated_rows("visual_math", n, make, seed=seed, split=split,
                          test_fraction=test_fraction, params=key_params, cache_dir=cache_dir)
