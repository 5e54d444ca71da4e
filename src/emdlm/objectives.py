"""Objective factory: config name + params -> an emdlm loss module with ``reduction="sum"``.

The integration divides the summed loss by the token count of the whole (accumulated,
all-process) batch, so every objective is built with ``reduction="sum"``. Loss modules are
imported only when asked for, so the CLI works with whichever objectives are installed.

What each objective is (its class, what it is built from, its settable parameters) is declared
once, in :mod:`emdlm.objective_specs`; the tables here are derived from it. The distillation
objectives (``DISTILL``) take the teacher's logits as a dense target; every other objective
refuses a teacher (checked in ``RunConfig.validate`` and here).

A loss class of the user's own is named ``objective.name=<module>:<Class>``: the module is
imported (:func:`importlib.import_module`, from ``sys.path``: PYTHONPATH, installed packages)
only here, when the objective is built for training, never while a config is read; the class
must derive from :class:`emdlm.losses.base.EMDLMLoss`, and its :func:`class_spec`, read from
what the class declares, goes through the same checks as a registered objective's.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from emdlm.config import ConfigError, ObjectiveConfig, check_lam_schedule, did_you_mean
from emdlm.objective_specs import (
    LOSS_BASE,
    OBJECTIVE_SPECS,
    ObjectiveSpec,
    class_reference_problem,
    is_class_reference,
    spec_of_class,
)

# derived from the one registry (emdlm.objective_specs)
_CLASSES = {name: (spec.module, spec.class_name) for name, spec in OBJECTIVE_SPECS.items()}
NUMERIC = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.numeric)
DISTILL = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.teacher)
# objectives built from a cost embedding
COST_EMBEDDING = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.cost_embedding)


def objective_class(name: str) -> type[nn.Module]:
    """The loss class for objective ``name``: a registered name or ``<module>:<Class>``
    (ConfigError if unknown or not importable, naming why in one line)."""
    if is_class_reference(name):
        return _user_class(name)
    if name not in _CLASSES:
        raise ConfigError(f"unknown objective {name!r}{did_you_mean(name, _CLASSES)}; choose one "
                          f"of {', '.join(_CLASSES)}, or <module>:<Class> for a loss class of "
                          "your own")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"objective {name!r} is not available ({module}.{cls}): {err}") from err


def weighable_objectives() -> list[str]:
    """The registered objectives whose loss takes per-token ``loss_weights``
    (``takes_loss_weights``), in registry order."""
    return [name for name in OBJECTIVE_SPECS
            if getattr(objective_class(name), "takes_loss_weights", False)]


def _user_class(name: str) -> type[nn.Module]:
    """The class ``<module>:<Class>`` names, imported now (running the module's code: the
    user's explicit choice in ``objective.name``); ConfigError for a module that does not
    import, a missing attribute, or something that is not an EMDLMLoss subclass."""
    from emdlm.losses.base import EMDLMLoss

    problem = class_reference_problem(name)
    if problem is not None:
        raise ConfigError(f"objective.name: {problem}")
    module_name, _, attribute = name.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as err:  # the user's module: whatever its code raised, in one line
        raise ConfigError(
            f"objective.name={name}: module {module_name!r} is not importable "
            f"({type(err).__name__}: {_first_line(err)}); it is looked up on sys.path "
            "(PYTHONPATH, installed "
            "packages)"
        ) from err
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"objective.name={name}: module {module_name!r} has no attribute "
                              f"{attribute!r}{did_you_mean(part, dir(found))}")
        found = getattr(found, part)
    if not isinstance(found, type):
        raise ConfigError(f"objective.name={name}: {attribute!r} is a {type(found).__name__}, "
                          f"not a loss class (a subclass of {LOSS_BASE})")
    if not issubclass(found, EMDLMLoss):
        raise ConfigError(f"objective.name={name}: class {found.__qualname__} does not derive "
                          f"from {LOSS_BASE}, the base of every emdlm loss")
    return found


def _first_line(err: BaseException) -> str:
    """The first line of what ``err`` says (an error is reported in one line)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def class_spec(name: str, cls: type) -> ObjectiveSpec:
    """The :class:`ObjectiveSpec` of a user's loss class ``cls`` named ``name``, read from what it
    declares: ``takes_number_mask`` (built from the tokenizer's NumberVocab, passed first, as the
    numeric objectives are; a λ schedule may apply), ``needs_teacher`` (a teacher, needed),
    its ``__init__`` keywords (the settable ``params``) and ``param_domains`` merged over the
    domains of the nearest registered class it derives from (:func:`spec_of_class`); built from
    a cost embedding only when it derives from a registered class that is."""
    ancestor = spec_of_class(cls)
    numeric = bool(getattr(cls, "takes_number_mask", False))
    cost = bool(ancestor is not None and ancestor.cost_embedding)
    doc = (inspect.getdoc(cls) or "").strip().splitlines()
    return ObjectiveSpec(
        name, cls.__module__, cls.__qualname__,
        doc[0] if doc else f"the loss class {cls.__qualname__}",
        tuple(_settable(cls, passes_first=numeric or cost)),
        numeric=numeric,
        cost_embedding=cost,
        teacher=bool(getattr(cls, "needs_teacher", False)),
        domains=dict(ancestor.domains) if ancestor is not None else {},
    )


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
    embedding defaults to the teacher's output embedding. A user's class (``<module>:<Class>``)
    goes through the checks ``RunConfig.validate`` makes of a registered objective (teacher,
    λ schedule, parameter domains) here, where it is imported, then through
    :func:`_check_contract`."""
    params = dict(cfg.params)
    if "reduction" in params:
        raise ConfigError("objective.params.reduction is fixed to 'sum' by the trainer")
    spec = OBJECTIVE_SPECS.get(cfg.name)
    if spec is not None:  # before importing the loss: the clearest message comes first
        _check_before_building(cfg, spec, teacher)
        number_vocab = _number_vocab(tokenizer, vocab_size, cfg.name) if spec.numeric else None
        cls = objective_class(cfg.name)
    else:  # a user's class: imported now, then checked as RunConfig.validate checks the others
        cls = objective_class(cfg.name)
        spec = class_spec(cfg.name, cls)
        _check_before_building(cfg, spec, teacher)
        check_lam_schedule(cfg, spec.numeric)
        problems = spec.param_problems(params, "objective.params.")
        if problems:
            raise ConfigError(f"objective {cfg.name!r}: {'; '.join(problems)}")
        number_vocab = _number_vocab(tokenizer, vocab_size, cfg.name) if spec.numeric else None
    _check_params(cfg.name, spec, cls, params)
    try:
        if spec.numeric:
            loss = cls(number_vocab, reduction="sum", **params)
        elif spec.cost_embedding:  # a distillation objective's defaults to the teacher's
            source = cfg.cost_embedding or ("teacher" if spec.teacher else None)
            emb = load_cost_embedding(source, model, vocab_size, teacher)
            loss = cls(emb, reduction="sum", **params)
        else:
            loss = cls(reduction="sum", **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"objective {cfg.name!r} with params {params}: {err}") from err
    if cfg.name not in OBJECTIVE_SPECS:
        _check_contract(cfg.name, cls, loss)
    return loss


def _check_before_building(cfg: ObjectiveConfig, spec: ObjectiveSpec, teacher: Any) -> None:
    """A cost embedding only for an objective built from one, a teacher exactly for one that
    distils."""
    if cfg.cost_embedding is not None and not spec.cost_embedding:
        raise ConfigError(
            f"objective.cost_embedding only applies to objectives {', '.join(COST_EMBEDDING)}"
        )
    check_teacher_objective(cfg.name, teacher is not None, spec.teacher)


def _check_contract(name: str, cls: type, loss: nn.Module) -> None:
    """What the training loop relies on of every loss (:class:`emdlm.losses.base.EMDLMLoss`),
    checked of a user's class once built: ``logits_loss`` implemented (what the base's
    ``forward`` calls after checking the call's keywords; a class may instead override
    ``forward`` itself), ``reduction`` kept at ``"sum"``, an integer ``ignore_index``, and a
    ``chunk_objective`` when the class declares ``has_from_hidden`` (the base's default)."""
    from emdlm.losses.base import EMDLMLoss

    where = f"objective {name!r} ({cls.__qualname__})"
    if cls.forward is EMDLMLoss.forward and cls.logits_loss is EMDLMLoss.logits_loss:
        raise ConfigError(f"{where} implements no logits_loss(logits, labels, ...) (nor forward)")
    reduction = getattr(loss, "reduction", None)
    if reduction != "sum":
        raise ConfigError(f"{where} must keep reduction='sum' as built (the trainer divides the "
                          f"sum by the batch's token count), got {reduction!r}")
    index = getattr(loss, "ignore_index", None)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError(f"{where} must set an integer ignore_index in __init__ (the label of "
                          f"positions not scored, -100 by default), got {index!r}")
    if getattr(cls, "has_from_hidden", True) and cls.chunk_objective is EMDLMLoss.chunk_objective:
        raise ConfigError(f"{where} declares has_from_hidden (EMDLMLoss's default) but implements "
                          "no chunk_objective: implement it, or set has_from_hidden = False on the "
                          "class (it then trains on the logits path only)")


def check_teacher_objective(name: str, has_teacher: bool, distils: bool | None = None) -> None:
    """ConfigError unless a teacher is given exactly for the distillation objectives
    (``distils``: whether objective ``name`` distils; default, the registry's word)."""
    if distils is None:
        distils = name in DISTILL
    if has_teacher and not distils:
        raise ConfigError(
            f"a teacher is set but objective {name!r} takes no target distribution; use one of "
            f"{', '.join(DISTILL)} to distil, or remove `teacher:`"
        )
    if not has_teacher and distils:
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
    spec = OBJECTIVE_SPECS.get(name) or class_spec(name, cls)
    return _settable(cls, passes_first=spec.numeric or spec.cost_embedding)


def _settable(cls: type, *, passes_first: bool) -> list[str]:
    """``cls``'s keyword parameters but ``reduction`` and, when the factory passes it, the first
    (the number vocab or the cost embedding)."""
    accepted = _init_parameters(cls)
    passed = {"reduction"}
    if passes_first and accepted:
        passed.add(accepted[0].name)
    return [p.name for p in accepted if p.name not in passed]


def _check_params(
    name: str, spec: ObjectiveSpec, cls: type, params: dict[str, Any]
) -> None:
    """ConfigError for a key of ``objective.params`` that the loss class does not take, with the
    nearest accepted name (read from the signature, so it cannot drift from the class)."""
    settable = _settable(cls, passes_first=spec.numeric or spec.cost_embedding)
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
