"""What launched this run, and a console that says so: world size, launcher, precision.

Why this exists (measured with accelerate 1.15, torch 2.13): ``accelerate launch`` with a
``distributed_type: MULTI_CPU`` config and no MPI hostfile runs its *single-process* launcher
and exits 0, so a run asked to use 2 processes silently trained on one. ``torchrun
--nproc_per_node 2`` (and accelerate with ``distributed_type: MULTI_GPU``, which hands over to
torchrun; with ``use_cpu: true`` on a CPU-only machine the processes use gloo) start what they
say. :func:`start_run_console` is called once per ``emdlm train`` run, after the Trainer is
built, and

- prints on rank 0: ``emdlm: world size 2 (torchrun), 4 per process x 1 accumulation x 2
  processes = 8 examples per optimizer step; fp32 on cpu``;
- warns (logger "emdlm") when a launcher asked for N processes but the run has fewer: the
  accelerate launcher's settings reach the child as environment variables (``ACCELERATE_*``,
  ``MASTER_ADDR`` when it was asked for more than one process) and its command line is the
  parent process's (``--num_processes``, ``--config_file``);
- replaces the Trainer's raw log dicts on the console (``{'loss': ..., 'grad_norm': ...}`` from
  transformers' ProgressCallback / PrinterCallback) with the loss on the progress bar, or one
  short line per log when the bar is off, and a one-line summary at the end.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.utils import logging as hf_logging

from emdlm.yaml_io import safe_load_unique

_LOG = logging.getLogger("emdlm")
# Set in the child by both of accelerate's launchers (single-process and torchrun hand-over).
_ACCELERATE_MARKERS = ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_MIXED_PRECISION")


@dataclass(frozen=True)
class LaunchInfo:
    """How this process was started.

    Attributes:
        world_size: processes in the run (``WORLD_SIZE``, 1 when unset).
        launcher: "torchrun", "accelerate launch", "accelerate launch (torchrun)", "mpirun",
            "torch.distributed" (RANK / WORLD_SIZE set by something else) or "single process".
        requested: processes the launcher was asked for, when it can be read (None otherwise).
        asked_for_more: the launcher was asked for more than one process (even when the exact
            number cannot be read).
    """

    world_size: int
    launcher: str
    requested: int | None = None
    asked_for_more: bool = False

    @property
    def mismatch(self) -> bool:
        """A launcher asked for more processes than the run has."""
        if self.requested is not None:
            return self.requested > self.world_size
        return self.asked_for_more and self.world_size == 1


def _int_env(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    return int(value) if value.strip().isdigit() else default


def _parent_cmdline() -> list[str]:
    """The parent process's arguments (Linux /proc; [] where unreadable)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _option(argv: Sequence[str], *names: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (first of ``names``)."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def accelerate_requested_processes(argv: Sequence[str]) -> int | None:
    """Processes an ``accelerate launch`` command line asks for: ``--num_processes`` or the
    config file's ``num_processes``; None when neither can be read."""
    if "launch" not in argv:
        return None
    value = _option(argv, "--num_processes", "--num-processes")
    if value is not None and value.isdigit():
        return int(value)
    path = _option(argv, "--config_file", "--config-file")
    if path is None:
        return None
    try:
        loaded = safe_load_unique(Path(path).read_text())
    except (OSError, yaml.YAMLError):  # a key given twice too: the count is not certain
        return None
    n = loaded.get("num_processes") if isinstance(loaded, dict) else None
    return n if isinstance(n, int) else None


def detect_launch(
    env: Mapping[str, str] | None = None, parent_argv: Sequence[str] | None = None
) -> LaunchInfo:
    """Read the launcher from the environment (and, for accelerate's single-process launcher,
    from the parent's command line; ``parent_argv`` overrides /proc for tests)."""
    env = os.environ if env is None else env
    world = _int_env(env, "WORLD_SIZE", 1)
    elastic = "TORCHELASTIC_RUN_ID" in env
    if any(key in env for key in _ACCELERATE_MARKERS):
        if elastic:
            return LaunchInfo(world, "accelerate launch (torchrun)", requested=world)
        argv = _parent_cmdline() if parent_argv is None else parent_argv
        # accelerate sets MASTER_ADDR for its child only when asked for > 1 process
        return LaunchInfo(world, "accelerate launch", accelerate_requested_processes(argv),
                          asked_for_more="MASTER_ADDR" in env)
    if elastic:
        return LaunchInfo(world, "torchrun", requested=world)
    mpi = _int_env(env, "OMPI_COMM_WORLD_SIZE", 0) or _int_env(env, "PMI_SIZE", 0)
    if mpi:
        return LaunchInfo(world, "mpirun", requested=mpi)
    if "RANK" in env or "WORLD_SIZE" in env:
        return LaunchInfo(world, "torch.distributed", requested=world)
    return LaunchInfo(world, "single process")


