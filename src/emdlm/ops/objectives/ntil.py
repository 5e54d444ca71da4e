"""NTIL and digit EMD per chunk (:class:`NTILObjective`) for :mod:`emdlm.ops.chunked`.

NTIL (Fei et al., ACL 2025, Eq. 1–4; xfey/NTIL ntil.py): CE per chunk
(:class:`emdlm.ops.objectives.ce.WeightedCEObjective`), and the [M, K] class-candidate logits
of the number positions copied out of each chunk's z
(:class:`emdlm.ops.objectives.candidates.CandidateCEObjective`). After the pass the NTIL terms are
computed on that small tensor (:func:`emdlm.functional.ntil.ntil_terms` on a float64 leaf,
:func:`~emdlm.functional.ntil.mix_coefficient` with the global CE mean), and their gradient
goes back on those logits only (:class:`emdlm.ops.chunk_objective.SparseLogitGrad`):

    total = CE + c·NTIL,   c = λ·sg(CE/NTIL) ("dynamic") or λ ("static")

so the summed loss is n·CE + n·c·NTIL (n counted labels; the engine applies 1/n for "mean").
Value and logits gradient equal the reference :func:`emdlm.functional.ntil.ntil_loss`'s.

Shape notation: N rows, V vocabulary, M number tokens, K candidates per token.
"""

from __future__ import annotations

import torch

from emdlm.functional.ntil import NTILSettings, mix_coefficient, ntil_terms, sample_noise
from emdlm.number_spans import SpanDraft
from emdlm.numbers import NumberVocab
from emdlm.ops.chunk_objective import Finish, SparseLogitGrad, count_divisor
from emdlm.ops.objectives.candidates import CandidateCEObjective


class NTILObjective(CandidateCEObjective):
    """CE per chunk plus NTIL (or digit EMD) on the kept [M, K] class-candidate logits.

    Args:
        draft: the labels' span draft (:func:`emdlm.functional.ntil.draft_spans`).
        vocab: the number vocabulary.
        n_rows: B, batch rows of the labels (``averaging="row"``).
        settings: the NTIL knobs (the reduction is applied by the engine).
        generator: draws the Gumbel noise of ``value_mode="gumbel"`` once the spans are made.

    Per-token weights w_t (:meth:`~emdlm.ops.chunk_objective.ChunkObjective.weigh_tokens`; a token
    of weight 0 is an ignored label before the spans are found, ``EMDLMLoss``): CE is the weighted
    CE family's (Σ w·CE / Σ w), n = Σ_t w_t, the NTIL terms are averaged with the number tokens' w
    and the numbers' mean weights (:func:`emdlm.functional.ntil.ntil_terms`), and the dynamic mix
    c = λ·sg(CE/NTIL) is taken, as without weights, from these weighted CE and NTIL.

    The span sizes and the widest class are read in the engine's one host sync of the call
    (:meth:`host_sizes`); spans, candidates and noise are made in :meth:`begin`. The chunk
    bounds of the number tokens and the candidate ids the sparse gradient touches come with it.
    """

    def __init__(
        self,
        draft: SpanDraft,
        vocab: NumberVocab,
        n_rows: int,
        settings: NTILSettings,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(draft, vocab)
        self.n_rows, self.settings, self.generator = n_rows, settings, generator
        self.noise: torch.Tensor | None = None

    def host_sizes(
        self, labels: torch.Tensor, valid: torch.Tensor, bounds: list[int], vocab: int
    ) -> torch.Tensor:
        """:meth:`CandidateLogits.host_sizes`."""
        return self.kept.host_sizes(labels, bounds)

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        self.kept.begin(starts, sizes)
        assert self.kept.candidates is not None
        self.noise = sample_noise(self.kept.candidates, self.settings, self.generator)

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        kept, settings = self.kept, self.settings
        spans, candidates = kept.spans, kept.candidates
        assert spans is not None and candidates is not None and kept.logits is not None
        count_f = count.to(torch.float64)
        ce_mean = stats[0].double() / count_divisor(count, torch.float64)
        token_weight = None
        if self.token_weights is not None:  # w_m of the number tokens (> 0: zeros were dropped)
            token_weight = self.token_weights.index_select(0, spans.flat_index).double()
        leaf = kept.logits.requires_grad_(want_grad and spans.n_tokens > 0)
        with torch.enable_grad():
            terms = ntil_terms(
                leaf, candidates, spans, self.n_rows, settings, self.noise, n_tokens=count,
                token_weight=token_weight,
            )
        coef = mix_coefficient(ce_mean, terms.ntil, settings)
        sparse = None
        if leaf.requires_grad:
            (grad_z,) = torch.autograd.grad(terms.ntil, leaf, allow_unused=True)
            if grad_z is not None:  # in sum units: n·c·dNTIL/dz (the engine applies 1/n)
                sparse = SparseLogitGrad(
                    rows=spans.flat_index,
                    ids=candidates.ids,
                    grad=grad_z * (coef * count_f),
                    logits=leaf.detach(),
                    columns=kept.columns,
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


__all__ = ["NTILObjective"]
