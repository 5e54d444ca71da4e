"""RefCOCO / RefCOCO+ / RefCOCOg in their own on-disk format -> grounding rows.

:func:`read_refcoco` reads the ``refs(unc).p`` / ``refs(google).p`` / ``refs(umd).p`` pickle of
lichengunc/refer (https://github.com/lichengunc/refer: a list of refs with ref_id, ann_id,
image_id, split, sentences[{sent}]), COCO's ``instances.json`` (images and annotations, bbox =
[x, y, w, h]) and the COCO image folder; one row per sentence, in the format of the ``grounding``
generator (:mod:`emdlm.tasks.grounding`), so training and
:func:`emdlm.metrics.compute_task_metrics` treat them alike. The pickle is read with a restricted
unpickler that admits only builtin containers and scalars
(:func:`emdlm.datasets.safe_pickle.safe_load_pickle`); the JSON by
:func:`emdlm.json_io.parse_json` (a key given twice, deep nesting and lone surrogates are
refused). Every box passes :func:`emdlm.datasets.reading.check_box`; ``images_root`` refuses
images outside a folder. A bad entry is a :class:`emdlm.config.ConfigError` naming the file and
the annotation, image or ref.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.reading import PathLike, all_finite, check_box, image_size
from emdlm.datasets.safe_pickle import safe_load_pickle
from emdlm.json_io import parse_json
from emdlm.metrics.boxes import check_box_format, format_box
from emdlm.tasks.grounding import PROMPTS as GROUNDING_PROMPTS


def read_refcoco(
    refs_path: PathLike,
    instances_path: PathLike,
    image_dir: PathLike,
    *,
    split: str | None = "val",
    box_format: str = "qwen2vl",
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """RefCOCO / RefCOCO+ / RefCOCOg rows, one per referring sentence.

    Args:
        refs_path: the ``refs(unc).p`` / ``refs(google).p`` / ``refs(umd).p`` pickle.
        instances_path: the dataset's COCO ``instances.json``.
        image_dir: the folder of the COCO images (``train2014``), named as in instances.json.
        split: keep refs of this split ("train", "val", "test", "testA", "testB"); None for all.
        box_format: "qwen2vl" or "llava" (see :mod:`emdlm.metrics.boxes`).
        images_root: if set, refuse an image (``file_name`` with ``../``, an absolute path, a
            symlink) that resolves outside this folder (:func:`emdlm.datasets.images.confine`).

    Returns:
        rows ``{"image", "prompt", "completion", "expression", "boxes": [[x1, y1, x2, y2]],
        "box_format", "ref_id", "split"}`` (boxes in pixels).

    A bbox that is not 4 finite numbers with w, h >= 0, a non-string ``file_name`` or sentence
    is a ConfigError naming the file and the annotation, image or ref.
    """
    check_box_format(box_format)
    refs = safe_load_pickle(refs_path)
    if not isinstance(refs, list):
        raise ConfigError(f"{refs_path}: expected a list of refs, got {type(refs).__name__}")
    images, anns = _load_instances(instances_path)
    folder = Path(image_dir)
    sizes: dict[Path, tuple[int, int]] = {}  # refs share images: decode each once
    rows: list[dict[str, Any]] = []
    for i, ref in enumerate(refs):
        where = f"{refs_path}[{i}]"
        try:
            if split is not None and ref["split"] != split:
                continue
            image_id, ann_id = int(ref["image_id"]), int(ref["ann_id"])
            image, ann = images[image_id], anns[ann_id]
            raw_sentences = ref["sentences"]
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"{where}: malformed ref or unknown image/annotation: {err!r}"
            ) from err
        sentences = _ref_sentences(raw_sentences, where)
        ann_where = f"{instances_path}: annotation id {ann_id}"
        box = _coco_box(ann, ann_where)
        path = folder / _file_name(image, f"{instances_path}: image id {image_id}")
        if path not in sizes:
            sizes[path] = image_size(path, where, images_root)
        width, height = sizes[path]
        check_box(box, width, height, ann_where, path)
        answer = format_box(box, width, height, box_format)
        for sent in sentences:
            rows.append(
                {
                    "image": str(path.resolve()),
                    "prompt": GROUNDING_PROMPTS[box_format].format(expr=sent.strip()),
                    "completion": answer,
                    "expression": sent.strip(),
                    "boxes": [list(box)],
                    "box_format": box_format,
                    "ref_id": ref.get("ref_id"),
                    "split": ref["split"],
                }
            )
    return rows


def _load_instances(path: PathLike) -> tuple[dict[int, Any], dict[int, Any]]:
    """(images by id, annotations by id) of a COCO instances.json; ConfigError if it is not
    one (unreadable, not JSON, nested too deeply, missing keys)."""
    try:
        instances = parse_json(Path(path).read_text(encoding="utf-8"))
        images = {int(im["id"]): im for im in instances["images"]}
        anns = {int(a["id"]): a for a in instances["annotations"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{path}: not a COCO instances file: {reason}") from err
    return images, anns


def _coco_box(ann: Any, where: str) -> tuple[float, float, float, float]:
    """(x1, y1, x2, y2) of a COCO annotation's ``bbox`` [x, y, w, h]; ConfigError naming
    ``where`` unless it is 4 finite numbers with w, h >= 0 (NaN or a negative size would
    become an answer like ``(0,0),(0,0)`` or one with x2 < x1)."""
    bbox = ann.get("bbox") if isinstance(ann, dict) else None
    numbers = (
        isinstance(bbox, list) and len(bbox) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)
    )
    if not numbers or not all_finite(bbox) or bbox[2] < 0 or bbox[3] < 0:
        raise ConfigError(
            f"{where}: bbox must be [x, y, w, h], 4 finite numbers with w, h >= 0, got {bbox!r}"
        )
    x, y, w, h = (float(v) for v in bbox)
    return (x, y, x + w, y + h)


def _file_name(image: Any, where: str) -> str:
    """A COCO image's ``file_name``; ConfigError naming ``where`` unless it is a string."""
    name = image.get("file_name") if isinstance(image, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: file_name must be a non-empty string, got {name!r}")
    return name


def _ref_sentences(sentences: Any, where: str) -> list[str]:
    """The ``sent`` strings of a ref's ``sentences``; ConfigError naming ``where`` and the
    sentence for one that is not a string (``"sent": 5``)."""
    if not isinstance(sentences, list):
        raise ConfigError(f"{where}: sentences must be a list, got {type(sentences).__name__}")
    out = []
    for j, s in enumerate(sentences):
        sent = s.get("sent") if isinstance(s, dict) else None
        if not isinstance(sent, str):
            raise ConfigError(
                f"{where}: sentences[{j}].sent must be a string, got {type(sent).__name__} "
                f"{sent!r}"
            )
        out.append(sent)
    return out
