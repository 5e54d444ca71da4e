"""The benchmark readers, on tiny fixtures written in each public format: MathVista (JSON dict
and list, a saved ``datasets`` folder), MathVision (JSONL, a saved ``datasets`` folder),
CTW1500 (the 32-value and the polygon ``.txt``, the XML) and Total-Text (the ``.txt`` records
and the ``.mat``), and ``images_root`` refusing images outside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from emdlm.config import ConfigError
from emdlm.datasets.curved_text import read_ctw1500, read_totaltext
from emdlm.datasets.visual_math import read_mathvision, read_mathvista
from emdlm.math_answers import NO_NUMBERS
from emdlm.metrics import compute_task_metrics
from emdlm.number_scope import row_scopes


def _png(path: Path, size: tuple[int, int] = (100, 50), color: str = "white") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


# ------------------------------------------------------------------------------ MathVista
MATHVISTA = {
    "1": {"pid": "1", "question": "Which is larger?", "image": "images/1.png",
          "choices": ["3", "4.5"], "answer": "4.5", "answer_type": "float", "precision": 1.0,
          "question_type": "multi_choice", "unit": None, "query": "Hint: pick.\nWhich?"},
    "2": {"pid": "2", "question": "How many bars?", "image": "images/2.png", "choices": None,
          "answer": "12", "answer_type": "integer", "precision": None,
          "question_type": "free_form", "unit": None},
    "3": {"pid": "3", "question": "How long is the side?", "image": "images/3.png",
          "choices": None, "answer": "1.5", "answer_type": "float", "precision": 2.0,
          "question_type": "free_form", "unit": "cm"},
    "4": {"pid": "4", "question": "What colour is the bar?", "image": "images/1.png",
          "choices": None, "answer": "Blue", "answer_type": "text", "precision": None,
          "question_type": "free_form", "unit": ""},
}


def _mathvista_dir(tmp_path: Path) -> Path:
    root = tmp_path / "mathvista"
    for name in ("1", "2", "3"):
        _png(root / "images" / f"{name}.png")
    return root


def test_mathvista_json_dict(tmp_path: Path) -> None:
    root = _mathvista_dir(tmp_path)
    (root / "testmini.json").write_text(json.dumps(MATHVISTA), encoding="utf-8")
    rows = read_mathvista(root / "testmini.json")
    assert [r["pid"] for r in rows] == ["1", "2", "3", "4"]
    mc, integer, floating, text = rows
    assert mc["prompt"] == "Which is larger?\n(A) 3 (B) 4.5"
    assert mc["completion"] == "B" and mc["answer"] == "4.5"
    assert (mc["question_type"], mc["answer_type"], mc["choices"], mc["precision"]) == (
        "multi_choice", "float", ["3", "4.5"], 1)
    assert mc["number_scope"] == NO_NUMBERS and mc["source"] == "mathvista"
    assert mc["image"] == str((root / "images" / "1.png").resolve())
    assert (integer["prompt"], integer["completion"], integer["number_scope"]) == (
        "How many bars?", "12", "all")
    assert (floating["completion"], floating["unit"], floating["precision"]) == ("1.50", "cm", 2)
    assert (text["completion"], text["unit"], text["number_scope"]) == ("Blue", None, NO_NUMBERS)
    # every row's scope is one emdlm.data reads; option letters are out of it
    scopes = row_scopes(rows, "all", None, "test")
    assert scopes is not None and scopes[0].search("B") is None and scopes[1] is None
    # the rows carry what the math kind needs: gold answers score perfectly, a wrong one not
    refs = [r["completion"] for r in rows]
    assert compute_task_metrics(refs, refs, "math", rows=rows)["exact_match"] == 1.0
    out = compute_task_metrics(["4.5", "12.0", "1.5 cm", "red"], refs, "math", rows=rows)
    assert out["exact_match"] == 0.75
    assert (out["exact_match_float"], out["exact_match_text"]) == (1.0, 0.0)


def test_mathvista_json_list_and_query_prompt(tmp_path: Path) -> None:
    root = _mathvista_dir(tmp_path)
    data = tmp_path / "annotations" / "testmini.json"
    data.parent.mkdir()
    data.write_text(json.dumps(list(MATHVISTA.values())[:1]), encoding="utf-8")
    rows = read_mathvista(data, root, prompt="query")
    assert rows[0]["prompt"] == "Hint: pick.\nWhich?"
    data.write_text(json.dumps(list(MATHVISTA.values())[:2]), encoding="utf-8")
    assert [r["pid"] for r in read_mathvista(data, root)] == ["1", "2"]
    with pytest.raises(ConfigError, match=r"testmini.json: entry 1: field 'query'"):
        read_mathvista(data, root, prompt="query")  # item 2 has no query
    with pytest.raises(ValueError, match="prompt must be one of"):
        read_mathvista(data, root, prompt="hint")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"answer": "5"}, r"entry '1': answer '5' is not one of the choices"),
        ({"question_type": "essay"}, r"entry '1': question_type must be one of"),
        ({"choices": None}, r"entry '1': a multi_choice item needs its choices"),
        ({"precision": 1.5}, r"entry '1': precision must be"),
        ({"question": ""}, r"entry '1': field 'question' must be non-empty text"),
        ({"answer": ""}, r"entry '1': no answer .*use testmini"),
        ({"image": "images/9.png"}, r"entry '1': image not found"),
        ({"image": None}, r"entry '1': field 'image' must be a path"),
    ],
)
def test_mathvista_bad_entries_name_the_entry(tmp_path: Path, change: dict, match: str) -> None:
    root = _mathvista_dir(tmp_path)
    bad = {"1": {**MATHVISTA["1"], **change}}
    (root / "testmini.json").write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        read_mathvista(root / "testmini.json")


def test_mathvista_bad_numbers_and_files(tmp_path: Path) -> None:
    root = _mathvista_dir(tmp_path)
    path = root / "testmini.json"
    path.write_text(json.dumps([{**MATHVISTA["2"], "answer": "twelve"}]), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"entry 0: integer answer 'twelve' is not a number"):
        read_mathvista(path)
    path.write_text(json.dumps([{**MATHVISTA["2"], "answer": "2.5"}]), encoding="utf-8")
    with pytest.raises(ConfigError, match="not a whole number"):
        read_mathvista(path)
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"testmini\.json: not valid JSON"):
        read_mathvista(path)
    path.write_text('"text"', encoding="utf-8")
    with pytest.raises(ConfigError, match="expected a list of items or a dict"):
        read_mathvista(path)
    _png(tmp_path / "outside.png")
    path.write_text(json.dumps([{**MATHVISTA["2"], "image": "../outside.png"}]),
                    encoding="utf-8")
    assert read_mathvista(path)[0]["image"].endswith("outside.png")
    with pytest.raises(ConfigError, match="outside images_root"):
        read_mathvista(path, images_root=root)
    with pytest.raises(ConfigError, match="not found"):
        read_mathvista(root / "missing.json")


def test_mathvista_saved_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    items = [MATHVISTA["1"], MATHVISTA["2"]]
    columns = {k: [it.get(k) for it in items] for k in
               ("pid", "question", "image", "answer", "answer_type", "question_type", "unit")}
    columns["choices"] = [it["choices"] or [] for it in items]
    columns["precision"] = [it["precision"] for it in items]
    columns["decoded_image"] = [Image.new("RGB", (40, 30), "red"), Image.new("L", (20, 10))]
    features = datasets.Features({
        **{k: datasets.Value("string") for k in
           ("pid", "question", "image", "answer", "answer_type", "question_type", "unit")},
        "choices": datasets.Sequence(datasets.Value("string")),
        "precision": datasets.Value("float64"),
        "decoded_image": datasets.Image(),
    })
    ds = datasets.Dataset.from_dict(columns, features=features)
    folder = tmp_path / "mathvista_hf"
    datasets.DatasetDict({"testmini": ds, "test": ds}).save_to_disk(str(folder))
    rows = read_mathvista(folder)
    assert [r["completion"] for r in rows] == ["B", "12"]
    cache = tmp_path / "mathvista_hf_images"
    assert rows[0]["image"] == str((cache / "mathvista_1.png").resolve())
    assert Image.open(rows[1]["image"]).size == (20, 10)
    # a free-form item's empty choices list is no choices
    assert rows[1]["choices"] == [] and rows[1]["question_type"] == "free_form"
    other = read_mathvista(folder, tmp_path / "pictures", split="test")
    assert Path(other[0]["image"]).parent == (tmp_path / "pictures").resolve()
    with pytest.raises(ConfigError, match=r"has splits \['testmini', 'test'\]"):
        read_mathvista(folder, split="val")
    with pytest.raises(ConfigError, match="not a dataset folder"):
        read_mathvista(tmp_path / "pictures")


# ------------------------------------------------------------------------------ MathVision
MATHVISION = [
    {"id": "6", "question": "In which picture?\n<image1>", "options": ["A", "B", "C", "D", "E"],
     "answer": "D", "solution": None, "level": 3, "subject": "logic", "image": "images/6.png"},
    {"id": "39", "question": "Which colour <image1> is it?",
     "options": ["red", "blue", "green", "Yellow", "unknown"], "answer": "A", "solution": None,
     "level": 3, "subject": "logic", "image": "images/6.png"},
    {"id": "4", "question": "How many digits?\n<image1>", "options": [], "answer": "6",
     "solution": None, "level": 1, "subject": "counting", "image": "images/4.png"},
    {"id": "7", "question": "How long?", "options": [], "answer": "2.5", "level": 2,
     "subject": "metric geometry", "image": "images/4.png"},
    {"id": "59", "question": "Which side?", "options": [], "answer": "C", "level": 1,
     "subject": "solid geometry", "image": "images/4.png"},
]


def _mathvision(tmp_path: Path, lines: list[str]) -> Path:
    """The MATH-V repository's layout: data/test.jsonl beside images/."""
    _png(tmp_path / "images" / "6.png")
    _png(tmp_path / "images" / "4.png")
    path = tmp_path / "data" / "test.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_mathvision_jsonl(tmp_path: Path) -> None:
    path = _mathvision(tmp_path, [json.dumps(x) for x in MATHVISION])
    rows = read_mathvision(path)
    assert [r["completion"] for r in rows] == ["D", "A", "6", "2.5", "C"]
    letters, colours, count, length, side = rows
    assert letters["prompt"] == "In which picture?\n(A) A (B) B (C) C (D) D (E) E"
    assert colours["prompt"] == (
        "Which colour is it?\n(A) red (B) blue (C) green (D) Yellow (E) unknown")
    assert (count["question_type"], count["answer_type"], count["precision"]) == (
        "free_form", "integer", 2)
    assert (length["answer_type"], length["number_scope"]) == ("float", "all")
    assert (side["question_type"], side["answer_type"], side["number_scope"]) == (
        "free_form", "text", NO_NUMBERS)
    assert (count["id"], count["level"], count["subject"], count["source"]) == (
        "4", 1, "counting", "mathvision")
    assert count["image"] == str((tmp_path / "images" / "4.png").resolve())
    # MathVision: the option letter or its text; numbers at 2 decimals
    preds = ["(D)", "red", "6.001", "2.55", "c"]
    out = compute_task_metrics(preds, [r["completion"] for r in rows], "math", rows=rows)
    assert out["exact_match"] == 0.8 and out["exact_match_float"] == 0.0


