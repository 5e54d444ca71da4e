"""Image+text examples for VLMs, checked before training starts.

Rows come from :func:`emdlm.data.load_examples` (JSONL, ``save_to_disk`` folder or a
registered task) and must hold ``prompt``, ``completion`` and an image under ``image_key``:

* JSONL: a path, relative to the JSONL file's folder (or absolute);
* ``save_to_disk`` folder: a ``datasets`` Image column (PIL images) or paths relative to the
  folder;
* a task generator: the absolute path of the rendered PNG.

Every image is decoded in full here (:func:`emdlm.datasets.images.check_image_file`; Pillow's
``verify`` does not decode JPEG data), so a missing, truncated or unreadable file, an unsupported
mode or a decompression bomb is a ConfigError naming ``file:line`` (or the row) before any step
runs. With ``data.images_root`` set, a path a data file names (absolute, ``../``, ``~`` or
through a symlink) must resolve inside that folder.

:func:`read_image_jsonl` reads such a JSONL file on its own (the rows, their images checked), as
the dataset readers of :mod:`emdlm.datasets` give theirs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError, DataSourceConfig
from emdlm.data import CutCounts, load_examples, report_cuts
from emdlm.datasets.images import (
    SUPPORTED_MODES,
    ImageCheckError,
    check_image_file,
    check_image_shape,
    confine,
    displayed_size,
)
from emdlm.datasets.reading import PathLike, confine_image, image_size, jsonl_values


def _jsonl_line_numbers(path: Path) -> list[int]:
    """1-based line numbers of the non-blank lines (the rows ``read_jsonl`` returned)."""
    with path.open("rb") as fh:
        return [n for n, raw in enumerate(fh, start=1) if raw.strip()]


def _where(src: DataSourceConfig, index: int, lines: list[int] | None) -> str:
    if lines is not None and index < len(lines):
        return f"{src.path}:{lines[index]}"
    return f"{src.describe()}: row {index}"


def check_image(
    value: Any, base: Path | None, where: str, image_key: str, images_root: str | None = None
) -> Any:
    """The image as a readable absolute path (or the PIL image itself); ConfigError naming
    ``where`` when it is missing, not a file, outside ``images_root`` (when set), or not an
    image that decodes in full (:func:`emdlm.datasets.images.check_image_file`: truncated data, an
    unsupported mode and decompression bombs are caught here, not mid-run)."""
    from PIL import Image

    if isinstance(value, Image.Image):  # a datasets Image column: decoded already
        if value.mode not in SUPPORTED_MODES:
            raise ConfigError(f"{where}: field {image_key!r}: image mode {value.mode} is not "
                              f"supported (supported: {', '.join(SUPPORTED_MODES)})")
        try:
            check_image_shape(*displayed_size(value))
        except ImageCheckError as err:
            raise ConfigError(f"{where}: field {image_key!r}: {err}") from err
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{where}: field {image_key!r} must be an image path, got {type(value).__name__}"
        )
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        confine(path, images_root, value)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: {err} (data.images_root)") from err
    if not path.is_file():
        raise ConfigError(f"{where}: image file not found: {path}")
    try:
        check_image_file(path)
    except ImageCheckError as err:
        raise ConfigError(f"{where}: cannot read image {path}: {err}") from err
    return str(path.resolve())


def load_image_examples(
    src: DataSourceConfig,
    *,
    seed: int,
    image_key: str = "image",
    images_root: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``src`` with ``image_key`` resolved and checked (see the module docstring).
    ``images_root`` (``data.images_root``) confines the image paths a data file names; rows a
    task generator renders are emdlm's own and are not confined."""
    rows = load_examples(src, seed=seed)
    lines: list[int] | None = None
    base: Path | None = None
    root = images_root if src.path is not None else None
    if src.path is not None:
        p = Path(src.path)
        base = p if p.is_dir() else p.parent
        if p.is_file():
            lines = _jsonl_line_numbers(p)
    out = []
    for i, row in enumerate(rows):
        where = _where(src, i, lines)
        if "completion" not in row:
            raise ConfigError(f"{where}: image examples need 'prompt' and 'completion' fields")
        if image_key not in row:
            raise ConfigError(f"{where}: field {image_key!r} (the image) is missing")
        out.append({**row, image_key: check_image(row[image_key], base, where, image_key, root)})
    return out


