"""The ``emdlm train`` recipe: validate everything, then create the output folder and train with
``transformers.Trainer`` and an emdlm loss as ``compute_loss_func``.

A recipe with parts (as torchtune's: setup, train, cleanup), each its own module:

- the model adapter (:mod:`emdlm.training.adapters`), chosen once from ``model.name``: a text
  model or an image-text model (VLM); it builds the tokenizer and model, the datasets and the
  collator, saves what goes beside the model and evaluates a trained folder;
- the run folder (:class:`~emdlm.training.folder_guard.FolderGuard`): safety checks, the lock,
  resume, the whole-run loss;
- distillation (:func:`~emdlm.training.distill.load_teacher`), the training arguments
  (:mod:`emdlm.training.arguments`), the step log and Ctrl-C (:mod:`emdlm.training.callbacks`).

Order of work (nothing is written until every input has been checked):

1. :func:`prepare_run` (setup) checks the output folder / checkpoint to resume from, loads the
   tokenizer, builds the model (checks the vocab), builds the objective (digit tokens, cost
   embedding, parameters), reads and tokenizes the data (file:line errors).
2. :func:`train` writes ``run_config.yaml``, trains (progress bar; per-step loss components in
   ``train_log.jsonl`` and TensorBoard under ``tb/``; checkpoints ``checkpoint-<step>``), saves
   the final model and tokenizer in the output folder and ``train_summary.json`` (cleanup: the
   folder's lock and the Ctrl-C handler are released however training ends).

Output folder safety (:mod:`emdlm.training.run_folder`): ``overwrite=True`` deletes only what
emdlm wrote there (its manifest plus known names) and refuses the current folder, its parents
and any folder holding the run's inputs. One run per folder: :func:`train` holds the folder's
lock (``.emdlm.lock``, rank 0 only) from before it writes the first byte until
train_summary.json is written, and checks the folder again under it (two runs that both saw an
empty folder cannot both use it); a second run is refused at once, naming the holder's pid.
Checkpoints are written under ``tmp-checkpoint-<step>`` and renamed into place when complete;
``resume`` checks the checkpoint (every file present and readable) before anything in the
folder changes, and falls back past a damaged newest one. A full disk while saving ends the
run with one line (:class:`~emdlm.training.saving.DiskFullError`) naming what was being
saved and the checkpoint that is intact.

The first Ctrl-C finishes the optimizer step in progress, saves a checkpoint and raises
:class:`TrainingInterrupted` (a second Ctrl-C aborts at once, still saving a checkpoint).
``resume=True`` continues from the newest checkpoint to the same result as an uninterrupted run
(same data order, optimizer, scheduler and RNG state).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from emdlm.config import ConfigError, RunConfig
from emdlm.data import TokenizedDataset, check_task_sources, load_examples
from emdlm.integrations.loss_weights import LOSS_WEIGHT_KEY, dataset_loss_weights
from emdlm.integrations.sharding import (
    check_fsdp_config,
    local_fraction,
    shard_model,
    shard_units,
    world_size_from_env,
)
from emdlm.integrations.transformers import (
    emdlm_trainer,
    make_compute_loss_func,
)
from emdlm.models import apply_lora, model_vocab_size
from emdlm.objectives import build_objective, weighable_objectives
from emdlm.training.adapters import GENERATION_KINDS, ModelAdapter, TextAdapter, adapter_for
from emdlm.training.arguments import dry_build_optimizer_and_scheduler
from emdlm.training.arguments import has_accelerator as _has_accelerator
from emdlm.training.arguments import training_arguments as _training_arguments
from emdlm.training.callbacks import GracefulStop as _GracefulStop
from emdlm.training.callbacks import TrainingInterrupted
from emdlm.training.callbacks import step_logger as _step_logger
from emdlm.training.distill import load_teacher
from emdlm.training.folder_guard import (
    RUN_CONFIG,
    TRAIN_LOG,
    FolderGuard,
    check_resume_settings,
    is_main_process,
    latest_checkpoint,
    run_inputs,
)
from emdlm.training.launch import from_hidden_message, start_run_console
from emdlm.training.run_folder import record_outputs
from emdlm.training.saving import atomic_checkpoint_trainer, full_disk_in_one_line

__all__ = [  # the recipe's names, and those of its parts that were first defined here
    "GENERATION_KINDS", "RUN_CONFIG", "TRAIN_LOG", "PreparedRun", "TrainingInterrupted",
    "latest_checkpoint", "load_teacher", "prepare_run", "run_training", "train",
    "training_arguments",
]


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
    adapter: ModelAdapter | None = None  # text or image-text (emdlm.training.adapters); None: text
    resume: bool | str = False  # as asked (``--resume`` / a checkpoint path): checked again
    inputs: tuple[str | None, ...] = ()  # the run's input files, kept out of --overwrite
    # test rows generated at each evaluation (emdlm.training.generation_eval), or None
    generation_eval_rows: list[dict[str, Any]] | None = None

    @property
    def model_adapter(self) -> ModelAdapter:
        return self.adapter if self.adapter is not None else TextAdapter()

    @property
    def folder(self) -> FolderGuard:
        """The run folder's guard (lock, checks, first write, summary)."""
        return FolderGuard(self.output_dir, self.resume, self.overwrite, self.inputs,
                           self.resume_from)


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
    cfg.validate()
    if cfg.data.train is None:
        raise ConfigError("no training data: set data.train.path or data.train.task")
    check_task_sources(cfg)  # before the model is built
    if cfg.train.fsdp:
        _check_fsdp_run(cfg, resume)
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    out = Path(cfg.output_dir)
    # another run in the folder: refused now, not after loading
    folder = FolderGuard.check(out, resume, overwrite, run_inputs(cfg, config_path))
    if folder.resume_from is not None:  # the same run, continued: not another one
        check_resume_settings(out, cfg)
    adapter = adapter_for(cfg)  # text, or image+text rows and a VLM (emdlm.vlm)
    tokenizer, model = adapter.build(cfg)
    vocab = model_vocab_size(model)
    teacher = None
    if cfg.teacher is not None:
        teacher = load_teacher(cfg.teacher, tokenizer, vocab, cfg.model.dtype)
    loss_fn = build_objective(
        cfg.objective, tokenizer=tokenizer, model=model, vocab_size=vocab, teacher=teacher
    )
    _check_loss_fits_run(cfg, loss_fn)
    if cfg.lora.enabled:
        model = apply_lora(
            model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
            target_modules=adapter.lora_targets(cfg.lora.target_modules),
        )
    if cfg.train.fsdp:
        try:  # the blocks to shard exist (sharding itself is collective: in train())
            shard_units(model, cfg.train.fsdp_config.get("transformer_layer_cls_to_wrap"))
        except ValueError as err:
            raise ConfigError(str(err)) from err
    train_ds, eval_ds = adapter.datasets(cfg, tokenizer)
    _check_weights_fit_loss(cfg, loss_fn, train_ds, eval_ds)
    adapter.check_before_training(cfg, eval_configs, model, tokenizer)
    try:  # whatever transformers rejects fails here, before the folder is written
        args = training_arguments(cfg, out, eval_ds is not None)
        dry_build_optimizer_and_scheduler(args, model)
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"transformers rejected the training settings: {err}") from err
    return PreparedRun(
        cfg, tokenizer, model, loss_fn, train_ds, eval_ds, out, folder.resume_from, overwrite,
        args, teacher, adapter, resume, folder.inputs,
        generation_eval_rows(cfg, adapter.family, eval_ds is not None),
    )


