"""Shared machinery of the image tasks: fonts, colours, backgrounds, noise, the image cache, the
domains of their common parameters and the answer pattern of a box.

Fonts are matplotlib's bundled DejaVu TTFs (``matplotlib.get_data_path()/fonts/ttf``), read by
Pillow, so rendered text never depends on the fonts installed on the system.

Cache: :func:`generated_rows` (an image task's rows: its cache key and the random stream of
each example) and :func:`cached_rows` under it write each example's PNG once into
``cache_dir`` (default ``<cache>/images/<task>/<key>/``, ``<cache>`` emdlm's cache
(:func:`emdlm.tokenizers.cache_dir`), ``key`` a hash of the task's parameters, seed and split)
plus a ``rows.jsonl`` manifest with paths relative to that folder. A later call with the same
parameters reads the manifest instead of rendering again (and renders only the rows beyond the
cached ones when asked for more). Example ``k`` depends only on (seed, split, k), so the first
``n`` rows of a bigger set equal a set of ``n``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from emdlm._files import atomic_write, exclusive_lock, open_lock_file
from emdlm.domains import NONNEGATIVE, NONNEGATIVE_COUNT, Domain
from emdlm.tasks import TEST_FRACTION
from emdlm.tokenizers import cache_dir as emdlm_cache_dir

RGB = tuple[int, int, int]

_QWEN_BOX = r"\(\s*\d+\s*,\s*\d+\s*\)\s*,\s*\(\s*\d+\s*,\s*\d+\s*\)"  # (x1,y1),(x2,y2)
_LLAVA_BOX = r"\[\s*\d*\.?\d+(?:\s*,\s*\d*\.?\d+){3}\s*\]"  # [x1, y1, x2, y2]
#: The answer pattern of the box tasks (``number_scope="answer"``): one box in either answer
#: format of :mod:`emdlm.metrics.boxes`, so a list of boxes is one match per box.
BOX_ANSWER_PATTERN = f"{_QWEN_BOX}|{_LLAVA_BOX}"

#: Named colours of the generated scenes (names appear in the referring expressions).
COLORS: dict[str, RGB] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 20),
}

FONT_FILES = {
    ("sans", False): "DejaVuSans.ttf",
    ("sans", True): "DejaVuSans-Bold.ttf",
    ("serif", False): "DejaVuSerif.ttf",
    ("serif", True): "DejaVuSerif-Bold.ttf",
    ("mono", False): "DejaVuSansMono.ttf",
    ("mono", True): "DejaVuSansMono-Bold.ttf",
}
FONT_FAMILIES = ("sans", "serif", "mono")
_MANIFEST = "rows.jsonl"
_KEY = "key.json"
_LOCK = ".lock"


def font_path(family: str = "sans", bold: bool = False) -> Path:
    """Path of matplotlib's bundled DejaVu font of ``family`` ("sans", "serif" or "mono")."""
    import matplotlib

    if (family, bold) not in FONT_FILES:
        raise ValueError(f"unknown font family {family!r}; expected one of {FONT_FAMILIES}")
    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / FONT_FILES[(family, bold)]
    if not path.is_file():  # pragma: no cover - a broken matplotlib install
        raise FileNotFoundError(f"matplotlib's DejaVu font is missing: {path}")
    return path


@lru_cache(maxsize=256)
def load_font(size: int, family: str = "sans", bold: bool = False) -> ImageFont.FreeTypeFont:
    """A Pillow TrueType font (cached: loading a TTF costs far more than drawing with it)."""
    return ImageFont.truetype(str(font_path(family, bold)), size=max(1, int(size)))


def random_color(rng: np.random.Generator, lo: int = 0, hi: int = 256) -> RGB:
    """A uniformly random RGB colour with each channel in [lo, hi)."""
    r, g, b = rng.integers(lo, hi, size=3).tolist()
    return (r, g, b)


def luminance(color: RGB) -> float:
    """Rec. 601 luma in [0, 255]: 0.299 R + 0.587 G + 0.114 B."""
    return 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]


def contrasting_color(rng: np.random.Generator, background: RGB, min_gap: float = 90.0) -> RGB:
    """A random colour whose luma differs from ``background``'s by at least ``min_gap``."""
    dark = luminance(background) > 127.5
    for _ in range(64):
        c = random_color(rng, 0, 110) if dark else random_color(rng, 150, 256)
        if abs(luminance(c) - luminance(background)) >= min_gap:
            return c
    return (0, 0, 0) if dark else (255, 255, 255)


