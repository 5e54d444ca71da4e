"""A schedule for λ, the weight of the numeric term in CE + λ·(...)·NTIL, over training.

What keeps a numeric objective's early gain without a late cost? One candidate is to
anneal the numeric term. With progress p = step / max_steps in [0, 1] and λ₀ the objective's
own ``lam`` (``objective.params.lam`` or its preset's):

    constant:  λ(p) = λ₀
    linear:    λ(p) = λ₀ + (λ_final − λ₀)·p
    cosine:    λ(p) = λ_final + (λ₀ − λ_final)·(1 + cos(π·p)) / 2

(the shapes of transformers' linear and cosine learning-rate decays, without warm-up). The
value is set before each optimizer step from the global step alone, so a resumed run continues
the same schedule. λ enters both mixes (static CE + λ·NTIL; dynamic CE + λ·sg(CE/NTIL)·NTIL,
:func:`emdlm.functional.ntil.mix_coefficient`), so ``mix_coef`` in the train log follows it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from emdlm.config import LAM_SCHEDULES
from emdlm.config.errors import check_one_of


def scheduled_lam(kind: str, start: float, final: float, progress: float) -> float:
    """λ at ``progress`` in [0, 1] (clamped) for schedule ``kind`` (module docstring)."""
    check_one_of("lam schedule", kind, LAM_SCHEDULES)
    p = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return start + (final - start) * p
    if kind == "cosine":
        return final + (start - final) * (1.0 + math.cos(math.pi * p)) / 2.0
    return start


def lam_schedule_callback(loss_fn: Any, kind: str, final: float) -> Any:
    """A ``transformers.TrainerCallback`` that sets ``loss_fn.settings.lam`` before each step.

    ``loss_fn`` is an NTIL / digit-EMD loss (an ``NTILSettings`` in ``.settings``); its λ at
    construction is λ₀.
    """
    from transformers import TrainerCallback

    settings = getattr(loss_fn, "settings", None)
    if settings is None or not hasattr(settings, "lam"):
        raise TypeError(f"{type(loss_fn).__name__} has no λ to schedule (settings.lam)")
    start = float(settings.lam)

    class LamSchedule(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            progress = state.global_step / state.max_steps if state.max_steps else 0.0
            lam = scheduled_lam(kind, start, final, progress)
            loss_fn.settings = dataclasses.replace(loss_fn.settings, lam=lam)

    return LamSchedule()
