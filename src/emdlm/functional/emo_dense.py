"""EMO distillation to a dense target (a teacher's softmax): reference implementation.

Source: Ren et al., "EMO: Earth Mover Distance Optimization for Auto-Regressive Language
Modeling", ICLR 2024, Sec. 3.2, Eq. 15 (the generalized DEMD for a dense target), mixed as in
Eq. 19 / the ``emoloss`` package (see :mod:`emdlm.functional.emo`).

Per scored position t, with student q_t = softmax(z_t), target p_t = softmax(u_t / τ) (u the
teacher's logits, τ the teacher temperature; the student is NOT softened) and Ê the row-normalized
cost embedding (cost C = 1 - Ê Êᵀ):

    DEMD_t = |q_t - p_t|ᵀ C p_t = Σ_i |q_ti - p_ti| · w_ti,   w_t = C p_t = (Σp_t) - Ê (Êᵀ p_t)

(equivalently Σ|q - p| · Σp - (|q - p|ᵀ Ê) · (Êᵀ p)); no V x V matrix is built. It is 0 when
q = p and it stayed >= the exact EMD with the cosine cost on every random case we tested
(tests/test_emo_distill.py, POT ``ot.emd2``). At q_i = p_i the |·| has no derivative: autograd
(and the chunked path) take the subgradient 0 there.

The "base" term B_t that DEMD is mixed with:

* ``"kl"``: KL(p_t ‖ q_t) = Σ_i p_ti (log p_ti - log q_ti) (0·log 0 = 0), the usual distillation
  loss (Hinton et al. 2015 without the student temperature and the τ² factor);
* ``"ce"``: CE to the gold token, -log q_t(y_t);
* ``"none"``: 0 (pure DEMD; only with mode "static").

and the mix (EMO's modes, with B in place of the gold CE; sg = stop-gradient):

* ``"static"``: B + mu · DEMD;
* ``"emo1"`` (Eq. 19): 0.5 · (B + sg(B / DEMD) · DEMD);
* ``"emo2"`` (``emoloss`` mode 2): DEMD + sg(DEMD / B) · B.

Values are summed over the scored positions (labels != ignore_index) and, for "mean", divided by
their count. No gradient flows to the teacher logits.

Shape notation: B batch, T time, V vocabulary, N = B*T positions, d' cost-embedding width.
"""

from __future__ import annotations

from typing import Literal

import torch

from emdlm._output import LossOutput
from emdlm.domains import POSITIVE, UNIT, domain_problems
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    compute_dtype,
    reduce_sum,
)
from emdlm.functional.emo import EMOMode, check_emo_options, mix_emo

DistillBase = Literal["kl", "ce", "none"]
DISTILL_BASES: tuple[str, ...] = ("kl", "ce", "none")


def check_distill_options(
    base: str, mode: str, mu: float, max_ratio: float | None, temperature: float
) -> None:
    """Validate the options of the EMO distillation loss (ValueError naming the bad one)."""
    check_emo_options(mode, mu, max_ratio)
    if base not in DISTILL_BASES:
        raise ValueError(f"base must be one of {DISTILL_BASES}, got {base!r}")
    if base == "none" and mode != "static":
        raise ValueError(
            f"base='none' (pure DEMD) only works with mode='static'; mode={mode!r} weights DEMD "
            "by a ratio to the base term"
        )
    _check_temperature(temperature)


def check_kl_distill_options(alpha: float, temperature: float) -> None:
    """Validate the options of the CE + KL distillation baseline (ValueError naming the bad
    one, in the words of the objective registry's domains: α in [0, 1], τ finite and > 0)."""
    problems = domain_problems({"alpha": UNIT}, {"alpha": alpha})
    if problems:
        raise ValueError(problems[0])
    _check_temperature(temperature)


def _check_temperature(temperature: float) -> None:
    """τ of a softmax: a finite number > 0 (``POSITIVE``; inf would flatten the teacher)."""
    problems = domain_problems({"temperature": POSITIVE}, {"temperature": temperature})
    if problems:
        raise ValueError(problems[0])


