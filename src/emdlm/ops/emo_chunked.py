"""Chunked EMO (CE + DEMD) on given logits: a user of the chunked-loss engine.

Per position t (EMO, ICLR 2024, Eq. 14 and Eq. 19; GUIDE §1.4):

    q_t = softmax(z_t)   (float32)      CE_t = -log q_t(y_t)
    DEMD_t = 1 - (Êᵀ q_t) · ê_{y_t} = 1 - Σ_v q_tv · S_{y_t v},   S = Ê Êᵀ (rows gathered)

    emo1:   L_t = 0.5 · (CE_t + sg(CE_t / DEMD_t) · DEMD_t)      (Eq. 19, official code)
    emo2:   L_t = DEMD_t + sg(DEMD_t / CE_t) · CE_t              (the emoloss package's mode 2)
    static: L_t = CE_t + mu · DEMD_t

reduced over the counted tokens (mean or sum). sg(·) is a stop-gradient. Ratios use the official
guard, CE / (max(DEMD, 0) + 1e-10) and DEMD / (CE + 1e-10): finite everywhere, and a term whose
value is 0 (DEMD = 0, or CE = 0) adds 0 to the loss. Same semantics as the reference
``emdlm.functional.emo.emo_loss`` (including its ``max_ratio`` cap of emo1's ratio).

Design (why this shape): the per-chunk function is :class:`emdlm.ops.from_hidden.EMOObjective`
(the one EMO from hidden states uses), run by :func:`emdlm.ops.chunked.chunked_logits_loss`:
- The gradient w.r.t. the logits is written into one buffer during forward, chunk by chunk,
  the way Liger-Kernel's fused cross-entropy does: ``a·(q - onehot) - b·q ⊙ (s - q·s)`` with
  s = S_{y,:} and detached per-token coefficients (a, b) from the mode. S is then computed once and
  used twice (for DEMD's value and for its gradient): one ``[n, d'] × [d', V]`` matmul per chunk,
  where recomputing in backward would need two. The buffer (logits' dtype, [N, V]) takes the
  place of what plain autograd keeps for CE alone (the saved log-softmax, then the gradient), so
  the only scratch beyond it is O(chunk·V): for float32 logits q lives in the buffer itself and
  one [chunk, V] scratch holds S. Scratch is allocated once per call and reused by every chunk
  (on CPU, fresh large tensors cost page faults comparable to an elementwise pass).
- Backward scales the buffer in place by grad_output (skipped when grad_output is exactly 1 and
  on the CPU, where reading it is free; never read on an accelerator: no host sync in backward)
  and hands it over (no copy). Backward can
  therefore run once per forward: a second call (``retain_graph=True``) raises a clear error
  unless ``inplace_backward=False`` (which multiplies out of place: one more [N, V] tensor).
- No gradient flows into the cost embedding: EMO's Ê is a frozen copy (Sec. 3.2).

Shape notation: N positions (all leading dims of the logits), V vocabulary, d' cost width.
"""

from __future__ import annotations

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels_shapes,
    compute_dtype,
)
from emdlm.ops._chunking import (
    EMOMode,
    check_chunk_size,
    check_cost_embedding,
    check_mode,
    prepare_cost,
)
from emdlm.ops._compile import eager_under_compile
from emdlm.ops.chunked import HeadOptions, chunked_logits_loss
from emdlm.ops.from_hidden import EMOObjective


def _check_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding: torch.Tensor,
    mode: str,
    reduction: str,
    ignore_index: int,
    chunk_size: int,
    mu: float = 1.0,
    max_ratio: float | None = None,
) -> None:
    check_mode(mode, reduction, mu, max_ratio)
    check_chunk_size(chunk_size)
    check_logits_labels_shapes(logits, labels)  # label range: in the engine's one host sync
    check_cost_embedding(cost_embedding, logits.shape[-1], logits.device)


@eager_under_compile
def emo_loss_chunked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding: torch.Tensor,
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
    """EMO loss on logits, chunked over positions, equal to ``emdlm.functional.emo.emo_loss``.

    Args:
        logits: [..., V] any float dtype, any strides (a sliced view such as ``logits[:, :-1]`` is
            read chunk by chunk, never copied whole). Softmax and losses are taken in float32
            (float64 for float64 logits).
        labels: [...] integer labels aligned with the logits (no shift inside).
        cost_embedding: Ê [V, d'], the row-normalized cost embedding (see
            ``emdlm.functional.emo.normalize_cost_embedding``); frozen, must not require grad.
        mode: "emo1" (Eq. 19, official), "emo2" (emoloss mode 2) or "static" (CE + mu·DEMD).
        mu: DEMD weight of "static" (must stay 1.0 for the other modes, as in the reference).
        ignore_index: label value that is not scored.
        reduction: "mean" over counted tokens or "sum".
        chunk_size: positions per chunk; scratch is one [chunk_size, V] float32 buffer beyond
            the gradient buffer (two for half-precision logits).
        cost_dtype: dtype of the S = Ê[y]·Êᵀ matmul; None is exact (the compute dtype);
            torch.bfloat16 trades accuracy for speed where bf16 matmuls are fast (GPUs, AMX CPUs).
        max_ratio: optional cap of emo1's sg(CE/DEMD) (the emoloss package and DRSY/EMO's
            emo_patch.py use 3.0; the paper and DRSY/EMO's gpt2.py use none).
        inplace_backward: scale the gradient buffer in place in backward and hand it over (no
            extra [N, V] tensor); backward then runs once per forward and a second call raises.
            False allows ``retain_graph=True`` / repeated backward at the cost of one copy.

    Returns:
        LossOutput with loss (0-d, compute dtype) and components "ce" and "demd" (means over the
        counted tokens, detached) and "n_tokens".

    Example:
        >>> E = torch.nn.functional.normalize(torch.randn(11, 4), dim=-1)
        >>> y = torch.tensor([[1, 2, 3], [4, -100, 5]])
        >>> out = emo_loss_chunked(torch.randn(2, 3, 11), y, E)
        >>> out.loss.shape, int(out.components["n_tokens"])
        (torch.Size([]), 5)
    """
    _check_inputs(
        logits, labels, cost_embedding, mode, reduction, ignore_index, chunk_size, mu, max_ratio
    )
    cost = prepare_cost(cost_embedding, cost_dtype, compute_dtype(logits.dtype))
    options = HeadOptions(ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size)
    objective = EMOObjective(cost, mode, mu, max_ratio)
    return chunked_logits_loss(
        logits, labels, objective, options, inplace_backward=inplace_backward
    )


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
    """Per-token DEMD_t = 1 - Σ_v q_tv·(Ê[y_t]·Êᵀ)_v (EMO Eq. 14), 0 where ignored; no gradient.

    Returns a tensor of the labels' shape in the compute dtype (float32, or float64).
    """
    _check_inputs(logits, labels, cost_embedding, "static", "sum", ignore_index, chunk_size)
    cdtype = compute_dtype(logits.dtype)
    cost = prepare_cost(cost_embedding, cost_dtype, cdtype)
    out = torch.zeros(labels.numel(), dtype=cdtype, device=logits.device)
    objective = EMOObjective(cost, "static", 1.0, None, demd_out=out)
    options = HeadOptions(ignore_index=ignore_index, reduction="sum", chunk_size=chunk_size)
    chunked_logits_loss(logits, labels, objective, options)
    return out.view(labels.shape)
