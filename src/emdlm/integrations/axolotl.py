"""Axolotl plugin: train with an emdlm objective from an Axolotl YAML config.

    plugins:
      - emdlm.integrations.axolotl.EMDLMPlugin
    emdlm:
      objective: {name: ntil, params: {preset: stable}}
      from_hidden: false          # true: no [B, T, V] logits while training
      number_scope: all           # "regex:<pattern>": score only the numbers inside matches

Axolotl's plugin interface (``axolotl/integrations/base.py``, ``BasePlugin``,
https://github.com/axolotl-ai-cloud/axolotl): the hooks used here are

* ``get_input_args``: the pydantic model of the ``emdlm:`` section (:data:`ARGS_PATH`); its
  validator checks the settings (:func:`emdlm.integrations.framework_objective.parse_settings`)
  and refuses the options that replace the model's loss or forward (:data:`CONFLICTS`: Liger's
  cross entropy and fused linear cross entropy, Cut Cross Entropy, chunked cross entropy),
  as Axolotl's own ``check_cross_entropy_conflicts`` does among those four;
* ``get_collator_cls_and_kwargs``: :class:`~emdlm.integrations.framework_objective.
  NumberMaskCollator` when the objective scores numbers and the scope is not "all";
* ``add_callbacks_post_trainer`` (Axolotl calls it while building the trainer, before
  ``post_trainer_create``): builds the loss with the trainer's tokenizer and model,
  :func:`emdlm.patch`-es it into the model (Axolotl's trainer optimises ``outputs.loss``) and
  returns :class:`~emdlm.integrations.transformers.LossComponentsCallback` (``emdlm/ce``,
  ``emdlm/ntil``, ... in the logs);
* ``post_trainer_create``: checks the trainer's model still carries the emdlm loss.

Axolotl is imported only when :class:`EMDLMPlugin` is first looked up, and a stand-in base
class is used where Axolotl is not installed (this module's tests), so importing this module
needs neither Axolotl nor pydantic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from emdlm.config import ConfigError
from emdlm.integrations.framework_objective import (
    FrameworkObjective,
    NumberMaskCollator,
    install_objective,
    parse_settings,
)
from emdlm.integrations.patch import PatchHandle
from emdlm.integrations.transformers import LossComponentsCallback

SECTION = "emdlm"
ARGS_PATH = f"{__name__}.EMDLMArgs"
#: Axolotl options that replace the model's cross entropy or its whole forward: with them the
#: emdlm loss would not be the one optimised.
CONFLICTS = (
    "liger_cross_entropy", "liger_fused_linear_cross_entropy", "cut_cross_entropy",
    "chunked_cross_entropy",
)
CONFLICTING_PLUGINS = ("cut_cross_entropy",)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def check_config(cfg: Any) -> FrameworkObjective:
    """The checked ``emdlm:`` section of an Axolotl config (mapping or attribute object);
    ConfigError for a bad setting, a conflicting option or plugin, or a number scope with
    sample packing (whose collators this plugin does not replace)."""
    settings = parse_settings(_get(cfg, SECTION), SECTION)
    on = [k for k in CONFLICTS if _get(cfg, k)]
    if on:
        raise ConfigError(
            f"emdlm plugin: {', '.join(on)} replace(s) the model's loss (or its forward), so the "
            f"emdlm objective would not be trained; set {' and '.join(f'{k}: false' for k in on)}"
            " (emdlm.from_hidden: true also avoids the [B, T, V] logits)"
        )
    plugins = [p for p in (_get(cfg, "plugins") or []) if any(c in p for c in CONFLICTING_PLUGINS)]
    if plugins:
        raise ConfigError(
            f"emdlm plugin: {plugins} replace(s) the model's forward; remove it from `plugins`"
        )
    if settings.wants_number_mask and _get(cfg, "sample_packing"):
        raise ConfigError(
            "emdlm plugin: emdlm.number_scope needs its own collator, which sample_packing "
            "replaces; set sample_packing: false or number_scope: all"
        )
    return settings


class _StandInBase:
    """An empty base in place of Axolotl's ``BasePlugin`` where Axolotl is not installed (the
    plugin's hooks are then tested without it)."""


class EMDLMPluginMixin:
    """The plugin's behaviour; :class:`EMDLMPlugin` puts it on Axolotl's ``BasePlugin``."""

    handle: PatchHandle | None = None

    def get_input_args(self) -> str:
        return ARGS_PATH

    def get_collator_cls_and_kwargs(self, cfg: Any, is_eval: bool = False) -> Any:
        settings = check_config(cfg)
        if not settings.wants_number_mask:
            return None
        return NumberMaskCollator, {"number_scope": settings.number_scope}

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list[Any]:
        handle = self._install(cfg, trainer)
        return [LossComponentsCallback(handle.compute_loss)]

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        handle = self._install(cfg, trainer)
        if handle.model.__dict__.get(handle.attr) is None:
            raise RuntimeError(
                "emdlm plugin: the model's emdlm loss was removed after it was installed "
                "(another plugin replaced the model's loss_function / forward)"
            )

    def _install(self, cfg: Any, trainer: Any) -> PatchHandle:
        """Patch the trainer's model once (the same handle on a second call)."""
        from emdlm.integrations.hidden_forward import unwrap_hf_model

        model = unwrap_hf_model(trainer.model)
        if self.handle is not None and self.handle.model is model:
            return self.handle
        settings = check_config(cfg)
        self.handle = install_objective(settings, model, trainer.processing_class)
        return self.handle


def _plugin_class() -> type:
    try:
        from axolotl.integrations.base import BasePlugin
    except ImportError:
        BasePlugin = _StandInBase
    return type("EMDLMPlugin", (EMDLMPluginMixin, BasePlugin), {"__module__": __name__})


def _args_class() -> type:
    from pydantic import BaseModel, model_validator

    class EMDLMArgs(BaseModel):
        """Axolotl input args: the ``emdlm:`` section (checked by :func:`check_config`)."""

        emdlm: dict[str, Any] | None = None

        @model_validator(mode="before")
        @classmethod
        def check_emdlm(cls, data: Any) -> Any:
            if isinstance(data, Mapping) and data.get(SECTION) is not None:
                try:
                    check_config(data)
                except ConfigError as err:
                    raise ValueError(str(err)) from None
            return data

    EMDLMArgs.__module__ = __name__
    return EMDLMArgs


_LAZY = {"EMDLMPlugin": _plugin_class, "EMDLMArgs": _args_class}


def __getattr__(name: str) -> Any:  # PEP 562: built on first look-up, then cached
    if name in _LAZY:
        value = _LAZY[name]()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARGS_PATH", "CONFLICTS", "EMDLMPluginMixin", "check_config"]
