"""Images as the model sees them: one RGB conversion and one up-front check for every loader.

Every route that feeds images to a model (the VLM collator, image JSONL rows, the dataset
readers, contact sheets) goes through :func:`to_rgb` / :func:`open_rgb`, so the pixels the model
trains on do not depend on how a row was loaded. Every route that checks images before training
goes through :func:`check_image_file`, which decodes the whole file: Pillow's ``verify()`` and
``Image.open`` read headers only, so a truncated JPEG would pass them and fail mid-run.

How each mode becomes 8-bit RGB (:func:`to_rgb`):

* EXIF orientation is applied first (``ImageOps.exif_transpose``): a photo tagged "rotate 90"
  reaches the model upright, and sizes (:func:`displayed_size`) are those of the upright image.
* 16-bit greyscale (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``) and 32-bit integer ``I`` (what
  Pillow opens 16-bit PGM / TIFF data as): the value range 0..65535 is scaled to 0..255 by
  ``value >> 8`` (``I`` is clipped to 0..65535 first). A plain ``convert("RGB")`` clips instead,
  so every value above 255 became white.
* ``F`` (32-bit float): 0.0 is black and 1.0 white, the convention of float image files
  (32-bit TIFF from GIMP or Photoshop); values outside [0, 1] are clipped, NaN is black.
* Alpha (``RGBA``, ``RGBa``, ``LA``, ``PA``) and transparency keys (palette ``P``, ``L`` or
  ``RGB`` with ``info["transparency"]``) are composited on :data:`BACKGROUND` (white, what image
  viewers and browsers show): a transparent pixel is white, not the black or arbitrary colour
  stored under it. ``out = (c * a + 255 * (255 - a)) / 255``, rounded.
* ``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ``HSV``, ``RGBX``: Pillow's own conversion (CMYK by
  the naive formula ``R = (255 - C)(255 - K) / 255``; no ICC colour management).

Modes outside :data:`SUPPORTED_MODES` (e.g. ``LAB``, which Pillow converts to wrong colours) are
refused by :func:`check_image_file` before training.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

PathLike = str | os.PathLike[str]
#: the colour transparent pixels are composited on (see the module docstring)
BACKGROUND = (255, 255, 255)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
ALPHA_MODES = ("RGBA", "RGBa", "LA", "PA")
SUPPORTED_MODES = (
    "1", "L", "P", "RGB", "RGBX", "CMYK", "YCbCr", "HSV", "I", "F",
    *SIXTEEN_BIT_MODES, *ALPHA_MODES,
)
#: the widest aspect ratio (long side / short side) accepted: Qwen2-VL's image processor refuses
#: more (``smart_resize``, transformers/models/qwen2_vl/image_processing_qwen2_vl.py), and
#: LLaVA's, which scales the short side to 336 pixels, would make a 5000x1 image 1.7 million
#: pixels wide before its crop
MAX_ASPECT_RATIO = 200
_ORIENTATION_TAG = 0x0112  # EXIF Orientation; 5..8 swap width and height
_TRANSPOSED = (5, 6, 7, 8)


class ImageCheckError(ValueError):
    """Why an image cannot be used (callers add the file:line where it was named)."""


# ----------------------------------------------------------------------------- conversion
def to_rgb(image: Any) -> Any:
    """A new 8-bit RGB PIL image of ``image`` (any :data:`SUPPORTED_MODES` mode), upright per
    its EXIF orientation; see the module docstring for how each mode converts and why.

    Raises:
        ImageCheckError: for a mode outside :data:`SUPPORTED_MODES`.
    """
    from PIL import ImageOps

    upright = ImageOps.exif_transpose(image)  # a copy, rotated when EXIF says so
    mode = upright.mode
    if mode not in SUPPORTED_MODES:
        raise ImageCheckError(_mode_problem(mode))
    if mode in SIXTEEN_BIT_MODES or mode == "I":
        return _grey_rgb(_sixteen_to_eight(np.asarray(upright)))
    if mode == "F":
        return _grey_rgb(_float_to_eight(np.asarray(upright)))
    if mode in ALPHA_MODES or "transparency" in upright.info:
        return _composite(upright.convert("RGBA"))
    return upright.convert("RGB")


def open_rgb(image: Any) -> Any:
    """:func:`to_rgb` of a PIL image (e.g. a ``datasets`` Image column) or an image file."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return to_rgb(image)
    with Image.open(Path(image)) as img:
        return to_rgb(img)


