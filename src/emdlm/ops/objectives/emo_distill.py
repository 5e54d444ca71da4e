"""Distillation per chunk for :func:`emdlm.ops.chunked.chunked_logits_loss`: a dense teacher
target, O(chunk·V) scratch. :class:`EMODistillObjective` (EMO's DEMD to the teacher) and
:class:`KLDistillObjective` (the CE + KL baseline), both reading the teacher's rows chunk by
chunk as :class:`TeacherRowsObjective` does.

Same values and gradients as the reference :func:`emdlm.functional.emo_dense.emo_distill_loss`
(formulas and sources there; EMO, Ren et al., ICLR 2024, Eq. 15 and Eq. 19). Per position, with
q = softmax(z), p = softmax(u / τ) and w = C p = (Σp) - Ê (Êᵀ p):

    DEMD = Σ_i |q_i - p_i| · w_i            d DEMD / d q_i = sign(q_i - p_i) · w_i =: g_i

(sign(0) = 0: at q_i = p_i the subgradient 0 is taken, as autograd's ``abs`` does), and through
the softmax  d DEMD / d z = q ⊙ (g - q·g).  The base terms' gradients w.r.t. z:
KL(p ‖ q) → (Σp)·q - p, CE(y) → q - onehot(y). With detached per-token coefficients (a, b) of the
mode (:func:`emdlm.ops._chunking.mode_coefficients`), the gradient is a·∇B + b·∇DEMD.

The engine writes the gradient w.r.t. the student logits into one [N, V] buffer during forward;
the teacher's rows of each chunk are views of its logits (one flattening copy only when its
strides split rows differently from the student's). w is needed twice (value and gradient), so
it is computed once per chunk with two matmuls, Êᵀp ([n, V] × [V, d']) and (Êᵀp) Êᵀ
([n, d'] × [d', V]); no V x V matrix. Scratch per chunk: about six [chunk, V] compute-dtype
tensors (log q / q, log p / w, p, q - p, g, and float32 copies of half-precision inputs). No
gradient flows to the teacher or to Ê.

The CE + KL baseline (:func:`emdlm.functional.emo_dense.kl_distill_loss`; Hinton, Vinyals &
Dean 2015, Sec. 2), per position with q = softmax(z), q_τ = softmax(z/τ), p_τ = softmax(u/τ):

    L = (1 - α)·CE(y) + α·τ²·KL(p_τ ‖ q_τ)
    dL/dz = (1 - α)·(q - onehot(y)) + α·τ·((Σp_τ)·q_τ - p_τ)

(Σp_τ = 1 up to rounding; kept so that the gradient is the reference's autograd one).

Shape notation: N positions, n positions in a chunk, V vocabulary, d' cost-embedding width.
"""

from __future__ import annotations

from typing import Any

import torch

from emdlm.ops._chunking import mode_coefficients, row_blocks
from emdlm.ops.chunk_objective import ChunkObjective, ChunkOut, Finish, count_divisor


