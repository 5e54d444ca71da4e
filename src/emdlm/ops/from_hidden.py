"""Per-chunk functions of CE, TaiLr, MixCE, DFT, digit EMD, NTIL, NTL and EMO for
:mod:`emdlm.ops.chunked`.

Each is a :class:`emdlm.ops.chunked.ChunkObjective`, run from hidden states (the loss modules'
``from_hidden``) and, for NTIL and EMO, from given logits too (:mod:`emdlm.ops.ntil_fused`,
:mod:`emdlm.ops.emo_chunked`): one per-chunk function per objective, whichever the path.

Weighted cross-entropy (CE, TaiLr, MixCE, DFT): per counted token t of a chunk, with
lse_t = logsumexp(z_t), CE_t = lse_t − z_t[y_t], q_t = softmax(z_t) and a detached multiplier
a_t = f(sg(q_t(y_t))) that depends only on the token's own gold probability (so it is local to
the chunk):

    L_t      = a_t·CE_t + ε·(lse_t − mean_v z_tv) + s·lse_t²     (ε: label smoothing,
                                                                  ε/V·Σ_v −log q_tv; s: z-loss)
    dL_t/dz_t = (a_t + ε + 2s·lse_t)·q_t − a_t·onehot(y_t) − ε/V

CE: a = 1, or 1 − ε with label smoothing (torch / Liger's definition; s is Liger's
``lse_square_scale``). DFT (TRL ``loss_type="dft"``): a = q_y. MixCE (ACL 2023):
a = η + (1−η)·q_y. TaiLr (ICLR 2023, preset "paper"):
a = (1−ε)·clamp(q_y/(γ + (1−γ)·q_y), w_min, 1); preset "emo_repo" (DRSY/EMO):
a = η + (1−η)·clamp(q_y/((1−η) + η·q_y), w_min, 1). The formulas are those of
:mod:`emdlm.functional.tailr` and :mod:`emdlm.functional.mixce` (the oracles in the tests).

NTIL and digit EMD (:class:`NTILObjective`): CE per chunk, and the [M, K] class-candidate logits
of the number positions copied out of each chunk's z. After the pass the NTIL terms are computed
on that small tensor (``ntil_terms`` on a float64 leaf, ``mix_coefficient`` with the global CE
mean), and their gradient goes back on those logits only
(:class:`emdlm.ops.chunked.SparseLogitGrad`).

NTL (:class:`NTLObjective`, ntloss's NTL-MSE family and number-level loss): token level in the
chunk (a row term in closed form), number level after the pass on the kept [M, K] candidate
logits, as NTIL.

EMO (:class:`EMOObjective`): :func:`emdlm.ops._chunking.emo_chunk` per chunk (EMO Eq. 14, 19).

Shape notation: n rows in a chunk, V vocabulary, M number tokens, K candidates per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import IGNORE_INDEX, Reduction, compute_dtype
from emdlm.functional.ntil import (
    ClassCandidates,
    NTILSettings,
    class_candidates,
    mix_coefficient,
    ntil_terms,
    sample_noise,
)
from emdlm.functional.ntl import (
    REWEIGH_FACTOR,
    NTLSettings,
    TokenLoss,
    leading_units,
    ntl_denominator,
    number_ntl,
    token_base,
    worst_distance,
)
from emdlm.number_spans import NumberSpans, SpanDraft
from emdlm.numbers import NumberVocab
from emdlm.ops._chunking import (
    ChunkSums,
    check_cost_embedding,
    check_mode,
    emo_chunk,
    prepare_cost,
)
from emdlm.ops.chunked import (
    ChunkObjective,
    ChunkOut,
    Finish,
    HeadOptions,
    SparseLogitGrad,
    chunked_linear_loss,
    counts_before,
)

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

    stats [Σ CE_t, Σ reported weight, Σ lse_t², Σ 1(argmax z_t = y_t)], then a subclass's own
    (:meth:`_row_terms`).

    Args:
        weights: f(q_y) -> (a, reported weight), or None for plain CE (a = 1).
        label_smoothing: ε, the unweighted smoothing term ε·(lse_t − mean_v z_tv).
        gold_scale: a constant factor on a (CE with label smoothing: 1 − ε, as torch / Liger).
        z_loss: s, the weight of lse_t² (Liger's ``lse_square_scale``; PaLM's z-loss).
        token_accuracy: count argmax z_t == y_t (an extra read of the chunk, before z may be
            overwritten); reported as "token_accuracy".

    Per counted token, L_t = a_t·CE_t + ε·(lse_t − mean_v z_tv) + s·lse_t² (+ a subclass's
    row term) and dL_t/dz_t = (a_t + ε + 2s·lse_t + c_t)·q_t − a_t·onehot(y_t) − ε/V (+ the
    row term's sparse part), c_t the row term's ∂/∂lse_t.
    """

    n_stats = 4

    def __init__(
        self,
        weights: TokenWeights | None = None,
        label_smoothing: float = 0.0,
        *,
        gold_scale: float = 1.0,
        z_loss: float = 0.0,
        token_accuracy: bool = False,
    ) -> None:
        self.weights = weights
        self.label_smoothing = float(label_smoothing)
        self.gold_scale = float(gold_scale)
        self.z_loss = float(z_loss)
        self.token_accuracy = bool(token_accuracy)

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
        if self.token_accuracy:  # before z may be overwritten (z is out from hidden states)
            correct = ((z.argmax(dim=-1) == labels) & valid).sum().to(out.dtype)
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
        base = [ce.sum(), reported.sum(), lse_sq.sum(), correct]
        stats = torch.stack(base if extra is None else [*base, *extra.stats.to(out.dtype)])
        if grad_scale is None:
            return ChunkOut(loss=per_token.sum(), grad=None, stats=stats)
        a_col = torch.ones_like(ce) if a is None else a  # [n]
        q_coef = a_col + eps
        if s > 0.0:
            q_coef = q_coef + (2.0 * s) * lse
        if extra is not None:
            q_coef = q_coef + extra.q_coef
        plain = a is None and eps == 0.0 and s == 0.0 and extra is None
        if total is not None:  # the 1/Σe normalization carries k·(a + ε + ...) (no extra pass)
            g = e.mul_((q_coef * grad_scale / total).unsqueeze(1))  # [n, V]
        elif plain:  # plain CE on given logits: q − onehot; k comes later
            g = e.scatter_add_(1, safe, -a_col.unsqueeze(1))
            return ChunkOut(loss=per_token.sum(), grad=g, stats=stats, scaled=False)
        else:
            g = e.mul_((q_coef * grad_scale).unsqueeze(1))  # [n, V]
        # k·((a + ε + 2s·lse + c)·q − a·onehot(y) − ε/V)
        g.scatter_add_(1, safe, -(a_col * grad_scale).unsqueeze(1))
        if eps > 0.0:
            g.sub_(grad_scale * (eps / z.shape[-1]))
        if extra is not None:  # the row term's sparse part, k·∂term/∂z[rows, ids]
            rows = extra.rows.unsqueeze(1).expand_as(extra.ids)  # [m, K]
            g.index_put_((rows, extra.ids), (extra.grad * grad_scale).to(g.dtype), accumulate=True)
        return ChunkOut(loss=per_token.sum(), grad=g, stats=stats)

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        denom = count.clamp_min(1).to(stats.dtype)
        components = {"ce": stats[0] / denom, "n_tokens": count}
        if self.weights is not None:
            components["weight_mean"] = stats[1] / denom
        if self.z_loss > 0.0:
            components["z_loss"] = self.z_loss * stats[2] / denom
        if self.token_accuracy:
            components["token_accuracy"] = stats[3] / denom
        return Finish(extra_loss=stats.new_zeros(()), sparse=None, components=components)


