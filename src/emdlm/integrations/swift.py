"""ms-swift losses by name: ``swift sft ... --external_plugins emdlm_plugin.py --loss_type
emdlm_ntil``.

ms-swift looks a ``--loss_type`` up in ``swift.loss.loss_map`` (name -> a ``BaseLoss``
subclass, ``swift/loss/mapping.py``, https://github.com/modelscope/ms-swift) and hands the
instance to its trainer as ``compute_loss_func``: the trainer runs the model without labels and
calls ``loss(outputs, labels, num_items_in_batch=N, loss_scale=..., trainer=...)`` with the
labels unshifted, as ``transformers.Trainer`` does. :func:`register_losses` (called by the
``--external_plugins`` file, which ms-swift imports before it builds the trainer) adds
``emdlm_<objective>`` for every registered objective, or the names and settings it is given::

    # emdlm_plugin.py
    from emdlm.integrations.swift import register_losses
    register_losses()                                    # emdlm_ce, emdlm_ntil, emdlm_emo, ...
    register_losses({"emdlm_ntil_fh": {"objective": {"name": "ntil"}, "from_hidden": True}})

Each loss is built on its first call from the trainer's model and tokenizer (ms-swift builds
the loss before the model reaches the trainer) as ``emdlm train`` builds it, scored by
:class:`~emdlm.integrations.transformers.ComputeLoss` (one shift, the sum divided by
``num_items_in_batch``), and adds a
:class:`~emdlm.integrations.transformers.LossComponentsCallback` to the trainer then.
``from_hidden``: the model's forward returns the final hidden state while training and the loss
applies the head (no ``[B, T, V]`` logits) from the second micro-batch on (the first has
already run when the loss is built; both paths give the same value). ms-swift's per-token
``loss_scale`` (weights other than 1), its sequence parallelism and a number scope are refused
by name.

ms-swift is imported only by :func:`register_losses`; the loss classes themselves can be built
on any base (:func:`loss_class`), so this module imports without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from emdlm.integrations.framework_objective import (
    FrameworkObjective,
    build_loss,
    parse_settings,
    text_tokenizer,
)
from emdlm.integrations.hidden_forward import unwrap_hf_model
from emdlm.integrations.transformers import ComputeLoss, LossComponentsCallback
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.objectives import DISTILL

PREFIX = "emdlm_"


class EMDLMSwiftLossMixin:
    """ms-swift ``BaseLoss`` behaviour: ``__call__`` scores with the emdlm objective of the
    class's ``settings``."""

    settings: FrameworkObjective
    loss_type: str

    def __init__(self, args: Any = None, trainer: Any = None) -> None:
        # what ms-swift's BaseLoss.__init__ keeps (its megatron flag is read by its own losses)
        self.args = args
        self.trainer = trainer
        self.is_megatron = False
        self.compute_loss: ComputeLoss | None = None

    def _compute_loss(self, trainer: Any) -> ComputeLoss:
        if self.compute_loss is not None:
            return self.compute_loss
        if trainer is None:
            raise RuntimeError(f"{self.loss_type}: called without the trainer (trainer=)")
        if getattr(getattr(trainer, "template", None), "sequence_parallel_size", 1) > 1:
            raise NotImplementedError(
                f"{self.loss_type}: ms-swift's sequence parallelism gathers a per-token CE "
                "before the loss; the emdlm losses need the logits: set sequence_parallel_size 1"
            )
        model = unwrap_hf_model(trainer.accelerator.unwrap_model(trainer.model)
                                if hasattr(trainer, "accelerator") else trainer.model)
        template = getattr(trainer, "template", None)
        tokenizer = text_tokenizer(getattr(template, "tokenizer", None) or
                                   trainer.processing_class)  # fmt: skip
        compute_loss = ComputeLoss(build_loss(self.settings, tokenizer, model), who=self.loss_type)
        if self.settings.from_hidden:
            compute_loss.enable_from_hidden(model)
        trainer.add_callback(LossComponentsCallback(compute_loss))
        self.compute_loss = compute_loss
        return compute_loss

    def __call__(
        self, outputs: Any, labels: torch.Tensor, *, num_items_in_batch: Any = None,
        loss_scale: torch.Tensor | None = None, **kwargs: Any,
    ) -> torch.Tensor:
        if loss_scale is not None and bool((loss_scale != 1).any()):
            raise NotImplementedError(
                f"{self.loss_type}: ms-swift passed per-token loss_scale weights other than 1 "
                "(--loss_scale); the emdlm losses take none: use --loss_scale default"
            )
        compute_loss = self._compute_loss(kwargs.get("trainer") or self.trainer)
        return compute_loss(outputs, labels, num_items_in_batch=num_items_in_batch)


def loss_class(loss_type: str, settings: FrameworkObjective, base: type = object) -> type:
    """A ``base`` subclass (ms-swift's ``BaseLoss``) named ``loss_type`` scoring ``settings``."""
    if settings.number_scope != "all":
        raise ValueError(
            f"{loss_type}: number_scope needs a collator that adds number_mask, which ms-swift's "
            "templates do not: leave number_scope 'all'"
        )
    return type(
        f"EMDLM_{loss_type}", (EMDLMSwiftLossMixin, base),
        {"settings": settings, "loss_type": loss_type, "__module__": __name__},
    )


def default_settings() -> dict[str, dict[str, Any]]:
    """``emdlm_<name>`` -> settings for every registered objective but the distillation ones."""
    return {f"{PREFIX}{name}": {"objective": {"name": name}}
            for name in OBJECTIVE_SPECS if name not in DISTILL}  # fmt: skip


def register_losses(
    settings: Mapping[str, Mapping[str, Any]] | None = None, loss_map: dict | None = None,
) -> dict[str, type]:
    """Add emdlm losses to ms-swift's ``loss_map`` (or the given ``loss_map``): each name of
    ``settings`` (default :func:`default_settings`) with its checked settings. Returns the
    classes added. A name ms-swift already has (not an emdlm one) is refused."""
    base: type = object
    if loss_map is None:
        from swift.loss import BaseLoss
        from swift.loss import loss_map as swift_loss_map

        loss_map, base = swift_loss_map, BaseLoss
    added = {}
    for name, raw in (default_settings() if settings is None else settings).items():
        existing = loss_map.get(name)
        if existing is not None and not issubclass(existing, EMDLMSwiftLossMixin):
            raise ValueError(f"register_losses: ms-swift already has a loss named {name!r}")
        added[name] = loss_class(name, parse_settings(raw, name), base)
    loss_map.update(added)
    return added


__all__ = ["EMDLMSwiftLossMixin", "default_settings", "loss_class", "register_losses"]
