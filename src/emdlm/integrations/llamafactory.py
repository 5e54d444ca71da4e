"""LLaMA-Factory with an emdlm objective, without forking it: its own training entry point
(``llamafactory.train.tuner.run_exp(args, callbacks)``, https://github.com/hiyouga/LLaMA-Factory)
run with one more callback that patches the model before the first step.

    python -m emdlm.integrations.llamafactory train_config.yaml

``train_config.yaml`` is a LLaMA-Factory config (``llamafactory-cli train`` reads the same) with
one extra section, taken out before LLaMA-Factory parses the rest::

    emdlm:
      objective: {name: ntil, params: {preset: stable}}
      from_hidden: false

LLaMA-Factory's SFT and pre-training trainers optimise the model's ``outputs.loss`` (it has no
loss hook of its own), so :func:`emdlm.patch` on the model is the whole route:
:class:`EMDLMCallback` installs it in ``on_train_begin`` (the model and tokenizer are the
trainer's) and writes the loss components into the logs (``emdlm/ce``, ``emdlm/ntil``, ...).
Options that replace the loss or the forward are refused by name (:data:`CONFLICTS`, and any
``use_*_loss`` flag), as are stages other than sft / pt and a number scope (LLaMA-Factory's
collators add no ``number_mask``). LLaMA-Factory is imported only by :func:`run`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from emdlm.config import ConfigError
from emdlm.integrations.framework_objective import (
    FrameworkObjective,
    install_objective,
    parse_settings,
)
from emdlm.integrations.patch import PatchHandle
from emdlm.integrations.transformers import LossComponentsCallback

SECTION = "emdlm"
#: LLaMA-Factory options that replace the model's loss or its forward.
CONFLICTS = ("enable_liger_kernel", "use_unsloth", "use_unsloth_gc")
STAGES = ("sft", "pt")


def check_config(cfg: Mapping[str, Any]) -> tuple[FrameworkObjective, dict[str, Any]]:
    """(checked ``emdlm:`` settings, the rest of the config for LLaMA-Factory); ConfigError for
    a bad setting, a conflicting option, a stage other than sft / pt or a number scope."""
    rest = {k: v for k, v in cfg.items() if k != SECTION}
    settings = parse_settings(cfg.get(SECTION), SECTION)
    on = [k for k in CONFLICTS if rest.get(k)]
    on += sorted(k for k, v in rest.items() if k.startswith("use_") and k.endswith("_loss") and v)
    if on:
        raise ConfigError(
            f"emdlm: {', '.join(on)} replace(s) the model's loss (or its forward), so the emdlm "
            f"objective would not be trained; set {' and '.join(f'{k}: false' for k in on)}"
        )
    stage = rest.get("stage", "sft")
    if stage not in STAGES:
        raise ConfigError(f"emdlm: stage {stage!r} is not trained on the model's loss; "
                          f"use one of {', '.join(STAGES)}")  # fmt: skip
    if settings.number_scope != "all":
        raise ConfigError("emdlm.number_scope: LLaMA-Factory's collators add no number_mask; "
                          "leave number_scope 'all'")  # fmt: skip
    return settings, rest


class EMDLMCallback(TrainerCallback):
    """Patches the trainer's model with the emdlm objective at ``on_train_begin`` and logs its
    components (a :class:`LossComponentsCallback` on the patch's ComputeLoss)."""

    def __init__(self, settings: FrameworkObjective) -> None:
        self.settings = settings
        self.handle: PatchHandle | None = None
        self.components: LossComponentsCallback | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       processing_class: Any = None, **kwargs: Any) -> None:  # fmt: skip
        if model is None or processing_class is None:
            raise RuntimeError("EMDLMCallback: the trainer passed no model or processing_class")
        if self.handle is None:
            self.handle = install_objective(self.settings, model, processing_class)
            self.components = LossComponentsCallback(self.handle.compute_loss)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.components is not None:
            self.components.on_step_end(args, state, control, **kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:  # fmt: skip
        if self.components is not None:
            self.components.on_log(args, state, control, logs=logs, **kwargs)


def load_config(path: str | Path) -> dict[str, Any]:
    """A LLaMA-Factory YAML config as a dict (the project's safe YAML loader)."""
    from emdlm.yaml_io import safe_load_unique

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"LLaMA-Factory config not found: {file}")
    cfg = safe_load_unique(file.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file}: expected a mapping of LLaMA-Factory options")
    return cfg


def run(config: Mapping[str, Any] | str | Path) -> None:
    """Train with LLaMA-Factory's ``run_exp`` and the emdlm objective of ``config``'s
    ``emdlm:`` section (checked before LLaMA-Factory starts)."""
    cfg = dict(config) if isinstance(config, Mapping) else load_config(config)
    settings, rest = check_config(cfg)
    from llamafactory.train.tuner import run_exp

    run_exp(args=rest, callbacks=[EMDLMCallback(settings)])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m emdlm.integrations.llamafactory CONFIG.yaml")
    try:
        run(args[0])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()


__all__ = ["CONFLICTS", "EMDLMCallback", "check_config", "load_config", "main", "run"]