class NTILObjective(WeightedCEObjective):
    """CE per chunk plus NTIL (or digit EMD) on the kept [M, K] class-candidate logits.

    Args:
        spans: the batch's number spans (``flat_index`` sorted, as ``find_number_spans`` gives).
        candidates: their class candidates ([M, K] ids).
        n_rows: B, batch rows of the labels (``averaging="row"``).
        settings: the NTIL knobs (reduction is applied by the engine).
        noise: [M, K] Gumbel noise for ``value_mode="gumbel"``.

    :meth:`from_draft` builds it from the labels' :class:`emdlm.numbers.SpanDraft` instead: the
    span sizes and the widest class are then read in the engine's one host sync of the call
    (:meth:`host_sizes`), and spans, candidates and noise are made in :meth:`begin`. Either
    way the call's only host read is the engine's: the chunk bounds of the number tokens and
    the candidate ids the sparse gradient touches (``SparseLogitGrad.columns``) come with it.
    """

    def __init__(
        self,
        spans: NumberSpans | None,
        candidates: ClassCandidates | None,
        n_rows: int,
        settings: NTILSettings,
        noise: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.spans, self.candidates = spans, candidates
        self.n_rows, self.settings, self.noise = n_rows, settings, noise
        self.draft: SpanDraft | None = None
        self.vocab: NumberVocab | None = None
        self.generator: torch.Generator | None = None
        self.class_logits: torch.Tensor | None = None
        self.bounds: list[int] = []
        self.chunk_of: dict[int, int] = {}
        self.members: torch.Tensor | None = None  # [V] bool: ids the candidates may hold
        self.n_members = 0

    @classmethod
    def from_draft(
        cls,
        draft: SpanDraft,
        vocab: NumberVocab,
        n_rows: int,
        settings: NTILSettings,
        generator: torch.Generator | None,
    ) -> NTILObjective:
        """The objective of the labels whose spans are ``draft`` (spans, candidates and the
        Gumbel noise, drawn with ``generator``, are made once the sizes are read)."""
        objective = cls(None, None, n_rows, settings, None)
        objective.draft, objective.vocab, objective.generator = draft, vocab, generator
        return objective

    def host_sizes(
        self, labels: torch.Tensor, valid: torch.Tensor, bounds: list[int], vocab: int
    ) -> torch.Tensor:
        """[M, S, widest class, U] then the number tokens before each bound (from a draft);
        [U, bounds...] with spans given. U: distinct ids the candidates may hold."""
        device = labels.device
        if self.draft is None:  # spans given: every candidate id, padding included
            spans, ids = self.spans, self.candidates.ids  # type: ignore[union-attr]
            is_num = torch.zeros(labels.shape[0], dtype=torch.bool, device=device)
            is_num.index_fill_(0, spans.flat_index, True)  # type: ignore[union-attr]
            members = torch.zeros(vocab, dtype=torch.bool, device=device)
            members.index_fill_(0, ids.reshape(-1), True)
            head = [members.sum().reshape(1)]
        else:  # from the draft: the members of every class present (padding maps anywhere)
            draft, nv = self.draft, self.vocab
            assert nv is not None
            is_num = draft.num.reshape(-1)  # [N]
            n_cls = nv.num_classes
            token_class = nv.token_class.index_select(0, draft.idx.reshape(-1))  # [N]
            slot = torch.where(is_num, token_class, n_cls)
            per_class = torch.zeros(n_cls + 1, dtype=torch.long, device=device)
            per_class.index_add_(0, slot, torch.ones_like(slot))
            present = per_class[:n_cls] > 0  # [C]
            members = nv.is_number & present[nv.token_class.clamp_min(0)]  # [V]
            width = (nv.class_mask.sum(dim=1) * present).amax()  # widest class present
            head = [
                torch.stack([draft.num.sum(), draft.num_start.sum(), width, members.sum()]),
            ]
        self.members = members
        return torch.cat([*head, counts_before(is_num, bounds)])

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        if self.draft is not None:
            n_tok, n_num, width = sizes[:3]
            sizes = sizes[3:]
            self.spans = self.draft.finish(n_tok, n_num)
            self.candidates = class_candidates(self.vocab, self.spans, width=width)  # type: ignore[arg-type]
            self.noise = sample_noise(self.candidates, self.settings, self.generator)
            self.draft = None
        self.n_members, self.bounds = sizes[0], sizes[1:]
        ids = self.candidates.ids  # type: ignore[union-attr]
        self.class_logits = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
        self.chunk_of = {s: i for i, s in enumerate(starts)}

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uniq [U], col [M, K]) of the candidate ids without a host sync: the U ids of
        ``members`` (size read in the call's one sync) and each entry's rank among them."""
        members = self.members
        assert members is not None
        uniq = torch.nonzero_static(members, size=self.n_members).squeeze(1)  # [U] ascending
        rank = torch.cumsum(members, 0) - 1  # [V]
        # A padding entry (id 0, gradient 0) that is no member lands on column 0: adds 0.
        col = rank[self.candidates.ids].clamp_min(0)  # type: ignore[union-attr]  # [M, K]
        return uniq, col

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        k = self.chunk_of[start]
        lo, hi = self.bounds[k], self.bounds[k + 1]
        if hi > lo and self.class_logits is not None:  # copy before CE overwrites z
            local = (self.spans.flat_index[lo:hi] - start).unsqueeze(1)  # [m, 1]
            self.class_logits[lo:hi] = z[local, self.candidates.ids[lo:hi]].double()
        return super().chunk(z, out, labels, valid, start, grad_scale)

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        spans, settings = self.spans, self.settings
        count_f = count.to(torch.float64)
        ce_mean = stats[0].double() / count_f.clamp_min(1)
        leaf = self.class_logits.requires_grad_(want_grad and spans.n_tokens > 0)  # type: ignore[union-attr]
        with torch.enable_grad():
            terms = ntil_terms(
                leaf, self.candidates, spans, self.n_rows, settings, self.noise, n_tokens=count
            )
        coef = mix_coefficient(ce_mean, terms.ntil, settings)
        sparse = None
        if leaf.requires_grad:
            (grad_z,) = torch.autograd.grad(terms.ntil, leaf, allow_unused=True)
            if grad_z is not None:  # in sum units: n·c·dNTIL/dz (the engine applies 1/n)
                sparse = SparseLogitGrad(
                    rows=spans.flat_index,
                    ids=self.candidates.ids,  # type: ignore[union-attr]
                    grad=grad_z * (coef * count_f),
                    logits=leaf.detach(),
                    columns=self._columns,
                )
        ntil = terms.ntil.detach()
        dtype = stats.dtype
        components = {
            "ce": ce_mean.to(dtype),
            "emd": terms.emd.detach().to(dtype),
            "relative": terms.relative.detach().to(dtype),
            "magnitude": terms.magnitude.detach().to(dtype),
            "ntil": ntil.to(dtype),
            "mix_coef": coef.detach().to(dtype),
            "n_numbers": torch.tensor(spans.n_numbers),
            "n_digit_tokens": torch.tensor(spans.n_tokens),
            "n_tokens": count,
        }
        return Finish(extra_loss=count_f * coef * ntil, sparse=sparse, components=components)


def token_ntl_with_grad(
    class_logits: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
    gold: torch.Tensor,
    worst: torch.Tensor,
    kind: TokenLoss,
    reweigh: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ℓ_m of :func:`emdlm.functional.ntl.token_ntl` with its gradient in closed form.

    With p = softmax(c) over the candidates, ℓ⁰ and ∂ℓ⁰/∂c from
    :func:`emdlm.functional.ntl.token_base`, and μ = exp(logsumexp(c) − lse) (∂μ/∂c_k = μ·p_k,
    ∂μ/∂lse = −μ):

        no reweigh:  ℓ = ℓ⁰,                 ∂ℓ/∂c = ∂ℓ⁰/∂c,                   ∂ℓ/∂lse = 0
        reweigh:     ℓ = ℓ⁰·μ + R·(1 − μ),   ∂ℓ/∂c_k = μ·(∂ℓ⁰/∂c_k + (ℓ⁰ − R)·p_k),
                                              ∂ℓ/∂lse = (R − ℓ⁰)·μ

    Args (float64, M rows): class_logits [M, K], lse [M], mask [M, K], values u [M, K] (leading-
    place units), gold u_y [M], worst R [M] (1.01·the largest ℓ⁰), kind, reweigh.

    Returns:
        (ℓ [M], ∂ℓ/∂c [M, K] (0 on padding), ∂ℓ/∂lse [M], μ [M]).
    """
    masked = class_logits.masked_fill(~mask, float("-inf"))  # [M, K]
    lse_c = torch.logsumexp(masked, dim=-1)  # [M]
    p = torch.exp(masked - lse_c.unsqueeze(1))  # [M, K], 0 on padding
    base, grad_base = token_base(p, values, gold, kind, grad=True)
    assert grad_base is not None
    mass = torch.exp(lse_c - lse)  # [M]
    if not reweigh:
        return base, grad_base, torch.zeros_like(base), mass
    ell = base * mass + worst * (1.0 - mass)
    grad_c = mass.unsqueeze(1) * (grad_base + (base - worst).unsqueeze(1) * p)
    return ell, grad_c, (worst - base) * mass, mass


class NTLObjective(NTILObjective):
    """CE per chunk plus ntloss's NTL (:mod:`emdlm.functional.ntl`): CE + λ·Σℓ/D.

    Built from the labels' :class:`emdlm.numbers.SpanDraft`: the span sizes, the widest class
    and n (counted labels, for D) are read in the engine's one host sync of the call
    (:meth:`host_sizes`); the candidate logits of the number positions are copied out of each
    chunk as in :class:`NTILObjective`.

    * level "token": ℓ_m depends on its own row only (its candidates' logits and lse), so it is
      added in the chunk (:meth:`_row_terms`), value and gradient in closed form
      (:func:`token_ntl_with_grad`): the reweigh's ∂ℓ/∂lse joins the coefficient of q, the rest
      is scattered onto the candidates. Nothing is left for after the pass.
    * level "number": ℓ_s spans tokens (maybe chunks), so the [M, K] candidate logits and the
      lse of the number rows are kept and the terms are taken after the pass (as NTIL's): the
      candidates' gradient goes back as a :class:`SparseLogitGrad`; the reweigh's ∂/∂lse at each
      number's first token, a dense q-row term, is left in :attr:`lse_grad` (sum units) for the
      caller to add through the head (``emdlm.losses.ntl.NumberLevelLoss._after_from_hidden``).

    Args:
        draft: the labels' span draft; vocab: the number vocabulary; settings: the NTL knobs.
    """

    def __init__(self, draft: SpanDraft, vocab: NumberVocab, settings: NTLSettings) -> None:
        super().__init__(None, None, 1, None, None)  # type: ignore[arg-type]  # NTIL's fields
        self.draft, self.vocab, self.ntl = draft, vocab, settings
        self.n_stats = 6 if settings.level == "token" else 4
        self.n_counted = 0
        self.item_weight = 0.0
        self.lse_kept: torch.Tensor | None = None
        self.lse_grad: torch.Tensor | None = None  # [M] float64, number level with reweigh
        self.count: torch.Tensor | None = None
        self.token_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def host_sizes(
        self, labels: torch.Tensor, valid: torch.Tensor, bounds: list[int], vocab: int
    ) -> torch.Tensor:
        """[n, M, S, widest class, U, number tokens before each bound]."""
        return torch.cat([valid.sum().reshape(1), super().host_sizes(labels, valid, bounds, vocab)])

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        self.n_counted = sizes[0]
        n_tok, n_num, width = sizes[1:4]
        assert self.draft is not None and self.vocab is not None
        self.spans = self.draft.finish(n_tok, n_num)
        self.candidates = class_candidates(self.vocab, self.spans, width=width)
        self.draft = None
        self.n_members, self.bounds = sizes[4], sizes[5:]
        ids = self.candidates.ids
        self.class_logits = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
        self.lse_kept = torch.zeros(ids.shape[0], dtype=torch.float64, device=ids.device)
        self.chunk_of = {s: i for i, s in enumerate(starts)}
        settings = self.ntl
        n_items = n_tok if settings.level == "token" else n_num
        # Σℓ enters the summed loss with λ·n/D: D = the items ("number") or n ("token").
        share = 1.0 if settings.averaging == "token" else self.n_counted / max(n_items, 1)
        self.item_weight = settings.lam * share
        if settings.level == "token":
            unit = leading_units(self.candidates, self.spans)  # [M, 1]
            values = self.candidates.values / unit  # [M, K]
            gold = values.gather(1, self.spans.gold_column.unsqueeze(1)).squeeze(1)  # [M]
            worst = REWEIGH_FACTOR * worst_distance(self.candidates, unit, settings.loss)
            self.token_tables = (values, gold, worst)

    def _row_terms(
        self, lse: torch.Tensor, valid: torch.Tensor, start: int
    ) -> RowTerms | None:
        k = self.chunk_of[start]
        lo, hi = self.bounds[k], self.bounds[k + 1]
        spans, candidates = self.spans, self.candidates
        assert spans is not None and candidates is not None and self.lse_kept is not None
        local = spans.flat_index[lo:hi] - start  # [m]
        lse_m = lse[local].double()  # [m]
        if self.ntl.level == "number":
            self.lse_kept[lo:hi] = lse_m
            return None
        assert self.token_tables is not None and self.class_logits is not None
        values, gold, worst = self.token_tables
        ell, grad_c, grad_lse, mass = token_ntl_with_grad(
            self.class_logits[lo:hi],
            lse_m,
            candidates.mask[lo:hi],
            values[lo:hi],
            gold[lo:hi],
            worst[lo:hi],
            self.ntl.loss,
            self.ntl.reweigh,
        )
        w, n = self.item_weight, lse.shape[0]
        loss = lse.new_zeros(n).index_add(0, local, (w * ell).to(lse.dtype))  # [n]
        q_coef = lse.new_zeros(n).index_add(0, local, (w * grad_lse).to(lse.dtype))  # [n]
        return RowTerms(
            loss=loss,
            q_coef=q_coef,
            rows=local,
            ids=candidates.ids[lo:hi],
            grad=w * grad_c,
            stats=torch.stack([ell.sum(), mass.sum()]),
        )

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        spans, settings = self.spans, self.ntl
        assert spans is not None and self.candidates is not None
        self.count = count
        dtype = stats.dtype
        ce_mean = stats[0] / count.clamp_min(1).to(dtype)
        extra = stats.new_zeros(())
        sparse = None
        if settings.level == "token":
            ntl_sum, mass_sum, n_items = stats[4].double(), stats[5], spans.n_tokens
        else:
            n_items = spans.n_numbers
            need = want_grad and n_items > 0
            leaf = self.class_logits.requires_grad_(need)  # type: ignore[union-attr]
            lse_leaf = self.lse_kept.requires_grad_(need)  # type: ignore[union-attr]
            with torch.enable_grad():
                per_number, mass = number_ntl(leaf, lse_leaf, self.candidates, spans, settings)
                total = per_number.sum()
            ntl_sum, mass_sum = total.detach(), mass.detach().sum()
            extra = (self.item_weight * ntl_sum).to(dtype)
            if need:
                grad_c, grad_lse = torch.autograd.grad(total, [leaf, lse_leaf], allow_unused=True)
                if grad_c is not None:  # in sum units (the engine applies k)
                    sparse = SparseLogitGrad(
                        rows=spans.flat_index,
                        ids=self.candidates.ids,
                        grad=grad_c * self.item_weight,
                        logits=leaf.detach(),
                        columns=self._columns,
                    )
                if grad_lse is not None and settings.reweigh:
                    self.lse_grad = grad_lse * self.item_weight  # [M], at first tokens only
        ntl = ntl_sum / ntl_denominator(n_items, count, settings.averaging)
        components = {
            "ce": ce_mean,
            "ntl": ntl.to(dtype),
            "number_mass": (mass_sum / max(n_items, 1)).to(dtype),
            "n_digit_tokens": torch.tensor(spans.n_tokens),
            "n_tokens": count,
        }
        if settings.level == "number":
            components["n_numbers"] = torch.tensor(spans.n_numbers)
        return Finish(extra_loss=extra, sparse=sparse, components=components)


class EMOObjective(ChunkObjective):
    """EMO (ICLR 2024, Eq. 14 and 19) per chunk: :func:`emdlm.ops._chunking.emo_chunk` plugged
    into the engine; stats [Σ CE_t, Σ DEMD_t]. Used from hidden states (:func:`emo_from_hidden`,
    :func:`emdlm.ops.fused_linear_emo.fused_linear_emo_loss`) and from logits
    (:func:`emdlm.ops.emo_chunked.emo_loss_chunked`, ``demd_chunked``).

    Buffers: the driver's ``out`` and one [rows, V] scratch of the objective's own. From logits
    (z read only) q and then the gradient live in ``out`` (the gradient buffer itself for
    float32 logits) and S in the scratch; from hidden states z *is* ``out``, so z's storage
    takes S (the log-softmax consumes z first) and q / the gradient go to the scratch.

    Args:
        cost: [V, d'] row-normalized Ê already cast to the S-matmul dtype (``prepare_cost``).
        mode: "emo1", "emo2" or "static".
        mu: weight of DEMD for "static".
        max_ratio: cap of the emo1 ratio (None: no cap).
        demd_out: optional [N] tensor receiving the per-token DEMD (0 where ignored).
    """

    n_stats = 2

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
        )
        return ChunkOut(loss=sums.loss, grad=g, stats=torch.stack([sums.ce, sums.demd]))

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        self.scratch = None
        denom = count.clamp_min(1).to(stats.dtype)
        components = {"ce": stats[0] / denom, "demd": stats[1] / denom, "n_tokens": count}
        return Finish(extra_loss=stats.new_zeros(()), sparse=None, components=components)


