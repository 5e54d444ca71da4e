"""The ``emdlm eval`` recipe: load a trained folder, generate answers for a test set, score them
with :func:`emdlm.evaluation.evaluate_examples`, write metrics.json + predictions.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from emdlm.config import ConfigError, RunConfig, apply_overrides, build_config, load_config_dict
from emdlm.data import load_examples

RUN_CONFIG = "run_config.yaml"


def resolve_eval_config(
    run_dir: str | Path, config: str | Path | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """The run's saved config (when the folder has one), then ``config``, then overrides."""
    folder = Path(run_dir)
    base: dict[str, Any] = {}
    for candidate in (folder / RUN_CONFIG, folder.parent / RUN_CONFIG):
        if candidate.is_file():  # a run folder, or a checkpoint-N inside one
            base = yaml.safe_load(candidate.read_text()) or {}
            break
    extra = load_config_dict(config)
    merged = _deep_merge(base, extra)
    return build_config(apply_overrides(merged, overrides or []))


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_trained(run_dir: str | Path, tokenizer_name: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a trained output folder or checkpoint folder."""
    from transformers import AutoModelForCausalLM

    from emdlm.models import check_vocab, load_tokenizer

    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"model folder not found: {folder}")
    if not (folder / "config.json").exists():
        raise ConfigError(f"{folder} holds no model (config.json missing)")
    has_tok = (folder / "tokenizer_config.json").exists() or (folder / "tokenizer.json").exists()
    if has_tok:
        tokenizer = load_tokenizer(str(folder))
    elif tokenizer_name is not None:
        tokenizer = load_tokenizer(tokenizer_name)
    else:
        raise ConfigError(f"{folder} has no tokenizer files; pass tokenizer=<name or folder>")
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    check_vocab(model, tokenizer)
    model.eval()
    return model, tokenizer


def evaluate_run(
    run_dir: str | Path,
    cfg: RunConfig,
    *,
    out_dir: str | Path | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Evaluate the model in ``run_dir`` on ``cfg.data.eval`` with ``cfg.eval`` settings.

    Writes ``metrics.json`` and ``predictions.jsonl`` to ``out_dir`` (default
    ``<run_dir>/eval``) and returns the metrics. Everything is loaded and checked first.
    """
    from emdlm.evaluation import evaluate_examples, write_eval_outputs

    if not Path(run_dir).is_dir():
        raise ConfigError(f"model folder not found: {run_dir}")
    if cfg.data.eval is None:
        raise ConfigError("no test set: set data.eval.path or data.eval.task (e.g. --task)")
    examples = load_examples(cfg.data.eval, seed=cfg.train.seed)
    if any("completion" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval needs prompt/completion examples")
    model, tokenizer = load_trained(run_dir, cfg.tokenizer)
    e = cfg.eval
    metrics, predictions = evaluate_examples(
        model, tokenizer, examples, kind=e.kind, max_new_tokens=e.max_new_tokens,
        batch_size=e.batch_size, do_sample=e.do_sample, temperature=e.temperature,
        top_p=e.top_p, seed=e.seed,
    )
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "eval"
    write_eval_outputs(target, metrics, predictions)
    return {"name": name or Path(run_dir).name, "metrics": metrics, "out_dir": str(target)}