def _sixteen_to_eight(values: np.ndarray) -> np.ndarray:
    """0..65535 samples (any integer dtype or byte order) -> 0..255 by ``>> 8``."""
    wide = np.clip(values.astype(np.int64), 0, 65535)
    return (wide >> 8).astype(np.uint8)


def _float_to_eight(values: np.ndarray) -> np.ndarray:
    """Float samples, 0.0 black and 1.0 white, clipped; NaN -> 0."""
    unit = np.clip(np.nan_to_num(values.astype(np.float64), nan=0.0), 0.0, 1.0)
    return np.rint(unit * 255.0).astype(np.uint8)


def _grey_rgb(grey: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1), mode="RGB")


def _composite(rgba: Any) -> Any:
    """An RGBA image over :data:`BACKGROUND`, rounded to the nearest 8-bit value."""
    from PIL import Image

    pixels = np.asarray(rgba).astype(np.int32)
    colour, alpha = pixels[..., :3], pixels[..., 3:]
    background = np.array(BACKGROUND, dtype=np.int32)
    out = (colour * alpha + background * (255 - alpha) + 127) // 255
    return Image.fromarray(out.astype(np.uint8), mode="RGB")


def _mode_problem(mode: str) -> str:
    return f"image mode {mode} is not supported (supported: {', '.join(SUPPORTED_MODES)})"


# ----------------------------------------------------------------------------- checks
def displayed_size(image: Any) -> tuple[int, int]:
    """(width, height) of ``image`` once its EXIF orientation is applied (as :func:`to_rgb`
    returns it), from the header where the format keeps EXIF there."""
    width, height = image.size
    orientation = image.getexif().get(_ORIENTATION_TAG, 1)
    return (height, width) if orientation in _TRANSPOSED else (width, height)


def check_image_shape(width: int, height: int) -> None:
    """ImageCheckError (one line) for an image whose long side is more than
    :data:`MAX_ASPECT_RATIO` times its short side."""
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageCheckError(
            f"the image is {width}x{height} pixels, an aspect ratio of "
            f"{max(width, height) / max(1, min(width, height)):.0f}:1; image processors take "
            f"at most {MAX_ASPECT_RATIO}:1 (Qwen2-VL's refuses more): crop or pad it"
        )


def check_image_file(path: Path) -> tuple[int, int]:
    """Decode the image file at ``path`` fully, convert it as the model will get it
    (:func:`to_rgb`) and return its upright (width, height).

    Raises:
        ImageCheckError: (one line) the file is not an image Pillow reads, is truncated or
            corrupt anywhere in its data (or its EXIF), has an unsupported mode, an aspect
            ratio over :data:`MAX_ASPECT_RATIO` (:func:`check_image_shape`), or declares
            more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (a possible decompression bomb:
            Pillow's warning band counts too, so nothing that large is decoded).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()  # decode every byte: verify() and open() stop at the header
                size: tuple[int, int] = to_rgb(img).size  # what the collator does cannot fail
        check_image_shape(*size)  # nor what the image processor does
        return size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageCheckError(f"refused as a possible decompression bomb: {err}") from err
    except ImageCheckError:
        raise
    except Exception as err:  # an untrusted file fails in many ways (OSError, struct, ...)
        raise ImageCheckError(_one_line(err)) from err


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


# ----------------------------------------------------------------------------- confinement
def confine(path: Path, images_root: PathLike | None, named: str | None = None) -> Path:
    """``path`` unchanged, or ImageCheckError if ``images_root`` is set and ``path`` (with
    symlinks and ``..`` resolved) lies outside it; the message quotes ``named`` (the path as
    the data file wrote it), else ``path``. Without ``images_root`` any path is kept: data
    files may name absolute or ``../`` images (documented), so confining is opt-in."""
    if images_root is None:
        return path
    root = Path(images_root).expanduser().resolve()
    if not root.is_dir():
        raise ImageCheckError(f"images_root {root} is not a folder")
    target = path.resolve()
    if not target.is_relative_to(root):
        shown = str(path) if named is None else named
        raise ImageCheckError(f"image {shown!r} resolves to {target}, outside images_root {root}")
    return path
