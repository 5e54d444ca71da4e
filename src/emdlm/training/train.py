"""The ``emdlm train`` recipe: validate everything, then create the output folder and train with
``transformers.Trainer`` and an emdlm loss as ``compute_loss_func``.

Order of work (nothing is written until every input has been checked):

1. :func:`prepare_run` loads the tokenizer, builds the model (checks the vocab), builds the
   objective (digit tokens, cost embedding, parameters), reads and tokenizes the data (file:line
   errors) and checks the output folder / checkpoint to resume from.
2. :func:`train` writes ``run_config.yaml``, trains (progress bar; per-step loss components in
   ``train_log.jsonl`` and TensorBoard under ``tb/``; checkpoints ``checkpoint-<step>``), saves
   the final model and tokenizer in the output folder and ``train_summary.json``.

The first Ctrl-C finishes the optimizer step in progress, saves a checkpoint and raises
:class:`TrainingInterrupted` (a second Ctrl-C aborts at once, still saving a checkpoint).
``resume=True`` continues from the newest checkpoint to the same result as an uninterrupted run
(same data order, optimizer, scheduler and RNG state).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from emdlm.config import ConfigError, RunConfig
from emdlm.data import DataCollator, TokenizedDataset, build_dataset, load_examples
from emdlm.integrations.transformers import ComputeLoss, make_compute_loss_func
from emdlm.models import apply_lora, build_model, load_tokenizer, model_vocab_size
from emdlm.objectives import build_objective

RUN_CONFIG = "run_config.yaml"  # also read by emdlm.training.evaluate
TRAIN_LOG = "train_log.jsonl"


class TrainingInterrupted(RuntimeError):
    """Raised after Ctrl-C, once a checkpoint has been saved (``.checkpoint``)."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(f"training interrupted; checkpoint saved in {checkpoint}")
        self.checkpoint = checkpoint


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-<step> folder with the highest step, or None."""
    found = [
        (int(p.name.split("-")[-1]), p)
        for p in folder.glob("checkpoint-*")
        if p.is_dir() and p.name.split("-")[-1].isdigit()
    ]
    return max(found)[1] if found else None


def _checkpoint_step(checkpoint: Path) -> int:
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    tail = checkpoint.name.split("-")[-1]
    return int(tail) if tail.isdigit() else 0


def _truncate_log(log: Path, step: int) -> None:
    """Drop log records after the checkpoint being resumed (they will be logged again)."""
    if not log.is_file():
        return
    kept = [line for line in log.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    log.write_text("".join(line + "\n" for line in kept))


@dataclass
class PreparedRun:
    """Everything a run needs, built and checked before anything is written."""

    cfg: RunConfig
    tokenizer: Any
    model: Any
    loss_fn: torch.nn.Module
    train_dataset: TokenizedDataset
    eval_dataset: TokenizedDataset | None
    output_dir: Path
    resume_from: Path | None


def _check_output_dir(out: Path, resume: bool | str, overwrite: bool) -> Path | None:
    if resume:
        if isinstance(resume, str) and resume not in ("true", "latest"):
            ckpt = Path(resume)
            if not ckpt.is_dir():
                raise ConfigError(f"checkpoint to resume from not found: {ckpt}")
            return ckpt
        ckpt = latest_checkpoint(out) if out.is_dir() else None
        if ckpt is None:
            raise ConfigError(f"--resume: no checkpoint-* folder in {out}")
        return ckpt
    if not _is_main_process():
        # only rank 0 writes; another rank could otherwise see rank 0's fresh folder and stop
        return None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output path {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"output folder {out} is not empty: use --resume to continue it, --overwrite to "
                f"replace it, or another output_dir"
            )
        if not (out / RUN_CONFIG).exists():
            raise ConfigError(f"--overwrite: {out} is not an emdlm run folder; refusing to delete")
    return None


def prepare_run(
    cfg: RunConfig, *, resume: bool | str = False, overwrite: bool = False
) -> PreparedRun:
    """Build and check tokenizer, model, objective, data and output folder. Writes nothing."""
    from transformers import set_seed

    cfg.validate()
    if cfg.data.train is None:
        raise ConfigError("no training data: set data.train.path or data.train.task")
    if cfg.train.fsdp and not _has_accelerator():
        # accelerate 1.15 turns FSDP on only for multi-GPU-type devices; on CPU it would
        # silently train with plain DDP instead
        raise ConfigError("train.fsdp needs GPUs: accelerate does not shard on CPU (use DDP)")
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    out = Path(cfg.output_dir)
    resume_from = _check_output_dir(out, resume, overwrite)
    train_rows = load_examples(cfg.data.train, seed=cfg.train.seed)
    eval_rows = (
        load_examples(cfg.data.eval, seed=cfg.train.seed) if cfg.data.eval is not None else None
    )
    tokenizer = load_tokenizer(cfg.tokenizer)
    set_seed(cfg.train.seed)
    model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    vocab = model_vocab_size(model)
    loss_fn = build_objective(cfg.objective, tokenizer=tokenizer, model=model, vocab_size=vocab)
    if cfg.lora.enabled:
        model = apply_lora(
            model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
        )
    kw = dict(max_length=cfg.data.max_length, add_eos=cfg.data.add_eos,
              extra_keys=cfg.data.extra_keys)
    train_ds = build_dataset(train_rows, tokenizer, source=cfg.data.train.describe(), **kw)
    eval_ds = None
    if eval_rows is not None and cfg.data.eval is not None:
        eval_ds = build_dataset(eval_rows, tokenizer, source=cfg.data.eval.describe(), **kw)
    return PreparedRun(cfg, tokenizer, model, loss_fn, train_ds, eval_ds, out, resume_from)


def _step_logger(compute_loss: ComputeLoss, out: Path, tensorboard: bool) -> Any:
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        """Per optimizer step: every loss component to train_log.jsonl and TensorBoard."""

        def __init__(self) -> None:
            self.fh: Any = None
            self.tb: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not state.is_world_process_zero:
                return
            self.fh = (out / TRAIN_LOG).open("a", encoding="utf-8")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(out / "tb"))
                except ImportError:  # tensorboard not installed: JSONL only
                    self.tb = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            comps = compute_loss.pop_components(all_reduce=True)  # collective: every rank
            if not state.is_world_process_zero or self.fh is None:
                return
            opt = kwargs.get("optimizer")
            lr = float(opt.param_groups[0]["lr"]) if opt is not None else None
            record = {"step": state.global_step, "epoch": state.epoch, "lr": lr, **comps}
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()
            if self.tb is not None:
                for key, value in comps.items():
                    self.tb.add_scalar(f"train/{key}", value, state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if self.tb is not None and logs:
                for key, value in logs.items():
                    if isinstance(value, (int, float)):
                        self.tb.add_scalar(f"trainer/{key}", value, state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.close()

        def close(self) -> None:
            if self.fh is not None:
                self.fh.close()
                self.fh = None
            if self.tb is not None:
                self.tb.close()
                self.tb = None

    return StepLogger()


class _GracefulStop:
    """First Ctrl-C: finish the current optimizer step, save a checkpoint, stop. Second
    Ctrl-C: the usual KeyboardInterrupt."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if outer.requested:
                    control.should_save = True
                    control.should_training_stop = True

        self.requested = False
        self.callback = _Callback()

    @contextlib.contextmanager
    def handle_sigint(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            print("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again to abort)",
                  file=sys.stderr, flush=True)

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _has_accelerator() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def training_arguments(cfg: RunConfig, out: Path, has_eval: bool) -> Any:
    """transformers.TrainingArguments for ``cfg``."""
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
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=t.num_workers,
        dataloader_pin_memory=torch.cuda.is_available(),
        # accelerate only sets up multi-process CPU (gloo) training when told it is on CPU
        use_cpu=not _has_accelerator(),
        bf16=t.bf16,
        fp16=t.fp16,
        average_tokens_across_devices=True,
        fsdp=True if t.fsdp else None,
        fsdp_config=t.fsdp_config or None,
        # only passed when on: the argument is deprecated in transformers 5 (a warning)
        **({"activation_checkpointing": True} if t.gradient_checkpointing else {}),
    )


