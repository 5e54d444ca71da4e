"""Hand an emdlm loss to ``transformers.Trainer`` as ``compute_loss_func``.

transformers 5.x calls ``compute_loss_func(outputs, labels, num_items_in_batch=N)`` with the
labels NOT shifted, and, when ``N`` is given, expects a loss already divided by ``N``: the count
of scored tokens in the whole accumulated batch, summed over processes when
``average_tokens_across_devices`` (the Trainer then multiplies by the process count because DDP
averages gradients). So, per micro-batch::

    loss_mb = sum_{t in micro-batch} l_t / N

and the accumulated gradient is exactly the gradient of the mean over all N tokens: the same as
one big batch, whatever the split into micro-batches and processes. This holds for every
objective whose summed loss is a sum of per-token (or per-number) terms. NTIL/EMO's *dynamic*
weights sg(CE/aux) are computed per call, i.e. per micro-batch: with accumulation they are
exact only if the ratio is per token (see the tests).

Reduction is decided in one place
(:func:`~emdlm.integrations.loss_contract.require_sum_reduction`): the adapter needs the loss's
per-token *sum*. A loss built with ``reduction="mean"`` would be divided by N a second time (a
gradient n times too small, n = the micro-batch's scored tokens, without a word), and a loss
that does not say its reduction cannot be trusted to be a sum, so both are refused with an error
naming ``reduction``. Every emdlm loss exposes ``.reduction``.

:class:`ComputeLoss` also records the loss components (token-weighted over micro-batches) when
gradients are on (training, not evaluation); :class:`LossComponentsCallback` writes them into
the Trainer's logs::

    compute_loss = make_compute_loss_func(NTILLoss(tok, reduction="sum"))
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                      compute_loss_func=compute_loss,
                      callbacks=[LossComponentsCallback(compute_loss)])
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from emdlm.integrations.hidden_forward import (
    FromHiddenForward,
    hidden_loss,
    install_forward,
    output_head,
)
from emdlm.integrations.loss_contract import IGNORE_INDEX, require_sum_reduction, scaled_loss


class ComputeLoss:
    """``compute_loss_func`` for ``transformers.Trainer`` around an emdlm loss (reduction "sum").

    Args:
        loss_fn: module called as ``loss_fn(logits [B, T-1, V], labels [B, T-1])`` returning a
            LossOutput whose ``loss`` is a sum over scored tokens; its ``reduction`` must be
            ``"sum"`` (checked here and at every call: :func:`require_sum_reduction`).
        ignore_index: label value that is not scored.
    """

    def __init__(
        self, loss_fn: nn.Module, ignore_index: int = IGNORE_INDEX,
        who: str = "make_compute_loss_func",
    ) -> None:
        require_sum_reduction(loss_fn, who)
        self.who = who
        self.loss_fn = loss_fn
        self.ignore_index = ignore_index
        self._loss_sum: torch.Tensor | None = None
        self._weighted: dict[str, torch.Tensor] = {}
        self._weight: torch.Tensor | None = None
        # A distillation loss (``needs_teacher``) reads the teacher's logits of the current
        # forward from here; :func:`with_teacher` sets them before every call.
        self.teacher_logits: torch.Tensor | None = None
        # from-hidden (make_compute_loss_func(..., from_hidden=True, model=m)): the model
        # whose output embedding the loss applies; set by enable_from_hidden.
        self.model: nn.Module | None = None
        # The current batch's number_mask [B, T] (data.number_scope), set by with_number_mask
        # before the forward and used by the next call only.
        self.number_mask: torch.Tensor | None = None
        self._warned_mask = False

    def enable_from_hidden(self, model: nn.Module) -> None:
        """Switch to the from-hidden path for ``model`` (installs its forward wrapper).

        While training, ``model``'s forward (the instance's, not the class's) runs only the
        backbone and returns the final hidden state; this ComputeLoss then applies the output
        embedding with ``loss_fn.from_hidden`` (no [B, T, V] logits). The forward still goes
        through DDP / accelerate wrappers, so gradient sync and accumulation are unchanged.
        Evaluation (no gradients) keeps the logits path.
        """
        if getattr(self.loss_fn, "needs_teacher", False):
            raise ValueError(
                f"from_hidden: {type(self.loss_fn).__name__} distils from the teacher's logits "
                "and has no from-hidden path; set from_hidden=False (train.fused_linear: false)"
            )
        if not callable(getattr(self.loss_fn, "from_hidden", None)):
            raise ValueError(
                f"from_hidden: {type(self.loss_fn).__name__} has no from_hidden method"
            )
        output_head(model)  # a head from_hidden cannot use is refused now, not mid-training
        install_forward(model, lambda orig: FromHiddenForward(model, orig, "hidden"))
        self.model = model

    def _mask_kwargs(self, number_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``{"number_mask": m}`` for a loss that takes it (``takes_number_mask``), else {}.

        A mask given to a loss that scores no numbers (CE, EMO, ...) is dropped with a
        UserWarning, once per ComputeLoss: the same data (with its number scope) can then feed
        a CE baseline and a numeric objective alike.
        """
        if number_mask is None:
            return {}
        if getattr(self.loss_fn, "takes_number_mask", False):
            return {"number_mask": number_mask}
        if not self._warned_mask:
            self._warned_mask = True
            warnings.warn(
                f"the batch has a number_mask (data.number_scope) but {type(self.loss_fn).__name__}"
                " scores no numbers: the mask is ignored (only NTIL / digit EMD use it)",
                UserWarning,
                stacklevel=3,
            )
        return {}

    def __call__(
        self,
        outputs: Any,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
        *,
        shifted: bool = False,
        number_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Σ l_t / N for one micro-batch; ``shifted``: ``labels`` are already aligned with the
        logits (transformers' ``shift_labels``), so no shift here.

        ``number_mask`` ([B, T] bool aligned with ``labels``, shifted with them; default: the
        one :func:`with_number_mask` took out of the batch): which tokens the numeric losses
        may score as numbers. Passed to losses with ``takes_number_mask``; others ignore it
        (one warning)."""
        if number_mask is None:
            number_mask, self.number_mask = self.number_mask, None  # used by one call only
        if labels is None:
            raise ValueError("compute_loss_func got labels=None: the batch has no 'labels'")
        require_sum_reduction(self.loss_fn, self.who)  # an attribute read: may have changed
        mask_kw = self._mask_kwargs(number_mask)
        if isinstance(outputs, Mapping) and outputs.get("emdlm_hidden") is not None:
            return self._call_from_hidden(
                outputs["emdlm_hidden"], labels, num_items_in_batch, **mask_kw
            )
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if shifted:
            if getattr(self.loss_fn, "needs_teacher", False):
                raise ValueError("pre-shifted labels are not supported for a distillation loss")
            shift_logits, shift_labels = logits, labels.to(logits.device)
        else:
            shift_logits = logits[:, :-1, :]  # [B, T-1, V]: position t predicts token t+1
            shift_labels = labels[:, 1:].to(logits.device)  # [B, T-1]
            if mask_kw:
                mask_kw["number_mask"] = mask_kw["number_mask"][:, 1:]  # shifted like labels
        if getattr(self.loss_fn, "needs_teacher", False):
            out = self.loss_fn(shift_logits, shift_labels, self._take_teacher_logits(logits))
        else:
            out = self.loss_fn(shift_logits, shift_labels, **mask_kw)
        count = (shift_labels != self.ignore_index).sum()
        if torch.is_grad_enabled():
            self._record(out.loss.detach(), out.components, count)
        return scaled_loss(out.loss, count, num_items_in_batch)

    def _call_from_hidden(
        self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any,
        number_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The from-hidden path: the head of ``self.model`` applied chunk by chunk
        (``loss_fn.from_hidden``), divided by ``num_items_in_batch`` as the logits path."""
        if self.model is None:
            raise RuntimeError("a from-hidden output reached a ComputeLoss without a model")
        out, count = hidden_loss(
            self.loss_fn, self.model, hidden, labels, self.ignore_index, number_mask=number_mask
        )
        if torch.is_grad_enabled():
            self._record(out.loss.detach(), out.components, count)
        return scaled_loss(out.loss, count, num_items_in_batch)

    def _take_teacher_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The teacher's shifted logits [B, T-1, V] for this call (used once, then cleared)."""
        teacher, self.teacher_logits = self.teacher_logits, None
        if teacher is None:
            raise RuntimeError(
                f"{type(self.loss_fn).__name__} distils from a teacher, but no teacher logits "
                "were set for this forward: build the Trainer class with "
                "with_teacher(Trainer, teacher, compute_loss) (emdlm train does, given `teacher:`)"
            )
        if tuple(teacher.shape) != tuple(logits.shape):
            raise ValueError(
                f"teacher logits {tuple(teacher.shape)} do not match the student's "
                f"{tuple(logits.shape)}: the teacher must see the same inputs and share the "
                "vocabulary"
            )
        return teacher[:, :-1, :].to(logits.device)

    def _record(
        self, summed_loss: torch.Tensor, components: Mapping[str, Any], count: torch.Tensor
    ) -> None:
        # No host sync here: tensors are accumulated and read once per optimizer step.
        w = count.detach().to(torch.float64)
        s = summed_loss.double()
        self._loss_sum = s if self._loss_sum is None else self._loss_sum + s
        self._weight = w if self._weight is None else self._weight + w
        for key, value in components.items():
            v = torch.as_tensor(value, dtype=torch.float64, device=w.device).detach()
            contrib = v if key.startswith("n_") else v * w  # counts add up, means are weighted
            self._weighted[key] = self._weighted.get(key, 0) + contrib

    def pop_components(self, all_reduce: bool = False) -> dict[str, float]:
        """Averages of what was recorded since the last call (training micro-batches only).

        Returns ``{}`` when nothing was recorded, else:

        - "loss": Σ (summed objective) / Σ n_scored over the recorded micro-batches, i.e. the
          objective's mean over the scored tokens. Popped once per optimizer step this is the
          Trainer's step loss (Σ_mb loss_mb / num_items_in_batch), the value its logged "loss"
          averages over steps; popped less often it is the token-weighted mean over all steps
          (never a sum over calls).
        - every loss component, averaged with token weights (weight = the micro-batch's scored
          token count), except counts ("n_*"), which are summed;
        - "n_scored": the scored tokens.

        With ``all_reduce`` the sums are taken over all torch.distributed ranks first (a
        collective: call it on every rank). One host sync per call.
        """
        if self._loss_sum is None or self._weight is None:
            return {}
        keys = sorted(self._weighted)
        stacked = torch.stack(
            [self._loss_sum.double(), self._weight.double()]
            + [torch.as_tensor(self._weighted[k], dtype=torch.float64) for k in keys]
        )
        self._loss_sum, self._weight, self._weighted = None, None, {}
        if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            stacked = stacked.to(_dist_device())
            torch.distributed.all_reduce(stacked)
        values = stacked.cpu().tolist()  # the one host sync per optimizer step
        loss_sum, weight = values[0], values[1]
        out = {"loss": loss_sum / max(weight, 1.0), "n_scored": weight}
        for key, value in zip(keys, values[2:], strict=True):
            out[key] = value if key.startswith("n_") else value / max(weight, 1.0)
        return out


def _dist_device() -> torch.device:
    backend = torch.distributed.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class LossComponentsCallback(TrainerCallback):
    """Writes every loss component of a :class:`ComputeLoss` into the Trainer's logs.

    ``Trainer(..., compute_loss_func=cl, callbacks=[LossComponentsCallback(cl)])`` adds
    ``emdlm/<name>`` for each component ("ce", "emd", "ntil", "mix_coef", ..., and "loss") to
    every training log record (``trainer.state.log_history`` and the console; for
    ``report_to`` integrations see below).

    Averaged as the Trainer averages its "loss": at each optimizer step
    ``cl.pop_components(all_reduce=True)`` gives the step's token-weighted means over its
    micro-batches (and over processes); a log record holds the plain mean of those per-step
    values over the steps since the previous record, so ``emdlm/loss`` equals the Trainer's
    "loss" (up to float rounding). Counts ("n_scored", "n_*") are averaged per step the same
    way. Evaluation records are left alone (the adapter records nothing without gradients).

    Where the values go: ``logs`` (so the console / progress bar and every callback after this
    one see them) and ``trainer.state.log_history``. Reporting integrations chosen with
    ``report_to`` ("tensorboard", "wandb", ...) are placed by the Trainer *before* user
    callbacks; to have the components there too, put this callback first:
    ``trainer.callback_handler.callbacks.insert(0, LossComponentsCallback(cl))``.

    Only one consumer may pop a ComputeLoss (``emdlm train`` has its own: do not add this
    callback there). ``pop_components`` is collective under torch.distributed: the callback
    runs on every rank, as Trainer callbacks do.
    """

    def __init__(self, compute_loss: ComputeLoss, prefix: str = "emdlm/") -> None:
        if not isinstance(compute_loss, ComputeLoss):
            raise TypeError(
                f"LossComponentsCallback needs the ComputeLoss given to the Trainer "
                f"(make_compute_loss_func(...)), got {type(compute_loss).__name__}"
            )
        self.compute_loss = compute_loss
        self.prefix = prefix
        self._sums: dict[str, float] = {}
        self._steps: dict[str, int] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for key, value in self.compute_loss.pop_components(all_reduce=True).items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._steps[key] = self._steps.get(key, 0) + 1

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Training records carry "loss"; evaluation ("eval_loss") and the final summary
        # ("train_loss") do not.
        if logs is None or "loss" not in logs or not self._sums:
            return
        values = {f"{self.prefix}{k}": self._sums[k] / self._steps[k] for k in sorted(self._sums)}
        self._sums, self._steps = {}, {}
        logs.update(values)  # seen by the callbacks after this one (console, progress bar)
        # Trainer.log appended a copy of ``logs`` to the history before calling on_log.
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
            history[-1].update(values)


def teacher_logits_for(teacher: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The frozen teacher's logits [B, T, V] on the student's inputs (everything but the labels
    and the Trainer's ``num_items_in_batch``), without gradient; the teacher is moved to the
    inputs' device on first use."""
    model_inputs = {
        k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")
    }
    device = next(
        (v.device for v in model_inputs.values() if isinstance(v, torch.Tensor)), None
    )
    param = next(teacher.parameters(), None)
    if device is not None and param is not None and param.device != device:
        teacher.to(device)
    with torch.no_grad():
        outputs = teacher(**model_inputs)
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    return logits.detach()


def with_teacher(base: type, teacher: nn.Module, compute_loss: ComputeLoss) -> type:
    """A subclass of Trainer class ``base`` that runs ``teacher`` on every batch's inputs.

    Its ``compute_loss`` computes the teacher's logits on exactly the inputs the student gets
    (same micro-batch, same padding, inside the same autocast context) and hands them to
    ``compute_loss`` (the :class:`ComputeLoss` given to the Trainer) before the student's
    forward; a loss with ``needs_teacher`` then receives them. The teacher is not part of the
    Trainer's model: it is never optimized or saved. Freeze it yourself (``eval()``,
    ``requires_grad_(False)``), as :func:`emdlm.training.train.load_teacher` does.
    """
    if not isinstance(compute_loss, ComputeLoss):
        raise TypeError(
            f"with_teacher needs the ComputeLoss given to the Trainer, got "
            f"{type(compute_loss).__name__}"
        )

    class TeacherTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(
            self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            compute_loss.teacher_logits = teacher_logits_for(teacher, inputs)
            try:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                )
            finally:
                compute_loss.teacher_logits = None  # never reused by another batch

    return TeacherTrainer


def with_number_mask(base: type, compute_loss: ComputeLoss) -> type:
    """A subclass of Trainer class ``base`` that hands each batch's ``number_mask`` to the loss.

    The collators put ``number_mask`` ([B, T] bool, aligned with the labels) into batches when
    a number scope is set (``data.number_scope``, :mod:`emdlm.data`). The model must not get
    it, so ``compute_loss`` takes it out of the inputs and gives it to ``compute_loss`` (the
    :class:`ComputeLoss` of the Trainer) for this forward; ComputeLoss shifts it like the
    labels and passes it to a numeric loss (NTIL, digit EMD). Apply it last (outermost), so
    that a teacher (:func:`with_teacher`) never sees the mask either. Batches without a mask
    pass through unchanged.
    """
    if not isinstance(compute_loss, ComputeLoss):
        raise TypeError(
            f"with_number_mask needs the ComputeLoss given to the Trainer, got "
            f"{type(compute_loss).__name__}"
        )

    class NumberMaskTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(
            self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            if "number_mask" in inputs:
                inputs = dict(inputs)
                compute_loss.number_mask = inputs.pop("number_mask")
            try:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                )
            finally:
                compute_loss.number_mask = None  # never reused by another batch

    NumberMaskTrainer.__name__ = f"NumberMask{base.__name__}"
    return NumberMaskTrainer


def make_compute_loss_func(
    loss_fn: nn.Module, ignore_index: int = IGNORE_INDEX, *, from_hidden: bool = False,
    model: nn.Module | None = None,
) -> ComputeLoss:
    """``Trainer(compute_loss_func=make_compute_loss_func(loss_fn))``: shifts the labels and
    divides the summed loss by ``num_items_in_batch`` (exact gradient accumulation).

    With ``from_hidden=True`` pass the model given to the Trainer (``model=``): its instance
    forward is wrapped (:meth:`ComputeLoss.enable_from_hidden`) so that training runs the
    backbone only and the loss applies the output embedding chunk by chunk; same loss and
    gradients as the logits path, without the [B, T, V] logits.
    """
    compute_loss = ComputeLoss(loss_fn, ignore_index=ignore_index)
    if from_hidden:
        if model is None:
            raise ValueError(
                "make_compute_loss_func(..., from_hidden=True) needs model=<the model given to "
                "the Trainer>: the loss applies its output embedding"
            )
        compute_loss.enable_from_hidden(model)
    elif model is not None:
        raise ValueError("make_compute_loss_func: model= is only used with from_hidden=True")
    return compute_loss


__all__ = [
    "ComputeLoss", "LossComponentsCallback", "make_compute_loss_func", "require_sum_reduction",
    "teacher_logits_for", "with_number_mask", "with_teacher",
]
