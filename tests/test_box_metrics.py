"""Box formats, reading order, one-to-one box matching and the several-box metrics: hand-worked
cases, a brute-force matching oracle, and the ``boxes`` kind of compute_task_metrics."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from emdlm.metrics import box_iou, compute_task_metrics
from emdlm.metrics.boxes import (
    answer_box_to_pixels,
    boxes_metrics,
    format_box,
    format_boxes,
    match_boxes,
    parse_boxes,
    quad_bbox,
    reading_order,
    rotated_rect_bbox,
)


def strip(x1: float, x2: float) -> tuple[float, float, float, float]:
    """A box spanning [x1, x2] horizontally and [0, 1] vertically (IoU = interval IoU)."""
    return (x1, 0.0, x2, 1.0)


# ----------------------------------------------------------------------------- formats
def test_format_box_both_conventions() -> None:
    assert format_box((10, 20, 30, 40), 100, 200) == "(100,100),(300,200)"
    assert format_box((10, 20, 30, 40), 100, 200, "llava") == "[0.100, 0.100, 0.300, 0.200]"
    # Rounding to the grid, and clipping of boxes poking out of the image.
    assert format_box((0.4, 0, 33.35, 100), 100, 100) == "(4,0),(334,1000)"
    assert format_box((-5, -1, 120, 50), 100, 100, "llava") == "[0.000, 0.000, 1.000, 0.500]"
    assert format_boxes([], 10, 10) == "none"
    assert (
        format_boxes([(0, 0, 5, 5), (5, 5, 10, 10)], 10, 10)
        == "(0,0),(500,500); (500,500),(1000,1000)"
    )
    with pytest.raises(ValueError, match="box_format"):
        format_box((0, 0, 1, 1), 10, 10, "yolo")
    with pytest.raises(ValueError, match="positive"):
        format_box((0, 0, 1, 1), 0, 10)


def test_answer_box_to_pixels_inverts_format() -> None:
    assert answer_box_to_pixels((100, 100, 300, 200), 100, 200) == (10, 20, 30, 40)
    got = answer_box_to_pixels((0.1, 0.1, 0.3, 0.2), 100, 200, "llava")
    assert got == pytest.approx((10, 20, 30, 40))


def test_parse_boxes() -> None:
    assert parse_boxes("(1,2),(3,4); (5,6),(7,8)") == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert parse_boxes("[0.1, 0.2, 0.3, 0.4]\n[0.5, 0.6, 0.7, 0.8]") == [
        (0.1, 0.2, 0.3, 0.4),
        (0.5, 0.6, 0.7, 0.8),
    ]
    assert parse_boxes("(1,2),(3,4);") == [(1, 2, 3, 4)]  # a trailing separator is harmless
    assert parse_boxes("none") == [] and parse_boxes("  ") == [] and parse_boxes("None.") == []
    assert parse_boxes("(1,2),(3,4); oops") is None  # one bad part fails the whole answer
    assert parse_boxes("(1,2),(3,4),(5,6)") is None


def test_quad_and_rotated_rect_bboxes() -> None:
    assert quad_bbox([377, 117, 463, 117, 465, 130, 378, 130]) == (377, 117, 465, 130)
    with pytest.raises(ValueError, match="even number"):
        quad_bbox([1, 2, 3])
    assert rotated_rect_bbox(10, 20, 40, 10, 0.0) == pytest.approx((10, 20, 50, 30))
    # A 4 x 2 rectangle at (0, 0) turned a quarter: centre (2, 1), half-extents (1, 2).
    assert rotated_rect_bbox(0, 0, 4, 2, math.pi / 2) == pytest.approx((1, -1, 3, 3))
    # A 2 x 2 square turned 45 degrees: half-diagonal sqrt(2) around the centre (1, 1).
    r = math.sqrt(2)
    assert rotated_rect_bbox(0, 0, 2, 2, -math.pi / 4) == pytest.approx(
        (1 - r, 1 - r, 1 + r, 1 + r)
    )


def test_reading_order_lines_then_left_to_right() -> None:
    boxes = [
        (50, 52, 90, 70),  # line 2, right
        (60, 10, 90, 30),  # line 1, right (a little lower than its neighbour)
        (5, 55, 40, 68),  # line 2, left
        (0, 5, 40, 25),  # line 1, left
        (10, 100, 30, 120),  # line 3
    ]
    assert reading_order(boxes) == [3, 1, 2, 0, 4]
    assert reading_order([]) == []


# ----------------------------------------------------------------------------- matching
def test_matching_maximizes_the_number_of_matches() -> None:
    g1, g2 = strip(0, 10), strip(3, 13)
    a, b = strip(1, 11), strip(-2, 8)
    assert box_iou(a, g1) == pytest.approx(9 / 11)
    assert box_iou(a, g2) == pytest.approx(8 / 12)
    assert box_iou(b, g1) == pytest.approx(8 / 12)
    assert box_iou(b, g2) == pytest.approx(5 / 15)
    # Greedy by IoU would take (a, g1) first and then find nothing for b: one match.
    got = sorted(match_boxes([a, b], [g1, g2]))
    assert [(p, g) for p, g, _ in got] == [(0, 1), (1, 0)]
    assert [m[2] for m in got] == pytest.approx([8 / 12, 8 / 12])
    assert match_boxes([], [g1]) == [] and match_boxes([a], []) == []
    assert match_boxes([strip(20, 30)], [g1]) == []


def _brute_force(preds: list, golds: list, thr: float) -> tuple[int, float]:
    """(most matches, largest IoU sum among matchings with that many) by enumeration."""
    best = (0, 0.0)
    k = min(len(preds), len(golds))
    for chosen in itertools.permutations(range(len(golds)), k):
        for pred_idx in itertools.combinations(range(len(preds)), k):
            pairs = [(p, g) for p, g in zip(pred_idx, chosen, strict=True)]
            ious = [box_iou(preds[p], golds[g]) for p, g in pairs]
            good = [v for v in ious if v >= thr]
            best = max(best, (len(good), sum(good)))
    return best


def test_matching_equals_brute_force_oracle() -> None:
    rnd = random.Random(0)
    for _ in range(150):

        def box() -> tuple[float, float, float, float]:
            x, y = rnd.uniform(0, 6), rnd.uniform(0, 6)
            return (x, y, x + rnd.uniform(1, 4), y + rnd.uniform(1, 4))

        preds = [box() for _ in range(rnd.randint(0, 4))]
        golds = [box() for _ in range(rnd.randint(0, 4))]
        thr = rnd.choice([0.3, 0.5])
        got = match_boxes(preds, golds, thr)
        count, total = _brute_force(preds, golds, thr)
        assert len(got) == count
        assert sum(m[2] for m in got) == pytest.approx(total)
        assert len({m[0] for m in got}) == len(got) == len({m[1] for m in got})  # one-to-one


# ----------------------------------------------------------------------------- metrics
def test_boxes_metrics_hand_worked() -> None:
    refs = [
        "(0,0),(100,100); (200,200),(300,300)",
        "(0,0),(100,100)",
        "(500,500),(600,600)",
    ]
    preds = [
        "(0,0),(100,100); (200,200),(300,300)",  # both found
        "(0,0),(100,90); (700,700),(800,800)",  # one found (IoU 0.9), one invented
        "the box is somewhere",  # a parse failure: its gold box is missed
    ]
    out = boxes_metrics(preds, refs)
    assert out["precision"] == pytest.approx(3 / 4)
    assert out["recall"] == pytest.approx(3 / 4)
    assert out["f1"] == pytest.approx(3 / 4)
    assert out["image_exact"] == pytest.approx(1 / 3)
    assert out["mean_matched_iou"] == pytest.approx((1 + 1 + 0.9) / 3)
    assert out["parse_failure_rate"] == pytest.approx(1 / 3)
    assert (out["n_pred_boxes"], out["n_gold_boxes"], out["n"]) == (4, 4, 3)
    assert compute_task_metrics(preds, refs, "boxes") == out


def test_boxes_metrics_precision_recall_differ_and_edge_cases() -> None:
    # 1 hit out of 1 prediction, 3 gold boxes: P = 1, R = 1/3, F1 = 0.5.
    out = boxes_metrics(["(0,0),(10,10)"], ["(0,0),(10,10); (20,20),(30,30); (40,40),(50,50)"])
    assert (out["precision"], out["recall"], out["f1"]) == pytest.approx((1.0, 1 / 3, 0.5))
    # Nothing to find and nothing predicted: perfect, finite.
    out = boxes_metrics(["none"], ["none"])
    assert (out["precision"], out["recall"], out["f1"], out["image_exact"]) == (1, 1, 1, 1)
    assert math.isnan(out["mean_matched_iou"])
    # Only invented boxes: precision 0, F1 0.
    out = boxes_metrics(["(0,0),(5,5)"], ["none"])
    assert (out["precision"], out["f1"], out["image_exact"]) == (0.0, 0.0, 0.0)
    # Lists of coordinates work as answers too.
    assert boxes_metrics([[(0, 0, 1, 1)]], [[(0, 0, 1, 1)]])["f1"] == 1.0
    # A stricter threshold turns the IoU 0.9 match into a miss.
    assert boxes_metrics(["(0,0),(10,9)"], ["(0,0),(10,10)"], threshold=0.95)["f1"] == 0.0
    with pytest.raises(ValueError, match="threshold"):
        boxes_metrics(["none"], ["none"], threshold=0.0)
    with pytest.raises(ValueError, match="2 predictions but 1"):
        boxes_metrics(["none", "none"], ["none"])
    with pytest.raises(ValueError, match="reference 0"):
        boxes_metrics(["none"], ["garbage"])


def test_single_box_kind_keeps_its_keys() -> None:
    out = compute_task_metrics(["(0,0),(10,10)", "nope"], ["(0,0),(10,10)", "(0,0),(1,1)"], "box")
    assert out == {"acc_iou50": 0.5, "mean_iou": 0.5, "parse_failure_rate": 0.5, "n": 2}
