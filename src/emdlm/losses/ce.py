"""Cross-entropy with the emdlm loss interface (the MLE / CE baseline), with Liger's options:
label smoothing, z-loss, token accuracy and predicted tokens, and TRL's logged entropy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    check_reduction,
    compute_dtype,
    log_softmax_zero_ignored,
)
from emdlm.losses.base import EMDLMLoss

if TYPE_CHECKING:
    from emdlm.ops.chunk_objective import ChunkObjective


class CrossEntropyLoss(EMDLMLoss):
    """Token-level cross-entropy, CE_t = -log softmax(z_t)[y_t], computed in float32.

    With the options (the definitions of Liger-Kernel's ``LigerCrossEntropyLoss`` and
    ``LigerFusedLinearCrossEntropyLoss``, linkedin/Liger-Kernel src/liger_kernel/ops/
    cross_entropy.py; the smoothing is also ``F.cross_entropy(label_smoothing=ε)``'s), per
    counted token:

        L_t = (1 − ε)·CE_t + ε·(1/V)·Σ_v −log q_t(v) + s·lse_t²,   lse_t = logsumexp(z_t)

    averaged over the counted tokens (ignored positions take no part, in the smoothing term
    too). s·lse² is PaLM's z-loss (Chowdhery et al. 2022, Sec. 5), Liger's ``lse_square_scale``.
    The defaults (ε = 0, s = 0) are plain CE, ``F.nll_loss`` of the log-softmax.

    float64 logits are computed and returned in float64, as every other emdlm loss does
    (:func:`emdlm.functional._common.compute_dtype`). Ignored positions get an exact zero
    gradient even when their logits are NaN or infinite (padding never leaks).

    Args:
        ignore_index: label value that is not scored (default -100).
        reduction: "mean" over counted tokens, or "sum" (for integrations that divide by a
            global token count, e.g. transformers' ``num_items_in_batch``).
        label_smoothing: ε in [0, 1].
        z_loss: s ≥ 0, the weight of lse² (PaLM used 1e-4).
        token_accuracy: report "token_accuracy", the share of counted tokens whose argmax is the
            label (ties: the first maximal id, as ``torch.argmax``); costs one more read of the
            logits.
        entropy: report "entropy", the mean over counted tokens of the predicted distribution's
            entropy H_t = −Σ_v q_t(v)·log q_t(v) (nats; TRL's logged entropy), from the fused
            from-hidden path's chunks as well (no [N, V] logits).
        predicted_tokens: return ``out.predicted_tokens``, the argmax token id at every
            position (labels' shape, long; ``ignore_index`` where the label is ignored; ties:
            the first maximal id, as ``torch.argmax``), Liger-Kernel's
            ``return_predicted_tokens``; from hidden states taken chunk by chunk (one [n] long
            per chunk, no [N, V] logits, no host sync), equal to the logits path's.

    Call: ``out = loss_fn(logits [B, T, V], labels [B, T])`` with labels aligned to the logits
    (no shift inside). ``out.components``: "ce" (mean plain CE over counted tokens), "n_tokens",
    and "z_loss" (mean s·lse²) when s > 0, "token_accuracy" and "entropy" when asked;
    ``out.predicted_tokens`` when asked.

    Example:
        >>> loss_fn = CrossEntropyLoss(label_smoothing=0.1, token_accuracy=True)
        >>> out = loss_fn(torch.tensor([[[2.0, 0.0, 0.0]]]), torch.tensor([[0]]))
        >>> float(out.components["token_accuracy"])
        1.0
    """

    takes_loss_weights = True  # per-token weights (EMDLMLoss.weighted_logits_loss)

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        token_accuracy: bool = False,
        entropy: bool = False,
        predicted_tokens: bool = False,
    ) -> None:
        super().__init__()
        check_reduction(reduction)
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing!r}")
        if not 0.0 <= float(z_loss) < float("inf"):
            raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.z_loss = float(z_loss)
        self.token_accuracy = bool(token_accuracy)
        self.entropy = bool(entropy)
        self.predicted_tokens = bool(predicted_tokens)

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        check_logits_labels(logits, labels, self.ignore_index)
        flat_logits = logits.reshape(-1, logits.shape[-1]).to(compute_dtype(logits.dtype))
        flat_labels = labels.reshape(-1).long()  # [N]
        valid = flat_labels != self.ignore_index  # [N]
        log_q = log_softmax_zero_ignored(flat_logits, valid)  # [N, V]
        count = valid.sum()
        eps, s = self.label_smoothing, self.z_loss
        components: dict[str, torch.Tensor | float] = {}
        if eps == 0.0 and s == 0.0:
            # F.cross_entropy is exactly nll_loss(log_softmax); ours zeroes ignored rows' gradient.
            total = F.nll_loss(log_q, flat_labels, ignore_index=self.ignore_index, reduction="sum")
            mean = total / count.clamp_min(1)
        else:
            safe = torch.where(valid, flat_labels, 0).unsqueeze(1)  # [N, 1]
            zero = log_q.new_zeros(())
            # where, not a multiply: an ignored row may hold NaN / ±inf (0·NaN = NaN).
            ce = torch.where(valid, -log_q.gather(1, safe).squeeze(1), zero)  # [N]
            per_token = (1.0 - eps) * ce if eps > 0.0 else ce
            if eps > 0.0:
                smooth = torch.where(valid, -log_q.mean(dim=-1), zero)  # (1/V)·Σ_v −log q_v
                per_token = per_token + eps * smooth
            if s > 0.0:
                # lse = z_y − log q_y: through log q, whose backward zeroes ignored rows.
                lse = torch.where(valid, flat_logits.gather(1, safe).squeeze(1) + ce, zero)
                lse_sq = lse * lse  # [N]
                per_token = per_token + s * lse_sq
                components["z_loss"] = s * lse_sq.detach().sum() / count.clamp_min(1)
            total = per_token.sum()
            mean = ce.detach().sum() / count.clamp_min(1)
            total_mean = total / count.clamp_min(1)
        predicted = None
        if self.token_accuracy or self.predicted_tokens:
            with torch.no_grad():
                top = logits.reshape(-1, logits.shape[-1]).argmax(dim=-1)  # [N]
                if self.predicted_tokens:
                    predicted = torch.where(valid, top, self.ignore_index).view(labels.shape)
        if self.token_accuracy:
            with torch.no_grad():
                hits = (top == flat_labels) & valid
                components["token_accuracy"] = hits.sum().to(mean.dtype) / count.clamp_min(1)
        if self.entropy:
            with torch.no_grad():
                q = log_q.exp()
                h = -torch.special.xlogy(q, q).sum(dim=-1)  # [N]
                h = torch.where(valid, h, h.new_zeros(()))
                components["entropy"] = h.sum() / count.clamp_min(1).to(h.dtype)
        if eps == 0.0 and s == 0.0:
            loss = total if self.reduction == "sum" else mean
        else:
            loss = total if self.reduction == "sum" else total_mean
        return LossOutput(
            loss=loss, components={"ce": mean.detach(), "n_tokens": count, **components},
            predicted_tokens=predicted,
        )

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[ChunkObjective, torch.Tensor]:
        """A :class:`~emdlm.ops.objectives.ce.WeightedCEObjective` (weight local to each token)."""
        from emdlm.ops.objectives.ce import WeightedCEObjective

        eps = self.label_smoothing
        objective = WeightedCEObjective(
            None,
            eps,
            gold_scale=1.0 - eps,
            z_loss=self.z_loss,
            token_accuracy=self.token_accuracy,
            entropy=self.entropy,
            predicted_tokens=self.predicted_tokens,
        )
        return objective, labels

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, token_accuracy={self.token_accuracy}, entropy={self.entropy}, "
            f"predicted_tokens={self.predicted_tokens}"
        )
