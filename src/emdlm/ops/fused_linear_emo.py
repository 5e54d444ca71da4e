"""Fused LM head + EMO (or CE): the [N, V] logits are never materialized.

Per chunk of positions (the scheme of Liger-Kernel's fused linear cross-entropy):

    z_c = h_c Wᵀ + b                       [n, V]   (input dtype, like the unfused head)
    g_c = d(loss)/d(z_c)                   [n, V]   (float32; see emdlm.ops._chunking)
    grad_h_c = g_c W                       [n, H]
    grad_W  += g_cᵀ h_c                    [V, H]
    grad_b  += Σ_rows g_c                  [V]

The per-token loss is the one of :func:`emdlm.ops.emo_chunked.emo_loss_chunked` (EMO, ICLR 2024,
Eq. 14 and 19; GUIDE §1.4): emo1 = 0.5·(CE + sg(CE/DEMD)·DEMD), emo2 = DEMD + sg(DEMD/CE)·CE,
static = CE + mu·DEMD; or CE alone for :func:`fused_linear_cross_entropy`.

All gradients are computed in forward; backward scales them in place by grad_output and hands
them over, so backward can run only once per forward (``retain_graph=True`` raises unless
``inplace_backward=False``). Peak memory beyond the inputs and their gradients is O(chunk·V): two
[chunk, V] float32 buffers reused by every chunk (z, later S; q, later the gradient; one more
for bf16/fp16 inputs), plus a float32 [V, H] accumulator for grad_W when the weight is bf16/fp16
(grad_W accumulated over chunks in half precision would be rounded once per chunk).

Shape notation: N positions (all leading dims of hidden), H hidden size, V vocabulary,
d' cost-embedding width.
"""

from __future__ import annotations

from typing import Any

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_reduction,
    compute_dtype,
)
from emdlm.ops._chunking import (
    ChunkSums,
    EMOMode,
    check_chunk_size,
    check_cost_embedding,
    check_mode,
    emo_chunk,
    prepare_cost,
    scratch,
)
from emdlm.ops._handover import hand_over_gradients


def _check_linear_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    chunk_size: int,
) -> None:
    check_chunk_size(chunk_size)
    if not torch.is_floating_point(hidden) or not torch.is_floating_point(weight):
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2 or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H] with H = hidden.shape[-1]; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape [V] = {tuple(weight.shape[:1])} and dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    # Shape / range checks of the labels against a zero-stride stand-in for the logits.
    stand_in = hidden.new_zeros(()).expand(*hidden.shape[:-1], weight.shape[0])
    check_logits_labels(stand_in, labels, ignore_index)


def _fused_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    cost: torch.Tensor | None,
    mode: str,
    mu: float,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    max_ratio: float | None,
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, ChunkSums, torch.Tensor, torch.Tensor, tuple[Any, Any, Any]]:
    """Chunk loop. Returns loss, sums, count, denominator and (grad_h, grad_W, grad_b) or Nones."""
    need_h, need_w, need_b = need
    with_grad = need_h or need_w or need_b
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_labels = labels.reshape(-1).long()  # [N]
    cdtype = compute_dtype(hidden.dtype)
    count = (flat_labels != ignore_index).sum()
    denom = count.clamp_min(1).to(cdtype)
    scale = 1.0 / denom if reduction == "mean" else torch.ones_like(denom)
    grad_h = torch.empty_like(h2) if need_h else None
    acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[:1], dtype=cdtype, device=weight.device) if need_b else None
    n_rows, vocab = h2.shape[0], weight.shape[0]
    rows = min(chunk_size, n_rows)
    # Buffers reused by every chunk: z (head output, input dtype), q / gradient (compute dtype),
    # and S (compute dtype; for float32 inputs it shares z's storage, consumed first).
    z_buf = scratch(rows, vocab, hidden.dtype, hidden.device)
    q_buf = scratch(rows, vocab, cdtype, hidden.device)
    s_buf: torch.Tensor | None
    if hidden.dtype != cdtype:  # half-precision inputs: S and the float32 staging copy of z
        s_buf = scratch(rows, vocab, cdtype, hidden.device)
    else:  # z is consumed (log-softmax into q_buf) before S is written
        s_buf = None if mode == "ce" else z_buf
    sums = ChunkSums.zeros(hidden.device, cdtype)
    for lo in range(0, n_rows, chunk_size):
        hi = min(lo + chunk_size, n_rows)
        n = hi - lo
        h_c = h2[lo:hi]  # [n, H]
        z = z_buf[:n]
        if bias is None:
            torch.mm(h_c, weight.T, out=z)  # [n, V]
        else:
            torch.addmm(bias, h_c, weight.T, out=z)
        g = emo_chunk(
            z,
            flat_labels[lo:hi],
            ignore_index,
            cost,
            mode,  # type: ignore[arg-type]
            mu,
            scale if with_grad else None,
            sums,
            q_buf[:n],
            None if s_buf is None else s_buf[:n],
            max_ratio=max_ratio,
        )
        if g is None:
            continue
        # The gradient in the dtype the unfused head's backward would see ([n, V]).
        g_d = g if g.dtype == hidden.dtype else z.copy_(g)
        if grad_h is not None:
            torch.mm(g_d, weight, out=grad_h[lo:hi])
        if grad_w is not None:
            # g is 0 on ignored rows, but a NaN / inf hidden state there (padding) would still
            # give 0·NaN = NaN in gᵀh: zero those rows of h with a where ([n, H], small).
            h_w = torch.where((flat_labels[lo:hi] != ignore_index)[:, None], h_c, 0.0)
            if grad_w.dtype == g_d.dtype:
                grad_w.addmm_(g_d.T, h_w)
            else:
                grad_w.add_(g_d.T @ h_w)
        if grad_b is not None:
            grad_b.add_(g.sum(0))
    loss = sums.loss * scale
    grads = (
        None if grad_h is None else grad_h.view(hidden.shape),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(weight.dtype),
    )
    return loss, sums, count, denom, grads


