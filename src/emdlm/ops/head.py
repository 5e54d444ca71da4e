"""The LM head of a chunked call and its options: z = cap·tanh(s·(h Wᵀ + b)/cap).

The from-hidden driver (:func:`emdlm.ops.chunked.chunked_linear_loss`) applies the head chunk
by chunk in its own buffers (:func:`head_chunk_logits`); :func:`head_logits` is the same head
with autograd, for a caller that needs a few rows of it again. The scale s is a model's
``logit_scale`` (Cohere), the soft-cap cap Gemma-2's ``final_logit_softcapping``
(transformers src/transformers/models/gemma2/modeling_gemma2.py); both are optional.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_logits_labels_shapes,
    check_reduction,
    compute_dtype,
)
from emdlm.ops._chunking import check_chunk_size

#: Elements (V x rows) of one chunk buffer by default: 256 MiB of float32 (why: the
#: docstring of :mod:`emdlm.ops.chunked`).
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(vocab: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one [rows, V] buffer holds about ``chunk_elements`` values."""
    return max(1, chunk_elements // max(vocab, 1))


@dataclass(frozen=True)
class HeadOptions:
    """Options of the head and of the loop.

    Attributes:
        ignore_index: label value that is not scored.
        reduction: "mean" over counted labels or "sum".
        chunk_size: rows per chunk (None: :func:`default_chunk_rows`).
        logit_scale: s, z = s·(hWᵀ + b) (e.g. Cohere's ``logit_scale``); None = 1. From hidden
            states only.
        softcap: cap, z = cap·tanh(z / cap) (Gemma-2's ``final_logit_softcapping``); None = off.
            From hidden states only.
    """

    ignore_index: int = IGNORE_INDEX
    reduction: Reduction = "mean"
    chunk_size: int | None = None
    logit_scale: float | None = None
    softcap: float | None = None


def check_head_options(options: HeadOptions) -> None:
    """Clear errors for bad head options."""
    check_reduction(options.reduction)
    if options.chunk_size is not None:
        check_chunk_size(options.chunk_size)
    for name in ("logit_scale", "softcap"):
        value = getattr(options, name)
        if value is not None and not (0 < float(value) < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")


def stand_in_logits(hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    """A zero-stride [..., V] stand-in for the logits of the head over ``hidden`` [..., H]
    (no memory): what the shape checks and a loss's ``chunk_objective`` read of the logits
    (shape, vocabulary size, dtype, device) when there are none."""
    return hidden.new_zeros(()).expand(*hidden.shape[:-1], vocab)


def check_linear_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    *,
    check_range: bool = True,
) -> None:
    """Clear errors for a head ``hidden [..., H] @ weight [V, H]ᵀ + bias [V]`` and its labels
    (``check_range=False``: shapes and dtypes only, no host sync)."""
    if not torch.is_floating_point(hidden) or not torch.is_floating_point(weight):
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2 or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H] with H = hidden.shape[-1]; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape [V] = {tuple(weight.shape[:1])} and dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    stand_in = stand_in_logits(hidden, weight.shape[0])
    if check_range:
        check_logits_labels(stand_in, labels, ignore_index)
    else:  # the drivers fold the range check into the one host sync of their call
        check_logits_labels_shapes(stand_in, labels)


def logit_transforms(
    z: torch.Tensor, options: HeadOptions, tanh_buf: torch.Tensor | None = None
) -> torch.Tensor:
    """z ← cap·tanh(s·z/cap) (scale and soft-cap as ``options`` ask), in place on ``z``; tanh
    kept in ``tanh_buf`` when given (the driver's buffer), else out of place (autograd)."""
    if options.logit_scale is not None:
        z = z.mul_(options.logit_scale)
    if options.softcap is not None:
        cap = float(options.softcap)
        if tanh_buf is None:
            return cap * torch.tanh(z / cap)
        torch.tanh(torch.div(z, cap, out=tanh_buf), out=tanh_buf)
        z = torch.mul(tanh_buf, cap, out=z)
    return z


def head_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, options: HeadOptions
) -> torch.Tensor:
    """z = cap·tanh(s·(h Wᵀ + b)/cap) [n, V] in the compute dtype, with autograd: the head the
    from-hidden driver applies chunk by chunk (same dtypes and order of operations), for a
    caller that needs a few rows of it again (number-level NTL's reweigh term)."""
    raw = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)  # input dtype
    z = raw.to(compute_dtype(h.dtype))
    return logit_transforms(z, options)


def head_chunk_logits(
    h_c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    raw: torch.Tensor,
    staged: torch.Tensor | None,
    tanh_buf: torch.Tensor | None,
    options: HeadOptions,
) -> torch.Tensor:
    """:func:`head_logits` of chunk ``h_c`` in the driver's buffers (``raw`` the head output,
    ``staged`` its compute-dtype copy, ``tanh_buf`` tanh for the soft-cap's backward)."""
    if bias is None:
        torch.mm(h_c, weight.T, out=raw)  # [n, V]
    else:
        torch.addmm(bias, h_c, weight.T, out=raw)
    z = raw if staged is None else staged.copy_(raw)  # [n, V] compute dtype
    return logit_transforms(z, options, tanh_buf)


__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "HeadOptions",
    "check_head_options",
    "check_linear_inputs",
    "default_chunk_rows",
    "head_chunk_logits",
    "head_logits",
    "logit_transforms",
    "stand_in_logits",
]
