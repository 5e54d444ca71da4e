"""Greedy (or sampled) answers and completion perplexity of a VLM on image rows, and the rows
with their images swapped (:func:`other_images`) to measure how much the answers use the image.

Same conventions as :func:`emdlm.generation.generate_answers`: an explicit GenerationConfig
(the checkpoint's own generation defaults are not used), stop per row at EOS or a stop string,
new text decoded without special tokens and cut before the first stop string. Prompts are
templated and left-padded by :class:`emdlm.vlm.collator.VLMCollator` in generation mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from emdlm.vlm.collator import VLMCollator


def _on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def generate_vlm_answers(
    model: Any,
    collator: VLMCollator,
    rows: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 16,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at: Sequence[str] = ("\n",),
) -> list[str]:
    """One answer per row (dicts with the image and "prompt")."""
    from emdlm.generation import check_counts, generate_new_text, generation_session

    check_counts(max_new_tokens=max_new_tokens, batch_size=batch_size)
    tokenizer = collator.tokenizer
    was_generation, collator.generation = collator.generation, True
    answers: list[str] = []
    try:
        with generation_session(
            model, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
            top_p=top_p, seed=seed, pad_token_id=collator.pad_id,
            eos_token_id=tokenizer.eos_token_id,
        ) as config:  # fmt: skip
            for start in range(0, len(rows), batch_size):
                batch = collator(list(rows[start : start + batch_size]))
                answers.extend(generate_new_text(model, tokenizer, batch, config, stop_at))
    finally:
        collator.generation = was_generation
    return answers


@torch.no_grad()
def vlm_perplexity(
    model: Any, collator: VLMCollator, rows: Sequence[dict[str, Any]], *, batch_size: int = 16
) -> float:
    """exp(mean NLL) of the completions and their EOS given image and prompt (the tokens the
    training loss scores)."""
    was_generation, collator.generation = collator.generation, False
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for start in range(0, len(rows), batch_size):
            batch = _on(collator(list(rows[start : start + batch_size])), device)
            labels = batch.pop("labels")
            logits = model(**batch).logits[:, :-1].float()  # [b, T-1, V]
            target = labels[:, 1:]  # [b, T-1]
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), target, ignore_index=-100, reduction="sum"
            )
            total += float(nll)
            count += int((target != -100).sum())
    finally:
        collator.generation = was_generation
    return math.exp(total / count) if count else float("nan")


def other_images(rows: Sequence[dict[str, Any]], image_key: str) -> list[dict[str, Any]]:
    """The rows with row i showing row i+1's image (the last row the first one's), prompts and
    answers unchanged. ``vlm_perplexity`` on them against the rows' own perplexity says how much
    of what the model predicts comes from the picture: equal values, the image is ignored.

    Raises ValueError for fewer than 2 rows (nothing to swap with).
    """
    if len(rows) < 2:
        raise ValueError(f"other_images needs at least 2 rows to swap images, got {len(rows)}")
    return [{**row, image_key: rows[(i + 1) % len(rows)][image_key]}
            for i, row in enumerate(rows)]