def launch_messages(info: LaunchInfo, args: Any) -> tuple[str, str | None]:
    """The start-of-run line and, on a launcher mismatch, a warning (else None).

    ``args``: the Trainer's TrainingArguments (``world_size`` is the process count the Trainer
    really set up; it wins over the environment)."""
    world = int(getattr(args, "world_size", info.world_size) or 1)
    per, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    device = getattr(getattr(args, "device", None), "type", "cpu")
    line = (
        f"emdlm: world size {world} ({info.launcher}), {per} per process x {accum} accumulation "
        f"x {world} process{'es' if world != 1 else ''} = {per * accum * world} examples per "
        f"optimizer step; {precision} on {device}"
    )
    if precision == "bf16" and device == "cpu":  # asked for explicitly (emdlm's default is fp32)
        line += " (as asked; bf16 ran ~5x slower than fp32 on CPUs without bf16 matrix units)"
    info = LaunchInfo(world, info.launcher, info.requested, info.asked_for_more)
    if not info.mismatch:
        return line, None
    asked = str(info.requested) if info.requested is not None else "more than 1"
    warning = (
        f"emdlm: {info.launcher} was asked for {asked} processes, but this run has {world}. "
        "accelerate 1.15 starts a `distributed_type: MULTI_CPU` config with its single-process "
        "launcher unless it is given an MPI hostfile. For 2 CPU processes use "
        "`accelerate launch --config_file \"$(emdlm config-path accelerate_ddp_cpu)\" ...` "
        "(distributed_type MULTI_GPU + use_cpu, which hands over to torchrun) or "
        "`torchrun --nproc_per_node 2 -m emdlm.cli train ...`"
    )
    return line, warning


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def log_line(logs: Mapping[str, Any], step: int, max_steps: int) -> str:
    """One short console line for a Trainer log record (train, eval or the final summary)."""
    if "train_runtime" in logs:
        loss = logs.get("train_loss")
        # transformers averages over the steps run by this process: after a resume that is not
        # the whole run (train_summary.json has the whole run's mean), so say which steps
        tail = (f", mean train loss {_fmt(float(loss))} over the steps run since (re)start"
                if loss is not None else "")
        seconds = float(logs["train_runtime"])
        if max_steps <= 0 or step >= max_steps:  # the normal end: every step was run
            return f"done: {step} steps in {seconds:.1f} s{tail}"
        return f"stopped at step {step} of {max_steps} after {seconds:.1f} s{tail}"
    skip = {"epoch", "total_flos", "step"}
    prefix = "eval " if any(k.startswith("eval_") for k in logs) else ""
    parts = [f"{k} {_fmt(v)}" for k, v in logs.items()
             if k not in skip and isinstance(v, (int, float, str))
             and not k.endswith(("_runtime", "_per_second"))]  # timings: in the summary
    return f"{prefix}step {step}/{max_steps}: " + ", ".join(parts)


class TidyProgressCallback(ProgressCallback):
    """transformers' progress bar with the latest loss as its postfix instead of a raw dict
    per log; evaluation results and the final summary as one short line each, on the bar's
    stream (stderr). The bar is closed before the final summary (``done: N steps in T s``) is
    printed, so the summary never lands inside the bar's line."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if not state.is_world_process_zero or logs is None:
            return
        if self.training_bar is None:  # evaluation outside training
            print(log_line(logs, state.global_step, state.max_steps), file=sys.stderr)
            return
        line = log_line(logs, state.global_step, state.max_steps)
        if "train_runtime" in logs:  # the end: close the bar (its last line, a newline) first,
            self.training_bar.close()  # so that "done: ..." is a line of its own after it
            self.training_bar = None
            print(line, file=sys.stderr, flush=True)
        elif "loss" in logs:
            post = {"loss": _fmt(float(logs["loss"]))}
            if "learning_rate" in logs:
                post["lr"] = f"{float(logs['learning_rate']):.2e}"
            self.training_bar.set_postfix(post, refresh=False)
        else:  # on the bar's stream, above the bar (tqdm's default would be stdout)
            self.training_bar.write(line, file=sys.stderr)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.training_bar is not None:  # closed already when the summary was logged
            super().on_train_end(args, state, control, **kw)


class LinePrinterCallback(TrainerCallback):
    """Without a progress bar: one short line per Trainer log (instead of PrinterCallback's
    raw dict)."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if state.is_local_process_zero and logs:
            print(log_line(logs, state.global_step, state.max_steps), flush=True)


