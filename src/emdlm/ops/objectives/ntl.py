"""The NTL losses per chunk (:class:`NTLObjective`) for :mod:`emdlm.ops.chunked`.

ntloss's NTL (Zausinger et al., ICML 2025; github.com/AI4SD/number-token-loss): NTL-MSE /
NTL-WAS at token level and the number-level loss, formulas in :mod:`emdlm.functional.ntl`
(the reference). CE per chunk (:class:`emdlm.ops.objectives.ce.WeightedCEObjective`) plus
λ·Σℓ/D: token level inside the chunk (a row term in closed form,
:func:`token_ntl_with_grad`), number level after the pass on the kept [M, K] candidate logits
(:class:`emdlm.ops.objectives.candidates.CandidateLogits`), as NTIL's.

Shape notation: n rows in a chunk, V vocabulary, M number tokens, S numbers, K candidates.
"""

from __future__ import annotations

import torch

from emdlm.functional.ntil import number_weights
from emdlm.functional.ntl import (
    REWEIGH_FACTOR,
    NTLSettings,
    SquashTable,
    TokenLoss,
    leading_units,
    ntl_denominator,
    number_ntl,
    token_base,
    token_squash,
    worst_distance,
)
from emdlm.number_spans import SpanDraft
from emdlm.numbers import NumberVocab
from emdlm.ops.chunk_objective import Finish, SparseLogitGrad, count_divisor
from emdlm.ops.objectives.candidates import CandidateCEObjective
from emdlm.ops.objectives.ce import RowTerms, WeightedCEObjective


