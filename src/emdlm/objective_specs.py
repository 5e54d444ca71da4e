"""The one registry of training objectives: what each is and what it takes, as plain data.

Each :class:`ObjectiveSpec` names its loss class by strings (``module``, ``class_name``), so this
module imports no loss and sits at the bottom with the config: :mod:`emdlm.config` reads the
names, the teacher and λ-schedule rules and the settable parameters from here, and
:mod:`emdlm.objectives` imports the class only when an objective is built. ``params`` is
declared, not read from the class; tests/test_objective_registry.py pins it equal to the class
signature (:func:`emdlm.objectives.settable_parameters`), so it cannot drift.

``domains`` declares the legal values of each numeric parameter (:class:`emdlm.domains.Domain`):
the one table that both the loss classes (:class:`emdlm.losses.base.EMDLMLoss` checks it before
``__init__`` runs) and the config (``objective.params``, in :meth:`emdlm.config.RunConfig.validate`,
before anything is loaded or written) read; tests/test_audit_third_params.py pins that every
float or int parameter of every class has one and that NaN, ±inf and out-of-domain values are
refused on both.

A loss class of the user's own is not registered here: ``objective.name=<module>:<Class>``
names it (:func:`is_class_reference`; only the form is checked while a config is read,
:func:`class_reference_problem`), :mod:`emdlm.objectives` imports it when the objective is built
and reads its spec from what the class declares; its ``param_domains``, laid over those of the
registered class it derives from, are its domains (:func:`spec_of_class`).

| name        | class                                  | built from / needs                     |
|-------------|----------------------------------------|----------------------------------------|
| ce          | emdlm.losses.ce.CrossEntropyLoss       | -                                      |
| emd         | emdlm.losses.ntil.DigitEMDLoss         | digit tokens '0'..'9' (NumberVocab)    |
| ntil        | emdlm.losses.ntil.NTILLoss             | digit tokens '0'..'9' (NumberVocab)    |
| emo         | emdlm.losses.emo.EMOLoss               | a cost embedding [V, d]                |
| tailr       | emdlm.losses.tailr.TaiLrLoss           | -                                      |
| mixce       | emdlm.losses.mixce.MixCELoss           | -                                      |
| dft         | emdlm.losses.dft.DFTLoss               | -                                      |
| ntl_mse     | emdlm.losses.ntl.NTLMSELoss            | number tokens (NumberVocab)            |
| ntl_was     | emdlm.losses.ntl.NTLWASLoss            | number tokens (NumberVocab)            |
| number_level| emdlm.losses.ntl.NumberLevelLoss       | number tokens (NumberVocab)            |
| emo_distill | emdlm.losses.emo_distill.EMODistillLoss | a teacher, a cost embedding (teacher's)|
| kl_distill  | emdlm.losses.emo_distill.KLDistillLoss  | a teacher                              |
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from emdlm.domains import (
    COUNT,
    INTEGER,
    NONNEGATIVE,
    POSITIVE,
    UNIT,
    Domain,
    domain_problems,
)


@dataclass(frozen=True)
class ObjectiveSpec:
    """One training objective.

    name: the config name (``objective.name``).
    module, class_name: where the loss class lives (imported lazily by emdlm.objectives).
    summary: one line for listings and messages.
    params: the keyword arguments of the class that ``objective.params`` may set (the factory
        passes the number vocab / cost embedding and ``reduction`` itself).
    numeric: built from the tokenizer's ``NumberVocab``; has the numeric term weight λ that
        ``objective.lam_schedule`` / ``lam_final`` schedule.
    cost_embedding: built from a cost embedding (``objective.cost_embedding``).
    teacher: distils from a teacher (``teacher:``), which it needs; every other objective
        refuses one.
    domains: the legal values of each numeric parameter of ``params`` (NaN and ±inf are in
        none); the class's own checks of how parameters combine (e.g. EMO's ``mu`` only with
        ``mode="static"``) come after.
    """

    name: str
    module: str
    class_name: str
    summary: str
    params: tuple[str, ...]
    numeric: bool = False
    cost_embedding: bool = False
    teacher: bool = False
    domains: Mapping[str, Domain] = field(default_factory=dict, hash=False)

    def param_problems(self, params: Mapping[str, Any], prefix: str = "") -> list[str]:
        """What is wrong with each value of ``params`` outside its declared domain, in words
        (``"lam=nan must be a finite number >= 0, got nan"``); empty when all are legal."""
        return domain_problems(self.domains, params, prefix)

    @property
    def path(self) -> str:
        """``module.ClassName`` of the loss class."""
        return f"{self.module}.{self.class_name}"


# NTIL and digit EMD share one signature (DigitEMDLoss forwards **kwargs to NTILLoss)
_NUMERIC_PARAMS = (
    "lam", "sigma", "emd_weight", "mix", "value_mode", "ignore_index", "vocab_size", "alpha",
    "beta", "tau", "noise_scale", "join_decimal", "signed", "digits_only", "thousands_separator",
    "averaging", "smoothing", "implementation", "generator", "chunk_elements", "max_ratio",
    "per_number", "magnitude_floor",
)

_IGNORE = {"ignore_index": INTEGER}
# NTIL Eq. 4: NTIL = w·(W·EMD) + α·relative + β·magnitude, weighted by λ against CE; every
# weight >= 0 (a negative one rewards a worse prediction: the loss is unbounded below);
# σ > -1 keeps the position weight (1+σ)^r positive; τ is the Gumbel-softmax temperature
_NUMERIC_DOMAINS = {
    "lam": NONNEGATIVE, "alpha": NONNEGATIVE, "beta": NONNEGATIVE, "emd_weight": NONNEGATIVE,
    "sigma": Domain(low=-1.0, low_open=True), "tau": POSITIVE, "noise_scale": NONNEGATIVE,
    "vocab_size": COUNT.or_(None), "chunk_elements": COUNT,
    "max_ratio": POSITIVE.or_(None, "preset"), "magnitude_floor": NONNEGATIVE.or_(None),
    **_IGNORE,
}
# ntloss: L = CE + λ·NTL
_NTL_DOMAINS = {"lam": NONNEGATIVE, "vocab_size": COUNT.or_(None), **_IGNORE}
# EMO Eq. 19 (static mode): L = CE + μ·DEMD
_EMO_DOMAINS = {
    "mu": NONNEGATIVE, "chunk_size": COUNT.or_(None), "max_ratio": POSITIVE.or_(None), **_IGNORE,
}

OBJECTIVE_SPECS: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            "ce", "emdlm.losses.ce", "CrossEntropyLoss",
            "cross-entropy, the baseline (optional label smoothing, z-loss, token accuracy)",
            ("ignore_index", "label_smoothing", "z_loss", "token_accuracy", "entropy",
             "predicted_tokens"),
            domains={"label_smoothing": UNIT, "z_loss": NONNEGATIVE, **_IGNORE},
        ),
        ObjectiveSpec(
            "emd", "emdlm.losses.ntil", "DigitEMDLoss",
            "CE + the position-weighted digit EMD (the NTIL paper's EMD baseline)",
            ("preset", *_NUMERIC_PARAMS),
            numeric=True,
            domains=_NUMERIC_DOMAINS,
        ),
        ObjectiveSpec(
            "ntil", "emdlm.losses.ntil", "NTILLoss",
            "CE + NTIL: digit EMD and the number-level value terms (NTIL Eq. 4)",
            ("preset", "lam", "alpha", "beta", "sigma", "emd_weight", "mix", "value_mode", "tau",
             "noise_scale", "ignore_index", "vocab_size", "join_decimal", "signed",
             "digits_only", "thousands_separator", "averaging", "smoothing", "implementation",
             "generator", "chunk_elements", "max_ratio", "per_number", "magnitude_floor"),
            numeric=True,
            domains=_NUMERIC_DOMAINS,
        ),
        ObjectiveSpec(
            "emo", "emdlm.losses.emo", "EMOLoss",
            "EMO: CE mixed with the differentiable EMD under a cost embedding (EMO Eq. 19)",
            ("mode", "mu", "ignore_index", "implementation", "chunk_size", "max_ratio"),
            cost_embedding=True,
            domains=_EMO_DOMAINS,
        ),
        ObjectiveSpec(
            "tailr", "emdlm.losses.tailr", "TaiLrLoss",
            "TaiLr: CE weighted by the model's own probability of the label",
            ("gamma", "min_weight", "label_smoothing", "preset", "mixing_ratio", "ignore_index"),
            # TaiLr: w = q / (γ + (1-γ)·q) clipped below at min_weight; γ = 0 is 0/0 at q = 0
            domains={
                "gamma": Domain(low=0.0, high=1.0, low_open=True), "min_weight": UNIT,
                "label_smoothing": Domain(low=0.0, high=1.0, high_open=True),
                "mixing_ratio": UNIT.or_(None), **_IGNORE,
            },
        ),
        ObjectiveSpec(
            "mixce", "emdlm.losses.mixce", "MixCELoss",
            "MixCE: forward and reverse cross-entropy mixed by eta",
            ("eta", "ignore_index"),
            domains={"eta": UNIT, **_IGNORE},  # L = η·forward CE + (1-η)·reverse CE
        ),
        ObjectiveSpec(
            "dft", "emdlm.losses.dft", "DFTLoss",
            "DFT: CE weighted by the model's own probability of the label (TRL loss_type=dft)",
            ("ignore_index",),
            domains=_IGNORE,
        ),
        ObjectiveSpec(
            "ntl_mse", "emdlm.losses.ntl", "NTLMSELoss",
            "CE + ntloss's NTL-MSE: expected token value vs the gold value (mse / l1 / huber)",
            ("preset", "lam", "loss", "reweigh", "averaging", "ignore_index", "vocab_size",
             "digits_only"),
            numeric=True,
            domains=_NTL_DOMAINS,
        ),
        ObjectiveSpec(
            "ntl_was", "emdlm.losses.ntl", "NTLWASLoss",
            "CE + ntloss's NTL-WAS: Wasserstein-1 distance of each number token to the gold",
            ("preset", "lam", "reweigh", "averaging", "ignore_index", "vocab_size",
             "digits_only", "squash_factor"),
            numeric=True,
            # ntloss NTLoss: the farthest wrong digit costs squash_factor x the closest
            domains={**_NTL_DOMAINS, "squash_factor": Domain(low=1.0, low_open=True).or_(None)},
        ),
        ObjectiveSpec(
            "number_level", "emdlm.losses.ntl", "NumberLevelLoss",
            "CE + ntloss's number-level loss: relative error of each whole number's value",
            ("preset", "lam", "reweigh", "float_level", "averaging", "ignore_index",
             "vocab_size", "digits_only"),
            numeric=True,
            domains=_NTL_DOMAINS,
        ),
        ObjectiveSpec(
            "emo_distill", "emdlm.losses.emo_distill", "EMODistillLoss",
            "EMO distillation: DEMD to the teacher's distribution (EMO Eq. 15)",
            ("base", "mode", "mu", "temperature", "ignore_index", "implementation",
             "chunk_size", "max_ratio"),
            cost_embedding=True,
            teacher=True,
            domains={**_EMO_DOMAINS, "temperature": POSITIVE},
        ),
        ObjectiveSpec(
            "kl_distill", "emdlm.losses.emo_distill", "KLDistillLoss",
            "distillation baseline: CE mixed with KL to the teacher",
            ("alpha", "temperature", "ignore_index", "chunk_size"),
            teacher=True,
            # L = (1-α)·CE + α·T²·KL(teacher_T || student_T)
            domains={"alpha": UNIT, "temperature": POSITIVE, "chunk_size": COUNT.or_(None),
                     **_IGNORE},
        ),
    )
}

_BY_CLASS = {spec.path: spec for spec in OBJECTIVE_SPECS.values()}

#: The class every objective's loss derives from, named by path so that this module imports no
#: loss (tests/test_objective_registry.py pins it to the class).
LOSS_BASE = "emdlm.losses.base.EMDLMLoss"
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def spec_of_class(cls: type) -> ObjectiveSpec | None:
    """The registered objective of loss class ``cls`` or of the nearest registered class it
    derives from (None: no registered class in its MRO and no ``param_domains``).

    A class may declare ``param_domains`` (a mapping of parameter name to
    :class:`~emdlm.domains.Domain`): they are laid over the registered ancestor's domains, so
    a user's loss class gets its numeric parameters checked as a registered one does."""
    registered = next((found for klass in cls.__mro__
                       if (found := _BY_CLASS.get(f"{klass.__module__}.{klass.__qualname__}"))
                       is not None), None)
    declared = getattr(cls, "param_domains", None)
    if not declared:
        return registered
    base = registered or ObjectiveSpec(
        f"{cls.__module__}:{cls.__qualname__}", cls.__module__, cls.__qualname__, "", ()
    )
    return dataclasses.replace(base, domains={**base.domains, **declared})


def is_class_reference(name: Any) -> bool:
    """Whether ``objective.name`` names a loss class of the user's own (``<module>:<Class>``)
    rather than a registered objective."""
    return isinstance(name, str) and ":" in name


def class_reference_problem(name: str) -> str | None:
    """What is wrong with the form of ``<module>:<Class>`` (both parts dotted Python names), in
    words, or None. Only the form: the module is imported when the objective is built
    (:func:`emdlm.objectives.objective_class`), never while a config is read."""
    module, _, attribute = name.partition(":")
    if _DOTTED_NAME.fullmatch(module) and _DOTTED_NAME.fullmatch(attribute):
        return None
    return (f"{name!r} is not of the form <module>:<Class> (a module importable from sys.path "
            "and a class in it, e.g. my_losses:ScaledCE)")


#: The config names, in registry order.
OBJECTIVE_NAMES: tuple[str, ...] = tuple(OBJECTIVE_SPECS)
