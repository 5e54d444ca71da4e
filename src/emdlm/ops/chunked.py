"""One chunked-loss engine: every objective, from hidden states or from given logits.

An objective is a :class:`ChunkObjective`: a per-chunk function (loss and gradient of a few
rows' logits) plus an optional after-pass term. Two drivers run it (the scheme of
Liger-Kernel's chunked-loss base class):

* :func:`chunked_linear_loss`, from hidden states (no [N, V] tensor ever alive). Per chunk c:

      r_c = h_c Wᵀ + b                        [n, V]  head output, input dtype (as the unfused head)
      z_c = cap·tanh(s·r_c / cap)             [n, V]  compute dtype; scale s and soft-cap optional
      (L_c, g_c) = objective.chunk(z_c, y_c, k·s)     summed loss, g_c = k·s·dL_c/dz_c
      g'_c = g_c · (1 − (z_c/cap)²)                   k = 1/n_counted ("mean") or 1 ("sum")
      grad_h_c = g'_c W,   grad_W += g'_cᵀ h_c,   grad_b += Σ_rows g'_c

* :func:`chunked_logits_loss`, from given logits (any strides, read chunk by chunk): z_c is a
  chunk of the logits, g_c = k·dL_c/dz_c is written into one [N, V] gradient buffer (logits'
  dtype; for float32 logits the objective works in it directly). An objective that would need
  a pass of its own to apply k (plain CE: g = softmax − onehot) leaves it to backward, where it
  joins grad_output in the one pass that scales the buffer.

After the pass the objective may add a term that depends only on a few logits it kept
(NTIL: the [M, K] class-candidate logits of the number positions) and on the pass's sums
(the global CE mean): ``objective.finish`` returns its loss and its sparse gradient
G[m, k] = dL/dz[rows[m], ids[m, k]], which is added without a second pass over the vocabulary:

    from hidden:  grad_h[rows[m]] += Σ_k G'[m, k]·W[ids[m, k]],
                  grad_W[ids[m, k]] += G'[m, k]·h[rows[m]],  grad_b[ids[m, k]] += G'[m, k]
                  (G' = k·G·s·(1 − (z/cap)²))
    from logits:  grad[rows[m], ids[m, k]] += k·G[m, k]

The loss is k·(Σ_c L_c + L_finish). Gradients are computed in forward; backward multiplies them
by grad_output and hands them over (:mod:`emdlm.ops._handover`), so the graph is
back-propagated once unless ``inplace_backward=False``. Rows of ignored labels get exactly 0
(the drivers zero them, so a NaN / inf at a padding position never leaks).

Host syncs: ONE per call (forward + backward), the ``.tolist()`` in ``_Pass.of`` at the start of
forward. It reads together every value the call needs on the host: the number of labels outside
[0, V) (the range error is raised there, before any gradient), the ignored rows before each
chunk bound (their indices then come from ``torch.nonzero_static``, which takes its size from
the caller), and the objective's own sizes (:meth:`ChunkObjective.host_sizes`: NTIL's span
sizes, widest class, candidate ids and number tokens per chunk). Nothing else reads a device
value: no ``nonzero`` / ``unique`` / ``.item()``, no host→device copy of a Python list, and
backward never reads grad_output on an accelerator (:func:`_grad_output_is_one`).
tests/test_host_syncs.py pins this for every registered objective.

This module holds the drivers (the passes over the chunks, their autograd Functions); the
objective base is :mod:`emdlm.ops.chunk_objective` and the head with its options
:mod:`emdlm.ops.head` (their public names are importable from here too).

Users: one :class:`ChunkObjective` per family in :mod:`emdlm.ops.objectives` (CE, TaiLr,
MixCE, DFT; NTIL and digit EMD; the NTL losses; EMO; EMO distillation and the KL baseline),
built by each loss's ``chunk_objective`` and run from hidden states by
``EMDLMLoss.from_hidden`` and from logits by the losses' chunked logits paths.

Memory of the hidden driver beyond the inputs and their gradients: one [n, V] buffer of the head
output (input dtype; the CE family computes its softmax and gradient in it, in place), one
float32 copy of it for half-precision inputs, one more with a soft-cap, EMO's q buffer, and a
float32 [V, H] accumulator for grad_W when the weight is bf16/fp16 (grad_W accumulated in half
precision would be rounded once per chunk). Default chunk: ``DEFAULT_CHUNK_ELEMENTS // V`` rows
(2^26 elements = 256 MiB of float32 per buffer; 441 rows at V = 151936, 2097 at V = 32000). At
N = 4096, V = 151936 the float32 logits are 2.49 GB and one buffer is 10.8 % of them (≤ 1/8).
Why not smaller: every chunk adds g_cᵀ h_c to the whole [V, H] grad_W, a pass over 545 MB at
Qwen's vocabulary, so small chunks are memory-bound on CPU (N = 1024, V = 151936, 2 threads,
fwd+bwd vs the full-logits CE: 1.32x at 110 rows, 1.21x at 220, 0.97x at 512; see
docs/results/bench_from_hidden_cpu.md). Pass ``chunk_size`` to trade time for memory.
Memory of the logits driver: the [N, V] gradient buffer (it replaces what plain autograd keeps)
plus one float32 [n, V] staging buffer for half-precision logits and the objective's scratch.

Shape notation: N rows (all leading dims of hidden / logits), n rows in a chunk, H hidden size,
V vocabulary, M kept positions, K kept logits per position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    bad_label_count,
    check_logits_labels_shapes,
    compute_dtype,
    label_range_error,
)
from emdlm.ops._chunking import row_chunks
from emdlm.ops._compile import eager_under_compile
from emdlm.ops._handover import hand_over_gradients
from emdlm.ops.chunk_objective import (
    ChunkObjective,
    ChunkOut,
    Finish,
    SparseLogitGrad,
    count_divisor,
    predicted_tokens,
)
from emdlm.ops.head import (
    DEFAULT_CHUNK_ELEMENTS,
    HeadOptions,
    check_head_options,
    check_linear_inputs,
    default_chunk_rows,
    head_chunk_logits,
    head_logits,
    stand_in_logits,
)


def counts_before(mask: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[len(bounds)] long: Σ mask[:b] for each host int b of ``bounds`` (ascending), no host
    sync. The bounds never travel to the device (a host→device copy syncs on CUDA): a strided
    slice of the cumulative sum when they are evenly spaced (the last one aside), else one
    select per bound."""
    cum = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])  # [N + 1]
    if len(bounds) >= 2:
        first, step = bounds[0], bounds[1] - bounds[0]
        if step > 0 and bounds[:-1] == list(range(first, bounds[-2] + 1, step)):
            return torch.cat([cum[first : bounds[-2] + 1 : step], cum[bounds[-1] :][:1]])
    return torch.stack([cum[b] for b in bounds])