def _check_loss_fits_run(cfg: RunConfig, loss_fn: Any) -> None:
    """ConfigError, before the folder is written, for a run setting the built loss cannot serve:
    ``train.fused_linear`` on a loss without a from-hidden path (``has_from_hidden`` False: the
    distillation objectives, a user's class that declares so), or a λ schedule on a loss without
    a λ to set (``settings.lam``, which the schedule's callback sets before each step)."""
    if cfg.train.fused_linear and not getattr(loss_fn, "has_from_hidden", False):
        raise ConfigError(
            f"train.fused_linear computes the loss from the final hidden states, but objective "
            f"{cfg.objective.name!r} ({type(loss_fn).__name__}) has no from-hidden path "
            "(has_from_hidden is False): set train.fused_linear=false"
        )
    if cfg.objective.lam_schedule != "constant" and not hasattr(
        getattr(loss_fn, "settings", None), "lam"
    ):
        raise ConfigError(
            f"objective.lam_schedule={cfg.objective.lam_schedule} sets the loss's λ "
            f"(settings.lam) before each step; {type(loss_fn).__name__} has none"
        )


def _check_weights_fit_loss(cfg: RunConfig, loss_fn: Any, train_ds: Any, eval_ds: Any) -> None:
    """ConfigError, before the folder is written, for rows with a ``loss_weight`` (or per-token
    ``loss_weights``) when the objective takes no per-token weights (``takes_loss_weights``
    False): they are never silently ignored. The rows' weights are checked on the way
    (:func:`~emdlm.integrations.loss_weights.dataset_loss_weights`)."""
    takes = bool(getattr(loss_fn, "takes_loss_weights", False))
    for ds, src in ((train_ds, cfg.data.train), (eval_ds, cfg.data.eval)):
        if ds is None or src is None:
            continue
        if dataset_loss_weights(ds, src.describe()) and not takes:
            raise ConfigError(
                f"{src.describe()}: rows carry {LOSS_WEIGHT_KEY!r}, but objective "
                f"{cfg.objective.name!r} ({type(loss_fn).__name__}) takes no per-token loss "
                "weights (takes_loss_weights is False): drop the field or use an objective "
                f"that takes them ({', '.join(weighable_objectives())})"
            )


