"""``emdlm.patch(model, loss_fn)``: the model's own ``forward(..., labels=...)`` gives emdlm's loss.

For everyone who trains through a framework that calls ``model(**batch)`` and reads
``outputs.loss`` (plain ``transformers.Trainer``, TRL, Axolotl, LLaMA-Factory)::

    handle = emdlm.patch(model, NTILLoss(tok, reduction="sum"))
    ...                      # train as usual
    handle.undo()

The loss is the objective's mean over the scored tokens of the call, or, when transformers passes
``num_items_in_batch`` (the scored tokens of the whole accumulated batch), the summed objective
divided by it: exactly the per-micro-batch value of :class:`~emdlm.integrations.transformers.
ComputeLoss`, so gradient accumulation is exact as there.

Two mechanisms, both on the *instance* (the model class is never touched):

- ``from_hidden=False``: the model's ``loss_function`` hook (transformers 5: the causal-LM heads
  call ``self.loss_function(logits=..., labels=..., vocab_size=..., **kwargs)`` after computing
  the full logits) is replaced by the emdlm loss.
- ``from_hidden=True``: that hook only ever receives the full ``[B, T, V]`` logits, too late to
  save their memory, so the instance's ``forward`` is wrapped instead: with labels it runs the
  backbone (``model.base_model``), takes the output embedding (``get_output_embeddings()``) and
  calls ``loss_fn.from_hidden``; the returned output has ``loss`` and ``logits=None``. Without
  labels the original forward runs unchanged (generation, evaluation).

The from-hidden forward is also what ``make_compute_loss_func(..., from_hidden=True, model=m)``
installs (mode "hidden": the Trainer pops the labels, so the wrapped forward returns the final
hidden state and :class:`ComputeLoss` applies the head itself).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from emdlm.integrations.transformers import IGNORE_INDEX, ComputeLoss, require_sum_reduction

# model.forward keyword arguments that the backbone must not receive
_HEAD_ONLY_KWARGS = ("labels", "num_items_in_batch", "logits_to_keep", "shift_labels")


@dataclass
class HiddenOutput(ModelOutput):
    """Mode "hidden"'s output: the final hidden state [B, T, H], no logits. A ModelOutput
    dataclass so DDP (which flattens and rebuilds outputs by field name) carries it."""

    emdlm_hidden: torch.Tensor | None = None
    past_key_values: Any = None


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


def scaled_loss(
    summed: torch.Tensor, count: torch.Tensor, num_items_in_batch: Any
) -> torch.Tensor:
    """Σ l_t / N with N = ``num_items_in_batch`` when given, else the call's scored count."""
    if num_items_in_batch is None:
        return summed / count.clamp_min(1)
    if isinstance(num_items_in_batch, torch.Tensor):
        return summed / num_items_in_batch.to(summed.device).clamp_min(1)
    return summed / max(int(num_items_in_batch), 1)


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
    from emdlm.integrations.sharding import check_head_weight, gathered_head

    head = output_head(model)
    if number_mask is not None and shift_labels is None:  # aligned with labels: shift it too
        number_mask = number_mask[:, 1:]
    if shift_labels is not None:
        shift_hidden, shift_labels = hidden, shift_labels.to(hidden.device)
    elif labels is not None:
        shift_hidden, shift_labels = hidden[:, :-1, :], labels[:, 1:].to(hidden.device)
    else:
        raise ValueError("from_hidden loss: neither labels nor shift_labels were given")
    # only the transforms the model has: a loss whose from_hidden lacks one is refused by name
    extra = {k: v for k, v in (("logit_scale", head.logit_scale), ("softcap", head.softcap))
             if v is not None}
    params = inspect.signature(loss_fn.from_hidden).parameters
    missing = [k for k in extra if k not in params]
    if missing:
        raise NotImplementedError(
            f"the model's logits use {missing} (from its config), which "
            f"{type(loss_fn).__name__}.from_hidden does not take: use the logits path"
        )
    if number_mask is not None:  # ComputeLoss passes it only to losses that take it
        extra["number_mask"] = number_mask
    with gathered_head(head.weight, head.bias) as (weight, bias):
        check_head_weight(weight, bias, head.module, hidden.shape[-1])
        out = loss_fn.from_hidden(
            shift_hidden.to(weight.dtype), weight, shift_labels, bias, **extra
        )
    return out, (shift_labels != ignore_index).sum()