def loss_from_hidden(
    objective: ChunkObjective,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ignore_index: int,
    reduction: Reduction,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
) -> LossOutput:
    """Run ``objective`` through :func:`emdlm.ops.chunked.chunked_linear_loss` (the modules'
    ``from_hidden`` methods); arguments as there and in :class:`HeadOptions`."""
    options = HeadOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        chunk_size=chunk_size,
        logit_scale=logit_scale,
        softcap=softcap,
    )
    return chunked_linear_loss(hidden, weight, bias, labels, objective, options)


def emo_objective(
    cost_embedding: torch.Tensor,
    vocab: int,
    like: torch.Tensor,
    *,
    mode: str,
    mu: float,
    max_ratio: float | None,
    reduction: Reduction,
    cost_dtype: torch.dtype | None = None,
) -> EMOObjective:
    """The checked :class:`EMOObjective` of a head with ``vocab`` rows whose inputs are
    ``like`` (hidden states or logits: their device and dtype): the options and Ê [V, d']
    checked, Ê cast for the S matmul (:func:`emdlm.ops._chunking.prepare_cost`)."""
    check_mode(mode, reduction, mu, max_ratio)
    check_cost_embedding(cost_embedding, vocab, like.device)
    cost = prepare_cost(cost_embedding, cost_dtype, compute_dtype(like.dtype))
    return EMOObjective(cost, mode, mu, max_ratio)


def emo_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mode: str = "emo1",
    mu: float = 1.0,
    max_ratio: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    cost_dtype: torch.dtype | None = None,
) -> LossOutput:
    """EMO of the head ``hidden @ weight.T + bias`` through the chunked engine.

    Same contract, value and gradients as
    :func:`emdlm.ops.fused_linear_emo.fused_linear_emo_loss` (``cost_embedding`` Ê [V, d']
    row-normalized), plus the engine's ``logit_scale`` / ``softcap``; components "ce", "demd",
    "n_tokens".
    """
    objective = emo_objective(
        cost_embedding,
        weight.shape[0],
        hidden,
        mode=mode,
        mu=mu,
        max_ratio=max_ratio,
        reduction=reduction,
        cost_dtype=cost_dtype,
    )
    return loss_from_hidden(
        objective,
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        chunk_size=chunk_size,
        logit_scale=logit_scale,
        softcap=softcap,
    )
