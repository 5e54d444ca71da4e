"""What the number objectives (NTIL, digit EMD, the NTL losses) share in the chunk engine: the
[M, K] class-candidate logits of a batch's number tokens, copied out of each chunk before the
chunk's CE may overwrite z, and the host sizes that let the engine's one host sync of the call
read everything they need.

Shape notation: N rows, V vocabulary, M number tokens, S numbers, K candidates per token,
U distinct candidate ids.
"""

from __future__ import annotations

import torch

from emdlm.functional.ntil import ClassCandidates, class_candidates
from emdlm.number_spans import NumberSpans, SpanDraft
from emdlm.numbers import NumberVocab
from emdlm.ops.chunk_objective import ChunkOut
from emdlm.ops.chunked import counts_before
from emdlm.ops.objectives.ce import WeightedCEObjective


class CandidateLogits:
    """The class-candidate logits z[m, candidates(m)] of the number tokens of one call.

    Built from the labels' :class:`emdlm.number_spans.SpanDraft` (no host sync):
    :meth:`host_sizes` gives the span sizes, the widest class present, U and the number tokens
    before each chunk bound for the engine's one host read; :meth:`begin` then makes the
    spans and their candidates and a float64 [M, K] buffer that :meth:`keep` fills chunk by
    chunk. :meth:`columns` gives the distinct candidate ids for a sparse gradient
    (``SparseLogitGrad.columns``) without another host sync.

    Attributes (after :meth:`begin`): spans, candidates, logits [M, K] float64, bounds
    (number tokens before each chunk's first row, then M).
    """

    #: Leading values of :meth:`host_sizes` before the per-bound counts.
    n_head = 4

    def __init__(self, draft: SpanDraft, vocab: NumberVocab) -> None:
        self.draft: SpanDraft | None = draft
        self.vocab = vocab
        self.spans: NumberSpans | None = None
        self.candidates: ClassCandidates | None = None
        self.logits: torch.Tensor | None = None
        self.bounds: list[int] = []
        self.chunk_of: dict[int, int] = {}
        self.members: torch.Tensor | None = None  # [V] bool: ids the candidates may hold
        self.n_members = 0

    def host_sizes(self, labels: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """[M, S, widest class present, U, number tokens before each bound] (1-D long, on
        the labels' device; no host sync)."""
        draft, nv = self.draft, self.vocab
        assert draft is not None
        device = labels.device
        is_num = draft.num.reshape(-1)  # [N]
        n_cls = nv.num_classes
        token_class = nv.token_class.index_select(0, draft.idx.reshape(-1))  # [N]
        slot = torch.where(is_num, token_class, n_cls)
        per_class = torch.zeros(n_cls + 1, dtype=torch.long, device=device)
        per_class.index_add_(0, slot, torch.ones_like(slot))
        present = per_class[:n_cls] > 0  # [C]
        # The members of every class present (a padding column maps anywhere: gradient 0).
        self.members = nv.is_number & present[nv.token_class.clamp_min(0)]  # [V]
        width = (nv.class_mask.sum(dim=1) * present).amax()  # widest class present
        head = torch.stack([draft.num.sum(), draft.num_start.sum(), width, self.members.sum()])
        return torch.cat([head, counts_before(is_num, bounds)])

    def begin(self, starts: list[int], sizes: list[int]) -> None:
        """``sizes``: the values of :meth:`host_sizes` as host ints."""
        assert self.draft is not None
        n_tok, n_num, width, self.n_members = sizes[: self.n_head]
        self.bounds = sizes[self.n_head :]
        self.spans = self.draft.finish(n_tok, n_num)
        self.candidates = class_candidates(self.vocab, self.spans, width=width)
        self.draft = None
        ids = self.candidates.ids
        self.logits = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
        self.chunk_of = {s: i for i, s in enumerate(starts)}

    def rows_in(self, start: int) -> tuple[int, int]:
        """[lo, hi): the number tokens of the chunk whose first row is ``start``."""
        k = self.chunk_of[start]
        return self.bounds[k], self.bounds[k + 1]

    def keep(self, z: torch.Tensor, start: int) -> None:
        """Copy the chunk's candidate logits out of ``z`` [n, V] (before CE overwrites it)."""
        lo, hi = self.rows_in(start)
        if hi > lo and self.logits is not None:
            assert self.spans is not None and self.candidates is not None
            local = (self.spans.flat_index[lo:hi] - start).unsqueeze(1)  # [m, 1]
            self.logits[lo:hi] = z[local, self.candidates.ids[lo:hi]].double()

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uniq [U], col [M, K]) of the candidate ids without a host sync: the U ids of
        ``members`` (size read in the call's one sync) and each entry's rank among them."""
        members, candidates = self.members, self.candidates
        assert members is not None and candidates is not None
        uniq = torch.nonzero_static(members, size=self.n_members).squeeze(1)  # [U] ascending
        rank = torch.cumsum(members, 0) - 1  # [V]
        # A padding entry (id 0, gradient 0) that is no member lands on column 0: adds 0.
        col = rank[candidates.ids].clamp_min(0)  # [M, K]
        return uniq, col


class CandidateCEObjective(WeightedCEObjective):
    """CE per chunk that first copies the chunk's number-token candidate logits into
    :attr:`kept` (a :class:`CandidateLogits`, before CE may overwrite z): the base of the NTIL
    and NTL objectives, which add their terms on those logits."""

    def __init__(self, draft: SpanDraft, vocab: NumberVocab) -> None:
        super().__init__()
        self.kept = CandidateLogits(draft, vocab)

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        self.kept.keep(z, start)
        return super().chunk(z, out, labels, valid, start, grad_scale)


__all__ = ["CandidateCEObjective", "CandidateLogits"]
