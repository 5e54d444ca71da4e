"""Model-based evaluation: batched generation, completion perplexity, task metrics, reports.

Works with any Hugging Face causal LM (``model(input_ids, attention_mask).logits`` and
``model.generate``) and any tokenizer with ``__call__``/``decode`` (char-level or BPE).

Tokenization convention (shared with the perplexity): a prompt is encoded with the tokenizer's
special tokens (a BOS where the tokenizer adds one), a completion without them, and the two id
lists are concatenated. This avoids BPE merges across the prompt/completion boundary.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from emdlm._files import atomic_write
from emdlm.eval_kinds import eval_kind
from emdlm.math_answers import item_from_row, score_answer
from emdlm.metrics import (
    TaskKind,
    box_iou,
    choice_metrics,
    clock_time_gap,
    compute_task_metrics,
    diversity_metrics,
    exact_match,
    mauve_num_buckets,
    mauve_over_runs,
    mauve_problem,
    mauve_score,
    parse_box,
    parse_number,
    perplexity,
    rouge,
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


def check_generation_fits(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int
) -> None:
    """ValueError when the longest prompt plus ``max_new_tokens`` exceeds the model's context
    (what :func:`generate_answers` would raise later, e.g. after a whole training run)."""
    limit = _max_positions(model)
    if limit is None or not prompts:
        return
    longest = max(len(_encode(tokenizer, p, special=True)) for p in prompts)
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"the longest eval prompt ({longest} tokens) + eval.max_new_tokens={max_new_tokens} "
            f"exceeds the model's context length {limit}: raise data.max_length (a tiny model's "
            "positions follow it) or lower eval.max_new_tokens"
        )


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


@contextlib.contextmanager
def generation_session(
    model: Any,
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    seed: int,
    pad_token_id: int | None,
    eos_token_id: int | None,
) -> Iterator[Any]:
    """The ``GenerationConfig`` for one evaluation call, with the model in eval mode and a blank
    ``model.generation_config`` meanwhile (both restored after).

    transformers fills every unset generation field from the model's own generation_config, so a
    checkpoint's defaults (top_k, repetition penalty, min length...) would otherwise change what
    is evaluated. Sampling is unbiased apart from ``temperature`` / ``top_p``: top_k=0 disables
    top-k filtering; the torch RNG is seeded with ``seed`` once per call.
    """
    from transformers import GenerationConfig

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample else {}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        **sampling,
    )
    if do_sample:
        torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    saved = getattr(model, "generation_config", None)
    try:
        if saved is not None:
            model.generation_config = GenerationConfig()
        yield config
    finally:
        if saved is not None:
            model.generation_config = saved
        model.train(was_training)


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
    from transformers import StoppingCriteriaList

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _model_device(model)
    pad_id = _pad_id(tokenizer)
    limit = _max_positions(model)
    answers: list[str] = []
    with generation_session(
        model, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
        top_p=top_p, seed=seed, pad_token_id=pad_id,
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
    ) as gen_config:  # fmt: skip
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
    return answers


# ----------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def sequence_nlls(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    add_eos: bool = False,
) -> list[tuple[float, int]]:
    """Per sequence: (summed negative log-likelihood in nats, number of scored tokens).

    ``texts`` is either plain strings (every token after the first is scored) or
    ``(prompt, completion)`` pairs (only completion tokens are scored, conditioned on the
    prompt). With ``add_eos`` the tokenizer's EOS is appended to each text / completion and
    scored too, as in training (``emdlm.data.tokenize_example``). Batches are right-padded and
    masked; one host sync per batch.
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
    out: list[tuple[float, int]] = []
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
            counts = (labels[:, 1:] != -100).sum(1).tolist()  # [b], on the host copy
            if width < 2:
                out.extend((0.0, 0) for _ in chunk)
                continue
            logits = model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
            ).logits  # [b, L, V]
            shifted = labels[:, 1:].to(device)  # [b, L-1], token t+1 predicted at t
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().transpose(1, 2),  # [b, V, L-1]
                shifted,
                ignore_index=-100,
                reduction="none",
            )  # [b, L-1], 0 where ignored
            sums = nll.double().sum(1).tolist()  # one host sync per batch
            out.extend(zip(sums, counts, strict=True))
    finally:
        model.train(was_training)
    return out


