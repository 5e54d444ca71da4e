"""What the ``emdlm train`` recipe hangs on ``transformers.Trainer``: the per-step loss log
(:func:`step_logger`) and Ctrl-C (:class:`GracefulStop`, :class:`TrainingInterrupted`).

The first Ctrl-C finishes the optimizer step in progress, saves a checkpoint and raises
:class:`TrainingInterrupted` (a second Ctrl-C aborts at once, still saving a checkpoint)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emdlm._extras import install_hint
from emdlm.integrations.transformers import ComputeLoss
from emdlm.training.folder_guard import TRAIN_LOG
from emdlm.training.saving import full_disk_in_one_line

TENSORBOARD_MISSING = (
    "train.tensorboard is on (the default) but the package 'tensorboard' is not installed: "
    f"losses go to train_log.jsonl only ({install_hint('tensorboard')}, or set "
    "train.tensorboard=false)"
)


def finished_checkpoint_step(checkpoint: str | None, max_steps: int) -> int | None:
    """The step of ``checkpoint`` if it is already the run's last (``max_steps``, or the
    checkpoint's own ``max_steps`` for a run sized by epochs), else None (also without one)."""
    if checkpoint is None:
        return None
    state_file = Path(checkpoint) / "trainer_state.json"
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text(encoding="utf-8"))
    step, last = int(state.get("global_step", 0)), max_steps
    if last <= 0:
        last = int(state.get("max_steps", 0))
    return step if 0 < last <= step else None


class TrainingInterrupted(RuntimeError):
    """Raised after Ctrl-C, once a checkpoint has been saved (``.checkpoint``)."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(f"training interrupted; checkpoint saved in {checkpoint}")
        self.checkpoint = checkpoint


def step_logger(compute_loss: ComputeLoss, out: Path, tensorboard: bool) -> Any:
    """A ``TrainerCallback`` writing every loss component of each optimizer step to
    ``out/train_log.jsonl`` (and TensorBoard under ``out/tb`` when ``tensorboard``)."""
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
                except ImportError:  # tensorboard not installed: JSONL only, said once
                    self.tb = None
                    print(f"warning: {TENSORBOARD_MISSING}", file=sys.stderr, flush=True)

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


class GracefulStop:
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

    def train(self, trainer: Any, out: Path, resume: str | None, logger: Any) -> Any:
        """``trainer.train(resume_from_checkpoint=resume)`` with Ctrl-C handled: its result, or
        :class:`TrainingInterrupted` once a checkpoint in ``out`` is saved. A full disk
        (checkpoint, train_log.jsonl) ends the run with one line, no traceback.

        A checkpoint already at the last step is not handed to ``trainer.train``: transformers
        (5.x) would run one step more when the step count is not a whole number of epochs
        (with gradient accumulation, for instance). Its weights are loaded and a result with
        no step run (training loss 0 over 0 steps) is returned."""
        finished = finished_checkpoint_step(resume, int(trainer.args.max_steps))
        if finished is not None:
            from transformers.trainer_utils import TrainOutput

            assert resume is not None
            # NOTE: a private Trainer method; it loads the weights as trainer.train would
            trainer._load_from_checkpoint(resume)
            trainer.state.global_step = finished
            print(f"done: nothing left to train (resumed at step {finished}, the last; the "
                  "whole-run loss is in train_summary.json)", file=sys.stderr, flush=True)
            return TrainOutput(finished, 0.0, {})
        try:
            with self.handle_sigint(), full_disk_in_one_line(out, f"into {out} during training"):
                result = trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:  # a second Ctrl-C (or one outside the main thread's handler)
            logger.close()
            # NOTE: a private Trainer method; it writes model, optimizer, scheduler, RNG and
            # trainer state exactly as a scheduled checkpoint, so --resume works from it. (An
            # interrupt inside optimizer.step could leave a half-updated step: the first Ctrl-C
            # takes the clean path below.)
            trainer._save_checkpoint(trainer.model, trial=None)
            raise TrainingInterrupted(out / f"checkpoint-{trainer.state.global_step}") from None
        if self.requested:  # first Ctrl-C: the Trainer saved after the step it was in
            raise TrainingInterrupted(out / f"checkpoint-{trainer.state.global_step}")
        return result
