"""Every image mode reaches the model as the right 8-bit RGB pixels (emdlm.datasets.images through
the VLM collator's ``open_image``), upright per EXIF; and the up-front image check decodes the
whole file, so truncated JPEGs and decompression bombs are one-line errors naming file:line on
every route (image JSONL reader, VLM loader, dataset readers), not tracebacks mid-run."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from emdlm.config import ConfigError, DataSourceConfig
from emdlm.datasets.image_rows import load_image_examples, read_image_jsonl
from emdlm.datasets.text_detection import read_icdar2015
from emdlm.vlm.collator import open_image

WHITE = 255


def _grey(values: list[int]) -> np.ndarray:
    """The expected [1, n, 3] RGB array of a row of grey levels."""
    return np.repeat(np.array([values], dtype=np.uint8)[..., None], 3, axis=-1)


def _palette(
    mode: str, indices: list[int], alpha: list[int] | None = None, key: int | None = None
) -> Image.Image:
    """A 1-row palette image (index 0 red, 1 green, 2 blue), with per-pixel alpha for "PA" or
    a transparent index ``key``."""
    pairs = zip(indices, alpha or [], strict=alpha is not None)
    raw = indices if alpha is None else [v for pair in pairs for v in pair]
    img = Image.frombytes(mode, (len(indices), 1), bytes(raw))
    img.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255])
    if key is not None:
        img.info["transparency"] = key
    return img


def _keyed(mode: str, pixels: list[Any], key: Any) -> Image.Image:
    """A 1-row image whose ``key`` colour is transparent (a PNG tRNS chunk)."""
    img = Image.new(mode, (len(pixels), 1))
    img.putdata(pixels)
    img.info["transparency"] = key
    return img


# name -> (image, file format, expected RGB): values chosen so a plain convert("RGB") differs.
CASES: dict[str, tuple[Callable[[], Image.Image], str, np.ndarray]] = {
    # 16-bit: value >> 8 (0, 256, 32768, 65535 -> 0, 1, 128, 255); convert() clipped to 255
    "I;16": (lambda: Image.fromarray(np.array([[0, 256, 32768, 65535]], dtype=np.uint16)),
             "PNG", _grey([0, 1, 128, 255])),
    "I;16B": (lambda: Image.frombytes(
        "I;16B", (4, 1), np.array([0, 256, 32768, 65535], dtype=">u2").tobytes()),
        "TIFF", _grey([0, 1, 128, 255])),
    # 32-bit int: clipped to 0..65535, then >> 8
    "I": (lambda: Image.fromarray(np.array([[-5, 0, 4096, 65535, 70000]], dtype=np.int32)),
          "TIFF", _grey([0, 0, 16, 255, 255])),
    # float: 0.0 black, 1.0 white, clipped, NaN black
    "F": (lambda: Image.fromarray(np.array([[-1.0, 0.0, 0.5, 1.0, 2.0, np.nan]],
                                           dtype=np.float32)),
          "TIFF", _grey([0, 0, 128, 255, 255, 0])),
    # alpha composited on white: (c * a + 255 * (255 - a)) / 255, rounded
    "RGBA": (lambda: Image.frombytes("RGBA", (3, 1), bytes([200, 100, 0, 255, 200, 100, 0, 0,
                                                            0, 0, 0, 128])),
             "PNG", np.array([[[200, 100, 0], [WHITE] * 3, [127, 127, 127]]], dtype=np.uint8)),
    "LA": (lambda: Image.frombytes("LA", (3, 1), bytes([10, 255, 10, 0, 100, 51])),
           "PNG", _grey([10, 255, 224])),
    "PA": (lambda: _palette("PA", [0, 2], [255, 0]), "TIFF",
           np.array([[[255, 0, 0], [WHITE] * 3]], dtype=np.uint8)),
    # transparency keys: the keyed index / grey level / colour is white
    "P+transparency": (lambda: _palette("P", [0, 1, 2], key=1), "PNG",
                       np.array([[[255, 0, 0], [WHITE] * 3, [0, 0, 255]]], dtype=np.uint8)),
    "L+transparency": (lambda: _keyed("L", [5, 9], 9), "PNG", _grey([5, 255])),
    "RGB+transparency": (lambda: _keyed("RGB", [(10, 20, 30), (1, 2, 3)], (1, 2, 3)), "PNG",
                         np.array([[[10, 20, 30], [WHITE] * 3]], dtype=np.uint8)),
}


def _save(img: Image.Image, path: Path, fmt: str) -> Path:
    extra = {"transparency": img.info["transparency"]} if "transparency" in img.info else {}
    img.save(path, format=fmt, **extra)
    return path


@pytest.mark.parametrize("via", ["image", "file"])
@pytest.mark.parametrize("name", list(CASES))
def test_mode_reaches_the_model_as_the_right_rgb(tmp_path: Path, name: str, via: str) -> None:
    build, fmt, expected = CASES[name]
    img = build()
    source: Any = img
    if via == "file":
        source = _save(img, tmp_path / f"x.{fmt.lower()}", fmt)
        with Image.open(source) as back:  # the file really holds the mode under test
            assert back.mode == img.mode or (name == "I;16B" and back.mode.startswith("I;16"))
    got = open_image(source)
    assert got.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_one_bit_and_cmyk_convert_through_the_one_helper() -> None:
    """Modes Pillow already converted right keep doing so in the shared helper."""
    from emdlm.datasets.images import to_rgb

    bits = Image.frombytes("1", (8, 1), bytes([0b10100000]))
    np.testing.assert_array_equal(np.asarray(to_rgb(bits)), _grey([255, 0, 255, 0, 0, 0, 0, 0]))
    cmyk = Image.frombytes("CMYK", (3, 1), bytes([0, 0, 0, 0, 0, 255, 255, 0, 0, 0, 0, 255]))
    np.testing.assert_array_equal(
        np.asarray(to_rgb(cmyk)), np.array([[[255, 255, 255], [255, 0, 0], [0, 0, 0]]])
    )


def _oriented_jpeg(path: Path, orientation: int) -> Path:
    """A 32 x 16 JPEG, left half red and right half blue, with an EXIF Orientation tag."""
    pixels = np.zeros((16, 32, 3), dtype=np.uint8)
    pixels[:, :16] = (255, 0, 0)
    pixels[:, 16:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif.tobytes())
    return path


def test_exif_orientation_6_jpeg_reaches_the_model_upright(tmp_path: Path) -> None:
    """Orientation 6 = "rotate 90 degrees clockwise to display": the stored left half (red) is
    the displayed top half."""
    got = np.asarray(open_image(_oriented_jpeg(tmp_path / "rot.jpg", 6))).astype(int)
    assert got.shape == (32, 16, 3)
    assert np.abs(got[4, 8] - (255, 0, 0)).max() < 40  # top: red
    assert np.abs(got[28, 8] - (0, 0, 255)).max() < 40  # bottom: blue


def test_readers_measure_the_upright_image(tmp_path: Path) -> None:
    """Box answers are normalised by the size of the image the model sees (16 x 32 upright,
    not the stored 32 x 16): the box (0, 0, 8, 16) is (0,0),(500,500) of the upright image."""
    images, gts = tmp_path / "images", tmp_path / "gt"
    images.mkdir()
    gts.mkdir()
    _oriented_jpeg(images / "img_1.jpg", 6)
    (gts / "gt_img_1.txt").write_text("0,0,8,0,8,16,0,16,word\n", encoding="utf-8")
    (row,) = read_icdar2015(images, gts)
    assert row["completion"] == "(0,0),(500,500)"


# ----------------------------------------------------------------------------- up-front check
def _truncated_jpeg(path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path, "JPEG")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header is intact, half the scan data gone
    return path


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height RGB pixels, with a few bytes of data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)
                     + chunk(b"IEND", b""))
    return path


def _jsonl(folder: Path, image: Path) -> Path:
    data = folder / "data.jsonl"
    ok = {"image": image.name, "prompt": "p", "completion": "c"}
    data.write_text(json.dumps(ok) + "\n")
    return data


def _route_jsonl_reader(folder: Path, image: Path) -> None:
    read_image_jsonl(_jsonl(folder, image))


def _route_vlm_loader(folder: Path, image: Path) -> None:
    load_image_examples(DataSourceConfig(path=str(_jsonl(folder, image))), seed=0)


def _route_icdar(folder: Path, image: Path) -> None:
    image.rename(folder / "img_1.png")
    gts = folder / "gt"
    gts.mkdir()
    (gts / "gt_img_1.txt").write_text("0,0,8,0,8,16,0,16,word\n", encoding="utf-8")
    read_icdar2015(folder, gts)


ROUTES = {"read_image_jsonl": (_route_jsonl_reader, r"data\.jsonl:1: "),
          "load_image_examples": (_route_vlm_loader, r"data\.jsonl:1: "),
          "read_icdar2015": (_route_icdar, r"gt_img_1\.txt:1: ")}


def _refused(route: str, folder: Path, image: Path) -> str:
    call, where = ROUTES[route]
    with pytest.raises(ConfigError, match=where) as err:
        call(folder, image)
    message = str(err.value)
    assert "\n" not in message  # one line
    return message


@pytest.mark.parametrize("route", list(ROUTES))
def test_truncated_jpeg_is_refused_up_front(tmp_path: Path, route: str) -> None:
    image = _truncated_jpeg(tmp_path / "cut.jpg")
    with Image.open(image) as img:  # what the old check relied on: the header reads fine
        img.verify()
    message = _refused(route, tmp_path, image)
    assert "truncated" in message


@pytest.mark.parametrize("side", [30000, 10000], ids=["bomb_error", "bomb_warning"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_decompression_bomb_header_is_refused_up_front(
    tmp_path: Path, route: str, side: int
) -> None:
    """30000 x 30000 is over twice Pillow's MAX_IMAGE_PIXELS (its error); 10000 x 10000 is in
    its warning band, refused too: nothing that large is decoded."""
    image = _png_header(tmp_path / "bomb.png", side, side)
    message = _refused(route, tmp_path, image)
    assert "decompression bomb" in message and f"{side * side}" in message


def test_unsupported_mode_is_refused_up_front(tmp_path: Path) -> None:
    """LAB, which Pillow converts to wrong colours, fails before training, not in the collator."""
    image = tmp_path / "lab.tif"
    Image.new("LAB", (4, 4), (50, 0, 0)).save(image, format="TIFF")
    message = _refused("load_image_examples", tmp_path, image)
    assert "mode LAB is not supported" in message
