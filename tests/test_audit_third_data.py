"""Third fault audit, data half: rows, dataset readers and images (docs/audit.md, rows D1..).

Each case was a silent wrong answer, a resource bomb or a traceback on the code before it:

* JSON data files (emdlm.json_io, read by every data reader): a key given twice, nesting deeper
  than the limit and a lone surrogate are one-line errors naming the file and line;
* a field far longer than ``max_length`` tokens is cut to a character cap before tokenizing,
  and the cut is counted and said (emdlm.data.cap_characters);
* every reader's boxes pass one geometry check (emdlm.metrics.boxes.box_problem): a box outside
  its image or made infinite by the reader's arithmetic is refused, naming file and line;
* integer answers are read exactly (emdlm.math_answers.exact_value), never through a float;
* an image wider than 200:1 is refused where images are checked (emdlm.datasets.images);
* MathVision's missing answer gets MathVision's message, not MathVista's.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from emdlm.config import ConfigError, DataSourceConfig
from emdlm.data import build_dataset, load_examples, read_jsonl
from emdlm.datasets.curved_text import read_ctw1500, read_totaltext
from emdlm.datasets.grounding import read_refcoco
from emdlm.datasets.image_rows import load_image_examples, read_image_jsonl
from emdlm.datasets.text_detection import read_icdar2015, read_td500
from emdlm.datasets.visual_math import read_mathvision, read_mathvista
from emdlm.json_io import MAX_DEPTH
from emdlm.math_answers import MathItem, score_answer
from emdlm.tokenizers import load_tokenizer


def _png(path: Path, size: tuple[int, int] = (100, 50)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (120, 30, 200)).save(path)
    return path


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


GOOD = '{"prompt": "1+1=", "completion": "2"}'


# ----------------------------------------------------------------------------- JSON rows
def test_duplicate_key_in_a_jsonl_row_is_refused_naming_row_and_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, GOOD, '{"prompt": "2+2=", "completion": "5", "completion": "4"}')
    with pytest.raises(ConfigError) as err:
        read_jsonl(path)
    message = _one_line(err)
    assert message.startswith(f"{path}:2: key 'completion' is given twice")


def test_duplicate_key_in_the_other_json_readers_is_refused(tmp_path: Path) -> None:
    """The same loader reads image JSONL, COCO instances and the math benchmarks."""
    _png(tmp_path / "a.png")
    rows = _jsonl(tmp_path, '{"image": "a.png", "prompt": "p", "completion": "1", '
                            '"completion": "2"}')
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: key 'completion' is given twice"):
        read_image_jsonl(rows)
    vista = tmp_path / "testmini.json"
    vista.write_text('{"1": {"pid": "1", "answer": "3"}, "1": {"pid": "1", "answer": "4"}}',
                     encoding="utf-8")
    with pytest.raises(ConfigError, match=r"testmini\.json: key '1' is given twice"):
        read_mathvista(vista)


def test_deep_nesting_is_one_line_naming_the_row(tmp_path: Path) -> None:
    """100,000 levels were a RecursionError traceback; deeper than MAX_DEPTH is refused."""
    deep = '{"prompt": "p", "completion": "c", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    just_over = ('{"prompt": "p", "completion": "c", "extra": ' + "[" * MAX_DEPTH
                 + "]" * MAX_DEPTH + "}")
    at_limit = ('{"prompt": "p", "completion": "c", "extra": ' + "[" * (MAX_DEPTH - 1)
                + "]" * (MAX_DEPTH - 1) + "}")
    for line in (deep, just_over):
        path = _jsonl(tmp_path, GOOD, line)
        with pytest.raises(ConfigError) as err:
            read_jsonl(path)
        assert _one_line(err) == (
            f"{path}:2: objects and arrays nest deeper than {MAX_DEPTH} levels")
    assert len(read_jsonl(_jsonl(tmp_path, at_limit))) == 1


def test_lone_surrogate_is_one_line_naming_row_and_field(tmp_path: Path) -> None:
    """"\\ud800" parsed into a string the tokenizer met with a TypeError traceback."""
    path = _jsonl(tmp_path, GOOD, '{"prompt": "a\\ud800b", "completion": "2"}')
    with pytest.raises(ConfigError) as err:
        read_jsonl(path)
    message = _one_line(err)
    assert message.startswith(f"{path}:2: the string at ['prompt'] holds a lone surrogate "
                              "\\ud800 at character 2")
    # a whole pair is one character, and fine
    (row,) = read_jsonl(_jsonl(tmp_path, '{"prompt": "\\ud83d\\ude00", "completion": "2"}'))
    assert row["prompt"] == "\U0001f600"


def test_lone_surrogate_through_training_data_is_a_config_error(tmp_path: Path) -> None:
    """The route of the audit case: load_examples then build_dataset with a real tokenizer."""
    path = _jsonl(tmp_path, '{"text": "x\\udfff"}')
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: the string at \['text'\] holds a "
                                          r"lone surrogate \\udfff"):
        build_dataset(load_examples(DataSourceConfig(path=str(path)), seed=0),
                      load_tokenizer("gpt2"), max_length=16)


# ----------------------------------------------------------------------------- size cap
def test_a_huge_field_is_cut_before_tokenizing_and_the_cut_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 50 MB line with max_length=16 took 245 s and 10.3 GB (tokenized whole); 5 MB here."""
    tok = load_tokenizer("gpt2")
    huge = "7 " * 2_500_000
    start = time.perf_counter()
    ds = build_dataset([{"prompt": "q", "completion": huge}, {"text": "short"}], tok,
                       max_length=16)
    assert time.perf_counter() - start < 20  # whole: about 25 s and 1 GB for 5 MB
    cuts = ds.cuts
    assert cuts is not None
    cap = (16 + 8) * 128  # (max_length + slack) x GPT-2's longest vocabulary entry
    assert (cuts.character_cut_rows, cuts.max_characters) == (1, cap)
    assert cuts.characters_cut == len(huge) - cap
    assert cuts.truncated == 1
    assert cuts.to_dict()["characters_cut"] == len(huge) - cap  # train_summary.json
    err = capsys.readouterr().err
    assert (f"1 rows had a field over {cap} characters, cut to it before tokenizing "
            f"({len(huge) - cap} characters)") in err
    # the tokens kept are those of the whole text
    whole = tok("q")["input_ids"] + tok(huge[:20_000], add_special_tokens=False)["input_ids"]
    assert ds[0]["input_ids"] == whole[:16]


