"""Model-based evaluation: a model's answers to test rows scored by their task kind.

* :func:`evaluate_examples`: generate answers (:mod:`emdlm.generation`), score them with the
  kind's metrics (:func:`emdlm.metrics.compute_task_metrics`) and write per-prediction
  diagnostics (:data:`ROW_FIELDS`) for predictions.jsonl;
* :func:`evaluate_text`: open-ended continuations by the EMO paper's protocol (Sec. 4.1):
  MAUVE averaged over sampling runs, perplexities, ROUGE, diversity;
* :func:`evaluate_choice`: multiple choice by the lowest perplexity (EMO Sec. 4.2).

The files these results go to: :mod:`emdlm.eval_outputs`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from emdlm.config.errors import check_one_of
from emdlm.decoding import check_decode, mbr_decode, mbr_distance
from emdlm.eval_kinds import eval_kind
from emdlm.generation import (
    check_counts,
    check_generation_fits,
    check_scored_fit,
    cut_at_stop,
    generate_answers,
    sequence_nll,
    sequence_nlls,
    sequence_perplexity,
)
from emdlm.math_answers import item_from_row, score_answer
from emdlm.metrics import (
    TaskKind,
    check_references,
    choice_metrics,
    clock_time_gap,
    compute_task_metrics,
    diversity_metrics,
    exact_match,
    mauve_num_buckets,
    mauve_over_runs,
    mauve_problem,
    mauve_score,
    parse_number,
    perplexity,
    rouge,
)
from emdlm.metrics.boxes import box_iou, parse_box

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


def per_example_fields(
    pred: str, ref: str, kind: TaskKind, row: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Per-prediction diagnostics written to predictions.jsonl (:data:`ROW_FIELDS`)."""
    return ROW_FIELDS[kind](pred, ref, row)


class EvalInputError(ValueError):
    """A test set that cannot be scored as asked, found before any answer is generated: a
    reference the kind cannot read, a row beyond the model's context."""


def check_before_generating(
    model: Any, tokenizer: Any, examples: Sequence[Mapping[str, Any]], references: Sequence[str],
    *, kind: TaskKind, max_new_tokens: int, perplexity_eos: bool | None,
) -> None:
    """:class:`EvalInputError` for what :func:`evaluate_examples` would otherwise find only
    after generating every answer: a reference the kind's metrics cannot read
    (:func:`emdlm.metrics.check_references`), a prompt that leaves no room for
    ``max_new_tokens`` in the model's context (:func:`emdlm.generation.check_generation_fits`),
    a row too long for its perplexity to be computed (``perplexity_eos`` not None: scored with
    or without EOS, :func:`emdlm.generation.check_scored_fit`)."""
    try:
        check_references(references, kind, rows=examples)
        check_generation_fits(model, tokenizer, [ex["prompt"] for ex in examples],
                              max_new_tokens)
        if perplexity_eos is not None:
            check_scored_fit(model, tokenizer,
                             [(ex["prompt"], ex["completion"]) for ex in examples],
                             add_eos=perplexity_eos)
    except ValueError as err:
        raise EvalInputError(str(err)) from err


def _check_prompt_completion(examples: Sequence[Mapping[str, Any]]) -> None:
    """KeyError naming the first example without a "prompt" or a "completion"."""
    for i, ex in enumerate(examples):
        if "prompt" not in ex or "completion" not in ex:
            raise KeyError(f"example {i} needs keys 'prompt' and 'completion', has {sorted(ex)}")


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
    decode: str = "greedy",
    mbr_samples: int = 16,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate answers for ``examples`` (dicts with "prompt" and "completion") and score them.

    ``stop_at`` defaults to the kind's (:mod:`emdlm.eval_kinds`): ``("\\n",)`` for answer kinds
    ("number", "clock", "box", ...) and no stop string for "text". The reference is the
    completion cut at the first stop string and stripped (so a training completion "42\\n" is the
    answer "42"); predictions are stripped.

    Before any answer is generated, :func:`check_before_generating` raises
    :class:`EvalInputError` for a reference the kind cannot read or a row beyond the context.

    Returns ``(metrics, predictions)``: metrics from
    :func:`emdlm.metrics.compute_task_metrics` plus ``perplexity`` of the full reference
    completions (and the EOS after them, as in training) given the prompts when
    ``with_perplexity``; one dict per example with prompt,
    reference, prediction and per-example diagnostics (correct, abs_error / time_gap / iou).

    ``decode="mbr"``: each prediction is the minimum-Bayes-risk pick among ``mbr_samples``
    answers sampled at ``temperature`` / ``top_p`` (:func:`emdlm.decoding.mbr_decode`); the
    metrics record the decoding settings and each row its ``samples``. ``"greedy"`` (default):
    one answer per prompt (sampled when ``do_sample``). Both record ``decode``.
    """
    spec = eval_kind(kind)  # checked before any generation: ValueError on an unknown kind
    check_decode(decode)
    if decode == "mbr":
        mbr_distance(kind)  # ValueError for a kind without a short answer
    _check_prompt_completion(examples)
    if stop_at is None:
        stop_at = spec.stop_at
    prompts = [ex["prompt"] for ex in examples]
    references = [cut_at_stop(ex["completion"], stop_at).strip() for ex in examples]
    # scored like the training loss: completion tokens and the EOS that ends them
    has_eos = isinstance(getattr(tokenizer, "eos_token_id", None), int)
    check_before_generating(model, tokenizer, examples, references, kind=kind,
                            max_new_tokens=max_new_tokens,
                            perplexity_eos=has_eos if with_perplexity else None)
    decoded = None
    if decode == "mbr":
        decoded = mbr_decode(
            model, tokenizer, prompts, kind=kind, samples=mbr_samples,
            max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
            top_p=top_p, seed=seed, stop_at=stop_at,
        )
        preds = decoded.answers
    else:
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
    metrics.update(decoded.metrics if decoded is not None else {"decode": "greedy"})
    if with_perplexity and examples:
        pairs = [(ex["prompt"], ex["completion"]) for ex in examples]
        metrics["perplexity"] = sequence_perplexity(
            model, tokenizer, pairs, batch_size=batch_size, add_eos=has_eos
        )
    rows = [
        {"prompt": p, "reference": r, "prediction": y, **per_example_fields(y, r, kind, ex)}
        for p, r, y, ex in zip(prompts, references, preds, examples, strict=True)
    ]
    if decoded is not None:
        for row, group in zip(rows, decoded.samples, strict=True):
            row["samples"] = group
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
    check_counts(num_samples=num_samples)
    if mauve and len(examples) < 2:
        raise ValueError("MAUVE needs at least 2 prompts; pass more examples or mauve=False")
    check_one_of("mauve_mode", mauve_mode, MAUVE_MODES)
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
    check_one_of("scoring", scoring, CHOICE_SCORING)
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


