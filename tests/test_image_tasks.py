"""Image task generators (clock, grounding, text_detection): row format, determinism, cache reuse,
train/test disjointness, answers that match the pixels, contact sheets (of math answers too),
and the numbers inside the answers as find_number_spans reads them on every named tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from emdlm.contact_sheet import (
    CAPTION_H,
    GOLD,
    LEGEND_H,
    PAD,
    WRONG,
    make_contact_sheet,
    sheet_size,
)
from emdlm.metrics.boxes import answer_box_to_pixels, parse_boxes, reading_order
from emdlm.number_spans import SpanOptions, find_number_spans
from emdlm.numbers import NumberVocab
from emdlm.tasks import available_tasks, generate_task
from emdlm.tasks.clock import hand_angles, render_clock, split_times
from emdlm.tasks.grounding import SHAPES, SIZES
from emdlm.tasks.render import COLORS, background
from emdlm.tasks.text_detection import render_words

TASKS = ("clock", "grounding", "text_detection")
SMALL = {
    "clock": {"image_size": 48},
    "grounding": {"image_size": 64},
    "text_detection": {"image_size": 64, "max_words": 3},
}


def pixels(path: str) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_tasks_are_registered() -> None:
    assert set(TASKS) <= set(available_tasks())


@pytest.mark.parametrize("task", TASKS)
def test_rows_deterministic_cached_and_prefix_stable(task: str, tmp_path: Path) -> None:
    rows = generate_task(task, n=5, split="train", seed=7, cache_dir=tmp_path / "a", **SMALL[task])
    size = SMALL[task]["image_size"]
    for row in rows:
        assert Path(row["image"]).is_absolute() and row["image"].endswith(".png")
        with Image.open(row["image"]) as im:
            assert im.format == "PNG" and im.size == (size, size)
        assert isinstance(row["prompt"], str) and row["prompt"]
        assert isinstance(row["completion"], str) and row["completion"]
    # Same arguments, fresh folder: same answers and the same pixels.
    again = generate_task(task, n=5, split="train", seed=7, cache_dir=tmp_path / "b", **SMALL[task])
    assert [r["completion"] for r in again] == [r["completion"] for r in rows]
    for r1, r2 in zip(rows, again, strict=True):
        assert np.array_equal(pixels(r1["image"]), pixels(r2["image"]))
    # Example k depends only on (seed, split, k): a smaller set is a prefix of a bigger one.
    first3 = generate_task(
        task, n=3, split="train", seed=7, cache_dir=tmp_path / "c", **SMALL[task]
    )
    assert [r["completion"] for r in first3] == [r["completion"] for r in rows[:3]]
    # A second call on the complete folder reuses the PNGs (nothing is rewritten).
    stamps = [Path(r["image"]).stat().st_mtime_ns for r in rows]
    reused = generate_task(
        task, n=4, split="train", seed=7, cache_dir=tmp_path / "a", **SMALL[task]
    )
    assert [Path(r["image"]).stat().st_mtime_ns for r in reused] == stamps[:4]
    assert reused == rows[:4]
    # Another seed or other parameters in the same folder: regenerated, not stale rows.
    other = generate_task(task, n=5, split="train", seed=8, cache_dir=tmp_path / "a", **SMALL[task])
    assert [r["completion"] for r in other] != [r["completion"] for r in rows]


def test_default_cache_folder_under_emdlm_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EMDLM_CACHE", str(tmp_path))
    rows = generate_task("clock", n=2, seed=1, image_size=48)
    assert Path(rows[0]["image"]).is_relative_to(tmp_path / "images" / "clock")


def test_clock_answers_and_disjoint_splits(tmp_path: Path) -> None:
    train, test = split_times("train", 0.2), split_times("test", 0.2)
    assert not set(train) & set(test) and len(train) + len(test) == 720
    assert 0.1 < len(test) / 720 < 0.3
    rows = {
        split: generate_task(
            "clock", n=20, split=split, seed=0, cache_dir=tmp_path / split, image_size=48
        )
        for split in ("train", "test")
    }
    times = {s: {r["completion"] for r in rs} for s, rs in rows.items()}
    assert not times["train"] & times["test"]
    for r in rows["train"] + rows["test"]:
        m = re.fullmatch(r"(\d{1,2})_(\d{2})", r["completion"])
        assert m and 1 <= int(m.group(1)) <= 12 and int(m.group(2)) < 60
        assert r["time"] == r["completion"]
    assert hand_angles(2, 55) == (87.5, 330.0)
    assert hand_angles(12, 0) == (0.0, 0.0)


def test_clock_minute_step_keeps_each_times_split(tmp_path: Path) -> None:
    """minute_step=5: only five-minute marks, each time in the split it has with step 1."""
    train5, test5 = split_times("train", 0.2, 5), split_times("test", 0.2, 5)
    assert len(train5) + len(test5) == 144 and all(m % 5 == 0 for _, m in train5 + test5)
    assert set(train5) <= set(split_times("train", 0.2)) and set(test5) <= set(
        split_times("test", 0.2)
    )
    rows = generate_task("clock", n=30, minute_step=15, cache_dir=tmp_path, image_size=48)
    assert {int(r["completion"].split("_")[1]) for r in rows} <= {0, 15, 30, 45}
    for bad in (0, 7, 2.5):
        with pytest.raises(ValueError, match="minute_step"):
            generate_task("clock", n=1, minute_step=bad, cache_dir=tmp_path)


def test_clock_plain_palette_has_fixed_colours(tmp_path: Path) -> None:
    """palette="plain": every face is white on grey with a red minute hand whatever the rng
    (only sizes and tick counts vary); "random" colours differ; unknown palettes are errors."""
    from emdlm.tasks.clock import PLAIN

    kw = {"jitter": 0.0, "noise": 0.0, "clutter": 0, "dial_styles": ("ticks",),
          "hand_shapes": ("line",), "image_size": 64}
    a = np.asarray(render_clock(np.random.default_rng(1), 3, 0, palette="plain", **kw))
    b = np.asarray(render_clock(np.random.default_rng(2), 3, 0, palette="plain", **kw))
    for img in (a, b):
        assert tuple(img[1, 1]) == PLAIN["background"] and tuple(img[40, 20]) == PLAIN["face"]
        r, g, _ = (int(v) for v in img[18, 32])  # the minute hand at 12, above the centre
        assert r > 150 and g < 90
    c = np.asarray(render_clock(np.random.default_rng(2), 3, 0, **kw))
    assert tuple(c[1, 1]) != PLAIN["background"]
    wide = np.asarray(render_clock(np.random.default_rng(1), 3, 0, palette="plain",
                                   hand_width=3.0, **kw))
    red = (a[..., 0] > 150) & (a[..., 1] < 90)
    red_wide = (wide[..., 0] > 150) & (wide[..., 1] < 90)
    assert red_wide.sum() > 1.5 * red.sum()
    with pytest.raises(ValueError, match="palette"):
        generate_task("clock", n=1, palette="pastel", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="hand_width"):
        generate_task("clock", n=1, hand_width=0.0, cache_dir=tmp_path)


def test_clock_reading_accuracy_splits_hour_and_minutes() -> None:
    from emdlm.tasks.clock import reading_accuracy

    got = reading_accuracy(["2_55", "12_00", "x", "3_15"], ["2_50", "12_05", "1_00", "4_15"])
    assert got == {"hour_accuracy": 0.5, "minute_accuracy": 0.25}  # "x": wrong on both
    with pytest.raises(ValueError, match="H_MM"):
        reading_accuracy(["1_00"], ["one"])
    with pytest.raises(ValueError, match="predictions"):
        reading_accuracy(["1_00"], [])


def test_clock_bad_parameters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="image_size"):
        generate_task("clock", n=1, image_size=8, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="dial_styles"):
        generate_task("clock", n=1, dial_styles=["roman"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="bad parameters for task 'clock'"):
        generate_task("clock", n=1, colour="red", cache_dir=tmp_path)


def _denoted(expr: str, objects: list[dict[str, Any]]) -> list[int]:
    """An independent reading of a generated expression: the objects it can denote."""
    words = expr.split()
    shape = next(w for w in words if w in SHAPES)
    color = next((w for w in words if w in COLORS), None)
    size = next((w for w in words if w in SIZES), None)
    cands = [
        i
        for i, o in enumerate(objects)
        if o["shape"] == shape and color in (None, o["color"]) and size in (None, o["size"])
    ]
    side = next((s for s in ("left", "right", "top", "bottom") if s in expr), None)
    if side is None:
        return cands
    axis = 0 if side in ("left", "right") else 1
    sign = -1 if side in ("left", "top") else 1

    def centre(i: int) -> float:
        b = objects[i]["box"]
        return sign * (b[axis] + b[axis + 2]) / 2

    best = max(cands, key=centre)
    return [best] if all(centre(best) > centre(j) for j in cands if j != best) else cands


@pytest.mark.parametrize("box_format", ["qwen2vl", "llava"])
def test_grounding_expressions_unambiguous_and_boxes_exact(box_format: str, tmp_path: Path) -> None:
    rows = generate_task(
        "grounding",
        n=20,
        split="train",
        seed=3,
        cache_dir=tmp_path,
        image_size=64,
        noise=0.0,
        box_format=box_format,
    )
    pattern = (
        r"\(\d+,\d+\),\(\d+,\d+\)"
        if box_format == "qwen2vl"
        else (r"\[\d\.\d{3}, \d\.\d{3}, \d\.\d{3}, \d\.\d{3}\]")
    )
    for r in rows:
        assert re.fullmatch(pattern, r["completion"])
        assert r["expression"] in r["prompt"]
        target = r["objects"][0]
        assert _denoted(r["expression"], r["objects"]) == [0], r["expression"]
        assert r["boxes"] == [target["box"]]
        # The answer maps back to the target's pixel box within the format's rounding.
        (ans,) = parse_boxes(r["completion"])
        assert answer_box_to_pixels(ans, 64, 64, box_format) == pytest.approx(
            target["box"], abs=0.07
        )
    # Some scenes need a position to single the target out ("... on the left", "the topmost").
    assert any(" the " in r["expression"][4:] or "most " in r["expression"] for r in rows)


def test_grounding_box_is_the_tight_box_of_the_drawn_shape(tmp_path: Path) -> None:
    # One object, no noise: the dark outline's pixels span exactly the answer's box.
    rows = generate_task(
        "grounding",
        n=12,
        seed=5,
        cache_dir=tmp_path,
        image_size=64,
        min_objects=1,
        max_objects=1,
        noise=0.0,
    )
    for r in rows:
        dark = pixels(r["image"]).max(axis=2) <= 45
        ys, xs = np.nonzero(dark)
        x1, y1, x2, y2 = r["boxes"][0]
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x1, y1, x2, y2)
        # Alone in the scene: never a position, only (possibly redundant) attributes.
        obj = r["objects"][0]
        assert r["expression"].split()[-1] == obj["shape"]
        assert set(r["expression"].split()[1:-1]) <= {obj["color"], obj["size"]}


def test_grounding_and_text_splits_disjoint(tmp_path: Path) -> None:
    for task in ("grounding", "text_detection"):
        sets = {
            s: generate_task(
                task, n=15, split=s, seed=0, cache_dir=tmp_path / task / s, image_size=64
            )
            for s in ("train", "test")
        }
        answers = {s: {(r["prompt"], r["completion"]) for r in rs} for s, rs in sets.items()}
        assert not answers["train"] & answers["test"]


def test_text_detection_ink_boxes_are_tight() -> None:
    s = 96
    for k in range(6):
        rng = np.random.default_rng([11, k])
        bg = np.asarray(background(np.random.default_rng([11, k]), (s, s)), dtype=np.int16)
        image, words, boxes, _ = render_words(rng, s, 4, clutter=0)
        ink = np.abs(np.asarray(image, dtype=np.int16) - bg).max(axis=2) > 40
        assert 1 <= len(words) <= 4
        covered = np.zeros_like(ink)
        for x1, y1, x2, y2 in boxes:
            covered[y1:y2, x1:x2] = True
            ys, xs = np.nonzero(ink[y1:y2, x1:x2])
            # Each box is the tight box of its word's ink (anti-aliased edges may be faint).
            assert xs.min() <= 1 and ys.min() <= 1
            assert xs.max() >= x2 - x1 - 2 and ys.max() >= y2 - y1 - 2
        assert not (ink & ~covered).any()  # no ink outside the boxes


def test_text_detection_rows(tmp_path: Path) -> None:
    rows = generate_task(
        "text_detection",
        n=10,
        seed=2,
        cache_dir=tmp_path,
        image_size=64,
        min_words=2,
        max_words=3,
        box_format="llava",
    )
    for r in rows:
        boxes = parse_boxes(r["completion"])
        assert boxes is not None and len(boxes) == len(r["boxes"]) == len(r["words"])
        assert 1 <= len(boxes) <= 3
        assert reading_order(r["boxes"]) == list(range(len(r["boxes"])))
        assert r["completion"].count("; ") == len(boxes) - 1
        for ans, px in zip(boxes, r["boxes"], strict=True):
            assert answer_box_to_pixels(ans, 64, 64, "llava") == pytest.approx(px, abs=0.04)
    with pytest.raises(ValueError, match="box_format"):
        generate_task("text_detection", n=1, box_format="coco", cache_dir=tmp_path)


# ----------------------------------------------------------------------------- contact sheets
@pytest.mark.parametrize(
    ("task", "kind"), [("clock", "clock"), ("grounding", "box"), ("text_detection", "boxes")]
)
def test_contact_sheet_png_of_expected_size(task: str, kind: str, tmp_path: Path) -> None:
    rows = generate_task(task, n=5, seed=1, cache_dir=tmp_path / "img", **SMALL[task])
    preds = [r["completion"] for r in rows[:3]] + ["garbage", ""]
    out = make_contact_sheet(
        rows, preds, tmp_path / "sheet" / "s.png", kind=kind, columns=4, thumb=64
    )
    with Image.open(out) as im:
        im.verify()
    with Image.open(out) as im:
        assert im.format == "PNG"
        cell = 64 + 2 * PAD
        assert im.size == (4 * cell, LEGEND_H + 2 * (cell + CAPTION_H)) == (288, 226)
        arr = np.asarray(im.convert("RGB"))
    # The first thumbnail is the first image, scaled (not a blank cell).
    assert arr[LEGEND_H + PAD : LEGEND_H + PAD + 64, PAD : PAD + 64].std() > 5
    with pytest.raises(ValueError, match="predictions"):
        make_contact_sheet(rows, preds[:2], tmp_path / "x.png", kind=kind)
    with pytest.raises(ValueError, match="kind"):
        make_contact_sheet(rows, preds, tmp_path / "x.png", kind="mask")


def test_contact_sheet_draws_gold_and_predicted_boxes(tmp_path: Path) -> None:
    rows = generate_task("grounding", n=1, seed=4, cache_dir=tmp_path / "img", image_size=64)
    out = make_contact_sheet(
        rows, ["(0,0),(1000,1000)"], tmp_path / "s.png", kind="box", columns=1, thumb=64
    )
    arr = np.asarray(Image.open(out).convert("RGB")).astype(int)
    y0, x0 = LEGEND_H + PAD, PAD
    # The predicted box is the whole image: its magenta frame runs along the thumbnail's edge.
    edge = arr[y0 + 10 : y0 + 54, x0]
    assert (np.abs(edge - [255, 0, 255]).max(axis=1) < 30).all()


def _caption_colors(arr: np.ndarray, column: int, row: int, thumb: int) -> set[str]:
    """Which of the two verdict colours the second caption line of a cell is drawn in."""
    cell = thumb + 2 * PAD
    y = LEGEND_H + row * (cell + CAPTION_H) + cell + 14
    strip = arr[y : y + 14, column * cell : (column + 1) * cell].astype(int)
    found = set()
    for name, rgb in (("right", GOLD), ("wrong", WRONG)):
        if (np.abs(strip - np.array(rgb)).max(axis=-1) < 40).sum() >= 5:
            found.add(name)
    return found


def test_contact_sheet_of_math_answers(tmp_path: Path) -> None:
    """Kind ``math`` from MathVista-like fixture rows: figure, question, gold and prediction,
    the verdict green or red as the math scoring reads the prediction."""
    colours = ["red", "blue", "green", "orange", "purple"]
    rows = []
    for i, c in enumerate(colours):
        path = tmp_path / "img" / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.new("RGB", (120, 80), c).save(path)
        rows.append({"image": str(path), "prompt": f"What is bar {i}? Answer with a number.",
                     "completion": "12", "question_type": "free_form",
                     "answer_type": "integer"})
    rows[0] = {**rows[0], "prompt": "Which is larger?\n(A) 3 (B) 4.5", "completion": "B",
               "question_type": "multi_choice", "answer_type": "float", "choices": ["3", "4.5"]}
    rows[1] = {**rows[1], "completion": "1.50", "answer_type": "float", "precision": 2}
    preds = ["4.5", "1.5", "13", "12", "no idea"]  # right, right, wrong, right, unparsed
    out = make_contact_sheet(rows, preds, tmp_path / "sheet" / "math.png", kind="math",
                             columns=3, thumb=96)
    assert out.is_file() and out.stat().st_size > 1000
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == sheet_size(5, 3, 96) == (312, 22 + 2 * 134)
        arr = np.asarray(im.convert("RGB"))
    verdicts = [_caption_colors(arr, i % 3, i // 3, 96) for i in range(5)]
    assert verdicts == [{"right"}, {"right"}, {"wrong"}, {"right"}, {"wrong"}]
    # each thumbnail is its figure (a uniform colour, letterboxed into the square)
    cell = 96 + 2 * PAD
    y = LEGEND_H + PAD + 48
    assert tuple(arr[y, PAD + 48]) == (255, 0, 0)
    assert tuple(arr[LEGEND_H + cell + CAPTION_H + PAD + 48, PAD + 48]) == (255, 165, 0)


# ----------------------------------------------------------------------------- numbers
PAPER = {"join_decimal": True, "signed": True}
LITERAL = {
    "(123,456),(789,12)": [123, 456, 789, 12],
    "[0.125, 0.5, 0.875, 1.0]": [0.125, 0.5, 0.875, 1.0],
    "2_55": [2, 55],
    "(0,0),(1000,1000); (94,500),(250,1000)": [0, 0, 1000, 1000, 94, 500, 250, 1000],
}


def _expected(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"\d+(?:\.\d+)?", text)]


def _answers(tmp_path: Path) -> dict[str, list[float]]:
    out = {k: [float(x) for x in v] for k, v in LITERAL.items()}
    for task, fmt in (
        ("clock", None),
        ("grounding", "qwen2vl"),
        ("grounding", "llava"),
        ("text_detection", "qwen2vl"),
        ("text_detection", "llava"),
    ):
        params = dict(SMALL[task]) | ({"box_format": fmt} if fmt else {})
        for r in generate_task(task, n=3, seed=0, cache_dir=tmp_path / f"{task}-{fmt}", **params):
            out[r["completion"]] = _expected(r["completion"])
    return out


@pytest.mark.parametrize("name", ["char", "gpt2", "qwen", "llama3-like"])
def test_find_number_spans_reads_task_answers(name: str, request, tmp_path: Path) -> None:
    prefix = {"char": "char", "gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}[name]
    tok = request.getfixturevalue(f"{prefix}_tokenizer")
    vocab: NumberVocab = request.getfixturevalue(f"{prefix}_vocab")
    answers = _answers(tmp_path)
    assert _expected("[0.125, 0.5, 0.875, 1.0]") == LITERAL["[0.125, 0.5, 0.875, 1.0]"]
    for text, want in answers.items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        spans = find_number_spans(torch.tensor([ids]), vocab, SpanOptions(**PAPER))
        assert spans.gold_value.tolist() == pytest.approx(want), (name, text)


def test_clock_hands_point_at_the_answer() -> None:
    """On plain tick dials (no noise, clutter or jitter) the pixels along each hand's angle
    differ from the face and the opposite side is bare face: the drawn time is the answer."""
    s = 128
    rnd = np.random.default_rng(0)
    for k in range(12):
        hour, minute = int(rnd.integers(1, 13)), int(rnd.integers(0, 60))
        img = render_clock(
            np.random.default_rng([5, k]),
            hour,
            minute,
            image_size=s,
            jitter=0.0,
            noise=0.0,
            clutter=0,
            dial_styles=("ticks",),
            hand_shapes=("line",),
        )
        arr = np.asarray(img, dtype=int)
        radius = 0.45 * s

        def at(r: float, deg: float, arr: np.ndarray = arr) -> np.ndarray:
            a = np.radians(deg)  # clockwise from 12 o'clock around the centre (s/2, s/2)
            return arr[int(s / 2 - r * np.cos(a)), int(s / 2 + r * np.sin(a))]

        hour_deg, minute_deg = hand_angles(hour, minute)
        free = next(
            d
            for d in range(0, 360, 5)
            if all(abs((d - h + 180) % 360 - 180) > 40 for h in (hour_deg, minute_deg))
        )
        face = at(0.5 * radius, free)
        # Only the minute hand reaches 0.7 R (the hour hand stops at 0.55 R, ticks begin at 0.82 R).
        assert np.abs(at(0.7 * radius, minute_deg) - face).max() > 40, (hour, minute)
        assert np.abs(at(0.7 * radius, minute_deg + 180) - face).max() < 10, (hour, minute)
        if abs((hour_deg - minute_deg + 180) % 360 - 180) > 40:
            assert np.abs(at(0.35 * radius, hour_deg) - face).max() > 40, (hour, minute)
            assert np.abs(at(0.35 * radius, hour_deg + 180) - face).max() < 10, (hour, minute)


def test_cache_extends_a_smaller_set(tmp_path: Path) -> None:
    small = generate_task("grounding", n=3, seed=2, cache_dir=tmp_path, image_size=64)
    stamps = [Path(r["image"]).stat().st_mtime_ns for r in small]
    big = generate_task("grounding", n=6, seed=2, cache_dir=tmp_path, image_size=64)
    assert big[:3] == small  # the cached prefix is kept as it is ...
    assert [Path(r["image"]).stat().st_mtime_ns for r in big[:3]] == stamps  # ... not redrawn
    fresh = generate_task("grounding", n=6, seed=2, cache_dir=tmp_path / "f", image_size=64)
    assert [r["completion"] for r in fresh] == [r["completion"] for r in big]
    Path(big[4]["image"]).unlink()  # a damaged cache is repaired from the first missing file
    again = generate_task("grounding", n=6, seed=2, cache_dir=tmp_path, image_size=64)
    assert Path(again[4]["image"]).is_file() and again == big


def test_cache_shared_by_concurrent_writers_renders_once_and_stays_whole(tmp_path: Path) -> None:
    """Two cells of the experiment runner asking for the same images at once: one renders,
    the other waits and reads its manifest; no reader ever opens a half-written PNG (the
    failure seen in a clock grid: 'cannot read image ...: Truncated File Read')."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from emdlm.tasks.render import cached_rows

    calls: list[int] = []
    lock = threading.Lock()

    def make(k: int) -> tuple[Image.Image, dict[str, Any]]:
        with lock:
            calls.append(k)
        time.sleep(0.005)
        return Image.new("RGB", (16, 16), (k, 0, 0)), {"prompt": "p", "completion": str(k)}

    folder = tmp_path / "shared"
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: cached_rows("t", {"x": 1}, 12, make, folder), range(2))
    assert first == second and len(first) == 12
    assert sorted(calls) == list(range(12))  # rendered once, not once per writer
    for k, row in enumerate(first):
        with Image.open(row["image"]) as image:
            assert image.getpixel((0, 0)) == (k, 0, 0)
    assert not list(folder.glob("*.tmp"))  # every temporary file was renamed into place
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in folder.iterdir() if p.name != ".lock")
