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

Per-token loss weights (a batch's ``loss_weights`` [B, T], from the data's ``loss_weight``
field, :mod:`emdlm.data`): the loss returns Σ_t w_t·l_t, and the honest normaliser is the
weight sum Σ_t w_t over the scored tokens of the accumulated batch, so
:class:`EMDLMTrainerMixin` counts ``num_items_in_batch`` that way (a micro-batch without
weights counts its tokens with weight 1):

    loss_mb = Σ_{t in micro-batch} w_t·l_t / Σ_{t in accumulated batch} w_t

which again makes any split into micro-batches the same as one big batch. A plain
``transformers.Trainer`` hands the batch to the model as it is (the weights would never reach
the loss): weighted data needs :class:`EMDLMTrainer` / :func:`emdlm_trainer`.

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
from transformers import Trainer, TrainerCallback

from emdlm.integrations.hidden_forward import (
    FromHiddenForward,
    aligned_hidden_loss,
    install_forward,
    output_head,
)
from emdlm.integrations.loss_contract import (
    IGNORE_INDEX,
    LossInputs,
    declared_needs,
    loss_inputs,
    require_sum_reduction,
    scaled_loss,
)
from emdlm.integrations.loss_weights import (
    LOSS_WEIGHT_KEY,
    TOKEN_WEIGHTS_KEY,
    dataset_loss_weights,
    weighted_item_count,
)


