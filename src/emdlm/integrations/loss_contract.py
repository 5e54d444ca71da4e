"""What a loss handed to a training framework promises: the contract every route shares.

The frameworks (``transformers.Trainer``'s ``compute_loss_func``, a model's ``loss_function``
hook, :func:`emdlm.patch`) pass unshifted labels with :data:`IGNORE_INDEX` at the positions
not scored, and, with gradient accumulation, ``num_items_in_batch``: the scored tokens of the
whole accumulated batch. So the loss must return the per-token *sum*
(:func:`require_sum_reduction`) and the caller divides it once (:func:`scaled_loss`).
Used by :mod:`emdlm.integrations.hidden_forward`, :mod:`emdlm.integrations.transformers` and
:mod:`emdlm.integrations.patch`; imports nothing of emdlm.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def require_sum_reduction(loss_fn: Any, who: str = "make_compute_loss_func") -> None:
    """Refuse a loss whose ``reduction`` is not ``"sum"`` (ValueError naming ``reduction``).

    The Trainer divides the micro-batch loss by ``num_items_in_batch`` itself, so the loss must
    return Σ_t l_t: a per-token mean would be divided twice. A missing or unknown reduction is
    not taken for "sum".
    """
    name = type(loss_fn).__name__
    if not hasattr(loss_fn, "reduction"):
        raise ValueError(
            f"{who} needs a loss that returns the per-token sum, but {name} has no `reduction` "
            f"attribute, so it cannot tell; build the loss with reduction='sum' (every emdlm "
            f"loss has it), or set `.reduction = 'sum'` on a callable that returns a sum"
        )
    reduction = loss_fn.reduction
    if reduction != "sum":
        raise ValueError(
            f"{who} needs a loss built with reduction='sum' (it divides by the batch's token "
            f"count itself; 'mean' would be divided twice and shrink the gradient), got "
            f"{name} with reduction={reduction!r}"
        )


def scaled_loss(
    summed: torch.Tensor, count: torch.Tensor, num_items_in_batch: Any
) -> torch.Tensor:
    """Σ l_t / N with N = ``num_items_in_batch`` when given, else the call's scored count."""
    if num_items_in_batch is None:
        return summed / count.clamp_min(1)
    if isinstance(num_items_in_batch, torch.Tensor):
        return summed / num_items_in_batch.to(summed.device).clamp_min(1)
    return summed / max(int(num_items_in_batch), 1)
