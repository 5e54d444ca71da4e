"""Input checks, reductions and CE mixing shared by every objective.

Shape notation: B batch, T time, V vocabulary rows of the logits, N = B*T flattened positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from emdlm._output import LossOutput

Reduction = Literal["mean", "sum"]
#: The label value that is not scored (the default ``ignore_index`` of
#: ``torch.nn.functional.cross_entropy``).
IGNORE_INDEX = -100


def check_logits_labels_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """The checks of :func:`check_logits_labels` that need no value (dtypes and shapes): no
    host sync. The chunked drivers run these first and fold the label-range check into the one
    host read of their call (:func:`bad_label_count`, :func:`label_range_error`)."""
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [..., V], got {tuple(logits.shape)}")
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)} need labels of shape "
            f"{tuple(logits.shape[:-1])}, got labels {tuple(labels.shape)}"
        )


def _bad_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """[...] bool: counted labels outside [0, V)."""
    # Compare in int64: with int16 / int8 / uint8 labels torch casts the Python scalars V and
    # ignore_index to the labels' dtype, where they wrap (50257 -> -15279 in int16, -100 -> 156
    # in uint8), so valid labels read as out of range and real ones as ignored.
    labels = labels.long()
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab))


def bad_label_count(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """0-d long: how many counted labels lie outside [0, V) (no host sync; read it together
    with the call's other sizes, then raise :func:`label_range_error` when it is not 0)."""
    return _bad_labels(labels, vocab, ignore_index).sum()


def label_range_error(labels: torch.Tensor, vocab: int, ignore_index: int) -> ValueError:
    """The error for labels outside [0, V), naming up to 5 of them (reads them: error path)."""
    bad_values = labels.long()[_bad_labels(labels, vocab, ignore_index)].unique()[:5].tolist()
    return ValueError(
        f"labels out of range for a vocabulary of {vocab} logit rows: found {bad_values} "
        f"(labels must be in [0, {vocab}) or equal ignore_index={ignore_index})"
    )


def check_logits_labels(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> None:
    """Raise a clear error for malformed inputs; one host sync (the label-range check).

    Checks: logits are floating point with a trailing vocab dim, labels are integer (int64,
    int32, int16, int8 or uint8; compared as int64) with the logits' leading shape, every
    non-ignored label lies in [0, V).
    """
    check_logits_labels_shapes(logits, labels)
    vocab = logits.shape[-1]
    # One reduction and a single host sync for the whole batch (not per token).
    if bool(_bad_labels(labels, vocab, ignore_index).any()):
        raise label_range_error(labels, vocab, ignore_index)


def check_reduction(reduction: str) -> None:
    """Raise a clear error unless ``reduction`` is "mean" or "sum"."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def reduce_sum(per_item: torch.Tensor, count: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """Finish a reduction: ``sum`` as is, ``mean`` divided by ``max(count, 1)``.

    With nothing counted the mean is an explicit zero that still carries the graph.
    """
    total = per_item.sum()
    if reduction == "sum":
        return total
    check_reduction(reduction)
    return total / count.clamp_min(1).to(total.dtype)


@dataclass(frozen=True)
class TokenLogProbs:
    """Per-position log-probabilities and CE of a flattened batch (see :func:`token_log_probs`).

    Attributes:
        log_q: [N, V] log-softmax in the compute dtype (float64 stays float64, else float32).
        ce: [N] CE_t = -log q_t(y_t), 0 at ignored positions.
        valid: [N] bool, label is counted.
        safe_labels: [N] labels with ignored positions replaced by 0 (safe to gather with).
        count: 0-d number of counted labels.
    """

    log_q: torch.Tensor
    ce: torch.Tensor
    valid: torch.Tensor
    safe_labels: torch.Tensor
    count: torch.Tensor


def token_weighted_ce_output(
    tokens: TokenLogProbs,
    per_token: torch.Tensor,
    multiplier: torch.Tensor,
    reduction: Reduction,
) -> LossOutput:
    """The output of a CE whose tokens are weighted by a detached multiplier m_t (DFT, MixCE,
    TaiLr): the loss Σ_t L_t (``per_token`` [N]) reduced by :func:`reduce_sum`, and over the n
    counted tokens the components

        ce = Σ_t CE_t / max(n, 1),   weight_mean = Σ_t m_t / max(n, 1),   n_tokens = n

    (``multiplier`` [N] is read at the counted tokens only)."""
    ce, count = tokens.ce, tokens.count
    denom = count.clamp_min(1).to(ce.dtype)
    components: dict[str, torch.Tensor | float] = {
        "ce": ce.detach().sum() / denom,
        "weight_mean": torch.where(tokens.valid, multiplier, ce.new_zeros(())).sum() / denom,
        "n_tokens": count,
    }
    return LossOutput(loss=reduce_sum(per_token, count, reduction), components=components)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (gradcheck, exact tests); every other float computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LogSoftmaxZeroIgnored(torch.autograd.Function):
    """log_softmax over the last dim of [N, V]; backward gives ignored rows an exact 0 gradient.

    The log-softmax backward of a row is g − softmax(z)·Σg. For an ignored row g = 0, but a NaN,
    an all −inf row or a +inf logit makes softmax(z) NaN there and 0·NaN = NaN, which would
    reach every weight that produced the row (grad_W = gᵀh): padding would leak into the update.
    The rows are filled with 0 in the gradient this Function allocates itself (no extra [N, V]
    tensor, no multiply).
    """

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = torch.log_softmax(flat, dim=-1)  # [N, V]
        ctx.save_for_backward(out, ignored)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out, ignored = ctx.saved_tensors
        # torch's own log-softmax backward (g − exp(out)·Σg), into a fresh tensor we own.
        grad_in = torch.ops.aten._log_softmax_backward_data(grad, out, out.dim() - 1, out.dtype)
        return grad_in.masked_fill_(ignored.unsqueeze(-1), 0.0), None  # flat, ignored


def log_softmax_zero_ignored(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log_softmax(flat, -1)`` for [N, V] logits whose gradient is exactly 0 where ``valid``
    [N] is False, even when those rows hold NaN or ±inf (padding never leaks).

    Same cost and memory as ``torch.log_softmax``; first-order gradients only.
    """
    if not (flat.requires_grad and torch.is_grad_enabled()):
        return torch.log_softmax(flat, dim=-1)
    return _LogSoftmaxZeroIgnored.apply(flat, ~valid)


def token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> TokenLogProbs:
    """Flatten [..., V] logits and [...] labels, log-softmax, gather the gold CE (no checks)."""
    vocab = logits.shape[-1]
    dtype = compute_dtype(logits.dtype)
    flat_logits = logits.reshape(-1, vocab).to(dtype)  # [N, V]
    flat_labels = labels.reshape(-1).long()  # [N]
    valid = flat_labels != ignore_index  # [N]
    safe_labels = torch.where(valid, flat_labels, 0)  # [N]
    log_q = log_softmax_zero_ignored(flat_logits, valid)  # [N, V]; padding never leaks
    gold = -log_q.gather(1, safe_labels.unsqueeze(1)).squeeze(1)  # [N]
    ce = torch.where(valid, gold, torch.zeros((), dtype=dtype, device=gold.device))
    return TokenLogProbs(
        log_q=log_q, ce=ce, valid=valid, safe_labels=safe_labels, count=valid.sum()
    )
