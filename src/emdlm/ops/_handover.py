"""Backward of the fast paths: hand gradients computed in forward to autograd, scaled once.

Every fused / chunked Function in emdlm computes d(loss)/d(input) in its forward (Liger-Kernel's
habit) and keeps it on ``ctx``; backward only multiplies by grad_output. Scaling in place saves
a full [N, V] tensor, so such a graph can be back-propagated once; ``inplace_backward=False``
keeps the buffers for another backward at the cost of one more copy.
"""

from __future__ import annotations

from typing import Any

import torch


def hand_over_gradients(
    ctx: Any, attr: str, factor: torch.Tensor | None, owner: str
) -> tuple[torch.Tensor | None, ...]:
    """Scale the gradients kept in ``ctx.<attr>`` (a tuple, entries may be None) by ``factor``.

    Args:
        ctx: the autograd context; reads ``ctx.inplace_backward``.
        attr: name of the attribute holding the tuple of gradients.
        factor: 0-d multiplier (grad_output, possibly times a saved scale); None = already 1.
        owner: the Function's name, for the error on a second backward.
    """
    grads = getattr(ctx, attr, None)
    if grads is None:
        raise RuntimeError(
            f"{owner}.backward was called twice: its gradients are scaled in place and handed "
            "over on the first call (back-propagated once); pass inplace_backward=False "
            "(retain_graph=True needs it) to back-propagate it again"
        )
    if ctx.inplace_backward:
        setattr(ctx, attr, None)  # autograd takes the buffers without a copy
        if factor is None:
            return grads
        return tuple(None if g is None else g.mul_(factor.to(g.dtype)) for g in grads)
    if factor is None:
        return tuple(None if g is None else g.clone() for g in grads)
    return tuple(None if g is None else g * factor.to(g.dtype) for g in grads)
