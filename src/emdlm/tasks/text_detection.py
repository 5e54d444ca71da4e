"""Scene text detection on synthetic images: find every word's box, in reading order.

Each image holds ``min_words``..``max_words`` English words (a built-in list) in DejaVu Sans,
Serif or Mono (regular or bold, matplotlib's bundled fonts), at heights of 7-16 % of the image
side, in a colour contrasting with a solid or gradient background cluttered with lines,
rectangles and ellipses, plus Gaussian pixel noise. Words never touch (their ink boxes keep a
2-pixel gap).

Answer: every word's tight ink box in reading order (:func:`emdlm.metrics.boxes.reading_order`:
lines top to bottom, each left to right), each in the model family's format (``box_format``:
``(x1,y1),(x2,y2)`` on a 0..1000 grid for Qwen2-VL, ``[x1, y1, x2, y2]`` 3-decimal fractions for
LLaVA), joined by ``"; "``: ``"(102,250),(391,344); (500,250),(812,352)"``. The metric
(``compute_task_metrics(kind="boxes")``) matches boxes one-to-one at IoU >= 0.5.

Train/test disjointness: a hash of the scene (words, fonts, sizes, positions; seed-independent)
decides its split, and the two splits draw from separate seed streams. Example k depends only on
(seed, split, k).

Throughput (one thread, image_size=128, 1-4 words, rendering + PNG writing, 2-core CPU shared
with other jobs, load average ~5): about 140 images/s for the train split and 70 for the test
split (a test scene is drawn before its hash can accept it, and only a fifth of them are).
Measured by timing ``generate_task("text_detection", n=300, cache_dir=<a fresh folder>)``
after a 2-image warm-up, under ``OMP_NUM_THREADS=1 taskset -c 0``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from emdlm.domains import Domain
from emdlm.metrics.boxes import check_box_format, format_boxes, reading_order
from emdlm.tasks import register_task
from emdlm.tasks.render import (
    BOX_ANSWER_PATTERN,
    CLUTTER,
    FONT_FAMILIES,
    NOISE,
    add_clutter,
    add_noise,
    background,
    contrasting_color,
    generated_rows,
    image_task_domains,
    load_font,
    unit_hash,
)

_WORD_TEXT = (
    "the and open shop exit stop park cafe hotel bank road north south east west sale bus "
    "taxi city river bridge market bread books music water fire police school garden station "
    "post office hall street lane avenue museum library pizza coffee tea fresh fish fruit "
    "green red blue gold silver king queen star moon sun rain snow wind light dark new old "
    "big small fast slow push pull enter welcome hello help info ticket gate door floor room "
    "house home farm field forest lake sea beach port train plane car bike walk run play game "
    "sport club team"
)
WORDS = tuple(_WORD_TEXT.split())
PROMPTS = {
    "qwen2vl": "Find every word in the image. List their boxes in reading order as "
    "(x1,y1),(x2,y2) on a 0-1000 grid, separated by '; '.",
    "llava": "Find every word in the image. List their boxes in reading order as "
    "[x1, y1, x2, y2] in fractions of the image size, separated by '; '.",
}
_GAP = 2  # pixels kept free around each word's ink box


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return not (
        a[2] + _GAP <= b[0] or b[2] + _GAP <= a[0] or a[3] + _GAP <= b[1] or b[3] + _GAP <= a[1]
    )


def render_words(
    rng: np.random.Generator,
    image_size: int,
    n_words: int,
    clutter: int,
) -> tuple[Image.Image, list[str], list[tuple[int, int, int, int]], list[list[Any]]]:
    """Draw up to ``n_words`` words (no noise yet); returns (image, words, ink boxes, style
    records)."""
    s = image_size
    img = background(rng, (s, s))
    draw = ImageDraw.Draw(img)
    base = img.getpixel((s // 2, s // 2))
    if clutter > 0:
        add_clutter(draw, rng, (s, s), int(rng.integers(clutter // 2, clutter + 1)), base)
    words: list[str] = []
    boxes: list[tuple[int, int, int, int]] = []
    styles: list[list[Any]] = []
    for _ in range(n_words * 30):
        if len(words) == n_words:
            break
        word = WORDS[int(rng.integers(len(WORDS)))]
        family = FONT_FAMILIES[int(rng.integers(len(FONT_FAMILIES)))]
        bold = bool(rng.random() < 0.4)
        font = load_font(round(float(s * rng.uniform(0.07, 0.16))), family, bold)
        left, top, right, bottom = font.getbbox(word)  # ink extent relative to the origin
        w, h = right - left, bottom - top
        if w >= s - 2 or h >= s - 2:
            continue
        x = int(rng.integers(1, s - w))  # where the ink's top-left corner goes
        y = int(rng.integers(1, s - h))
        # Draw on a word-sized mask (cheap), then take the tight box of the drawn ink.
        mask = Image.new("L", (w + 4, h + 4), 0)
        ImageDraw.Draw(mask).text((2 - left, 2 - top), word, fill=255, font=font)
        ink = mask.getbbox()
        if ink is None:
            continue
        box = (x - 2 + ink[0], y - 2 + ink[1], x - 2 + ink[2], y - 2 + ink[3])
        if box[0] < 0 or box[1] < 0 or box[2] > s or box[3] > s:
            continue
        if any(_overlaps(box, b) for b in boxes):
            continue
        img.paste(contrasting_color(rng, base, 100), (x - 2, y - 2), mask=mask)
        words.append(word)
        boxes.append(box)
        styles.append([word, family, bold, font.size, list(box)])
    return img, words, boxes, styles


def detection_row(
    boxes: list[tuple[float, float, float, float]], words: list[str], width: int, height: int,
    box_format: str,
) -> dict[str, Any]:
    """The row fields of an image's words and their pixel boxes, both put in reading order
    (:func:`emdlm.metrics.boxes.reading_order`): ``prompt``, ``completion`` (the boxes in
    ``box_format`` for a ``width`` x ``height`` image), ``boxes``, ``words``, ``box_format``."""
    order = reading_order(boxes)
    ordered = [boxes[i] for i in order]
    return {
        "prompt": PROMPTS[box_format],
        "completion": format_boxes(ordered, width, height, box_format),
        "boxes": [list(b) for b in ordered],
        "words": [words[i] for i in order],
        "box_format": box_format,
    }


#: The legal values of the text-detection task's numeric parameters (emdlm.domains); the body
#: checks ``min_words <= max_words``.
TEXT_DETECTION_DOMAINS: dict[str, Domain] = {
    **image_task_domains(48),
    "min_words": Domain(low=1, high=12, integer=True),
    "max_words": Domain(low=1, high=12, integer=True),
    "clutter": CLUTTER,
    "noise": NOISE,
}


@register_task("text_detection", answer_pattern=BOX_ANSWER_PATTERN, eval_kind="boxes",
               domains=TEXT_DETECTION_DOMAINS)
def text_detection(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    image_size: int = 128,
    min_words: int = 1,
    max_words: int = 4,
    clutter: int = 8,
    noise: float = 6.0,
    box_format: str = "qwen2vl",
    test_fraction: float = 0.2,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows ``{"image", "prompt", "completion", "boxes", "words", "box_format"}``:
    ``completion`` lists the word boxes in reading order, ``boxes`` (pixels) and ``words`` follow
    the same order.

    Args:
        n: number of examples.
        split: "train" or "test" (disjoint scenes; see the module docstring).
        seed: the same arguments give the same images.
        image_size: side of the square image in pixels (>= 48).
        min_words, max_words: words per image, 1 <= min <= max <= 12 (placement may fall short
            of the drawn count on a crowded image; never below 1).
        clutter: largest number of background lines / rectangles / ellipses (0 for none).
        noise: largest standard deviation of the Gaussian pixel noise (0..255 units).
        box_format: "qwen2vl" or "llava" (see :mod:`emdlm.metrics.boxes`).
        test_fraction: share of scene hashes reserved for the test split, in (0, 1).
        cache_dir: folder for the PNGs (default: under ``$EMDLM_CACHE/images/text_detection``).
    """
    check_box_format(box_format)
    if not 1 <= min_words <= max_words <= 12:
        raise ValueError(f"need 1 <= min_words <= max_words <= 12, got {min_words}, {max_words}")
    params = {
        "image_size": image_size,
        "min_words": min_words,
        "max_words": max_words,
        "clutter": clutter,
        "noise": noise,
        "box_format": box_format,
    }
    want_test = split == "test"

    def make(rng: np.random.Generator) -> tuple[Image.Image, dict[str, Any]]:
        for _ in range(1000):  # rejection: a scene with words that hashes into this split
            count = int(rng.integers(min_words, max_words + 1))
            image, words, boxes, styles = render_words(rng, image_size, count, clutter)
            if words and (unit_hash(["text_detection", styles]) < test_fraction) == want_test:
                break
        else:  # pragma: no cover - only for degenerate parameters
            raise ValueError(f"could not place words with parameters {params}")
        image = add_noise(image, rng, noise * rng.random())  # only on the accepted scene
        return image, detection_row(boxes, words, image_size, image_size, box_format)

    return generated_rows("text_detection", n, make, seed=seed, split=split,
                          test_fraction=test_fraction, params=params, cache_dir=cache_dir)
