"""Recipes behind the CLI: ``train`` (Trainer + emdlm loss), ``evaluate`` (generation +
metrics) and ``demo`` (CE vs NTIL on built-in arithmetic)."""

from __future__ import annotations

from emdlm.training.evaluate import evaluate_run, load_trained
from emdlm.training.train import (
    PreparedRun,
    TrainingInterrupted,
    latest_checkpoint,
    prepare_run,
    run_training,
    train,
)

__all__ = [
    "PreparedRun",
    "TrainingInterrupted",
    "evaluate_run",
    "latest_checkpoint",
    "load_trained",
    "prepare_run",
    "run_training",
    "train",
]
