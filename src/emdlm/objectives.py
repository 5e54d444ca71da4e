"""Objective factory: config name + params -> an emdlm loss module with ``reduction="sum"``.

The integration divides the summed loss by the token count of the whole (accumulated,
all-process) batch, so every objective is built with ``reduction="sum"``. Loss modules are
imported only when asked for, so the CLI works with whichever objectives are installed.

What each objective is (its class, what it is built from, its settable parameters) is declared
once, in :mod:`emdlm.objective_specs`; the tables here are derived from it. The distillation
objectives (``DISTILL``) take the teacher's logits as a dense target; every other objective
refuses a teacher (checked in ``RunConfig.validate`` and here).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from emdlm.config import ConfigError, ObjectiveConfig, did_you_mean
from emdlm.objective_specs import OBJECTIVE_SPECS

# derived from the one registry (emdlm.objective_specs)
_CLASSES = {name: (spec.module, spec.class_name) for name, spec in OBJECTIVE_SPECS.items()}
NUMERIC = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.numeric)
DISTILL = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.teacher)
# objectives built from a cost embedding
COST_EMBEDDING = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.cost_embedding)


def objective_class(name: str) -> type[nn.Module]:
    """The loss class for objective ``name`` (ConfigError if unknown or not importable)."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown objective {name!r}{did_you_mean(name, _CLASSES)}; choose one "
                          f"of {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"objective {name!r} is not available ({module}.{cls}): {err}") from err


def _folder_output_embedding(folder: Path) -> torch.Tensor:
    """The output embedding [V, d] of the causal LM saved in ``folder`` (a Hugging Face folder;
    no remote code), e.g. a pre-trained oracle's head for a student trained from scratch; read
    from its safetensors without building the model where possible."""
    from emdlm.weights import output_embedding_from_folder

    try:
        weight = output_embedding_from_folder(folder)
    except ConfigError as err:
        raise ConfigError(f"cost embedding folder: {err}") from err
    return weight.detach().to(torch.float32, copy=True)


