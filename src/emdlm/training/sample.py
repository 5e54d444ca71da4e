"""The ``emdlm sample`` recipe: a corpus of a model's own continuations (EMO's oracle experiment).

EMO (ICLR 2024, Sec. 4.1, Table 2) trains students on text sampled from an oracle model and
scores them against the oracle. This module samples ``num_samples`` continuations of every
prompt of a test set by unbiased (ancestral) sampling — temperature 1, no top-k, top-p 1, as
``eval.kind=text`` does (:func:`emdlm.generation.generate_answers`) — and writes a JSONL file:

* ``--format prompt_completion`` (default): ``{"prompt": p, "completion": sample}``: a test set
  whose references are the oracle's samples (MAUVE / ROUGE / PPL_test against the oracle), or a
  training set that trains the continuation only;
* ``--format text``: ``{"text": p + sample}``: a training set of whole sequences.

A sample that is empty after stripping (EOS at once) has no text to train on or compare with:
it is left out and counted (``empty_samples`` in the returned summary and on the console).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from emdlm._files import atomic_write
from emdlm.config import ConfigError, RunConfig
from emdlm.config.errors import check_one_of
from emdlm.data import load_examples

FORMATS = ("prompt_completion", "text")


def check_sample_target(out: Path, *, overwrite: bool) -> None:
    """Refuse to replace an existing file unless asked (before anything is loaded)."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a .jsonl file path")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")


def sample_corpus(
    run_dir: str | Path, cfg: RunConfig, out: str | Path, *, fmt: str = "prompt_completion",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Sample ``cfg.eval.num_samples`` continuations of at most ``cfg.eval.max_new_tokens``
    tokens for every prompt of ``cfg.data.eval`` with the model in ``run_dir``; write them to
    ``out`` (JSONL, prompt-major order) and return a summary (rows, prompts, empty samples,
    settings). Everything is checked before the file is written."""
    from emdlm.generation import generate_answers
    from emdlm.training.evaluate import load_trained

    target = Path(out)
    check_one_of("--format", fmt, FORMATS, ConfigError)
    check_sample_target(target, overwrite=overwrite)
    if cfg.data.eval is None:
        raise ConfigError("no prompts: set data.eval.path or data.eval.task (e.g. --task)")
    e = cfg.eval
    if e.num_samples < 1:
        raise ConfigError(f"eval.num_samples must be >= 1, got {e.num_samples}")
    examples = load_examples(cfg.data.eval, seed=cfg.train.seed)
    if any("prompt" not in ex for ex in examples):
        raise ConfigError(f"{cfg.data.eval.describe()}: sampling needs a 'prompt' in every row")
    model, tokenizer = load_trained(run_dir, cfg.tokenizer)
    prompts = [str(ex["prompt"]) for ex in examples for _ in range(e.num_samples)]
    try:
        samples = generate_answers(
            model, tokenizer, prompts, max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size, do_sample=True, temperature=e.temperature, top_p=e.top_p,
            seed=e.seed, stop_at=(),
        )
    except ValueError as err:
        raise ConfigError(f"sampling: {err}") from err
    rows = []
    for prompt, sample in zip(prompts, samples, strict=True):
        if not sample.strip():
            continue
        rows.append({"text": prompt + sample} if fmt == "text"
                    else {"prompt": prompt, "completion": sample})
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target) as fh:  # a killed run leaves no half-written sample file
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {
        "out": str(target), "rows": len(rows), "prompts": len(examples),
        "num_samples": e.num_samples, "empty_samples": len(samples) - len(rows),
        "max_new_tokens": e.max_new_tokens, "temperature": e.temperature, "top_p": e.top_p,
        "top_k": 0, "seed": e.seed, "format": fmt,
    }
