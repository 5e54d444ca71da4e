"""Fused LM head + EMO (or CE): the [N, V] logits are never materialized.

Both functions are users of the chunked-loss engine (:func:`emdlm.ops.chunked.chunked_linear_loss`,
the scheme of Liger-Kernel's fused linear cross-entropy): per chunk of positions

    z_c = h_c Wᵀ + b                       [n, V]   (input dtype, like the unfused head)
    g_c = d(loss)/d(z_c)                   [n, V]   (float32; the per-chunk objective)
    grad_h_c = g_c W,   grad_W += g_cᵀ h_c,   grad_b += Σ_rows g_c

with the per-token loss of :class:`emdlm.ops.from_hidden.EMOObjective` (EMO, ICLR 2024,
Eq. 14 and 19; GUIDE §1.4): emo1 = 0.5·(CE + sg(CE/DEMD)·DEMD), emo2 = DEMD + sg(DEMD/CE)·CE,
static = CE + mu·DEMD; or CE alone (:class:`emdlm.ops.from_hidden.WeightedCEObjective`) for
:func:`fused_linear_cross_entropy`. The loss modules' ``from_hidden`` methods call the same
objectives with a logit scale / soft-cap and a vocabulary-sized default chunk; these two keep
their historical signature (``chunk_size`` = 1024 positions by default).

All gradients are computed in forward; backward scales them in place by grad_output and hands
them over, so backward can run only once per forward (``retain_graph=True`` raises unless
``inplace_backward=False``). Peak memory beyond the inputs and their gradients is O(chunk·V): two
[chunk, V] float32 buffers reused by every chunk (z, later S; q, later the gradient; one more
for bf16/fp16 inputs), plus a float32 [V, H] accumulator for grad_W when the weight is bf16/fp16.

Shape notation: N positions (all leading dims of hidden), H hidden size, V vocabulary,
d' cost-embedding width.
"""

from __future__ import annotations

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, check_reduction, compute_dtype
from emdlm.ops._chunking import (
    EMOMode,
    check_chunk_size,
    check_cost_embedding,
    check_mode,
    prepare_cost,
)
from emdlm.ops.chunked import HeadOptions, check_linear_inputs, chunked_linear_loss
from emdlm.ops.from_hidden import EMOObjective, WeightedCEObjective


def fused_linear_emo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mode: EMOMode = "emo1",
    mu: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    chunk_size: int = 1024,
    cost_dtype: torch.dtype | None = None,
    max_ratio: float | None = None,
    inplace_backward: bool = True,
) -> LossOutput:
    """EMO loss of the LM head ``hidden @ weight.T + bias`` without materializing the logits.

    Equal to ``emo_loss(hidden @ weight.T + bias, labels, Ê, ...)`` (values and the gradients
    w.r.t. hidden, weight and bias); see :func:`emdlm.ops.emo_chunked.emo_loss_chunked` for the
    formula, the modes and the options. :func:`emdlm.ops.from_hidden.emo_from_hidden` is the
    same with a logit scale / soft-cap.

    Args:
        hidden: [..., H] final hidden states, float32 / bf16 / fp16 (the head matmul runs in this
            dtype, the softmax and losses in float32).
        weight: [V, H] LM-head weight, same dtype as hidden.
        labels: [...] labels aligned with hidden (no shift inside).
        cost_embedding: Ê [V, d'], row-normalized, frozen (d' may differ from H).
        bias: optional [V] head bias.
        mode, mu, ignore_index, reduction, cost_dtype, max_ratio, inplace_backward: as in
            ``emo_loss_chunked`` (in-place backward scales grad_hidden / grad_weight / grad_bias
            in place and hands them over; a second backward then raises).
        chunk_size: positions per chunk; scratch is 2·chunk_size·V float32 values (float32
            inputs; 3 for half precision).

    Returns:
        LossOutput with loss and components "ce", "demd" (means over counted tokens), "n_tokens".
    """
    check_mode(mode, reduction, mu, max_ratio)
    check_chunk_size(chunk_size)
    # Label range: checked in the engine's one host sync (before any gradient is computed).
    check_linear_inputs(hidden, weight, labels, bias, ignore_index, check_range=False)
    check_cost_embedding(cost_embedding, weight.shape[0], hidden.device)
    cost = prepare_cost(cost_embedding, cost_dtype, compute_dtype(hidden.dtype))
    options = HeadOptions(ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size)
    objective = EMOObjective(cost, mode, mu, max_ratio)
    return chunked_linear_loss(
        hidden, weight, bias, labels, objective, options, inplace_backward=inplace_backward
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    chunk_size: int = 1024,
    inplace_backward: bool = True,
) -> LossOutput:
    """Cross-entropy of ``hidden @ weight.T + bias`` without materializing the [N, V] logits.

    CE_t = logsumexp(z_t) - z_t[y_t] in float32, reduced over counted tokens; gradients for hidden,
    weight and bias computed chunk by chunk in forward (the objective of
    ``CrossEntropyLoss.from_hidden``). Components: "ce", "n_tokens".
    """
    check_reduction(reduction)
    check_chunk_size(chunk_size)
    options = HeadOptions(ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size)
    return chunked_linear_loss(
        hidden,
        weight,
        bias,
        labels,
        WeightedCEObjective(),
        options,
        inplace_backward=inplace_backward,
    )


__all__ = ["fused_linear_cross_entropy", "fused_linear_emo_loss"]