@dataclass
class _Pass:
    """What both drivers set up the same way: flat labels, the count, the reduction, and what
    the call's one host sync read (label-range check, ignored rows, the objective's sizes)."""

    labels: torch.Tensor  # [N] long
    valid: torch.Tensor  # [N] bool
    count: torch.Tensor  # 0-d: counted labels (long) or their weight sum (objective.counted)
    scale: torch.Tensor  # 0-d compute dtype: k = 1/count ("mean") or 1 ("sum")
    ignored: torch.Tensor | None  # [I] long rows of ignored labels, ascending (None: not asked)
    cut: list[int]  # ignored[cut[i] : cut[i + 1]] lie in [ignore_bounds[i], ignore_bounds[i + 1])
    objective_sizes: list[int]  # the values of objective.host_sizes

    @classmethod
    def of(
        cls,
        labels: torch.Tensor,
        options: HeadOptions,
        cdtype: torch.dtype,
        vocab: int,
        objective: ChunkObjective,
        bounds: list[int],
        ignore_bounds: list[int] | None,
    ) -> _Pass:
        """Flatten ``labels`` [...], count them, and read in ONE host sync (the only one of the
        call): the number of labels outside [0, V) (then raise the range error, before any
        gradient), the ignored rows before each of ``ignore_bounds`` (None: not needed) and
        ``objective.host_sizes`` for the chunk ``bounds``."""
        flat = labels.reshape(-1).long()
        valid = flat != options.ignore_index
        count = objective.counted(valid)
        if options.reduction == "mean":  # a count of 0 (or a weight sum of 0) divides by 1
            scale = 1.0 / count_divisor(count, cdtype)
        else:
            scale = torch.ones((), dtype=cdtype, device=labels.device)
        parts = [bad_label_count(flat, vocab, options.ignore_index).reshape(1)]
        if ignore_bounds is not None:
            parts.append(counts_before(~valid, ignore_bounds))
        weights = objective.token_weights
        if weights is not None:  # per-token weights must be finite and >= 0
            parts.append((~torch.isfinite(weights) | (weights < 0)).sum().reshape(1))
        n_cut = 0 if ignore_bounds is None else len(ignore_bounds)
        n_head = 1 + n_cut + (weights is not None)
        extra = objective.host_sizes(flat, valid, bounds, vocab)
        if extra is not None:
            parts.append(extra.reshape(-1).long())
        sizes = torch.cat(parts).tolist()  # the host sync of the call
        if sizes[0]:
            raise label_range_error(flat, vocab, options.ignore_index)
        if weights is not None and sizes[n_head - 1]:
            raise ValueError(
                f"loss_weights must be finite and >= 0: {sizes[n_head - 1]} of "
                f"{weights.numel()} entries are negative, NaN or inf"
            )
        cut = sizes[1 : 1 + n_cut]
        ignored = None
        if ignore_bounds is not None:
            # nonzero_static takes its size from the caller: no second sync.
            ignored = torch.nonzero_static(~valid, size=cut[-1] - cut[0]).squeeze(1)
        return cls(flat, valid, count, scale, ignored, cut, sizes[n_head:])

    def ignored_in(self, i: int, start: int) -> torch.Tensor:
        """Ignored rows of the i-th span of ``ignore_bounds``, relative to ``start`` (no sync)."""
        assert self.ignored is not None
        return self.ignored[self.cut[i] - self.cut[0] : self.cut[i + 1] - self.cut[0]] - start


