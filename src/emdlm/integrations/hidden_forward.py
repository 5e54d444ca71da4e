"""The from-hidden forward: a Hugging Face model's backbone, its output head, and the loss
applied to the final hidden state, so the ``[B, T, V]`` logits are never built.

:class:`FromHiddenForward` replaces the forward of one model *instance* (the class is never
touched; :func:`install_forward`). Mode "loss" (``emdlm.patch(..., from_hidden=True)``): with
labels it runs the backbone (``model.base_model``) and hands the final hidden state to the
patch's :class:`~emdlm.integrations.transformers.ComputeLoss` (the one loss step of every
route), returning its loss with ``logits=None``. Mode "hidden"
(``make_compute_loss_func(..., from_hidden=True, model=m)``): while training it returns the
final hidden state, and the Trainer's ComputeLoss scores it. Either way the head is applied by
:func:`hidden_loss` (the output embedding read by :func:`output_head`, gathered under FSDP2 /
ZeRO-3). Without labels (generation, evaluation) the original forward runs unchanged.

Below :mod:`emdlm.integrations.transformers` and :mod:`emdlm.integrations.patch`, which both
install it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from emdlm.integrations.loss_contract import (
    IGNORE_INDEX,
    LossInputs,
    declared_needs,
    loss_inputs,
)
from emdlm.integrations.loss_weights import TOKEN_WEIGHTS_KEY, refuse_weights_on
from emdlm.integrations.sharding import check_head_weight, gathered_head

# model.forward keyword arguments that the backbone must not receive
_HEAD_ONLY_KWARGS = (
    "labels", "num_items_in_batch", "logits_to_keep", "shift_labels", "number_mask",
)


@dataclass
class HiddenOutput(ModelOutput):
    """Mode "hidden"'s output: the final hidden state [B, T, H], no logits. A ModelOutput
    dataclass so DDP (which flattens and rebuilds outputs by field name) carries it."""

    emdlm_hidden: torch.Tensor | None = None
    past_key_values: Any = None
    # always None: frameworks that test ``outputs.logits`` (ms-swift's token accuracy) skip
    logits: torch.Tensor | None = None


def unwrap_hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face ``PreTrainedModel`` inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass
class OutputHead:
    """What the logits are made of: z = s·(h Wᵀ + b), then cap·tanh(z / cap) if ``softcap``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    logit_scale: float | None
    softcap: float | None
    module: nn.Module | None = None  # the head (its in/out features check a gathered weight)


