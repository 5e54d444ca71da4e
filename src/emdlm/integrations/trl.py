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
defaults to True). Note that ``SFTConfig`` turns on bf16 autocast by default; emdlm losses
take the softmax in float32 whatever the logits' dtype.

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

from collections.abc import Callable
from typing import Any

import torch
from trl import SFTTrainer

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX
from emdlm.integrations.transformers import ComputeLoss, make_compute_loss_func

LossFn = Callable[[torch.Tensor, torch.Tensor], LossOutput]


def sft_compute_loss_func(loss_fn: LossFn) -> ComputeLoss:
    """``SFTTrainer(..., compute_loss_func=sft_compute_loss_func(loss_fn))``.

    The transformers adapter as is: TRL calls it as ``f(outputs, labels, num_items_in_batch=N)``
    with unshifted labels, exactly like ``transformers.Trainer``. Prefer
    :class:`EMDLMSFTTrainer`, which avoids TRL's extra forward pass.
    """
    return make_compute_loss_func(loss_fn)


class EMDLMSFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` whose training and evaluation loss is an emdlm loss.

    Args:
        loss_fn: an emdlm loss module with ``reduction="sum"``, called as
            ``loss_fn(logits [B, T-1, V], labels [B, T-1])`` on the shifted batch.
        *args, **kwargs: passed to ``trl.SFTTrainer`` unchanged (``compute_loss_func`` and
            ``loss_type="dft"`` are refused: they would replace the emdlm loss).

    Logged next to TRL's metrics: ``mean_token_accuracy`` (argmax of the logits on scored
    positions, train and eval) and, in training, each loss component as ``emdlm/<name>``.
    Unsupported: DeepSpeed Ulysses sequence parallelism (TRL reduces its own fused loss there).
    """

    def __init__(self, *args: Any, loss_fn: LossFn, **kwargs: Any) -> None:
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("EMDLMSFTTrainer computes the loss itself; drop compute_loss_func")
        emdlm_loss = make_compute_loss_func(loss_fn)  # checks reduction == "sum"
        super().__init__(*args, **kwargs)
        if self.args.loss_type != "nll":
            raise ValueError(
                f"EMDLMSFTTrainer replaces the loss; SFTConfig.loss_type must be 'nll', "
                f"got {self.args.loss_type!r}"
            )
        self.emdlm_loss = emdlm_loss

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        mode = "train" if model.training else "eval"
        labels = inputs["labels"]  # [B, T], unshifted, -100 where not scored
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        model_inputs["use_cache"] = False
        outputs = model(**model_inputs)  # the original forward: full logits [B, T, V]
        loss = self.emdlm_loss(outputs, labels, num_items_in_batch=num_items_in_batch)
        # Like Trainer.compute_loss: num_items_in_batch counts the tokens of every rank while
        # DDP averages gradients over ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes

        with torch.no_grad():  # a host sync or two per step for logging, as TRL does
            shift_labels = labels[:, 1:]
            mask = shift_labels != IGNORE_INDEX
            hits = ((outputs.logits[:, :-1].argmax(-1) == shift_labels) & mask).sum()
            n_valid = self.accelerator.gather_for_metrics(mask.sum()).sum()
            n_hits = self.accelerator.gather_for_metrics(hits).sum()
            acc = (n_hits / n_valid).item() if n_valid > 0 else 0.0
            self._metrics[mode]["mean_token_accuracy"].append(acc)
            # The adapter records components only when gradients are on (training).
            for name, value in self.emdlm_loss.pop_components().items():
                if name != "loss":
                    self._metrics[mode][f"emdlm/{name}"].append(value)
        return (loss, outputs) if return_outputs else loss
