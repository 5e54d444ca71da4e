"""The generated visual math task: row format, determinism per seed, train/dev/test
disjointness (and the train and test streams of the default parameters pinned as they were
before the dev split), every sub-task's answer drawn correctly (bar heights, line points and
shape counts measured on the pixels), the multiple-choice rows, the per-row number scope and
parameter validation."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from emdlm.eval_kinds import EVAL_KINDS
from emdlm.models import load_tokenizer
from emdlm.number_scope import piece_masks, scope_pattern
from emdlm.tasks import available_tasks, generate_task, task_spec
from emdlm.tasks.render import COLORS
from emdlm.tasks.visual_math import (
    FREE_FORM,
    LINE_X,
    MULTI_CHOICE,
    NO_NUMBERS,
    SPLITS,
    SUBTASKS,
    content_id,
    figure_answer,
    format_choices,
    in_split,
    make_choices,
    split_of,
)

SIZE = 112
PLAIN = {"image_size": SIZE, "supersample": 1, "noise": 0.0}  # exact colours on the pixels
EIGHT = np.ones((3, 3), dtype=bool)  # 8-connected components


def rows_of(tmp_path: Path, n: int = 40, name: str = "c", **params: Any) -> list[dict[str, Any]]:
    return generate_task("visual_math", n=n, cache_dir=tmp_path / name, **params)


def pixels(path: str) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def mask_of(img: np.ndarray, color: tuple[int, int, int]) -> np.ndarray:
    return np.all(img == np.array(color), axis=-1)


def test_registered_as_a_number_task() -> None:
    assert "visual_math" in available_tasks()
    spec = task_spec("visual_math")
    assert spec.splits == SPLITS == ("train", "dev", "test")
    assert spec.eval_kind == ("math" if "math" in EVAL_KINDS else "number")
    assert spec.answer_pattern is not None and spec.answer_pattern.fullmatch("12")


def test_row_format(tmp_path: Path) -> None:
    rows = rows_of(tmp_path, 30, multiple_choice=0.5)
    for r in rows:
        assert Path(r["image"]).is_file()
        assert r["subtask"] in SUBTASKS and r["answer_type"] == "integer"
        assert r["question_type"] in (FREE_FORM, MULTI_CHOICE)
        assert int(r["answer"]) == figure_answer(r["subtask"], r["figure"]) >= 0
        with Image.open(r["image"]) as im:
            assert im.size == (SIZE, SIZE) and im.mode == "RGB"


def test_same_seed_same_rows_and_pixels(tmp_path: Path) -> None:
    a = rows_of(tmp_path, 24, "a", seed=3, multiple_choice=0.5)
    b = rows_of(tmp_path, 24, "b", seed=3, multiple_choice=0.5)
    strip = [{k: v for k, v in r.items() if k != "image"} for r in a]
    assert strip == [{k: v for k, v in r.items() if k != "image"} for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert np.array_equal(pixels(ra["image"]), pixels(rb["image"]))
    c = rows_of(tmp_path, 24, "c", seed=4, multiple_choice=0.5)
    assert [r["prompt"] for r in c] != [r["prompt"] for r in a]
    # a prefix of a bigger set equals the smaller set (example k depends on (seed, split, k))
    big = rows_of(tmp_path, 30, "d", seed=3, multiple_choice=0.5)
    assert [r["prompt"] for r in big[:24]] == [r["prompt"] for r in a]


@pytest.mark.parametrize("subtask", SUBTASKS)
def test_train_and_test_are_disjoint(tmp_path: Path, subtask: str) -> None:
    train = rows_of(tmp_path, 60, "tr", subtasks=[subtask], seed=0)
    test = rows_of(tmp_path, 60, "te", subtasks=[subtask], split="test", seed=1)
    ids = {repr(content_id(subtask, r["figure"])) for r in train}
    assert not ids & {repr(content_id(subtask, r["figure"])) for r in test}
    assert all(in_split(subtask, r["figure"], "train", 0.2) for r in train)
    assert all(in_split(subtask, r["figure"], "test", 0.2) for r in test)


# The first rows of the default parameters (seed 0) as the code made them before the dev split
# existed (2026-11-27): (sub-task, completion, figure content and what was drawn). Adding
# dev_fraction (0 by default) must leave both streams as they were.
PINNED = {
    "train": [
        ("side", "1", {"width": 1, "height": 1, "colors": ["red"]}),
        ("side", "7", {"width": 4, "height": 7, "colors": ["yellow"]}),
        ("bar_difference", "2",
         {"values": [6, 4, 4], "colors": ["red", "purple", "orange"], "query": [0, 1]}),
        ("perimeter", "32", {"width": 7, "height": 9, "colors": ["blue"]}),
        ("bar_difference", "4",
         {"values": [9, 7, 5], "colors": ["orange", "blue", "purple"], "query": [0, 2]}),
    ],
    "test": [
        ("count", "6", {"color": "red", "count": 6, "others": 3,
                        "colors": ["red"] * 6 + ["orange", "green", "green"],
                        "cells": [1, 5, 15, 0, 12, 4, 14, 3, 2]}),
        ("perimeter", "24", {"width": 3, "height": 9, "colors": ["green"]}),
        ("count", "5", {"color": "yellow", "count": 5, "others": 4,
                        "colors": ["yellow"] * 5 + ["purple", "purple", "blue", "blue"],
                        "cells": [5, 6, 15, 2, 7, 10, 4, 8, 13]}),
        ("bar_value", "9", {"values": [9, 7, 6], "colors": ["green", "red", "blue"],
                            "query": [0]}),
        ("bar_difference", "2", {"values": [3, 1, 4], "colors": ["green", "blue", "red"],
                                 "query": [0, 1]}),
    ],
}


@pytest.mark.parametrize("split", ["train", "test"])
def test_default_streams_are_those_of_before_the_dev_split(tmp_path: Path, split: str) -> None:
    rows = rows_of(tmp_path, 5, split=split)
    assert [(r["subtask"], r["completion"], r["figure"]) for r in rows] == PINNED[split]
    assert rows[0]["prompt"] == {
        "train": "The perimeter is P. What is the side marked ? Answer with a number.",
        "test": "How many red shapes are there? Answer with a number.",
    }[split]
    # an explicit dev_fraction=0 is the default; a dev_fraction never moves the test stream
    same = rows_of(tmp_path, 5, "zero", split=split, dev_fraction=0.0)
    assert [r["figure"] for r in same] == [r["figure"] for r in rows]
    if split == "test":
        with_dev = rows_of(tmp_path, 5, "dev", split=split, dev_fraction=0.2)
        assert [r["prompt"] for r in with_dev] == [r["prompt"] for r in rows]


def test_train_dev_and_test_are_disjoint(tmp_path: Path) -> None:
    fractions = {"test_fraction": 0.2, "dev_fraction": 0.2}
    ids: dict[str, set[str]] = {}
    for split, seed in zip(SPLITS, (0, 1, 2), strict=True):
        rows = rows_of(tmp_path, 60, split, split=split, seed=seed, **fractions)
        assert {r["subtask"] for r in rows} == set(SUBTASKS)
        assert all(split_of(r["subtask"], r["figure"], 0.2, 0.2) == split for r in rows)
        ids[split] = {repr(content_id(r["subtask"], r["figure"])) for r in rows}
    assert not ids["train"] & ids["dev"] and not ids["train"] & ids["test"]
    assert not ids["dev"] & ids["test"]
    # without dev_fraction the train split still holds the dev contents: why a run tuned on
    # "dev" gives its train split the same dev_fraction
    plain = rows_of(tmp_path, 60, "plain", seed=0, test_fraction=0.2)
    assert any(split_of(r["subtask"], r["figure"], 0.2, 0.2) == "dev" for r in plain)


def test_dev_split_is_deterministic_and_its_own_stream(tmp_path: Path) -> None:
    a = rows_of(tmp_path, 12, "a", split="dev", seed=5, dev_fraction=0.1)
    b = rows_of(tmp_path, 12, "b", split="dev", seed=5, dev_fraction=0.1)
    assert [{k: v for k, v in r.items() if k != "image"} for r in a] == [
        {k: v for k, v in r.items() if k != "image"} for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert np.array_equal(pixels(ra["image"]), pixels(rb["image"]))
    other = rows_of(tmp_path, 12, "c", split="dev", seed=6, dev_fraction=0.1)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in a]
    assert all(split_of(r["subtask"], r["figure"], 0.2, 0.1) == "dev" for r in a + other)


@pytest.mark.parametrize("params,match", [
    ({"split": "dev"}, r"split='dev' needs dev_fraction > 0 \(give the same dev_fraction to "
                       r"the train split\)"),
    ({"split": "dev", "dev_fraction": 0.0}, "needs dev_fraction > 0"),
    ({"dev_fraction": -0.1}, r"dev_fraction must be a finite number in \[0, 1\), got -0.1"),
    ({"dev_fraction": 0.8, "test_fraction": 0.2}, r"= \[0, 0.8\), got 0.8"),
    ({"split": "val", "dev_fraction": 0.1}, "split must be one of train, dev, test"),
])
def test_bad_split_parameters(tmp_path: Path, params: dict[str, Any], match: str) -> None:
    from emdlm.tasks.visual_math import visual_math

    with pytest.raises(ValueError, match=match):
        visual_math(2, cache_dir=tmp_path / "x", **params)
    if params.get("split") != "val":  # through the registry too
        with pytest.raises(ValueError, match=match):
            rows_of(tmp_path, 2, **params)
    assert not (tmp_path / "x").exists()


def _plot_rows(top: int, y1: float, y2: float) -> Any:
    return lambda v: y2 - v / top * (y2 - y1)


@pytest.mark.parametrize("subtask", ["bar_value", "bar_difference"])
def test_bars_are_drawn_at_their_values(tmp_path: Path, subtask: str) -> None:
    for r in rows_of(tmp_path, 20, subtasks=[subtask], n_bars=4, max_value=9, **PLAIN):
        fig, img = r["figure"], pixels(r["image"])
        row = _plot_rows(9, 0.1 * SIZE, 0.92 * SIZE)
        assert len(set(fig["colors"])) == len(fig["values"]) == 4
        for v, c in zip(fig["values"], fig["colors"], strict=True):
            ys = np.nonzero(mask_of(img, COLORS[c]).any(axis=1))[0]
            assert abs(ys.min() - row(v)) <= 1.5, (v, c, ys.min(), row(v))
        asked = [fig["colors"][i] for i in fig["query"]]
        assert all(f"the {c} bar" in r["prompt"] for c in asked)
        if subtask == "bar_difference":
            i, j = fig["query"]
            assert int(r["answer"]) == fig["values"][i] - fig["values"][j] > 0


def test_line_passes_through_its_values(tmp_path: Path) -> None:
    for r in rows_of(tmp_path, 20, subtasks=["line_value"], max_value=9, **PLAIN):
        fig, img = r["figure"], pixels(r["image"])
        a, b, x0 = fig["slope"], fig["intercept"], fig["x"]
        assert int(r["answer"]) == a * x0 + b and f"f({x0})" in r["prompt"]
        assert all(0 <= a * x + b <= 9 for x in LINE_X)
        row = _plot_rows(9, 0.06 * SIZE, 0.86 * SIZE)
        line = mask_of(img, COLORS[fig["colors"][0]])
        x_at = 0.16 * SIZE + (LINE_X[-1] * 0.5) / LINE_X[-1] * 0.78 * SIZE  # x = 2, mid-line
        ys = np.nonzero(line[:, round(x_at)])[0]
        if x0 != 2:  # the marker dot covers the line at x0
            assert abs(ys.mean() - row(a * 2 + b)) <= 2.0
        dot = np.all(img < 60, axis=-1)  # the black marker at (x0, f(x0))
        x_dot = 0.16 * SIZE + x0 / LINE_X[-1] * 0.78 * SIZE
        y_dot = row(a * x0 + b)
        r0, c0 = round(y_dot), round(x_dot)
        assert dot[r0 - 1 : r0 + 2, c0 - 1 : c0 + 2].all()


def test_shapes_counted_on_the_pixels(tmp_path: Path) -> None:
    for r in rows_of(tmp_path, 25, subtasks=["count"], **PLAIN):
        fig, img = r["figure"], pixels(r["image"])
        assert f"How many {fig['color']} shapes" in r["prompt"]
        _, found = ndimage.label(mask_of(img, COLORS[fig["color"]]), EIGHT)
        assert found == fig["count"] == int(r["answer"])
        _, every = ndimage.label(~mask_of(img, (255, 255, 255)), EIGHT)
        assert every == fig["count"] + fig["others"]


@pytest.mark.parametrize("subtask", ["perimeter", "side"])
def test_rectangles_drawn_to_scale(tmp_path: Path, subtask: str) -> None:
    for r in rows_of(tmp_path, 20, subtasks=[subtask], max_value=9, **PLAIN):
        fig, img = r["figure"], pixels(r["image"])
        w, h = fig["width"], fig["height"]
        outline = mask_of(img, COLORS[fig["colors"][0]])
        ys, xs = np.nonzero(outline)
        unit = 0.62 * SIZE / 9
        assert abs((xs.max() - xs.min()) - w * unit) <= 2.5
        assert abs((ys.max() - ys.min()) - h * unit) <= 2.5
        expected = 2 * (w + h) if subtask == "perimeter" else h
        assert int(r["answer"]) == expected


def test_multiple_choice_rows(tmp_path: Path) -> None:
    rows = rows_of(tmp_path, 60, multiple_choice=1.0, n_choices=5)
    for r in rows:
        choices = [int(c) for c in r["choices"]]
        answer = int(r["answer"])
        assert len(choices) == len(set(choices)) == 5 and choices.count(answer) == 1
        assert min(choices) >= 0
        assert r["completion"] == string.ascii_uppercase[choices.index(answer)]
        assert r["question_type"] == MULTI_CHOICE and r["number_scope"] == NO_NUMBERS
        assert format_choices(choices) in r["prompt"] and "(E)" in r["prompt"]
    letters = {r["completion"] for r in rows}
    assert len(letters) >= 4  # the answer's position varies


def test_free_form_rows(tmp_path: Path) -> None:
    for r in rows_of(tmp_path, 30, multiple_choice=0.0):
        assert r["completion"] == r["answer"] and r["choices"] is None
        assert r["question_type"] == FREE_FORM and r["number_scope"] == "all"
        assert r["prompt"].endswith("Answer with a number.")


def test_multiple_choice_fraction(tmp_path: Path) -> None:
    rows = rows_of(tmp_path, 200, multiple_choice=0.3, subtasks=["count"], image_size=64)
    share = sum(r["question_type"] == MULTI_CHOICE for r in rows) / len(rows)
    assert 0.2 < share < 0.4


@pytest.mark.parametrize("answer,n", [(0, 2), (0, 6), (1, 4), (30, 6)])
def test_make_choices(answer: int, n: int) -> None:
    for seed in range(20):
        choices = make_choices(np.random.default_rng(seed), answer, n)
        assert len(set(choices)) == n and choices.count(answer) == 1 and min(choices) >= 0


def test_number_scope_scores_free_form_numbers_only(tmp_path: Path) -> None:
    rows = rows_of(tmp_path, 40, multiple_choice=0.5, subtasks=["perimeter"])
    assert {r["question_type"] for r in rows} == {FREE_FORM, MULTI_CHOICE}
    scopes = [scope_pattern(r["number_scope"], "visual_math", "test") for r in rows]
    tok = load_tokenizer("char")
    _, masks = piece_masks(tok, [r["completion"] for r in rows], scopes,
                           add_special_tokens=False)
    for r, mask in zip(rows, masks, strict=True):
        if r["question_type"] == FREE_FORM:
            assert mask and all(mask)  # every digit of the answer is scored
        else:
            assert not any(mask)  # the option letter is no quantity
    assert re.compile(NO_NUMBERS[len("regex:"):]).search("A 12") is None


@pytest.mark.parametrize("params,match", [
    ({"subtasks": ["pie"]}, "subtasks"),
    ({"subtasks": []}, "subtasks"),
    ({"subtasks": ["count", "count"]}, "subtasks"),
    ({"max_value": 1}, "max_value"),
    ({"max_value": 3.5}, "max_value"),
    ({"n_bars": 0}, "n_bars"),
    ({"n_bars": 7}, "n_bars"),
    ({"n_bars": 1, "subtasks": ["bar_difference"]}, "bar_difference"),
    ({"multiple_choice": 1.5}, "multiple_choice"),
    ({"n_choices": 1}, "n_choices"),
    ({"n_choices": 7}, "n_choices"),
    ({"noise": -1.0}, "noise"),
    ({"supersample": 5}, "supersample"),
    ({"image_size": 32}, "image_size"),
    ({"test_fraction": 0.0}, "test_fraction"),
])
def test_bad_parameters(tmp_path: Path, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rows_of(tmp_path, 2, **params)
    with pytest.raises(ValueError, match="visual_math"):
        rows_of(tmp_path, 2, colour="red")

