"""Weighted cross-entropy per chunk (CE, TaiLr, MixCE, DFT) for :mod:`emdlm.ops.chunked`.

Per counted token t of a chunk, with lse_t = logsumexp(z_t), CE_t = lse_t − z_t[y_t],
q_t = softmax(z_t) and a detached multiplier a_t = f(sg(q_t(y_t))) that depends only on the
token's own gold probability (so it is local to the chunk):

    L_t      = a_t·CE_t + ε·(lse_t − mean_v z_tv) + s·lse_t²     (ε: label smoothing,
                                                                  ε/V·Σ_v −log q_tv; s: z-loss)
    dL_t/dz_t = (a_t + ε + 2s·lse_t)·q_t − a_t·onehot(y_t) − ε/V

CE: a = 1, or 1 − ε with label smoothing (torch / Liger's definition, linkedin/Liger-Kernel
src/liger_kernel/ops/cross_entropy.py; s is Liger's ``lse_square_scale``). DFT (TRL
``loss_type="dft"``): a = q_y. MixCE (Zhang et al., ACL 2023): a = η + (1−η)·q_y. TaiLr (Ji et
al., ICLR 2023, preset "paper"): a = (1−ε)·clamp(q_y/(γ + (1−γ)·q_y), w_min, 1); preset
"emo_repo" (DRSY/EMO): a = η + (1−η)·clamp(q_y/((1−η) + η·q_y), w_min, 1). The formulas are
those of :mod:`emdlm.functional.tailr` and :mod:`emdlm.functional.mixce` (the oracles in the
tests). The number objectives (:mod:`emdlm.ops.objectives.ntil`, ``.ntl``) extend
:class:`WeightedCEObjective` with their own terms.

Shape notation: n rows in a chunk, V vocabulary, m rows with a sparse term, K its columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from emdlm.ops.chunk_objective import ChunkObjective, ChunkOut, Finish, count_divisor

#: f(q_y) -> (a, reported weight), both [n]; q_y is detached.
TokenWeights = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def mixce_weights(eta: float) -> TokenWeights:
    """MixCE's multiplier a = η + (1−η)·q_y (reported as is)."""

    def weights(q_gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = eta + (1.0 - eta) * q_gold
        return a, a

    return weights


def dft_weights() -> TokenWeights:
    """DFT's multiplier a = q_y (TRL ``loss_type="dft"``; reported as is)."""

    def weights(q_gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q_gold, q_gold

    return weights


def tailr_weights(
    preset: str, gamma: float, min_weight: float, label_smoothing: float, mixing_ratio: float | None
) -> TokenWeights:
    """TaiLr's multiplier of CE and its reported weight (``functional.tailr.tailr_loss``)."""

    def paper(q_gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = (q_gold / (gamma + (1.0 - gamma) * q_gold)).clamp(min_weight, 1.0)
        return (1.0 - label_smoothing) * w, w

    def emo_repo(q_gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eta = float(mixing_ratio)  # type: ignore[arg-type]  # validated by the module
        denom = (1.0 - eta) + eta * q_gold
        tiny = torch.finfo(q_gold.dtype).tiny
        # η = 1 with q underflowing to 0 would give 0/0; the term is multiplied by 1-η = 0 anyway.
        ratio = torch.where(denom > 0, q_gold / denom.clamp_min(tiny), 1.0)
        a = eta + (1.0 - eta) * ratio.clamp(min_weight, 1.0)
        return a, a

    return paper if preset == "paper" else emo_repo


def _log_softmax_parts(
    z: torch.Tensor, out: torch.Tensor, safe: torch.Tensor, smoothing: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """CE_t = −log q_t(y_t), (1/V)·Σ_v −log q_tv (if ``smoothing``), e [n, V] in ``out`` and
    lse_t = logsumexp(z_t) [n]: e = q (total None), or e = exp(z − max) with q = e / total.

    Given logits (z read only, compute dtype) take one fused log-softmax into ``out`` and an
    exp in place, the kernels of ``F.cross_entropy``; lse = z_y − log q_y. From hidden states z
    is ``out`` (and a half-precision chunk is staged into it): then lse = max + log Σ exp(z − max)
    is taken in place, with no other [n, V] tensor.
    """
    cdtype = out.dtype
    if z.dtype == cdtype and z is not out:  # identity, not data_ptr: traceable
        log_q = torch.ops.aten._log_softmax.out(z, 1, False, out=out)  # [n, V]
        ce = -log_q.gather(1, safe).squeeze(1)  # [n]
        lse = z.gather(1, safe).squeeze(1) + ce  # [n]
        smooth = -log_q.mean(dim=-1) if smoothing else None  # [n]
        return ce, smooth, log_q.exp_(), None, lse
    gold = z.gather(1, safe).squeeze(1).to(cdtype)  # [n] z_y, read before z is overwritten
    mean_z = z.mean(dim=-1, dtype=cdtype) if smoothing else None  # [n]
    top = z.amax(dim=-1, keepdim=True).to(cdtype)  # [n, 1]
    e = torch.sub(z, top, out=out) if z.dtype == cdtype else out.copy_(z).sub_(top)
    e = e.exp_()  # [n, V]
    total = e.sum(dim=-1)  # [n]
    lse = top.squeeze(1) + total.log()  # [n]
    return lse - gold, None if mean_z is None else lse - mean_z, e, total, lse


def chunk_entropy(
    e: torch.Tensor,
    total: torch.Tensor | None,
    valid: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over the counted rows of the entropy H_t = −Σ_v q_tv·log q_tv (0-d, detached), each
    row times its weight w_t when per-token ``weights`` [n] are given.

    ``e`` [n, V] is q (``total`` None) or exp(z − max) with q = e / total [n]; then
    H_t = log total_t − Σ_v e_tv·log e_tv / total_t (xlogy: 0·log 0 = 0, so a −inf logit adds
    nothing). One [n, V] temporary of the chunk; ignored rows count 0 (``where``: they may hold
    NaN).
    """
    with torch.no_grad():
        plogp = torch.special.xlogy(e, e).sum(dim=-1)  # [n]
        h = -plogp if total is None else total.log() - plogp / total
        if weights is not None:
            h = h * weights
        return torch.where(valid, h, h.new_zeros(())).sum()


@dataclass
class RowTerms:
    """A token-local term a subclass of :class:`WeightedCEObjective` adds to a chunk.

    Attributes (sum units, before ``grad_scale``; rows local to the chunk):
        loss: [n] added to each row's loss (0 where nothing is added).
        q_coef: [n] added to the coefficient of q in the row's gradient (∂term/∂lse_t, since
            ∂lse_t/∂z_tv = q_tv).
        rows: [m] local rows of the sparse part; ids: [m, K] vocabulary ids; grad: [m, K]
            ∂term/∂z at those places (padding columns 0).
        stats: [e] sums reported to ``finish`` after the base's four.
    """

    loss: torch.Tensor
    q_coef: torch.Tensor
    rows: torch.Tensor
    ids: torch.Tensor
    grad: torch.Tensor
    stats: torch.Tensor


class WeightedCEObjective(ChunkObjective):
    """Σ_t a_t·CE_t (+ label smoothing ε, + z-loss s·lse_t²) per chunk.

    stats [Σ CE_t, Σ reported weight, Σ lse_t², Σ 1(argmax z_t = y_t), Σ H_t] (the last two 0
    unless asked), then a subclass's own (:meth:`_row_terms`) from index :attr:`n_stats` on.

    Args:
        weights: f(q_y) -> (a, reported weight), or None for plain CE (a = 1).
        label_smoothing: ε, the unweighted smoothing term ε·(lse_t − mean_v z_tv).
        gold_scale: a constant factor on a (CE with label smoothing: 1 − ε, as torch / Liger).
        z_loss: s, the weight of lse_t² (Liger's ``lse_square_scale``; PaLM's z-loss).
        token_accuracy: count argmax z_t == y_t (an extra read of the chunk, before z may be
            overwritten); reported as "token_accuracy".
        entropy: report "entropy", the mean over counted tokens of H_t = −Σ_v q_tv·log q_tv
            (TRL's logged entropy), taken from the chunk's softmax (:func:`chunk_entropy`).
        predicted_tokens: keep argmax_v z_tv of every row (the first maximal id on ties, as
            ``torch.argmax``), one [n] long per chunk, read before z may be overwritten (the
            argmax ``token_accuracy`` counts, taken once for both): :meth:`predicted`.

    Per counted token, L_t = a_t·CE_t + ε·(lse_t − mean_v z_tv) + s·lse_t² (+ a subclass's
    row term) and dL_t/dz_t = (a_t + ε + 2s·lse_t + c_t)·q_t − a_t·onehot(y_t) − ε/V (+ the
    row term's sparse part), c_t the row term's ∂/∂lse_t.

    Per-token weights w_t (:meth:`ChunkObjective.weigh_tokens`): every token's L_t, gradient and
    stats are multiplied by w_t and the count is Σ_t w_t over the counted tokens
    (:meth:`ChunkObjective.counted`), so w_t = 0 scores the token exactly as an ignored label. A row
    term (:meth:`_row_terms`) is multiplied by w_t with L_t in value and in q's coefficient; its
    sparse part and stats are the subclass's to weigh.
    """

    n_stats = 5
    takes_token_weights = True

    def __init__(
        self,
        weights: TokenWeights | None = None,
        label_smoothing: float = 0.0,
        *,
        gold_scale: float = 1.0,
        z_loss: float = 0.0,
        token_accuracy: bool = False,
        entropy: bool = False,
        predicted_tokens: bool = False,
    ) -> None:
        self.weights = weights
        self.label_smoothing = float(label_smoothing)
        self.gold_scale = float(gold_scale)
        self.z_loss = float(z_loss)
        self.token_accuracy = bool(token_accuracy)
        self.entropy = bool(entropy)
        self.predicted_tokens = bool(predicted_tokens)
        self._argmax: list[torch.Tensor] = []  # one [n] per chunk, in row order

    def predicted(self) -> torch.Tensor | None:
        if not self.predicted_tokens:
            return None
        return torch.cat(self._argmax) if self._argmax else torch.empty(0, dtype=torch.long)

    def _row_terms(
        self, lse: torch.Tensor, valid: torch.Tensor, start: int
    ) -> RowTerms | None:
        """A subclass's token-local term for the chunk at ``start`` given lse [n] (0 where
        ignored); None: nothing added."""
        return None

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        safe = torch.where(valid, labels, 0).unsqueeze(1)  # [n, 1]
        zero = out.new_zeros(())
        eps, s = self.label_smoothing, self.z_loss
        w = self.chunk_weights(valid, start, out.dtype)  # [n], 0 where ignored; None: unweighted
        # before z may be overwritten (z is out from hidden states)
        top = z.argmax(dim=-1) if self.token_accuracy or self.predicted_tokens else None  # [n]
        if self.predicted_tokens:
            self._argmax.append(top)  # type: ignore[arg-type]
        if self.token_accuracy:
            hits = (top == labels) & valid
            correct = hits.sum().to(out.dtype) if w is None else torch.where(hits, w, zero).sum()
        else:
            correct = zero
        ce_raw, smooth_raw, e, total, lse_raw = _log_softmax_parts(z, out, safe, eps > 0.0)
        # where, not a multiply: an ignored row may hold NaN / ±inf (0·NaN = NaN).
        ce = torch.where(valid, ce_raw, zero)  # [n]
        lse = torch.where(valid, lse_raw, zero)  # [n]
        if self.weights is None:
            a, reported = None, torch.where(valid, 1.0, zero)
        else:
            a, reported = self.weights(torch.exp(-ce))
            a, reported = torch.where(valid, a, zero), torch.where(valid, reported, zero)
        if self.gold_scale != 1.0:
            a = torch.where(valid, self.gold_scale, zero) if a is None else a * self.gold_scale
        per_token = ce if a is None else a * ce
        if smooth_raw is not None:
            smooth = torch.where(valid, smooth_raw, zero)  # (1/V)·Σ_v −log q_v: [n]
            per_token = per_token + eps * smooth
        lse_sq = lse * lse  # [n]
        if s > 0.0:
            per_token = per_token + s * lse_sq
        extra = self._row_terms(lse, valid, start)
        if extra is not None:
            per_token = per_token + extra.loss
        # before e becomes the gradient in place; weighted like the other stats
        entropy = chunk_entropy(e, total, valid, w) if self.entropy else zero
        if w is not None:  # w_t·L_t, and the stats weighted alike
            per_token, ce, reported, lse_sq = per_token * w, ce * w, reported * w, lse_sq * w
        base = [ce.sum(), reported.sum(), lse_sq.sum(), correct, entropy]
        stats = torch.stack(base if extra is None else [*base, *extra.stats.to(out.dtype)])
        if grad_scale is None:
            return ChunkOut(loss=per_token.sum(), grad=None, stats=stats)
        a_col = torch.ones_like(ce) if a is None else a  # [n]
        # k·w_t per row with weights (k·(w_t·dL_t/dz_t)), else the 0-d k
        row_scale = grad_scale if w is None else grad_scale * w
        q_coef = a_col + eps
        if s > 0.0:
            q_coef = q_coef + (2.0 * s) * lse
        if extra is not None:
            q_coef = q_coef + extra.q_coef
        plain = a is None and eps == 0.0 and s == 0.0 and extra is None and w is None
        if total is not None:  # the 1/Σe normalization carries k·(a + ε + ...) (no extra pass)
            g = e.mul_((q_coef * row_scale / total).unsqueeze(1))  # [n, V]
        elif plain:  # plain CE on given logits: q − onehot; k comes later
            g = e.scatter_add_(1, safe, -a_col.unsqueeze(1))
            return ChunkOut(loss=per_token.sum(), grad=g, stats=stats, scaled=False)
        else:
            g = e.mul_((q_coef * row_scale).unsqueeze(1))  # [n, V]
        # k·((a + ε + 2s·lse + c)·q − a·onehot(y) − ε/V)
        g.scatter_add_(1, safe, -(a_col * row_scale).unsqueeze(1))
        if eps > 0.0:
            g.sub_((row_scale * (eps / z.shape[-1])).reshape(-1, 1))
        if extra is not None:  # the row term's sparse part, k·∂term/∂z[rows, ids]
            rows = extra.rows.unsqueeze(1).expand_as(extra.ids)  # [m, K]
            g.index_put_((rows, extra.ids), (extra.grad * grad_scale).to(g.dtype), accumulate=True)
        return ChunkOut(loss=per_token.sum(), grad=g, stats=stats)

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        denom = count_divisor(count, stats.dtype)
        components = {"ce": stats[0] / denom, "n_tokens": count}
        if self.weights is not None:
            components["weight_mean"] = stats[1] / denom
        if self.z_loss > 0.0:
            components["z_loss"] = self.z_loss * stats[2] / denom
        if self.token_accuracy:
            components["token_accuracy"] = stats[3] / denom
        if self.entropy:
            components["entropy"] = stats[4] / denom
        return Finish(extra_loss=stats.new_zeros(()), sparse=None, components=components)