def test_the_character_cap_follows_on_truncate_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cut to it before tokenizing.*on_truncate=error"):
        build_dataset([{"text": "a" * 100_000}], load_tokenizer("char"), max_length=8,
                      on_truncate="error")


def test_the_character_cap_applies_to_image_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """VLM rows are measured (tokenized) before training too: the same cap, counted."""
    from emdlm.config import load_config
    from emdlm.training.image_text import prepare_vlm_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    _png(tmp_path / "a.png", (64, 64))
    huge = "1" * 300_000
    data = _jsonl(tmp_path, '{"image": "a.png", "prompt": "p", "completion": "12"}',
                  json.dumps({"image": "a.png", "prompt": "p", "completion": huge}))
    cfg = load_config(None, [
        "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
        "data.max_length=128", f"output_dir={tmp_path / 'run'}",
    ])
    parts = prepare_vlm_run(cfg)
    cuts = parts.train_dataset.cuts
    assert cuts is not None and cuts.character_cut_rows == 1
    cap = cuts.max_characters
    assert 0 < cap < 20_000 and cuts.characters_cut == len(huge) - cap
    assert len(parts.train_dataset[1]["completion"]) == cap
    assert f"1 rows had a field over {cap} characters" in capsys.readouterr().err


# ----------------------------------------------------------------------------- geometry
def _icdar(tmp_path: Path, text: str) -> tuple[Path, Path]:
    images, gts = tmp_path / "images", tmp_path / "gt"
    _png(images / "img_1.png", (100, 50))
    gts.mkdir()
    (gts / "gt_img_1.txt").write_text(text, encoding="utf-8")
    return images, gts


