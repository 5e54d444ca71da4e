"""Visual grounding on synthetic scenes: "the small red circle" -> its box.

A scene holds ``min_objects``..``max_objects`` shapes (circle, square, triangle, diamond) in six
colours and two size classes ("small": 8-13 % of the image side, "large": 20-28 %), placed at
random and allowed to overlap up to ``max_overlap`` (IoU of their boxes) on a solid or gradient
background with Gaussian pixel noise. One object is the target; the expression naming it is drawn
among those that pick exactly that object in the scene (checked by :func:`resolve`):

* attributes: "the circle", "the red circle", "the small circle", "the small red circle";
* position among the objects matching the attributes: "the red circle on the left" or "the
  red circle at the top" (two match,
  centres apart by more than the larger one's width) or "the leftmost red circle" (three or
  more, the target's centre beyond every other's by that margin); likewise right, top, bottom.

Answer: the target's tight box in the model family's format (``box_format``, see
:mod:`emdlm.metrics.boxes`): ``(x1,y1),(x2,y2)`` on a 0..1000 grid (Qwen2-VL, default) or
``[x1, y1, x2, y2]`` as 3-decimal fractions (LLaVA).

Train/test disjointness: a scene's hash (shapes, colours, sizes, positions in pixels, target,
expression; seed-independent) decides its split, and the two splits draw from separate seed
streams. Example k depends only on (seed, split, k).

Throughput (one thread, image_size=128, 3-6 objects, rendering + PNG writing, 2-core CPU
shared with other jobs, load average ~5): about 140-170 images/s.
Measured by timing ``generate_task("grounding", n=300, cache_dir=<a fresh folder>)``
after a 2-image warm-up, under ``OMP_NUM_THREADS=1 taskset -c 0``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from emdlm.domains import Domain
from emdlm.metrics.boxes import box_iou, check_box_format, format_box
from emdlm.tasks import register_task
from emdlm.tasks.render import (
    BOX_ANSWER_PATTERN,
    COLORS,
    NOISE,
    add_noise,
    background,
    generated_rows,
    image_task_domains,
    unit_hash,
)

SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = {"small": (0.08, 0.13), "large": (0.20, 0.28)}  # box side as a fraction of the image
_SIDES = {"left": (0, -1), "right": (0, 1), "top": (1, -1), "bottom": (1, 1)}  # (axis, sign)
_EXTREME = {"left": "leftmost", "right": "rightmost", "top": "topmost", "bottom": "bottom-most"}
PROMPTS = {
    "qwen2vl": "Locate {expr} in the image. Answer with its box as (x1,y1),(x2,y2) on a "
    "0-1000 grid.",
    "llava": "Locate {expr} in the image. Answer with its box as [x1, y1, x2, y2] in "
    "fractions of the image size.",
}


@dataclass(frozen=True)
class SceneObject:
    """One shape of a scene: attributes and its box (x1, y1, x2, y2) in pixels."""

    shape: str
    color: str
    size: str
    box: tuple[int, int, int, int]

    @property
    def center(self) -> tuple[float, float]:
        return ((self.box[0] + self.box[2]) / 2.0, (self.box[1] + self.box[3]) / 2.0)


@dataclass(frozen=True)
class Expression:
    """A referring expression: attributes (None = not said) and an optional relative position."""

    shape: str
    color: str | None = None
    size: str | None = None
    side: str | None = None  # "left", "right", "top" or "bottom"

    def text(self, n_matching: int) -> str:
        """The English phrase; ``n_matching`` objects share the attributes (it picks the form of
        a position: "on the left" for two, "leftmost" for more)."""
        words = " ".join(w for w in (self.size, self.color, self.shape) if w)
        if self.side is None:
            return f"the {words}"
        if n_matching == 2:
            where = "on" if self.side in ("left", "right") else "at"
            return f"the {words} {where} the {self.side}"
        return f"the {_EXTREME[self.side]} {words}"


def _matches(expr: Expression, obj: SceneObject) -> bool:
    return (
        obj.shape == expr.shape
        and (expr.color is None or obj.color == expr.color)
        and (expr.size is None or obj.size == expr.size)
    )


def resolve(expr: Expression, objects: list[SceneObject]) -> list[int]:
    """Indices of the objects ``expr`` can denote in the scene (exactly one when unambiguous).

    Without a position: every object with the attributes. With one: the object among them
    whose centre lies beyond every other's along the side by more than the larger of the two
    objects' extents on that axis; none if no object is clearly the extreme one.
    """
    cands = [i for i, o in enumerate(objects) if _matches(expr, o)]
    if expr.side is None or len(cands) < 2:
        return cands if expr.side is None else []
    axis, sign = _SIDES[expr.side]
    for i in cands:
        ci = sign * objects[i].center[axis]
        clear = True
        for j in cands:
            if j == i:
                continue
            extent = max(
                objects[i].box[axis + 2] - objects[i].box[axis],
                objects[j].box[axis + 2] - objects[j].box[axis],
            )
            if ci - sign * objects[j].center[axis] <= extent:
                clear = False
                break
        if clear:
            return [i]
    return []


def unambiguous_expressions(objects: list[SceneObject], target: int) -> list[Expression]:
    """Every expression form (attributes, then attributes + position) that picks ``target``."""
    t = objects[target]
    out = []
    for color in (None, t.color):
        for size in (None, t.size):
            base = Expression(t.shape, color, size)
            if resolve(base, objects) == [target]:
                out.append(base)
                continue
            for side in _SIDES:
                expr = Expression(t.shape, color, size, side)
                if resolve(expr, objects) == [target]:
                    out.append(expr)
    return out


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, outline: tuple[int, int, int]):
    x1, y1, x2, y2 = obj.box
    fill = COLORS[obj.color]
    # The box is the tight box of the drawn pixels: shapes touch all four sides.
    if obj.shape == "circle":
        draw.ellipse([x1, y1, x2 - 1, y2 - 1], fill=fill, outline=outline)
    elif obj.shape == "square":
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=fill, outline=outline)
    elif obj.shape == "triangle":
        draw.polygon(
            [((x1 + x2 - 1) / 2, y1), (x2 - 1, y2 - 1), (x1, y2 - 1)], fill=fill, outline=outline
        )
    else:  # diamond
        mx, my = (x1 + x2 - 1) / 2, (y1 + y2 - 1) / 2
        draw.polygon([(mx, y1), (x2 - 1, my), (mx, y2 - 1), (x1, my)], fill=fill, outline=outline)


def sample_scene(
    rng: np.random.Generator, image_size: int, n_objects: int, max_overlap: float
) -> list[SceneObject]:
    """``n_objects`` shapes with random attributes and boxes whose pairwise IoU <= max_overlap
    (fewer if placement keeps failing)."""
    objects: list[SceneObject] = []
    for _ in range(n_objects * 20):
        if len(objects) == n_objects:
            break
        size = ("small", "large")[int(rng.integers(2))]
        lo, hi = SIZES[size]
        side = max(4, round(float(image_size * rng.uniform(lo, hi))))
        x1 = int(rng.integers(0, image_size - side + 1))
        y1 = int(rng.integers(0, image_size - side + 1))
        box = (x1, y1, x1 + side, y1 + side)
        if any(box_iou(box, o.box) > max_overlap for o in objects):
            continue
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        objects.append(SceneObject(shape, color, size, box))
    return objects


def render_scene(
    rng: np.random.Generator, objects: list[SceneObject], image_size: int, noise: float
) -> Image.Image:
    """Draw ``objects`` in order (later ones on top) on a pale random background."""
    img = background(rng, (image_size, image_size), 200, 256)
    draw = ImageDraw.Draw(img)
    for obj in objects:
        _draw_object(draw, obj, (40, 40, 40))
    return add_noise(img, rng, noise * rng.random())


#: The legal values of the grounding task's numeric parameters (emdlm.domains); the body checks
#: ``min_objects <= max_objects``.
GROUNDING_DOMAINS: dict[str, Domain] = {
    **image_task_domains(48),
    "min_objects": Domain(low=1, high=12, integer=True),
    "max_objects": Domain(low=1, high=12, integer=True),
    "max_overlap": Domain(low=0.0, high=0.5),
    "noise": NOISE,
}


@register_task("grounding", answer_pattern=BOX_ANSWER_PATTERN, eval_kind="box",
               domains=GROUNDING_DOMAINS)
def grounding(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    image_size: int = 128,
    min_objects: int = 3,
    max_objects: int = 6,
    max_overlap: float = 0.1,
    noise: float = 6.0,
    box_format: str = "qwen2vl",
    test_fraction: float = 0.2,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows ``{"image", "prompt", "completion", "expression", "boxes", "box_format",
    "objects"}``: ``completion`` is the target's box text, ``boxes`` its pixel box in a list,
    ``objects`` every object of the scene (shape, color, size, box) with the target first.

    Args:
        n: number of examples.
        split: "train" or "test" (disjoint scenes; see the module docstring).
        seed: the same arguments give the same images.
        image_size: side of the square image in pixels (>= 48).
        min_objects, max_objects: objects per scene, 1 <= min <= max <= 12.
        max_overlap: largest IoU between two objects' boxes, in [0, 0.5] (overlapping shapes
            stay identifiable).
        noise: largest standard deviation of the Gaussian pixel noise (0..255 units).
        box_format: "qwen2vl" or "llava" (see :mod:`emdlm.metrics.boxes`).
        test_fraction: share of scene hashes reserved for the test split, in (0, 1).
        cache_dir: folder for the PNGs (default: under ``$EMDLM_CACHE/images/grounding``).
    """
    check_box_format(box_format)
    if not 1 <= min_objects <= max_objects <= 12:
        raise ValueError(
            f"need 1 <= min_objects <= max_objects <= 12, got {min_objects}, {max_objects}"
        )
    params = {
        "image_size": image_size,
        "min_objects": min_objects,
        "max_objects": max_objects,
        "max_overlap": max_overlap,
        "noise": noise,
        "box_format": box_format,
    }
    want_test = split == "test"

    def make(rng: np.random.Generator) -> tuple[Image.Image, dict[str, Any]]:
        for _ in range(1000):  # rejection: an unambiguous target in this split's half
            count = int(rng.integers(min_objects, max_objects + 1))
            objects = sample_scene(rng, image_size, count, max_overlap)
            target = int(rng.integers(len(objects)))
            exprs = unambiguous_expressions(objects, target)
            if not exprs:
                continue
            expr = exprs[int(rng.integers(len(exprs)))]
            n_match = sum(
                _matches(Expression(expr.shape, expr.color, expr.size), o) for o in objects
            )
            phrase = expr.text(n_match)
            scene = [[o.shape, o.color, o.size, list(o.box)] for o in objects]
            if (unit_hash(["grounding", scene, target, phrase]) < test_fraction) != want_test:
                continue
            break
        else:  # pragma: no cover - only for degenerate parameters
            raise ValueError(f"could not draw an unambiguous scene with parameters {params}")
        image = render_scene(rng, objects, image_size, noise)
        box = objects[target].box
        ordered = [objects[target]] + [o for i, o in enumerate(objects) if i != target]
        row = {
            "prompt": PROMPTS[box_format].format(expr=phrase),
            "completion": format_box(box, image_size, image_size, box_format),
            "expression": phrase,
            "boxes": [list(box)],
            "box_format": box_format,
            "objects": [asdict(o) | {"box": list(o.box)} for o in ordered],
        }
        return image, row

    return generated_rows("grounding", n, make, seed=seed, split=split,
                          test_fraction=test_fraction, params=params, cache_dir=cache_dir)
