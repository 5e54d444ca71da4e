"""Examples in, padded tensors out.

Sources (see :class:`emdlm.config.DataSourceConfig`): a JSONL file (each line an object with
string fields "prompt" and "completion", or "text"), a folder written by
``datasets.Dataset.save_to_disk`` (same fields), or a registered task generator.

Number scope (:mod:`emdlm.number_scope`: which numbers the numeric objectives score): a row's
``"number_scope"`` or ``data.number_scope`` other than "all" gives the items a ``number_mask``
(aligned with ``labels``, False on the prompt and the EOS); the collator pads it, and the
numeric losses score a number only if all its tokens are in it. CE is untouched.

Tokenization: prompt/completion examples become ``prompt_ids + completion_ids + [eos]`` (prompt
encoded with the tokenizer's special tokens, completion without: the convention of
:mod:`emdlm.generation`) with the prompt's labels set to -100, so only the completion (and its
eos) is trained; text examples are
``ids + [eos]`` with every token a label. Extra fields named in ``extra_keys`` (e.g. an image
tensor "pixel_values") are kept as tensors and stacked by the collator, so a model taking more
inputs needs no trainer change.

Loss weights: a row's optional ``"loss_weight"`` (a finite number ≥ 0) scales every scored
token of that row. Absent, JSON ``null`` and ``None`` (what a ``datasets`` column gives a row
that lacks the field while others have it) all mean "no weight given": weight 1, the same in
every source (:func:`emdlm.integrations.loss_weights.check_loss_weight`, the one rule). Anything
else is a ConfigError naming the row, raised once, where the rows enter: as a file is read
(:func:`load_examples`, which checks a task generator's rows too and returns
:class:`CheckedRows`), or in :func:`build_dataset` for rows given to it otherwise. The item
keeps the weight (an item of a row without one has none), and the collator only converts the
batch's checked weights into ``loss_weights`` [B, T] (the row's weight on its tokens, 0 on
padding), which the trainers hand to a loss that takes per-token weights
(:class:`emdlm.losses.base.EMDLMLoss`, ``takes_loss_weights``). A tokenized item may instead
carry its own per-token ``"loss_weights"`` list, aligned with its ``input_ids`` (the two
multiply when both are given).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from emdlm.config import ConfigError, DataSourceConfig, RunConfig
from emdlm.functional._common import IGNORE_INDEX
from emdlm.integrations.loss_weights import (
    LOSS_WEIGHT_KEY,
    TOKEN_WEIGHTS_KEY,
    check_loss_weight,
    has_loss_weights,
    pad_loss_weights,
)
from emdlm.json_io import JSONDataError, parse_json
from emdlm.number_scope import NUMBER_SCOPE_KEY, piece_masks, row_scopes, scope_pattern

CUT_POLICIES = ("warn", "error")  # data.on_truncate / data.on_drop
_BASE_KEYS = (
    "input_ids", "labels", "attention_mask", "number_mask", LOSS_WEIGHT_KEY, TOKEN_WEIGHTS_KEY,
)
#: the row fields that are tokenized, and so cut to :func:`max_characters` first
TEXT_FIELDS = ("prompt", "completion", "text")
#: tokens of room past ``max_length`` in :func:`max_characters`
CHARACTER_CAP_SLACK = 8
#: characters per token assumed for a tokenizer without ``get_vocab`` (:func:`max_characters`)
TOKEN_CHARACTERS_FALLBACK = 256


class CheckedRows(list):  # type: ignore[type-arg]
    """Rows whose fields (and ``loss_weight``) were checked where they entered
    (:func:`load_examples`, :func:`read_jsonl`): :func:`build_dataset` does not check their
    weights again."""


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    check_loss_weight(row.get(LOSS_WEIGHT_KEY), where)  # null: no weight given
    if TOKEN_WEIGHTS_KEY in row:
        raise ConfigError(
            f"{where}: field {TOKEN_WEIGHTS_KEY!r} (per-token weights) belongs to tokenized items "
            f"aligned with their input_ids; a text row takes one {LOSS_WEIGHT_KEY!r}"
        )
    has_pc = "prompt" in row or "completion" in row
    if has_pc:
        for key in ("prompt", "completion"):
            if key not in row:
                raise ConfigError(f"{where}: field {key!r} is missing")
            if not isinstance(row[key], str):
                raise ConfigError(
                    f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}"
                )
        if not row["completion"]:
            raise ConfigError(f"{where}: empty 'completion'")
    elif "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise ConfigError(f"{where}: field 'text' must be a non-empty string")
    else:
        raise ConfigError(
            f"{where}: needs 'prompt' and 'completion' fields, or 'text' "
            f"(found {', '.join(sorted(map(str, row))) or 'no fields'})"
        )
    return row


def _decode_line(raw: bytes, where: str) -> str:
    """One JSONL line as text; ConfigError naming the line and the first bad byte if it is not
    UTF-8 (a UTF-8 byte-order mark is dropped)."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.start + 1].hex()
        raise ConfigError(
            f"{where}: not UTF-8 (byte 0x{bad} at column {err.start + 1}); save the file as "
            "UTF-8"
        ) from None