def _finish_loss(loss_sum: torch.Tensor, fin: Finish, run: _Pass) -> torch.Tensor:
    """k·(Σ_c L_c + L_finish), summed in float64."""
    return (loss_sum.double() + fin.extra_loss.double()) * run.scale.double()


#: (name, dtype) of each component packed by :func:`_forward_outputs`, in order.
_Names = list[tuple[str, torch.dtype]]


def _forward_outputs(
    ctx: Any,
    grads: tuple[Any, ...],
    inplace_backward: bool,
    loss: torch.Tensor,
    fin: Finish,
    names: _Names,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What both drivers' Functions keep in forward and return: the gradients computed there
    (handed over in backward, in place unless ``inplace_backward`` is False), then the loss and
    the components as one float64 vector, a non-differentiable output (their names and dtypes
    appended to ``names``, for :func:`_loss_output`)."""
    ctx.grads = grads
    ctx.inplace_backward = inplace_backward
    names.extend((k, v.dtype) for k, v in fin.components.items())
    values = [v.detach().double().reshape(()) for v in fin.components.values()]
    packed = torch.stack(values) if values else loss.new_zeros(0, dtype=torch.float64)
    ctx.mark_non_differentiable(packed)
    return loss, packed


def _loss_output(
    objective: ChunkObjective,
    labels: torch.Tensor,
    ignore_index: int,
    apply: Callable[[_Names], tuple[torch.Tensor, torch.Tensor]] | None,
    values: Callable[[], tuple[torch.Tensor, Finish]],
) -> LossOutput:
    """A driver's LossOutput: from its autograd Function when a gradient is wanted
    (``apply(names)``: the loss and the packed components of :func:`_forward_outputs`), else
    from its pass under ``no_grad`` (``values()``: the loss and the Finish); with the
    objective's predicted tokens (:func:`predicted_tokens`)."""
    if apply is not None:
        names: _Names = []
        loss, packed = apply(names)
        # Components travel packed as float64 (one non-differentiable output); restore dtypes.
        components = {k: v.to(dt) for (k, dt), v in zip(names, packed.unbind(0), strict=True)}
    else:
        with torch.no_grad():
            loss, fin = values()
        components = {k: v.detach() for k, v in fin.components.items()}
    predicted = predicted_tokens(objective, labels, ignore_index)
    return LossOutput(loss=loss, components=components, predicted_tokens=predicted)


# ----------------------------------------------------------------------------------------------
# From hidden states
# ----------------------------------------------------------------------------------------------


def _add_sparse(
    sparse: SparseLogitGrad,
    h2: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    options: HeadOptions,
    grads: tuple[Any, Any, Any],
) -> None:
    """Add the after-pass term's gradient through the head, on the kept logits only.

    The [M, K] gradient is made dense over the U distinct ids it touches (G [M, U]), so the
    work is two small matmuls, G W_U and Gᵀ h_M, instead of an [M, K, H] gather.
    """
    grad_h, grad_w, grad_b = grads
    if sparse.rows.numel() == 0:
        return
    cdtype = grad_w.dtype if grad_w is not None else compute_dtype(h2.dtype)
    g = sparse.grad.to(torch.float64) * scale.to(torch.float64)  # [M, K]
    if options.logit_scale is not None:
        g = g * options.logit_scale
    if options.softcap is not None:
        g = g * (1.0 - (sparse.logits.double() / options.softcap) ** 2)
    if sparse.columns is not None:  # given by the objective: no host sync
        uniq, col = sparse.columns()  # [U], [M, K]
    else:
        uniq, col = torch.unique(sparse.ids, return_inverse=True)  # [U], [M, K] (one host sync)
    rows_mk = torch.arange(g.shape[0], device=g.device)[:, None].expand_as(col)
    dense = torch.zeros((g.shape[0], uniq.numel()), dtype=torch.float64, device=g.device)
    dense.index_put_((rows_mk, col), g, accumulate=True)  # [M, U]
    dense = dense.to(cdtype)
    h_m = h2[sparse.rows].to(cdtype)  # [M, H]
    if grad_h is not None:
        contrib = dense @ weight[uniq].to(cdtype)  # [M, H]
        grad_h.index_add_(0, sparse.rows, contrib.to(grad_h.dtype))
    if grad_w is not None:
        grad_w.index_add_(0, uniq, (dense.T @ h_m).to(grad_w.dtype))  # [U, H]
    if grad_b is not None:
        grad_b.index_add_(0, uniq, dense.sum(0).to(grad_b.dtype))


def _engine_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    objective: ChunkObjective,
    options: HeadOptions,
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, Finish, tuple[Any, Any, Any]]:
    """The chunk loop from hidden states. Returns the reduced loss, the objective's Finish and
    the gradients (hidden, weight, bias), None where not needed."""
    need_h, need_w, need_b = need
    want_grad = need_h or need_w or need_b
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    cdtype = compute_dtype(hidden.dtype)
    n_rows, vocab = h2.shape[0], weight.shape[0]
    chunk = options.chunk_size or default_chunk_rows(vocab)
    rows = max(1, min(chunk, n_rows))
    starts = list(range(0, n_rows, chunk))
    bounds = [*starts, n_rows]
    run = _Pass.of(labels, options, cdtype, vocab, objective, bounds, bounds if want_grad else None)
    acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    grad_h = torch.zeros_like(h2) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
    grad_b = (
        torch.zeros(weight.shape[:1], dtype=acc_dtype, device=weight.device) if need_b else None
    )
    # k·s folded into the objective's gradient (a multiplier it applies anyway): no extra pass.
    grad_scale = None
    if want_grad:
        grad_scale = run.scale * (options.logit_scale or 1.0)
    # Buffers reused by every chunk: the head output (input dtype), its compute-dtype copy
    # (half precision only) and tanh (soft-cap only).
    raw_buf = torch.empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
    staged_buf = None if hidden.dtype == cdtype else torch.empty_like(raw_buf, dtype=cdtype)
    tanh_buf = None if options.softcap is None else torch.empty_like(raw_buf, dtype=cdtype)
    loss_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
    stats = torch.zeros(objective.n_stats, dtype=cdtype, device=hidden.device)
    objective.begin(starts, n_rows, run.objective_sizes)
    for i, lo in enumerate(starts):
        hi = min(lo + chunk, n_rows)
        n = hi - lo
        valid_c = run.valid[lo:hi]
        # Ignored rows' hidden states are zeroed ([n, H], small): a NaN / inf there (padding)
        # then never reaches z, tanh or gᵀh, and their exact-0 gradient stays 0.
        h_c = torch.where(valid_c[:, None], h2[lo:hi], 0.0)  # [n, H]
        tanh_c = None if tanh_buf is None else tanh_buf[:n]
        staged = None if staged_buf is None else staged_buf[:n]
        z = head_chunk_logits(h_c, weight, bias, raw_buf[:n], staged, tanh_c, options)
        out = objective.chunk(z, z, run.labels[lo:hi], valid_c, lo, grad_scale)
        loss_sum = loss_sum + out.loss
        stats = stats + out.stats
        if out.grad is None:
            continue
        g = out.grad.index_fill_(0, run.ignored_in(i, lo), 0.0)  # [n, V] k·s·dL/dz
        if not out.scaled:
            g.mul_(grad_scale)
        if tanh_c is not None:  # d(cap·tanh(r/cap))/dr = 1 − tanh²
            g.mul_(tanh_c.square_().neg_().add_(1.0))
        g_d = g if g.dtype == hidden.dtype else raw_buf[:n].copy_(g)  # as the head's backward
        if grad_h is not None:
            torch.mm(g_d, weight, out=grad_h[lo:hi])
        if grad_w is not None:
            if grad_w.dtype == g_d.dtype:
                grad_w.addmm_(g_d.T, h_c)
            else:
                grad_w.add_(g_d.T @ h_c)
        if grad_b is not None:
            grad_b.add_(g.sum(0))
    fin = objective.finish(stats, run.count, want_grad)
    total = _finish_loss(loss_sum, fin, run)
    if want_grad and fin.sparse is not None:
        _add_sparse(fin.sparse, h2, weight, run.scale, options, (grad_h, grad_w, grad_b))
    grads = (
        None if grad_h is None else grad_h.view(hidden.shape),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(weight.dtype),
    )
    return total.to(cdtype), fin, grads


