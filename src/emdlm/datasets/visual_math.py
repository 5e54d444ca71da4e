"""Readers for the visual math benchmarks (MathVista, MathVision) -> image task rows.

Rows are ``{"image": absolute path, "prompt", "completion", ...metadata}`` as from the other
readers (:mod:`emdlm.datasets`), scored with ``eval.kind: math``
(:mod:`emdlm.math_answers`). Each row keeps what scoring needs: ``question_type``,
``answer_type``, ``choices``, ``precision``, ``unit``, and the raw ``answer``; and its own
``number_scope``: nothing for a multiple-choice or text answer (an option letter is not a
quantity: :data:`emdlm.math_answers.NO_NUMBERS`), the whole answer for a free-form number.

* MathVista (:func:`read_mathvista`): ``testmini.json`` / ``test.json`` (a dict keyed by ``pid``
  or a list) beside its ``images/`` folder, or a folder written by ``datasets``'
  ``save_to_disk`` (the Hub's ``AI4Math/MathVista``: splits ``testmini`` / ``test``, the picture
  in ``decoded_image``). Fields: ``pid``, ``question``, ``image`` (a path relative to the data
  folder), ``choices`` (list or null), ``answer``, ``answer_type`` (integer / float / text /
  list), ``precision``, ``question_type`` (multi_choice / free_form), ``unit``, ``query``.
  The prompt is the question, then the lettered choices of a multiple-choice item
  (``"(A) 3 (B) 4"``); or, with ``prompt="query"``, the dataset's own ``query`` (its hint and
  question). The completion is the option letter, an integer as written, a float at its
  ``precision`` (``"1.50"``), else the answer's text.
* MathVision (:func:`read_mathvision`): ``test.jsonl`` / ``testmini.jsonl`` lines with ``id``,
  ``question``, ``options`` (list, may be empty), ``image``, ``answer``, ``level``, ``subject``
  (images relative to the file's folder or, as in the MATH-V repository's ``data/`` beside
  ``images/``, its parent). With options the answer is a letter A-E (an option's text is turned
  into its letter); without, a number (compared at 2 decimals, as MathVision's ``is_equal``
  rounds) or text. ``<image1>``-style placeholders are taken out of the question: the row
  shows the one image.

Pictures stored inside a saved ``datasets`` folder are written once as PNG files to
``image_dir`` (default: a folder ``<dataset folder>_images`` beside it), so rows name files as
everywhere else. Every image is decoded in full before anything trains; ``images_root`` refuses
paths outside a folder. A bad entry (a missing field, an answer that is not one of the choices,
a number that does not parse, a missing or broken image) is a :class:`emdlm.config.ConfigError`
naming the file and line (JSONL), entry (JSON) or row (dataset folder).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.config.errors import check_one_of
from emdlm.datasets.images import to_rgb
from emdlm.datasets.reading import PathLike, image_size, jsonl_values, read_text
from emdlm.json_io import JSONDataError, parse_json
from emdlm.math_answers import (
    LETTERS,
    MathItem,
    exact_value,
    format_choices,
    format_number,
    make_item,
    number_scope,
    parse_value,
)

PROMPT_SOURCES = ("question", "query")
EMBEDDED_IMAGE_KEYS = ("decoded_image", "image")
_PLACEHOLDER_RE = re.compile(r"\s*<image\d*>\s*")
_SAFE_NAME_RE = re.compile(r"[^\w.-]")


# ----------------------------------------------------------------------------- loading
def _json_entries(path: Path) -> Iterator[tuple[str, Any, Any]]:
    """(where, key, entry) of a JSON file: a list, or a dict keyed by pid."""
    try:
        data = parse_json(read_text(path))
    except JSONDataError as err:
        raise ConfigError(f"{path}: {err}") from None
    if isinstance(data, dict):
        for key, entry in data.items():
            yield f"{path}: entry {key!r}", key, entry
    elif isinstance(data, list):
        for i, entry in enumerate(data):
            yield f"{path}: entry {i}", None, entry
    else:
        raise ConfigError(f"{path}: expected a list of items or a dict keyed by pid, got "
                          f"{type(data).__name__}")


def _dataset_entries(folder: Path, split: str | None) -> Iterator[tuple[str, Any, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as err:  # datasets raises FileNotFoundError / ValueError variants
        raise ConfigError(
            f"{folder}: not a dataset folder written by save_to_disk ({err})"
        ) from err
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None:
            split = "testmini" if "testmini" in ds else names[0] if len(names) == 1 else None
        if split not in ds:
            raise ConfigError(f"{folder}: has splits {names}; pass split= one of them")
        ds = ds[split]
    for i, entry in enumerate(ds):
        yield f"{folder}: row {i}", None, dict(entry)


def _entries(path: Path, split: str | None) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(where, key, entry) of each problem of a dataset folder, a JSONL or a JSON file;
    ConfigError for a missing file, an entry that is not an object, or no entry at all."""
    if path.is_dir():
        entries = _dataset_entries(path, split)
    elif not path.is_file():
        raise ConfigError(f"{path}: not found")
    elif path.suffix.lower() == ".jsonl":
        entries = ((where, None, entry) for where, entry in jsonl_values(path))
    else:
        entries = _json_entries(path)
    return _objects(entries, path)


