"""Per-row and per-token loss weights in the data, and the weighted token count of a batch.

A training row (a JSONL line, a ``datasets`` row) may carry ``"loss_weight"``: a finite number
≥ 0 that scales each of its scored tokens. One rule, :func:`check_loss_weight`, for every
source: ``None`` (JSON ``null``; in a ``datasets`` column, a row that lacks the field while
others have it) means "no weight given", exactly as the field absent: weight 1. A tokenized
item may instead carry ``"loss_weights"``, one weight per token of its ``input_ids`` (the two
multiply).

Each source's weights are checked once, before training, where they enter: rows read from a
file as they are read (:func:`emdlm.data.load_examples`), rows handed to
:func:`emdlm.data.build_dataset` there, a dataset handed to a trainer at its setup
(:func:`dataset_loss_weights`; a dataset built by emdlm declares ``loss_weights_checked`` and is
not read again). The collators (:class:`emdlm.data.DataCollator`, the TRL and VLM routes')
take the values as checked and only convert them (:func:`pad_loss_weights`; a value that is
no number, from a dataset no setup could read, is refused there with the same words) into
``loss_weights`` [B, T] float32 aligned with ``labels``, which the trainers take out of the
model's inputs and hand to a loss that declares ``takes_loss_weights``
(:class:`emdlm.losses.base.EMDLMLoss`); the loss's own check (finite and ≥ 0, in its one host
sync) still refuses a bad value from a dataset no setup could read.

With weights the loss of a micro-batch is Σ_t w_t·l_t, and the normaliser of gradient
accumulation is the weight sum over the scored tokens of the whole accumulated batch,
:func:`weighted_item_count` (transformers' ``num_items_in_batch`` counts labels, i.e. every
weight 1), so that any split into micro-batches gives the gradient of one big batch:

    Σ_mb Σ_{t∈mb} w_t·l_t / Σ_{t∈batch} w_t = the weighted mean over the batch.

This is ntloss's normalisation (Σ w·l / Σ w, AI4SD/number-token-loss ``ntloss/core.py``), not a
mean over the token count with weights only in the numerator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from emdlm.config import ConfigError
from emdlm.functional._common import IGNORE_INDEX

#: a row's weight, and a tokenized item's (and a batch's) per-token weights
LOSS_WEIGHT_KEY = "loss_weight"
TOKEN_WEIGHTS_KEY = "loss_weights"


def check_loss_weight(value: Any, where: str) -> float | None:
    """The one rule for a row's ``loss_weight`` value (``value`` None where the field is absent
    too): None is "no weight given" (weight 1) and is returned as None; any other value must be
    a finite number ≥ 0 and is returned as a float; anything else (a bool, a string, NaN, ±inf,
    a negative number) is a ConfigError naming ``where``."""
    if value is None:
        return None
    number = _scalar(value)
    if not _is_number(number) or not math.isfinite(number) or number < 0:
        raise _bad_weight(value, where)
    return float(number)


def _scalar(value: Any) -> Any:
    """A one-element tensor or array (a ``datasets`` column in torch / numpy format) as its
    Python number; anything else as it is."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        return value.item()
    return value


def _is_number(value: Any) -> bool:
    """A real number, not a bool (``True`` would pass as weight 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _bad_weight(value: Any, where: str) -> ConfigError:
    return ConfigError(
        f"{where}: field {LOSS_WEIGHT_KEY!r} must be a finite number >= 0, got {value!r}"
    )


def row_weight(value: Any, where: str = "batch item") -> float:
    """A ``loss_weight`` value as the collators use it: 1.0 for None ("no weight given"), else
    the number as a float. Only its type is checked here (a string or a bool from a dataset no
    setup could read, an iterable one, is :func:`check_loss_weight`'s ConfigError naming
    ``where``); a NaN, infinite or negative number is the loss's check, in its one host sync."""
    if value is None:
        return 1.0
    number = _scalar(value)
    if not _is_number(number):
        raise _bad_weight(value, where)
    return float(number)


