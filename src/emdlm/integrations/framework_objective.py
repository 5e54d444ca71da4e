"""An emdlm objective named in a fine-tuning framework's config (Axolotl, ms-swift,
LLaMA-Factory): the settings, checked before anything loads, the loss built from them, and the
``number_mask`` a collator adds for a number scope.

The settings mirror the ``objective:`` section of an ``emdlm train`` config
(:class:`emdlm.config.ObjectiveConfig`)::

    objective: {name: ntil, params: {preset: stable}}   # any registered objective
    from_hidden: false      # true: the loss applies the output head itself (no [B, T, V] logits)
    number_scope: all       # or "regex:<pattern>" / "answer:<task>": which numbers are scored

:func:`install_objective` hands the loss to the model with :func:`emdlm.patch` (the model's
own forward returns it, which is what these frameworks' trainers optimise), so every route
shares :class:`~emdlm.integrations.transformers.ComputeLoss`: one shift, the sum divided by
``num_items_in_batch``, the components recorded for
:class:`~emdlm.integrations.transformers.LossComponentsCallback`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import nn
from transformers import DataCollatorForSeq2Seq

from emdlm.config import ConfigError, ObjectiveConfig, did_you_mean
from emdlm.integrations.loss_contract import IGNORE_INDEX
from emdlm.integrations.patch import PatchHandle, patch
from emdlm.number_scope import in_scope_tokens, scope_pattern
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.objectives import DISTILL, build_objective, objective_class, settable_parameters

SETTING_KEYS = ("objective", "from_hidden", "number_scope")
OBJECTIVE_KEYS = ("name", "params", "cost_embedding")


@dataclass(frozen=True)
class FrameworkObjective:
    """The checked settings: the objective (as ``emdlm train``'s), the from-hidden switch and
    the number scope ("all": no mask)."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    from_hidden: bool = False
    number_scope: str = "all"

    @property
    def wants_number_mask(self) -> bool:
        """A scope other than "all" on an objective that scores numbers (NTIL, digit EMD, NTL)."""
        return self.number_scope != "all" and OBJECTIVE_SPECS[self.objective.name].numeric


def parse_settings(raw: Mapping[str, Any] | None, where: str) -> FrameworkObjective:
    """:class:`FrameworkObjective` from a config mapping; ConfigError naming ``where`` and the
    key for an unknown key, objective or parameter, a distillation objective (the frameworks'
    forward runs no teacher) or a bad number scope."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(SETTING_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {', '.join(SETTING_KEYS)}")
    objective = raw.get("objective") or {}
    if isinstance(objective, str):
        objective = {"name": objective}
    if not isinstance(objective, Mapping):
        raise ConfigError(f"{where}.objective must be a mapping, got {type(objective).__name__}")
    unknown = sorted(set(objective) - set(OBJECTIVE_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}.objective: unknown key(s) {unknown}; known: {', '.join(OBJECTIVE_KEYS)}"
        )
    name = str(objective.get("name", "ce"))
    if name not in OBJECTIVE_SPECS:
        raise ConfigError(
            f"{where}.objective.name: unknown objective {name!r}"
            f"{did_you_mean(name, OBJECTIVE_SPECS)}; choose one of {', '.join(OBJECTIVE_SPECS)}"
        )
    if name in DISTILL:
        raise ConfigError(
            f"{where}.objective.name: {name!r} distils from a teacher, which this framework's "
            "forward does not run; train it with `emdlm train` (teacher:)"
        )
    params = dict(objective.get("params") or {})
    settable = settable_parameters(name, objective_class(name))
    bad = sorted(set(params) - set(settable))
    if bad:
        raise ConfigError(
            f"{where}.objective.params: {name!r} takes no {bad}; settable: {', '.join(settable)}"
        )
    from_hidden = raw.get("from_hidden", False)
    if not isinstance(from_hidden, bool):
        raise ConfigError(f"{where}.from_hidden must be true or false, got {from_hidden!r}")
    scope = raw.get("number_scope", "all")
    scope_pattern(scope, None, f"{where}.number_scope")  # ConfigError for a bad scope
    return FrameworkObjective(
        objective=ObjectiveConfig(
            name=name, params=params, cost_embedding=objective.get("cost_embedding")
        ),
        from_hidden=from_hidden,
        number_scope=scope,
    )


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a trainer's ``processing_class`` (a processor's ``.tokenizer``)."""
    return getattr(processing_class, "tokenizer", None) or processing_class


def build_loss(settings: FrameworkObjective, tokenizer: Any, model: nn.Module) -> nn.Module:
    """The objective's loss module (``reduction="sum"``), built as ``emdlm train`` builds it."""
    vocab = model.get_output_embeddings().weight.shape[0]
    return build_objective(
        settings.objective, tokenizer=text_tokenizer(tokenizer), model=model, vocab_size=vocab
    )


def install_objective(
    settings: FrameworkObjective, model: nn.Module, tokenizer: Any
) -> PatchHandle:
    """Build the loss and :func:`emdlm.patch` it into ``model`` (from hidden states when the
    settings say so); the handle's ``compute_loss`` gives the components."""
    return patch(model, build_loss(settings, tokenizer, model), from_hidden=settings.from_hidden)


def token_texts(tokenizer: Any) -> list[str]:
    """The text of every vocabulary id on its own (``convert_tokens_to_string`` of the token),
    read once per collator: what a number scope's regex is matched against."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]


def number_mask_of(
    input_ids: Sequence[int], labels: Sequence[int], pieces: Sequence[str], scope: str,
) -> list[bool]:
    """Per token: is it a scored token inside the number scope?

    The scored tokens' texts (``labels`` != -100, from ``pieces``) are joined into the target
    text, the scope's regex runs over it (:func:`emdlm.number_scope.in_scope_tokens`), and
    every unscored token is False.
    """
    scored = [i for i, y in enumerate(labels) if y != IGNORE_INDEX]
    texts = [pieces[input_ids[i]] for i in scored]
    ends = list(accumulate(len(t) for t in texts))
    offsets = [(end - len(t), end) for t, end in zip(texts, ends, strict=True)]
    inside = in_scope_tokens("".join(texts), offsets, scope_pattern(scope, None, "number_scope"))
    mask = [False] * len(input_ids)
    for i, flag in zip(scored, inside, strict=True):
        mask[i] = flag
    return mask


class NumberMaskCollator(DataCollatorForSeq2Seq):
    """``DataCollatorForSeq2Seq`` that also returns ``number_mask`` [B, T] (bool, aligned with
    ``labels``, False on padding) for ``number_scope``; the patched model hands it to the
    loss, never to the backbone."""

    def __init__(self, *args: Any, number_scope: str = "all", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        scope_pattern(number_scope, None, "number_scope")
        self.number_scope = number_scope
        self._pieces: list[str] | None = None

    def __call__(self, features: list[dict[str, Any]], return_tensors: Any = None) -> Any:
        if self._pieces is None:
            self._pieces = token_texts(self.tokenizer)
        masks = [
            number_mask_of(list(f["input_ids"]), list(f["labels"]), self._pieces,
                           self.number_scope)
            for f in features
        ]  # fmt: skip
        batch = super().__call__(
            [{k: v for k, v in f.items() if k != "number_mask"} for f in features],
            return_tensors,
        )
        width = batch["input_ids"].shape[1]
        left = self.tokenizer.padding_side == "left"
        out = torch.zeros((len(masks), width), dtype=torch.bool)  # [B, T]
        for row, mask in enumerate(masks):
            values = torch.tensor(mask, dtype=torch.bool)
            if left:
                out[row, width - len(mask):] = values
            else:
                out[row, : len(mask)] = values
        batch["number_mask"] = out
        return batch


__all__ = [
    "FrameworkObjective", "NumberMaskCollator", "build_loss", "install_objective",
    "number_mask_of", "parse_settings", "text_tokenizer", "token_texts",
]
