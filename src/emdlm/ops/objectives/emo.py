"""EMO per chunk (:class:`EMOObjective`) for :mod:`emdlm.ops.chunked`, and the cost setup EMO and
EMO distillation share (:func:`emo_cost`).

Per position t (EMO, Ren et al., ICLR 2024, Eq. 14 and Eq. 19; DRSY/EMO):

    q_t = softmax(z_t)                  CE_t = -log q_t(y_t)
    DEMD_t = 1 - (Êᵀ q_t) · ê_{y_t} = 1 - Σ_v q_tv · S_{y_t v},   S = Ê Êᵀ (rows gathered)

    emo1:   L_t = 0.5 · (CE_t + sg(CE_t / DEMD_t) · DEMD_t)      (Eq. 19, official code)
    emo2:   L_t = DEMD_t + sg(DEMD_t / CE_t) · CE_t              (the emoloss package's mode 2)
    static: L_t = CE_t + mu · DEMD_t

sg(·) a stop-gradient; ratios use the official guard (:func:`emdlm.ops._chunking.
mode_coefficients`). Same values and gradients as the reference
:func:`emdlm.functional.emo.emo_loss`. The per-chunk work is :func:`emdlm.ops._chunking.
emo_chunk`: the gradient a·(q − onehot) − b·q ⊙ (s − q·s), s = S_{y,:}, is written during
forward with S computed once per chunk (one [n, d'] × [d', V] matmul) and used for the value and
the gradient. No gradient flows into Ê: EMO's cost embedding is a frozen copy (Sec. 3.2).

Shape notation: N positions, n positions in a chunk, V vocabulary, d' cost width.
"""

from __future__ import annotations

import torch

from emdlm.functional._common import IGNORE_INDEX, check_logits_labels_shapes, compute_dtype
from emdlm.ops._chunking import (
    ChunkSums,
    check_chunk_size,
    check_cost_embedding,
    emo_chunk,
    prepare_cost,
)
from emdlm.ops.chunk_objective import ChunkObjective, ChunkOut, Finish, count_divisor
from emdlm.ops.chunked import chunked_logits_loss
from emdlm.ops.head import HeadOptions


def emo_cost(
    cost_embedding: torch.Tensor,
    like: torch.Tensor,
    vocab: int,
    cost_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Ê [V, d'] checked against a head of ``vocab`` rows whose inputs are ``like`` (hidden
    states or logits: their device and dtype), and cast once for the S matmul (default: the
    compute dtype, exact; :func:`emdlm.ops._chunking.prepare_cost`)."""
    check_cost_embedding(cost_embedding, vocab, like.device)
    return prepare_cost(cost_embedding, cost_dtype, compute_dtype(like.dtype))


class EMOObjective(ChunkObjective):
    """EMO (ICLR 2024, Eq. 14 and 19) per chunk: :func:`emdlm.ops._chunking.emo_chunk` plugged
    into the engine; stats [Σ CE_t, Σ DEMD_t]. Run by both drivers: ``EMOLoss.from_hidden``
    (:func:`~emdlm.ops.chunked.chunked_linear_loss`) and ``EMOLoss``'s chunked logits path and
    :func:`demd_chunked` (:func:`~emdlm.ops.chunked.chunked_logits_loss`).

    Buffers: the driver's ``out`` and one [rows, V] scratch of the objective's own. From logits
    (z read only) q and then the gradient live in ``out`` (the gradient buffer itself for
    float32 logits) and S in the scratch; from hidden states z *is* ``out``, so z's storage
    takes S (the log-softmax consumes z first) and q / the gradient go to the scratch.

    Args:
        cost: [V, d'] row-normalized Ê already cast to the S-matmul dtype (:func:`emo_cost`).
        mode: "emo1", "emo2" or "static".
        mu: weight of DEMD for "static".
        max_ratio: cap of the emo1 ratio (None: no cap).
        demd_out: optional [N] tensor receiving the per-token DEMD (0 where ignored).

    Per-token weights w_t (:meth:`~emdlm.ops.chunk_objective.ChunkObjective.weigh_tokens`): the loss
    is Σ_t w_t·L_t ("sum") or Σ_t w_t·L_t / Σ_t w_t ("mean") over the counted tokens, and
    "ce" / "demd" are the same weighted means. The dynamic mix (emo1's sg(CE_t/DEMD_t), emo2's
    sg(DEMD_t/CE_t)) is a ratio of one token's own terms, so it is computed as without
    weights (w_t cancels in it) and w_t scales the token's whole L_t and its gradient.
    """

    n_stats = 2
    takes_token_weights = True

    def __init__(
        self,
        cost: torch.Tensor,
        mode: str,
        mu: float,
        max_ratio: float | None,
        demd_out: torch.Tensor | None = None,
    ) -> None:
        self.cost, self.mode, self.mu, self.max_ratio = cost, mode, mu, max_ratio
        self.demd_out = demd_out
        self.scratch: torch.Tensor | None = None

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        n = z.shape[0]
        if self.scratch is None or self.scratch.shape[0] < n:
            self.scratch = torch.empty_like(out)  # [rows, V], reused by every chunk
        extra = self.scratch[:n]
        q_buf, s_buf = (extra, out) if z is out else (out, extra)
        sums = ChunkSums.zeros(out.device, out.dtype)
        # labels of ignored rows are set to -1 so emo_chunk's own ignore test sees them.
        marked = torch.where(valid, labels, -1)
        g = emo_chunk(
            z,
            marked,
            -1,
            self.cost,
            self.mode,  # type: ignore[arg-type]
            self.mu,
            grad_scale,
            sums,
            q_buf,
            s_buf,
            max_ratio=self.max_ratio,
            demd_out=None if self.demd_out is None else self.demd_out[start : start + n],
            weights=self.chunk_weights(valid, start, out.dtype),
        )
        return ChunkOut(loss=sums.loss, grad=g, stats=torch.stack([sums.ce, sums.demd]))

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        self.scratch = None
        denom = count_divisor(count, stats.dtype)
        components = {"ce": stats[0] / denom, "demd": stats[1] / denom, "n_tokens": count}
        return Finish(extra_loss=stats.new_zeros(()), sparse=None, components=components)




@torch.no_grad()
def demd_chunked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = 1024,
    cost_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token DEMD_t = 1 - Σ_v q_tv·(Ê[y_t]·Êᵀ)_v (EMO Eq. 14), 0 where ignored; no gradient
    (a diagnostic, not a loss: :class:`EMOObjective` run for its ``demd_out``).

    Returns a tensor of the labels' shape in the compute dtype (float32, or float64).
    """
    check_chunk_size(chunk_size)
    check_logits_labels_shapes(logits, labels)  # label range: in the engine's one host sync
    cost = emo_cost(cost_embedding, logits, logits.shape[-1], cost_dtype)
    out = torch.zeros(labels.numel(), dtype=compute_dtype(logits.dtype), device=logits.device)
    objective = EMOObjective(cost, "static", 1.0, None, demd_out=out)
    options = HeadOptions(ignore_index=ignore_index, reduction="sum", chunk_size=chunk_size)
    chunked_logits_loss(logits, labels, objective, options)
    return out.view(labels.shape)


__all__ = ["EMOObjective", "demd_chunked", "emo_cost"]