def test_icdar_quad_outside_the_image_is_refused(tmp_path: Path) -> None:
    images, gts = _icdar(tmp_path, "1,1,5,1,5,5,1,5,ok\n500,10,600,10,600,20,500,20,far\n")
    with pytest.raises(ConfigError) as err:
        read_icdar2015(images, gts)
    assert _one_line(err) == (f"{gts / 'gt_img_1.txt'}:2: box (500, 10, 600, 20) lies outside "
                              "the 100x50 image img_1.png")
    # poking out is fine: the answer is the part inside
    images, gts = _icdar(tmp_path / "poke", "90,40,150,40,150,80,90,80,edge\n")
    assert read_icdar2015(images, gts)[0]["completion"] == "(900,800),(1000,1000)"


def test_td500_box_outside_the_image_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "td500"
    _png(folder / "IMG_0001.png", (200, 100))
    (folder / "IMG_0001.gt").write_text("0 0 10 20 40 10 0\n1 0 -90 -90 40 10 0\n",
                                        encoding="utf-8")
    with pytest.raises(ConfigError, match=r"IMG_0001\.gt:2: box .* lies outside the 200x100"):
        read_td500(folder)


def test_ctw1500_box_outside_or_overflowing_is_refused(tmp_path: Path) -> None:
    """1e308 passed the finiteness check and, plus its offsets, became [inf, inf, inf, inf]."""
    _png(tmp_path / "images" / "0001.png", (200, 100))
    labels = tmp_path / "labels"
    labels.mkdir()
    good = [10, 20, 90, 50, *[v for _ in range(7) for v in (0, 0, 80, 30)]]
    for line, problem in (
        ([1e308, 1e308, 1e308, 1e308, *[1e308] * 28], "has a coordinate that is not a finite"),
        ([300, 20, 390, 50, *good[4:]], "lies outside the 200x100 image"),
    ):
        (labels / "0001.txt").write_text(
            ",".join(map(str, good)) + "\n" + ",".join(map(repr, line)) + "\n",
            encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            read_ctw1500(tmp_path / "images", labels)
        message = _one_line(err)
        assert message.startswith(f"{labels / '0001.txt'}:2: box (") and problem in message


def test_ctw1500_xml_polygon_outside_the_image_is_refused(tmp_path: Path) -> None:
    _png(tmp_path / "images" / "0200.png", (100, 100))
    labels = tmp_path / "xml"
    labels.mkdir()
    (labels / "0200.xml").write_text(
        '<Annotations><image file="0200.png"><box><label>far</label>'
        "<segs>300,300,400,300,400,400,300,400</segs></box></image></Annotations>",
        encoding="utf-8")
    with pytest.raises(ConfigError, match=r"0200\.xml: image '0200\.png' box 0: box .* lies "
                                          r"outside the 100x100 image"):
        read_ctw1500(tmp_path / "images", labels)


def test_totaltext_polygon_outside_the_image_is_refused(tmp_path: Path) -> None:
    _png(tmp_path / "Images" / "img11.jpg", (100, 100))
    gt = tmp_path / "gt"
    gt.mkdir()
    (gt / "poly_gt_img11.txt").write_text(
        "x: [[10 50 50 10]], y: [[10 10 40 40]], ornt: [u'h'], transcriptions: [u'in']\n"
        "x: [[-90 -50 -50 -90]], y: [[10 10 40 40]], ornt: [u'h'], transcriptions: [u'out']\n",
        encoding="utf-8")
    with pytest.raises(ConfigError, match=r"poly_gt_img11\.txt:2: box \(-90, 10, -50, 40\) lies "
                                          r"outside the 100x100 image img11\.jpg"):
        read_totaltext(tmp_path / "Images", gt)


def test_refcoco_box_outside_the_image_is_refused(tmp_path: Path) -> None:
    images = tmp_path / "train2014"
    _png(images / "COCO_1.png", (200, 100))
    instances = {"images": [{"id": 1, "file_name": "COCO_1.png"}],
                 "annotations": [{"id": 10, "image_id": 1, "bbox": [250, 10, 20, 20]}]}
    refs = [{"ref_id": 0, "ann_id": 10, "image_id": 1, "split": "val",
             "sentences": [{"sent": "far right"}]}]
    (tmp_path / "refs(unc).p").write_bytes(pickle.dumps(refs, protocol=2))
    (tmp_path / "instances.json").write_text(json.dumps(instances), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        read_refcoco(tmp_path / "refs(unc).p", tmp_path / "instances.json", images)
    assert _one_line(err) == (f"{tmp_path / 'instances.json'}: annotation id 10: box (250, 10, "
                              "270, 30) lies outside the 200x100 image COCO_1.png")


# ----------------------------------------------------------------------------- integers
def test_mathvista_integer_answer_is_kept_exactly(tmp_path: Path) -> None:
    """12345678901234567 became 12345678901234568, read through a float."""
    _png(tmp_path / "images" / "1.png")
    entries = {
        str(i): {"pid": str(i), "question": "How many?", "image": "images/1.png",
                 "choices": None, "answer": answer, "answer_type": "integer",
                 "precision": None, "question_type": "free_form", "unit": None}
        for i, answer in enumerate(("12345678901234567", 12345678901234567))
    }
    (tmp_path / "testmini.json").write_text(json.dumps(entries), encoding="utf-8")
    rows = read_mathvista(tmp_path / "testmini.json")
    assert [r["completion"] for r in rows] == ["12345678901234567"] * 2


def test_integer_scoring_is_exact() -> None:
    item = MathItem("free_form", "integer")
    gold = "12345678901234567"
    assert score_answer("12345678901234567", gold, item).correct
    assert not score_answer("12345678901234568", gold, item).correct
    assert score_answer("12345678901234567.9", gold, item).parsed == gold  # truncated
    assert score_answer("2.7", "2", item).correct  # MathVista's truncation kept


# ----------------------------------------------------------------------------- images
def test_a_5000x1_image_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The image processor's aspect-ratio traceback came after the model was built."""
    _png(tmp_path / "wide.png", (5000, 1))
    _png(tmp_path / "ok.png", (200, 1))  # 200:1 is the limit, kept
    path = _jsonl(tmp_path, '{"image": "ok.png", "prompt": "p", "completion": "1"}',
                  '{"image": "wide.png", "prompt": "p", "completion": "1"}')
    with pytest.raises(ConfigError) as err:
        load_image_examples(DataSourceConfig(path=str(path)), seed=0)
    message = _one_line(err)
    assert message.startswith(f"{path}:2: cannot read image {tmp_path / 'wide.png'}: the "
                              "image is 5000x1 pixels, an aspect ratio of 5000:1")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:2: unreadable image .*5000:1"):
        read_image_jsonl(path)


def test_a_too_wide_picture_in_a_datasets_column_is_refused() -> None:
    from emdlm.datasets.image_rows import check_image

    with pytest.raises(ConfigError, match=r"row 3: field 'image': the image is 1x900 pixels"):
        check_image(Image.new("RGB", (1, 900)), None, "row 3", "image")


# ----------------------------------------------------------------------------- messages
@pytest.mark.parametrize("answer", [None, "", "  "], ids=["null", "empty", "blank"])
def test_mathvision_without_answer_gets_mathvision_advice(tmp_path: Path, answer: Any) -> None:
    _png(tmp_path / "images" / "1.jpg")
    entry = {"id": "1", "question": "How many?", "options": [], "image": "images/1.jpg",
             "answer": answer}
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(entry) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        read_mathvision(path)
    message = _one_line(err)
    assert message.startswith(f"{path}:1: no answer") and "MathVision" in message
    assert "MathVista" not in message and "use testmini" not in message
