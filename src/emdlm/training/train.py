"""The ``emdlm train`` recipe: validate everything, then create the output folder and train with
``transformers.Trainer`` and an emdlm loss as ``compute_loss_func``.

Order of work (nothing is written until every input has been checked):

1. :func:`prepare_run` loads the tokenizer, builds the model (checks the vocab), builds the
   objective (digit tokens, cost embedding, parameters), reads and tokenizes the data (file:line
   errors) and checks the output folder / checkpoint to resume from.
2. :func:`train` writes ``run_config.yaml``, trains (progress bar; per-step loss components in
   ``train_log.jsonl`` and TensorBoard under ``tb/``; checkpoints ``checkpoint-<step>``), saves
   the final model and tokenizer in the output folder and ``train_summary.json``.

Output folder safety (:mod:`emdlm.training.run_folder`): ``overwrite=True`` deletes only what
emdlm wrote there (its manifest plus known names) and refuses the current folder, its parents
and any folder holding the run's inputs. One run per folder: :func:`train` holds the folder's
lock (``.emdlm.lock``, rank 0 only) from before it writes the first byte until
train_summary.json is written, and checks the folder again under it (two runs that both saw an
empty folder cannot both use it); a second run is refused at once, naming the holder's pid.
Checkpoints are written under ``tmp-checkpoint-<step>`` and renamed into place when complete;
``resume`` checks the checkpoint (every file present and readable) before anything in the
folder changes, and falls back past a damaged newest one. A full disk while saving ends the
run with one line (:class:`~emdlm.training.run_folder.DiskFullError`) naming what was being
saved and the checkpoint that is intact.

The first Ctrl-C finishes the optimizer step in progress, saves a checkpoint and raises
:class:`TrainingInterrupted` (a second Ctrl-C aborts at once, still saving a checkpoint).
``resume=True`` continues from the newest checkpoint to the same result as an uninterrupted run
(same data order, optimizer, scheduler and RNG state).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from emdlm._files import atomic_write
from emdlm.config import ConfigError, ModelConfig, RunConfig
from emdlm.data import DataCollator, TokenizedDataset, build_dataset, load_examples
from emdlm.integrations.sharding import (
    check_fsdp_config,
    local_fraction,
    shard_model,
    shard_units,
    world_size_from_env,
)
from emdlm.integrations.transformers import (
    ComputeLoss,
    make_compute_loss_func,
    with_number_mask,
    with_teacher,
)
from emdlm.models import apply_lora, build_model, load_tokenizer, model_vocab_size
from emdlm.objectives import build_objective
from emdlm.training.launch import start_run_console
from emdlm.training.run_folder import (
    atomic_checkpoint_trainer,
    check_overwrite_target,
    check_run_folder_free,
    checkpoint_folders,
    clear_run_folder,
    full_disk_in_one_line,
    has_entries,
    hold_run_folder,
    record_outputs,
    remove_stale_saves,
    resume_checkpoint,
)
from emdlm.vlm.models import is_vlm
from emdlm.vlm.training import lora_targets

RUN_CONFIG = "run_config.yaml"  # also read by emdlm.training.evaluate
TRAIN_LOG = "train_log.jsonl"
_BUSY_HINT = "wait for it to finish, or choose another output_dir"


class TrainingInterrupted(RuntimeError):
    """Raised after Ctrl-C, once a checkpoint has been saved (``.checkpoint``)."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(f"training interrupted; checkpoint saved in {checkpoint}")
        self.checkpoint = checkpoint


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-<step> folder with the highest step, or None (``tmp-checkpoint-*``
    folders, saves in progress or killed, are ignored)."""
    found = checkpoint_folders(folder)
    return found[0] if found else None


def _checkpoint_step(checkpoint: Path) -> int:
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    tail = checkpoint.name.split("-")[-1]
    return int(tail) if tail.isdigit() else 0


def _logged_losses(log: Path, last_step: int) -> list[float] | None:
    """The per-step "loss" of steps 1..last_step from train_log.jsonl, or None when the log does
    not hold exactly those steps."""
    if not log.is_file():
        return None
    losses: dict[int, float] = {}
    for line in log.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "loss" in record and 1 <= int(record.get("step", 0)) <= last_step:
                losses[int(record["step"])] = float(record["loss"])
    if sorted(losses) != list(range(1, last_step + 1)):
        return None
    return [losses[s] for s in range(1, last_step + 1)]


def _logged_mean_loss(log: Path, last_step: int) -> float | None:
    """Mean step loss of steps 1..``last_step`` from the logged window means of train_log.jsonl:
    Σ_w loss_w · (step_w − step_{w−1}) / last_step. None unless the windows end at ``last_step``.

    Used for multi-process runs: there transformers' ``training_loss`` adds one process's
    unlogged remainder to the all-gathered window means and is off (1.3865 against the
    one-process 1.3716 in tests/test_multiprocess.py), while the logged means are exact."""
    if not log.is_file() or last_step < 1:
        return None
    windows: dict[int, float] = {}
    for line in log.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "loss" in record and 1 <= int(record.get("step", 0)) <= last_step:
                windows[int(record["step"])] = float(record["loss"])
    if not windows or max(windows) != last_step:
        return None
    total, previous = 0.0, 0
    for step in sorted(windows):
        total += windows[step] * (step - previous)
        previous = step
    return total / last_step


def _whole_run_loss(log: Path, resumed_at: int, result: Any) -> float | None:
    """Mean step loss over the whole run after a resume.

    transformers' ``training_loss`` averages only the steps this call ran (``resumed_at``+1 ..
    N); the steps before come from train_log.jsonl (kept up to ``resumed_at`` on resume), so
    the value equals an uninterrupted run's: (sum_{s<=S} loss_s + mean_this_call * (N - S)) / N.
    None when the log misses steps."""
    total_steps = int(result.global_step)
    before = _logged_losses(log, resumed_at)
    if before is None or total_steps <= 0:
        return None
    return (sum(before) + result.training_loss * (total_steps - resumed_at)) / total_steps


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
    overwrite: bool = False
    training_args: Any = None  # transformers.TrainingArguments, built (and checked) early
    teacher: Any = None  # frozen distillation teacher (``teacher:``), or None
    vlm: Any = None  # emdlm.vlm.training.VLMParts for a VLM run (collator, image processor)
    resume: bool | str = False  # as asked (``--resume`` / a checkpoint path): checked again
    inputs: tuple[str | None, ...] = ()  # the run's input files, kept out of --overwrite


def _run_inputs(cfg: RunConfig, config_path: str | Path | None) -> list[str | None]:
    """Files and folders the run reads: --overwrite must never delete a folder holding them."""
    sources = [s for s in (cfg.data.train, cfg.data.eval) if s is not None]
    return [
        *(s.path for s in sources), None if config_path is None else str(config_path),
        cfg.model.name, cfg.tokenizer, cfg.objective.cost_embedding, cfg.teacher,
    ]


def _check_output_dir(
    out: Path, resume: bool | str, overwrite: bool, inputs: Sequence[str | None], *,
    warn: bool = True,
) -> Path | None:
    """The checkpoint to resume from (checked complete), or None for a new run; ConfigError for
    an output folder this run may not use. Reads only. A folder holding only the lock file
    counts as empty. ``warn=False``: the same check made again (under the lock), no warnings."""
    if resume and overwrite:
        raise ConfigError("give --resume or --overwrite, not both")
    if resume:
        if isinstance(resume, str) and resume not in ("true", "latest"):
            ckpt = Path(resume)
            if not ckpt.is_dir():
                raise ConfigError(f"checkpoint to resume from not found: {ckpt}")
            return resume_checkpoint(out, ckpt, warn=warn)
        return resume_checkpoint(out, None, warn=warn)
    if not _is_main_process():
        # only rank 0 writes; another rank could otherwise see rank 0's fresh folder and stop
        return None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output path {out} exists and is not a folder")
    if out.is_dir() and has_entries(out):
        if not overwrite:
            raise ConfigError(
                f"output folder {out} is not empty: use --resume to continue it, --overwrite to "
                f"replace it, or another output_dir"
            )
        check_overwrite_target(out, inputs)
    elif overwrite:
        check_overwrite_target(out, [], require_run_folder=False)  # never cwd or its parents
    return None


def prepare_run(
    cfg: RunConfig,
    *,
    resume: bool | str = False,
    overwrite: bool = False,
    config_path: str | Path | None = None,
    eval_configs: Sequence[RunConfig] = (),
) -> PreparedRun:
    """Build and check tokenizer, model, objective, data, training arguments and output folder
    (``config_path``: the config file the run was loaded from, one of its inputs). Writes
    nothing. ``eval_configs``: the configs the finished run will be evaluated with (the
    experiment runner's); one whose generation cannot fit the model's context is an error here,
    before training (for the run's own ``eval`` settings it is a warning)."""
    from transformers import set_seed

    cfg.validate()
    if cfg.data.train is None:
        raise ConfigError("no training data: set data.train.path or data.train.task")
    if cfg.train.fsdp:
        _check_fsdp_run(cfg, resume)
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    out = Path(cfg.output_dir)
    if _is_main_process():  # another run in the folder: refused now, not after loading
        check_run_folder_free(out, hint=_BUSY_HINT)
    inputs = tuple(_run_inputs(cfg, config_path))
    resume_from = _check_output_dir(out, resume, overwrite, inputs)
    vlm = None
    if is_vlm(cfg.model.name):  # image+text rows, image processor and VLM (emdlm.vlm)
        from emdlm.vlm.training import prepare_vlm_run

        set_seed(cfg.train.seed)
        vlm = prepare_vlm_run(cfg)
        tokenizer, model = vlm.tokenizer, vlm.model
    else:
        train_rows = load_examples(cfg.data.train, seed=cfg.train.seed)
        eval_rows = (
            load_examples(cfg.data.eval, seed=cfg.train.seed) if cfg.data.eval is not None
            else None
        )
        tokenizer = load_tokenizer(cfg.tokenizer)
        set_seed(cfg.train.seed)
        model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    vocab = model_vocab_size(model)
    teacher = None
    if cfg.teacher is not None:
        teacher = load_teacher(cfg.teacher, tokenizer, vocab, cfg.model.dtype)
    loss_fn = build_objective(
        cfg.objective, tokenizer=tokenizer, model=model, vocab_size=vocab, teacher=teacher
    )
    if cfg.lora.enabled:
        model = apply_lora(
            model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
            target_modules=(
                cfg.lora.target_modules if vlm is None  # VLM: the language model only
                else lora_targets(cfg.lora.target_modules)
            ),
        )
    if cfg.train.fsdp:
        try:  # the blocks to shard exist (sharding itself is collective: in train())
            shard_units(model, cfg.train.fsdp_config.get("transformer_layer_cls_to_wrap"))
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if vlm is not None:
        train_ds, eval_ds = vlm.train_dataset, vlm.eval_dataset
    else:
        kw = dict(max_length=cfg.data.max_length, add_eos=cfg.data.add_eos,
                  extra_keys=cfg.data.extra_keys, on_truncate=cfg.data.on_truncate,
                  on_drop=cfg.data.on_drop, number_scope=cfg.data.number_scope)
        train_ds = build_dataset(train_rows, tokenizer, source=cfg.data.train.describe(),
                                 task=cfg.data.train.task, **kw)
        eval_ds = None
        if eval_rows is not None and cfg.data.eval is not None:
            eval_ds = build_dataset(eval_rows, tokenizer, source=cfg.data.eval.describe(),
                                    task=cfg.data.eval.task, **kw)
    if vlm is None:  # text models: will the evaluation after training be able to generate?
        _check_eval_generation(cfg, eval_configs, model, tokenizer, eval_rows)
    try:  # whatever transformers rejects fails here, before the folder is written
        args = training_arguments(cfg, out, eval_ds is not None)
        _dry_build_optimizer_and_scheduler(args, model)
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"transformers rejected the training settings: {err}") from err
    return PreparedRun(
        cfg, tokenizer, model, loss_fn, train_ds, eval_ds, out, resume_from, overwrite, args,
        teacher, vlm, resume, inputs,
    )


# eval kinds that generate (emdlm eval after training): their prompts should fit the context
GENERATION_KINDS = ("number", "clock", "box", "boxes", "text")


def _generation_problem(
    eval_cfg: RunConfig, model: Any, tokenizer: Any, rows: list[dict[str, Any]]
) -> str | None:
    """Why ``emdlm eval`` with ``eval_cfg`` could not generate with this model (its longest
    prompt + ``eval.max_new_tokens`` exceed the model's context), or None."""
    from emdlm.evaluation import check_generation_fits

    prompts = [str(r["prompt"]) for r in rows if "prompt" in r]
    try:
        check_generation_fits(model, tokenizer, prompts, eval_cfg.eval.max_new_tokens)
    except ValueError as err:
        where = eval_cfg.data.eval.describe() if eval_cfg.data.eval is not None else "eval"
        return f"{where}: {err}"
    return None


def _check_eval_generation(
    cfg: RunConfig, eval_configs: Sequence[RunConfig], model: Any, tokenizer: Any,
    eval_rows: list[dict[str, Any]] | None,
) -> None:
    """Before training: with ``eval_configs`` (the experiment runner's), ConfigError for one
    whose generation cannot fit the model's context; without, a warning when the run's own
    ``eval`` settings could not (the run may be evaluated later with other settings)."""
    for eval_cfg in eval_configs:
        if eval_cfg.data.eval is None or eval_cfg.eval.kind not in GENERATION_KINDS:
            continue
        same_data = (eval_rows is not None and eval_cfg.data.eval == cfg.data.eval
                     and eval_cfg.train.seed == cfg.train.seed)
        rows = eval_rows if same_data else load_examples(eval_cfg.data.eval,
                                                         seed=eval_cfg.train.seed)
        problem = _generation_problem(eval_cfg, model, tokenizer, rows)
        if problem:
            raise ConfigError(problem)
    if not eval_configs and eval_rows is not None and cfg.eval.kind in GENERATION_KINDS:
        problem = _generation_problem(cfg, model, tokenizer, eval_rows)
        if problem:
            print(f"warning: {problem}; `emdlm eval` with these settings will fail",
                  file=sys.stderr, flush=True)


def _check_fsdp_run(cfg: RunConfig, resume: bool | str) -> None:
    """ConfigError for a ``train.fsdp`` run emdlm cannot shard (see
    :mod:`emdlm.integrations.sharding`): one process, accelerate's own FSDP at the same time,
    ``--resume`` (checkpoints of a sharded run hold the gathered model only, no optimizer
    state), LoRA (adapters added after sharding are not sharded), or a bad ``fsdp_config``."""
    try:
        check_fsdp_config(cfg.train.fsdp_config)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    world = world_size_from_env()
    if world < 2:
        # one process would "shard" over itself: no error, no saving, not what was asked for
        raise ConfigError(
            f"train.fsdp=true shards the model over processes, but this run has {world}: launch "
            "with torchrun --standalone --nproc_per_node N -m emdlm.cli train ... (N >= 2)"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ConfigError(
            "train.fsdp=true applies FSDP2 in emdlm, but accelerate was launched with its own "
            "FSDP config: use one of them (torchrun + train.fsdp=true, or the accelerate config "
            "with train.fsdp=false)"
        )
    if resume:
        raise ConfigError(
            "--resume is not supported with train.fsdp=true: its checkpoints hold the gathered "
            "model only (no optimizer state)"
        )
    if cfg.lora.enabled:
        raise ConfigError("train.fsdp=true with lora.enabled is not supported")


def load_teacher(path: str, tokenizer: Any, vocab_size: int, dtype: str) -> Any:
    """The distillation teacher: a local causal-LM folder, frozen (eval mode, no gradients), in
    the student's dtype (it follows the student's device at the first batch).

    ConfigError when the folder is missing, its output layer has not ``vocab_size`` rows (the
    student's), or it ships a tokenizer whose vocabulary differs from the student's (the
    teacher's distribution must be over the same tokens, in the same order)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"teacher folder not found: {path} (teacher)")
    try:
        teacher = build_model(ModelConfig(name=str(folder), dtype=dtype), tokenizer)
    except ConfigError as err:
        raise ConfigError(f"teacher {path}: {err}") from err
    rows = model_vocab_size(teacher)
    if rows != vocab_size:
        raise ConfigError(
            f"teacher {path} has {rows} output rows but the student has {vocab_size}: teacher "
            "and student must share the vocabulary"
        )
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        teacher_vocab = load_tokenizer(str(folder)).get_vocab()
        if teacher_vocab != tokenizer.get_vocab():
            differ = sorted(set(teacher_vocab.items()) ^ set(tokenizer.get_vocab().items()))
            raise ConfigError(
                f"teacher {path} has a different tokenizer than the student "
                f"({len(teacher_vocab)} vs {len(tokenizer.get_vocab())} tokens; e.g. "
                f"{differ[:3]} differ): distillation needs the same token ids"
            )
    else:
        print(f"warning: teacher {path} has no tokenizer files; only its vocabulary size was "
              "checked against the student's", file=sys.stderr)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def _dry_build_optimizer_and_scheduler(args: Any, model: Any) -> None:
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
        # train.fsdp: emdlm applies FSDP2 itself (emdlm.integrations.sharding), not accelerate;
        # a sharded model's checkpoints are the gathered weights only (transformers refuses to
        # save the sharded optimizer state of such a model)
        save_only_model=t.fsdp,
        # only passed when on: the argument is deprecated in transformers 5 (a warning)
        **({"activation_checkpointing": True} if t.gradient_checkpointing else {}),
    )


def train(run: PreparedRun, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train a prepared run; returns the summary also written to train_summary.json.

    ``callbacks``: extra ``transformers.TrainerCallback`` objects.

    Rank 0 holds the run folder's lock (:func:`emdlm.training.run_folder.hold_run_folder`) from
    before its first write until train_summary.json is written, and releases it however
    training ends (error, Ctrl-C); the folder is checked again under the lock. Raises
    :class:`~emdlm.training.run_folder.RunFolderBusy` at once when another process holds it,
    ConfigError when another process wrote into the folder since :func:`prepare_run` looked.
    Other ranks take no lock: they would block on rank 0's (and rank 0 does all the writing).
    """
    if not _is_main_process():
        return _train_in_folder(run, callbacks)
    with hold_run_folder(run.output_dir, _holder_label(run), hint=_BUSY_HINT):
        _check_output_dir_again(run)
        return _train_in_folder(run, callbacks)


def _holder_label(run: PreparedRun) -> str:
    """What the lock file says this process is doing (shown to a process it refuses)."""
    if run.resume_from is not None:
        return "emdlm train --resume"
    return "emdlm train --overwrite" if run.overwrite else "emdlm train"


def _check_output_dir_again(run: PreparedRun) -> None:
    """:func:`prepare_run`'s output-folder check made again under the lock: between that check
    and the lock another run may have written into the folder (both saw it empty) or saved a
    newer checkpoint. ConfigError when the outcome changed, before anything is written."""
    resume = run.resume or (str(run.resume_from) if run.resume_from is not None else False)
    now = _check_output_dir(run.output_dir, resume, run.overwrite, run.inputs, warn=False)
    if now != run.resume_from:
        raise ConfigError(
            f"{run.output_dir} changed while this run was being prepared (the checkpoint to "
            f"resume from is now {now}, was {run.resume_from}): run the command again"
        )


def _train_in_folder(run: PreparedRun, callbacks: list[Any] | None) -> dict[str, Any]:
    """The body of :func:`train`, with the folder's lock held (rank 0)."""
    from transformers import Trainer

    cfg, out = run.cfg, run.output_dir
    main = _is_main_process()
    args = run.training_args
    if args is None:  # a PreparedRun built by hand
        args = training_arguments(cfg, out, run.eval_dataset is not None)
    fsdp_facts = _shard(run, args) if cfg.train.fsdp else None
    existing: set[str] = set()
    if main:
        existing = _prepare_folder(run)
        if run.vlm is not None:  # before training, so eval of a checkpoint-N finds it here
            run.vlm.image_processor.save_pretrained(str(out))
            record_outputs(out, ["preprocessor_config.json"])
    compute_loss = make_compute_loss_func(
        run.loss_fn, from_hidden=cfg.train.fused_linear,
        model=run.model if cfg.train.fused_linear else None,
    )
    logger = _step_logger(compute_loss, out, cfg.train.tensorboard)
    stopper = _GracefulStop()
    schedule: list[Any] = []
    if cfg.objective.lam_schedule != "constant":
        from emdlm.training.lam_schedule import lam_schedule_callback

        schedule = [lam_schedule_callback(run.loss_fn, cfg.objective.lam_schedule,
                                          cfg.objective.lam_final)]
    trainer_cls = atomic_checkpoint_trainer(Trainer)
    if run.teacher is not None:  # the teacher's logits on every batch, for the distill loss
        trainer_cls = with_teacher(trainer_cls, run.teacher, compute_loss)
    # outermost: a batch's number_mask (data.number_scope) goes to the loss, not to a model
    trainer_cls = with_number_mask(trainer_cls, compute_loss)
    trainer = trainer_cls(
        model=run.model,
        args=args,
        train_dataset=run.train_dataset,
        eval_dataset=run.eval_dataset,
        data_collator=(
            run.vlm.collator if run.vlm is not None
            else DataCollator(run.tokenizer.pad_token_id, cfg.data.pad_to_multiple_of)
        ),
        processing_class=run.tokenizer,  # checkpoints carry the tokenizer (eval works on them)
        compute_loss_func=compute_loss,
        callbacks=[*schedule, logger, stopper.callback, *(callbacks or [])],
    )
    start_run_console(trainer)  # world size + launcher check (rank 0), tidy console lines
    resume = str(run.resume_from) if run.resume_from is not None else None
    try:
        # a full disk (checkpoint, train_log.jsonl): one line, no traceback
        with stopper.handle_sigint(), full_disk_in_one_line(out, f"into {out} during training"):
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
    trained_step = int(result.global_step)
    with full_disk_in_one_line(out, f"the final model into {out} (its model files there are "
                               "incomplete)", trained_step=trained_step):
        _save_final_model(run, trainer, main)
    summary = {
        "global_step": result.global_step,
        "train_loss": result.training_loss,
        **{k: v for k, v in result.metrics.items() if isinstance(v, (int, float))},
        "objective": cfg.objective.name,
        "output_dir": str(out),
        "data": {
            name: ds.cuts.to_dict()
            for name, ds in (("train", run.train_dataset), ("eval", run.eval_dataset))
            if ds is not None and getattr(ds, "cuts", None) is not None
        },
    }
    if fsdp_facts is not None:  # what the Trainer trained: the FSDP module, not a DDP wrapper
        summary["fsdp"] = {**fsdp_facts, "trained_as": type(trainer.model_wrapped).__name__}
    if main and run.resume_from is not None:
        _whole_run_summary(summary, out, _checkpoint_step(run.resume_from), result)
    elif main and world_size_from_env() > 1:
        logged = _logged_mean_loss(out / TRAIN_LOG, int(result.global_step))
        if logged is not None:
            summary["train_loss"] = logged
    if main:
        with full_disk_in_one_line(out, f"{out / 'train_summary.json'} (the final model was "
                                   "saved)", trained_step=trained_step):
            # whole or absent: the experiment runner reads it to know the cell trained
            with atomic_write(out / "train_summary.json") as fh:
                fh.write(json.dumps(summary, indent=2))
            created = {p.name for p in out.iterdir()} - existing
            record_outputs(out, created | {"train_summary.json"})
    return summary


def _save_final_model(run: PreparedRun, trainer: Any, main: bool) -> None:
    """The trained model (LoRA: the adapter and a merged full model) and the tokenizer, in the
    run folder."""
    out = run.output_dir
    if run.cfg.lora.enabled:  # keep the adapter, and save a merged full model for eval
        trainer.save_model(str(out / "adapter"))
        if main:
            trainer.model.merge_and_unload().save_pretrained(str(out))
    else:
        trainer.save_model(str(out))  # gathers FSDP / DeepSpeed shards; writes on rank 0
    if main:
        run.tokenizer.save_pretrained(str(out))


def _shard(run: PreparedRun, args: Any) -> dict[str, Any]:
    """FSDP2 on ``run.model`` over every process (collective), before the Trainer is built;
    returns what was sharded (for train_summary.json) and says it on rank 0's stderr."""
    import torch.distributed as dist

    _ = args.device  # sets up accelerate's process group (gloo on CPU, NCCL on GPU)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("train.fsdp: torch.distributed was not initialised by the launcher")
    fsdp_cfg = run.cfg.train.fsdp_config
    shard_model(
        run.model, fsdp_cfg.get("transformer_layer_cls_to_wrap"),
        reshard_after_forward=fsdp_cfg.get("reshard_after_forward", True),
    )
    local, full = local_fraction(run.model)
    facts = {
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "param_elements": full, "local_param_elements_rank0": local,
    }
    if _is_main_process():
        print(f"emdlm: FSDP2 over {facts['world_size']} processes ({facts['backend']}): rank 0 "
              f"holds {local} of {full} parameter elements", file=sys.stderr, flush=True)
    return facts


def _whole_run_summary(summary: dict[str, Any], out: Path, resumed_at: int, result: Any) -> None:
    """After a resume: ``train_loss`` over the whole run (see :func:`_whole_run_loss`)."""
    summary["resumed_from_step"] = resumed_at
    whole = _whole_run_loss(out / TRAIN_LOG, resumed_at, result)
    if whole is None:
        summary["train_loss_steps"] = f"{resumed_at + 1}-{result.global_step}"
        print(
            f"warning: {out / TRAIN_LOG} misses steps before {resumed_at + 1}: train_loss in "
            "train_summary.json covers only the steps run since the resume", file=sys.stderr,
        )
    else:
        summary["train_loss"] = whole


def _prepare_folder(run: PreparedRun) -> set[str]:
    """Rank 0, after every check passed: clear what an old run wrote (``--overwrite``; the
    user's other files stay), or tidy a resumed folder; write run_config.yaml and the manifest;
    trim train_log.jsonl to the checkpoint. Returns the entries present before training."""
    cfg, out = run.cfg, run.output_dir
    if run.overwrite and run.resume_from is None and out.is_dir():
        removed, kept = clear_run_folder(out)
        if removed:
            print(
                f"--overwrite: removed from {out}: {', '.join(removed)}"
                + (f" (kept: {', '.join(kept)})" if kept else ""), file=sys.stderr, flush=True,
            )
    out.mkdir(parents=True, exist_ok=True)
    if run.resume_from is not None:
        stale = remove_stale_saves(out)
        if stale:
            print(f"removed unfinished checkpoint saves: {', '.join(stale)}", file=sys.stderr)
    record_outputs(out, [RUN_CONFIG, TRAIN_LOG] + (["tb"] if cfg.train.tensorboard else []))
    (out / RUN_CONFIG).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if run.resume_from is not None:
        _truncate_log(out / TRAIN_LOG, _checkpoint_step(run.resume_from))
    return {p.name for p in out.iterdir()}


def run_training(
    cfg: RunConfig,
    *,
    resume: bool | str = False,
    overwrite: bool = False,
    config_path: str | Path | None = None,
    eval_configs: Sequence[RunConfig] = (),
) -> dict[str, Any]:
    """prepare_run + train."""
    return train(prepare_run(cfg, resume=resume, overwrite=overwrite, config_path=config_path,
                             eval_configs=eval_configs))