def has_loss_weights(features: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any item carries a row weight or per-token weights (a ``None`` weight is no
    weight given, as :func:`check_loss_weight` says)."""
    keys = (LOSS_WEIGHT_KEY, TOKEN_WEIGHTS_KEY)
    return any(f.get(k) is not None for f in features for k in keys)


def pad_loss_weights(
    features: Sequence[Mapping[str, Any]], lengths: Sequence[int], width: int, *, left: bool = False
) -> torch.Tensor:
    """[B, width] float32 ``loss_weights`` of the batch: item i's ``loss_weight`` (1 when
    absent or None; checked at its source, :func:`row_weight` converts it and refuses a
    non-number) times its per-token ``loss_weights`` (when given, one per token) on its tokens,
    0 on padding. ConfigError naming the item for a row weight that is no number or a per-token
    list whose length is not the item's."""
    out = torch.zeros((len(features), width), dtype=torch.float32)
    for i, (f, length) in enumerate(zip(features, lengths, strict=True)):
        weight = row_weight(f.get(LOSS_WEIGHT_KEY), f"batch item {i}")
        row = torch.full((length,), weight, dtype=torch.float32)
        if f.get(TOKEN_WEIGHTS_KEY) is not None:
            per_token = torch.as_tensor(f[TOKEN_WEIGHTS_KEY], dtype=torch.float32).reshape(-1)
            if per_token.numel() != length:
                raise ConfigError(
                    f"batch item {i}: {TOKEN_WEIGHTS_KEY} has {per_token.numel()} entries for "
                    f"{length} tokens"
                )
            row = row * per_token
        span = slice(width - length, width) if left else slice(0, length)
        out[i, span] = row
    return out


def dataset_loss_weights(dataset: Any, where: str = "train_dataset") -> bool | None:
    """Whether ``dataset`` carries loss weights, every row weight checked on the way
    (:func:`check_loss_weight`: a ConfigError naming the row; ``None`` is no weight given):
    True / False for a list-backed dataset (``dataset.items``, :class:`emdlm.data.
    TokenizedDataset`; ``dataset.rows``, the image-text rows) or a ``datasets.Dataset`` (its
    columns); None for another dataset (not read: the loss refuses weights it cannot take at
    the first weighted batch). A dataset that declares ``loss_weights_checked`` (emdlm's own,
    built from rows checked where they entered) is only looked at, not checked again."""
    checked = bool(getattr(dataset, "loss_weights_checked", False))
    rows = getattr(dataset, "items", None)
    if not isinstance(rows, list):
        rows = getattr(dataset, "rows", None)
    columns = getattr(dataset, "column_names", None)
    if isinstance(rows, list) and all(isinstance(r, Mapping) for r in rows):
        values = [r.get(LOSS_WEIGHT_KEY) for r in rows]
        found = has_loss_weights(rows)
    elif isinstance(columns, list):
        values = list(dataset[LOSS_WEIGHT_KEY]) if LOSS_WEIGHT_KEY in columns else []
        # a column of None only (no row gives a weight) is no weight given, as in a list
        found = TOKEN_WEIGHTS_KEY in columns or any(v is not None for v in values)
    else:
        return None
    if not checked:
        for i, value in enumerate(values):
            check_loss_weight(value, f"{where}: row {i}")
    return found


def refuse_weights_on(route: str) -> ValueError:
    """The error of a route whose framework counts ``num_items_in_batch`` itself (labels, not
    weights): a weighted batch reaching it is refused, never silently mis-normalised."""
    return ValueError(
        f"{route} got a batch with {TOKEN_WEIGHTS_KEY} (the data's {LOSS_WEIGHT_KEY!r} field), "
        "but the framework normalises by its label count, not by the weights: train with "
        "EMDLMTrainer / emdlm_trainer(Trainer) and make_compute_loss_func(loss_fn)"
    )


def weighted_item_count(batch_samples: Sequence[Any]) -> torch.Tensor | None:
    """Σ w_t over the scored labels (``labels[..., 1:] != -100``, the positions a causal loss
    scores) of all ``batch_samples`` (the micro-batches of one optimizer step), with their
    ``loss_weights`` shifted alike; a micro-batch without weights counts each label as 1.
    None when no micro-batch has weights (then the label count is the normaliser).

    A micro-batch with its own ``shift_labels`` (padding-free collators) is refused with
    weights: they are aligned with ``labels``."""
    if not any(isinstance(b, Mapping) and b.get(TOKEN_WEIGHTS_KEY) is not None
               for b in batch_samples):
        return None
    total: torch.Tensor | None = None
    for batch in batch_samples:
        if "shift_labels" in batch:
            raise ValueError(
                f"{TOKEN_WEIGHTS_KEY} with a batch's own shift_labels (a padding-free collator) "
                "is not supported: the weights are aligned with labels"
            )
        labels = batch["labels"][..., 1:]
        scored = labels != IGNORE_INDEX
        weights = batch.get(TOKEN_WEIGHTS_KEY)
        part = (scored.sum().float() if weights is None
                else torch.where(scored, weights[..., 1:].to(labels.device), 0.0).sum().float())
        total = part if total is None else total + part.to(total.device)
    return total


__all__ = [
    "LOSS_WEIGHT_KEY", "TOKEN_WEIGHTS_KEY", "check_loss_weight", "dataset_loss_weights",
    "has_loss_weights", "pad_loss_weights", "refuse_weights_on", "row_weight",
    "weighted_item_count",
]
