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

The from-hidden forward (:mod:`emdlm.integrations.hidden_forward`) is also what
``make_compute_loss_func(..., from_hidden=True, model=m)`` installs (mode "hidden": the Trainer
pops the labels, so the wrapped forward returns the final hidden state and :class:`ComputeLoss`
applies the head itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# backbone_hidden, hidden_loss, HiddenOutput, OutputHead, scaled_loss: also importable from here,
# their home before emdlm.integrations.hidden_forward / loss_contract
from emdlm.integrations.hidden_forward import (
    FromHiddenForward,
    HiddenOutput,  # noqa: F401
    OutputHead,
    backbone_hidden,  # noqa: F401
    hidden_loss,  # noqa: F401
    install_forward,
    output_head,
    unwrap_hf_model,
)
from emdlm.integrations.loss_contract import (
    IGNORE_INDEX,
    require_sum_reduction,
    scaled_loss,  # noqa: F401
)
from emdlm.integrations.loss_weights import TOKEN_WEIGHTS_KEY, refuse_weights_on
from emdlm.integrations.transformers import ComputeLoss


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
    """A transformers ``loss_function`` (``ForCausalLMLoss``'s signature) around ComputeLoss.

    The causal-LM heads pass the forward's extra keywords on to the hook, so a batch's
    ``number_mask`` (``data.number_scope``) reaches the loss here."""

    def loss_function(
        logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
        num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None, number_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None and labels is None:
            raise ValueError("emdlm.patch: the model's loss_function got no labels")
        if kwargs.get(TOKEN_WEIGHTS_KEY) is not None:
            raise refuse_weights_on("emdlm.patch")
        return compute_loss(
            {"logits": logits}, shift_labels if shift_labels is not None else labels,
            num_items_in_batch=num_items_in_batch, shifted=shift_labels is not None,
            number_mask=number_mask,
        )

    return loss_function


def require_output_head(model: nn.Module) -> None:
    """TypeError naming the class unless ``model`` (a Hugging Face model, unwrapped) has an
    output head: ``get_output_embeddings()`` returns the LM head of a causal LM and None for a
    backbone (``GPT2Model``, ``LlamaModel``), whose forward takes no labels and computes no loss
    (transformers' ``PreTrainedModel.get_output_embeddings``)."""
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None or getter() is None:
        raise TypeError(
            f"emdlm.patch: {type(model).__name__} has no output head (get_output_embeddings() "
            "is None): a backbone computes no loss from labels; patch the causal LM with its "
            "head (e.g. AutoModelForCausalLM, GPT2LMHeadModel)"
        )


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

    Raises:
        TypeError: ``model`` has no output head (a backbone such as ``GPT2Model``): its forward
            never computes a loss from labels, so a patched one would silently train nothing.
    """
    require_sum_reduction(loss_fn, "emdlm.patch")
    hf = unwrap_hf_model(model)
    require_output_head(hf)
    compute_loss = ComputeLoss(loss_fn, ignore_index=ignore_index, who="emdlm.patch")
    if compute_loss.needs.needs_teacher:
        raise ValueError(
            f"emdlm.patch: {type(loss_fn).__name__} distils from a teacher, which a patched "
            "forward cannot run; train with EMDLMTrainer(..., teacher=teacher) and "
            "compute_loss_func=make_compute_loss_func(loss_fn) instead"
        )
    if from_hidden:
        compute_loss.enable_from_hidden(hf, install=False)  # refuses an unusable head now
        install_forward(hf, lambda orig: FromHiddenForward(hf, orig, "loss", compute_loss))
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
