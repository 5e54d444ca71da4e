"""The training settings of the ``emdlm train`` recipe as ``transformers.TrainingArguments``,
and the check that transformers accepts them (optimizer, LR schedule) before anything is
written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from emdlm.config import RunConfig
from emdlm.vlm.models import is_vlm


def has_accelerator() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def report_integrations(value: str | list[str]) -> list[str]:
    """``train.report_to`` as the Trainer's list; ValueError naming an integration transformers
    does not know (with the known ones) or one whose package is not installed."""
    from transformers.integrations import integration_utils

    names = [n for n in ([value] if isinstance(value, str) else list(value)) if n != "none"]
    known = sorted(integration_utils.INTEGRATION_TO_CALLBACK)
    installed = set(integration_utils.get_available_reporting_integrations())
    for name in names:
        if name not in known:
            raise ValueError(
                f"train.report_to: {name!r} is not a transformers logging integration "
                f"(known: {', '.join(known)})"
            )
        if name not in installed:
            raise ValueError(
                f"train.report_to: {name!r} needs its package, which is not installed here "
                f"(pip install {name.replace('_', '-')})"
            )
    return names


def training_arguments(
    cfg: RunConfig, out: Path, has_eval: bool, *, use_cpu: bool | None = None
) -> Any:
    """transformers.TrainingArguments for ``cfg`` (``use_cpu``: default, when no accelerator
    is found)."""
    from transformers import TrainingArguments

    t, o = cfg.train, cfg.optim
    do_eval = has_eval and t.eval_steps is not None
    warmup: float = o.warmup_steps if o.warmup_steps > 0 else o.warmup_ratio
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.max_grad_norm,
        lr_scheduler_type=o.scheduler,
        warmup_steps=warmup,
        optim=o.optim,
        logging_strategy="steps",
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy="steps" if do_eval else "no",
        eval_steps=t.eval_steps if do_eval else None,
        seed=t.seed,
        data_seed=t.seed,
        disable_tqdm=not t.progress_bar,
        # emdlm logs every loss component to train_log.jsonl and tb/ itself; train.report_to
        # adds the Trainer's integrations (wandb, mlflow, ...)
        report_to=report_integrations(t.report_to) or "none",
        # every parameter of a causal LM takes part in each forward, so DDP need not search the
        # graph for unused ones (and warn that it found none); VLMs keep transformers' default
        ddp_find_unused_parameters=None if is_vlm(cfg.model.name) else False,
        remove_unused_columns=False,
        dataloader_num_workers=t.num_workers,
        dataloader_pin_memory=torch.cuda.is_available(),
        # accelerate only sets up multi-process CPU (gloo) training when told it is on CPU
        use_cpu=not has_accelerator() if use_cpu is None else use_cpu,
        bf16=t.bf16,
        fp16=t.fp16,
        average_tokens_across_devices=True,
        # train.fsdp: emdlm applies FSDP2 itself (emdlm.integrations.sharding), not accelerate;
        # a sharded model's checkpoints are the gathered weights only (transformers refuses to
        # save the sharded optimizer state of such a model)
        save_only_model=t.fsdp,
        # only passed when on: the argument is deprecated in transformers 5 (a warning)
        **({"activation_checkpointing": True} if t.gradient_checkpointing else {}),
    )


def dry_build_optimizer_and_scheduler(args: Any, model: Any) -> None:
    """Resolve the optimizer class and build the LR schedule on a one-element dummy optimizer,
    as Trainer will at its first step, so that a combination transformers rejects (an optimizer
    whose package is missing, a schedule needing settings) fails before anything is written."""
    from transformers import Trainer, get_scheduler

    Trainer.get_optimizer_cls_and_kwargs(args, model)
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    get_scheduler(
        args.lr_scheduler_type, optimizer=dummy, num_warmup_steps=0,
        num_training_steps=max(args.max_steps, 1),
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )
