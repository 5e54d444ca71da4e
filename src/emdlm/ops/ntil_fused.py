"""Fused CE + NTIL: one [N, V] gradient buffer, NTIL's sparse gradient written into it.

Same value and logits gradient as the reference :func:`emdlm.functional.ntil.ntil_loss` (tested
equal to float32 tolerance), at about the cost of cross-entropy alone (GUIDE §2):

* forward: chunk over rows in float32; per chunk log-softmax is written straight into the
  buffer (float32 logits) or a chunk temporary, the CE of the gold tokens is read off it, then it
  is turned in place into softmax − onehot (the CE gradient, unscaled). log-softmax and the
  gradient are never both kept.
* NTIL runs on the small [M, K] class-candidate logits with autograd enabled locally on a
  detached float64 leaf (:func:`emdlm.functional.ntil.ntil_terms`); its gradient, times the mix
  coefficient (λ·sg(CE/NTIL) or λ) and the counted-token number n, is scatter-added into the
  buffer rows of the number positions.
* ``averaging="token"`` (terms summed over the batch, divided by n) needs nothing special: n is
  passed to :func:`~emdlm.functional.ntil.ntil_terms`, so the fused value and gradient are the
  reference's for every averaging.
* backward multiplies the buffer in place by grad_output · c (c = 1/n for "mean", 1 for "sum")
  and returns it: no second [N, V] tensor. The graph can therefore be back-propagated once.

Shape notation: N = B·T flattened positions, V vocabulary rows, M number tokens, K candidates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from emdlm.functional._common import compute_dtype
from emdlm.functional.ntil import (
    ClassCandidates,
    NTILSettings,
    NTILTerms,
    mix_coefficient,
    ntil_terms,
)
from emdlm.numbers import NumberSpans
from emdlm.ops._compile import eager_under_compile
from emdlm.ops._handover import hand_over_gradients

#: Elements per chunk (64 MiB of float32): float32 logits are written straight into the buffer,
#: other dtypes use one float32 temporary of this size. Larger chunks ran faster on CPU.
DEFAULT_CHUNK_ELEMENTS = 1 << 24

COMPONENT_NAMES = ("ce", "emd", "relative", "magnitude", "ntil", "mix_coef")


def _row_chunks(logits: torch.Tensor, chunk_rows: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (start, stop, [stop−start, V] view) over the flattened rows of ``logits``.

    Works for non-contiguous views such as ``logits[:, :-1]`` without copying them whole.
    """
    vocab_rows = logits.shape[-1]
    try:
        flat = logits.view(-1, vocab_rows)
    except RuntimeError:
        flat = None
    if flat is not None:
        for start in range(0, flat.shape[0], chunk_rows):
            stop = min(start + chunk_rows, flat.shape[0])
            yield start, stop, flat[start:stop]
        return
    rows = logits.reshape(-1, logits.shape[-2], vocab_rows) if logits.dim() > 2 else logits[None]
    time = rows.shape[1]
    for b in range(rows.shape[0]):
        for start in range(0, time, chunk_rows):
            stop = min(start + chunk_rows, time)
            yield b * time + start, b * time + stop, rows[b, start:stop]


def gather_class_logits(
    logits: torch.Tensor, flat_index: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """[M, K] logits at (flattened position, candidate id) without copying the whole logits."""
    vocab_rows = logits.shape[-1]
    try:
        return logits.view(-1, vocab_rows)[flat_index.unsqueeze(1), ids]
    except RuntimeError:
        time = logits.shape[-2]
        rows = logits.reshape(-1, time, vocab_rows)
        b, t = flat_index // time, flat_index % time
        return rows[b.unsqueeze(1), t.unsqueeze(1), ids]


def ce_grad_forward(
    logits: torch.Tensor,
    flat_labels: torch.Tensor,
    ignore_index: int,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE sum (float64, 0-d) and the [N, V] buffer softmax − onehot (zero on ignored rows).

    Ignored rows are masked with ``where`` / ``index_fill_`` (never multiplied by 0), so a NaN
    or ±inf logit at a padding position changes neither the sum nor any other row's gradient.

    The buffer has the logits' dtype; the math is float32 (float64 for float64 logits).
    """
    vocab_rows = logits.shape[-1]
    n = flat_labels.numel()
    buffer = torch.empty((n, vocab_rows), dtype=logits.dtype, device=logits.device)
    chunk_rows = max(1, chunk_elements // max(vocab_rows, 1))
    valid = flat_labels != ignore_index  # [N]
    safe = torch.where(valid, flat_labels, 0).unsqueeze(1)  # [N, 1]
    compute = compute_dtype(logits.dtype)
    minus_valid = -valid.to(compute).unsqueeze(1)  # [N, 1]
    ce_sum = torch.zeros((), dtype=torch.float64, device=logits.device)
    direct = logits.dtype == compute  # write log-softmax straight into the buffer
    for start, stop, chunk in _row_chunks(logits, chunk_rows):
        if direct:
            work = torch.log_softmax(chunk, dim=-1, out=buffer[start:stop])  # [c, V]
        else:
            work = torch.log_softmax(chunk.to(compute), dim=-1)  # [c, V] float32 temporary
        gold_logp = work.gather(1, safe[start:stop]).squeeze(1)  # [c]
        # where, not a multiply: an ignored row may hold NaN / ±inf (0·NaN = NaN).
        gold_logp = torch.where(valid[start:stop], gold_logp, 0.0)
        ce_sum = ce_sum - gold_logp.sum(dtype=torch.float64)
        work.exp_().scatter_add_(1, safe[start:stop], minus_valid[start:stop])
        if not direct:
            buffer[start:stop].copy_(work)
    ignored = (~valid).nonzero().squeeze(1)  # one sync per batch
    if ignored.numel():
        buffer.index_fill_(0, ignored, 0.0)
    return ce_sum, buffer


class NTILFusedFunction(torch.autograd.Function):
    """Autograd Function: (logits, labels, spans, candidates, ...) -> (loss, components)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        spans: NumberSpans,
        candidates: ClassCandidates,
        n_rows: int,
        settings: NTILSettings,
        noise: torch.Tensor | None,
        chunk_elements: int,
        inplace_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat_labels = labels.reshape(-1).long()  # [N]
        ce_sum, buffer = ce_grad_forward(logits, flat_labels, settings.ignore_index, chunk_elements)
        count = (flat_labels != settings.ignore_index).sum()
        count_f = count.to(torch.float64)
        ce_mean = ce_sum / count_f.clamp_min(1)

        class_logits = gather_class_logits(logits.detach(), spans.flat_index, candidates.ids)
        leaf = class_logits.double().requires_grad_(True)  # [M, K]
        with torch.enable_grad():
            terms: NTILTerms = ntil_terms(
                leaf, candidates, spans, n_rows, settings, noise, n_tokens=count
            )
            coef = mix_coefficient(ce_mean, terms.ntil, settings)
            if spans.n_tokens > 0:
                (grad_z,) = torch.autograd.grad(terms.ntil, leaf, allow_unused=True)
                if grad_z is not None:
                    scaled = grad_z * (coef * count_f)  # [M, K] float64
                    rows = spans.flat_index.unsqueeze(1).expand_as(candidates.ids)
                    buffer.index_put_(
                        (rows, candidates.ids), scaled.to(buffer.dtype), accumulate=True
                    )
        ntil = terms.ntil.detach()
        if settings.reduction == "sum":
            loss = ce_sum + count_f * coef * ntil
            ctx.scale = None  # c = 1
        else:
            loss = ce_mean + coef * ntil
            ctx.scale = 1.0 / count_f.clamp_min(1)
        ctx.buffer = (buffer,)
        ctx.inplace_backward = inplace_backward
        ctx.logits_shape = logits.shape
        components = torch.stack(
            [
                ce_mean,
                terms.emd.detach(),
                terms.relative.detach(),
                terms.magnitude.detach(),
                ntil,
                coef.detach(),
            ]
        ).float()
        ctx.mark_non_differentiable(components)
        return loss.to(compute_dtype(logits.dtype)), components

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_components: torch.Tensor) -> tuple:
        factor = grad_loss.to(torch.float64)
        if ctx.scale is not None:
            factor = factor * ctx.scale
        (grad_logits,) = hand_over_gradients(ctx, "buffer", factor, "NTILFusedFunction")
        grad_logits = grad_logits.view(ctx.logits_shape)
        # logits, labels, spans, candidates, n_rows, settings, noise, chunk_elements, inplace
        return grad_logits, None, None, None, None, None, None, None, None


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

    ``inplace_backward=True`` (default) scales the gradient buffer in place and hands it out:
    no second [N, V] tensor, but the graph can be back-propagated only once. False keeps the
    buffer (one extra [N, V] tensor per backward), e.g. for gradcheck.
    """
    loss, packed = NTILFusedFunction.apply(
        logits,
        labels,
        spans,
        candidates,
        n_rows,
        settings,
        noise,
        chunk_elements,
        inplace_backward,
    )
    components: dict[str, torch.Tensor] = dict(zip(COMPONENT_NAMES, packed.unbind(0), strict=True))
    count = (labels != settings.ignore_index).sum()
    components.update(
        n_numbers=torch.tensor(spans.n_numbers),
        n_digit_tokens=torch.tensor(spans.n_tokens),
        n_tokens=count,
    )
    return loss, components
