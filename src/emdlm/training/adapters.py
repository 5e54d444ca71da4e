"""The model adapter of the ``emdlm train`` and ``emdlm eval`` recipes: everything that differs
between a text model and an image-text model (VLM), behind the same methods, chosen once.

:func:`adapter_for` picks it from a run config (``model.name`` a VLM: :class:`ImageTextAdapter`,
else :class:`TextAdapter`); :func:`adapter_for_folder` from a trained folder (its config.json an
image-text-to-text model). The recipes then call the adapter and never ask which it is:

- ``build(cfg)``: the training rows (checked), tokenizer and model (seeded), as (tokenizer, model);
- ``lora_targets(configured)``: the LoRA target modules (a VLM's default: its language model);
- ``datasets(cfg, tokenizer)``: the tokenized train and eval datasets;
- ``check_before_training(cfg, eval_configs, model, tokenizer)``: will the evaluation after
  training work (text: can its prompts be generated from within the model's context);
- ``collator(cfg, tokenizer)``: the Trainer's data collator;
- ``save_beside_model(out)``: what goes in the run folder beside the model before training (a
  VLM's image processor), the names written;
- ``evaluate(run_dir, cfg, target)``: ``emdlm eval`` of a trained folder: (metrics, prediction
  rows, pictures drawn under ``target``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from emdlm.config import ConfigError, RunConfig
from emdlm.data import DataCollator, TokenizedDataset, build_dataset, load_examples
from emdlm.eval_kinds import GENERATION_KINDS, eval_kind  # generated kinds: prompts must fit
from emdlm.models import build_model, load_tokenizer
from emdlm.training.image_text import ImageTextAdapter
from emdlm.vlm.models import folder_model_type, is_vlm

__all__ = ["ImageTextAdapter", "ModelAdapter", "TextAdapter", "adapter_for", "adapter_for_folder"]


class ModelAdapter(Protocol):
    """What the recipes ask of a model family (see the module docstring)."""

    family: str

    def build(self, cfg: RunConfig) -> tuple[Any, Any]: ...

    def lora_targets(self, configured: Any) -> Any: ...

    def datasets(self, cfg: RunConfig, tokenizer: Any) -> tuple[Any, Any | None]: ...

    def check_before_training(
        self, cfg: RunConfig, eval_configs: Sequence[RunConfig], model: Any, tokenizer: Any
    ) -> None: ...

    def collator(self, cfg: RunConfig, tokenizer: Any) -> Any: ...

    def save_beside_model(self, out: Path) -> list[str]: ...

    def evaluate(
        self, run_dir: Path, cfg: RunConfig, target: Path
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]: ...


def adapter_for(cfg: RunConfig) -> ModelAdapter:
    """The adapter of the model ``cfg`` trains (a new one per run: it keeps the run's rows)."""
    return ImageTextAdapter() if is_vlm(cfg.model.name) else TextAdapter()


def adapter_for_folder(run_dir: Path) -> ModelAdapter:
    """The adapter of the trained model in ``run_dir`` (a run folder or a checkpoint)."""
    model_type = folder_model_type(run_dir)
    return ImageTextAdapter(model_type) if model_type is not None else TextAdapter()


class TextAdapter:
    """A causal LM on prompt/completion (or text) rows."""

    family = "text"

    def __init__(self) -> None:
        self.train_rows: list[dict[str, Any]] | None = None
        self.eval_rows: list[dict[str, Any]] | None = None

    def build(self, cfg: RunConfig) -> tuple[Any, Any]:
        from transformers import set_seed

        assert cfg.data.train is not None
        self.train_rows = load_examples(cfg.data.train, seed=cfg.train.seed)
        self.eval_rows = (
            load_examples(cfg.data.eval, seed=cfg.train.seed) if cfg.data.eval is not None
            else None
        )
        tokenizer = load_tokenizer(cfg.tokenizer)
        set_seed(cfg.train.seed)
        return tokenizer, build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)

    def lora_targets(self, configured: Any) -> Any:
        return configured

    def datasets(
        self, cfg: RunConfig, tokenizer: Any
    ) -> tuple[TokenizedDataset, TokenizedDataset | None]:
        assert cfg.data.train is not None and self.train_rows is not None
        kw = dict(max_length=cfg.data.max_length, add_eos=cfg.data.add_eos,
                  extra_keys=cfg.data.extra_keys, on_truncate=cfg.data.on_truncate,
                  on_drop=cfg.data.on_drop, number_scope=cfg.data.number_scope)
        train_ds = build_dataset(self.train_rows, tokenizer, source=cfg.data.train.describe(),
                                 task=cfg.data.train.task, **kw)
        eval_ds = None
        if self.eval_rows is not None and cfg.data.eval is not None:
            eval_ds = build_dataset(self.eval_rows, tokenizer, source=cfg.data.eval.describe(),
                                    task=cfg.data.eval.task, **kw)
        return train_ds, eval_ds

    def check_before_training(
        self, cfg: RunConfig, eval_configs: Sequence[RunConfig], model: Any, tokenizer: Any
    ) -> None:
        """Will the evaluation after training be able to generate?"""
        _check_eval_generation(cfg, eval_configs, model, tokenizer, self.eval_rows)

    def collator(self, cfg: RunConfig, tokenizer: Any) -> DataCollator:
        return DataCollator(tokenizer.pad_token_id, cfg.data.pad_to_multiple_of)

    def save_beside_model(self, out: Path) -> list[str]:
        return []  # the tokenizer is saved with the model (and in every checkpoint)

    def evaluate(
        self, run_dir: Path, cfg: RunConfig, target: Path
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]:
        from emdlm.training.text_eval import evaluate_text_folder

        metrics, predictions = evaluate_text_folder(run_dir, cfg)
        return metrics, predictions, []


def _generation_problem(
    eval_cfg: RunConfig, model: Any, tokenizer: Any, rows: list[dict[str, Any]]
) -> str | None:
    """Why ``emdlm eval`` with ``eval_cfg`` could not generate with this model (its longest
    prompt + ``eval.max_new_tokens`` exceed the model's context) or score the answers (a
    reference its kind cannot read, :func:`emdlm.metrics.check_references`), or None."""
    from emdlm.generation import check_generation_fits, cut_at_stop
    from emdlm.metrics import check_references

    prompts = [str(r["prompt"]) for r in rows if "prompt" in r]
    kind = eval_kind(eval_cfg.eval.kind)
    scored = [r for r in rows if "completion" in r]
    try:
        check_generation_fits(model, tokenizer, prompts, eval_cfg.eval.max_new_tokens)
        if kind.short_answer and len(scored) == len(rows):
            check_references([cut_at_stop(str(r["completion"]), kind.stop_at).strip()
                              for r in scored], eval_cfg.eval.kind, rows=scored)
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
