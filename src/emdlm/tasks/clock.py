"""Analog clock reading (the NTIL paper's TIME task): an image of a clock face -> "H_MM".

Each face varies: dial style (numerals, ticks or both; numerals in DejaVu Sans or Serif), face
and background colours (solid or gradient), hand shapes (line, tapered, arrow) and colours, the
centre and radius (``jitter``), background clutter and Gaussian pixel noise. The hour hand is
shorter and thicker than the minute hand and sits at ``30 * (H mod 12) + MM / 2`` degrees, as on a
real clock. Answers are "H_MM" with H in 1..12 and two minute digits ("2_55"), as in TIME.

Difficulty knobs: ``minute_step`` (5: five-minute marks only), ``palette="plain"`` (fixed
colours: only the hands' angles vary) and ``hand_width``. A tiny VLM trained from scratch on
2 CPU cores does not find the hands among random colours (docs/results/vlm_clock_cpu.md), so
the packaged clock configs use plain five-minute clocks; the defaults stay TIME-like.

Train/test disjointness: each of the 720 dial times is hashed (seed-independent); times whose
hash falls under ``test_fraction`` belong to the test split only, so a test clock never shows a
time seen in training (with any seed). Example k depends only on (seed, split, k).

Images are rendered once into the cache (:func:`emdlm.tasks.render.cached_rows`).
Throughput (one thread, image_size=128, supersample=2, rendering + PNG writing, 2-core CPU
shared with other jobs, load average ~5): about 80 images/s for either split (PNG encoding of
the noisy image and the gradient background take most of it); re-reading a cached set: >15k
rows/s. Measured by timing ``generate_task("clock", n=300, cache_dir=<a fresh folder>)``
after a 2-image warm-up, under ``OMP_NUM_THREADS=1 taskset -c 0``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from emdlm.config.errors import check_one_of
from emdlm.domains import UNIT, Domain
from emdlm.tasks import register_task
from emdlm.tasks.render import (
    CLUTTER,
    NOISE,
    SUPERSAMPLE,
    add_clutter,
    add_noise,
    background,
    contrasting_color,
    generated_rows,
    image_task_domains,
    load_font,
    random_color,
    unit_hash,
)

PROMPT = "What time does the clock show? Answer as H_MM."
DIAL_STYLES = ("numerals", "ticks", "both")
HAND_SHAPES = ("line", "tapered", "arrow")
PALETTES = ("random", "plain")
# "plain": fixed colours, so that only the hands' angles vary between faces
PLAIN = {"background": (235, 235, 235), "face": (255, 255, 255), "ink": (0, 0, 0),
         "hour": (0, 0, 0), "minute": (200, 30, 30)}
#: The legal values of the clock task's numeric parameters (emdlm.domains); ``minute_step``
#: must also divide 60 (checked in :func:`clock`).
CLOCK_DOMAINS: dict[str, Domain] = {
    **image_task_domains(32),
    "jitter": Domain(low=0.0, high=0.5),
    "noise": NOISE,
    "clutter": CLUTTER,
    "second_hand_prob": UNIT,
    "supersample": SUPERSAMPLE,
    "minute_step": Domain(low=1, high=60, integer=True),
    "hand_width": Domain(low=0.2, high=4.0),
}


def format_time(hour: int, minute: int) -> str:
    """The TIME dataset's answer: ``"H_MM"`` with H in 1..12 (0 is written 12)."""
    return f"{(hour - 1) % 12 + 1}_{minute:02d}"


def split_times(
    split: str, test_fraction: float, minute_step: int = 1
) -> list[tuple[int, int]]:
    """The (hour 1..12, minute) pairs of ``split`` with minutes a multiple of ``minute_step``:
    a seed-independent hash of each time decides (so a coarser step keeps each time's split)."""
    want_test = split == "test"
    return [
        (h, m)
        for h in range(1, 13)
        for m in range(0, 60, minute_step)
        if (unit_hash(["clock", h, m]) < test_fraction) == want_test
    ]


def hand_angles(hour: int, minute: int) -> tuple[float, float]:
    """(hour, minute) hand angles in degrees clockwise from 12: (30 (H mod 12) + M / 2, 6 M)."""
    return 30.0 * (hour % 12) + 0.5 * minute, 6.0 * minute


def _point(cx: float, cy: float, r: float, degrees: float) -> tuple[float, float]:
    a = math.radians(degrees)
    return (cx + r * math.sin(a), cy - r * math.cos(a))


