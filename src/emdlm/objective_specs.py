"""The one registry of training objectives: what each is and what it takes, as plain data.

Each :class:`ObjectiveSpec` names its loss class by strings (``module``, ``class_name``), so this
module imports no loss and sits at the bottom with the config: :mod:`emdlm.config` reads the
names, the teacher and λ-schedule rules and the settable parameters from here, and
:mod:`emdlm.objectives` imports the class only when an objective is built. ``params`` is
declared, not read from the class; tests/test_objective_registry.py pins it equal to the class
signature (:func:`emdlm.objectives.settable_parameters`), so it cannot drift.

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

from dataclasses import dataclass


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
    """

    name: str
    module: str
    class_name: str
    summary: str
    params: tuple[str, ...]
    numeric: bool = False
    cost_embedding: bool = False
    teacher: bool = False

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

OBJECTIVE_SPECS: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            "ce", "emdlm.losses.ce", "CrossEntropyLoss",
            "cross-entropy, the baseline (optional label smoothing, z-loss, token accuracy)",
            ("ignore_index", "label_smoothing", "z_loss", "token_accuracy"),
        ),
        ObjectiveSpec(
            "emd", "emdlm.losses.ntil", "DigitEMDLoss",
            "CE + the position-weighted digit EMD (the NTIL paper's EMD baseline)",
            ("preset", *_NUMERIC_PARAMS),
            numeric=True,
        ),
        ObjectiveSpec(
            "ntil", "emdlm.losses.ntil", "NTILLoss",
            "CE + NTIL: digit EMD and the number-level value terms (NTIL Eq. 4)",
            ("preset", "lam", "alpha", "beta", "sigma", "emd_weight", "mix", "value_mode", "tau",
             "noise_scale", "ignore_index", "vocab_size", "join_decimal", "signed",
             "digits_only", "thousands_separator", "averaging", "smoothing", "implementation",
             "generator", "chunk_elements", "max_ratio", "per_number", "magnitude_floor"),
            numeric=True,
        ),
        ObjectiveSpec(
            "emo", "emdlm.losses.emo", "EMOLoss",
            "EMO: CE mixed with the differentiable EMD under a cost embedding (EMO Eq. 19)",
            ("mode", "mu", "ignore_index", "implementation", "chunk_size", "max_ratio"),
            cost_embedding=True,
        ),
        ObjectiveSpec(
            "tailr", "emdlm.losses.tailr", "TaiLrLoss",
            "TaiLr: CE weighted by the model's own probability of the label",
            ("gamma", "min_weight", "label_smoothing", "preset", "mixing_ratio", "ignore_index"),
        ),
        ObjectiveSpec(
            "mixce", "emdlm.losses.mixce", "MixCELoss",
            "MixCE: forward and reverse cross-entropy mixed by eta",
            ("eta", "ignore_index"),
        ),
        ObjectiveSpec(
            "dft", "emdlm.losses.dft", "DFTLoss",
            "DFT: CE weighted by the model's own probability of the label (TRL loss_type=dft)",
            ("ignore_index",),
        ),
        ObjectiveSpec(
            "ntl_mse", "emdlm.losses.ntl", "NTLMSELoss",
            "CE + ntloss's NTL-MSE: expected token value vs the gold value (mse / l1 / huber)",
            ("preset", "lam", "loss", "reweigh", "averaging", "ignore_index", "vocab_size",
             "digits_only"),
            numeric=True,
        ),
        ObjectiveSpec(
            "ntl_was", "emdlm.losses.ntl", "NTLWASLoss",
            "CE + ntloss's NTL-WAS: Wasserstein-1 distance of each number token to the gold",
            ("preset", "lam", "reweigh", "averaging", "ignore_index", "vocab_size",
             "digits_only"),
            numeric=True,
        ),
        ObjectiveSpec(
            "number_level", "emdlm.losses.ntl", "NumberLevelLoss",
            "CE + ntloss's number-level loss: relative error of each whole number's value",
            ("preset", "lam", "reweigh", "float_level", "averaging", "ignore_index",
             "vocab_size", "digits_only"),
            numeric=True,
        ),
        ObjectiveSpec(
            "emo_distill", "emdlm.losses.emo_distill", "EMODistillLoss",
            "EMO distillation: DEMD to the teacher's distribution (EMO Eq. 15)",
            ("base", "mode", "mu", "temperature", "ignore_index", "implementation",
             "chunk_size", "max_ratio"),
            cost_embedding=True,
            teacher=True,
        ),
        ObjectiveSpec(
            "kl_distill", "emdlm.losses.emo_distill", "KLDistillLoss",
            "distillation baseline: CE mixed with KL to the teacher",
            ("alpha", "temperature", "ignore_index"),
            teacher=True,
        ),
    )
}

#: The config names, in registry order.
OBJECTIVE_NAMES: tuple[str, ...] = tuple(OBJECTIVE_SPECS)
