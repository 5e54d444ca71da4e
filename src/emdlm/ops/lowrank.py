"""Low-rank cost embedding: trade DEMD's exactness for a cheaper S = Ê[y]·Êᵀ matmul.

EMO's cost only enters through the Gram matrix G = Ê Êᵀ (cosine similarities; EMO Eq. 14). The best
rank-r approximation of G in any unitarily invariant norm keeps the top r principal directions
of Ê (Eckart–Young), computed here without centering (centering would change the inner products):

    ÊᵀÊ = U Λ Uᵀ  (d' × d', float64 eigendecomposition),   Ê_r = Ê U_r   [V, r]

Rows of Ê_r are then re-normalized to unit length, so C_r(i, i) = 0 and DEMD_r stays in [0, 2]
(with a one-hot target, ≥ 0). The matmul in the chunked paths costs r/d' of the exact one; the
error in DEMD is measured by ``benchmarks/bench_emo.py``. This is an approximation the EMO paper
does not make: an option, never a default.

Shape notation: V vocabulary, d' cost width, r rank.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def lowrank_cost_embedding(cost_embedding: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank-``rank`` cost embedding Ê_r [V, rank] (top principal directions, rows re-normalized).

    Args:
        cost_embedding: Ê [V, d'] (row-normalized or not: rows of the result are unit length).
        rank: 1 <= rank <= d'. ``rank == d'`` reproduces Ê's Gram matrix exactly (a rotation).

    Returns:
        Ê_r in the input's dtype and device.
    """
    if cost_embedding.dim() != 2 or not torch.is_floating_point(cost_embedding):
        raise ValueError(
            f"cost_embedding must be a float [V, d'] matrix, got {tuple(cost_embedding.shape)} "
            f"{cost_embedding.dtype}"
        )
    width = cost_embedding.shape[1]
    if not isinstance(rank, int) or not 1 <= rank <= width:
        raise ValueError(f"rank must be an int in [1, {width}] (the cost width), got {rank!r}")
    e64 = cost_embedding.detach().to(torch.float64)
    _evals, evecs = torch.linalg.eigh(e64.T @ e64)  # ascending eigenvalues, [d', d']
    top = evecs[:, -rank:].flip(-1)  # [d', r] largest first
    reduced = torch.nn.functional.normalize(e64 @ top, dim=-1)  # [V, r]
    return reduced.to(cost_embedding.dtype)