def token_ntl_with_grad(
    class_logits: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
    gold: torch.Tensor,
    worst: torch.Tensor,
    kind: TokenLoss,
    reweigh: bool,
    squash: SquashTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ℓ_m of :func:`emdlm.functional.ntl.token_ntl` with its gradient in closed form.

    With p = softmax(c) over the candidates, ℓ⁰ and ∂ℓ⁰/∂c from
    :func:`emdlm.functional.ntl.token_base`, and μ = exp(logsumexp(c) − lse) (∂μ/∂c_k = μ·p_k,
    ∂μ/∂lse = −μ):

        no reweigh:  ℓ = ℓ⁰,                 ∂ℓ/∂c = ∂ℓ⁰/∂c,                   ∂ℓ/∂lse = 0
        reweigh:     ℓ = ℓ⁰·μ + R·(1 − μ),   ∂ℓ/∂c_k = μ·(∂ℓ⁰/∂c_k + (ℓ⁰ − R)·p_k),
                                              ∂ℓ/∂lse = (R − ℓ⁰)·μ

    Args (float64, M rows): class_logits [M, K], lse [M], mask [M, K], values u [M, K] (leading-
    place units), gold u_y [M], worst R [M] (1.01·the largest ℓ⁰), kind, reweigh, squash (the
    "was" distances' :class:`~emdlm.functional.ntl.SquashTable`, None: unsquashed).

    Returns:
        (ℓ [M], ∂ℓ/∂c [M, K] (0 on padding), ∂ℓ/∂lse [M], μ [M]).
    """
    masked = class_logits.masked_fill(~mask, float("-inf"))  # [M, K]
    lse_c = torch.logsumexp(masked, dim=-1)  # [M]
    p = torch.exp(masked - lse_c.unsqueeze(1))  # [M, K], 0 on padding
    base, grad_base = token_base(p, values, gold, kind, grad=True, squash=squash)
    assert grad_base is not None
    mass = torch.exp(lse_c - lse)  # [M]
    if not reweigh:
        return base, grad_base, torch.zeros_like(base), mass
    ell = base * mass + worst * (1.0 - mass)
    grad_c = mass.unsqueeze(1) * (grad_base + (base - worst).unsqueeze(1) * p)
    return ell, grad_c, (worst - base) * mass, mass


class NTLObjective(CandidateCEObjective):
    """CE per chunk plus ntloss's NTL (:mod:`emdlm.functional.ntl`): CE + λ·Σℓ/D.

    Built from the labels' :class:`emdlm.number_spans.SpanDraft`: the span sizes, the widest class
    and n (counted labels, for D) are read in the engine's one host sync of the call
    (:meth:`host_sizes`); the candidate logits of the number positions are copied out of each
    chunk (:class:`~emdlm.ops.objectives.candidates.CandidateCEObjective`).

    * level "token": ℓ_m depends on its own row only (its candidates' logits and lse), so it is
      added in the chunk (:meth:`_row_terms`), value and gradient in closed form
      (:func:`token_ntl_with_grad`): the reweigh's ∂ℓ/∂lse joins the coefficient of q, the rest
      is scattered onto the candidates. Nothing is left for after the pass.
    * level "number": ℓ_s spans tokens (maybe chunks), so the [M, K] candidate logits and the
      lse of the number rows are kept and the terms are taken after the pass (as NTIL's): the
      candidates' gradient goes back as a :class:`SparseLogitGrad`; the reweigh's ∂/∂lse at each
      number's first token, a dense q-row term, is left in :attr:`lse_grad` (sum units) for the
      caller to add through the head (``emdlm.losses.ntl.NTLLoss._after_from_hidden``).

    Per-token weights w_t (:meth:`~emdlm.ops.chunk_objective.ChunkObjective.weigh_tokens`; a token
    of weight 0 is an ignored label before the spans are found, ``EMDLMLoss``): CE is the weighted
    CE family's, n = Σ_t w_t, and with item weights ω (token level: ω_m = w_m; number level:
    ω_s = the mean weight of the number's tokens, :func:`emdlm.functional.ntil.number_weights`)

        NTL = Σ ω·ℓ / D,   D = Σ ω ("number")  or  n ("token"),

    "number_mass" the same weighted mean of μ.

    Args:
        draft: the labels' span draft; vocab: the number vocabulary; settings: the NTL knobs.
    """

    takes_token_weights = True

    def __init__(self, draft: SpanDraft, vocab: NumberVocab, settings: NTLSettings) -> None:
        super().__init__(draft, vocab)
        self.ntl = settings
        # the base's stats, then Σℓ and Σμ at token level (:meth:`_row_terms`)
        self.n_base_stats = WeightedCEObjective.n_stats
        self.n_stats = self.n_base_stats + (2 if settings.level == "token" else 0)
        self.n_counted: int | torch.Tensor = 0  # n: counted labels, or Σ_t w_t with weights
        self.item_weight: float | torch.Tensor = 0.0  # λ·n/D, a 0-d tensor with weights
        self.omega: torch.Tensor | None = None  # [M] or [S] item weights ω (None: all 1)
        self.lse_kept: torch.Tensor | None = None
        self.lse_grad: torch.Tensor | None = None  # [M] float64, number level with reweigh
        self.count: torch.Tensor | None = None
        self.token_tables: (
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, SquashTable | None] | None
        ) = None

    def host_sizes(
        self, labels: torch.Tensor, valid: torch.Tensor, bounds: list[int], vocab: int
    ) -> torch.Tensor:
        """[n, then :meth:`CandidateLogits.host_sizes`]."""
        if self.token_weights is not None:  # n = Σ_t w_t stays on the device
            self.n_counted = self.counted(valid).double()
        return torch.cat([valid.sum().reshape(1), self.kept.host_sizes(labels, bounds)])

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        if self.token_weights is None:
            self.n_counted = sizes[0]
        kept = self.kept
        kept.begin(starts, sizes[1:])
        spans, candidates = kept.spans, kept.candidates
        assert spans is not None and candidates is not None
        self.lse_kept = torch.zeros(
            candidates.ids.shape[0], dtype=torch.float64, device=candidates.ids.device
        )
        settings = self.ntl
        n_items = spans.n_tokens if settings.level == "token" else spans.n_numbers
        if self.token_weights is not None:
            w_m = self.token_weights.index_select(0, spans.flat_index).double()  # [M] > 0
            self.omega = (
                w_m if settings.level == "token"
                else number_weights(w_m, spans.number_id, spans.n_numbers)
            )
        # Σℓ enters the summed loss with λ·n/D: D = the items ("number") or n ("token").
        share = 1.0 if settings.averaging == "token" else self.n_counted / self._items(n_items)
        self.item_weight = settings.lam * share
        if settings.level == "token":
            unit = leading_units(candidates, spans)  # [M, 1]
            values = candidates.values / unit  # [M, K]
            gold = values.gather(1, spans.gold_column.unsqueeze(1)).squeeze(1)  # [M]
            squash = token_squash(values, candidates, settings)
            worst = REWEIGH_FACTOR * worst_distance(candidates, unit, settings.loss, squash)
            self.token_tables = (values, gold, worst, squash)

    def _items(self, n_items: int) -> float | torch.Tensor:
        """The items' weight Σ ω (their number without weights), ≥ 1 or > 0."""
        if self.omega is None:
            return float(max(n_items, 1))
        total = self.omega.sum()
        return torch.where(total > 0, total, 1.0)

    def _row_terms(
        self, lse: torch.Tensor, valid: torch.Tensor, start: int
    ) -> RowTerms | None:
        kept = self.kept
        lo, hi = kept.rows_in(start)
        spans, candidates = kept.spans, kept.candidates
        assert spans is not None and candidates is not None and self.lse_kept is not None
        local = spans.flat_index[lo:hi] - start  # [m]
        lse_m = lse[local].double()  # [m]
        if self.ntl.level == "number":
            self.lse_kept[lo:hi] = lse_m
            return None
        assert self.token_tables is not None and kept.logits is not None
        values, gold, worst, squash = self.token_tables
        ell, grad_c, grad_lse, mass = token_ntl_with_grad(
            kept.logits[lo:hi],
            lse_m,
            candidates.mask[lo:hi],
            values[lo:hi],
            gold[lo:hi],
            worst[lo:hi],
            self.ntl.loss,
            self.ntl.reweigh,
            squash.row_slice(lo, hi) if squash is not None else None,
        )
        w, n = self.item_weight, lse.shape[0]
        # The base multiplies the row's loss and q coefficient by w_t; the sparse part and
        # the stats are weighted here.
        loss = lse.new_zeros(n).index_add(0, local, (w * ell).to(lse.dtype))  # [n]
        q_coef = lse.new_zeros(n).index_add(0, local, (w * grad_lse).to(lse.dtype))  # [n]
        grad = w * grad_c
        if self.omega is not None:
            omega = self.omega[lo:hi]  # [m]
            ell, mass, grad = ell * omega, mass * omega, grad * omega.unsqueeze(1)
        return RowTerms(
            loss=loss,
            q_coef=q_coef,
            rows=local,
            ids=candidates.ids[lo:hi],
            grad=grad,
            stats=torch.stack([ell.sum(), mass.sum()]),
        )

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        kept, settings = self.kept, self.ntl
        spans, candidates = kept.spans, kept.candidates
        assert spans is not None and candidates is not None and kept.logits is not None
        assert self.lse_kept is not None
        self.count = count
        dtype = stats.dtype
        ce_mean = stats[0] / count_divisor(count, dtype)
        extra = stats.new_zeros(())
        sparse = None
        if settings.level == "token":
            first = self.n_base_stats
            ntl_sum, mass_sum, n_items = stats[first].double(), stats[first + 1], spans.n_tokens
        else:
            n_items = spans.n_numbers
            need = want_grad and n_items > 0
            leaf = kept.logits.requires_grad_(need)
            lse_leaf = self.lse_kept.requires_grad_(need)
            with torch.enable_grad():
                per_number, mass = number_ntl(leaf, lse_leaf, candidates, spans, settings)
                if self.omega is not None:
                    per_number, mass = per_number * self.omega, mass * self.omega
                total = per_number.sum()
            ntl_sum, mass_sum = total.detach(), mass.detach().sum()
            extra = (self.item_weight * ntl_sum).to(dtype)
            if need:
                grad_c, grad_lse = torch.autograd.grad(total, [leaf, lse_leaf], allow_unused=True)
                if grad_c is not None:  # in sum units (the engine applies k)
                    sparse = SparseLogitGrad(
                        rows=spans.flat_index,
                        ids=candidates.ids,
                        grad=grad_c * self.item_weight,
                        logits=leaf.detach(),
                        columns=kept.columns,
                    )
                if grad_lse is not None and settings.reweigh:
                    self.lse_grad = grad_lse * self.item_weight  # [M], at first tokens only
        if self.omega is None:
            ntl = ntl_sum / ntl_denominator(n_items, count, settings.averaging)
        else:  # D = Σ ω ("number") or n = Σ_t w_t ("token")
            d = self._items(n_items) if settings.averaging == "number" else count.double()
            ntl = ntl_sum / torch.where(torch.as_tensor(d) > 0, d, 1.0)
        components = {
            "ce": ce_mean,
            "ntl": ntl.to(dtype),
            "number_mass": (mass_sum / self._items(n_items)).to(dtype),
            "n_digit_tokens": torch.tensor(spans.n_tokens),
            "n_tokens": count,
        }
        if settings.level == "number":
            components["n_numbers"] = torch.tensor(spans.n_numbers)
        return Finish(extra_loss=extra, sparse=sparse, components=components)



__all__ = ["NTLObjective", "token_ntl_with_grad"]