class ImageRowsDataset:
    """Rows kept as dicts; the VLM collator opens images and tokenizes per batch. ``cuts``
    says how many rows truncation cut or dropped (:func:`cut_image_rows`).
    ``loss_weights_checked``: the rows come from :func:`load_image_examples`, whose
    :func:`emdlm.data.load_examples` checked their ``loss_weight`` (a trainer's setup does not
    read them again)."""

    loss_weights_checked = True

    def __init__(self, rows: list[dict[str, Any]], cuts: CutCounts | None = None) -> None:
        self.rows = rows
        self.cuts = cuts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def cut_image_rows(
    rows: list[dict[str, Any]],
    lengths: list[tuple[int, int]],
    *,
    source: str,
    max_length: int,
    on_truncate: str = "warn",
    on_drop: str = "warn",
    character_cuts: tuple[int, int, int] = (0, 0, 0),
) -> ImageRowsDataset:
    """Say what ``data.max_length`` cuts before training, as for text data
    (:func:`emdlm.data.build_dataset`): a row whose prompt (image tokens included) leaves no
    room for an answer token is dropped, a row whose answer (with its EOS) does not fit is
    truncated by the collator; both are counted, printed once and kept in ``dataset.cuts``
    (``train_summary.json``), or are a ConfigError with ``data.on_drop`` / ``data.on_truncate``
    = "error". ``lengths``: (prompt, answer) token counts per row
    (:meth:`emdlm.vlm.collator.VLMCollator.lengths`). ``character_cuts``: (rows cut, characters
    cut, the cap) of :func:`emdlm.data.cap_characters`, run on the rows before they were
    measured."""
    kept = [row for row, (p, _) in zip(rows, lengths, strict=True) if p + 1 <= max_length]
    truncated = sum(1 for p, a in lengths if p + 1 <= max_length < p + a)
    cuts = CutCounts(source, len(rows), truncated, len(rows) - len(kept), max_length,
                     *character_cuts)
    need = measured_need(lengths)
    if not kept:  # the error alone: no warning and note saying the same first
        raise ConfigError(f"{source}: no example leaves room for an answer within "
                          f"data.max_length={max_length}; {need}")
    try:
        report_cuts(cuts, on_truncate, on_drop)
    except ConfigError as err:
        raise ConfigError(f"{err}; {need}") from err
    if (truncated or len(kept) < len(rows)) and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {need}", file=sys.stderr, flush=True)
    return ImageRowsDataset(kept, cuts)


def measured_need(lengths: list[tuple[int, int]]) -> str:
    """What ``data.max_length`` keeps every row whole, measured on the rows: the longest
    prompt (its image tokens included, as the processor expands them) plus its answer and EOS.
    ``lengths``: (prompt, answer-with-EOS) token counts per row."""
    prompt, answer = max(lengths, key=lambda pa: pa[0] + pa[1])
    longest_prompt = max(p for p, _ in lengths)
    other = f"; the longest prompt alone is {longest_prompt}" if longest_prompt != prompt else ""
    return (
        f"data.max_length={prompt + answer} keeps every row whole (measured: the longest row is "
        f"{prompt} prompt tokens, image tokens included, + {answer} answer tokens with EOS"
        f"{other})"
    )


def read_image_jsonl(
    path: PathLike, *, check_images: bool = True, images_root: PathLike | None = None
) -> list[dict[str, Any]]:
    """Rows of an image+text JSONL file: ``{"image", "prompt", "completion", ...}`` per line.

    Relative ``image`` paths are resolved against the JSONL file's folder (returned absolute).
    Missing fields, a non-object line, an image outside ``images_root`` (when set; absolute and
    ``../`` paths are allowed otherwise) or (with ``check_images``) a missing image or one that
    does not decode in full raise ConfigError with ``file:line``.
    """
    src = Path(path)
    folder = src.resolve().parent
    rows = []
    for where, row in jsonl_values(src):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in ("image", "prompt", "completion") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{where}: missing or non-string field(s) {missing}")
        image = Path(row["image"])
        image = image if image.is_absolute() else folder / image
        if check_images:
            image_size(image, where, images_root, row["image"])
        else:
            confine_image(image, where, images_root, row["image"])
        rows.append({**row, "image": str(image)})
    return rows
