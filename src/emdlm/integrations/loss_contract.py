"""What a loss handed to a training framework promises: the contract every route shares.

The frameworks (``transformers.Trainer``'s ``compute_loss_func``, a model's ``loss_function``
hook, :func:`emdlm.patch`) pass unshifted labels with :data:`IGNORE_INDEX` at the positions
not scored, and, with gradient accumulation, ``num_items_in_batch``: the scored tokens of the
whole accumulated batch (their weight sum with per-token loss weights,
:mod:`emdlm.integrations.loss_weights`). So the loss must return the per-token *sum*
(:func:`require_sum_reduction`) and the caller divides it once (:func:`scaled_loss`).
Used by :mod:`emdlm.integrations.hidden_forward`, :mod:`emdlm.integrations.transformers` and
:mod:`emdlm.integrations.patch`.

Every route builds one :class:`LossInputs` with :func:`loss_inputs` (the one place labels, the
number mask and a teacher's logits are shifted) and hands it to
:meth:`emdlm.integrations.transformers.ComputeLoss.step`, which reads what the loss declares
(:func:`declared_needs`, from :class:`emdlm.losses.base.EMDLMLoss`) instead of probing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from emdlm.functional._common import IGNORE_INDEX
from emdlm.losses.base import EMDLMLoss
from emdlm.ops.chunk_objective import count_divisor, token_count


def scored_positions(
    labels: torch.Tensor, loss_weights: torch.Tensor | None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Bool mask of the positions a loss scores: labels ≠ ``ignore_index`` and, with
    ``loss_weights`` (the labels' shape), weight > 0 (a weight of 0 scores a token as an
    ignored label): the positions of TRL's ``mean_token_accuracy`` on both routes."""
    valid = labels != ignore_index
    if loss_weights is not None:
        valid = valid & (loss_weights.to(valid.device) > 0)
    return valid


def require_sum_reduction(loss_fn: Any, who: str = "make_compute_loss_func") -> None:
    """Refuse a loss whose ``reduction`` is not ``"sum"`` (ValueError naming ``reduction``).

    The Trainer divides the micro-batch loss by ``num_items_in_batch`` itself, so the loss must
    return Σ_t l_t: a per-token mean would be divided twice. A missing or unknown reduction is
    not taken for "sum".
    """
    name = type(loss_fn).__name__
    if not hasattr(loss_fn, "reduction"):
        raise ValueError(
            f"{who} needs a loss that returns the per-token sum, but {name} has no `reduction` "
            f"attribute, so it cannot tell; build the loss with reduction='sum' (every emdlm "
            f"loss has it), or set `.reduction = 'sum'` on a callable that returns a sum"
        )
    reduction = loss_fn.reduction
    if reduction != "sum":
        raise ValueError(
            f"{who} needs a loss built with reduction='sum' (it divides by the batch's token "
            f"count itself; 'mean' would be divided twice and shrink the gradient), got "
            f"{name} with reduction={reduction!r}"
        )


def scaled_loss(
    summed: torch.Tensor, count: torch.Tensor, num_items_in_batch: Any
) -> torch.Tensor:
    """Σ l_t / N with N = ``num_items_in_batch`` when given, else the call's scored count; an N
    of 0 divides by 1 (the chunk engine's :func:`~emdlm.ops.chunk_objective.count_divisor`).
    N may be a weight sum (per-token loss weights), so it is not rounded and one below 1 is
    divided by as it is."""
    if num_items_in_batch is None:
        n = count
    elif isinstance(num_items_in_batch, torch.Tensor):
        n = num_items_in_batch.to(summed.device)
    else:
        return summed / (num_items_in_batch if num_items_in_batch > 0 else 1)
    return summed / count_divisor(n)