def output_head(model: nn.Module) -> OutputHead:
    """The output embedding and logit transform of a HF causal LM, read at every call.

    Logit transforms from the model config: Gemma-2/3 ``final_logit_softcapping`` (soft-cap),
    a logit scale (:func:`_logit_scale`). A head wrapped by PEFT
    with an active adapter (LoRA on ``lm_head``) is refused: its effective weight is not
    ``.weight``; a wrapper whose adapters are off uses its ``base_layer``.
    """
    hf = unwrap_hf_model(model)
    head = hf.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(hf).__name__} has no output embedding (get_output_embeddings() is None): "
            "from_hidden needs a causal LM with a linear head"
        )
    base_layer = getattr(head, "base_layer", None)
    if base_layer is not None:  # a PEFT-wrapped head
        adapter_on = (
            not getattr(head, "merged", False) and not getattr(head, "disable_adapters", False)
            and bool(getattr(head, "active_adapters", None))
        )
        if adapter_on:
            raise NotImplementedError(
                "from_hidden: the output embedding carries an active PEFT adapter (LoRA on "
                "lm_head), whose effective weight is not lm_head.weight; leave lm_head out "
                "of target_modules or use the logits path (from_hidden=False)"
            )
        head = base_layer
    weight = getattr(head, "weight", None)
    # a DeepSpeed ZeRO-3 parameter holds a 0-element partition outside a gather; its full
    # shape is ds_shape (gathered for the loss by sharding.gathered_head)
    shape = getattr(weight, "ds_shape", None) if isinstance(weight, torch.Tensor) else None
    if not isinstance(weight, torch.Tensor) or len(shape or weight.shape) != 2:
        raise ValueError(
            f"from_hidden needs a linear output embedding with a [V, H] weight, got "
            f"{type(head).__name__}"
        )
    cfg = getattr(hf, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    softcap = getattr(text_cfg, "final_logit_softcapping", None)
    scale = _logit_scale(text_cfg)
    return OutputHead(
        weight=weight,
        bias=getattr(head, "bias", None),
        logit_scale=None if scale is None or float(scale) == 1.0 else float(scale),
        softcap=None if softcap is None else float(softcap),
        module=head,
    )


def _logit_scale(cfg: Any) -> float | None:
    """The factor the model multiplies its logits by, from the (text) config, or None.

    Cohere ``logit_scale``, ``output_multiplier``, Falcon-H1 ``lm_head_multiplier``: z·s;
    Granite / MiniCPM3 ``logits_scaling``: z / s (HyperCLOVA X multiplies by it). More than one
    of them set is refused rather than guessed.
    """
    found = {
        name: float(value) for name in
        ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
        if (value := getattr(cfg, name, None)) is not None
    }
    if len(found) > 1:
        raise ValueError(f"from_hidden: the model config sets several logit scales {found}")
    if not found:
        return None
    (name, value), = found.items()
    if name == "logits_scaling" and getattr(cfg, "model_type", None) != "hyperclovax":
        return 1.0 / value
    return value


def backbone_hidden(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the backbone (``model.base_model``) on the forward's inputs; (hidden, outputs)."""
    hf = unwrap_hf_model(model)
    backbone = getattr(hf, "base_model", None)
    if backbone is None or backbone is hf:
        raise ValueError(
            f"{type(hf).__name__} has no separate backbone (base_model): from_hidden needs a "
            "Hugging Face causal LM (…ForCausalLM / …ForConditionalGeneration)"
        )
    inputs = {k: v for k, v in kwargs.items() if k not in _HEAD_ONLY_KWARGS}
    inputs["return_dict"] = True
    outputs = backbone(*args, **inputs)
    hidden = outputs["last_hidden_state"] if isinstance(outputs, Mapping) else outputs[0]
    return hidden, outputs


def hidden_loss(
    loss_fn: nn.Module, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None,
    ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None,
    number_mask: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor]:
    """Summed from-hidden loss of unshifted ``labels`` [B, T] on ``hidden`` [B, T, H].

    Position t predicts token t+1, as the logits path's shift; ``shift_labels`` (already
    aligned with ``hidden``, as transformers passes them under context parallelism) are scored
    without shifting. Under FSDP2 / DeepSpeed ZeRO-3 the head's weight is gathered for the
    loss (:func:`~emdlm.integrations.sharding.gathered_head`; this is the one place every
    from-hidden entry point reads it) and checked to be the full matrix. Returns
    (LossOutput, count).
    """
    if labels is None and shift_labels is None:
        raise ValueError("from_hidden loss: neither labels nor shift_labels were given")
    aligned = loss_inputs(  # the one shift of every route (number_mask with the labels)
        shift_labels if shift_labels is not None else labels, hidden=hidden, model=model,
        number_mask=number_mask, shifted=shift_labels is not None,
    )
    return aligned_hidden_loss(loss_fn, aligned, ignore_index)


def aligned_hidden_loss(
    loss_fn: nn.Module, inputs: LossInputs, ignore_index: int = IGNORE_INDEX,
) -> tuple[Any, torch.Tensor]:
    """Summed from-hidden loss of already aligned ``inputs`` (built by
    :func:`~emdlm.integrations.loss_contract.loss_inputs` with ``hidden`` and ``model``):
    ``loss_fn.from_hidden(hidden, W, labels, b, **inputs.call_keywords(), ...)`` with the
    model's output embedding (gathered under FSDP2 / ZeRO-3) and only the logit transforms the
    model has. Returns
    (LossOutput, count of scored labels, or their weight sum with ``loss_weights``:
    :meth:`LossInputs.scored <emdlm.integrations.loss_contract.LossInputs.scored>`).
    :func:`hidden_loss` and
    :meth:`~emdlm.integrations.transformers.ComputeLoss.step` both end here."""
    if inputs.hidden is None or inputs.model is None:
        raise ValueError("aligned_hidden_loss needs LossInputs built with hidden and model")
    head = output_head(inputs.model)
    shift_hidden, shift_labels = inputs.hidden, inputs.labels
    # only the transforms the model has: a loss whose from_hidden lacks one is refused by name
    extra = {k: v for k, v in (("logit_scale", head.logit_scale), ("softcap", head.softcap))
             if v is not None}
    taken = declared_needs(loss_fn).hidden_transforms
    missing = [k for k in extra if k not in taken]
    if missing:
        raise NotImplementedError(
            f"the model's logits use {missing} (from its config), which "
            f"{type(loss_fn).__name__}.from_hidden does not take: use the logits path"
        )
    with gathered_head(head.weight, head.bias) as (weight, bias):
        check_head_weight(weight, bias, head.module, shift_hidden.shape[-1])
        out = loss_fn.from_hidden(
            shift_hidden.to(weight.dtype), weight, shift_labels, bias, **extra,
            **inputs.call_keywords(),
        )
    return out, inputs.scored(ignore_index)


class FromHiddenForward:
    """A replacement ``forward`` bound to one model instance (mode "loss" or "hidden").

    Mode "loss" (:func:`~emdlm.integrations.patch.patch`): given labels, runs the backbone and
    returns ``loss_call``'s loss (the patch's
    :class:`~emdlm.integrations.transformers.ComputeLoss`, the one loss step of every route)
    with ``logits=None``; a batch's ``number_mask`` keyword goes to the loss, never to the
    backbone. Mode "hidden" (``make_compute_loss_func``): while training with gradients and
    without labels, returns the backbone's output with the final hidden state under
    ``"emdlm_hidden"`` and no logits. Otherwise the original forward. A batch's
    ``loss_weights`` reaching the model (a plain Trainer, a patched forward) is refused
    (:func:`~emdlm.integrations.loss_weights.refuse_weights_on`): the model would drop them.
    """

    def __init__(
        self, model: nn.Module, original: Callable[..., Any], mode: str,
        loss_call: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        if mode not in ("loss", "hidden"):
            raise ValueError(f"FromHiddenForward mode must be 'loss' or 'hidden', got {mode!r}")
        if mode == "loss" and loss_call is None:
            raise ValueError("FromHiddenForward mode 'loss' needs the loss_call that scores it")
        self.model = model
        self.original = original
        self.mode = mode
        self.loss_call = loss_call
        # Trainer reads the forward's signature (which batch columns to keep, whether it takes
        # num_items_in_batch): show the original's.
        self.__signature__ = inspect.signature(original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if kwargs.get(TOKEN_WEIGHTS_KEY) is not None:  # the model would drop them unread
            raise refuse_weights_on(
                "the from-hidden forward" if self.mode == "hidden" else "emdlm.patch"
            )
        labels = kwargs.get("labels")
        shift_labels = kwargs.get("shift_labels")
        if self.mode == "hidden":
            if labels is not None or not (self.model.training and torch.is_grad_enabled()):
                return self.original(*args, **kwargs)
            hidden, outputs = backbone_hidden(self.model, args, kwargs)
            return HiddenOutput(
                emdlm_hidden=hidden, past_key_values=outputs.get("past_key_values")
            )
        if labels is None and shift_labels is None:
            kwargs.pop("number_mask", None)  # generation with a batch's mask: not the model's
            return self.original(*args, **kwargs)
        assert self.loss_call is not None
        hidden, outputs = backbone_hidden(self.model, args, kwargs)
        loss = self.loss_call(
            {"emdlm_hidden": hidden},
            shift_labels if shift_labels is not None else labels,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            shifted=shift_labels is not None,
            number_mask=kwargs.get("number_mask"),
        )
        return CausalLMOutputWithPast(
            loss=loss, logits=None, past_key_values=outputs.get("past_key_values")
        )


def install_forward(model: nn.Module, wrapper_factory: Callable[[Any], FromHiddenForward]) -> Any:
    """Set ``model.forward`` (instance attribute) to a wrapper of the current forward."""
    hf = unwrap_hf_model(model)
    if isinstance(hf.__dict__.get("forward"), FromHiddenForward):
        raise RuntimeError(
            f"{type(hf).__name__} already has an emdlm from-hidden forward: undo the first "
            "patch (handle.undo()) before installing another"
        )
    wrapper = wrapper_factory(hf.forward)
    hf.forward = wrapper
    return wrapper


__all__ = [
    "FromHiddenForward", "HiddenOutput", "OutputHead", "aligned_hidden_loss", "backbone_hidden",
    "hidden_loss",
    "install_forward", "output_head", "unwrap_hf_model",
]