def check_teacher_logits(logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    """Teacher logits must be floating, of the student's shape, on its device, and frozen."""
    if not torch.is_floating_point(teacher_logits):
        raise TypeError(f"teacher_logits must be floating point, got {teacher_logits.dtype}")
    if tuple(teacher_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"teacher_logits must have the student logits' shape [..., V]: student "
            f"{tuple(logits.shape)}, teacher {tuple(teacher_logits.shape)} (same tokenizer, same "
            "inputs, same shift)"
        )
    if teacher_logits.device != logits.device:
        raise ValueError(
            f"teacher_logits are on {teacher_logits.device} but the student logits on "
            f"{logits.device}"
        )
    if teacher_logits.requires_grad:
        raise ValueError(
            "teacher_logits require grad, but distillation gives the teacher no gradient: pass "
            "teacher_logits.detach() (or compute them under torch.no_grad())"
        )


def emo_distill_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding_normalized: torch.Tensor,
    *,
    base: DistillBase = "kl",
    mode: EMOMode = "static",
    mu: float = 1.0,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    max_ratio: float | None = None,
) -> LossOutput:
    """EMO distillation loss B + DEMD mix (module docstring), plain autograd (the reference).

    Args:
        logits: student z [..., V], any float dtype (computed in float32; float64 kept).
        teacher_logits: u [..., V], same shape, detached.
        labels: y [...]: ``ignore_index`` marks unscored positions; the gold token is used only
            by base "ce".
        cost_embedding_normalized: Ê [V, d'] (``normalize_cost_embedding``).
        base, mode, mu, max_ratio: the mix (module docstring); temperature: τ of the teacher.
        reduction: "mean" over the scored positions or "sum".

    Returns:
        LossOutput with components "base", "demd" (means over scored positions), "n_tokens".
    """
    check_distill_options(base, mode, mu, max_ratio, temperature)
    check_logits_labels(logits, labels, ignore_index)
    check_teacher_logits(logits, teacher_logits)
    vocab = logits.shape[-1]
    if cost_embedding_normalized.dim() != 2 or cost_embedding_normalized.shape[0] != vocab:
        raise ValueError(
            f"cost embedding must have shape [V={vocab}, d'], got "
            f"{tuple(cost_embedding_normalized.shape)}"
        )
    dtype = compute_dtype(logits.dtype)
    flat_labels = labels.reshape(-1).long()
    valid = flat_labels != ignore_index  # [N]
    keep = valid[:, None]
    # Ignored rows may hold NaN / inf (padding): replace them so no NaN reaches a gradient.
    z = torch.where(keep, logits.reshape(-1, vocab).to(dtype), 0.0)  # [N, V]
    u = torch.where(keep, teacher_logits.reshape(-1, vocab).to(dtype) / temperature, 0.0)
    log_q = torch.log_softmax(z, dim=-1)
    log_p = torch.log_softmax(u, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    emb = cost_embedding_normalized.to(device=z.device, dtype=dtype)  # [V, d']
    cost_p = p.sum(-1, keepdim=True) - (p @ emb) @ emb.T  # w = C p: [N, V]
    demd = ((q - p).abs() * cost_p).sum(-1)  # [N]; abs' gradient at 0 is 0
    if base == "kl":
        base_value = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    elif base == "ce":
        safe = torch.where(valid, flat_labels, 0)
        base_value = -log_q.gather(1, safe[:, None]).squeeze(1)
    else:
        base_value = torch.zeros_like(demd)
    zero = torch.zeros((), dtype=dtype, device=z.device)
    base_value = torch.where(valid, base_value, zero)
    demd = torch.where(valid, demd, zero)
    per_token = mix_emo(base_value, demd, mode=mode, mu=mu, max_ratio=max_ratio)
    count = valid.sum()
    denom = count.clamp_min(1).to(dtype)
    return LossOutput(
        loss=reduce_sum(per_token, count, reduction),
        components={
            "base": base_value.detach().sum() / denom,
            "demd": demd.detach().sum() / denom,
            "n_tokens": count,
        },
    )


def kl_distill_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    alpha: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> LossOutput:
    """The usual distillation baseline: per token (1 - α)·CE(y) + α·τ²·KL(p_τ ‖ q_τ).

    p_τ = softmax(u/τ), q_τ = softmax(z/τ) (Hinton, Vinyals & Dean 2015, "Distilling the
    Knowledge in a Neural Network", Sec. 2: both softened, KL scaled by τ² so its gradient does
    not shrink with τ). Plain autograd.

    Returns:
        LossOutput with components "ce", "kl" (τ²·KL; means over scored positions), "n_tokens".
    """
    check_kl_distill_options(alpha, temperature)
    check_logits_labels(logits, labels, ignore_index)
    check_teacher_logits(logits, teacher_logits)
    vocab = logits.shape[-1]
    dtype = compute_dtype(logits.dtype)
    flat_labels = labels.reshape(-1).long()
    valid = flat_labels != ignore_index
    keep = valid[:, None]
    z = torch.where(keep, logits.reshape(-1, vocab).to(dtype), 0.0)
    u = torch.where(keep, teacher_logits.reshape(-1, vocab).to(dtype), 0.0)
    log_q = torch.log_softmax(z, dim=-1)
    safe = torch.where(valid, flat_labels, 0)
    ce = -log_q.gather(1, safe[:, None]).squeeze(1)
    if temperature == 1.0:  # the usual case: no second student log-softmax
        log_qt, log_pt = log_q, torch.log_softmax(u, dim=-1)
    else:
        log_qt = torch.log_softmax(z / temperature, dim=-1)
        log_pt = torch.log_softmax(u / temperature, dim=-1)
    p_t = log_pt.exp()
    kl = torch.where(p_t > 0, p_t * (log_pt - log_qt), 0.0).sum(-1) * temperature**2
    zero = torch.zeros((), dtype=dtype, device=z.device)
    ce, kl = torch.where(valid, ce, zero), torch.where(valid, kl, zero)
    per_token = (1.0 - alpha) * ce + alpha * kl
    count = valid.sum()
    denom = count.clamp_min(1).to(dtype)
    return LossOutput(
        loss=reduce_sum(per_token, count, reduction),
        components={
            "ce": ce.detach().sum() / denom,
            "kl": kl.detach().sum() / denom,
            "n_tokens": count,
        },
    )


__all__ = [
    "DISTILL_BASES",
    "DistillBase",
    "check_distill_options",
    "check_kl_distill_options",
    "check_teacher_logits",
    "emo_distill_loss",
    "kl_distill_loss",
]
