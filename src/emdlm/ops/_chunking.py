"""EMO's per-chunk kernel (the chunked-loss engine's EMO objective) and shared chunk helpers.

One chunk is ``n`` positions with their ``[n, V]`` logits. For each chunk we compute, in float32
(float64 when the logits are float64):

    q = softmax(z)                      CE_t   = logsumexp(z_t) - z_t[y_t]
    s_t = Ê[y_t] · Êᵀ   ([n, V])        DEMD_t = 1 - Σ_v q_tv · s_tv            (EMO Eq. 14)

and, when asked, the gradient of the per-token loss ``a_t·CE_t + b_t·DEMD_t`` w.r.t. z_t:

    a_t·(q_t - onehot(y_t)) + b_t·(-q_t ⊙ (s_t - q_t·s_t))
      = q_t ⊙ (a_t + b_t·(q_t·s_t) - b_t·s_t) - a_t·onehot(y_t)

where the detached coefficients ``a``, ``b`` come from the mode (EMO Eq. 19 / the emoloss "mode
2" / a static mix). ``s_t`` is used twice (value and gradient), so one ``[n, d] × [d, V]`` matmul
per chunk is all the extra work EMO needs over CE.

Shape notation: N positions, n positions in a chunk, V vocabulary, d cost-embedding width,
H hidden size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from emdlm.functional.emo import EMOMode

# The official codes' guard: sg(CE / (DEMD + 1e-10)) and sg(DEMD / (CE + 1e-10)), with DEMD clamped
# at 0 first (as in emdlm.functional.emo.mix_emo): finite everywhere, and a term whose value is 0
# stays 0.
RATIO_EPS = 1e-10


@dataclass
class ChunkSums:
    """Running sums over counted tokens in the compute dtype (0-d tensors, no host sync)."""

    loss: torch.Tensor
    ce: torch.Tensor
    demd: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device, dtype: torch.dtype) -> ChunkSums:
        z = torch.zeros((), device=device, dtype=dtype)
        return cls(loss=z.clone(), ce=z.clone(), demd=z.clone())


def check_chunk_size(chunk_size: int) -> None:
    """ValueError unless ``chunk_size`` (rows per chunk) is a positive int."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_cost_embedding(
    cost_embedding: torch.Tensor, vocab: int, device: torch.device | None = None
) -> None:
    """Ê must be a floating [V, d'] matrix with one row per logit column, frozen, on ``device``."""
    if device is not None and cost_embedding.device != device:
        raise ValueError(
            f"cost_embedding is on {cost_embedding.device} but the model outputs are on {device}"
        )
    if not torch.is_floating_point(cost_embedding):
        raise TypeError(
            f"cost_embedding must be a floating-point tensor, got dtype {cost_embedding.dtype}"
        )
    if cost_embedding.dim() != 2 or cost_embedding.shape[0] != vocab:
        raise ValueError(
            f"cost_embedding must have shape [V, d'] with V = {vocab} (the logits' last dim), "
            f"got {tuple(cost_embedding.shape)}"
        )
    if cost_embedding.requires_grad:
        raise ValueError(
            "cost_embedding requires grad, but EMO's cost embedding is a frozen copy "
            "(EMO Sec. 3.2) and this path gives it no gradient: pass cost_embedding.detach()"
        )


def prepare_cost(
    cost_embedding: torch.Tensor, cost_dtype: torch.dtype | None, compute_dtype: torch.dtype
) -> torch.Tensor:
    """Cast Ê once to the dtype of the S matmul (default: the compute dtype, i.e. exact)."""
    dtype = compute_dtype if cost_dtype is None else cost_dtype
    if not dtype.is_floating_point:
        raise TypeError(f"cost_dtype must be a floating dtype, got {dtype}")
    return cost_embedding.detach().to(dtype).contiguous()


