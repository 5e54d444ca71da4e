"""Model-based evaluation: batched generation, completion perplexity, task metrics, reports.

Works with any Hugging Face causal LM (``model(input_ids, attention_mask).logits`` and
``model.generate``) and any tokenizer with ``__call__``/``decode`` (char-level or BPE).

Tokenization convention (shared with the perplexity): a prompt is encoded with the tokenizer's
special tokens (a BOS where the tokenizer adds one), a completion without them, and the two id
lists are concatenated. This avoids BPE merges across the prompt/completion boundary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from emdlm.metrics import (
    TASK_KINDS,
    TaskKind,
    box_iou,
    clock_time_gap,
    compute_task_metrics,
    exact_match,
    parse_box,
    parse_number,
    perplexity,
)

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - parameterless model
        return torch.device("cpu")


def _max_positions(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _pad_id(tokenizer: Any) -> int:
    """The id used for padding: pad, else eos, else 0 (padding is masked out anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _cut_at_stop(text: str, stop_at: Sequence[str]) -> str:
    cut = len(text)
    for stop in stop_at:
        if stop:
            idx = text.find(stop)
            if idx != -1:
                cut = min(cut, idx)
    return text[:cut]


class _StopOnStrings:
    """Generation stopping criterion: a row is done once its decoded new text holds a stop
    string. One batch_decode per step (a handful of short strings), not per token id."""

    def __init__(self, tokenizer: Any, prompt_len: int, stop_at: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.stop_at = [s for s in stop_at if s]

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(
            input_ids[:, self.prompt_len :], skip_special_tokens=True
        )
        done = [any(s in t for s in self.stop_at) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at: Sequence[str] = ("\n",),
) -> list[str]:
    """Generate a completion for each prompt; return only the new text, cut at a stop string.

    Prompts are left-padded per batch (decoder-only models continue from the last position),
    with an attention mask so padding is ignored. Generation stops per row at the tokenizer's
    EOS or once the new text contains one of ``stop_at``; the returned text is decoded without
    special tokens and cut before the first stop string (not stripped). Greedy decoding
    (``do_sample=False``) is deterministic; sampling is seeded with ``seed`` once per call.

    Raises ValueError if a prompt plus ``max_new_tokens`` exceeds the model's context length.
    """
    from transformers import GenerationConfig, StoppingCriteriaList

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _model_device(model)
    pad_id = _pad_id(tokenizer)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    limit = _max_positions(model)
    was_training = model.training
    model.eval()
    # An explicit config, and (below) a blank model.generation_config during the call:
    # transformers fills every unset field from the model's own generation_config, so a
    # checkpoint's defaults (top_k, repetition penalty, min length...) would otherwise change
    # what is evaluated. top_k=0 disables top-k filtering.
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample else {}
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        **sampling,
    )
    if do_sample:
        torch.manual_seed(seed)
    answers: list[str] = []
    saved_generation_config = getattr(model, "generation_config", None)
    try:
        if saved_generation_config is not None:
            model.generation_config = GenerationConfig()
        for start in range(0, len(prompts), batch_size):
            encoded = [
                _encode(tokenizer, p, special=True) for p in prompts[start : start + batch_size]
            ]
            if any(len(ids) == 0 for ids in encoded):
                raise ValueError("a prompt encodes to zero tokens; generation needs a context")
            width = max(len(ids) for ids in encoded)
            if limit is not None and width + max_new_tokens > limit:
                raise ValueError(
                    f"prompt of {width} tokens + max_new_tokens={max_new_tokens} exceeds the "
                    f"model's context length {limit}"
                )
            input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # [b, L]
            attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [b, L]
            for row, ids in enumerate(encoded):  # left padding
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, width - len(ids) :] = 1
            criteria = [_StopOnStrings(tokenizer, width, stop_at)] if any(stop_at) else []
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=gen_config,
                stopping_criteria=StoppingCriteriaList(criteria),
            )  # [b, L + new]
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            answers.extend(_cut_at_stop(t, stop_at) for t in texts)
    finally:
        if saved_generation_config is not None:
            model.generation_config = saved_generation_config
        model.train(was_training)
    return answers


# ----------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def sequence_nll(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    add_eos: bool = False,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of scored tokens.

    ``texts`` is either plain strings (every token after the first is scored) or
    ``(prompt, completion)`` pairs (only completion tokens are scored, conditioned on the
    prompt). With ``add_eos`` the tokenizer's EOS is appended to each text / completion and
    scored too, as in training (``emdlm.data.tokenize_example``). Batches are right-padded and
    masked; the sum is in float64 on the host, with one host sync per batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _model_device(model)
    pad_id = _pad_id(tokenizer)
    eos: list[int] = []
    if add_eos:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos_id, int):
            raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
        eos = [eos_id]
    seqs: list[tuple[list[int], int]] = []  # (ids, index of the first scored token)
    for item in texts:
        if isinstance(item, str):
            ids = _encode(tokenizer, item, special=True) + eos
            seqs.append((ids, 1))
        else:
            prompt, completion = item
            p_ids = _encode(tokenizer, prompt, special=True)
            c_ids = _encode(tokenizer, completion, special=False) + eos
            seqs.append((p_ids + c_ids, max(len(p_ids), 1)))
    limit = _max_positions(model)
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    try:
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start : start + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            if limit is not None and width > limit:
                raise ValueError(f"a sequence of {width} tokens exceeds the context {limit}")
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [b, L]
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [b, L]
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)  # [b, L]
            for row, (ids, first) in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
                labels[row, first : len(ids)] = input_ids[row, first : len(ids)]
            if width < 2:
                continue
            logits = model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
            ).logits  # [b, L, V]
            shifted = labels[:, 1:].to(device)  # [b, L-1], token t+1 predicted at t
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                shifted.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            total_nll += float(nll)  # one host sync per batch
            total_tokens += int((labels[:, 1:] != -100).sum())  # counted on the host copy
    finally:
        model.train(was_training)
    return total_nll, total_tokens