class FromHiddenForward:
    """A replacement ``forward`` bound to one model instance (mode "loss" or "hidden").

    Mode "loss" (:func:`patch`): given labels, returns an output with the emdlm loss
    (:func:`scaled_loss`) and ``logits=None``. Mode "hidden" (``make_compute_loss_func``):
    while training with gradients and without labels, returns the backbone's output with the
    final hidden state under ``"emdlm_hidden"`` and no logits. Otherwise the original forward.
    """

    def __init__(
        self, model: nn.Module, original: Callable[..., Any], mode: str,
        loss_fn: nn.Module | None = None, ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.model = model
        self.original = original
        self.mode = mode
        self.loss_fn = loss_fn
        self.ignore_index = ignore_index
        self.compute_loss: ComputeLoss | None = None  # mode "loss": records components
        # Trainer reads the forward's signature (which batch columns to keep, whether it takes
        # num_items_in_batch): show the original's.
        self.__signature__ = inspect.signature(original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

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
            return self.original(*args, **kwargs)
        assert self.loss_fn is not None
        require_sum_reduction(self.loss_fn, "emdlm.patch")
        hidden, outputs = backbone_hidden(self.model, args, kwargs)
        out, count = hidden_loss(
            self.loss_fn, self.model, hidden, labels, self.ignore_index, shift_labels
        )
        if self.compute_loss is not None and torch.is_grad_enabled():
            self.compute_loss._record(out.loss.detach(), out.components, count)
        return CausalLMOutputWithPast(
            loss=scaled_loss(out.loss, count, kwargs.get("num_items_in_batch")),
            logits=None,
            past_key_values=outputs.get("past_key_values"),
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


class PatchHandle:
    """What :func:`patch` changed on the instance; ``.undo()`` restores it."""

    def __init__(self, model: nn.Module, attr: str, compute_loss: ComputeLoss) -> None:
        self.model = model
        self.attr = attr
        self.compute_loss = compute_loss  # its pop_components() gives the loss components
        self._done = False

    def undo(self) -> None:
        """Remove the instance attribute the patch set (the class's own comes back)."""
        if self._done:
            return
        self.model.__dict__.pop(self.attr, None)
        self._done = True


def _loss_hook(compute_loss: ComputeLoss) -> Callable[..., torch.Tensor]:
    """A transformers ``loss_function`` (``ForCausalLMLoss``'s signature) around ComputeLoss."""

    def loss_function(
        logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
        num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None, **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is not None:  # already aligned with the logits (context parallelism)
            return compute_loss(
                {"logits": logits}, shift_labels, num_items_in_batch=num_items_in_batch,
                shifted=True,
            )
        if labels is None:
            raise ValueError("emdlm.patch: the model's loss_function got no labels")
        return compute_loss({"logits": logits}, labels, num_items_in_batch=num_items_in_batch)

    return loss_function


def patch(
    model: nn.Module, loss_fn: nn.Module, from_hidden: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> PatchHandle:
    """Make ``model(..., labels=labels).loss`` the emdlm loss; returns a handle with ``.undo()``.

    Args:
        model: a Hugging Face causal LM (or a PEFT model around one).
        loss_fn: an emdlm loss built with ``reduction="sum"``.
        from_hidden: never build the ``[B, T, V]`` logits (forward wrapper; ``logits=None``
            in the outputs when labels are given).
        ignore_index: label value that is not scored.
    """
    require_sum_reduction(loss_fn, "emdlm.patch")
    hf = unwrap_hf_model(model)
    compute_loss = ComputeLoss(loss_fn, ignore_index=ignore_index, who="emdlm.patch")
    if from_hidden:
        output_head(hf)  # a head from_hidden cannot use is refused now, not mid-training
        wrapper = install_forward(
            hf, lambda orig: FromHiddenForward(hf, orig, "loss", loss_fn, ignore_index)
        )
        wrapper.compute_loss = compute_loss
        return PatchHandle(hf, "forward", compute_loss)
    if not hasattr(type(hf), "loss_function"):
        raise ValueError(
            f"{type(hf).__name__} has no loss_function hook (transformers 5 causal LMs have "
            "one): use emdlm.patch(..., from_hidden=True), which wraps the forward instead"
        )
    if "_loss_function" in hf.__dict__:
        raise RuntimeError(
            f"{type(hf).__name__} already has a custom loss_function: undo it first"
        )
    hf.loss_function = _loss_hook(compute_loss)  # the property's setter: instance attribute
    return PatchHandle(hf, "_loss_function", compute_loss)


__all__ = ["OutputHead", "PatchHandle", "output_head", "patch", "unwrap_hf_model"]