def _chunk(
    z: torch.Tensor,
    u: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    cost: torch.Tensor,
    opts: dict[str, Any],
    grad_scale: torch.Tensor | None,
    staging: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: per-token (loss value, base, DEMD) [n] and, if asked, d(loss)/dz [n, V].

    ``z``, ``u``: [n, V] student / teacher logits (any dtype, any strides; read only);
    ``staging``: [n, V] compute-dtype buffer that receives the student logits (it may be ``z``);
    ``weights``: optional [n] per-token weights w_t (0 where ignored), multiplying each token's
    value, base, DEMD and gradient (the per-token mix ratio is the token's own: w_t cancels).
    """
    cdtype = cost.dtype  # the compute dtype: prepare_cost cast Ê to it
    keep = valid[:, None]
    # Ignored rows may hold NaN / inf (padding): compute on zeros there, so nothing non-finite
    # enters a row sum; their coefficients are 0 and their gradient rows are filled with 0.
    if z.dtype == cdtype:  # one pass, into the driver's buffer
        z = torch.where(keep, z, torch.zeros((), dtype=cdtype, device=z.device), out=staging)
    else:  # half-precision logits: stage a float32 copy, then zero the ignored rows
        z = staging.copy_(z).masked_fill_(~keep, 0.0)
    u = torch.where(keep, u.to(cdtype), 0.0)
    if opts["temperature"] != 1.0:
        u = u.div_(opts["temperature"])
    log_q = torch.log_softmax(z, dim=1)  # [n, V]
    log_p = torch.log_softmax(u, dim=1)  # [n, V]
    p = log_p.exp()  # [n, V]
    base = opts["base"]
    if base == "kl":  # Σ p (log p - log q), with 0·log 0 = 0
        terms = log_p.sub_(log_q).mul_(p).masked_fill_(p == 0, 0.0)
        base_value = terms.sum(dim=1)
    elif base == "ce":
        base_value = -log_q.gather(1, labels[:, None]).squeeze(1)
    else:
        base_value = torch.zeros(z.shape[0], dtype=cdtype, device=z.device)
    q = log_q.exp_()  # [n, V]
    p_sum = p.sum(dim=1, keepdim=True)  # [n, 1]
    w = torch.addmm(p_sum, p @ cost, cost.T, beta=1.0, alpha=-1.0)  # C p: [n, V]
    diff = q - p  # [n, V]
    g = torch.sign(diff).mul_(w)  # d DEMD / d q (subgradient 0 where q_i = p_i)
    demd = torch.linalg.vecdot(diff, g, dim=1)  # Σ |q - p| ⊙ w: [n]
    a, b, value = mode_coefficients(
        base_value, demd, valid, opts["mode"], opts["mu"], opts["max_ratio"]
    )
    zero = torch.zeros((), dtype=cdtype, device=z.device)
    base_value = torch.where(valid, base_value, zero)
    demd = torch.where(valid, demd, zero)
    if weights is not None:  # w_t·L_t and the stats alike
        value, base_value, demd = value * weights, base_value * weights, demd * weights
    if grad_scale is None:
        return value, base_value, demd, None
    row_scale = grad_scale if weights is None else grad_scale * weights  # k or k·w_t
    a = a * row_scale
    b = b * row_scale  # type: ignore[operator]
    q_dot_g = torch.linalg.vecdot(q, g, dim=1)  # [n]
    grad = g.sub_(q_dot_g[:, None]).mul_(q).mul_(b[:, None])  # b · q ⊙ (g - q·g)
    if base == "kl":  # a · ((Σp) q - p)
        grad.addcmul_(q, a[:, None] * p_sum).addcmul_(p, -a[:, None])
    elif base == "ce":  # a · (q - onehot(y))
        grad.addcmul_(q, a[:, None]).scatter_add_(1, labels[:, None], -a[:, None])
    return value, base_value, demd, grad.masked_fill_(~keep, 0.0)


class TeacherRowsObjective(ChunkObjective):
    """Base of the distillation objectives: the teacher's logits u [..., V], aligned with the
    student's, read chunk by chunk (:meth:`teacher_rows`) as views of its own blocks, so a
    sliced teacher such as ``logits[:, :-1]`` is never copied whole. A subclass gives the
    per-chunk :meth:`kernel` (loss and two terms per token) and the terms' :attr:`stat_names`;
    the chunk loop's side (teacher rows, weights, sums, the means in ``finish``) is here."""

    #: the names of the two per-token terms the kernel returns beside the loss (components)
    stat_names: tuple[str, str] = ("", "")
    n_stats = 2
    takes_token_weights = True

    def __init__(self, teacher_logits: torch.Tensor) -> None:
        self.teacher = teacher_logits
        self.blocks: list[tuple[int, torch.Tensor]] = []
        self.flat: torch.Tensor | None = None

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        self.blocks = list(row_blocks(self.teacher))  # (first row, [m, V] view), no copy

    def teacher_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Teacher rows [lo, hi): a view of one block, else of a flattened copy (made once)."""
        for base, block in self.blocks:
            if base <= lo and hi <= base + block.shape[0]:
                return block[lo - base : hi - base]
        if self.flat is None:  # the student's chunk spans two teacher blocks
            self.flat = self.teacher.reshape(-1, self.teacher.shape[-1])
        return self.flat[lo:hi]

    def release(self) -> None:
        """Drop the views of the teacher (called from ``finish``)."""
        self.blocks, self.flat = [], None

    def kernel(
        self, z: torch.Tensor, u: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
        grad_scale: torch.Tensor | None, staging: torch.Tensor, weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One chunk: per-token (loss, first term, second term) [n], each times w_t when
        ``weights`` are given, and d(loss)/dz [n, V] when ``grad_scale`` is given."""
        raise NotImplementedError

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        u = self.teacher_rows(start, start + z.shape[0])
        safe = torch.where(valid, labels, 0)
        w = self.chunk_weights(valid, start, out.dtype)
        value, first, second, g = self.kernel(z, u, safe, valid, grad_scale, out, w)
        return ChunkOut(loss=value.sum(), grad=g, stats=torch.stack([first.sum(), second.sum()]))

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        """The two terms' means over the counted tokens (their weight sum with weights) as the
        components :attr:`stat_names`, and "n_tokens"."""
        self.release()
        denom = count_divisor(count, stats.dtype)
        first, second = self.stat_names
        components = {first: stats[0] / denom, second: stats[1] / denom, "n_tokens": count}
        return Finish(extra_loss=stats.new_zeros(()), sparse=None, components=components)


class EMODistillObjective(TeacherRowsObjective):
    """EMO distillation (EMO Eq. 15) per chunk for :func:`emdlm.ops.chunked.chunked_logits_loss`;
    stats [Σ base, Σ DEMD].

    Args:
        teacher_logits: u [..., V] aligned with the student logits (any dtype and strides).
        cost: Ê [V, d'] cast to the compute dtype (:func:`emdlm.ops.objectives.emo.emo_cost`).
        opts: base, mode, mu, temperature, max_ratio, checked where the loss is built
            (:class:`emdlm.losses.emo_distill.EMODistillLoss`; their meaning:
            :mod:`emdlm.functional.emo_dense`).

    Per-token weights w_t (:meth:`~emdlm.ops.chunk_objective.ChunkObjective.weigh_tokens`):
    Σ_t w_t·L_t ("sum") or Σ_t w_t·L_t / Σ_t w_t ("mean"), "base" and "demd" the same weighted
    means; the dynamic mix of emo1 / emo2 is a ratio of the token's own terms, computed as
    without weights.
    """

    stat_names = ("base", "demd")

    def __init__(self, teacher_logits: torch.Tensor, cost: torch.Tensor, opts: dict[str, Any]):
        super().__init__(teacher_logits)
        self.cost, self.opts = cost, opts

    def kernel(
        self, z: torch.Tensor, u: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
        grad_scale: torch.Tensor | None, staging: torch.Tensor, weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return _chunk(z, u, labels, valid, self.cost, self.opts, grad_scale, staging, weights)


def _kl_chunk(
    z: torch.Tensor,
    u: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    alpha: float,
    temperature: float,
    grad_scale: torch.Tensor | None,
    staging: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of the CE + KL baseline: per-token (loss value, CE, τ²·KL) [n] and, if asked,
    d(loss)/dz [n, V] (module docstring), each times the token's weight w_t when ``weights``
    [n] (0 where ignored) are given.

    ``z``, ``u``: [n, V] student / teacher logits (any dtype and strides; read only);
    ``labels`` [n] in range (0 where ignored); ``staging``: [n, V] compute-dtype buffer that
    receives the student logits (it may be ``z``).
    """
    cdtype = staging.dtype
    keep = valid[:, None]
    # Ignored rows may hold NaN / inf (padding): computed on zeros, their gradient rows 0.
    if z.dtype == cdtype:
        z = torch.where(keep, z, torch.zeros((), dtype=cdtype, device=z.device), out=staging)
    else:  # half-precision logits: stage a float32 copy, then zero the ignored rows
        z = staging.copy_(z).masked_fill_(~keep, 0.0)
    u = torch.where(keep, u.to(cdtype), 0.0)
    log_q = torch.log_softmax(z, dim=1)  # [n, V]
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)  # [n]
    if temperature == 1.0:  # the usual case: no second student log-softmax
        log_qt = log_q
    else:
        log_qt = torch.log_softmax(z / temperature, dim=1)
        u = u.div_(temperature)
    log_pt = torch.log_softmax(u, dim=1)  # [n, V]
    p = log_pt.exp()  # [n, V]
    kl = log_pt.sub_(log_qt).mul_(p).masked_fill_(p == 0, 0.0).sum(dim=1) * temperature**2
    zero = torch.zeros((), dtype=cdtype, device=z.device)
    ce, kl = torch.where(valid, ce, zero), torch.where(valid, kl, zero)
    value = (1.0 - alpha) * ce + alpha * kl
    if weights is not None:  # w_t·L_t and the stats alike
        value, ce, kl = value * weights, ce * weights, kl * weights
    if grad_scale is None:
        return value, ce, kl, None
    n = z.shape[0]
    row_scale = torch.broadcast_to(grad_scale if weights is None else grad_scale * weights, (n,))
    p_sum = p.sum(dim=1, keepdim=True)  # [n, 1]
    at = alpha * temperature
    if temperature == 1.0:  # q_τ = q: q·((1 - α) + α·Σp) - α·p
        grad = log_q.exp_().mul_(p_sum * alpha + (1.0 - alpha)).sub_(p, alpha=alpha)
    else:  # (1 - α)·q + α·τ·(Σp·q_τ - p)
        q_t = log_qt.exp_().mul_(p_sum * at)
        grad = log_q.exp_().mul_(1.0 - alpha).add_(q_t).sub_(p, alpha=at)
    grad.mul_(row_scale[:, None])
    grad.scatter_add_(1, labels[:, None], (row_scale * -(1.0 - alpha))[:, None])
    return value, ce, kl, grad.masked_fill_(~keep, 0.0)


class KLDistillObjective(TeacherRowsObjective):
    """The CE + KL distillation baseline per chunk, (1 - α)·CE(y) + α·τ²·KL(p_τ ‖ q_τ) (module
    docstring); stats [Σ CE, Σ τ²·KL], reported as the components "ce", "kl" (means over the
    counted tokens) and "n_tokens", as :func:`emdlm.functional.emo_dense.kl_distill_loss`.

    Args:
        teacher_logits: u [..., V] aligned with the student logits (any dtype and strides).
        alpha, temperature: α in [0, 1] and τ > 0, checked where the loss is built
            (:class:`emdlm.losses.emo_distill.KLDistillLoss`).

    Per-token weights w_t (:meth:`~emdlm.ops.chunk_objective.ChunkObjective.weigh_tokens`):
    Σ_t w_t·L_t ("sum") or Σ_t w_t·L_t / Σ_t w_t ("mean"), "ce" and "kl" the same weighted means.
    """

    stat_names = ("ce", "kl")

    def __init__(self, teacher_logits: torch.Tensor, alpha: float, temperature: float) -> None:
        super().__init__(teacher_logits)
        self.alpha, self.temperature = float(alpha), float(temperature)

    def kernel(
        self, z: torch.Tensor, u: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
        grad_scale: torch.Tensor | None, staging: torch.Tensor, weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return _kl_chunk(z, u, labels, valid, self.alpha, self.temperature, grad_scale,
                         staging, weights)


__all__ = ["EMODistillObjective", "KLDistillObjective", "TeacherRowsObjective"]