class FusedLinearEMOFunction(torch.autograd.Function):
    """Autograd Function: loss and detached stats from hidden, weight, bias; no [N, V] logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        cost: torch.Tensor | None,
        mode: str,
        mu: float,
        ignore_index: int,
        reduction: str,
        chunk_size: int,
        max_ratio: float | None,
        inplace_backward: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.inplace_backward = inplace_backward
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])  # hidden, weight, bias
        loss, sums, count, denom, grads = _fused_forward(
            hidden,
            weight,
            bias,
            labels,
            cost,
            mode,
            mu,
            ignore_index,
            reduction,
            chunk_size,
            max_ratio,
            need,
        )
        ctx.grads = grads
        ce, demd = sums.ce / denom, sums.demd / denom
        ctx.mark_non_differentiable(ce, demd, count)
        return loss, ce, demd, count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        out = hand_over_gradients(ctx, "grads", grad_loss, "FusedLinearEMOFunction")
        return (
            *out,  # hidden, weight, bias
            None,  # labels
            None,  # cost
            None,  # mode
            None,  # mu
            None,  # ignore_index
            None,  # reduction
            None,  # chunk_size
            None,  # max_ratio
            None,  # inplace_backward
        )


def _run(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    cost: torch.Tensor | None,
    options: tuple[Any, ...],
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch: the Function when a gradient is wanted, else a values-only chunk loop.

    ``options`` = (mode, mu, ignore_index, reduction, chunk_size, max_ratio).
    """
    wants_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if wants_grad:
        return FusedLinearEMOFunction.apply(
            hidden, weight, bias, labels, cost, *options, inplace_backward
        )
    with torch.no_grad():
        loss, sums, count, denom, _ = _fused_forward(
            hidden, weight, bias, labels, cost, *options, (False, False, False)
        )
    return loss, sums.ce / denom, sums.demd / denom, count


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
    formula, the modes and the options.

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
    _check_linear_inputs(hidden, weight, labels, bias, ignore_index, chunk_size)
    check_cost_embedding(cost_embedding, weight.shape[0], hidden.device)
    cost = prepare_cost(cost_embedding, cost_dtype, compute_dtype(hidden.dtype))
    options = (mode, mu, ignore_index, reduction, chunk_size, max_ratio)
    loss, ce, demd, count = _run(hidden, weight, bias, labels, cost, options, inplace_backward)
    return LossOutput(loss=loss, components={"ce": ce, "demd": demd, "n_tokens": count})


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
    weight and bias computed chunk by chunk in forward. Components: "ce", "n_tokens".
    """
    check_reduction(reduction)
    _check_linear_inputs(hidden, weight, labels, bias, ignore_index, chunk_size)
    options = ("ce", 0.0, ignore_index, reduction, chunk_size, None)
    loss, ce, _demd, count = _run(hidden, weight, bias, labels, None, options, inplace_backward)
    return LossOutput(loss=loss, components={"ce": ce, "n_tokens": count})
