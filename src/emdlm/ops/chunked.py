"""One chunked-loss engine: any objective from hidden states, no [N, V] logits ever alive.

Per chunk of rows c (the scheme of Liger-Kernel's chunked-loss base class and of
:mod:`emdlm.ops.fused_linear_emo`), in forward:

    r_c = h_c Wᵀ + b                        [n, V]  head output, input dtype (as the unfused head)
    z_c = cap·tanh(s·r_c / cap)             [n, V]  compute dtype; scale s and soft-cap optional
    (L_c, g_c) = objective.chunk(z_c, y_c)          summed loss, g_c = dL_c/dz_c (0 on ignored rows)
    g'_c = k · g_c · s·(1 − (z_c/cap)²)             k = 1/n_counted ("mean") or 1 ("sum")
    grad_h_c = g'_c W,   grad_W += g'_cᵀ h_c,   grad_b += Σ_rows g'_c

After the pass the objective may add a term that depends only on a few logits it kept
(NTIL: the [M, K] class-candidate logits of the number positions) and on the pass's sums
(the global CE mean): ``objective.finish`` returns its loss and its sparse gradient
G[m, k] = dL/dz[rows[m], ids[m, k]], which is added without a second pass over the vocabulary:

    grad_h[rows[m]] += Σ_k G'[m, k]·W[ids[m, k]],   grad_W[ids[m, k]] += G'[m, k]·h[rows[m]],
    grad_b[ids[m, k]] += G'[m, k]                    (G' = k·G·s·(1 − (z/cap)²))

The loss is k·(Σ_c L_c + L_finish). backward multiplies the kept gradients by grad_output and
hands them over (:mod:`emdlm.ops._handover`), so the graph is back-propagated once unless
``inplace_backward=False``.

Memory beyond the inputs and their gradients: one [n, V] buffer of the head output (input
dtype; the CE family computes its softmax and gradient in it, in place), one float32 copy of it
for half-precision inputs, one more with a soft-cap, EMO's q buffer, and a float32 [V, H]
accumulator for grad_W when the weight is bf16/fp16 (grad_W accumulated in half precision would
be rounded once per chunk). Default chunk: ``DEFAULT_CHUNK_ELEMENTS // V`` rows (2^26 elements =
256 MiB of float32 per buffer; 441 rows at V = 151936, 2097 at V = 32000). At N = 4096,
V = 151936 the float32 logits are 2.49 GB and one buffer is 10.8 % of them (≤ 1/8).
Why not smaller: every chunk adds g_cᵀ h_c to the whole [V, H] grad_W, a pass over 545 MB at
Qwen's vocabulary, so small chunks are memory-bound on CPU (N = 1024, V = 151936, 2 threads,
fwd+bwd vs the full-logits CE: 1.32x at 110 rows, 1.21x at 220, 0.97x at 512; see
docs/results/bench_from_hidden_cpu.md). Pass ``chunk_size`` to trade time for memory.

Shape notation: N rows (all leading dims of hidden), n rows in a chunk, H hidden size,
V vocabulary, M kept positions, K kept logits per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, check_reduction, compute_dtype
from emdlm.ops._compile import eager_under_compile
from emdlm.ops._handover import hand_over_gradients
from emdlm.ops.fused_linear_emo import _check_linear_inputs

#: Elements (V x rows) of one chunk buffer by default: 256 MiB of float32 (module docstring).
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(vocab: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one [rows, V] buffer holds about ``chunk_elements`` values."""
    return max(1, chunk_elements // max(vocab, 1))


@dataclass
class ChunkOut:
    """What an objective returns for one chunk.

    Attributes:
        loss: 0-d summed loss of the chunk's counted rows (compute dtype, no reduction).
        grad: [n, V] d(loss)/d(z_c) in the compute dtype, exactly 0 on ignored rows (may be
            z_c's own storage, overwritten); None when no gradient was asked for.
        stats: [S] sums the objective wants back in ``finish`` (compute dtype).
    """

    loss: torch.Tensor
    grad: torch.Tensor | None
    stats: torch.Tensor


@dataclass
class SparseLogitGrad:
    """Gradient of the after-pass term w.r.t. a few logits z[rows[m], ids[m, k]].

    Attributes:
        rows: [M] long flattened positions.
        ids: [M, K] long vocabulary ids (padding columns must carry grad 0).
        grad: [M, K] d(term)/dz, unreduced (sum units, as ``ChunkOut.grad``).
        logits: [M, K] the (scaled, capped) logits z at those places (for the soft-cap chain).
    """

    rows: torch.Tensor
    ids: torch.Tensor
    grad: torch.Tensor
    logits: torch.Tensor


@dataclass
class Finish:
    """What an objective returns after the pass.

    Attributes:
        extra_loss: 0-d loss added to Σ_c L_c before the reduction (sum units).
        sparse: the extra loss's gradient on a few logits, or None.
        components: detached diagnostics for the :class:`LossOutput`.
    """

    extra_loss: torch.Tensor
    sparse: SparseLogitGrad | None
    components: dict[str, torch.Tensor] = field(default_factory=dict)


class ChunkObjective:
    """Base of the per-chunk functions plugged into :func:`chunked_linear_loss`.

    Subclasses implement :meth:`chunk`; :meth:`begin` and :meth:`finish` are optional hooks.
    An objective instance serves one call (it may keep state between chunks).
    """

    #: Number of summed statistics returned per chunk (length of ``ChunkOut.stats``).
    n_stats: int = 1

    def begin(self, n_rows: int, chunk_rows: int) -> None:
        """Called once before the first chunk (N rows, ``chunk_rows`` per chunk)."""

    def chunk(
        self,
        z: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        want_grad: bool,
    ) -> ChunkOut:
        """Loss and gradient of rows [start, start + n): z [n, V] (owned, may be overwritten),
        labels [n] long, valid [n] bool."""
        raise NotImplementedError

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        """After the pass: ``stats`` [S] summed over chunks, ``count`` counted labels (0-d)."""
        return Finish(extra_loss=stats.new_zeros(()), sparse=None)


@dataclass(frozen=True)
class HeadOptions:
    """Options of the head and of the loop.

    Attributes:
        ignore_index: label value that is not scored.
        reduction: "mean" over counted labels or "sum".
        chunk_size: rows per chunk (None: :func:`default_chunk_rows`).
        logit_scale: s, z = s·(hWᵀ + b) (e.g. Cohere's ``logit_scale``); None = 1.
        softcap: cap, z = cap·tanh(z / cap) (Gemma-2's ``final_logit_softcapping``); None = off.
    """

    ignore_index: int = IGNORE_INDEX
    reduction: Reduction = "mean"
    chunk_size: int | None = None
    logit_scale: float | None = None
    softcap: float | None = None


def check_head_options(options: HeadOptions) -> None:
    """Clear errors for bad head options."""
    check_reduction(options.reduction)
    if options.chunk_size is not None and (
        not isinstance(options.chunk_size, int) or options.chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {options.chunk_size!r}")
    for name in ("logit_scale", "softcap"):
        value = getattr(options, name)
        if value is not None and not (0 < float(value) < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")


def _head_chunk(
    h_c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    raw: torch.Tensor,
    staged: torch.Tensor | None,
    tanh_buf: torch.Tensor | None,
    options: HeadOptions,
) -> torch.Tensor:
    """z_c = cap·tanh(s·(h_c Wᵀ + b)/cap) in the compute dtype; tanh kept in ``tanh_buf``."""
    if bias is None:
        torch.mm(h_c, weight.T, out=raw)  # [n, V]
    else:
        torch.addmm(bias, h_c, weight.T, out=raw)
    z = raw if staged is None else staged.copy_(raw)  # [n, V] compute dtype
    if options.logit_scale is not None:
        z.mul_(options.logit_scale)
    if tanh_buf is not None:
        cap = float(options.softcap)  # type: ignore[arg-type]
        torch.tanh(torch.div(z, cap, out=tanh_buf), out=tanh_buf)
        torch.mul(tanh_buf, cap, out=z)
    return z


def _chain_head(
    g: torch.Tensor, scale: torch.Tensor, tanh: torch.Tensor | None, options: HeadOptions
) -> torch.Tensor:
    """g · k · s · (1 − tanh²) in place: the gradient w.r.t. the raw head output."""
    g.mul_(scale)
    if options.logit_scale is not None:
        g.mul_(options.logit_scale)
    if tanh is not None:
        g.mul_(tanh.square_().neg_().add_(1.0))
    return g


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
    """The chunk loop. Returns the reduced loss, the objective's Finish and the gradients."""
    need_h, need_w, need_b = need
    want_grad = need_h or need_w or need_b
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_labels = labels.reshape(-1).long()  # [N]
    valid = flat_labels != options.ignore_index  # [N]
    cdtype = compute_dtype(hidden.dtype)
    count = valid.sum()
    scale = (
        1.0 / count.clamp_min(1).to(cdtype)
        if options.reduction == "mean"
        else torch.ones((), dtype=cdtype, device=hidden.device)
    )
    n_rows, vocab = h2.shape[0], weight.shape[0]
    chunk = options.chunk_size or default_chunk_rows(vocab)
    rows = max(1, min(chunk, n_rows))
    acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    grad_h = torch.zeros_like(h2) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
    grad_b = (
        torch.zeros(weight.shape[:1], dtype=acc_dtype, device=weight.device) if need_b else None
    )
    # Buffers reused by every chunk: the head output (input dtype), its compute-dtype copy
    # (half precision only) and tanh (soft-cap only).
    raw_buf = torch.empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
    staged_buf = None if hidden.dtype == cdtype else torch.empty_like(raw_buf, dtype=cdtype)
    tanh_buf = None if options.softcap is None else torch.empty_like(raw_buf, dtype=cdtype)
    loss_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
    stats = torch.zeros(objective.n_stats, dtype=cdtype, device=hidden.device)
    objective.begin(n_rows, chunk)
    for lo in range(0, n_rows, chunk):
        hi = min(lo + chunk, n_rows)
        n = hi - lo
        valid_c = valid[lo:hi]
        # Ignored rows' hidden states are zeroed ([n, H], small): a NaN / inf there (padding)
        # then never reaches z, tanh or gᵀh, and their exact-0 gradient stays 0.
        h_c = torch.where(valid_c[:, None], h2[lo:hi], 0.0)  # [n, H]
        tanh_c = None if tanh_buf is None else tanh_buf[:n]
        staged = None if staged_buf is None else staged_buf[:n]
        z = _head_chunk(h_c, weight, bias, raw_buf[:n], staged, tanh_c, options)
        out = objective.chunk(z, flat_labels[lo:hi], valid_c, lo, want_grad)
        loss_sum = loss_sum + out.loss
        stats = stats + out.stats
        if out.grad is None:
            continue
        g = _chain_head(out.grad, scale, tanh_c, options)
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
    fin = objective.finish(stats, count, want_grad)
    total = (loss_sum.double() + fin.extra_loss.double()) * scale.double()
    if want_grad and fin.sparse is not None:
        _add_sparse(fin.sparse, h2, weight, scale, options, (grad_h, grad_w, grad_b))
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
        names: list[tuple[str, torch.dtype]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])  # hidden, weight, bias
        loss, fin, grads = _engine_forward(
            hidden,
            weight,
            bias,
            labels,
            objective,
            options,
            need,  # type: ignore[arg-type]
        )
        ctx.grads = grads
        ctx.inplace_backward = inplace_backward
        names.extend((k, v.dtype) for k, v in fin.components.items())
        values = [v.detach().double().reshape(()) for v in fin.components.values()]
        packed = torch.stack(values) if values else loss.new_zeros(0, dtype=torch.float64)
        ctx.mark_non_differentiable(packed)
        return loss, packed

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
        LossOutput with the loss (0-d, compute dtype) and the objective's components.
    """
    options = options or HeadOptions()
    check_head_options(options)
    _check_linear_inputs(hidden, weight, labels, bias, options.ignore_index, 1)
    labels = labels.to(hidden.device)
    wants_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if wants_grad:
        names: list[tuple[str, torch.dtype]] = []
        loss, packed = ChunkedLinearLossFunction.apply(
            hidden, weight, bias, labels, objective, options, inplace_backward, names
        )
        # Components travel packed as float64 (one non-differentiable output); restore dtypes.
        components = {k: v.to(dt) for (k, dt), v in zip(names, packed.unbind(0), strict=True)}
    else:
        with torch.no_grad():
            loss, fin, _ = _engine_forward(
                hidden, weight, bias, labels, objective, options, (False, False, False)
            )
        components = {k: v.detach() for k, v in fin.components.items()}
    return LossOutput(loss=loss, components=components)


__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "ChunkObjective",
    "ChunkOut",
    "ChunkedLinearLossFunction",
    "Finish",
    "HeadOptions",
    "SparseLogitGrad",
    "chunked_linear_loss",
    "default_chunk_rows",
]