def generation_eval_rows(
    cfg: RunConfig, family: str, has_eval: bool
) -> list[dict[str, Any]] | None:
    """The first ``eval.rows_during_training`` rows of ``data.eval`` to generate answers for
    at each ``train.eval_steps`` evaluation, or None: no evaluation during training, the switch
    at 0, a kind without a short answer (text, choice), an image-text run or a sharded one."""
    from emdlm.eval_kinds import eval_kind

    spec = eval_kind(cfg.eval.kind)
    if (not has_eval or cfg.data.eval is None or cfg.train.eval_steps is None
            or cfg.eval.rows_during_training < 1 or family != "text" or cfg.train.fsdp
            or not spec.generates or spec.open_ended):
        return None
    rows = load_examples(cfg.data.eval, seed=cfg.train.seed)[: cfg.eval.rows_during_training]
    if any("prompt" not in ex or "completion" not in ex for ex in rows):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval.rows_during_training needs "
                          "prompt/completion rows (or set it to 0)")
    return rows


def training_arguments(cfg: RunConfig, out: Path, has_eval: bool) -> Any:
    """transformers.TrainingArguments for ``cfg``
    (:func:`emdlm.training.arguments.training_arguments`), on the CPU unless
    ``_has_accelerator()``."""
    return _training_arguments(cfg, out, has_eval, use_cpu=not _has_accelerator())


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
    with run.folder.held():
        return _train_in_folder(run, callbacks)


def _train_in_folder(run: PreparedRun, callbacks: list[Any] | None) -> dict[str, Any]:
    """The body of :func:`train`, with the folder's lock held (rank 0)."""
    from transformers import Trainer

    cfg, out, adapter = run.cfg, run.output_dir, run.model_adapter
    main = is_main_process()
    args = run.training_args
    if args is None:  # a PreparedRun built by hand
        args = training_arguments(cfg, out, run.eval_dataset is not None)
    fsdp_facts = _shard(run, args) if cfg.train.fsdp else None
    existing: set[str] = set()
    if main:
        existing = run.folder.prepare(cfg)
        beside = adapter.save_beside_model(out)  # before training: checkpoint-N's eval finds it
        if beside:
            record_outputs(out, beside)
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
    # the one loss step (ComputeLoss): the trainer owns the teacher (distillation) and hands
    # each batch's number_mask (data.number_scope) and teacher logits to it as arguments
    trainer_cls = emdlm_trainer(atomic_checkpoint_trainer(Trainer), teacher=run.teacher)
    trainer = trainer_cls(
        model=run.model,
        args=args,
        train_dataset=run.train_dataset,
        eval_dataset=run.eval_dataset,
        data_collator=adapter.collator(cfg, run.tokenizer),
        processing_class=run.tokenizer,  # checkpoints carry the tokenizer (eval works on them)
        compute_loss_func=compute_loss,
        callbacks=[*schedule, logger, stopper.callback, *(callbacks or [])],
    )
    if run.generation_eval_rows:
        from emdlm.training.generation_eval import generation_eval

        e = cfg.eval
        trainer.add_callback(generation_eval(
            trainer, run.generation_eval_rows, tokenizer=run.tokenizer, kind=e.kind,
            rows=len(run.generation_eval_rows), max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size,
        ))
    notes = ([from_hidden_message(cfg.objective.name, run.loss_fn, run.model)]
             if cfg.train.fused_linear else [])
    start_run_console(trainer, notes)  # world size + launcher check (rank 0), tidy console
    note = run.loss_fn.logged_loss_note() if hasattr(run.loss_fn, "logged_loss_note") else None
    if main and note:
        print(f"emdlm: {note}", file=sys.stderr, flush=True)
    resume = str(run.resume_from) if run.resume_from is not None else None
    result = stopper.train(trainer, out, resume, logger)  # Ctrl-C: TrainingInterrupted
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
    if main:  # train_loss over the whole run; train_summary.json
        run.folder.finish(summary, result, existing, trained_step)
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
    if is_main_process():
        print(f"emdlm: FSDP2 over {facts['world_size']} processes ({facts['backend']}): rank 0 "
              f"holds {local} of {full} parameter elements", file=sys.stderr, flush=True)
    return facts


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