def background(rng: np.random.Generator, size: tuple[int, int], lo: int = 0, hi: int = 256):
    """A solid or linear-gradient RGB background of ``size`` (w, h), channels in [lo, hi)."""
    w, h = size
    a = np.array(random_color(rng, lo, hi), dtype=np.float32)
    if rng.random() < 0.5:
        return Image.new("RGB", size, tuple(int(v) for v in a))
    b = np.array(random_color(rng, lo, hi), dtype=np.float32)
    angle = rng.uniform(0.0, 2.0 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (np.cos(angle) * xx / max(w, 1) + np.sin(angle) * yy / max(h, 1) + 1.0) / 2.0
    pixels = a + (b - a) * t[..., None]  # [h, w, 3]
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def add_clutter(
    draw: ImageDraw.ImageDraw,
    rng: np.random.Generator,
    size: tuple[int, int],
    count: int,
    base: RGB,
    spread: int = 60,
) -> None:
    """Draw ``count`` random lines, rectangles and ellipses in colours near ``base``.

    Colours stay within ``spread`` of the background colour, so clutter distracts without hiding
    the foreground (text or hands) drawn on top of it.
    """
    w, h = size
    for _ in range(count):
        c = tuple(int(np.clip(v + rng.integers(-spread, spread + 1), 0, 255)) for v in base)
        x1, x2 = sorted(rng.integers(0, w, size=2).tolist())
        y1, y2 = sorted(rng.integers(0, h, size=2).tolist())
        kind = int(rng.integers(0, 3))
        width = int(rng.integers(1, max(2, w // 64) + 1))
        if kind == 0:
            draw.line([(x1, y1), (x2, y2)], fill=c, width=width)
        elif kind == 1:
            draw.rectangle([x1, y1, x2, y2], outline=c, width=width)
        else:
            draw.ellipse([x1, y1, x2, y2], outline=c, width=width)


def add_noise(image: Image.Image, rng: np.random.Generator, sigma: float) -> Image.Image:
    """Add i.i.d. Gaussian pixel noise of standard deviation ``sigma`` (in 0..255 units)."""
    if sigma <= 0:
        return image
    arr = np.asarray(image, dtype=np.float32)
    arr = arr + rng.normal(0.0, sigma, size=arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), image.mode)


#: Legal values of the parameters the image tasks share (each task declares its own table of
#: :class:`emdlm.domains.Domain`, built from these): the Gaussian pixel noise's largest standard
#: deviation, the largest number of clutter shapes, the supersampling factor.
NOISE = NONNEGATIVE
CLUTTER = NONNEGATIVE_COUNT
SUPERSAMPLE = Domain(low=1, high=4, integer=True)


def image_task_domains(min_image_size: int) -> dict[str, Domain]:
    """The domains every image task has: ``image_size`` (an integer >= ``min_image_size``)
    and ``test_fraction`` (in (0, 1))."""
    return {"image_size": Domain(low=min_image_size, integer=True),
            "test_fraction": TEST_FRACTION}


def cache_key(
    task: str, seed: int, split: str, test_fraction: float, params: dict[str, Any]
) -> dict[str, Any]:
    """What identifies a generated set in the image cache (:func:`cached_rows`): the task,
    a format version, the seed, the split and every rendering parameter."""
    return {
        "task": task,
        "v": 1,
        "seed": seed,
        "split": split,
        "test_fraction": test_fraction,
        **params,
    }


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex digest of ``obj``'s canonical JSON (sorted keys): the same on every run and machine."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def unit_hash(obj: Any) -> float:
    """A seed-independent number in [0, 1) from ``obj``: decides train/test membership."""
    return int(stable_hash(obj, 13), 16) / float(16**13)


def _key_text(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, default=str)


def default_cache_root() -> Path:
    """``images`` in emdlm's cache (:func:`emdlm.tokenizers.cache_dir`)."""
    return emdlm_cache_dir() / "images"


def _read_manifest(folder: Path, key: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Up to ``n`` cached rows (image paths relative to ``folder``) whose PNGs exist; none if
    the folder was made with other parameters (a ``cache_dir`` reused for another set)."""
    manifest, key_file = folder / _MANIFEST, folder / _KEY
    if not manifest.is_file() or not key_file.is_file():
        return []
    if key_file.read_text(encoding="utf-8") != _key_text(key):
        return []
    rows: list[dict[str, Any]] = []
    with manifest.open(encoding="utf-8") as f:
        for line in f:
            if len(rows) == n:
                break
            row = json.loads(line)
            if not (folder / row["image"]).is_file():
                break
            rows.append(row)
    return rows


def cached_rows(
    task: str,
    key: dict[str, Any],
    n: int,
    make_example: Callable[[int], tuple[Image.Image, dict[str, Any]]],
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """Render ``n`` examples once into the cache and return their rows.

    Args:
        task: task name (a folder level of the default cache path).
        key: everything the images depend on (parameters, seed, split); hashed into the folder.
        n: number of rows.
        make_example: ``k -> (image, row)`` for the k-th example; ``row`` holds ``prompt``,
            ``completion`` and metadata, and gets ``image`` (an absolute PNG path) here.
        cache_dir: the folder to use instead of the default one.

    Returns:
        ``n`` rows, each with ``image`` (absolute path of a PNG), ``prompt``, ``completion``.
    """
    folder = (
        Path(cache_dir)
        if cache_dir is not None
        else (default_cache_root() / task / stable_hash(key))
    )
    rows = _read_manifest(folder, key, n)
    if len(rows) < n:
        folder.mkdir(parents=True, exist_ok=True)
        # Processes that share the cache (the experiment runner's parallel cells) render one
        # after the other: the second finds the first one's manifest.
        with _folder_lock(folder):
            rows = _read_manifest(folder, key, n)
            if len(rows) < n:
                _render_missing(folder, key, n, rows, make_example)
    return [{**row, "image": str(folder / row["image"])} for row in rows]


def generated_rows(
    task: str,
    n: int,
    make_example: Callable[[np.random.Generator], tuple[Image.Image, dict[str, Any]]],
    *,
    seed: int,
    split: str,
    test_fraction: float,
    params: dict[str, Any],
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """:func:`cached_rows` of an image task whose example k is ``make_example(rng)`` with
    ``rng = np.random.default_rng([seed, stream, k])``, ``stream`` 0 for "train", 2 for "dev"
    and 1 for "test" (train and test kept their streams when "dev" came), so example k depends
    only on (seed, split, k). The cache key is :func:`cache_key` of the same arguments."""
    key = cache_key(task, seed, split, test_fraction, params)
    stream = {"train": 0, "dev": 2}.get(split, 1)

    def make(k: int) -> tuple[Image.Image, dict[str, Any]]:
        return make_example(np.random.default_rng([seed, stream, k]))

    return cached_rows(task, key, n, make, cache_dir)


def _render_missing(
    folder: Path, key: dict[str, Any], n: int, rows: list[dict[str, Any]],
    make_example: Callable[[int], tuple[Image.Image, dict[str, Any]]],
) -> None:
    """Append rows ``len(rows) .. n-1`` to ``rows`` (example k depends only on (seed, split,
    k): the cached prefix is kept), each PNG written whole (a temporary file renamed into
    place, so a reader never opens a half-written image), then the manifest."""
    if not rows:  # stale, or made with other parameters: never pair it with the new key
        (folder / _MANIFEST).unlink(missing_ok=True)
    for k in range(len(rows), n):
        image, row = make_example(k)
        name = f"{k:06d}.png"
        with atomic_write(folder / name, binary=True) as f:
            image.save(f, format="PNG", compress_level=1)
        rows.append({"image": name, **row})
    _write_manifest(folder, key, rows)


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder/.lock`` (``flock``; ``msvcrt.locking`` on Windows), waited
    for: one process renders a cache while the others wait and then reuse it. The lock file is
    never opened through a link (:func:`emdlm._files.open_lock_file`)."""
    with open_lock_file(folder / _LOCK) as fh, exclusive_lock(fh, blocking=True):
        yield


def _write_manifest(folder: Path, key: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (relative image paths) and ``key`` after the PNGs, the manifest last and
    atomically, so a reader never sees a half-written set."""
    with atomic_write(folder / _KEY) as f:
        f.write(_key_text(key))
    with atomic_write(folder / _MANIFEST) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


#: Shapes :func:`draw_shape` draws.
SHAPE_NAMES = ("circle", "square", "triangle", "diamond")


def draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    box: tuple[float, float, float, float],
    fill: RGB,
    outline: RGB | None = None,
) -> None:
    """Draw a filled ``shape`` (one of :data:`SHAPE_NAMES`) touching the four sides of ``box``
    (x1, y1, x2, y2; inclusive)."""
    x1, y1, x2, y2 = box
    if shape == "circle":
        draw.ellipse([x1, y1, x2, y2], fill=fill, outline=outline)
    elif shape == "square":
        draw.rectangle([x1, y1, x2, y2], fill=fill, outline=outline)
    elif shape == "triangle":
        draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill, outline=outline)
    elif shape == "diamond":
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        draw.polygon([(mx, y1), (x2, my), (mx, y2), (x1, my)], fill=fill, outline=outline)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPE_NAMES}")
