"""Run configuration: nested dataclasses loaded from YAML, with dotted ``key=value`` overrides.

A config file mirrors :class:`RunConfig`::

    model: {name: tiny-gpt2, params: {n_layer: 2, n_embd: 96}}
    tokenizer: char
    data:
      train: {task: arithmetic, n: 20000, params: {max_digits: 3}}
      eval: {task: arithmetic, n: 200, split: test}
    objective: {name: ntil, params: {lam: 0.3}}
    optim: {lr: 1.0e-3, scheduler: cosine, warmup_ratio: 0.05}
    train: {batch_size: 32, grad_accum: 1, max_steps: 500, seed: 0}
    output_dir: runs/ntil

Overrides use the same dotted paths: ``objective.name=ce train.max_steps=10``; values are parsed
as YAML scalars ("1e-3" -> 0.001, "true" -> True, "[1, 2]" -> list). Unknown keys are an error
naming the key and the valid ones. An override that switches ``objective.name`` drops the
inherited objective settings the new objective does not take (:func:`switch_objective`).

One job per module: :mod:`~emdlm.config.schema` (the dataclasses, the legal values and
``RunConfig.validate``), :mod:`~emdlm.config.coerce` (a raw mapping to the dataclasses),
:mod:`~emdlm.config.overrides` (``key=value`` overrides and the objective switch),
:mod:`~emdlm.config.packaged` (the configs shipped with emdlm), :mod:`~emdlm.config.loading`
(files to a validated config) and :mod:`~emdlm.config.errors` (``ConfigError``).
"""

from __future__ import annotations

from emdlm.config.coerce import build_config
from emdlm.config.errors import ConfigError, check_choice, did_you_mean
from emdlm.config.loading import load_config, load_config_dict, read_yaml_file
from emdlm.config.overrides import apply_overrides, parse_override, switch_objective
from emdlm.config.packaged import (
    PACKAGED_FOLDER,
    packaged_config_path,
    packaged_configs,
    packaged_experiment,
    packaged_experiments,
)
from emdlm.config.schema import (
    ADAM_BETA,
    DATA_SPLITS,
    DECODE_MODES,
    DISTILL_OBJECTIVES,
    LAM_SCHEDULES,
    MAX_SEED,
    NUMERIC_OBJECTIVES,
    OBJECTIVES,
    RUN_SETTING_DOMAINS,
    DataConfig,
    DataSourceConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    check_lam_schedule,
    check_seed,
)

__all__ = [
    "ADAM_BETA", "DATA_SPLITS", "DECODE_MODES", "DISTILL_OBJECTIVES", "LAM_SCHEDULES", "MAX_SEED",
    "NUMERIC_OBJECTIVES", "OBJECTIVES", "PACKAGED_FOLDER", "RUN_SETTING_DOMAINS", "ConfigError",
    "DataConfig", "DataSourceConfig", "EvalConfig", "LoraConfig", "ModelConfig", "ObjectiveConfig",
    "OptimConfig", "RunConfig", "TrainConfig", "apply_overrides", "build_config", "check_choice",
    "check_lam_schedule", "check_seed", "did_you_mean", "load_config", "load_config_dict",
    "packaged_config_path", "packaged_configs", "packaged_experiment", "packaged_experiments",
    "parse_override", "read_yaml_file", "switch_objective",
]