class ChunkedLinearLossFunction(torch.autograd.Function):
    """(hidden, weight, bias) -> (loss, packed components); gradients computed in forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        objective: ChunkObjective,
        options: HeadOptions,
        inplace_backward: bool,
        names: _Names,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])  # hidden, weight, bias
        loss, fin, grads = _engine_forward(
            hidden, weight, bias, labels, objective, options, need  # type: ignore[arg-type]
        )
        return _forward_outputs(ctx, grads, inplace_backward, loss, fin, names)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        out = hand_over_gradients(ctx, "grads", grad_loss, "ChunkedLinearLossFunction")
        # hidden, weight, bias, then: labels, objective, options, inplace_backward, names
        return (*out, None, None, None, None, None)


@eager_under_compile
def chunked_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    objective: ChunkObjective,
    options: HeadOptions | None = None,
    *,
    inplace_backward: bool = True,
) -> LossOutput:
    """Loss of the LM head ``z = cap·tanh(s·(hidden Wᵀ + b)/cap)`` without [N, V] logits.

    Args:
        hidden: [..., H] final hidden states (float32 / float64 / bf16 / fp16; the head matmul
            runs in this dtype, the objective in float32, float64 for float64 inputs).
        weight: [V, H] LM-head weight, same dtype as hidden.
        bias: optional [V] head bias.
        labels: [...] labels aligned with hidden (no shift inside).
        objective: the per-chunk function (:class:`ChunkObjective`), fresh for this call.
        options: :class:`HeadOptions` (reduction, ignore_index, chunk size, scale, soft-cap).
        inplace_backward: scale the kept gradients in place in backward and hand them over
            (one backward only); False keeps them for another backward (e.g. gradcheck).

    Returns:
        LossOutput with the loss (0-d, compute dtype), the objective's components and its
        predicted tokens (:meth:`ChunkObjective.predicted`, labels' shape) when it gives them.
    """
    options = options or HeadOptions()
    check_head_options(options)
    # Label range: checked in the driver's one host sync (before any gradient is computed).
    check_linear_inputs(hidden, weight, labels, bias, options.ignore_index, check_range=False)
    labels = labels.to(hidden.device)
    wants_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    return _loss_output(
        objective,
        labels,
        options.ignore_index,
        (lambda names: ChunkedLinearLossFunction.apply(
            hidden, weight, bias, labels, objective, options, inplace_backward, names
        )) if wants_grad else None,
        lambda: _engine_forward(hidden, weight, bias, labels, objective, options, (False,) * 3)[:2],
    )


# ----------------------------------------------------------------------------------------------
# From given logits
# ----------------------------------------------------------------------------------------------


def _logits_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    objective: ChunkObjective,
    options: HeadOptions,
    want_grad: bool,
) -> tuple[torch.Tensor, Finish, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop over given logits. Returns the reduced loss, the objective's Finish, the
    [N, V] gradient buffer (logits' dtype) or None, and the multiplier k still to apply to the
    buffer in backward (None when every chunk's gradient came scaled)."""
    vocab = logits.shape[-1]
    device = logits.device
    cdtype = compute_dtype(logits.dtype)
    n_rows = labels.numel()
    chunk = options.chunk_size or default_chunk_rows(vocab)
    chunks = list(row_chunks(logits, chunk))  # views: a sliced [B, T-1, V] is never copied
    starts = [lo for lo, _, _ in chunks]
    ignore_bounds = [0, n_rows] if want_grad else None
    run = _Pass.of(labels, options, cdtype, vocab, objective, [*starts, n_rows], ignore_bounds)
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=device) if want_grad else None
    # The objective works in the gradient buffer itself when it has the compute dtype;
    # otherwise in one staging buffer, cast into the buffer after each chunk.
    direct = grad is not None and grad.dtype == cdtype
    rows = max((hi - lo for lo, hi, _ in chunks), default=1)
    staged = None if direct else torch.empty((rows, vocab), dtype=cdtype, device=device)
    grad_scale = run.scale if want_grad else None
    loss_sum = torch.zeros((), dtype=cdtype, device=device)
    stats = torch.zeros(objective.n_stats, dtype=cdtype, device=device)
    unscaled: list[tuple[int, int]] = []  # chunks whose gradient still lacks k
    objective.begin(starts, n_rows, run.objective_sizes)
    for lo, hi, z in chunks:
        out = grad[lo:hi] if direct else staged[: hi - lo]  # type: ignore[index]
        res = objective.chunk(z, out, run.labels[lo:hi], run.valid[lo:hi], lo, grad_scale)
        loss_sum = loss_sum + res.loss
        stats = stats + res.stats
        if grad is None or res.grad is None:
            continue
        if res.grad.data_ptr() != grad[lo].data_ptr():
            grad[lo:hi].copy_(res.grad)
        if not res.scaled:
            unscaled.append((lo, hi))
    fin = objective.finish(stats, run.count, want_grad)
    total = _finish_loss(loss_sum, fin, run)
    later = None
    if grad is not None:
        # k is applied in backward with grad_output (one pass) when no chunk applied it.
        if unscaled and len(unscaled) == len(chunks):
            later = run.scale
        else:
            for lo, hi in unscaled:
                grad[lo:hi].mul_(run.scale.to(grad.dtype))
        grad.index_fill_(0, run.ignored_in(0, 0), 0.0)  # exact 0 there, whatever the logits held
        sparse = fin.sparse
        if sparse is not None and sparse.rows.numel():
            rows_mk = sparse.rows[:, None].expand_as(sparse.ids)  # [M, K]
            g = sparse.grad.double()
            if later is None:
                g = g * run.scale.double()
            grad.index_put_((rows_mk, sparse.ids), g.to(grad.dtype), accumulate=True)
    return total.to(cdtype), fin, grad, later


