"""Hand an emdlm loss to ``transformers.Trainer`` as ``compute_loss_func``.

transformers 5.x calls ``compute_loss_func(outputs, labels, num_items_in_batch=N)`` with the
labels NOT shifted, and, when ``N`` is given, expects a loss already divided by ``N``: the count
of scored tokens in the whole accumulated batch, summed over processes when
``average_tokens_across_devices`` (the Trainer then multiplies by the process count because DDP
averages gradients). So, per micro-batch::

    loss_mb = sum_{t in micro-batch} l_t / N

and the accumulated gradient is exactly the gradient of the mean over all N tokens: the same as
one big batch, whatever the split into micro-batches and processes. This holds for every
objective whose summed loss is a sum of per-token (or per-number) terms. NTIL/EMO's *dynamic*
weights sg(CE/aux) are computed per call, i.e. per micro-batch: with accumulation they are
exact only if the ratio is per token (see the tests).

:class:`ComputeLoss` also records the loss components (token-weighted over micro-batches) for
the logging callback; nothing is recorded when gradients are off (evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100


class ComputeLoss:
    """``compute_loss_func`` for ``transformers.Trainer`` around an emdlm loss (reduction "sum").

    Args:
        loss_fn: module called as ``loss_fn(logits [B, T-1, V], labels [B, T-1])`` returning a
            LossOutput whose ``loss`` is a sum over scored tokens.
        ignore_index: label value that is not scored.
    """

    def __init__(self, loss_fn: nn.Module, ignore_index: int = IGNORE_INDEX) -> None:
        reduction = getattr(loss_fn, "reduction", "sum")
        if reduction != "sum":
            raise ValueError(
                f"make_compute_loss_func needs a loss built with reduction='sum' (it divides by "
                f"the batch's token count itself), got reduction={reduction!r}"
            )
        self.loss_fn = loss_fn
        self.ignore_index = ignore_index
        self._loss_sum: torch.Tensor | None = None
        self._weighted: dict[str, torch.Tensor] = {}
        self._weight: torch.Tensor | None = None

    def __call__(
        self,
        outputs: Any,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        if labels is None:
            raise ValueError("compute_loss_func got labels=None: the batch has no 'labels'")
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        shift_logits = logits[:, :-1, :]  # [B, T-1, V]: position t predicts token t+1
        shift_labels = labels[:, 1:].to(logits.device)  # [B, T-1]
        out = self.loss_fn(shift_logits, shift_labels)
        count = (shift_labels != self.ignore_index).sum()
        if num_items_in_batch is None:
            denom: torch.Tensor | int = count.clamp_min(1)
        else:
            denom = num_items_in_batch
            if isinstance(denom, torch.Tensor):
                denom = denom.to(out.loss.device).clamp_min(1)
            else:
                denom = max(int(denom), 1)
        loss = out.loss / denom
        if torch.is_grad_enabled():
            self._record(loss.detach(), out.components, count)
        return loss

    def _record(
        self, loss: torch.Tensor, components: Mapping[str, Any], count: torch.Tensor
    ) -> None:
        # No host sync here: tensors are accumulated and read once per optimizer step.
        w = count.detach().to(torch.float64)
        self._loss_sum = loss.double() if self._loss_sum is None else self._loss_sum + loss
        self._weight = w if self._weight is None else self._weight + w
        for key, value in components.items():
            v = torch.as_tensor(value, dtype=torch.float64, device=w.device).detach()
            contrib = v if key.startswith("n_") else v * w  # counts add up, means are weighted
            self._weighted[key] = self._weighted.get(key, 0) + contrib

    def pop_components(self, all_reduce: bool = False) -> dict[str, float]:
        """Components since the last call: "loss" (the optimizer step's loss, a mean over the
        step's scored tokens), each loss component averaged with token weights ("n_*" counts
        summed), and "n_scored". With ``all_reduce``, summed over torch.distributed ranks."""
        if self._loss_sum is None or self._weight is None:
            return {}
        keys = sorted(self._weighted)
        stacked = torch.stack(
            [self._loss_sum.double(), self._weight.double()]
            + [torch.as_tensor(self._weighted[k], dtype=torch.float64) for k in keys]
        )
        self._loss_sum, self._weight, self._weighted = None, None, {}
        if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            stacked = stacked.to(_dist_device())
            torch.distributed.all_reduce(stacked)
        values = stacked.cpu().tolist()  # the one host sync per optimizer step
        loss_sum, weight = values[0], values[1]
        out = {"loss": loss_sum, "n_scored": weight}
        for key, value in zip(keys, values[2:], strict=True):
            out[key] = value if key.startswith("n_") else value / max(weight, 1.0)
        return out


def _dist_device() -> torch.device:
    backend = torch.distributed.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_compute_loss_func(loss_fn: nn.Module, ignore_index: int = IGNORE_INDEX) -> ComputeLoss:
    """``Trainer(compute_loss_func=make_compute_loss_func(loss_fn))``: shifts the labels and
    divides the summed loss by ``num_items_in_batch`` (exact gradient accumulation)."""
    return ComputeLoss(loss_fn, ignore_index=ignore_index)


__all__ = ["ComputeLoss", "make_compute_loss_func"]