def sequence_nll(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    add_eos: bool = False,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of scored tokens over all
    ``texts`` (see :func:`sequence_nlls` for what is scored); the sum is in float64."""
    per_seq = sequence_nlls(model, tokenizer, texts, batch_size=batch_size, add_eos=add_eos)
    return math.fsum(v for v, _ in per_seq), sum(c for _, c in per_seq)


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


def _exact_fields(pred: str, ref: str, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"correct": exact_match(pred, ref, numeric=False)}


def _number_fields(pred: str, ref: str, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    p, r = parse_number(pred), parse_number(ref)
    return {
        "correct": exact_match(pred, ref, numeric=True),
        "abs_error": abs(p - r) if p is not None and r is not None else None,
    }


def _clock_fields(pred: str, ref: str, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    gap = clock_time_gap(pred, ref)
    return {"correct": gap == 0.0, "time_gap": gap}


def _box_fields(pred: str, ref: str, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    p_box, r_box = parse_box(pred), parse_box(ref)
    iou = box_iou(p_box, r_box) if p_box is not None and r_box is not None else None
    return {"correct": iou is not None and iou >= 0.5, "iou": iou}


def _math_fields(pred: str, ref: str, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    score = score_answer(pred, ref, item_from_row(row, ref))
    return {"correct": score.correct, "parsed": score.parsed, "abs_error": score.abs_error}


#: The per-prediction diagnostics of each task kind written to predictions.jsonl:
#: ``fn(prediction, reference, row=None) -> {"correct": ..., ...}`` (``row``: the test row, read
#: by the kinds with per-row metadata). Exactly the registered kinds
#: (tests/test_task_registry.py).
ROW_FIELDS: dict[str, Callable[..., dict[str, Any]]] = {
    "number": _number_fields,  # correct by value, abs_error
    "clock": _clock_fields,  # correct when the gap is 0, time_gap
    "box": _box_fields,  # correct at IoU >= 0.5, iou
    "boxes": _exact_fields,
    "text": _exact_fields,
    "choice": _exact_fields,
    "math": _math_fields,  # correct as the benchmark scores, parsed answer, abs_error
}


def _per_example_fields(
    pred: str, ref: str, kind: TaskKind, row: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Per-prediction diagnostics written to predictions.jsonl (:data:`ROW_FIELDS`)."""
    return ROW_FIELDS[kind](pred, ref, row)


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

    ``stop_at`` defaults to the kind's (:mod:`emdlm.eval_kinds`): ``("\\n",)`` for answer kinds
    ("number", "clock", "box", ...) and no stop string for "text". The reference is the
    completion cut at the first stop string and stripped (so a training completion "42\\n" is the
    answer "42"); predictions are stripped.

    Returns ``(metrics, predictions)``: metrics from
    :func:`emdlm.metrics.compute_task_metrics` plus ``perplexity`` of the full reference
    completions (and the EOS after them, as in training) given the prompts when
    ``with_perplexity``; one dict per example with prompt,
    reference, prediction and per-example diagnostics (correct, abs_error / time_gap / iou).
    """
    spec = eval_kind(kind)  # checked before any generation: ValueError on an unknown kind
    for i, ex in enumerate(examples):
        if "prompt" not in ex or "completion" not in ex:
            raise KeyError(f"example {i} needs keys 'prompt' and 'completion', has {sorted(ex)}")
    if stop_at is None:
        stop_at = spec.stop_at
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
    metrics = compute_task_metrics(
        preds, references, kind, mauve=mauve, featurizer=featurizer, rows=examples
    )
    if with_perplexity and examples:
        pairs = [(ex["prompt"], ex["completion"]) for ex in examples]
        # scored like the training loss: completion tokens and the EOS that ends them
        has_eos = isinstance(getattr(tokenizer, "eos_token_id", None), int)
        metrics["perplexity"] = sequence_perplexity(
            model, tokenizer, pairs, batch_size=batch_size, add_eos=has_eos
        )
    rows = [
        {"prompt": p, "reference": r, "prediction": y, **_per_example_fields(y, r, kind, ex)}
        for p, r, y, ex in zip(prompts, references, preds, examples, strict=True)
    ]
    return metrics, rows


# ----------------------------------------------------------------------------------------------
# Open-ended text (EMO paper Sec. 4.1 protocol)
# ----------------------------------------------------------------------------------------------

#: MAUVE settings used by :func:`evaluate_text` (mauve-text's defaults; recorded in metrics).
MAUVE_SETTINGS = {"seed": 25, "scaling_factor": 5.0, "kmeans_num_redo": 5, "kmeans_max_iter": 500}


MAUVE_MODES = ("mean", "pooled")


def _text_mauve(
    samples: Sequence[str], refs: Sequence[str], num_samples: int, mode: str, featurizer: Any
) -> dict[str, Any]:
    """MAUVE of prompt-major ``samples`` (``num_samples`` per reference) against ``refs``: the
    mean over sampling runs ("mean") or one score of every sample pooled ("pooled"), with the
    settings; warns on stderr when the score cannot rank models."""
    import sys

    settings = dict(
        seed=MAUVE_SETTINGS["seed"], mauve_scaling_factor=MAUVE_SETTINGS["scaling_factor"],
        kmeans_num_redo=MAUVE_SETTINGS["kmeans_num_redo"],
        kmeans_max_iter=MAUVE_SETTINGS["kmeans_max_iter"],
    )
    out: dict[str, Any] = {"mauve_mode": mode}
    if mode == "pooled":
        out["mauve"] = mauve_score(samples, refs, featurizer=featurizer, **settings)
        out["mauve_num_buckets"] = mauve_num_buckets(len(samples), len(refs))
    else:  # run j: the j-th sample of every prompt
        runs = [list(samples[j::num_samples]) for j in range(num_samples)]
        scores = mauve_over_runs(runs, refs, featurizer=featurizer, **settings)
        out.update(
            mauve=statistics.fmean(scores), mauve_runs=scores,
            mauve_run_std=statistics.stdev(scores) if len(scores) > 1 else float("nan"),
            mauve_run_min=min(scores), mauve_run_max=max(scores),
        )
        out["mauve_num_buckets"] = mauve_num_buckets(len(refs), len(refs))
    out.update({f"mauve_{k}": v for k, v in MAUVE_SETTINGS.items()})
    out["mauve_features"] = "all-MiniLM-L6-v2" if featurizer is None else type(featurizer).__name__
    problem = mauve_problem(out["mauve"], out["mauve_num_buckets"])
    if problem:
        print(f"warning: {problem}", file=sys.stderr)
    return out


def _check_prompt_completion(examples: Sequence[Mapping[str, Any]]) -> None:
    for i, ex in enumerate(examples):
        if "prompt" not in ex or "completion" not in ex:
            raise KeyError(f"example {i} needs keys 'prompt' and 'completion', has {sorted(ex)}")


def _pairs_perplexity(
    model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]], **kw: Any
) -> float:
    """Perplexity of the completions of ``pairs`` given their prompts; NaN when no pair has a
    completion token (e.g. every sample ended at once with EOS)."""
    total, count = sequence_nll(model, tokenizer, pairs, **kw)
    return perplexity(total, count) if count else float("nan")


def evaluate_text(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    num_samples: int = 5,
    max_new_tokens: int = 80,
    batch_size: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    oracle: tuple[Any, Any] | None = None,
    mauve: bool = True,
    mauve_mode: str = "mean",
    featurizer: Any = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Sample continuations of each prompt and score them as the EMO paper does (Sec. 4.1).

    Sampling is ancestral ("unbiased"): ``do_sample`` with ``temperature`` (default 1),
    ``top_p`` (default 1.0) and top-k off (``top_k=0``; transformers' own default would be 50),
    ``num_samples`` continuations of at most ``max_new_tokens`` tokens per prompt, stopped
    only by EOS. Metrics (samples and references are stripped):

    * ``mauve`` (MiniLM features, against the human continuations Q), by ``mauve_mode``:
      "mean" (the paper's: sampling run j takes the j-th sample of every prompt, one MAUVE per
      run, ``mauve`` is their mean; ``mauve_run_std`` / ``_min`` / ``_max`` give the spread and
      ``mauve_runs`` the scores) or "pooled" (one MAUVE of all num_samples x n samples against
      the n references). Recorded: ``mauve_mode``, ``mauve_num_buckets``,
      ``mauve_scaling_factor``, ``mauve_seed``, ``mauve_kmeans_num_redo``,
      ``mauve_kmeans_max_iter``, ``mauve_features``; a warning on stderr when the score is
      saturated or at its floor (:func:`emdlm.metrics.mauve_problem`).
    * ``ppl_test``: exp(mean NLL) of the reference continuations given their prompts (no EOS:
      a continuation is a window cut from a document, not its end).
    * ``ppl_oracle`` (with ``oracle=(model, tokenizer)``): exp(mean NLL) that the oracle assigns
      to the generated continuations given their prompts, all samples pooled by token. The
      decoded text is re-encoded with the oracle's tokenizer.
    * ``rouge1`` / ``rougeL``: mean F-measure of each sample against its prompt's reference.
    * ``distinct_{1,2,3}``, ``rep_{1,2,3,4}``, ``repeated_4gram_share``
      (:func:`emdlm.metrics.diversity_metrics`, on whitespace words), ``gen_words_mean``,
      ``empty_rate``, and the settings (``num_samples``, ``temperature``, ``top_p``, ``top_k``,
      ``max_new_tokens``, ``n_prompts``, ``n_samples``).

    Returns ``(metrics, rows)`` with one row per prompt: prompt, reference (stripped) and
    samples as generated (not stripped: the text PPL_oracle scored).
    """
    _check_prompt_completion(examples)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if mauve and len(examples) < 2:
        raise ValueError("MAUVE needs at least 2 prompts; pass more examples or mauve=False")
    if mauve_mode not in MAUVE_MODES:
        raise ValueError(f"mauve_mode must be one of {', '.join(MAUVE_MODES)}, got {mauve_mode!r}")
    prompts = [str(ex["prompt"]) for ex in examples]
    refs = [str(ex["completion"]) for ex in examples]
    repeated = [p for p in prompts for _ in range(num_samples)]  # prompt-major order
    raw = generate_answers(
        model, tokenizer, repeated, max_new_tokens=max_new_tokens, batch_size=batch_size,
        do_sample=True, temperature=temperature, top_p=top_p, seed=seed, stop_at=(),
    )
    samples = [t.strip() for t in raw]
    sample_refs = [r.strip() for r in refs for _ in range(num_samples)]
    metrics: dict[str, Any] = {}
    if mauve:
        metrics.update(_text_mauve(samples, [r.strip() for r in refs], num_samples, mauve_mode,
                                   featurizer))
    metrics["ppl_test"] = _pairs_perplexity(
        model, tokenizer, list(zip(prompts, refs, strict=True)), batch_size=batch_size
    )
    if oracle is not None:
        o_model, o_tokenizer = oracle
        metrics["ppl_oracle"] = _pairs_perplexity(
            o_model, o_tokenizer, list(zip(repeated, raw, strict=True)), batch_size=batch_size
        )
    metrics.update(rouge(samples, sample_refs))
    metrics.update(diversity_metrics(samples))
    lengths = [len(t.split()) for t in samples]
    metrics["gen_words_mean"] = sum(lengths) / len(lengths) if lengths else float("nan")
    metrics["empty_rate"] = sum(n == 0 for n in lengths) / len(lengths) if lengths else 0.0
    metrics.update(
        num_samples=num_samples, temperature=temperature, top_p=top_p, top_k=0,
        max_new_tokens=max_new_tokens, n_prompts=len(prompts), n_samples=len(samples),
    )
    rows = [
        {
            "prompt": p,
            "reference": r.strip(),
            "samples": raw[i * num_samples : (i + 1) * num_samples],  # as generated
        }
        for i, (p, r) in enumerate(zip(prompts, refs, strict=True))
    ]
    return metrics, rows


# ----------------------------------------------------------------------------------------------
# Choice by perplexity (EMO paper Sec. 4.2, OpenICL's PPL inferencer)
# ----------------------------------------------------------------------------------------------

CHOICE_SCORING = ("text", "completion")


def _check_choice_examples(examples: Sequence[Mapping[str, Any]]) -> None:
    for i, ex in enumerate(examples):
        missing = [k for k in ("prompt", "choices", "label") if k not in ex]
        if missing:
            raise KeyError(f"choice example {i} lacks {missing}; it has {sorted(ex)}")
        choices = ex["choices"]
        if not isinstance(choices, (list, tuple)) or len(choices) < 2:
            raise ValueError(f"choice example {i}: 'choices' must list >= 2 candidates")
        if not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice example {i}: every candidate must be a non-empty string")
        label = ex["label"]
        if isinstance(label, bool) or not isinstance(label, int):
            raise ValueError(f"choice example {i}: 'label' must be an int index, got {label!r}")
        if not 0 <= label < len(choices):
            raise ValueError(f"choice example {i}: label {label} not among {len(choices)} choices")


def score_choices(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 16,
    scoring: str = "text",
) -> list[list[float]]:
    """Mean NLL per token of each candidate of each example (lower is better).

    ``scoring="text"`` (default, OpenICL's ``PPLInferencer`` without ``normalizing_str``): the
    whole filled text ``prompt + candidate`` (demonstrations included) is tokenized as one
    string and every token after the first is scored; the score is its mean NLL. (OpenICL
    divides the summed NLL by all non-pad tokens, the unscored first one included; we divide
    by the scored ones.) ``scoring="completion"``: only the candidate's tokens, given the
    prompt (the evaluation convention of :func:`sequence_nll` for pairs).
    """
    if scoring not in CHOICE_SCORING:
        raise ValueError(f"scoring must be one of {CHOICE_SCORING}, got {scoring!r}")
    _check_choice_examples(examples)
    items: list[Any] = [
        ex["prompt"] + c if scoring == "text" else (ex["prompt"], c)
        for ex in examples
        for c in ex["choices"]
    ]
    per_seq = sequence_nlls(model, tokenizer, items, batch_size=batch_size)
    scores: list[list[float]] = []
    k = 0
    for i, ex in enumerate(examples):
        row = []
        for _ in ex["choices"]:
            nll, count = per_seq[k]
            k += 1
            if count == 0:
                raise ValueError(f"choice example {i}: a candidate text has no scored token")
            row.append(nll / count)
        scores.append(row)
    return scores


def evaluate_choice(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 16,
    scoring: str = "text",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Pick, per example, the candidate with the lowest mean NLL (:func:`score_choices`; ties
    go to the first) and report :func:`emdlm.metrics.choice_metrics` (accuracy, chance_rate,
    majority_rate, n) plus ``scoring``. Rows: prompt, choices, label, prediction (index),
    mean_nll per candidate, correct."""
    scores = score_choices(model, tokenizer, examples, batch_size=batch_size, scoring=scoring)
    predicted = [min(range(len(row)), key=row.__getitem__) for row in scores]
    gold = [int(ex["label"]) for ex in examples]
    metrics: dict[str, Any] = dict(
        choice_metrics(predicted, gold, [len(ex["choices"]) for ex in examples])
    )
    metrics["scoring"] = scoring
    rows = [
        {
            "prompt": ex["prompt"],
            "choices": list(ex["choices"]),
            "label": y,
            "prediction": p,
            "mean_nll": row,
            "correct": p == y,
        }
        for ex, y, p, row in zip(examples, gold, predicted, scores, strict=True)
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


#: The files of one evaluation folder (``emdlm eval``'s ``--out``, an experiment's step folder).
METRICS_FILE = "metrics.json"
PREDICTIONS_FILE = "predictions.jsonl"
#: Key of metrics.json recording how many rows predictions.jsonl holds. metrics.json is written
#: last, so it is the evaluation's completion record and this count is checked against the rows.
N_PREDICTIONS = "n_predictions"
#: Counts that metrics.json held before ``n_predictions`` existed, one per predictions row
#: (``n_prompts`` of eval.kind text, ``n`` of every other kind): the check for older folders.
LEGACY_ROW_COUNTS = ("n_prompts", "n")


class EvalOutputError(ValueError):
    """An evaluation folder that does not hold one whole evaluation (files missing, cut off,
    or disagreeing on the number of rows). The message is one line naming the file."""


def write_eval_outputs(
    out_dir: str | Path,
    metrics: Mapping[str, Any],
    predictions: Iterable[Mapping[str, Any]],
) -> dict[str, Path]:
    """Write ``predictions.jsonl`` (one JSON object per line), then ``metrics.json`` with
    ``n_predictions`` (the number of rows) added, to out_dir.

    Each file is written to a temporary name in out_dir and renamed into place
    (:func:`emdlm._files.atomic_write`), and an earlier ``metrics.json`` is removed first, so
    that a ``metrics.json`` is only ever beside the complete predictions it counts: a write cut
    short (an error, a killed process) leaves no folder that reads as a finished evaluation
    (:func:`eval_outputs_problem`). NaN/inf values are written as null. Returns
    ``{"metrics": path, "predictions": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    preds_path = out / PREDICTIONS_FILE
    metrics_path.unlink(missing_ok=True)  # the old completion record must not outlive its rows
    count = 0
    with atomic_write(preds_path) as fh:
        for row in predictions:
            fh.write(json.dumps(_json_safe(dict(row)), ensure_ascii=False, allow_nan=False))
            fh.write("\n")
            count += 1
    record = {**_json_safe(dict(metrics)), N_PREDICTIONS: count}
    with atomic_write(metrics_path) as fh:
        fh.write(json.dumps(record, indent=2, allow_nan=False) + "\n")
    return {"metrics": metrics_path, "predictions": preds_path}


def _expected_rows(metrics: Mapping[str, Any]) -> int | None:
    """The row count metrics.json records: ``n_predictions``, else (a folder written before it
    existed) ``n_prompts`` or ``n``; None when it records none."""
    for key in (N_PREDICTIONS, *LEGACY_ROW_COUNTS):
        value = metrics.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _read_metrics_record(out_dir: Path) -> dict[str, Any]:
    """metrics.json of ``out_dir`` as a dict; EvalOutputError when it is missing or torn."""
    path = out_dir / METRICS_FILE
    if not path.is_file():
        raise EvalOutputError(f"{path} is missing: the evaluation did not finish")
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EvalOutputError(f"{path} is not valid JSON ({err}): a cut-off write?") from None
    if not isinstance(metrics, dict):
        raise EvalOutputError(f"{path} holds a {type(metrics).__name__}, not a JSON object")
    return metrics


def _rows_problem(path: Path, data: bytes, expected: int | None) -> str | None:
    """Why the bytes of predictions.jsonl are not ``expected`` whole rows (None when they are)."""
    lines = data.count(b"\n")
    if data and not data.endswith(b"\n"):
        return (f"{path}:{lines + 1}: the last line is cut off mid-row (no newline at the end "
                "of the file): a write that did not finish")
    if expected is not None and lines != expected:
        return (f"{path} has {lines} rows but {path.parent / METRICS_FILE} records {expected}: "
                "a write that did not finish")
    return None


def eval_outputs_problem(out_dir: str | Path) -> str | None:
    """Why ``out_dir`` does not hold one finished evaluation, in one line; None when it does.

    Finished means: ``metrics.json`` parses as an object, and ``predictions.jsonl`` ends with a
    newline and has as many lines as metrics.json records (``n_predictions``; for folders
    written before that key, ``n_prompts`` or ``n``; with no count at all, the ending newline is
    the only check). Cheap: the rows themselves are not parsed (:func:`read_eval_outputs` does).
    """
    out = Path(out_dir)
    try:
        metrics = _read_metrics_record(out)
    except EvalOutputError as err:
        return str(err)
    path = out / PREDICTIONS_FILE
    if not path.is_file():
        return f"{path} is missing beside {out / METRICS_FILE}"
    return _rows_problem(path, path.read_bytes(), _expected_rows(metrics))


def read_predictions(path: str | Path, expected: int | None = None) -> list[dict[str, Any]]:
    """The rows of a predictions.jsonl, checked: every line a JSON object, the file ending with
    a newline, and ``expected`` rows when given. EvalOutputError naming ``file:line`` otherwise
    (never a row count silently short, never a JSONDecodeError traceback)."""
    path = Path(path)
    data = path.read_bytes()
    problem = _rows_problem(path, data, expected)
    if problem is not None:
        raise EvalOutputError(problem)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        at = data[: err.start].count(b"\n") + 1
        raise EvalOutputError(f"{path}:{at}: not UTF-8 text ({err.reason})") from None
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.split("\n")[:-1], 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalOutputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise EvalOutputError(f"{path}:{number}: a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return rows


def read_eval_outputs(out_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics, prediction rows) of a finished evaluation folder, both checked (see
    :func:`eval_outputs_problem` and :func:`read_predictions`); EvalOutputError otherwise."""
    out = Path(out_dir)
    metrics = _read_metrics_record(out)
    path = out / PREDICTIONS_FILE
    if not path.is_file():
        raise EvalOutputError(f"{path} is missing beside {out / METRICS_FILE}")
    return metrics, read_predictions(path, _expected_rows(metrics))


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if _is_number_list(value):  # e.g. mauve_runs: a summary here, the list in metrics.json
        v = [float(x) for x in value]
        std = statistics.stdev(v) if len(v) > 1 else math.nan
        return (f"{_format_value(statistics.fmean(v))} ± {_format_value(std)} "
                f"({_format_value(min(v))}–{_format_value(max(v))}, n={len(v)})")
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


def _is_number_list(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))


def format_metrics_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table with one column per run and one row per metric (side by side).

    ``rows`` maps a run name (e.g. "ce", "ntil") to its metrics dict; metrics appear in order of
    first appearance; a metric missing from a run shows "-". Floats get 4 significant digits; a
    list of numbers (``mauve_runs``, one score per sampling run) is summarized as
    "mean ± std (min–max, n=k)" (metrics.json keeps the list).
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