def read_jsonl(path: str | Path) -> CheckedRows:
    """Rows of a JSONL file; ConfigError naming ``file:line`` for any malformed line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file not found: {p}")
    rows = CheckedRows()
    # bytes, decoded line by line, so that an encoding error names its line like JSON errors
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = _decode_line(raw, f"{p}:{lineno}")
            if not line.strip():
                continue
            try:
                row = parse_json(line)
            except JSONDataError as err:
                raise ConfigError(f"{p}:{lineno}: {err}") from None
            rows.append(_check_row(row, f"{p}:{lineno}"))
    if not rows:
        raise ConfigError(f"{p}: no examples")
    return rows


def _read_saved_dataset(path: Path, split: str) -> CheckedRows:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError/ValueError variants
        raise ConfigError(f"{path}: not a dataset folder written by save_to_disk ({err})") from err
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path}: has splits {list(ds)}, not {split!r}")
        ds = ds[split]
    rows = CheckedRows(_check_row(dict(r), f"{path}: row {i}") for i, r in enumerate(ds))
    if not rows:
        raise ConfigError(f"{path}: no examples")
    return rows


def check_task_sources(cfg: RunConfig) -> None:
    """ConfigError naming the role (``"data.train: ..."``) for a task source of ``cfg`` that
    :func:`load_examples` would refuse (unknown task or split, ``n``, ``seed``, a parameter the
    generator does not take or a value outside its domain), found without generating anything;
    file sources pass (they are checked as they are read)."""
    from emdlm.tasks import check_task_call

    for role, src in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if src is None or src.task is None:
            continue
        seed = cfg.train.seed if src.seed is None else src.seed  # as load_examples is called
        try:
            check_task_call(src.task, n=src.n, split=src.resolved_split, seed=seed, **src.params)
        except ValueError as err:
            raise ConfigError(f"{role}: {err}") from err


def load_examples(src: DataSourceConfig, *, seed: int) -> CheckedRows:
    """Examples (dicts) from one source, their loss weights checked (a file's as it is read,
    a task generator's here); errors are ConfigError naming the source."""
    if src.task is not None:
        from emdlm.tasks import generate_task

        try:
            generated = generate_task(
                src.task, n=src.n, split=src.resolved_split,
                seed=seed if src.seed is None else src.seed, **src.params,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        for i, row in enumerate(generated):
            check_loss_weight(row.get(LOSS_WEIGHT_KEY), f"{src.describe()}: example {i}")
        rows = CheckedRows(generated)
    else:
        assert src.path is not None
        p = Path(src.path)
        if p.is_dir():
            rows = _read_saved_dataset(p, src.resolved_split)
        elif p.is_file():
            rows = read_jsonl(p)
        else:
            raise ConfigError(f"data path not found: {p}")
    if src.limit is not None:
        rows = CheckedRows(rows[: src.limit])
    return rows


def max_characters(tokenizer: Any, max_length: int) -> int:
    """The characters a text field keeps before tokenizing (:func:`cap_characters`):
    ``(max_length + CHARACTER_CAP_SLACK) * L``, L the longest entry of the tokenizer's
    vocabulary (``get_vocab()``; :data:`TOKEN_CHARACTERS_FALLBACK` without one).

    A token stands for at most L characters of text, so a field cut there still has more than
    ``max_length`` tokens and the ``max_length`` kept are those of the whole field; the
    :data:`CHARACTER_CAP_SLACK` tokens absorb the last word, split differently at the cut.
    (A tokenizer that drops characters, a normalizer stripping accents or whitespace no token
    holds, can keep fewer: the cut is counted and said either way.) GPT-2's and Qwen2's longest
    entry is 128 characters, so ``max_length=16`` keeps 3,072 characters of a 50 MB line, which
    took minutes and gigabytes to tokenize whole."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    longest = max(map(len, get_vocab()), default=1) if callable(get_vocab) else (
        TOKEN_CHARACTERS_FALLBACK
    )
    return (max_length + CHARACTER_CAP_SLACK) * max(1, longest)


def cap_characters(
    rows: list[dict[str, Any]], tokenizer: Any, max_length: int
) -> tuple[list[dict[str, Any]], set[int], int, int]:
    """(rows, indices of the rows cut, characters cut, the cap): every text field
    (:data:`TEXT_FIELDS`) longer than :func:`max_characters` cut to it (a cut row is a new
    dict; the others are the same objects). The tokenizer's vocabulary is read only when a
    field is long enough to be cut at all."""
    longest = max((len(v) for r in rows for k in TEXT_FIELDS if isinstance(v := r.get(k), str)),
                  default=0)
    if longest <= max_length + CHARACTER_CAP_SLACK:  # below any cap: no vocabulary to read
        return rows, set(), 0, 0
    cap = max_characters(tokenizer, max_length)
    out, cut_rows, cut = [], set(), 0
    for i, row in enumerate(rows):
        long = [k for k in TEXT_FIELDS if isinstance(row.get(k), str) and len(row[k]) > cap]
        if long:
            cut_rows.add(i)
            cut += sum(len(row[k]) - cap for k in long)
            row = {**row, **{k: row[k][:cap] for k in long}}
        out.append(row)
    return out, cut_rows, cut, cap


def tokenize_example(
    example: dict[str, Any],
    tokenizer: Any,
    *,
    max_length: int,
    add_eos: bool = True,
    extra_keys: Sequence[str] = (),
    number_scope: str = "all",
    task: str | None = None,
) -> dict[str, Any] | None:
    """input_ids / labels (prompt masked with -100) for one example, or None if truncation
    left no completion token; with a number scope other than "all" (the example's own
    ``"number_scope"`` over ``number_scope``; module docstring) also ``number_mask``."""
    eos = [tokenizer.eos_token_id] if add_eos else []
    scope = scope_pattern(
        example.get(NUMBER_SCOPE_KEY, number_scope), example.get("task", task), "example"
    )
    target = example["completion"] if "completion" in example else example["text"]
    mask: list[bool] = []
    if scope is not None:
        _, masks = piece_masks(
            tokenizer, [target], [scope], add_special_tokens="completion" not in example
        )
        mask = masks[0] + [False] * len(eos)
    if "completion" in example:
        # same convention as emdlm.evaluation: the prompt with the tokenizer's special tokens
        # (a BOS where it adds one), the completion without, concatenated as id lists
        prompt = tokenizer(example["prompt"])["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + eos
        ids = (prompt + completion)[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt) + completion)[:max_length]
        mask = [False] * len(prompt) + mask
    else:
        ids = (tokenizer(example["text"])["input_ids"] + eos)[:max_length]
        labels = list(ids)
    # the first position is never a target after the causal shift
    if sum(lab != IGNORE_INDEX for lab in labels[1:]) == 0:
        return None
    item: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if scope is not None:
        item["number_mask"] = mask[:max_length]
    weight = check_loss_weight(example.get(LOSS_WEIGHT_KEY), "example")
    if weight is not None:
        item[LOSS_WEIGHT_KEY] = weight
    for key in extra_keys:
        if key not in example:
            raise ConfigError(f"extra key {key!r} missing from an example")
        item[key] = torch.as_tensor(example[key])
    return item


@dataclass
class CutCounts:
    """What truncation to ``max_length`` did to one source's examples.

    ``truncated``: kept, but cut (a completion lost its end and its EOS, or a text its end);
    ``dropped``: removed, because the prompt filled ``max_length`` and no target token was left.
    ``character_cut_rows`` of the rows had a field longer than ``max_characters``, cut to it
    before tokenizing (:func:`cap_characters`), ``characters_cut`` characters in all.
    """

    source: str
    examples: int
    truncated: int
    dropped: int
    max_length: int
    character_cut_rows: int = 0
    characters_cut: int = 0
    max_characters: int = 0

    def message(self) -> str:
        """``"<source>: N of M examples truncated, K dropped (data.max_length=L)"``, then
        ``"; R rows had a field over C characters, cut to it before tokenizing (X characters)"``
        when the character cap cut any."""
        text = (
            f"{self.source}: {self.truncated} of {self.examples} examples truncated, "
            f"{self.dropped} dropped (data.max_length={self.max_length})"
        )
        if self.character_cut_rows:
            text += (
                f"; {self.character_cut_rows} rows had a field over {self.max_characters} "
                f"characters, cut to it before tokenizing ({self.characters_cut} characters)"
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TokenizedDataset(torch.utils.data.Dataset):
    """A list of tokenized examples (dicts of lists / tensors); ``cuts`` says how many examples
    truncation cut or dropped (None when not built by :func:`build_dataset`).

    ``loss_weights_checked``: the items' ``loss_weight`` values were checked when the rows
    entered (:func:`build_dataset`), so a trainer's setup does not read them again
    (:func:`emdlm.integrations.loss_weights.dataset_loss_weights`)."""

    loss_weights_checked = True

    def __init__(self, items: list[dict[str, Any]], cuts: CutCounts | None = None) -> None:
        self.items = items
        self.cuts = cuts

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def report_cuts(cuts: CutCounts, on_truncate: str, on_drop: str) -> None:
    """Print the cut counts to stderr once (rank 0), or raise ConfigError when the policy says
    "error"."""
    for policy, key, count in (
        (on_drop, "on_drop", cuts.dropped), (on_truncate, "on_truncate", cuts.truncated)
    ):
        if policy not in CUT_POLICIES:
            raise ConfigError(
                f"data.{key} must be one of {', '.join(CUT_POLICIES)}, got {policy!r}"
            )
        if count and policy == "error":
            raise ConfigError(
                f"{cuts.message()}; data.{key}=error: raise data.max_length or shorten the "
                "examples"
            )
    if (cuts.truncated or cuts.dropped) and int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {cuts.message()}", file=sys.stderr, flush=True)


def build_dataset(
    examples: Iterable[dict[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    add_eos: bool = True,
    extra_keys: Sequence[str] = (),
    source: str = "data",
    on_truncate: str = "warn",
    on_drop: str = "warn",
    number_scope: str = "all",
    task: str | None = None,
) -> TokenizedDataset:
    """Tokenize all examples (batched calls into the tokenizer; same result as
    :func:`tokenize_example` per example, plus ``number_mask`` when a scope is set).

    Text fields longer than :func:`max_characters` are cut to it first (tokenizing a 50 MB
    line whole to keep 16 tokens took minutes), and counted. Examples longer than
    ``max_length`` are cut, and dropped when no target token is left;
    both are counted (``dataset.cuts``) and printed once as :meth:`CutCounts.message`, or are a
    ConfigError when ``on_truncate`` / ``on_drop`` is "error". ConfigError as well if no
    example is left.

    ``number_scope`` is the rows' default scope and ``task`` the source's task (for "answer"),
    see the module docstring: when any row's scope is not "all", every item gets
    ``number_mask`` (list of bool aligned with ``labels``)."""
    checked = isinstance(examples, CheckedRows)  # their weights checked as they were read
    rows, char_cut_rows, chars_cut, char_cap = cap_characters(
        list(examples), tokenizer, max_length
    )
    scopes = row_scopes(rows, number_scope, task, source)
    # the rows' weights (None: no weight given), checked before anything is tokenized
    weights = {i: ex[LOSS_WEIGHT_KEY] for i, ex in enumerate(rows)
               if ex.get(LOSS_WEIGHT_KEY) is not None}
    if not checked:
        for i, value in weights.items():
            check_loss_weight(value, f"{source}: example {i}")
    pc = [i for i, ex in enumerate(rows) if "completion" in ex]
    tx = [i for i, ex in enumerate(rows) if "completion" not in ex]
    eos = [tokenizer.eos_token_id] if add_eos else []
    ids_of: dict[int, tuple[list[int], list[int]]] = {}
    mask_of: dict[int, list[bool]] = {}
    full_length: dict[int, int] = {}  # before truncation
    if pc:
        prompts = tokenizer([rows[i]["prompt"] for i in pc])["input_ids"]
        texts = [rows[i]["completion"] for i in pc]
        if scopes is None:
            comps = tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            comps, masks = piece_masks(
                tokenizer, texts, [scopes[i] for i in pc], add_special_tokens=False
            )
            for i, p, m in zip(pc, prompts, masks, strict=True):
                mask_of[i] = ([False] * len(p) + m + [False] * len(eos))[:max_length]
        for i, p, c in zip(pc, prompts, comps, strict=True):
            c = list(c) + eos
            full_length[i] = len(p) + len(c)
            ids_of[i] = ((list(p) + c)[:max_length], ([IGNORE_INDEX] * len(p) + c)[:max_length])
    if tx:
        texts = [rows[i]["text"] for i in tx]
        if scopes is None:
            encoded = tokenizer(texts)["input_ids"]
        else:
            encoded, masks = piece_masks(
                tokenizer, texts, [scopes[i] for i in tx], add_special_tokens=True
            )
            for i, m in zip(tx, masks, strict=True):
                mask_of[i] = (m + [False] * len(eos))[:max_length]
        for i, t in zip(tx, encoded, strict=True):
            full_length[i] = len(t) + len(eos)
            ids = (list(t) + eos)[:max_length]
            ids_of[i] = (ids, list(ids))
    items = []
    truncated = dropped = 0
    for i, ex in enumerate(rows):
        ids, labels = ids_of[i]
        if all(lab == IGNORE_INDEX for lab in labels[1:]):
            dropped += 1  # truncation left no target
            continue
        truncated += full_length[i] > max_length or i in char_cut_rows
        item: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if scopes is not None:
            item["number_mask"] = mask_of[i]
        if i in weights:
            item[LOSS_WEIGHT_KEY] = float(weights[i])
        for key in extra_keys:
            if key not in ex:
                raise ConfigError(f"{source}: example {i} has no extra key {key!r}")
            item[key] = torch.as_tensor(ex[key])
        items.append(item)
    cuts = CutCounts(source, len(rows), truncated, dropped, max_length, len(char_cut_rows),
                     chars_cut, char_cap)
    if not items:
        raise ConfigError(
            f"{source}: no example has a target token left after truncation to "
            f"data.max_length={max_length}"
        )
    report_cuts(cuts, on_truncate, on_drop)
    return TokenizedDataset(items, cuts)


def pad_number_mask(
    features: Sequence[dict[str, Any]], lengths: Sequence[int], width: int, *, left: bool = False
) -> torch.Tensor:
    """[B, width] bool ``number_mask`` of the batch: each item's mask, False on padding.

    Raises ConfigError when only some items carry a mask, or a mask's length is not its
    item's."""
    out = torch.zeros((len(features), width), dtype=torch.bool)
    for i, (f, length) in enumerate(zip(features, lengths, strict=True)):
        if "number_mask" not in f:
            raise ConfigError(
                f"batch item {i} has no number_mask while others do: build every example with "
                "the same data pipeline (build_dataset / the VLM collator give all or none)"
            )
        mask = torch.as_tensor(f["number_mask"], dtype=torch.bool)
        if mask.numel() != length:
            raise ConfigError(
                f"batch item {i}: number_mask has {mask.numel()} entries for {length} tokens"
            )
        span = slice(width - length, width) if left else slice(0, length)
        out[i, span] = mask
    return out


def require_pad_token_id(pad_token_id: Any, what: str = "DataCollator") -> int:
    """``pad_token_id`` as an int, or a ValueError naming the fix: a tokenizer without a pad
    token (GPT-2's, ``emdlm.tokenizers.load_tokenizer("gpt2")``) cannot pad a batch."""
    if pad_token_id is None:
        raise ValueError(
            f"{what}: the tokenizer has no pad_token_id, so batches cannot be padded: set "
            "tokenizer.pad_token = tokenizer.eos_token first (GPT-2 has no pad token; "
            "emdlm.models.load_tokenizer does this for you)"
        )
    try:
        if isinstance(pad_token_id, bool):
            raise TypeError
        return operator.index(pad_token_id)
    except TypeError:
        raise ValueError(
            f"{what}: pad_token_id must be an integer token id, got {pad_token_id!r}"
        ) from None


class DataCollator:
    """Right-pads input_ids (pad id), labels (-100) and builds attention_mask; any other key
    whose values are tensors is stacked and passed through (e.g. "pixel_values"). Items with a
    ``number_mask`` (a number scope, module docstring) give a [B, T] bool ``number_mask``,
    False on padding, for the numeric losses (the Trainer glue takes it out of the model's
    inputs: :func:`emdlm.integrations.transformers.emdlm_trainer`). Items with a
    ``loss_weight`` or per-token ``loss_weights`` (module docstring) give a [B, T] float32
    ``loss_weights`` (:func:`pad_loss_weights`), taken out of the model's inputs the same way
    and handed to the loss.

    Position 0's label is set to -100: after the causal shift it is never a target, and this
    makes "count labels != -100" equal with or without the shift (so transformers'
    ``num_items_in_batch`` is the scored-token count either way).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = require_pad_token_id(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        width = max(lengths)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            width = (width + m - 1) // m * m
        n = len(features)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, (f, length) in enumerate(zip(features, lengths, strict=True)):
            input_ids[i, :length] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[i, :length] = torch.as_tensor(f["labels"], dtype=torch.long)
            attention[i, :length] = 1
        labels[:, 0] = IGNORE_INDEX
        batch: dict[str, torch.Tensor] = {
            "input_ids": input_ids, "labels": labels, "attention_mask": attention,
        }
        if any("number_mask" in f for f in features):
            batch["number_mask"] = pad_number_mask(features, lengths, width)
        if has_loss_weights(features):
            batch[TOKEN_WEIGHTS_KEY] = pad_loss_weights(features, lengths, width)
        for key in features[0]:
            if key in _BASE_KEYS:
                continue
            values = [f[key] for f in features]
            if all(isinstance(v, torch.Tensor) for v in values):
                batch[key] = torch.stack(values)
        return batch