def mode_coefficients(
    ce: torch.Tensor,
    demd: torch.Tensor,
    valid: torch.Tensor,
    mode: EMOMode,
    mu: float,
    max_ratio: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached per-token coefficients (a, b) of CE and DEMD, and the per-token loss value.

    Same values as ``emdlm.functional.emo.mix_emo``:
    - emo1 (EMO Eq. 19, official): L = 0.5·(CE + r·DEMD), r = sg(CE / (max(DEMD, 0) + 1e-10)),
      clamped at ``max_ratio`` when given (the emoloss package uses 3.0).
    - emo2 (emoloss mode 2): L = DEMD + r·CE, r = sg(DEMD / (CE + 1e-10)).
    - static: L = CE + mu·DEMD.
    Ignored tokens get a = b = L = 0.
    """
    zero = torch.zeros((), dtype=ce.dtype, device=ce.device)
    if mode == "emo1":
        # DEMD is clamped at 0 (as mix_emo does): a rounding just below 0 must not be
        # multiplied by a ratio of ~CE/1e-10; the clamp's gradient is 0 there.
        nonneg = demd >= 0
        demd = demd.clamp_min(0.0)
        r = ce / (demd + RATIO_EPS)
        if max_ratio is not None:
            r = r.clamp_max(max_ratio)
        a = torch.full_like(ce, 0.5)
        b = torch.where(nonneg, 0.5 * r, 0.0)
        value = 0.5 * (ce + r * demd)
    elif mode == "emo2":
        r = demd / (ce + RATIO_EPS)
        a = r
        b = torch.ones_like(ce)
        value = demd + r * ce
    elif mode == "static":
        a = torch.ones_like(ce)
        b = torch.full_like(ce, float(mu))
        value = ce + mu * demd
    else:  # pragma: no cover - the loss checks the mode at construction (check_emo_options)
        raise ValueError(f"unknown mode {mode!r}")
    return (
        torch.where(valid, a, zero),
        torch.where(valid, b, zero),
        torch.where(valid, value, zero),
    )


def emo_chunk(
    z: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    cost: torch.Tensor,
    mode: EMOMode,
    mu: float,
    grad_scale: torch.Tensor | None,
    sums: ChunkSums,
    q_out: torch.Tensor,
    s_buf: torch.Tensor,
    *,
    max_ratio: float | None = None,
    demd_out: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Process one chunk: add its sums to ``sums``; return d(loss)/dz in ``q_out`` if asked.

    The per-chunk function of :class:`emdlm.ops.objectives.emo.EMOObjective` (the chunked-loss
    engine's EMO). The caller owns every [n, V] buffer, so a call allocates nothing of size V
    (on CPU a fresh large tensor costs page faults comparable to an elementwise pass; reusing
    buffers across chunks avoids them). Passes over [n, V]: log-softmax, exp, the S matmul,
    q⊙s, its row sum, and two for the gradient. Gradient rows of ignored labels are left to the
    caller (the engine's drivers zero them: q may be NaN there, from a NaN / ±inf logit at a
    padding position).

    Args:
        z: [n, V] logits of the chunk, any float dtype, any strides; read only.
        labels: [n] int64 labels (``ignore_index`` marks positions that are not scored).
        cost: [V, d'] Ê already cast to the matmul dtype.
        grad_scale: 0-d tensor multiplying the gradient (1/count for "mean", 1 for "sum"); None
            computes values only.
        q_out: [n, V] contiguous, compute dtype: receives q, then the gradient (for float32
            logits this can be the chunk's slice of the final gradient buffer).
        s_buf: [n, V] contiguous, compute dtype scratch. It may alias ``z`` (``z`` is consumed
            before ``s_buf`` is written).
        demd_out: optional [n] tensor that receives the per-token DEMD (0 where ignored).
        weights: optional [n] per-token weights w_t (0 where ignored): the token's loss, its
            CE and DEMD sums and its gradient are multiplied by w_t; the mix coefficients
            (a, b) are per token, a ratio of the token's own CE and DEMD, so w_t cancels in
            them (``demd_out`` stays unweighted).
    """
    cdtype = q_out.dtype
    valid = labels != ignore_index  # [n]
    y = torch.where(valid, labels, 0)[:, None]  # [n, 1] safe gather index
    if z.dtype != cdtype:  # stage a float32 copy (CPU log-softmax cannot upcast on the fly)
        z = s_buf.copy_(z)
    torch.ops.aten._log_softmax.out(z, 1, False, out=q_out)  # log q, [n, V]
    ce = -q_out.gather(1, y).squeeze(1)  # [n] CE_t = -log q_t(y_t)
    q = q_out.exp_()  # [n, V]

    gold = cost[y.squeeze(1)]  # [n, d'] ê_{y_t}
    # [n, V] S_{y_t v} = ê_{y_t} · ê_v; a reduced-precision Ê is multiplied, then upcast.
    exact = cost.dtype == cdtype
    s = torch.mm(gold, cost.T, out=s_buf) if exact else s_buf.copy_(gold @ cost.T)
    p = s.mul_(q)  # [n, V] q ⊙ s (s is not needed on its own again)
    qs = p.sum(dim=1)  # [n] Σ_v q_v s_v
    demd = 1.0 - qs  # [n] EMO Eq. 14 with a one-hot target
    a, b, value = mode_coefficients(ce, demd, valid, mode, mu, max_ratio)
    ce_c, demd_c = torch.where(valid, ce, 0.0), torch.where(valid, demd, 0.0)
    if demd_out is not None:
        demd_out.copy_(demd_c)
    if weights is not None:  # w_t·L_t (where: a NaN of an ignored row never meets its w = 0)
        value, ce_c, demd_c = value * weights, ce_c * weights, demd_c * weights
    sums.loss += value.sum()
    sums.ce += ce_c.sum()
    sums.demd += demd_c.sum()
    if grad_scale is None:
        return None

    # g = q ⊙ (a + b·(q·s) - b·s) - a·onehot(y) = c·q - b·(q ⊙ s) - a·onehot(y), c = a + b·(q·s)
    row_scale = grad_scale if weights is None else grad_scale * weights  # k or k·w_t
    a = a * row_scale
    b = b * row_scale
    g = q.mul_((a + b * qs)[:, None]).addcmul_(p, -b[:, None])
    return g.scatter_add_(1, y, -a[:, None])


def row_blocks(x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Split ``x [..., V]`` into 2-d ``[m, V]`` *views* covering consecutive flattened rows.

    A contiguous (or merely row-mergeable) tensor is one block; a sliced view such as
    ``logits[:, :-1]`` cannot be flattened without a copy, so it is walked one outer index at a
    time (a loop over batch rows, not tokens). Yields (first flattened row, view).
    """
    lead = tuple(x.shape[:-1])
    vocab = x.shape[-1]
    if x.numel() == 0:
        return
    for k in range(len(lead) + 1):
        inner_rows = math.prod(lead[k:])
        try:  # every outer index has the same strides, so testing the first one is enough
            x[(0,) * k].view(inner_rows, vocab)
        except RuntimeError:
            continue
        start = 0
        for idx in itertools.product(*(range(s) for s in lead[:k])):
            yield start, x[idx].view(inner_rows, vocab)
            start += inner_rows
        return


def row_chunks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Chunks of at most ``chunk_size`` rows of ``x [..., V]``: (start, end, [end - start, V])."""
    for base, block in row_blocks(x):
        for lo in range(0, block.shape[0], chunk_size):
            hi = min(lo + chunk_size, block.shape[0])
            yield base + lo, base + hi, block[lo:hi]