def _grad_output_is_one(factor: torch.Tensor) -> bool:
    """Whether backward may skip scaling the [N, V] gradient buffer by ``factor`` (0-d).

    Only where reading the value is free: a CPU tensor, where a factor of exactly 1 (a plain
    ``loss.backward()``) then saves one pass over the buffer. A value on an accelerator is never
    read: that read is a host sync in the middle of backward, stalling the host until every
    queued kernel has run, and costs more than the one elementwise pass it could save (which a
    loss divided by a token count, grad_output = 1/n, never skips anyway).
    """
    return factor.device.type == "cpu" and bool(factor == 1)


class ChunkedLogitsLossFunction(torch.autograd.Function):
    """(logits) -> (loss, packed components); the [N, V] gradient computed in forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        objective: ChunkObjective,
        options: HeadOptions,
        inplace_backward: bool,
        names: _Names,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, fin, grad, later = _logits_forward(logits, labels, objective, options, True)
        ctx.later = later
        grads = (grad.view(logits.shape),)  # type: ignore[union-attr]
        return _forward_outputs(ctx, grads, inplace_backward, loss, fin, names)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        factor = grad_loss if ctx.later is None else grad_loss * ctx.later
        skip = ctx.inplace_backward and _grad_output_is_one(factor)
        (grad,) = hand_over_gradients(
            ctx, "grads", None if skip else factor, "ChunkedLogitsLossFunction"
        )
        # logits, then: labels, objective, options, inplace_backward, names
        return grad, None, None, None, None, None


@eager_under_compile
def chunked_logits_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    objective: ChunkObjective,
    options: HeadOptions | None = None,
    *,
    inplace_backward: bool = True,
) -> LossOutput:
    """Loss of given logits, chunk by chunk, with one [N, V] gradient buffer.

    Args:
        logits: [..., V] any float dtype and strides (a sliced view such as ``logits[:, :-1]``
            is read chunk by chunk, never copied whole); the objective runs in float32 (float64
            for float64 logits).
        labels: [...] labels aligned with the logits (no shift inside).
        objective: the per-chunk function (:class:`ChunkObjective`), fresh for this call.
        options: :class:`HeadOptions` (reduction, ignore_index, chunk size; no scale / cap:
            the logits are taken as given).
        inplace_backward: scale the gradient buffer in place in backward and hand it over
            (one backward only); False keeps it for another backward (e.g. gradcheck).

    Returns:
        LossOutput with the loss (0-d, compute dtype), the objective's components and its
        predicted tokens (:meth:`ChunkObjective.predicted`, labels' shape) when it gives them.
    """
    options = options or HeadOptions()
    check_head_options(options)
    if options.logit_scale is not None or options.softcap is not None:
        raise ValueError(
            "logit_scale / softcap apply to the head from hidden states (chunked_linear_loss); "
            "given logits are scored as they are"
        )
    # Label range: checked in the driver's one host sync (before any gradient is computed).
    check_logits_labels_shapes(logits, labels)
    labels = labels.to(logits.device)
    wants_grad = torch.is_grad_enabled() and logits.requires_grad
    return _loss_output(
        objective,
        labels,
        options.ignore_index,
        (lambda names: ChunkedLogitsLossFunction.apply(
            logits, labels, objective, options, inplace_backward, names
        )) if wants_grad else None,
        lambda: _logits_forward(logits, labels, objective, options, False)[:2],
    )



__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "ChunkObjective",
    "ChunkOut",
    "ChunkedLinearLossFunction",
    "ChunkedLogitsLossFunction",
    "Finish",
    "HeadOptions",
    "SparseLogitGrad",
    "check_linear_inputs",
    "chunked_linear_loss",
    "chunked_logits_loss",
    "count_divisor",
    "counts_before",
    "default_chunk_rows",
    "head_logits",
    "predicted_tokens",
    "stand_in_logits",
]