def test_mathvision_option_text_as_answer(tmp_path: Path) -> None:
    path = _mathvision(tmp_path, [json.dumps({**MATHVISION[1], "answer": "green"})])
    assert read_mathvision(path)[0]["completion"] == "C"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (json.dumps({**MATHVISION[0], "answer": "F"}), r"test.jsonl:2: answer 'F' is not one"),
        (json.dumps({**MATHVISION[0], "options": "ABCDE"}), r"test.jsonl:2: field 'options'"),
        (json.dumps({**MATHVISION[0], "id": None}), r"test.jsonl:2: field 'id'"),
        (json.dumps({**MATHVISION[0], "image": "images/9.png"}), r"test.jsonl:2: image not"),
        (json.dumps({**MATHVISION[0], "answer": None}), r"test.jsonl:2: no answer"),
        ("{not json", r"test.jsonl:2: not valid JSON"),
        ("[1, 2]", r"test.jsonl:2: expected an object"),
    ],
)
def test_mathvision_bad_lines_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = _mathvision(tmp_path, [json.dumps(MATHVISION[2]), line])
    with pytest.raises(ConfigError, match=match):
        read_mathvision(path)


def test_mathvision_broken_image_and_encoding(tmp_path: Path) -> None:
    path = _mathvision(tmp_path, [json.dumps(MATHVISION[2])])
    (tmp_path / "images" / "4.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    with pytest.raises(ConfigError, match=r"test.jsonl:1: unreadable image"):
        read_mathvision(path)
    path.write_bytes(json.dumps(MATHVISION[2]).replace("How", "H\xe9w").encode("latin-1"))
    with pytest.raises(ConfigError, match=r"test.jsonl:1: not UTF-8"):
        read_mathvision(path)


def test_mathvision_saved_datasets_folder(tmp_path: Path) -> None:
    """The Hub's ``MathLLMs/MathVision`` saved with ``save_to_disk``: splits ``test`` and
    ``testmini``, the picture in ``decoded_image`` beside the ``image`` path."""
    datasets = pytest.importorskip("datasets")
    items = [MATHVISION[0], MATHVISION[2], MATHVISION[3]]
    text = ("id", "question", "image", "answer", "solution", "subject")
    columns: dict[str, list] = {k: [it.get(k) for it in items] for k in text}
    columns["options"] = [it["options"] for it in items]
    columns["level"] = [it["level"] for it in items]
    columns["decoded_image"] = [Image.new("RGB", (40, 30), "red"), Image.new("L", (20, 10)),
                                Image.new("RGBA", (16, 16), (0, 0, 255, 128))]
    features = datasets.Features({
        **{k: datasets.Value("string") for k in text},
        "options": datasets.Sequence(datasets.Value("string")),
        "level": datasets.Value("int64"),
        "decoded_image": datasets.Image(),
    })
    ds = datasets.Dataset.from_dict(columns, features=features)
    folder = tmp_path / "mathvision_hf"
    datasets.DatasetDict({"test": ds, "testmini": ds.select([1])}).save_to_disk(str(folder))
    mini = read_mathvision(folder)  # testmini by default
    assert [r["id"] for r in mini] == ["4"] and mini[0]["completion"] == "6"
    rows = read_mathvision(folder, split="test")
    assert [r["completion"] for r in rows] == ["D", "6", "2.5"]
    letters, count, length = rows
    assert letters["prompt"] == "In which picture?\n(A) A (B) B (C) C (D) D (E) E"
    assert (letters["question_type"], letters["choices"]) == ("multi_choice", list("ABCDE"))
    assert (count["answer_type"], count["precision"], count["level"], count["subject"]) == (
        "integer", 2, 1, "counting")
    assert (length["answer_type"], length["number_scope"]) == ("float", "all")
    cache = tmp_path / "mathvision_hf_images"
    assert letters["image"] == str((cache / "mathvision_6.png").resolve())
    with Image.open(count["image"]) as im:
        assert im.size == (20, 10) and im.mode == "RGB"
    out = compute_task_metrics(["d", "6.001", "2.4"], [r["completion"] for r in rows], "math",
                               rows=rows)
    assert out["exact_match"] == pytest.approx(2 / 3)
    other = read_mathvision(folder, tmp_path / "pictures", split="test")
    assert Path(other[0]["image"]).parent == (tmp_path / "pictures").resolve()
    read_mathvision(folder, split="test", images_root=tmp_path)  # the pictures lie inside
    with pytest.raises(ConfigError, match=r"mathvision_hf: row 0: .*outside images_root"):
        read_mathvision(folder, split="test", images_root=folder)
    with pytest.raises(ConfigError, match=r"has splits \['test', 'testmini'\]"):
        read_mathvision(folder, split="val")
    with pytest.raises(ConfigError, match="not a dataset folder"):
        read_mathvision(tmp_path / "pictures")


# ------------------------------------------------------------------------------ CTW1500
def test_ctw1500_offset_format(tmp_path: Path) -> None:
    _png(tmp_path / "train_images" / "0001.png", (200, 100))
    # xmin, ymin, xmax, ymax then 14 offsets from (xmin, ymin): a curve 10..90 x 20..50
    offsets = [0, 10, 20, 0, 40, 5, 60, 0, 80, 10, 80, 20, 60, 15, 40, 20, 20, 15, 0, 30,
               0, 25, 10, 20, 20, 25, 30, 30]
    curve = [10, 20, 90, 50, *offsets]
    second = [100, 60, 180, 90, *[v for _ in range(7) for v in (0, 0, 80, 30)]]
    labels = tmp_path / "train_labels"
    labels.mkdir()
    (labels / "0001.txt").write_text(
        "\n".join(",".join(map(str, v)) for v in (second, curve)) + "\n", encoding="utf-8")
    (row,) = read_ctw1500(tmp_path / "train_images", labels)
    assert row["boxes"] == [[10.0, 20.0, 90.0, 50.0], [100.0, 60.0, 180.0, 90.0]]  # read order
    assert row["completion"] == "(50,200),(450,500); (500,600),(900,900)"
    assert row["words"] == ["", ""] and row["box_format"] == "qwen2vl"
    llava = read_ctw1500(tmp_path / "train_images", labels, box_format="llava")[0]
    assert llava["completion"].startswith("[0.050, 0.200, 0.450, 0.500]")


def test_ctw1500_polygon_format_and_dont_care(tmp_path: Path) -> None:
    _png(tmp_path / "test_images" / "1001.jpg", (100, 100))
    labels = tmp_path / "test_labels"
    labels.mkdir()
    (labels / "001001.txt").write_text(
        "10,10,40,5,70,10,70,30,40,25,10,30,####CURVED\n"
        "5,60,95,60,95,90,5,90,#######\n", encoding="utf-8")
    (row,) = read_ctw1500(tmp_path / "test_images", labels)
    assert row["boxes"] == [[10.0, 5.0, 70.0, 30.0]] and row["words"] == ["CURVED"]
    assert row["completion"] == "(100,50),(700,300)"
    everything = read_ctw1500(tmp_path / "test_images", labels, include_dont_care=True)[0]
    assert everything["words"] == ["CURVED", "###"]


def test_ctw1500_xml(tmp_path: Path) -> None:
    _png(tmp_path / "images" / "0200.png", (1000, 500))
    labels = tmp_path / "xml"
    labels.mkdir()
    (labels / "0200.xml").write_text(
        '<?xml version="1.0"?>\n<Annotations><image file="0200.png">'
        '<box height="197" left="131" top="49" width="399"><label>OLATHE</label>'
        "<segs>131,58,208,49,279,56,346,76,412,101,473,141,530,192,510,246,458,210,405,175,"
        "350,151,291,137,228,133,165,134</segs></box>"
        '<box height="20" left="10" top="400" width="100"><label>SIGN</label></box>'
        "</image></Annotations>", encoding="utf-8")
    (row,) = read_ctw1500(tmp_path / "images", labels)
    assert row["boxes"] == [[131.0, 49.0, 530.0, 246.0], [10.0, 400.0, 110.0, 420.0]]
    assert row["words"] == ["OLATHE", "SIGN"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1,2,3\n", r"0001.txt:1: expected 32 values"),
        ("10,10,40,5,####a\n10,x,40,5,70,10,####b\n", r"0001.txt:2: coordinates must be finite"),
        ("10,10,40,####a\n", r"0001.txt:1: a polygon needs an even number"),
        ("10,10,40,5,nan,10,####a\n", r"0001.txt:1: coordinates must be finite"),
    ],
)
def test_ctw1500_bad_lines_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    _png(tmp_path / "images" / "0001.png")
    labels = tmp_path / "labels"
    labels.mkdir()
    (labels / "0001.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        read_ctw1500(tmp_path / "images", labels)


def test_ctw1500_bad_xml_and_missing_image(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.mkdir()
    (labels / "0001.xml").write_text(
        '<!DOCTYPE a [<!ENTITY x "y">]><Annotations/>', encoding="utf-8")
    with pytest.raises(ConfigError, match="DOCTYPE or ENTITY"):
        read_ctw1500(tmp_path, labels)
    (labels / "0001.xml").write_text("<Annotations><image", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"0001\.xml: not valid XML"):
        read_ctw1500(tmp_path, labels)
    (labels / "0001.xml").unlink()
    (labels / "0002.txt").write_text("1,2,3,4,####a\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"0002.txt:1: image not found"):
        read_ctw1500(tmp_path, labels)


def _escaping_link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        link.symlink_to(target)
    except OSError:  # pragma: no cover - a file system without symlinks
        pytest.skip("symlinks not supported here")


def test_ctw1500_images_root_refuses_images_outside_it(tmp_path: Path) -> None:
    data = tmp_path / "ctw1500"
    outside = _png(tmp_path / "elsewhere" / "0009.png")
    _png(data / "images" / "0200.png")
    labels = data / "xml"
    labels.mkdir(parents=True)
    box = '<box height="20" left="10" top="10" width="30"><label>A</label></box>'
    for name in ("../../elsewhere/0009.png", str(outside)):  # "../" and an absolute path
        (labels / "0200.xml").write_text(
            f'<Annotations><image file="{name}">{box}</image></Annotations>', encoding="utf-8")
        assert read_ctw1500(data / "images", labels)[0]["boxes"] == [[10.0, 10.0, 40.0, 30.0]]
        shown = re.escape(repr(name))
        with pytest.raises(ConfigError, match=rf"0200\.xml: image {shown}: .*resolves to "
                                              rf".*outside images_root"):
            read_ctw1500(data / "images", labels, images_root=data)
    (labels / "0200.xml").write_text(
        f'<Annotations><image file="0200.png">{box}</image></Annotations>', encoding="utf-8")
    assert len(read_ctw1500(data / "images", labels, images_root=data)) == 1
    # a .txt label whose image in image_dir is a symlink to a file outside the root
    (labels / "0200.xml").unlink()
    (labels / "0001.txt").write_text("1,2,30,4,30,20,1,20,####a\n", encoding="utf-8")
    _escaping_link(data / "images" / "0001.png", outside)
    assert len(read_ctw1500(data / "images", labels)) == 1
    with pytest.raises(ConfigError, match=r"0001\.txt:1: image .*outside images_root"):
        read_ctw1500(data / "images", labels, images_root=data)
    with pytest.raises(ConfigError, match=r"images_root .* is not a folder"):
        read_ctw1500(data / "images", labels, images_root=data / "missing")


# ------------------------------------------------------------------------------ Total-Text
TOTALTEXT = (
    "x: [[115 503 494 115]], y: [[322 346 426 404]], ornt: [u'h'], transcriptions: [u'nauGHTY']\n"
    "x: [[ 10  30  50  70  90 110 130 150\n"
    "   150 130 110  90  70  50  30  10]], y: [[50 40 35 30 30 35 40 50 70 60 55 50 50 55 60\n"
    "   70]], ornt: [u'c'], transcriptions: [u\"don't\"]\n"
    "x: [[300 350 350 300]], y: [[10 10 30 30]], ornt: [u'#'], transcriptions: [u'#']\n"
)


def test_totaltext_txt(tmp_path: Path) -> None:
    _png(tmp_path / "Images" / "Train" / "img11.jpg", (1000, 500))
    gt = tmp_path / "Groundtruth" / "Text" / "Train"
    gt.mkdir(parents=True)
    (gt / "poly_gt_img11.txt").write_text(TOTALTEXT, encoding="utf-8")
    (gt / "README.txt").write_text("not a label file", encoding="utf-8")
    (row,) = read_totaltext(tmp_path / "Images" / "Train", gt)
    assert row["boxes"] == [[10.0, 30.0, 150.0, 70.0], [115.0, 322.0, 503.0, 426.0]]
    assert row["words"] == ["don't", "nauGHTY"]
    assert row["completion"] == "(10,60),(150,140); (115,644),(503,852)"
    everything = read_totaltext(tmp_path / "Images" / "Train", gt, include_dont_care=True)[0]
    assert everything["words"] == ["#", "don't", "nauGHTY"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (TOTALTEXT.splitlines()[0] + "\nx: [[1 2]], y: [[1]], ornt: [u'h'], transcriptions: [u'a']",
         r"poly_gt_img1.txt:2: 2 x but 1 y"),
        ("x: [[1 2 3]], y: [[1 2 3]], ornt: [u'h']\n", r"poly_gt_img1.txt:1: expected"),
        ("x: [[1 b]], y: [[1 2]], ornt: [u'h'], transcriptions: [u'a']\n",
         r"poly_gt_img1.txt:1: coordinates must be finite"),
        ("x: [[1]], y: [[1]], ornt: [u'h'], transcriptions: [u'a']\n",
         r"poly_gt_img1.txt:1: a polygon needs"),
    ],
)
def test_totaltext_bad_records_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    _png(tmp_path / "img1.png")
    (tmp_path / "gt").mkdir()
    (tmp_path / "gt" / "poly_gt_img1.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        read_totaltext(tmp_path, tmp_path / "gt")


def test_totaltext_mat(tmp_path: Path) -> None:
    scipy_io = pytest.importorskip("scipy.io")
    _png(tmp_path / "img7.png", (200, 100))
    (tmp_path / "gt").mkdir()
    table = np.empty((2, 6), dtype=object)
    table[0] = ["x:", np.array([[20, 60, 60, 20]]), "y:", np.array([[10, 10, 30, 30]]),
                np.array(["word"]), np.array(["h"])]
    table[1] = ["x:", np.array([[100, 150, 150]]), "y:", np.array([[50, 50, 90]]),
                np.array(["#"]), np.array(["#"])]
    scipy_io.savemat(str(tmp_path / "gt" / "poly_gt_img7.mat"), {"polygt": table})
    (row,) = read_totaltext(tmp_path, tmp_path / "gt")
    assert row["boxes"] == [[20.0, 10.0, 60.0, 30.0]] and row["words"] == ["word"]
    assert row["completion"] == "(100,100),(300,300)"
    assert len(read_totaltext(tmp_path, tmp_path / "gt", include_dont_care=True)[0]["boxes"]) == 2
    scipy_io.savemat(str(tmp_path / "gt" / "poly_gt_img7.mat"), {"other": np.zeros(3)})
    with pytest.raises(ConfigError, match=r"poly_gt_img7\.mat: expected a variable 'polygt'"):
        read_totaltext(tmp_path, tmp_path / "gt")
    (tmp_path / "gt" / "poly_gt_img7.mat").write_bytes(b"MATLAB 5.0 broken")
    with pytest.raises(ConfigError, match=r"poly_gt_img7\.mat: not a MATLAB file"):
        read_totaltext(tmp_path, tmp_path / "gt")


def test_totaltext_images_root_refuses_images_outside_it(tmp_path: Path) -> None:
    data = tmp_path / "totaltext"
    gt = data / "gt"
    gt.mkdir(parents=True)
    (gt / "poly_gt_img11.txt").write_text(TOTALTEXT, encoding="utf-8")
    _png(tmp_path / "elsewhere" / "img11.jpg", (1000, 500))
    # an image_dir outside the root
    assert len(read_totaltext(tmp_path / "elsewhere", gt)) == 1
    with pytest.raises(ConfigError, match=r"poly_gt_img11\.txt:1: image .*img11\.jpg.* "
                                          r"outside images_root"):
        read_totaltext(tmp_path / "elsewhere", gt, images_root=data)
    # a symlink inside it to the image outside
    _escaping_link(data / "Images" / "img11.jpg", tmp_path / "elsewhere" / "img11.jpg")
    with pytest.raises(ConfigError, match="outside images_root"):
        read_totaltext(data / "Images", gt, images_root=data)
    (data / "Images" / "img11.jpg").unlink()
    _png(data / "Images" / "img11.jpg", (1000, 500))
    (row,) = read_totaltext(data / "Images", gt, images_root=data)
    assert row["words"] == ["don't", "nauGHTY"]