def load_cost_embedding(
    source: str | None, model: Any, vocab_size: int, teacher: Any = None
) -> torch.Tensor:
    """EMO's cost embedding: "model" (frozen copy of the model's output embedding now),
    "teacher" (the same from the distillation teacher), a model folder (its output embedding) or
    a tensor file (.pt / .safetensors, first tensor) with ``vocab_size`` rows."""
    if source == "teacher":
        if teacher is None:
            raise ConfigError("objective.cost_embedding=teacher needs a teacher (`teacher:`)")
        model, source = teacher, "model"
    if source is None:
        raise ConfigError(
            "objective 'emo' needs a cost embedding: set objective.cost_embedding=model (a frozen "
            "copy of the model's output embedding at the start) or a path to a [V, d] tensor file"
        )
    if source == "model":
        from emdlm.losses.emo import cost_embedding_from

        emb = cost_embedding_from(model)
    elif Path(source).is_dir():
        emb = _folder_output_embedding(Path(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"cost embedding file or model folder not found: {path}")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if not tensors:
                raise ConfigError(f"{path}: no tensor inside")
            emb = next(iter(tensors.values()))
        else:
            import pickle

            from emdlm.weights import weights_only_refusal

            try:  # weights_only: a pickle that would run code is refused, never loaded
                emb = torch.load(str(path), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise ConfigError(
                    f"cost embedding: {weights_only_refusal(err, path)}"
                ) from err
        if not isinstance(emb, torch.Tensor):
            raise ConfigError(f"{path}: expected a tensor, got {type(emb).__name__}")
    if emb.dim() != 2 or emb.shape[0] != vocab_size:
        raise ConfigError(
            f"cost embedding must be [V={vocab_size}, d], got shape {tuple(emb.shape)}"
        )
    return emb.detach()


def build_objective(
    cfg: ObjectiveConfig, *, tokenizer: Any, model: Any, vocab_size: int, teacher: Any = None
) -> nn.Module:
    """The loss module for ``cfg`` with ``reduction="sum"``; ConfigError for any bad input
    (unknown parameter, tokenizer without digit tokens, missing cost embedding, a teacher for an
    objective that takes none or none for a distillation objective). ``emo_distill``'s cost
    embedding defaults to the teacher's output embedding."""
    params = dict(cfg.params)
    if "reduction" in params:
        raise ConfigError("objective.params.reduction is fixed to 'sum' by the trainer")
    if cfg.cost_embedding is not None and cfg.name not in COST_EMBEDDING:
        raise ConfigError(
            f"objective.cost_embedding only applies to objectives {', '.join(COST_EMBEDDING)}"
        )
    check_teacher_objective(cfg.name, teacher is not None)
    if cfg.name in NUMERIC:  # before importing the loss: the clearest message comes first
        number_vocab = _number_vocab(tokenizer, vocab_size, cfg.name)
    cls = objective_class(cfg.name)
    _check_params(cfg.name, cls, params)
    try:
        if cfg.name in NUMERIC:
            return cls(number_vocab, reduction="sum", **params)
        if cfg.name == "emo":
            emb = load_cost_embedding(cfg.cost_embedding, model, vocab_size)
            return cls(emb, reduction="sum", **params)
        if cfg.name == "emo_distill":
            source = cfg.cost_embedding or "teacher"
            emb = load_cost_embedding(source, model, vocab_size, teacher)
            return cls(emb, reduction="sum", **params)
        return cls(reduction="sum", **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"objective {cfg.name!r} with params {params}: {err}") from err


def check_teacher_objective(name: str, has_teacher: bool) -> None:
    """ConfigError unless a teacher is given exactly for the distillation objectives."""
    if has_teacher and name not in DISTILL:
        raise ConfigError(
            f"a teacher is set but objective {name!r} takes no target distribution; use one of "
            f"{', '.join(DISTILL)} to distil, or remove `teacher:`"
        )
    if not has_teacher and name in DISTILL:
        raise ConfigError(
            f"objective {name!r} distils from a teacher: set `teacher: <local model folder>` "
            "(a Hugging Face causal LM with the student's tokenizer)"
        )


def _init_parameters(cls: type) -> list[inspect.Parameter]:
    """Keyword parameters of ``cls.__init__``, following ``**kwargs`` up the MRO (a subclass
    that forwards ``**kwargs`` to its base accepts the base's names too)."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass in (nn.Module, object):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]  # no self
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                found.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(found.values())


def settable_parameters(name: str, cls: type) -> list[str]:
    """The keyword parameters of objective ``name``'s class ``cls`` that ``objective.params`` may
    set, in signature order: all but what the factory passes itself (the number vocab or cost
    embedding, and ``reduction``). The registry's declared ``params`` are pinned to this."""
    accepted = _init_parameters(cls)
    passed = {"reduction"}
    if (name in NUMERIC or name in COST_EMBEDDING) and accepted:
        passed.add(accepted[0].name)
    return [p.name for p in accepted if p.name not in passed]


def _check_params(name: str, cls: type, params: dict[str, Any]) -> None:
    """ConfigError for a key of ``objective.params`` that the loss class does not take, with the
    nearest accepted name (read from the signature, so it cannot drift from the class)."""
    settable = settable_parameters(name, cls)
    for key in params:
        if key not in settable:
            raise ConfigError(
                f"objective {name!r} has no parameter objective.params.{key}"
                f"{did_you_mean(key, settable)}; it takes {', '.join(settable) or 'none'}"
            )


def _number_vocab(tokenizer: Any, vocab_size: int, objective: str) -> Any:
    """The tokenizer's NumberVocab; whether the objective scores any of its tokens (which
    depends on its ``digits_only``) is the loss class's check, the same on the API."""
    from emdlm.numbers import NumberVocab

    try:
        vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size)
    except ValueError as err:
        raise ConfigError(f"objective {objective!r} needs digit tokens: {err}") from err
    return vocab