def train(run: PreparedRun, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train a prepared run; returns the summary also written to train_summary.json.

    ``callbacks``: extra ``transformers.TrainerCallback`` objects."""
    from transformers import Trainer

    cfg, out = run.cfg, run.output_dir
    main = _is_main_process()
    if main:
        if run.resume_from is None and out.is_dir():  # --overwrite, checked in prepare_run
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_CONFIG).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if run.resume_from is not None:
            _truncate_log(out / TRAIN_LOG, _checkpoint_step(run.resume_from))
    compute_loss = make_compute_loss_func(run.loss_fn)
    logger = _step_logger(compute_loss, out, cfg.train.tensorboard)
    stopper = _GracefulStop()
    trainer = Trainer(
        model=run.model,
        args=training_arguments(cfg, out, run.eval_dataset is not None),
        train_dataset=run.train_dataset,
        eval_dataset=run.eval_dataset,
        data_collator=DataCollator(run.tokenizer.pad_token_id, cfg.data.pad_to_multiple_of),
        processing_class=run.tokenizer,  # checkpoints carry the tokenizer (eval works on them)
        compute_loss_func=compute_loss,
        callbacks=[logger, stopper.callback, *(callbacks or [])],
    )
    resume = str(run.resume_from) if run.resume_from is not None else None
    try:
        with stopper.handle_sigint():
            result = trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:  # a second Ctrl-C (or one outside the main thread's handler)
        logger.close()
        # NOTE: a private Trainer method; it writes model, optimizer, scheduler, RNG and
        # trainer state exactly as a scheduled checkpoint, so --resume works from it. (An
        # interrupt inside optimizer.step could leave a half-updated step: the first Ctrl-C
        # takes the clean path below.)
        trainer._save_checkpoint(trainer.model, trial=None)
        raise TrainingInterrupted(out / f"checkpoint-{trainer.state.global_step}") from None
    if stopper.requested:  # first Ctrl-C: the Trainer saved after the step it was in
        raise TrainingInterrupted(out / f"checkpoint-{trainer.state.global_step}")
    if cfg.lora.enabled:  # keep the adapter, and save a merged full model for eval
        trainer.save_model(str(out / "adapter"))
        if main:
            trainer.model.merge_and_unload().save_pretrained(str(out))
    else:
        trainer.save_model(str(out))  # gathers FSDP / DeepSpeed shards; writes on rank 0
    if main:
        run.tokenizer.save_pretrained(str(out))
    summary = {
        "global_step": result.global_step,
        "train_loss": result.training_loss,
        **{k: v for k, v in result.metrics.items() if isinstance(v, (int, float))},
        "objective": cfg.objective.name,
        "output_dir": str(out),
    }
    if main:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_training(
    cfg: RunConfig, *, resume: bool | str = False, overwrite: bool = False
) -> dict[str, Any]:
    """prepare_run + train."""
    return train(prepare_run(cfg, resume=resume, overwrite=overwrite))