def sequence_perplexity(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    add_eos: bool = False,
) -> float:
    """Per-token perplexity exp(sum NLL / n_tokens) over texts or completion tokens of
    ``(prompt, completion)`` pairs (see :func:`sequence_nll`)."""
    total_nll, total_tokens = sequence_nll(
        model, tokenizer, texts, batch_size=batch_size, add_eos=add_eos
    )
    return perplexity(total_nll, total_tokens)


# ----------------------------------------------------------------------------------------------
# Whole evaluation
# ----------------------------------------------------------------------------------------------


def _per_example_fields(pred: str, ref: str, kind: TaskKind) -> dict[str, Any]:
    """Per-prediction diagnostics written to predictions.jsonl."""
    fields: dict[str, Any] = {"correct": exact_match(pred, ref, numeric=kind == "number")}
    if kind == "number":
        p, r = parse_number(pred), parse_number(ref)
        fields["abs_error"] = abs(p - r) if p is not None and r is not None else None
    elif kind == "clock":
        gap = clock_time_gap(pred, ref)
        fields["time_gap"] = gap
        fields["correct"] = gap == 0.0
    elif kind == "box":
        p_box, r_box = parse_box(pred), parse_box(ref)
        iou = box_iou(p_box, r_box) if p_box is not None and r_box is not None else None
        fields["iou"] = iou
        fields["correct"] = iou is not None and iou >= 0.5
    return fields


def evaluate_examples(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Mapping[str, str]],
    *,
    kind: TaskKind = "number",
    max_new_tokens: int = 16,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at: Sequence[str] | None = None,
    with_perplexity: bool = True,
    mauve: bool = False,
    featurizer: Any = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate answers for ``examples`` (dicts with "prompt" and "completion") and score them.

    ``stop_at`` defaults to ``("\\n",)`` for answer kinds ("number", "clock", "box") and to no
    stop string for "text". The reference is the completion cut at the first stop string and
    stripped (so a training completion "42\\n" is the answer "42"); predictions are stripped.

    Returns ``(metrics, predictions)``: metrics from
    :func:`emdlm.metrics.compute_task_metrics` plus ``perplexity`` of the full reference
    completions (and the EOS after them, as in training) given the prompts when
    ``with_perplexity``; one dict per example with prompt,
    reference, prediction and per-example diagnostics (correct, abs_error / time_gap / iou).
    """
    if kind not in TASK_KINDS:  # checked before any generation
        raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")
    for i, ex in enumerate(examples):
        if "prompt" not in ex or "completion" not in ex:
            raise KeyError(f"example {i} needs keys 'prompt' and 'completion', has {sorted(ex)}")
    if stop_at is None:
        stop_at = () if kind == "text" else ("\n",)
    prompts = [ex["prompt"] for ex in examples]
    references = [_cut_at_stop(ex["completion"], stop_at).strip() for ex in examples]
    preds = generate_answers(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_at=stop_at,
    )
    preds = [p.strip() for p in preds]
    metrics = compute_task_metrics(preds, references, kind, mauve=mauve, featurizer=featurizer)
    if with_perplexity and examples:
        pairs = [(ex["prompt"], ex["completion"]) for ex in examples]
        # scored like the training loss: completion tokens and the EOS that ends them
        has_eos = isinstance(getattr(tokenizer, "eos_token_id", None), int)
        metrics["perplexity"] = sequence_perplexity(
            model, tokenizer, pairs, batch_size=batch_size, add_eos=has_eos
        )
    rows = [
        {"prompt": p, "reference": r, "prediction": y, **_per_example_fields(y, r, kind)}
        for p, r, y in zip(prompts, references, preds, strict=True)
    ]
    return metrics, rows


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """Non-finite floats become None so the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_eval_outputs(
    out_dir: str | Path,
    metrics: Mapping[str, Any],
    predictions: Sequence[Mapping[str, Any]],
) -> dict[str, Path]:
    """Write ``metrics.json`` and ``predictions.jsonl`` (one JSON object per line) to out_dir.

    NaN/inf values are written as null. Returns ``{"metrics": path, "predictions": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.json"
    preds_path = out / "predictions.jsonl"
    metrics_path.write_text(
        json.dumps(_json_safe(dict(metrics)), indent=2, allow_nan=False) + "\n", encoding="utf-8"
    )
    with preds_path.open("w", encoding="utf-8") as fh:
        for row in predictions:
            fh.write(json.dumps(_json_safe(dict(row)), ensure_ascii=False, allow_nan=False))
            fh.write("\n")
    return {"metrics": metrics_path, "predictions": preds_path}


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value.is_integer() and abs(value) < 1e6:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def format_metrics_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table with one column per run and one row per metric (side by side).

    ``rows`` maps a run name (e.g. "ce", "ntil") to its metrics dict; metrics appear in order of
    first appearance; a metric missing from a run shows "-". Floats get 4 significant digits.
    """
    names = list(rows)
    keys: list[str] = []
    for metrics in rows.values():
        keys.extend(k for k in metrics if k not in keys)
    header = ["metric", *names]
    body = [[k, *(_format_value(rows[n].get(k)) for n in names)] for k in keys]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "| " + " | ".join([first, *rest]) + " |"

    sep = "|" + "|".join(["-" * (widths[0] + 2)] + [("-" * (w + 1)) + ":" for w in widths[1:]])
    return "\n".join([line(header), sep + "|", *(line(r) for r in body)])
