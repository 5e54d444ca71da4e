"""EMO: Earth Mover Distance Optimization for auto-regressive LMs (reference implementation).

Source: Ren et al., "EMO: Earth Mover Distance Optimization for Auto-Regressive Language
Modeling", ICLR 2024, Sec. 3.1-3.2 (Eq. 8-15) and Appendix A.3 (Eq. 19); official code
DRSY/EMO (language_modeling/gpt2.py, emo_patch.py) and the pip package ``emoloss``
(module ``emo.loss``, v0.0.3).

Cost between tokens: C(v_i, v_j) = 1 - cos(e_i, e_j), with e the rows of a frozen cost embedding
E [V, d'] (usually a copy of a pre-trained LM head; d' need not equal the model's hidden size).
With Ê the row-normalized E, C = 1 - Ê Êᵀ, and for a model distribution q:

* DEMD, one-hot target y (Eq. 14): the transport plan to a one-hot target is unique (all of q
  moves to y), so the bound is exact here: DEMD = Σ_i q_i C(i, y) = 1 - (Êᵀ q) · ê_y.
* Independent-plan bound, dense target p (Eq. 12-13): qᵀ C p = (Σq)(Σp) - (Êᵀq)·(Êᵀp)
  = 1 - (Êᵀ q) · (Êᵀ p); an upper bound on the exact EMD (the plan q ⊗ p is feasible).
* Generalized DEMD, dense target p (Eq. 15): |q - p|ᵀ C p
  = Σ_i |q_i - p_i| · ((Σp) - ê_i · (Êᵀ p)); zero when q = p, equal to DEMD for one-hot p.
  Not proven a bound here, but it stayed >= the exact EMD in every random case we tried
  (benchmarks/emo_bound_looseness.py: about 2-3x EMD, while qᵀCp reaches 6-18x EMD when q is
  close to p, since qᵀCp does not vanish at q = p).

None of these builds a one-hot [N, V] or a V x V matrix: ê_y is gathered and every product goes
through Êᵀq / Êᵀp ([N, d']).

Mixing with MLE, per token t (CE_t = -log q_t(y_t); sg = stop-gradient):

* ``"emo1"`` (Eq. 19, DRSY/EMO): 0.5 · (CE + sg(CE / (DEMD + 1e-10)) · DEMD).
* ``"emo2"`` (``emoloss`` mode 2): DEMD + sg(DEMD / (CE + 1e-10)) · CE.
* ``"static"``: CE + μ · DEMD.

The per-token values are summed over non-ignored tokens and divided by their count (official:
``(loss * mask).sum() / (1e-15 + mask.sum())``).

NOTE (the two official codes disagree): ``emoloss`` v0.0.3 caps the emo1 ratio,
min(sg(CE / (DEMD + 1e-10)), 3.0); DRSY/EMO and the paper do not. The cap binds whenever
CE > 3·DEMD (e.g. near initialization, where CE ≈ log V and DEMD ≈ 1), so the gradients
differ there. ``max_ratio=3.0`` reproduces emoloss; the default ``None`` is the paper / DRSY/EMO.

NOTE (departures from the official code, invisible on ordinary inputs):
* The official code adds 1e-15 to the one-hot before L1-normalizing it, which shifts DEMD by at
  most V·1e-15; we use the exact one-hot (a gather).
* Where DEMD rounds to a tiny negative number (1 - a dot product of unit vectors can land just
  below 0 in float32) the official ratio CE / (DEMD + 1e-10) can flip sign and explode; we
  divide by max(DEMD, 0) + 1e-10 instead. When DEMD is exactly 0 (a perfect prediction, or
  mass on tokens whose cost rows coincide with ê_y) the 1e-10 keeps the ratio finite, as in
  the official code; the mixed term's value is then 0.

Shape notation: B batch, T time, V vocabulary, N = B*T positions, d' cost-embedding width.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from emdlm._output import LossOutput
from emdlm.functional._common import (
    IGNORE_INDEX,
    Reduction,
    check_logits_labels,
    compute_dtype,
    reduce_sum,
    token_log_probs,
)

EMOMode = Literal["emo1", "emo2", "static"]
EMO_MODES: tuple[str, ...] = ("emo1", "emo2", "static")
_RATIO_EPS = 1e-10  # the official codes' guard in CE / (DEMD + 1e-10) and DEMD / (CE + 1e-10)


def normalize_cost_embedding(cost_embedding: torch.Tensor) -> torch.Tensor:
    """Row-normalize a cost embedding: Ê_i = E_i / ||E_i||_2 (detached); zero rows stay zero.

    A zero row has no direction, so its cosine with every token (itself included) is taken to
    be 0: cost 1 - cos = 1 to everything, the cost of an unrelated token. Such rows occur in
    practice: a tied Qwen2 built from its config has the pad token's row zeroed by
    ``nn.Embedding(padding_idx=...)``. One warning gives their count.

    Args:
        cost_embedding: E [V, d'], any floating dtype (d' need not match the model).

    Returns:
        Ê [V, d'] in float32 (float64 input stays float64), with no autograd history.

    Raises:
        ValueError: if E is not 2-D, or some row is not finite (NaN / inf entries); the message
            lists the offending row indices.
    """
    if not torch.is_floating_point(cost_embedding):
        raise TypeError(
            f"cost_embedding must be a floating-point tensor, got dtype {cost_embedding.dtype}"
        )
    if cost_embedding.dim() != 2:
        raise ValueError(
            f"cost_embedding must have shape [V, d'], got {tuple(cost_embedding.shape)}"
        )
    dtype = torch.float64 if cost_embedding.dtype == torch.float64 else torch.float32
    emb = cost_embedding.detach().to(dtype)  # [V, d']
    norms = torch.linalg.vector_norm(emb, ord=2, dim=1)  # [V]
    bad = ~torch.isfinite(norms)
    zero = norms == 0
    # One host sync, at construction time only.
    n_bad, n_zero = torch.stack([bad.sum(), zero.sum()]).tolist()
    if n_bad:
        rows = bad.nonzero().flatten()
        shown = rows[:10].tolist()
        more = f" (and {n_bad - 10} more)" if n_bad > 10 else ""
        raise ValueError(
            f"cost_embedding of shape {tuple(cost_embedding.shape)} has {n_bad} row(s) with "
            f"non-finite entries at indices {shown}{more}; the cosine cost 1 - cos(e_i, e_j) is "
            "undefined for them"
        )
    if n_zero:
        shown = zero.nonzero().flatten()[:10].tolist()
        more = ", ..." if n_zero > 10 else ""
        warnings.warn(
            f"cost_embedding of shape {tuple(cost_embedding.shape)} has {n_zero} zero row(s) "
            f"(indices {shown}{more}, e.g. a pad token's embedding): they get cosine 0, i.e. "
            "cost 1, to every token",
            UserWarning,
            stacklevel=2,
        )
    return emb / torch.where(zero, 1.0, norms).unsqueeze(1)  # zero rows: 0 / 1 = 0


def _check_cost(logits: torch.Tensor, cost_normalized: torch.Tensor) -> None:
    if cost_normalized.dim() != 2:
        raise ValueError(
            f"normalized cost embedding must have shape [V, d'], got {tuple(cost_normalized.shape)}"
        )
    if cost_normalized.shape[0] != logits.shape[-1]:
        raise ValueError(
            f"vocabulary mismatch: logits {tuple(logits.shape)} have V={logits.shape[-1]} but "
            f"the cost embedding {tuple(cost_normalized.shape)} has {cost_normalized.shape[0]} "
            "rows (it must have one row per logit)"
        )


def _check_dense(logits: torch.Tensor, target_probs: torch.Tensor) -> None:
    if not torch.is_floating_point(logits) or not torch.is_floating_point(target_probs):
        raise TypeError(
            f"logits and target_probs must be floating point, got {logits.dtype} and "
            f"{target_probs.dtype}"
        )
    if logits.dim() < 2 or tuple(target_probs.shape) != tuple(logits.shape):
        raise ValueError(
            f"target_probs must have the logits' shape [..., V]: logits {tuple(logits.shape)}, "
            f"target_probs {tuple(target_probs.shape)}"
        )


def _demd_flat(
    logits: torch.Tensor, labels: torch.Tensor, cost_normalized: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position CE and DEMD on flattened inputs (no checks). Returns ce, demd, valid, count."""
    tokens = token_log_probs(logits, labels, ignore_index)
    log_q, valid = tokens.log_q, tokens.valid  # [N, V], [N]
    emb = cost_normalized.to(device=log_q.device, dtype=log_q.dtype)  # [V, d']
    q_repr = log_q.exp() @ emb  # Êᵀq per row: [N, d']
    gold_repr = emb.index_select(0, tokens.safe_labels)  # ê_y: [N, d']
    demd = 1.0 - (q_repr * gold_repr).sum(dim=-1)  # [N]
    demd = torch.where(valid, demd, torch.zeros((), dtype=demd.dtype, device=demd.device))
    return tokens.ce, demd, valid, tokens.count


def demd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding_normalized: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token DEMD = 1 - (Êᵀ softmax(z)) · ê_y (EMO Eq. 14), 0 at ignored positions.

    Args:
        logits: z [..., V], any float dtype (computed in float32; float64 kept).
        labels: y [...], aligned with the logits; ``ignore_index`` marks unscored positions.
        cost_embedding_normalized: Ê [V, d'] from :func:`normalize_cost_embedding`.

    Returns:
        DEMD [...] in the compute dtype, each value in [0, 2] (up to rounding).
    """
    check_logits_labels(logits, labels, ignore_index)
    _check_cost(logits, cost_embedding_normalized)
    _, value, _, _ = _demd_flat(logits, labels, cost_embedding_normalized, ignore_index)
    return value.reshape(labels.shape)


def _dense_reprs(
    logits: torch.Tensor, target_probs: torch.Tensor, cost_normalized: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_dense(logits, target_probs)
    _check_cost(logits, cost_normalized)
    vocab = logits.shape[-1]
    dtype = compute_dtype(logits.dtype)
    q = torch.softmax(logits.reshape(-1, vocab).to(dtype), dim=-1)  # [N, V]
    p = target_probs.reshape(-1, vocab).to(dtype)  # [N, V]
    emb = cost_normalized.to(device=q.device, dtype=dtype)  # [V, d']
    return q, p, emb


def demd_bound_dense(
    logits: torch.Tensor, target_probs: torch.Tensor, cost_embedding_normalized: torch.Tensor
) -> torch.Tensor:
    """Per-token independent-plan bound qᵀ C p = (Σp) - (Êᵀq)·(Êᵀp) (EMO Eq. 12-13).

    With Σp = 1 this is 1 - (Êᵀq)·(Êᵀp). It upper-bounds the exact EMD(q, p) (the product plan
    q ⊗ p is feasible) and equals it when p is one-hot. Gradients flow into ``target_probs``
    too if it requires grad (detach a teacher yourself).

    Args:
        logits: z [..., V]; target_probs: p [..., V] (rows on the simplex);
        cost_embedding_normalized: Ê [V, d'].

    Returns:
        [...] per-token values in the compute dtype.
    """
    q, p, emb = _dense_reprs(logits, target_probs, cost_embedding_normalized)
    value = p.sum(dim=-1) - ((q @ emb) * (p @ emb)).sum(dim=-1)  # [N]
    return value.reshape(logits.shape[:-1])


def generalized_demd(
    logits: torch.Tensor, target_probs: torch.Tensor, cost_embedding_normalized: torch.Tensor
) -> torch.Tensor:
    """Per-token generalized DEMD |q - p|ᵀ C p (EMO Eq. 15), without a V x V matrix.

    (C p)_i = Σ_j p_j (1 - ê_i·ê_j) = (Σp) - ê_i · (Êᵀp), so the value is
    Σ_i |q_i - p_i| · ((Σp) - ê_i · (Êᵀp)); it builds one [N, V] buffer (C p) and no [V, V].
    Zero when q = p; equal to :func:`demd` when p is one-hot.

    Args:
        logits: z [..., V]; target_probs: p [..., V] (soft labels or a teacher distribution);
        cost_embedding_normalized: Ê [V, d'].

    Returns:
        [...] per-token values in the compute dtype.
    """
    q, p, emb = _dense_reprs(logits, target_probs, cost_embedding_normalized)
    cost_p = p.sum(dim=-1, keepdim=True) - (p @ emb) @ emb.T  # (C p) per row: [N, V]
    value = ((q - p).abs() * cost_p).sum(dim=-1)  # [N]
    return value.reshape(logits.shape[:-1])


def mix_emo(
    ce: torch.Tensor,
    demd_value: torch.Tensor,
    mode: EMOMode = "emo1",
    mu: float = 1.0,
    max_ratio: float | None = None,
) -> torch.Tensor:
    """Per-token EMO/MLE mix (see the module docstring for the three modes and their sources).

    ``ce`` and ``demd_value`` are per-token tensors of the same shape (0 at ignored tokens, which
    keeps every mixed value 0 there).
    """
    if mode == "emo1":
        # Eq. 19: value 0.5*(CE + CE) = CE, gradient 0.5*(∇CE + (CE/DEMD)·∇DEMD).
        # DEMD >= 0 in exact arithmetic; a float32 rounding just below 0 would otherwise be
        # multiplied by a ratio of ~CE/1e-10 and swing the value far below 0.
        demd_value = demd_value.clamp_min(0.0)
        ratio = ce.detach() / (demd_value.detach() + _RATIO_EPS)
        if max_ratio is not None:
            ratio = ratio.clamp_max(max_ratio)  # emoloss v0.0.3 caps the ratio at 3.0
        return 0.5 * (ce + ratio * demd_value)
    if mode == "emo2":
        ratio = demd_value.detach() / (ce.detach() + _RATIO_EPS)
        return demd_value + ratio * ce
    if mode == "static":
        return ce + mu * demd_value
    raise ValueError(f"mode must be one of {EMO_MODES}, got {mode!r}")


def check_emo_options(mode: str, mu: float, max_ratio: float | None) -> None:
    """Validate the mixing options (shared by the module and the fast paths)."""
    if mode not in EMO_MODES:
        raise ValueError(f"mode must be one of {EMO_MODES}, got {mode!r}")
    if mode != "static" and mu != 1.0:
        raise ValueError(f"mu={mu} only applies to mode='static' (got mode={mode!r})")
    if max_ratio is not None and (mode != "emo1" or not max_ratio > 0):
        raise ValueError(
            f"max_ratio must be None or > 0 and only applies to mode='emo1'; got "
            f"max_ratio={max_ratio}, mode={mode!r}"
        )


def emo_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cost_embedding_normalized: torch.Tensor,
    *,
    mode: EMOMode = "emo1",
    mu: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    max_ratio: float | None = None,
) -> LossOutput:
    """EMO objective mixed with MLE (reference; the fast paths in emdlm.ops equal it).

    Args:
        logits: z [B, T, V] (or [N, V]), any float dtype, labels aligned (no shift inside).
        labels: y [B, T] with ``ignore_index`` at unscored positions.
        cost_embedding_normalized: Ê [V, d'] from :func:`normalize_cost_embedding`.
        mode: "emo1" (Eq. 19, official), "emo2" (emoloss mode 2) or "static" (CE + mu*DEMD).
        mu: DEMD weight for mode "static" (must stay 1.0 otherwise).
        reduction: "mean" over counted tokens or "sum".
        max_ratio: cap on the emo1 ratio; 3.0 reproduces the ``emoloss`` package.

    Returns:
        LossOutput with components "ce" and "demd" (means over counted tokens) and "n_tokens".

    Example:
        >>> e_hat = normalize_cost_embedding(model.get_output_embeddings().weight)
        >>> out = emo_loss(logits[:, :-1], input_ids[:, 1:], e_hat)
        >>> out.loss.backward()
    """
    check_emo_options(mode, mu, max_ratio)
    check_logits_labels(logits, labels, ignore_index)
    _check_cost(logits, cost_embedding_normalized)
    ce, value, _, count = _demd_flat(logits, labels, cost_embedding_normalized, ignore_index)
    per_token = mix_emo(ce, value, mode=mode, mu=mu, max_ratio=max_ratio)  # [N]
    loss = reduce_sum(per_token, count, reduction)
    denom = count.clamp_min(1).to(ce.dtype)
    components: dict[str, torch.Tensor | float] = {
        "ce": (ce.detach().sum() / denom),
        "demd": (value.detach().sum() / denom),
        "n_tokens": count,
    }
    return LossOutput(loss=loss, components=components)


__all__ = [
    "EMO_MODES",
    "EMOMode",
    "check_emo_options",
    "demd",
    "demd_bound_dense",
    "emo_loss",
    "generalized_demd",
    "mix_emo",
    "normalize_cost_embedding",
]