def _draw_hand(
    draw: ImageDraw.ImageDraw,
    center: tuple[float, float],
    length: float,
    width: float,
    degrees: float,
    color: tuple[int, int, int],
    shape: str,
) -> None:
    cx, cy = center
    tip = _point(cx, cy, length, degrees)
    tail = _point(cx, cy, 0.15 * length, degrees + 180.0)
    if shape == "line":
        draw.line([tail, tip], fill=color, width=max(1, round(width)))
        return
    left = _point(cx, cy, width, degrees - 90.0)
    right = _point(cx, cy, width, degrees + 90.0)
    if shape == "tapered":
        draw.polygon([tail, left, tip, right], fill=color)
        return
    # arrow: a shaft and a triangular head
    head_base = _point(cx, cy, 0.75 * length, degrees)
    draw.line([tail, head_base], fill=color, width=max(1, round(width * 0.8)))
    hl = _point(head_base[0], head_base[1], 1.6 * width, degrees - 90.0)
    hr = _point(head_base[0], head_base[1], 1.6 * width, degrees + 90.0)
    draw.polygon([hl, tip, hr], fill=color)


def render_clock(
    rng: np.random.Generator,
    hour: int,
    minute: int,
    *,
    image_size: int = 128,
    jitter: float = 0.1,
    noise: float = 8.0,
    clutter: int = 4,
    dial_styles: tuple[str, ...] = DIAL_STYLES,
    hand_shapes: tuple[str, ...] = HAND_SHAPES,
    second_hand_prob: float = 0.0,
    supersample: int = 2,
    palette: str = "random",
    hand_width: float = 1.0,
) -> Image.Image:
    """One clock face showing ``hour``:``minute``, styled by ``rng`` (see :func:`clock`)."""
    s = image_size * supersample
    plain = palette == "plain"
    img = Image.new("RGB", (s, s), PLAIN["background"]) if plain else background(rng, (s, s))
    draw = ImageDraw.Draw(img)
    if clutter > 0:
        add_clutter(draw, rng, (s, s), int(rng.integers(0, clutter + 1)), img.getpixel((0, 0)))
    radius = 0.45 * s * (1.0 - jitter * rng.random())
    cx = s / 2 + jitter * radius * rng.uniform(-1, 1)
    cy = s / 2 + jitter * radius * rng.uniform(-1, 1)
    if plain:
        face, ink = PLAIN["face"], PLAIN["ink"]
    else:
        face = random_color(rng, 170, 256) if rng.random() < 0.75 else random_color(rng, 0, 80)
        ink = contrasting_color(rng, face, 110)
    rim = max(1, round(radius * rng.uniform(0.02, 0.08)))
    draw.ellipse(
        [cx - radius, cy - radius, cx + radius, cy + radius], fill=face, outline=ink, width=rim
    )
    style = dial_styles[int(rng.integers(len(dial_styles)))]
    if style in ("ticks", "both"):
        n_ticks = 60 if rng.random() < 0.5 else 12
        for k in range(n_ticks):
            deg = k * 360.0 / n_ticks
            major = k % (n_ticks // 12) == 0  # the twelve hour positions
            inner = radius * (0.82 if major else 0.9)
            draw.line(
                [_point(cx, cy, inner, deg), _point(cx, cy, radius * 0.96, deg)],
                fill=ink,
                width=max(1, round(radius * (0.035 if major else 0.015))),
            )
    if style in ("numerals", "both"):
        font = load_font(
            round(radius * rng.uniform(0.17, 0.24)),
            ("sans", "serif")[int(rng.integers(2))],
            bool(rng.random() < 0.5),
        )
        ring = radius * (0.68 if style == "both" else 0.8)
        for k in range(1, 13):
            x, y = _point(cx, cy, ring, 30.0 * k)
            draw.text((x, y), str(k), fill=ink, font=font, anchor="mm")
    hour_deg, minute_deg = hand_angles(hour, minute)
    if plain:
        hour_color, minute_color = PLAIN["hour"], PLAIN["minute"]
    else:
        hour_color = contrasting_color(rng, face, 110)
        minute_color = hour_color if rng.random() < 0.6 else contrasting_color(rng, face, 110)
    shape = hand_shapes[int(rng.integers(len(hand_shapes)))]
    _draw_hand(
        draw, (cx, cy), radius * rng.uniform(0.45, 0.55), radius * 0.07 * hand_width, hour_deg,
        hour_color, shape,
    )
    _draw_hand(
        draw,
        (cx, cy),
        radius * rng.uniform(0.78, 0.9),
        radius * 0.045 * hand_width,
        minute_deg,
        minute_color,
        shape,
    )
    if rng.random() < second_hand_prob:
        _draw_hand(
            draw, (cx, cy), radius * 0.9, radius * 0.012, rng.uniform(0, 360), (200, 30, 30), "line"
        )
    hub = radius * 0.05
    draw.ellipse([cx - hub, cy - hub, cx + hub, cy + hub], fill=hour_color)
    if supersample > 1:
        img = img.resize((image_size, image_size), Image.Resampling.BILINEAR, reducing_gap=2.0)
    return add_noise(img, rng, noise * rng.random())


@register_task("clock", answer_pattern=r"\b\d{1,2}_\d{2}\b", eval_kind="clock",  # "H_MM"
               domains=CLOCK_DOMAINS)
def clock(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    image_size: int = 128,
    jitter: float = 0.1,
    noise: float = 8.0,
    clutter: int = 4,
    dial_styles: tuple[str, ...] | list[str] = DIAL_STYLES,
    hand_shapes: tuple[str, ...] | list[str] = HAND_SHAPES,
    second_hand_prob: float = 0.0,
    supersample: int = 2,
    test_fraction: float = 0.2,
    minute_step: int = 1,
    palette: str = "random",
    hand_width: float = 1.0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows ``{"image": png path, "prompt": PROMPT, "completion": "2_55", "time": "2_55"}``.

    Args:
        n: number of examples.
        split: "train" or "test" (disjoint dial times; see the module docstring).
        seed: the same arguments give the same images.
        image_size: side of the square image in pixels (>= 32).
        jitter: in [0, 0.5]: random shrink of the radius and shift of the centre, as a fraction
            of the radius.
        noise: largest standard deviation of the Gaussian pixel noise (0..255 units); each image
            draws its own in [0, noise].
        clutter: largest number of background lines / rectangles / ellipses (0 for none).
        dial_styles: subset of ("numerals", "ticks", "both") to draw from.
        hand_shapes: subset of ("line", "tapered", "arrow") to draw from.
        second_hand_prob: probability of a distracting thin red second hand.
        supersample: render at this multiple of ``image_size`` and downscale (anti-aliasing).
        test_fraction: share of the 720 dial times reserved for the test split, in (0, 1).
        minute_step: minutes are multiples of this divisor of 60 (1: every minute, as in the
            TIME dataset; 5: the 144 times of the five-minute marks).
        palette: "random" (face, ink, hands and background colours drawn per image) or "plain"
            (light grey background, white face, black ink and hour hand, red minute hand).
        hand_width: multiplier of both hands' width (1: hour 7 %, minute 4.5 % of the radius).
        cache_dir: folder for the PNGs (default: under ``$EMDLM_CACHE/images/clock``).
    """
    if 60 % minute_step:  # an integer in 1..60: CLOCK_DOMAINS, checked before
        raise ValueError(f"minute_step must be a divisor of 60 (1, 2, 3, 4, 5, 6, 10, 12, 15, "
                         f"20, 30, 60), got {minute_step!r}")
    check_one_of("palette", palette, PALETTES)
    styles, shapes = tuple(dial_styles), tuple(hand_shapes)
    if not styles or set(styles) - set(DIAL_STYLES):
        raise ValueError(f"dial_styles must be a non-empty subset of {DIAL_STYLES}, got {styles}")
    if not shapes or set(shapes) - set(HAND_SHAPES):
        raise ValueError(f"hand_shapes must be a non-empty subset of {HAND_SHAPES}, got {shapes}")
    times = split_times(split, test_fraction, minute_step)
    if not times:
        raise ValueError(f"test_fraction={test_fraction} leaves no dial time for split {split!r}")
    style = {
        "image_size": image_size,
        "jitter": jitter,
        "noise": noise,
        "clutter": clutter,
        "dial_styles": styles,
        "hand_shapes": shapes,
        "second_hand_prob": second_hand_prob,
        "supersample": supersample,
        "palette": palette,
        "hand_width": hand_width,
    }
    # these join the key only when not at their defaults, so sets cached before they existed
    # stay valid
    defaults = {"minute_step": 1, "palette": "random", "hand_width": 1.0}
    given = {"minute_step": minute_step, "palette": palette, "hand_width": hand_width}
    extra = {k: v for k, v in given.items() if v != defaults[k]}
    base = {k: v for k, v in style.items() if k not in given}

    def make(rng: np.random.Generator) -> tuple[Image.Image, dict[str, Any]]:
        hour, minute = times[int(rng.integers(len(times)))]
        answer = format_time(hour, minute)
        image = render_clock(rng, hour, minute, **style)
        return image, {"prompt": PROMPT, "completion": answer, "time": answer}

    return generated_rows("clock", n, make, seed=seed, split=split, test_fraction=test_fraction,
                          params={**base, **extra}, cache_dir=cache_dir)


def reading_accuracy(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Exact match split into its two readings: the share of answers whose hour is right
    (``hour_accuracy``) and whose minutes are right (``minute_accuracy``), as
    :func:`emdlm.metrics.clock_metrics` gives them. An unparsable answer is wrong on both;
    chance is 1/12 for the hour and 1/(60 / minute_step) for the minutes. ValueError when the
    lists differ in length or a reference is not "H_MM"."""
    from emdlm.metrics import clock_metrics

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        return {"hour_accuracy": float("nan"), "minute_accuracy": float("nan")}
    out = clock_metrics(predictions, references)
    return {"hour_accuracy": out["hour_accuracy"], "minute_accuracy": out["minute_accuracy"]}
