"""Dataset readers refuse annotations that would become wrong answers (NaN, infinite or
negative-size boxes), files that are not UTF-8 and non-string RefCOCO fields, each with one line
naming the file and line (or annotation / entry); and ``images_root`` / ``data.images_root``
confines the image paths a data file names (``../``, absolute, symlinks), through the readers,
the VLM loader and ``emdlm train``."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, DataSourceConfig
from emdlm.datasets.grounding import read_refcoco
from emdlm.datasets.image_rows import load_image_examples, read_image_jsonl
from emdlm.datasets.text_detection import read_icdar2015, read_td500


def _png(path: Path, size: tuple[int, int] = (100, 50)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (120, 30, 200)).save(path)
    return path


def _one_line(err: pytest.ExceptionInfo[ConfigError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- fixtures
def _icdar(tmp_path: Path, gt_bytes: bytes) -> tuple[Path, Path]:
    images, gts = tmp_path / "images", tmp_path / "gt"
    _png(images / "img_1.png")
    gts.mkdir()
    (gts / "gt_img_1.txt").write_bytes(gt_bytes)
    return images, gts


def _td500(tmp_path: Path, gt_text: str) -> Path:
    folder = tmp_path / "td500"
    _png(folder / "IMG_0001.png", (200, 100))
    (folder / "IMG_0001.gt").write_text(gt_text, encoding="utf-8")
    return folder


def _refcoco(
    tmp_path: Path, *, bbox: Any = (20, 10, 50, 40), sent: Any = "man on the left",
    file_name: Any = "COCO_1.png", nan_json: bool = False,
) -> tuple[Path, Path, Path]:
    images = tmp_path / "train2014"
    _png(images / "COCO_1.png", (200, 100))
    instances = {
        "images": [{"id": 1, "file_name": file_name, "width": 200, "height": 100}],
        "annotations": [{"id": 10, "image_id": 1, "bbox": list(bbox), "category_id": 1}],
    }
    refs = [{"ref_id": 0, "ann_id": 10, "image_id": 1, "split": "val",
             "sentences": [{"sent": "fine", "sent_id": 0}, {"sent": sent, "sent_id": 1}]}]
    refs_path = tmp_path / "refs(unc).p"
    refs_path.write_bytes(pickle.dumps(refs, protocol=2))
    inst_path = tmp_path / "instances.json"
    inst_path.write_text(json.dumps(instances, allow_nan=nan_json))
    return refs_path, inst_path, images


# ----------------------------------------------------------------------------- 7: boxes
@pytest.mark.parametrize(
    ("line", "problem"),
    [("nan,1,5,1,5,5,1,5,word", "nan"), ("1,1,inf,1,5,5,1,5,word", "inf"),
     ("1,1,5,1,5,5,1,-inf,word", "-inf")],
    ids=["nan", "inf", "minus_inf"],
)
def test_icdar_non_finite_coordinate_names_file_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    images, gts = _icdar(tmp_path, f"\ufeff1,1,5,1,5,5,1,5,ok\n{line}\n".encode())
    with pytest.raises(ConfigError) as err:
        read_icdar2015(images, gts)
    message = _one_line(err)
    assert "gt_img_1.txt:2: coordinates must be finite numbers" in message and problem in message


@pytest.mark.parametrize(
    ("line", "match"),
    [("0 0 10 20 40 10 nan", "finite"), ("0 0 10 20 40 10 inf", "finite"),
     ("0 0 nan 20 40 10 0", "finite"), ("0 0 10 20 -40 10 0", "w=-40"),
     ("0 0 10 20 40 -10 0", "h=-10")],
    ids=["nan_angle", "inf_angle", "nan_x", "negative_width", "negative_height"],
)
def test_td500_non_finite_or_negative_size_names_file_line(
    tmp_path: Path, line: str, match: str
) -> None:
    folder = _td500(tmp_path, f"0 0 10 20 40 10 0\n{line}\n")
    with pytest.raises(ConfigError) as err:
        read_td500(folder)
    message = _one_line(err)
    assert "IMG_0001.gt:2: " in message and match in message


@pytest.mark.parametrize(
    "bbox",
    [(50, 50, -30, -30), (50, 50, 30, -1), (math.nan, 0, 10, 10), (0, 0, math.inf, 10)],
    ids=["negative_size", "negative_height", "nan", "inf"],
)
def test_refcoco_bad_bbox_names_instances_file_and_ann_id(tmp_path: Path, bbox: Any) -> None:
    refs, inst, images = _refcoco(tmp_path, bbox=bbox, nan_json=True)
    with pytest.raises(ConfigError) as err:
        read_refcoco(refs, inst, images)
    message = _one_line(err)
    assert message.startswith(f"{inst}: annotation id 10: bbox must be [x, y, w, h]")


def test_refcoco_zero_size_box_is_legal(tmp_path: Path) -> None:
    """A degenerate (w = h = 0) box is legal and kept; only negative sizes are refused."""
    refs, inst, images = _refcoco(tmp_path, bbox=(20, 10, 0, 0))
    rows = read_refcoco(refs, inst, images)
    assert rows[0]["boxes"] == [[20.0, 10.0, 20.0, 10.0]]
    refs, inst, images = _refcoco(tmp_path / "bad", bbox=(20, 10, 0, -0.5))
    with pytest.raises(ConfigError, match="annotation id 10"):
        read_refcoco(refs, inst, images)


# ----------------------------------------------------------------------------- 9: encodings, types
@pytest.mark.parametrize(
    ("data", "line", "looks_like"),
    [("1,1,5,1,5,5,1,5,ok\n1,1,5,1,5,5,1,5,café\n".encode("latin-1"), 2, "Latin-1"),
     ("\ufeff1,1,5,1,5,5,1,5,ok\n".encode("utf-16"), 1, "UTF-16 byte-order mark"),
     ("1,1,5,1,5,5,1,5,ok\n".encode("utf-16-le"), 1, "UTF-16 without a byte-order mark")],
    ids=["latin1", "utf16_bom", "utf16_no_bom"],
)
def test_icdar_file_not_utf8_names_file_line_and_encoding(
    tmp_path: Path, data: bytes, line: int, looks_like: str
) -> None:
    images, gts = _icdar(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        read_icdar2015(images, gts)
    message = _one_line(err)
    assert f"gt_img_1.txt:{line}: not UTF-8" in message and looks_like in message


def test_td500_and_image_jsonl_not_utf8_name_file_line(tmp_path: Path) -> None:
    folder = _td500(tmp_path, "")
    (folder / "IMG_0001.gt").write_bytes("0 0 10 20 40 10 0\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"IMG_0001\.gt:1: not UTF-8"):
        read_td500(folder)
    _png(tmp_path / "a.png")
    data = tmp_path / "data.jsonl"
    row = {"image": "a.png", "prompt": "p", "completion": "c"}
    data.write_bytes(
        (json.dumps(row) + "\n" + json.dumps({**row, "prompt": "é"}, ensure_ascii=False))
        .encode("latin-1")
    )
    with pytest.raises(ConfigError, match=r"data\.jsonl:2: not UTF-8 \(byte 0xe9\)"):
        read_image_jsonl(data)


def test_refcoco_non_string_sentence_names_file_and_field(tmp_path: Path) -> None:
    refs, inst, images = _refcoco(tmp_path, sent=5)
    with pytest.raises(ConfigError) as err:
        read_refcoco(refs, inst, images)
    assert _one_line(err) == f"{refs}[0]: sentences[1].sent must be a string, got int 5"


def test_refcoco_non_string_file_name_names_file_and_image(tmp_path: Path) -> None:
    refs, inst, images = _refcoco(tmp_path, file_name=7)
    with pytest.raises(ConfigError) as err:
        read_refcoco(refs, inst, images)
    assert _one_line(err) == f"{inst}: image id 1: file_name must be a non-empty string, got 7"


# ----------------------------------------------------------------------------- images_root
def _escapes(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A data folder (the root) and image paths that leave it in each way, plus one inside."""
    root = tmp_path / "data"
    _png(root / "in.png")
    outside = _png(tmp_path / "secret.png")
    (root / "link.png").symlink_to(outside)
    return root, {"dotdot": "../secret.png", "absolute": str(outside), "symlink": "link.png"}


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_image_jsonl_images_root_refuses_paths_outside(tmp_path: Path, escape: str) -> None:
    root, paths = _escapes(tmp_path)
    data = root / "data.jsonl"
    rows = [{"image": "in.png", "prompt": "p", "completion": "c"},
            {"image": paths[escape], "prompt": "p", "completion": "c"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_image_jsonl(data)) == 2  # the default keeps documented paths working
    for check_images in (True, False):
        with pytest.raises(ConfigError) as err:
            read_image_jsonl(data, images_root=root, check_images=check_images)
        message = _one_line(err)
        assert message.startswith(f"{data}:2: image {paths[escape]!r} resolves to ")
        assert f"outside images_root {root.resolve()}" in message
    inside = data.with_name("inside.jsonl")
    inside.write_text(json.dumps(rows[0]) + "\n")
    assert len(read_image_jsonl(inside, images_root=root)) == 1


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_vlm_loader_images_root_refuses_paths_outside(tmp_path: Path, escape: str) -> None:
    root, paths = _escapes(tmp_path)
    data = root / "d.jsonl"
    data.write_text(json.dumps({"image": "in.png", "prompt": "p", "completion": "c"}) + "\n"
                    + json.dumps({"image": paths[escape], "prompt": "p", "completion": "c"}))
    src = DataSourceConfig(path=str(data))
    assert len(load_image_examples(src, seed=0)) == 2
    with pytest.raises(ConfigError) as err:
        load_image_examples(src, seed=0, images_root=str(root))
    message = _one_line(err)
    assert message.startswith(f"{data}:2: image {paths[escape]!r} resolves to ")
    assert "data.images_root" in message


def test_refcoco_images_root_refuses_file_name_outside(tmp_path: Path) -> None:
    refs, inst, images = _refcoco(tmp_path, file_name="../secret.png")
    _png(tmp_path / "secret.png")
    assert len(read_refcoco(refs, inst, images)) == 2
    with pytest.raises(ConfigError) as err:
        read_refcoco(refs, inst, images, images_root=images)
    assert _one_line(err).startswith(f"{refs}[0]: image ")
    assert "outside images_root" in str(err.value)


def test_cli_train_with_images_root_refuses_before_writing(tmp_path: Path) -> None:
    root, paths = _escapes(tmp_path)
    data = root / "train.jsonl"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(root / "in.png")
    rows = [{"image": "in.png", "prompt": "t?", "completion": "1_00"},
            {"image": paths["dotdot"], "prompt": "t?", "completion": "2_00"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
        "train.max_steps=1", "train.batch_size=2", "train.progress_bar=false",
        "train.tensorboard=false", f"output_dir={out}", f"data.images_root={root}",
    ])
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert text.count("\n") == 0, text
    assert text.startswith(f"error: {data}:2: image '../secret.png' resolves to ")
    assert "outside images_root" in text
    assert not out.exists()