@dataclass(frozen=True)
class LossInputs:
    """One loss call's tensors, aligned: position t of ``logits`` / ``hidden`` predicts
    ``labels[:, t]``; ``number_mask``, ``loss_weights`` and ``teacher_logits`` are aligned the
    same way.

    Exactly one of ``logits`` ([B, T, V]) and ``hidden`` ([B, T, H], with ``model``: the causal
    LM whose output embedding turns it into logits) is set. Built by :func:`loss_inputs` only,
    so the shift is made in one place.
    """

    labels: torch.Tensor
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    model: Any = None
    number_mask: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None

    def call_keywords(self) -> dict[str, torch.Tensor]:
        """The keywords of the one loss call of every route, ``loss(logits, labels, **kw)``
        and ``loss.from_hidden(hidden, W, labels, b, **kw)`` (:class:`emdlm.losses.base.
        EMDLMLoss`): ``number_mask``, ``teacher_logits`` and ``loss_weights``, each only when
        the batch has it, so a user's callable ``(logits, labels)`` that declares none is
        called as it is."""
        given = (
            ("number_mask", self.number_mask), ("teacher_logits", self.teacher_logits),
            ("loss_weights", self.loss_weights),
        )
        return {k: v for k, v in given if v is not None}

    def token_hits(
        self, out: Any, ignore_index: int = IGNORE_INDEX
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hits, counted), 0-d long: of the :func:`scored_positions`, how many the loss's
        output ``out`` says the model's argmax got right, and how many there are (no host
        sync), the counts of TRL's ``mean_token_accuracy``. From ``out.predicted_tokens`` (the
        argmax per position, ``CrossEntropyLoss(predicted_tokens=True)``), else from the
        component ``token_accuracy`` (hits / counted, ``token_accuracy=True``) when the call
        has no ``loss_weights`` (with weights it is a weighted share, not a count); None when
        ``out`` gives neither."""
        predicted = getattr(out, "predicted_tokens", None)
        if predicted is not None:
            counted = scored_positions(self.labels, self.loss_weights, ignore_index)
            hits = (predicted.to(self.labels.device) == self.labels) & counted
            return hits.sum(), counted.sum()
        share = (getattr(out, "components", None) or {}).get("token_accuracy")
        if share is None or self.loss_weights is not None:
            return None
        n = scored_positions(self.labels, self.loss_weights, ignore_index).sum()
        share = torch.as_tensor(share).detach().to(device=n.device, dtype=torch.float64)
        return (share * n).round().long(), n

    def scored(self, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """What the call's summed loss is divided by when no ``num_items_in_batch`` is given
        (and what its components are averaged with): the scored labels, or with
        ``loss_weights`` their weight sum Σ_{labels ≠ ignore_index} w_t (0-d, no host sync),
        counted as the chunk engine counts (:func:`~emdlm.ops.chunk_objective.token_count`)."""
        return token_count(self.labels != ignore_index, self.loss_weights)


def loss_inputs(
    labels: torch.Tensor | None,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    model: Any = None,
    number_mask: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    shifted: bool = False,
) -> LossInputs:
    """The :class:`LossInputs` of a framework's call: ``labels`` [B, T] as frameworks pass them
    (unshifted, :data:`IGNORE_INDEX` where not scored), the model's logits or final hidden
    state [B, T, ·], and a batch's ``number_mask`` / per-token ``loss_weights`` / a teacher's
    logits of the same inputs, aligned with ``labels`` / ``logits``.

    Shifts once, as every causal LM: position t predicts token t+1, so ``logits[:, :-1]``,
    ``hidden[:, :-1]`` and ``teacher_logits[:, :-1]`` meet ``labels[:, 1:]``,
    ``number_mask[:, 1:]`` and ``loss_weights[:, 1:]``. ``shifted=True``: the labels are
    already aligned (transformers' ``shift_labels`` under context parallelism) and nothing is
    shifted.
    """
    if labels is None:
        raise ValueError("the loss got labels=None: the batch has no 'labels'")
    if (logits is None) == (hidden is None):
        raise ValueError("a loss call needs exactly one of logits and hidden states")
    if hidden is not None and model is None:
        raise RuntimeError("a from-hidden output reached the loss without its model")
    states = logits if logits is not None else hidden
    assert states is not None
    if teacher_logits is not None:
        if logits is None:
            raise ValueError("teacher logits need the student's logits (no from-hidden path)")
        if tuple(teacher_logits.shape) != tuple(logits.shape):
            raise ValueError(
                f"teacher logits {tuple(teacher_logits.shape)} do not match the student's "
                f"{tuple(logits.shape)}: the teacher must see the same inputs and share the "
                "vocabulary"
            )
    if not shifted:
        states, labels = states[:, :-1, :], labels[:, 1:]
        number_mask = None if number_mask is None else number_mask[:, 1:]
        loss_weights = None if loss_weights is None else loss_weights[:, 1:]
        teacher_logits = None if teacher_logits is None else teacher_logits[:, :-1, :]
    device = states.device
    return LossInputs(
        labels=labels.to(device),
        logits=states if logits is not None else None,
        hidden=states if hidden is not None else None,
        model=model,
        number_mask=None if number_mask is None else number_mask.to(device),
        teacher_logits=None if teacher_logits is None else teacher_logits.to(device),
        loss_weights=None if loss_weights is None else loss_weights.to(device),
    )


@dataclass(frozen=True)
class LossNeeds:
    """What a loss declares it needs from the training loop (:class:`emdlm.losses.base.
    EMDLMLoss`); a loss that is not an EMDLMLoss (a user's callable) needs nothing and has a
    from-hidden path when it has a ``from_hidden`` method."""

    needs_teacher: bool
    takes_number_mask: bool
    has_from_hidden: bool
    hidden_transforms: tuple[str, ...] = ()
    takes_loss_weights: bool = False


def declared_needs(loss_fn: Any) -> LossNeeds:
    """The declarations of ``loss_fn`` (read, never probed by calling or by signature).

    An :class:`~emdlm.losses.base.EMDLMLoss` declares them all; another callable may declare
    them as attributes of the same names (missing ones: False / none; ``has_from_hidden``
    defaults to whether it has a ``from_hidden`` method)."""
    if isinstance(loss_fn, EMDLMLoss):
        return LossNeeds(
            loss_fn.needs_teacher, loss_fn.takes_number_mask, loss_fn.has_from_hidden,
            tuple(loss_fn.hidden_transforms), loss_fn.takes_loss_weights,
        )
    return LossNeeds(
        bool(getattr(loss_fn, "needs_teacher", False)),
        bool(getattr(loss_fn, "takes_number_mask", False)),
        bool(getattr(loss_fn, "has_from_hidden", callable(getattr(loss_fn, "from_hidden", None)))),
        tuple(getattr(loss_fn, "hidden_transforms", ())),
        bool(getattr(loss_fn, "takes_loss_weights", False)),
    )