def _objects(
    entries: Iterator[tuple[str, Any, Any]], path: Path
) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    empty = True
    for where, key, entry in entries:
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected an object, got {type(entry).__name__}")
        empty = False
        yield where, key, entry
    if empty:
        raise ConfigError(f"{path}: no problems")


# ----------------------------------------------------------------------------- fields
def _text(entry: dict[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: field {key!r} must be non-empty text, got {value!r}")
    return value


#: what a missing answer means, per reader (MathVista's test answers are private; every
#: MathVision entry, test and testmini alike, has its answer)
NO_ANSWER_ADVICE = {
    "mathvista": "MathVista's test split keeps its answers private: use testmini",
    "mathvision": "every MathVision entry (test and testmini) has its answer: the file is "
                  "damaged or is not MathVision's",
}


def _identifier(value: Any, key: str, where: str) -> str | int:
    """A problem's identifier field (text or an integer); ConfigError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{where}: field {key!r} must be text or a number, got {value!r}")
    return value


def _answer_text(entry: dict[str, Any], where: str, source: str) -> str:
    value = entry.get("answer")
    usable = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if not usable or not str(value).strip():
        raise ConfigError(f"{where}: no answer (got {value!r}); {NO_ANSWER_ADVICE[source]}")
    return " ".join(str(value).split())


def _image_path(
    entry: dict[str, Any], where: str, bases: list[Path], cache: Path | None, name: str,
    images_root: PathLike | None,
) -> Path:
    """The image of an entry: a picture stored in the entry (written once to ``cache``), or a
    path relative to the first of ``bases`` holding it; decoded in full."""
    for key in EMBEDDED_IMAGE_KEYS:
        picture = entry.get(key)
        if hasattr(picture, "save") and hasattr(picture, "mode"):  # a PIL image
            if cache is None:
                raise ConfigError(f"{where}: the picture is stored in the data; pass image_dir")
            cache.mkdir(parents=True, exist_ok=True)
            path = cache / f"{_SAFE_NAME_RE.sub('_', name)}.png"
            try:
                to_rgb(picture).save(path, format="PNG")
            except Exception as err:  # an untrusted picture fails in many ways
                raise ConfigError(f"{where}: unreadable picture: {err}") from err
            image_size(path, where, images_root)
            return path.resolve()
    named = entry.get("image")
    if not isinstance(named, str) or not named.strip():
        raise ConfigError(f"{where}: field 'image' must be a path, got {named!r}")
    rel = Path(named)
    candidates = [rel] if rel.is_absolute() else [b / rel for b in bases]
    path = next((p for p in candidates if p.is_file()), candidates[0])
    image_size(path, where, images_root, named)
    return path.resolve()


def _checked_item(where: str, **fields: Any) -> MathItem:
    try:
        return make_item(**fields, where=where)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _choice_letter(answer: str, choices: tuple[str, ...], where: str) -> str:
    """The letter of ``answer``: the option whose text it is, else itself if a letter."""
    if answer in choices:
        return LETTERS[choices.index(answer)]
    if len(answer) == 1 and answer in LETTERS[: len(choices)]:
        return answer
    raise ConfigError(f"{where}: answer {answer!r} is not one of the choices {list(choices)}")


def _completion(answer: str, item: MathItem, where: str) -> str:
    if item.question_type == "multi_choice":
        return _choice_letter(answer, item.choices, where)
    if item.answer_type in ("integer", "float"):
        value = parse_value(answer)
        if value is None:
            raise ConfigError(f"{where}: {item.answer_type} answer {answer!r} is not a number")
        if item.answer_type == "integer":  # exactly: a float rounds 17-digit integers
            exact = exact_value(answer)
            if exact is None or exact.denominator != 1:
                raise ConfigError(f"{where}: integer answer {answer!r} is not a whole number")
            return str(exact.numerator)
        if item.precision is not None:
            return format_number(value, item.answer_type, item.precision)
    return answer


def _row(
    image: Path, prompt: str, completion: str, answer: str, item: MathItem, **meta: Any
) -> dict[str, Any]:
    return {
        "image": str(image),
        "prompt": prompt,
        "completion": completion,
        "question_type": item.question_type,
        "answer_type": item.answer_type,
        "choices": list(item.choices),
        "precision": item.precision,
        "unit": item.unit,
        "answer": answer,
        "number_scope": number_scope(item),
        **meta,
    }


def _sources(path: PathLike, image_dir: PathLike | None) -> tuple[Path, list[Path], Path | None]:
    src = Path(path)
    if src.is_dir():
        cache = Path(image_dir) if image_dir is not None else src.parent / f"{src.name}_images"
        return src, [cache, src], cache
    if image_dir is not None:
        return src, [Path(image_dir)], None
    folder = src.resolve().parent
    return src, [folder, folder.parent], None


# ----------------------------------------------------------------------------- MathVista
def read_mathvista(
    path: PathLike,
    image_dir: PathLike | None = None,
    *,
    split: str | None = None,
    prompt: str = "question",
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """MathVista rows, one per problem.

    Args:
        path: ``testmini.json`` / ``test.json`` (a dict keyed by pid, or a list), or a folder
            written by ``datasets``' ``save_to_disk``.
        image_dir: the folder the ``image`` paths are relative to (default: the JSON's folder,
            then its parent); for a dataset folder with pictures inside, where they are written
            (default ``<folder>_images`` beside it).
        split: the split of a saved ``DatasetDict`` (default ``testmini``).
        prompt: "question" (the question, then the lettered choices) or "query" (the
            dataset's own ``query``: its hint and the question).
        images_root: refuse an image that resolves outside this folder.

    Returns:
        rows ``{"image", "prompt", "completion", "question_type", "answer_type", "choices",
        "precision", "unit", "answer", "number_scope", "pid", "source": "mathvista"}``.
    """
    check_one_of("prompt", prompt, PROMPT_SOURCES)
    src, bases, cache = _sources(path, image_dir)
    rows = []
    for where, key, entry in _entries(src, split):
        pid = _identifier(entry.get("pid", key), "pid", where)
        question = _text(entry, "question", where)
        item = _checked_item(
            where, question_type=entry.get("question_type"),
            answer_type=entry.get("answer_type"), choices=entry.get("choices"),
            precision=entry.get("precision"), unit=entry.get("unit"),
        )
        answer = _answer_text(entry, where, "mathvista")
        completion = _completion(answer, item, where)
        if prompt == "query":
            text = _text(entry, "query", where)
        elif item.question_type == "multi_choice":
            text = f"{question.strip()}\n{format_choices(item.choices)}"
        else:
            text = question.strip()
        image = _image_path(entry, where, bases, cache, f"mathvista_{pid}", images_root)
        rows.append(_row(image, text, completion, answer, item, pid=str(pid),
                         source="mathvista"))
    return rows


# ----------------------------------------------------------------------------- MathVision
MATHVISION_PRECISION = 2  # MathVision's is_equal rounds both numbers to 2 decimals


def _mathvision_item(entry: dict[str, Any], answer: str, where: str) -> MathItem:
    options = entry.get("options")
    if options is None:
        options = []
    if not isinstance(options, list):
        raise ConfigError(f"{where}: field 'options' must be a list, got {options!r}")
    if options:
        return _checked_item(where, question_type="multi_choice", answer_type="text",
                             choices=options)
    value = parse_value(answer)
    if value is None:
        return _checked_item(where, question_type="free_form", answer_type="text")
    integer = value.is_integer() and not any(c in answer for c in "./e")
    return _checked_item(where, question_type="free_form",
                         answer_type="integer" if integer else "float",
                         precision=MATHVISION_PRECISION)


def read_mathvision(
    path: PathLike,
    image_dir: PathLike | None = None,
    *,
    split: str | None = None,
    images_root: PathLike | None = None,
) -> list[dict[str, Any]]:
    """MathVision rows, one per problem of a ``test.jsonl`` / ``testmini.jsonl`` (or a saved
    ``datasets`` folder with the same fields: the Hub's ``MathLLMs/MathVision``, splits
    ``test`` / ``testmini``, the picture in ``decoded_image``).

    Args:
        path: the JSONL file, or a folder written by ``datasets``' ``save_to_disk``.
        image_dir: as for :func:`read_mathvista`.
        split: the split of a saved ``DatasetDict`` (default ``testmini``, or its only split).
        images_root: refuse an image that resolves outside this folder.

    The completion is the option letter (A-E) with options, else the answer as written (a
    number, compared at 2 decimals; or text). Rows: ``{"image", "prompt", "completion",
    "question_type", "answer_type", "choices", "precision", "unit", "answer", "number_scope",
    "id", "level", "subject", "source": "mathvision"}``.
    """
    src, bases, cache = _sources(path, image_dir)
    rows = []
    for where, _, entry in _entries(src, split):
        ident = _identifier(entry.get("id"), "id", where)
        question = " ".join(_PLACEHOLDER_RE.sub(" ", _text(entry, "question", where)).split())
        answer = _answer_text(entry, where, "mathvision")
        item = _mathvision_item(entry, answer, where)
        if item.question_type == "multi_choice":
            prompt = f"{question}\n{format_choices(item.choices)}"
            completion = _choice_letter(answer, item.choices, where)
        else:
            prompt, completion = question, answer
        image = _image_path(entry, where, bases, cache, f"mathvision_{ident}", images_root)
        rows.append(_row(image, prompt, completion, answer, item, id=str(ident),
                         level=entry.get("level"), subject=entry.get("subject"),
                         source="mathvision"))
    return rows


__all__ = ["MATHVISION_PRECISION", "read_mathvision", "read_mathvista"]
