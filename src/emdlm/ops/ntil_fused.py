"""Fused CE + NTIL on given logits: one [N, V] gradient buffer, NTIL's sparse gradient added to it.

Same value and logits gradient as the reference :func:`emdlm.functional.ntil.ntil_loss` (tested
equal to float32 tolerance), at about the cost of cross-entropy alone (GUIDE §2). A user of the
chunked-loss engine (:func:`emdlm.ops.chunked.chunked_logits_loss`) with the objective NTIL uses
from hidden states too (:class:`emdlm.ops.from_hidden.NTILObjective`):

* forward: chunk over rows in float32; per chunk the CE of the gold tokens and its gradient
  k·(softmax − onehot) are computed in the gradient buffer itself (float32 logits) or in one
  float32 staging buffer, after the [M, K] class-candidate logits of the chunk's number
  positions are copied out.
* NTIL runs on the small [M, K] class-candidate logits with autograd enabled locally on a
  detached float64 leaf (:func:`emdlm.functional.ntil.ntil_terms`); its gradient, times the mix
  coefficient (λ·sg(CE/NTIL) or λ, with the global CE mean) and k·n (n counted tokens), is
  scatter-added into the buffer rows of the number positions.
* ``averaging="token"`` (terms summed over the batch, divided by n) needs nothing special: n is
  passed to :func:`~emdlm.functional.ntil.ntil_terms`, so the fused value and gradient are the
  reference's for every averaging.
* backward multiplies the buffer in place by grad_output and returns it: no second [N, V]
  tensor. The graph can therefore be back-propagated once.

k = 1/n for "mean", 1 for "sum". Shape notation: N = B·T flattened positions, V vocabulary
rows, M number tokens, K candidates.
"""

from __future__ import annotations

import torch

from emdlm.functional.ntil import ClassCandidates, NTILSettings
from emdlm.number_spans import NumberSpans
from emdlm.ops._compile import eager_under_compile
from emdlm.ops.chunked import HeadOptions, chunked_logits_loss, default_chunk_rows
from emdlm.ops.from_hidden import NTILObjective

#: Elements per chunk (64 MiB of float32): float32 logits are worked on in the gradient buffer
#: itself, other dtypes use one float32 staging buffer of this size. Larger chunks ran faster
#: on CPU.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


@eager_under_compile
def ntil_fused(
    logits: torch.Tensor,
    labels: torch.Tensor,
    spans: NumberSpans,
    candidates: ClassCandidates,
    n_rows: int,
    settings: NTILSettings,
    noise: torch.Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    inplace_backward: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Fused CE + NTIL; same contract as :func:`emdlm.functional.ntil.ntil_loss` (inputs are
    assumed validated, spans/candidates/noise precomputed for ``labels``).

    Args:
        logits: [..., V] any float dtype and strides (``logits[:, :-1]`` is read chunk by chunk).
        labels: [...] aligned with the logits; spans / candidates / noise: for these labels.
        n_rows: B, batch rows of the labels (``averaging="row"``).
        settings: the NTIL knobs (reduction and ignore_index included).
        chunk_elements: about V x rows values per chunk (rows = chunk_elements // V).
        inplace_backward: True (default) scales the gradient buffer in place and hands it out:
            no second [N, V] tensor, but the graph can be back-propagated only once. False keeps
            the buffer (one extra [N, V] tensor per backward), e.g. for gradcheck.

    Returns:
        (loss, components): "ce", "emd", "relative", "magnitude", "ntil", "mix_coef",
        "n_numbers", "n_digit_tokens", "n_tokens".
    """
    objective = NTILObjective(spans, candidates, n_rows, settings, noise)
    return ntil_fused_objective(
        logits, labels, objective, settings, chunk_elements, inplace_backward
    )


@eager_under_compile
def ntil_fused_objective(
    logits: torch.Tensor,
    labels: torch.Tensor,
    objective: NTILObjective,
    settings: NTILSettings,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    inplace_backward: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`ntil_fused` for an objective made by the caller, e.g.
    :meth:`NTILObjective.from_draft <emdlm.ops.from_hidden.NTILObjective.from_draft>` (the
    loss modules' path: the span sizes are then read in the engine's one host sync of the
    call, with the label-range check)."""
    options = HeadOptions(
        ignore_index=settings.ignore_index,
        reduction=settings.reduction,
        chunk_size=default_chunk_rows(logits.shape[-1], chunk_elements),
    )
    out = chunked_logits_loss(logits, labels, objective, options, inplace_backward=inplace_backward)
    return out.loss, out.components


__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ntil_fused", "ntil_fused_objective"]
