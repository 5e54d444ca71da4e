"""The text half of ``emdlm eval`` (the VLM half is :func:`emdlm.training.image_text.evaluate_vlm`):
load a trained causal-LM folder and score it on the test set by ``eval.kind``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emdlm.config import ConfigError, RunConfig
from emdlm.data import load_examples
from emdlm.eval_kinds import eval_kind
from emdlm.metrics.text import check_text_metric_packages


def load_trained(run_dir: str | Path, tokenizer_name: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a trained output folder or checkpoint folder."""
    from transformers import AutoModelForCausalLM

    from emdlm.models import check_vocab, load_tokenizer
    from emdlm.training.checkpoints import check_holds_model, weights_problem
    from emdlm.weights import refuse_folder_code

    folder = Path(run_dir)
    check_holds_model(folder)
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
    refuse_folder_code(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError(f"cannot load the model in {folder}: {err}") from err
    check_vocab(model, tokenizer)
    model.eval()
    return model, tokenizer


def evaluate_text_folder(
    run_dir: Path, cfg: RunConfig
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics and prediction rows of the causal LM in ``run_dir`` on ``cfg.data.eval`` (see
    :func:`emdlm.training.evaluate.evaluate_run`)."""
    from emdlm.evaluation import evaluate_examples

    assert cfg.data.eval is not None  # checked by evaluate_run
    examples = load_examples(cfg.data.eval, seed=cfg.train.seed)
    if any("completion" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval needs prompt/completion examples")
    e, kind = cfg.eval, eval_kind(cfg.eval.kind)
    if not kind.generates and any("choices" not in ex or "label" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: eval.kind=choice needs 'choices' and "
                          "'label' in every example (e.g. --task polarity_choice)")
    if kind.open_ended:
        check_text_metric_packages(mauve=e.mauve)
    oracle = load_trained(e.oracle, cfg.tokenizer) if kind.open_ended and e.oracle else None
    model, tokenizer = load_trained(run_dir, cfg.tokenizer)
    if kind.open_ended:
        metrics, predictions = _evaluate_text(model, tokenizer, examples, e, oracle)
    elif not kind.generates:
        from emdlm.evaluation import evaluate_choice

        try:
            metrics, predictions = evaluate_choice(
                model, tokenizer, examples, batch_size=e.batch_size
            )
        except ValueError as err:  # e.g. k-shot prompts longer than the model's context
            raise ConfigError(f"choice evaluation: {err}") from err
    else:
        from emdlm.evaluation import EvalInputError

        try:
            metrics, predictions = evaluate_examples(
                model, tokenizer, examples, kind=e.kind, max_new_tokens=e.max_new_tokens,
                batch_size=e.batch_size, do_sample=e.do_sample, temperature=e.temperature,
                top_p=e.top_p, seed=e.seed, decode=e.decode, mbr_samples=e.mbr_samples,
            )
        except EvalInputError as err:  # found before any answer was generated
            raise ConfigError(f"{cfg.data.eval.describe()}: {err}") from err
    return metrics, predictions


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