def tidy_console(trainer: Any) -> None:
    """Swap the Trainer's ProgressCallback / PrinterCallback (exactly those classes, in place)
    for :class:`TidyProgressCallback` / :class:`LinePrinterCallback`."""
    callbacks = trainer.callback_handler.callbacks
    for i, cb in enumerate(callbacks):
        if type(cb) is ProgressCallback:
            callbacks[i] = TidyProgressCallback()
        elif type(cb) is PrinterCallback:
            callbacks[i] = LinePrinterCallback()


def from_hidden_message(objective: str, loss_fn: Any, model: Any) -> str:
    """The start-of-run line of a ``train.fused_linear`` run: the loss runs from the final
    hidden states (which objective, the output embedding's size, rows per chunk)."""
    from emdlm.integrations.hidden_forward import output_head

    weight = output_head(model).weight
    vocab = int((getattr(weight, "ds_shape", None) or weight.shape)[0])  # ZeRO-3: full shape
    chunk = getattr(loss_fn, "from_hidden_chunk_rows", None)
    rows = f"chunks of up to {chunk(vocab)} rows" if callable(chunk) else "chunks of rows"
    return (
        f"emdlm: loss from hidden states (train.fused_linear): {objective} "
        f"({type(loss_fn).__name__}.from_hidden) applies the {vocab}-token output embedding "
        f"in {rows}; the [batch, length, {vocab}] logits are not built while training "
        "(evaluation keeps the logits path)"
    )


def start_run_console(trainer: Any, notes: Sequence[str] = ()) -> LaunchInfo:
    """Start-of-run report (rank 0) and tidy console for ``trainer``; returns the launch.
    ``notes``: further start-of-run lines printed right after the world-size line (e.g.
    :func:`from_hidden_message`)."""
    info = detect_launch()
    line, warning = launch_messages(info, trainer.args)
    if trainer.args.process_index == 0:
        print(line, file=sys.stderr, flush=True)
        for note in notes:
            print(note, file=sys.stderr, flush=True)
        if warning is not None:
            _LOG.warning(warning)
    tidy_console(trainer)
    # one bar per phase: the Trainer's own training / evaluation bars stay (plain tqdm), the
    # library's per-save "Writing model shards" bars (one per checkpoint and final save) go
    hf_logging.disable_progress_bar()
    return info


__all__ = [
    "LaunchInfo",
    "LinePrinterCallback",
    "TidyProgressCallback",
    "accelerate_requested_processes",
    "detect_launch",
    "from_hidden_message",
    "launch_messages",
    "log_line",
    "start_run_console",
    "tidy_console",
]


def close_process_group(*, finished: bool) -> None:
    """End torch.distributed at the end of a command run under a launcher.

    After a 2-process FSDP run had finished and saved, a process sometimes died at exit with
    "terminate called without an active exception" (SIGABRT; about 1 run in 50 on 2 busy cores,
    CI included). ``destroy_process_group`` alone does not prevent it: FSDP's DeviceMesh (kept
    alive by DTensor caches) still holds the gloo group, whose worker threads outlive it and
    meet the interpreter's finalization (pytorch/pytorch#179291 describes the crash).

    ``finished``: every rank got here normally; then a barrier (no rank leaves while another
    still talks to it), the group is destroyed, the standard streams and logging are flushed,
    and the process ends with ``os._exit(0)``, skipping the finalization where the crash
    happens. All output is written and closed by then. After an error (``finished=False``) a
    rank may never reach a barrier: the group is only destroyed, and the error propagates.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if not finished:
        dist.destroy_process_group()
        return
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
