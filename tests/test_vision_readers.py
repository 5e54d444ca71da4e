"""Readers of the public datasets' own formats on tiny fixtures written here: RefCOCO (refs
pickle + COCO instances + images, restricted unpickler), ICDAR2015, MSRA-TD500, clock folders and
image JSONL files; bad rows are ConfigErrors naming the file and line."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
from PIL import Image

from emdlm.config import ConfigError
from emdlm.datasets.clock import clock_time_from_name, read_clock_folder
from emdlm.datasets.grounding import read_refcoco
from emdlm.datasets.image_rows import read_image_jsonl
from emdlm.datasets.safe_pickle import safe_load_pickle
from emdlm.datasets.text_detection import read_icdar2015, read_td500


def png(path: Path, size: tuple[int, int] = (20, 10), fmt: str = "PNG") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (120, 30, 200)).save(path, format=fmt)
    return path


# ----------------------------------------------------------------------------- RefCOCO
def refcoco_fixture(tmp_path: Path) -> tuple[Path, Path, Path]:
    images = tmp_path / "train2014"
    png(images / "COCO_train2014_000000000001.jpg", (200, 100), "JPEG")
    png(images / "COCO_train2014_000000000002.jpg", (50, 50), "JPEG")
    instances = {
        "images": [
            {"id": 1, "file_name": "COCO_train2014_000000000001.jpg", "width": 200, "height": 100},
            {"id": 2, "file_name": "COCO_train2014_000000000002.jpg", "width": 50, "height": 50},
        ],
        "annotations": [
            {"id": 10, "image_id": 1, "bbox": [20, 10, 50, 40], "category_id": 1},
            {"id": 11, "image_id": 2, "bbox": [0, 0, 25, 50], "category_id": 1},
        ],
        "categories": [{"id": 1, "name": "person"}],
    }
    refs = [
        {
            "ref_id": 0,
            "ann_id": 10,
            "image_id": 1,
            "split": "val",
            "category_id": 1,
            "file_name": "COCO_train2014_000000000001_10.jpg",
            "sentences": [
                {"sent": "man on the left", "raw": "Man on the left", "sent_id": 0},
                {"sent": "guy in red", "raw": "guy in red", "sent_id": 1},
            ],
        },
        {
            "ref_id": 1,
            "ann_id": 11,
            "image_id": 2,
            "split": "train",
            "category_id": 1,
            "sentences": [{"sent": "left half", "raw": "left half", "sent_id": 2}],
        },
    ]
    refs_path = tmp_path / "refs(unc).p"
    refs_path.write_bytes(pickle.dumps(refs, protocol=2))
    inst_path = tmp_path / "instances.json"
    inst_path.write_text(json.dumps(instances))
    return refs_path, inst_path, images


def test_refcoco_rows(tmp_path: Path) -> None:
    refs, inst, images = refcoco_fixture(tmp_path)
    rows = read_refcoco(refs, inst, images, split="val")
    assert [r["expression"] for r in rows] == ["man on the left", "guy in red"]
    # bbox [x, y, w, h] = [20, 10, 50, 40] in a 200 x 100 image -> (20, 10, 70, 50).
    assert rows[0]["boxes"] == [[20.0, 10.0, 70.0, 50.0]]
    assert rows[0]["completion"] == "(100,100),(350,500)"
    assert "man on the left" in rows[0]["prompt"]
    assert Path(rows[0]["image"]).is_file() and Path(rows[0]["image"]).is_absolute()
    llava = read_refcoco(refs, inst, images, split=None, box_format="llava")
    assert [r["completion"] for r in llava] == [
        "[0.100, 0.100, 0.350, 0.500]",
        "[0.100, 0.100, 0.350, 0.500]",
        "[0.000, 0.000, 0.500, 1.000]",
    ]
    assert [r["split"] for r in llava] == ["val", "val", "train"]


def test_refcoco_missing_image_names_the_entry(tmp_path: Path) -> None:
    refs, inst, images = refcoco_fixture(tmp_path)
    (images / "COCO_train2014_000000000002.jpg").unlink()
    with pytest.raises(ConfigError, match=r"refs\(unc\)\.p\[1\]: image not found"):
        read_refcoco(refs, inst, images, split=None)
    (images / "COCO_train2014_000000000001.jpg").write_bytes(b"not an image")
    with pytest.raises(ConfigError, match=r"\[0\]: unreadable image"):
        read_refcoco(refs, inst, images, split="val")


class _Evil:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "refs(unc).p"
    bad.write_bytes(pickle.dumps([{"ref_id": 0}, _Evil(marker)], protocol=2))
    with pytest.raises(ConfigError, match=r"global (posix|os|nt)\.system is not allowed"):
        safe_load_pickle(bad)
    assert not marker.exists()  # nothing ran
    _, inst, images = refcoco_fixture(tmp_path / "ok")
    with pytest.raises(ConfigError, match="refused"):
        read_refcoco(bad, inst, images)
    assert not marker.exists()
    # Builtin containers and scalars (a set needs a global in protocol 2) load fine.
    good = tmp_path / "good.p"
    data = [{"a": (1, 2.5, "x", None, True, 10**30)}, {1, 2}, frozenset({3})]
    good.write_bytes(pickle.dumps(data, protocol=2))
    assert safe_load_pickle(good) == data
    good.write_bytes(pickle.dumps([b"bytes", bytearray(b"ba")], protocol=5))
    assert safe_load_pickle(good) == [b"bytes", bytearray(b"ba")]
    corrupt = tmp_path / "corrupt.p"
    corrupt.write_bytes(b"\x80\x02]q\x00")
    with pytest.raises(ConfigError, match=r"corrupt\.p"):
        safe_load_pickle(corrupt)


# ----------------------------------------------------------------------------- ICDAR2015
def test_icdar2015_quads_bom_and_dont_care(tmp_path: Path) -> None:
    images, gts = tmp_path / "images", tmp_path / "gt"
    png(images / "img_1.jpg", (100, 50), "JPEG")
    png(images / "img_2.jpg", (100, 50), "JPEG")
    gts.mkdir()
    (gts / "gt_img_1.txt").write_text(
        "\ufeff60,10,90,12,89,20,59,18,EXIT\n"
        "10,30,40,30,40,45,10,45,Hello, world\n"
        "1,1,5,1,5,5,1,5,###\n",
        encoding="utf-8",
    )
    (gts / "gt_img_2.txt").write_text("\ufeff1,1,5,1,5,5,1,5,###\n", encoding="utf-8")
    rows = read_icdar2015(images, gts)
    assert len(rows) == 2
    first = rows[0]
    # Reading order: EXIT (top line) first, then "Hello, world"; the ### box is left out.
    assert first["words"] == ["EXIT", "Hello, world"]
    assert first["boxes"] == [[59, 10, 90, 20], [10, 30, 40, 45]]
    assert first["completion"] == "(590,200),(900,400); (100,600),(400,900)"
    assert rows[1]["completion"] == "none" and rows[1]["boxes"] == []
    kept = read_icdar2015(images, gts, include_dont_care=True, box_format="llava")
    assert kept[0]["words"] == ["###", "EXIT", "Hello, world"]
    assert kept[1]["completion"] == "[0.010, 0.020, 0.050, 0.100]"


def test_icdar2015_bad_rows(tmp_path: Path) -> None:
    images, gts = tmp_path / "images", tmp_path / "gt"
    png(images / "img_1.jpg", (100, 50), "JPEG")
    gts.mkdir()
    (gts / "gt_img_1.txt").write_text("1,1,5,1,5,5,1,5,ok\n1,2,3,oops\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"gt_img_1\.txt:2: expected"):
        read_icdar2015(images, gts)
    (gts / "gt_img_1.txt").write_text("1,1,5,1,5,5,1,5,ok\n", encoding="utf-8")
    (gts / "gt_img_7.txt").write_text("1,1,5,1,5,5,1,5,ok\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"gt_img_7\.txt:1: image not found"):
        read_icdar2015(images, gts)
    with pytest.raises(ConfigError, match="no files"):
        read_icdar2015(images, tmp_path / "empty")


# ----------------------------------------------------------------------------- TD500
def test_td500_rotated_rectangles(tmp_path: Path) -> None:
    folder = tmp_path / "test"
    png(folder / "IMG_0001.JPG", (200, 100), "JPEG")
    (folder / "IMG_0001.gt").write_text(
        "0 0 10 20 40 10 0\n"  # axis-aligned: (10, 20, 50, 30)
        f"1 0 100 40 40 20 {math.pi / 2}\n"  # quarter turn: centre (120, 50), half (10, 20)
        "2 1 0 0 10 10 0\n",  # difficult: left out
        encoding="utf-8",
    )
    (rows,) = read_td500(folder)
    assert [b for box in rows["boxes"] for b in box] == pytest.approx(
        [10, 20, 50, 30, 110, 30, 130, 70]
    )
    assert rows["completion"] == "(50,200),(250,300); (550,300),(650,700)"
    (with_difficult,) = read_td500(folder, include_difficult=True)
    assert len(with_difficult["boxes"]) == 3
    (folder / "IMG_0001.gt").write_text("0 0 10 20 40 10\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"IMG_0001\.gt:1: expected 'index difficult"):
        read_td500(folder)


# ----------------------------------------------------------------------------- clocks
def test_clock_time_from_name() -> None:
    assert clock_time_from_name("2_55") == "2_55"
    assert clock_time_from_name("02-55") == "2_55"
    assert clock_time_from_name("2_55_003") == "2_55"
    assert clock_time_from_name("0_07") == "12_07"
    assert clock_time_from_name("12.30") == "12_30"
    assert clock_time_from_name("13_00") is None
    assert clock_time_from_name("2_61") is None
    assert clock_time_from_name("2_555") is None
    assert clock_time_from_name("img_2_55") is None


def test_clock_folder(tmp_path: Path) -> None:
    png(tmp_path / "2_55.png")
    png(tmp_path / "12-05_003.jpg", fmt="JPEG")
    png(tmp_path / "10_10" / "photo.png")
    png(tmp_path / "03-20" / "sub" / "x.png")
    (tmp_path / "notes.txt").write_text("not an image")
    rows = read_clock_folder(tmp_path)
    got = {Path(r["image"]).relative_to(tmp_path).as_posix(): r["completion"] for r in rows}
    assert got == {
        "2_55.png": "2_55",
        "12-05_003.jpg": "12_05",
        "10_10/photo.png": "10_10",
        "03-20/sub/x.png": "3_20",
    }
    assert all(r["time"] == r["completion"] and "H_MM" in r["prompt"] for r in rows)
    png(tmp_path / "misc" / "clock.png")
    with pytest.raises(ConfigError, match=r"clock\.png: no time"):
        read_clock_folder(tmp_path)
    (tmp_path / "misc" / "clock.png").unlink()
    (tmp_path / "4_44.png").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"4_44\.png.*unreadable image"):
        read_clock_folder(tmp_path)


# ----------------------------------------------------------------------------- JSONL
def test_image_jsonl_relative_paths_and_errors(tmp_path: Path) -> None:
    png(tmp_path / "imgs" / "a.png")
    data = tmp_path / "data.jsonl"
    rows = [
        {"image": "imgs/a.png", "prompt": "What time?", "completion": "2_55", "time": "2_55"},
        {"image": str(tmp_path / "imgs" / "a.png"), "prompt": "p", "completion": "c"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_image_jsonl(data)
    assert [r["image"] for r in got] == [str(tmp_path / "imgs" / "a.png")] * 2
    assert got[0]["time"] == "2_55"
    data.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "image": "nope.png"}))
    with pytest.raises(ConfigError, match=r"data\.jsonl:2: image not found"):
        read_image_jsonl(data)
    assert len(read_image_jsonl(data, check_images=False)) == 2
    data.write_text(json.dumps({"image": "imgs/a.png", "prompt": "p"}))
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: missing .*completion"):
        read_image_jsonl(data)
