"""Generation and perplexity with any Hugging Face causal LM: batched greedy or sampled answers
cut at stop strings, and per-sequence negative log-likelihood.

Works with any model with ``model(input_ids, attention_mask).logits`` and ``model.generate``,
and any tokenizer with ``__call__``/``decode`` (char-level or BPE).

Tokenization convention (shared by generation and perplexity): a prompt is encoded with the
tokenizer's special tokens (a BOS where the tokenizer adds one), a completion without them, and
the two id lists are concatenated. This avoids BPE merges across the prompt/completion boundary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from emdlm.metrics import perplexity

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def model_device(model: torch.nn.Module) -> torch.device:
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


def check_scored_fit(
    model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]], *, add_eos: bool = False
) -> None:
    """ValueError naming the first ``(prompt, completion)`` pair whose tokens (and the EOS with
    ``add_eos``), as :func:`sequence_nlls` scores them, exceed the model's context: what it
    would raise later, e.g. after every answer of an evaluation was generated."""
    limit = _max_positions(model)
    if limit is None:
        return
    eos = 1 if add_eos else 0
    for i, (prompt, completion) in enumerate(pairs):
        length = (len(_encode(tokenizer, prompt, special=True))
                  + len(_encode(tokenizer, completion, special=False)) + eos)
        if length > limit:
            raise ValueError(
                f"row {i}: its prompt and completion{' and EOS' if eos else ''} are {length} "
                f"tokens, beyond the model's context length {limit}, so the completion's "
                "perplexity cannot be computed: shorten the row or leave it out"
            )


def check_counts(**counts: int) -> None:
    """ValueError naming the first of ``counts`` below 1 (``"batch_size must be >= 1, got 0"``):
    the check of the counts that generation and scoring calls take."""
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _pad_id(tokenizer: Any) -> int:
    """The id used for padding: pad, else eos, else 0 (padding is masked out anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def cut_at_stop(text: str, stop_at: Sequence[str]) -> str:
    cut = len(text)
    for stop in stop_at:
        if stop:
            idx = text.find(stop)
            if idx != -1:
                cut = min(cut, idx)
    return text[:cut]


class StopOnStrings:
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
    num_return_sequences: int = 1,
) -> Iterator[Any]:
    """The ``GenerationConfig`` for one evaluation call, with the model in eval mode and a blank
    ``model.generation_config`` meanwhile (both restored after).

    transformers fills every unset generation field from the model's own generation_config, so a
    checkpoint's defaults (top_k, repetition penalty, min length...) would otherwise change what
    is evaluated. Sampling is unbiased apart from ``temperature`` / ``top_p``: top_k=0 disables
    top-k filtering; the torch RNG is seeded with ``seed`` once per call.
    ``num_return_sequences``: sequences returned per prompt (more than 1 only when sampling).
    """
    from transformers import GenerationConfig

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample else {}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        num_return_sequences=num_return_sequences,
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


def generate_new_text(
    model: Any, tokenizer: Any, inputs: dict[str, torch.Tensor], config: Any,
    stop_at: Sequence[str],
) -> list[str]:
    """The new text of one left-padded batch: ``model.generate(**inputs)`` (``inputs`` moved to
    the model's device, ``input_ids`` [b, L] among them) with ``config``, each row stopped at
    EOS or once its new text holds one of ``stop_at``, decoded without special tokens and cut
    before the first stop string."""
    from transformers import StoppingCriteriaList

    device = model_device(model)
    width = inputs["input_ids"].shape[1]
    criteria = [StopOnStrings(tokenizer, width, stop_at)] if any(stop_at) else []
    out = model.generate(
        **{k: v.to(device) for k, v in inputs.items()}, generation_config=config,
        stopping_criteria=StoppingCriteriaList(criteria),
    )  # [b * num_return_sequences, L + new], prompt-major
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return [cut_at_stop(t, stop_at) for t in texts]


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
    num_return_sequences: int = 1,
) -> list[str]:
    """Generate a completion for each prompt; return only the new text, cut at a stop string.

    ``num_return_sequences`` (k, sampling only): k completions per prompt from one ``generate``
    call per batch, returned prompt-major (the k of prompt 0, then the k of prompt 1, ...).

    Prompts are left-padded per batch (decoder-only models continue from the last position),
    with an attention mask so padding is ignored. Generation stops per row at the tokenizer's
    EOS or once the new text contains one of ``stop_at``; the returned text is decoded without
    special tokens and cut before the first stop string (not stripped). Greedy decoding
    (``do_sample=False``) is deterministic; sampling is seeded with ``seed`` once per call.

    Raises ValueError if a prompt plus ``max_new_tokens`` exceeds the model's context length.
    """
    check_counts(max_new_tokens=max_new_tokens, batch_size=batch_size)
    if num_return_sequences < 1 or (num_return_sequences > 1 and not do_sample):
        raise ValueError(
            f"num_return_sequences must be 1 for greedy decoding and >= 1 when sampling, got "
            f"{num_return_sequences} (do_sample={do_sample})"
        )
    pad_id = _pad_id(tokenizer)
    limit = _max_positions(model)
    answers: list[str] = []
    with generation_session(
        model, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
        top_p=top_p, seed=seed, pad_token_id=pad_id,
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        num_return_sequences=num_return_sequences,
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
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
            answers.extend(generate_new_text(model, tokenizer, inputs, gen_config, stop_at))
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
    check_counts(batch_size=batch_size)
    device = model_device(model)
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