class ComputeLoss:
    """``compute_loss_func`` for ``transformers.Trainer`` around an emdlm loss (reduction "sum"):
    the one loss step every route calls (Trainer, :class:`EMDLMTrainer`, TRL's
    :class:`~emdlm.integrations.trl.EMDLMSFTTrainer`, :func:`emdlm.patch` on logits or hidden
    states, ``emdlm train``).

    A call builds the aligned :class:`~emdlm.integrations.loss_contract.LossInputs` (one shift,
    :func:`~emdlm.integrations.loss_contract.loss_inputs`), runs :meth:`step` and divides the
    summed loss once (:func:`~emdlm.integrations.loss_contract.scaled_loss`). What the loss
    needs is read from its declarations (:class:`emdlm.losses.base.EMDLMLoss`): a teacher's
    logits and a batch's number mask are *arguments* of the call, never fields set from
    outside; a loss that needs a teacher and gets none, or gets one it cannot use, is refused
    by name.

    Args:
        loss_fn: module called as ``loss_fn(logits [B, T-1, V], labels [B, T-1], **kw)`` (``kw``:
            ``number_mask`` / ``teacher_logits`` where the batch has them) returning a
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
        self.needs = declared_needs(loss_fn)
        self._loss_sum: torch.Tensor | None = None
        self._weighted: dict[str, torch.Tensor] = {}
        self._weight: torch.Tensor | None = None
        # from-hidden (make_compute_loss_func(..., from_hidden=True, model=m), emdlm.patch):
        # the model whose output embedding the loss applies; set by enable_from_hidden.
        self.model: nn.Module | None = None
        self._warned_mask = False
        # the dataset check_dataset last read, and whether it had weights: read once
        self._checked: tuple[Any, bool | None] | None = None
        #: (hits, counted) of the last call (LossInputs.token_hits), None when the loss gave
        #: no predicted tokens: TRL's mean_token_accuracy on the from-hidden route
        self.last_token_hits: tuple[torch.Tensor, torch.Tensor] | None = None

    def enable_from_hidden(self, model: nn.Module, install: bool = True) -> None:
        """Score ``model``'s final hidden states (``install``: wrap its forward in mode
        "hidden"; :func:`emdlm.patch` installs mode "loss" itself).

        While training, ``model``'s forward (the instance's, not the class's) runs only the
        backbone and returns the final hidden state; this ComputeLoss then applies the output
        embedding with ``loss_fn.from_hidden`` (no [B, T, V] logits). The forward still goes
        through DDP / accelerate wrappers, so gradient sync and accumulation are unchanged.
        Evaluation (no gradients) keeps the logits path.
        """
        name = type(self.loss_fn).__name__
        if self.needs.needs_teacher:
            raise ValueError(
                f"from_hidden: {name} distils from the teacher's logits "
                "and has no from-hidden path; set from_hidden=False (train.fused_linear: false)"
            )
        if not self.needs.has_from_hidden:
            raise ValueError(f"from_hidden: {name} has no from_hidden method")
        output_head(model)  # a head from_hidden cannot use is refused now, not mid-training
        if install:
            install_forward(model, lambda orig: FromHiddenForward(model, orig, "hidden"))
        self.model = model

    def _usable_mask(self, number_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``number_mask`` for a loss that declares ``takes_number_mask``, else None.

        A mask given to a loss that scores no numbers (CE, EMO, ...) is dropped with a
        UserWarning, once per ComputeLoss: the same data (with its number scope) can then feed
        a CE baseline and a numeric objective alike.
        """
        if number_mask is None or self.needs.takes_number_mask:
            return number_mask
        if not self._warned_mask:
            self._warned_mask = True
            warnings.warn(
                f"the batch has a number_mask (data.number_scope) but {type(self.loss_fn).__name__}"
                " scores no numbers: the mask is ignored (only NTIL / digit EMD use it)",
                UserWarning,
                stacklevel=4,
            )
        return None

    def unweighable(self, what: str) -> ValueError:
        """The error for weighted data (``what`` has them) given to a loss that takes no
        per-token weights: never silently unweighted."""
        return ValueError(
            f"{what} (the data's {LOSS_WEIGHT_KEY!r} field), but objective "
            f"{type(self.loss_fn).__name__} takes no per-token loss weights "
            "(takes_loss_weights is False): drop the field or use a loss that declares "
            "takes_loss_weights"
        )

    def check_dataset(self, dataset: Any, where: str = "train_dataset") -> bool | None:
        """Refuse, at setup, a ``dataset`` whose rows carry loss weights when the loss takes
        none (:meth:`unweighable`), and a bad row weight either way
        (:func:`~emdlm.integrations.loss_weights.dataset_loss_weights`); returns what that
        found (True / False, None: not readable). The same dataset object is read once: a
        second call (the trainer's setup, then its train dataloader) gives the first answer."""
        if self._checked is not None and self._checked[0] is dataset:
            found = self._checked[1]
        else:
            found = dataset_loss_weights(dataset, where)  # checks the rows' weights too
            self._checked = (dataset, found)
        if found and not self.needs.takes_loss_weights:
            raise self.unweighable(f"{where} has loss weights")
        return found

    def inputs(
        self, outputs: Any, labels: torch.Tensor | None, *, shifted: bool = False,
        number_mask: torch.Tensor | None = None, teacher_logits: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> LossInputs:
        """The aligned inputs of one call: the model ``outputs`` (its output mapping or tuple
        with the logits, the logits tensor itself, or the final hidden state of the from-hidden
        forward), the unshifted ``labels`` (already aligned with
        ``shifted``), the batch's ``number_mask`` and per-token ``loss_weights`` (refused by
        :meth:`unweighable` for a loss that takes none) and the teacher's logits on the same
        inputs."""
        name = type(self.loss_fn).__name__
        if self.needs.needs_teacher and teacher_logits is None:
            raise RuntimeError(
                f"{name} distils from a teacher, but no teacher logits were given for this "
                "forward: train with EMDLMTrainer / emdlm_trainer(Trainer, teacher=teacher) "
                "(emdlm train does, given `teacher:`)"
            )
        if teacher_logits is not None and not self.needs.needs_teacher:
            raise ValueError(
                f"teacher logits were given but {name} does not distil (needs_teacher is False)"
            )
        if loss_weights is not None and not self.needs.takes_loss_weights:
            raise self.unweighable("the batch has loss_weights")
        hidden = outputs.get("emdlm_hidden") if isinstance(outputs, Mapping) else None
        logits = None
        if hidden is None:
            if isinstance(outputs, Mapping):
                logits = outputs["logits"]
            else:  # the logits tensor itself, or a model's tuple output (logits first)
                logits = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        return loss_inputs(
            labels, logits=logits, hidden=hidden, model=self.model if hidden is not None else None,
            number_mask=self._usable_mask(number_mask), teacher_logits=teacher_logits,
            loss_weights=loss_weights, shifted=shifted,
        )

    def step(self, inputs: LossInputs) -> tuple[Any, torch.Tensor]:
        """The summed loss of aligned ``inputs`` and the count of scored tokens (their weight
        sum with ``loss_weights``, :meth:`LossInputs.scored`): the one
        place a loss is called, one way on both routes (:meth:`LossInputs.call_keywords
        <emdlm.integrations.loss_contract.LossInputs.call_keywords>`: the teacher's logits and
        the number mask as keywords). From hidden states: :func:`aligned_hidden_loss` (the
        model's output head, gathered under FSDP2 / ZeRO-3); from logits: ``loss_fn(logits,
        labels, **keywords)``."""
        if inputs.hidden is not None:
            return aligned_hidden_loss(self.loss_fn, inputs, self.ignore_index)
        out = self.loss_fn(inputs.logits, inputs.labels, **inputs.call_keywords())
        return out, inputs.scored(self.ignore_index)

    def __call__(
        self,
        outputs: Any,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
        *,
        shifted: bool = False,
        number_mask: torch.Tensor | None = None,
        teacher_logits: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Σ l_t / N for one micro-batch (N: ``num_items_in_batch``, else this call's count).

        ``shifted``: ``labels`` are already aligned with the logits (transformers'
        ``shift_labels``), so no shift here. ``number_mask`` ([B, T] bool aligned with
        ``labels``, shifted with them): which tokens the numeric losses may score as numbers;
        passed to losses that declare ``takes_number_mask``, ignored by the others (one
        warning). ``teacher_logits`` ([B, T, V], the teacher's on the same inputs): for a loss
        that declares ``needs_teacher``, which refuses to run without them. ``loss_weights``
        ([B, T] float aligned with ``labels``): per-token weights w_t, for a loss that declares
        ``takes_loss_weights`` (refused otherwise); the sum is then Σ w_t·l_t and N should be
        Σ w_t over the accumulated batch (:class:`EMDLMTrainerMixin` counts it so)."""
        require_sum_reduction(self.loss_fn, self.who)  # an attribute read: may have changed
        inputs = self.inputs(
            outputs, labels, shifted=shifted, number_mask=number_mask,
            teacher_logits=teacher_logits, loss_weights=loss_weights,
        )
        out, count = self.step(inputs)
        self.last_token_hits = inputs.token_hits(out, self.ignore_index)
        if torch.is_grad_enabled():
            self._record(out.loss.detach(), out.components, count)
        return scaled_loss(out.loss, count, num_items_in_batch)

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
        divisor = weight if weight > 0 else 1.0  # a weight sum may lie in (0, 1): no max(w, 1)
        out = {"loss": loss_sum / divisor, "n_scored": weight}
        for key, value in zip(keys, values[2:], strict=True):
            out[key] = value if key.startswith("n_") else value / divisor
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


def loss_scale_across_devices(trainer: Any) -> int:
    """What ``Trainer.compute_loss`` multiplies a loss divided by ``num_items_in_batch`` by when
    ``average_tokens_across_devices``: N counts every rank's tokens while DDP averages gradients
    over ranks (tensor-parallel ranks share a batch and count once)."""
    if trainer.args.n_gpu > 1:
        return int(trainer.args.n_gpu)
    tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
    return int(trainer.accelerator.num_processes // max(tp, 1))


class EMDLMTrainerMixin:
    """``compute_loss`` of a ``transformers.Trainer`` (or TRL trainer) whose
    ``compute_loss_func`` is a :class:`ComputeLoss`: the trainer owns its teacher and hands
    each batch's extras to the loss as arguments.

    Per micro-batch: the ``number_mask`` the collators add with a number scope
    (``data.number_scope``) and the per-token ``loss_weights`` (the data's ``loss_weight``
    field, :mod:`emdlm.integrations.loss_weights`) are taken out of the inputs (the model never
    sees them); the frozen
    ``teacher`` (if any) runs on exactly the student's inputs (same padding, same autocast);
    the model runs without labels; then ``compute_loss_func(outputs, labels,
    num_items_in_batch=N, number_mask=..., loss_weights=..., teacher_logits=...)`` (only the
    extras the batch has), scaled like ``Trainer.compute_loss``
    (:func:`loss_scale_across_devices`). With weighted batches N is the weight sum of the
    accumulated batch (:func:`~emdlm.integrations.loss_weights.weighted_item_count`), and a
    loss that takes no weights is refused when the training data is first loaded
    (:meth:`ComputeLoss.check_dataset`), before any step.
    The teacher is not part of the Trainer's model: never optimized or saved; freeze it
    yourself (``eval()``, ``requires_grad_(False)``), as :func:`emdlm.training.train.
    load_teacher` does.
    """

    teacher: nn.Module | None = None

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: Any) -> Any:
        """``num_items_in_batch`` counted over ``labels[..., 1:]``, the positions the emdlm loss
        scores, for every model.

        transformers' ``Trainer._get_num_items_in_batch`` (5.17-5.23) counts ``labels[..., 1:]``
        only when the model's ``loss_type`` maps to ``ForCausalLMLoss``, which it derives from
        the class name (``LlamaForCausalLM`` yes, ``GPT2LMHeadModel`` no); otherwise it counts
        every label. A collator that leaves each row's first token scored (TRL's, on plain-text
        rows) then makes N one token per row too big, and the loss and gradient too small by
        that factor. A batch's own ``shift_labels`` (padding-free collators) is kept as is.
        """
        for_count = [
            {**b, "shift_labels": b["labels"][..., 1:]}
            if isinstance(b, Mapping) and "labels" in b and "shift_labels" not in b else b
            for b in batch_samples
        ]
        weighted = weighted_item_count(batch_samples)
        if weighted is None:
            return super()._get_num_items_in_batch(for_count, device)  # type: ignore[misc]
        return self._spread_item_count(weighted, device)

    def _spread_item_count(self, local: torch.Tensor, device: Any) -> torch.Tensor:
        """A weighted ``num_items_in_batch`` (Σ w_t of this process's micro-batches) treated
        as transformers' ``Trainer._get_num_items_in_batch`` (5.23) treats its label count:
        summed over processes when ``average_tokens_across_devices``, else divided among
        DataParallel GPUs, then divided by the devices that share one batch (tensor, context
        and sequence parallel sizes)."""
        args = self.args  # type: ignore[attr-defined]
        count = local.to(device)
        if args.average_tokens_across_devices:
            if args.world_size > 1:
                count = self.accelerator.gather(count).sum()  # type: ignore[attr-defined]
        elif args.n_gpu > 1:
            count = count / args.n_gpu
        if args.n_gpu > 1 and count.dim() == 0:
            count = count.unsqueeze(0).expand(args.n_gpu, -1)
        shared = 1
        for size in ("get_tp_size", "get_cp_size", "get_sp_size"):
            getter = getattr(self, size, None)
            shared *= int(getter()) if callable(getter) else 1
        return count / shared

    def get_train_dataloader(self) -> Any:
        """The Trainer's, after refusing weighted training data for a loss that takes no
        weights (:meth:`ComputeLoss.check_dataset`): at setup, never silently unweighted."""
        loss_call = self.emdlm_loss_call()
        if isinstance(loss_call, ComputeLoss):
            loss_call.check_dataset(self.train_dataset)  # type: ignore[attr-defined]
        return super().get_train_dataloader()  # type: ignore[misc]

    def emdlm_loss_call(self) -> Any:
        """The :class:`ComputeLoss` this trainer scores with (the Trainer's
        ``compute_loss_func``; TRL's trainer keeps its own, see EMDLMSFTTrainer)."""
        return self.compute_loss_func  # type: ignore[attr-defined]

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        loss_call = self.emdlm_loss_call()
        if loss_call is None:
            raise ValueError(
                f"{type(self).__name__} needs compute_loss_func=make_compute_loss_func(loss_fn)"
            )
        inputs = dict(inputs)
        extras: dict[str, torch.Tensor] = {}
        for key in ("number_mask", TOKEN_WEIGHTS_KEY):
            value = inputs.pop(key, None)
            if value is not None:
                extras[key] = value
        labels = inputs.pop("labels", None)
        if self.teacher is not None:
            extras["teacher_logits"] = teacher_logits_for(self.teacher, inputs)
        if getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch
        outputs = model(**inputs)
        loss = loss_call(outputs, labels, num_items_in_batch=num_items_in_batch, **extras)
        args = self.args  # type: ignore[attr-defined]
        if args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * loss_scale_across_devices(self)
        return (loss, outputs) if return_outputs else loss


def emdlm_trainer(base: type, teacher: nn.Module | None = None) -> type:
    """A subclass of Trainer class ``base`` with :class:`EMDLMTrainerMixin`'s ``compute_loss``
    (``teacher``: the frozen distillation teacher it owns). A ``base`` that already is one
    keeps its teacher unless another is given."""
    if isinstance(base, type) and issubclass(base, EMDLMTrainerMixin):
        if teacher is None:
            return base
        return type(base.__name__, (base,), {"teacher": teacher})
    return type(f"EMDLM{base.__name__}", (EMDLMTrainerMixin, base), {"teacher": teacher})


class EMDLMTrainer(EMDLMTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`EMDLMTrainerMixin`'s ``compute_loss``::

        trainer = EMDLMTrainer(model=model, args=args, train_dataset=ds,
                               compute_loss_func=make_compute_loss_func(loss_fn),
                               teacher=frozen_teacher)  # teacher only for distillation
    """

    def __init__(self, *args: Any, teacher: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if teacher is not None:
            self.teacher = teacher


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
    "ComputeLoss", "EMDLMTrainer", "EMDLMTrainerMixin", "LossComponentsCallback",
    "emdlm_trainer", "loss_scale_across_devices", "make_compute_loss_func",
    "require_sum_reduction", "teacher_logits_for",
]
