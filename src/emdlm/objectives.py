"""Objective factory: config name + params -> an emdlm loss module with ``reduction="sum"``.

The integration divides the summed loss by the token count of the whole (accumulated,
all-process) batch, so every objective is built with ``reduction="sum"``. Loss modules are
imported only when asked for, so the CLI works with whichever objectives are installed.

| name  | class                                  | needs                                  |
|-------|----------------------------------------|----------------------------------------|
| ce    | emdlm.losses.ce.CrossEntropyLoss       | -                                      |
| emd   | emdlm.losses.ntil.DigitEMDLoss         | a tokenizer with digit tokens '0'..'9' |
| ntil  | emdlm.losses.ntil.NTILLoss             | a tokenizer with digit tokens '0'..'9' |
| emo   | emdlm.losses.emo.EMOLoss               | a cost embedding [V, d]                |
| tailr | emdlm.losses.tailr.TaiLrLoss           | -                                      |
| mixce | emdlm.losses.mixce.MixCELoss           | -                                      |
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from emdlm.config import ConfigError, ObjectiveConfig

_CLASSES = {
    "ce": ("emdlm.losses.ce", "CrossEntropyLoss"),
    "emd": ("emdlm.losses.ntil", "DigitEMDLoss"),
    "ntil": ("emdlm.losses.ntil", "NTILLoss"),
    "emo": ("emdlm.losses.emo", "EMOLoss"),
    "tailr": ("emdlm.losses.tailr", "TaiLrLoss"),
    "mixce": ("emdlm.losses.mixce", "MixCELoss"),
}
NUMERIC = ("emd", "ntil")


def objective_class(name: str) -> type[nn.Module]:
    """The loss class for objective ``name`` (ConfigError if unknown or not importable)."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown objective {name!r}; choose one of {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"objective {name!r} is not available ({module}.{cls}): {err}") from err


def load_cost_embedding(source: str | None, model: Any, vocab_size: int) -> torch.Tensor:
    """EMO's cost embedding: "model" (frozen copy of the model's output embedding now) or a
    tensor file (.pt / .safetensors, first tensor) with ``vocab_size`` rows."""
    if source is None:
        raise ConfigError(
            "objective 'emo' needs a cost embedding: set objective.cost_embedding=model (a frozen "
            "copy of the model's output embedding at the start) or a path to a [V, d] tensor file"
        )
    if source == "model":
        from emdlm.losses.emo import cost_embedding_from

        emb = cost_embedding_from(model)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"cost embedding file not found: {path}")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if not tensors:
                raise ConfigError(f"{path}: no tensor inside")
            emb = next(iter(tensors.values()))
        else:
            emb = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(emb, torch.Tensor):
            raise ConfigError(f"{path}: expected a tensor, got {type(emb).__name__}")
    if emb.dim() != 2 or emb.shape[0] != vocab_size:
        raise ConfigError(
            f"cost embedding must be [V={vocab_size}, d], got shape {tuple(emb.shape)}"
        )
    return emb.detach()


def build_objective(
    cfg: ObjectiveConfig, *, tokenizer: Any, model: Any, vocab_size: int
) -> nn.Module:
    """The loss module for ``cfg`` with ``reduction="sum"``; ConfigError for any bad input
    (unknown parameter, tokenizer without digit tokens, missing cost embedding)."""
    params = dict(cfg.params)
    if "reduction" in params:
        raise ConfigError("objective.params.reduction is fixed to 'sum' by the trainer")
    if cfg.cost_embedding is not None and cfg.name != "emo":
        raise ConfigError("objective.cost_embedding only applies to objective 'emo'")
    if cfg.name in NUMERIC:  # before importing the loss: the clearest message comes first
        number_vocab = _number_vocab(tokenizer, vocab_size, cfg.name)
    cls = objective_class(cfg.name)
    try:
        if cfg.name in NUMERIC:
            return cls(number_vocab, reduction="sum", **params)
        if cfg.name == "emo":
            emb = load_cost_embedding(cfg.cost_embedding, model, vocab_size)
            return cls(emb, reduction="sum", **params)
        return cls(reduction="sum", **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"objective {cfg.name!r} with params {params}: {err}") from err


def _number_vocab(tokenizer: Any, vocab_size: int, objective: str) -> Any:
    from emdlm.numbers import NumberVocab

    try:
        vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size)
    except ValueError as err:
        raise ConfigError(f"objective {objective!r} needs digit tokens: {err}") from err
    if not bool(vocab.is_number.any()) or bool((vocab.digit_ids < 0).all()):
        raise ConfigError(
            f"objective {objective!r} scores digit tokens, but tokenizer "
            f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no token "
            "that is a run of digits; use a tokenizer with digit tokens (e.g. 'char', 'qwen')"
        )
    return vocab
