"""The ``emdlm eval`` recipe: load a trained folder, generate answers for a test set, score them
with :func:`emdlm.evaluation.evaluate_examples`, write metrics.json + predictions.jsonl."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from emdlm.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    build_config,
    load_config_dict,
    read_yaml_file,
)
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
            base = read_yaml_file(candidate) or {}
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
    from emdlm.training.run_folder import checkpoint_folders, checkpoint_problem, weights_problem

    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"model folder not found: {folder}")
    if not (folder / "config.json").exists():
        complete = [c for c in checkpoint_folders(folder) if checkpoint_problem(c) is None]
        hint = f"; evaluate a checkpoint instead: emdlm eval {complete[0]}" if complete else ""
        raise ConfigError(f"{folder} holds no model (config.json missing){hint}")
    has_tok = (folder / "tokenizer_config.json").exists() or (folder / "tokenizer.json").exists()
    if has_tok:
        tokenizer = load_tokenizer(str(folder))
    elif tokenizer_name is not None:
        tokenizer = load_tokenizer(tokenizer_name)
    else:
        raise ConfigError(f"{folder} has no tokenizer files; pass tokenizer=<name or folder>")
    problem = weights_problem(folder)
    if problem:  # before transformers, whose error would name no file
        raise ConfigError(f"cannot load the model in {folder}: {problem}")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError(f"cannot load the model in {folder}: {err}") from err
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

    ``eval.kind`` "text" samples ``eval.num_samples`` continuations per prompt and scores them
    (:func:`emdlm.evaluation.evaluate_text`; PPL_oracle with ``eval.oracle``); "choice" picks
    the lowest-perplexity candidate (:func:`emdlm.evaluation.evaluate_choice`); the other kinds
    generate and parse answers (:func:`emdlm.evaluation.evaluate_examples`).
    Writes ``metrics.json`` and ``predictions.jsonl`` to ``out_dir`` (default
    ``<run_dir>/eval``) and returns the metrics. Everything is loaded and checked first.

    When the output folder lies inside a run folder (the default ``<run_dir>/eval``), the run
    folder's lock is held from the start to the last write, so an ``emdlm train`` working there
    (or another ``emdlm eval``) is reported at once (RunFolderBusy, naming the holder) instead
    of after the evaluation.
    """
    from emdlm.evaluation import write_eval_outputs
    from emdlm.training.run_folder import (
        enclosing_run_folder,
        hold_run_folder,
        is_run_folder,
        record_outputs,
    )

    if not Path(run_dir).is_dir():
        raise ConfigError(f"model folder not found: {run_dir}")
    if cfg.data.eval is None:
        raise ConfigError("no test set: set data.eval.path or data.eval.task (e.g. --task)")
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "eval"
    run_folder = enclosing_run_folder(target)
    with (contextlib.nullcontext() if run_folder is None else hold_run_folder(
            run_folder, "emdlm eval", hint="wait for it to finish, or write the evaluation "
            "elsewhere with --out")):
        metrics, predictions, pictures = _evaluate(Path(run_dir), cfg, target)
        write_eval_outputs(target, metrics, predictions)
        if out_dir is None and is_run_folder(Path(run_dir)):  # --overwrite may remove it later
            record_outputs(Path(run_dir), ["eval"])
    return {
        "name": name or Path(run_dir).name, "metrics": metrics, "out_dir": str(target),
        "files": ["metrics.json", "predictions.jsonl", *(p.name for p in pictures)],
    }


def _evaluate(
    run_dir: Path, cfg: RunConfig, target: Path
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]:
    """Metrics, prediction rows and the pictures drawn (a VLM's ``target/contact_sheet.png``)
    of the model in ``run_dir`` (see :func:`evaluate_run`)."""
    from emdlm.evaluation import evaluate_examples
    from emdlm.vlm.models import folder_model_type

    assert cfg.data.eval is not None  # checked by evaluate_run
    vlm_type = folder_model_type(run_dir)
    if vlm_type is not None:  # an image-text-to-text folder: images + generation (emdlm.vlm)
        from emdlm.vlm.training import evaluate_vlm

        sheet = target / "contact_sheet.png"
        metrics, predictions = evaluate_vlm(run_dir, vlm_type, cfg, sheet=sheet)
        return metrics, predictions, [sheet] if sheet.is_file() else []
    examples = load_examples(cfg.data.eval, seed=cfg.train.seed)
    if any("completion" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval needs prompt/completion examples")
    e = cfg.eval
    if e.kind == "choice" and any("choices" not in ex or "label" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval.kind=choice needs 'choices' and "
                          "'label' in every example (e.g. --task polarity_choice)")
    oracle = load_trained(e.oracle, cfg.tokenizer) if e.kind == "text" and e.oracle else None
    model, tokenizer = load_trained(run_dir, cfg.tokenizer)
    if e.kind == "text":
        metrics, predictions = _evaluate_text(model, tokenizer, examples, e, oracle)
    elif e.kind == "choice":
        from emdlm.evaluation import evaluate_choice

        try:
            metrics, predictions = evaluate_choice(
                model, tokenizer, examples, batch_size=e.batch_size
            )
        except ValueError as err:  # e.g. k-shot prompts longer than the model's context
            raise ConfigError(f"choice evaluation: {err}") from err
    else:
        metrics, predictions = evaluate_examples(
            model, tokenizer, examples, kind=e.kind, max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size, do_sample=e.do_sample, temperature=e.temperature,
            top_p=e.top_p, seed=e.seed,
        )
    return metrics, predictions, []


def _evaluate_text(
    model: Any, tokenizer: Any, examples: list[dict[str, Any]], e: Any, oracle: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """eval.kind=text: sampled continuations, scored (ValueError becomes ConfigError)."""
    from emdlm.evaluation import evaluate_text

    try:
        metrics, rows = evaluate_text(
            model, tokenizer, examples, num_samples=e.num_samples,
            max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
            temperature=e.temperature, top_p=e.top_p, seed=e.seed, oracle=oracle,
            mauve=e.mauve, mauve_mode=e.mauve_mode,
        )
    except ValueError as err:
        raise ConfigError(f"text evaluation: {err}") from err
    if oracle is not None:
        metrics["oracle"] = str(e.oracle)
    return metrics, rows
