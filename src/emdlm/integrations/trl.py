"""TRL ``SFTTrainer`` with an emdlm loss.

Two ways in, both opt-in and explicit (nothing is patched on import):

1. :class:`EMDLMSFTTrainer` (recommended): a subclass of ``trl.SFTTrainer`` that overrides
   ``compute_loss``, the route TRL 1.x documents (its ``compute_loss_func`` argument is
   deprecated in SFTTrainer and makes every step run a second, no-grad forward pass for
   TRL's own metrics). One forward pass, the emdlm loss on the full logits, and the loss's
   components logged next to TRL's metrics as ``emdlm/<name>``.
2. :func:`sft_compute_loss_func` for ``SFTTrainer(..., compute_loss_func=...)``: works, but
   pays the extra forward pass and emits TRL's FutureWarning.

Both use :func:`emdlm.integrations.transformers.make_compute_loss_func` (the same adapter as
for ``transformers.Trainer``): per micro-batch, ``loss_fn(logits[:, :-1], labels[:, 1:]).loss``
with the loss in ``reduction="sum"``, divided by ``num_items_in_batch`` (the number of scored
tokens of the whole accumulated batch, which Trainer passes in), so gradient accumulation gives
the same gradient as one big batch. TRL's labels are unshifted ``input_ids`` with -100 on
padding (and on the prompt for prompt/completion datasets, where ``completion_only_loss``
defaults to True). emdlm losses take the softmax in float32 whatever the logits' dtype.

Precision: ``SFTConfig`` turns on bf16 autocast by default, which ran about 5x slower than fp32
on CPUs without bf16 matrix units. On a CPU-only run :class:`EMDLMSFTTrainer` therefore trains
in fp32 and says so in a warning; pass ``bf16_on_cpu=True`` to keep bf16 there. (SFTConfig
cannot tell its default from an explicit ``bf16=True``, hence the separate switch.)

Example::

    from trl import SFTConfig
    from emdlm.integrations.trl import EMDLMSFTTrainer
    from emdlm.losses.ce import CrossEntropyLoss

    trainer = EMDLMSFTTrainer(
        model=model, args=SFTConfig(output_dir="out"), train_dataset=ds,
        processing_class=tokenizer, loss_fn=CrossEntropyLoss(reduction="sum"),
    )
    trainer.train()
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from emdlm._extras import missing_extra

try:
    from trl import SFTConfig, SFTTrainer
except ModuleNotFoundError as err:  # the [trl] extra is not installed
    raise missing_extra(err, "emdlm.integrations.trl") from None

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX
from emdlm.integrations.loss_contract import scored_positions
from emdlm.integrations.loss_weights import (
    LOSS_WEIGHT_KEY,
    TOKEN_WEIGHTS_KEY,
    has_loss_weights,
    pad_loss_weights,
)
from emdlm.integrations.transformers import (
    ComputeLoss,
    EMDLMTrainerMixin,
    make_compute_loss_func,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], LossOutput]
_LOG = logging.getLogger("emdlm")
_FP32_WARNING = (
    "emdlm: training on CPU in fp32 (SFTConfig asked for bf16, its default, which ran ~5x "
    "slower than fp32 on CPU); pass bf16_on_cpu=True to EMDLMSFTTrainer to keep bf16"
)


def _cpu_only(args: Any) -> bool:
    """True when the Trainer will run on CPU: ``use_cpu`` or no CUDA / XPU / MPS device."""
    if getattr(args, "use_cpu", False):
        return True
    xpu = getattr(torch, "xpu", None)
    mps = getattr(torch.backends, "mps", None)
    return not (
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (mps is not None and mps.is_available())
    )


def _model_name(model: Any) -> str:
    """The name TRL gives its default output folder (``<name>-SFT``)."""
    if isinstance(model, str):
        return model.split("/")[-1]
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or type(model).__name__).split("/")[-1]


def fp32_on_cpu(args: Any, bf16_on_cpu: bool = False) -> Any:
    """``args`` with bf16 turned off when training on CPU (a copy; the caller's is unchanged).

    TRL's ``SFTConfig`` defaults to bf16 autocast; on CPUs without bf16 matrix units it ran ~5x
    slower than fp32. Unless ``bf16_on_cpu``, a CPU run gets ``bf16=False`` and
    ``mixed_precision="no"`` and a warning says so. Anything else is returned as is.
    """
    if args is None or not getattr(args, "bf16", False) or bf16_on_cpu or not _cpu_only(args):
        return args
    args = copy.copy(args)
    args.bf16 = False
    if getattr(args, "mixed_precision", None) == "bf16":
        args.mixed_precision = "no"
    _LOG.warning(_FP32_WARNING)
    return args


def _default_config(model: Any, bf16_on_cpu: bool) -> Any:
    """TRL's default ``SFTConfig("<model>-SFT")``, in fp32 on a CPU-only machine (where TRL's
    own default, bf16 without ``use_cpu``, is refused by transformers), and there without
    pinned memory (the default ``dataloader_pin_memory=True`` makes torch warn "'pin_memory'
    argument is set as true but no accelerator is found" at every data loader)."""
    name = f"{_model_name(model)}-SFT"
    if not _cpu_only(None):
        return SFTConfig(name)
    if bf16_on_cpu:
        return SFTConfig(name, use_cpu=True, dataloader_pin_memory=False)
    _LOG.warning(_FP32_WARNING)
    return SFTConfig(name, bf16=False, dataloader_pin_memory=False)


def sft_compute_loss_func(loss_fn: LossFn) -> ComputeLoss:
    """``SFTTrainer(..., compute_loss_func=sft_compute_loss_func(loss_fn))``.

    The transformers adapter as is: TRL calls it as ``f(outputs, labels, num_items_in_batch=N)``
    with unshifted labels, exactly like ``transformers.Trainer``. Prefer
    :class:`EMDLMSFTTrainer`, which avoids TRL's extra forward pass.
    """
    return make_compute_loss_func(loss_fn)


class RowWeightCollator:
    """TRL's collator with the rows' loss weights: each example's ``loss_weight`` /
    ``loss_weights`` is taken out before ``inner`` sees it, and a batch with any gets
    ``loss_weights`` aligned with its ``labels``: [B, T] for a padded batch (TRL pads on the
    right), or the rows' weights concatenated into [1, Σ lengths] for a padding-free one
    (:func:`~emdlm.integrations.loss_weights.pad_loss_weights`)."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], Any], padding_free: bool) -> None:
        self.inner = inner
        self.padding_free = bool(padding_free)

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        dropped = (LOSS_WEIGHT_KEY, TOKEN_WEIGHTS_KEY)
        batch = self.inner([{k: v for k, v in ex.items() if k not in dropped} for ex in examples])
        if not has_loss_weights(examples):
            return batch
        if any("input_ids" not in ex for ex in examples):
            raise ValueError(
                "loss weights on the TRL route need tokenized text rows (input_ids); this "
                "dataset's rows are collated from raw fields (a vision dataset?)"
            )
        lengths = [len(ex["input_ids"]) for ex in examples]
        width = batch["labels"].shape[-1]
        if not self.padding_free:
            batch[TOKEN_WEIGHTS_KEY] = pad_loss_weights(examples, lengths, width)
            return batch
        rows = pad_loss_weights(examples, lengths, max(lengths))  # [B, max length]
        flat = torch.cat([row[:n] for row, n in zip(rows, lengths, strict=True)])
        weights = torch.zeros((1, width), dtype=torch.float32)
        weights[0, : flat.numel()] = flat
        batch[TOKEN_WEIGHTS_KEY] = weights
        return batch


class EMDLMSFTTrainer(EMDLMTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose training and evaluation loss is an emdlm loss.

    Args:
        loss_fn: an emdlm loss module with ``reduction="sum"``, called as
            ``loss_fn(logits [B, T-1, V], labels [B, T-1], number_mask=..., teacher_logits=...)``
            on the shifted batch (the keywords only where the batch has them).
        teacher: the frozen teacher of a distillation loss (``needs_teacher``), run on every
            batch's inputs (:class:`~emdlm.integrations.transformers.EMDLMTrainerMixin`).
        from_hidden: train from the final hidden states (the model's forward runs the backbone
            only; the loss applies the output embedding chunk by chunk, no [B, T, V] logits).
        bf16_on_cpu: keep SFTConfig's bf16 on a CPU-only run (default: fp32 there, with a
            warning; see the module docstring).
        *args, **kwargs: passed to ``trl.SFTTrainer`` (``compute_loss_func`` and
            ``loss_type="dft"`` are refused: they would replace the emdlm loss); ``args`` is
            copied with bf16 off on CPU unless ``bf16_on_cpu``.

    The loss step is the one every route shares (:class:`~emdlm.integrations.transformers.
    ComputeLoss`): a batch's ``number_mask`` (``data.number_scope``) goes to a numeric loss,
    never to the model. Rows with a ``loss_weight`` (or per-token ``loss_weights``,
    :mod:`emdlm.integrations.loss_weights`) are kept through TRL's column pruning and its
    collator and weight the loss (a loss that takes no weights is refused before training;
    packing is refused with weights). Logged next to TRL's metrics: ``mean_token_accuracy``
    (TRL's: the share of scored positions whose argmax is the label, hits and positions summed
    over processes; a weight-0 token counts as an ignored label). On the logits route from the
    full logits, train and eval; from hidden states (no logits) from the loss's own argmax, so
    the same value on the same batch, where the loss gives it: ``predicted_tokens=True`` of a
    CE-family loss, or ``token_accuracy=True`` on a batch without loss weights
    (:meth:`~emdlm.integrations.loss_contract.LossInputs.token_hits`); absent otherwise. And,
    in training, each loss component as
    ``emdlm/<name>``: with ``from_hidden`` a CE-family loss built with ``token_accuracy=True``
    / ``entropy=True`` gives ``emdlm/token_accuracy`` / ``emdlm/entropy`` from the fused
    path's chunks.
    Unsupported: DeepSpeed Ulysses sequence parallelism (TRL reduces its own fused loss there).
    """

    def __init__(
        self, *args: Any, loss_fn: LossFn, teacher: torch.nn.Module | None = None,
        from_hidden: bool = False, bf16_on_cpu: bool = False, **kwargs: Any,
    ) -> None:
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("EMDLMSFTTrainer computes the loss itself; drop compute_loss_func")
        emdlm_loss = ComputeLoss(loss_fn, who="EMDLMSFTTrainer")  # refuses reduction != "sum"
        if emdlm_loss.needs.needs_teacher and teacher is None:
            raise ValueError(
                f"EMDLMSFTTrainer: {type(loss_fn).__name__} distils from a teacher: pass teacher="
            )
        if teacher is not None and not emdlm_loss.needs.needs_teacher:
            raise ValueError(
                f"EMDLMSFTTrainer: teacher= given but {type(loss_fn).__name__} does not distil"
            )
        config = args[1] if len(args) > 1 else kwargs.get("args")  # SFTTrainer(model, args)
        if config is None:  # TRL's own default, built here so that its precision can be set
            config = _default_config(args[0] if args else kwargs.get("model"), bf16_on_cpu)
        config = fp32_on_cpu(config, bf16_on_cpu)
        train_dataset = args[2] if len(args) > 2 else kwargs.get("train_dataset")
        weighted = emdlm_loss.check_dataset(train_dataset)  # the rows' weights, read once
        if getattr(config, "packing", False) and weighted:
            raise ValueError(
                "EMDLMSFTTrainer: packing merges rows, so their loss weights cannot follow "
                "them: set SFTConfig(packing=False) or drop the loss_weight field"
            )
        if len(args) > 1:
            args = (args[0], config, *args[2:])
        else:
            kwargs["args"] = config
        super().__init__(*args, **kwargs)
        self.data_collator = RowWeightCollator(self.data_collator, self.padding_free)
        if self.args.loss_type != "nll":
            raise ValueError(
                f"EMDLMSFTTrainer replaces the loss; SFTConfig.loss_type must be 'nll', "
                f"got {self.args.loss_type!r}"
            )
        if from_hidden:
            emdlm_loss.enable_from_hidden(self.model)
        self.emdlm_loss = emdlm_loss
        self.teacher = teacher

    def emdlm_loss_call(self) -> ComputeLoss:
        return self.emdlm_loss

    def _set_signature_columns_if_needed(self) -> None:
        """TRL's columns, and the loss-weight fields: ``remove_unused_columns`` (on by default)
        would otherwise drop them before the collator, and the weights would be lost."""
        super()._set_signature_columns_if_needed()
        kept = list(self._signature_columns or [])
        self._signature_columns = kept + [
            k for k in (LOSS_WEIGHT_KEY, TOKEN_WEIGHTS_KEY) if k not in kept
        ]

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        mode = "train" if model.training else "eval"
        labels = inputs["labels"]  # [B, T], unshifted, -100 where not scored
        loss, outputs = super().compute_loss(
            model, {**inputs, "use_cache": False}, return_outputs=True,
            num_items_in_batch=num_items_in_batch,
        )
        with torch.no_grad():  # a host sync or two per step for logging, as TRL does
            logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
            if logits is not None:
                shift_labels = labels[:, 1:].to(logits.device)
                weights = inputs.get(TOKEN_WEIGHTS_KEY)
                mask = scored_positions(
                    shift_labels, None if weights is None else weights[:, 1:], IGNORE_INDEX)
                hits = ((logits[:, :-1].argmax(-1) == shift_labels) & mask).sum()
                counts: tuple[torch.Tensor, torch.Tensor] | None = (hits, mask.sum())
            else:  # from hidden states: the loss's own argmax, where it gives one
                counts = self.emdlm_loss.last_token_hits
            if counts is not None:  # counts summed over processes, then divided (TRL's way)
                n_valid = self.accelerator.gather_for_metrics(counts[1]).sum()
                n_hits = self.accelerator.gather_for_metrics(counts[0]).sum()
                acc = (n_hits / n_valid).item() if n_valid > 0 else 0.0
                self._metrics[mode]["mean_token_accuracy"].append(acc)
            # The adapter records components only when gradients are on (training).
            for name, value in self.emdlm_loss.pop_components().items():
                if name != "loss":
                    self._metrics[mode][f"emdlm/{name}"].append(value)
        return (loss, outputs) if return_outputs else loss
