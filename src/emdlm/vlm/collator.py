"""Image+text batches for VLMs: the model's image processor, its prompt template and labels
that score only the answer.

Per example ``{"image", "prompt", "completion"}``:

1. The prompt is written with the tokenizer's chat template when it has one (a user message
   holding the image and the prompt, then the assistant's turn), else with the family's plain
   template: Qwen2-VL's ``<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>
   {prompt}<|im_end|>\\n<|im_start|>assistant\\n`` or LLaVA-1.5's ``USER: <image>\\n{prompt}
   ASSISTANT:``.
2. Its single image placeholder is expanded to the number of image features the vision tower
   yields (Qwen2-VL: grid t·h·w / merge²; LLaVA: (side / patch)², plus 1 with the "full"
   feature strategy).
3. ``input_ids = prompt + completion + [eos]``; ``labels`` are -100 on the prompt (image
   tokens included) and on padding, so the objectives score only the answer and its EOS, as in
   :mod:`emdlm.data`.

Batches carry ``pixel_values`` (and ``image_grid_thw`` plus ``mm_token_type_ids``, 1 on image
tokens, for Qwen2-VL, whose 5.23 forward needs them for its 3-D RoPE). With a number scope
(``number_scope``, or a row's ``"number_scope"`` field; :mod:`emdlm.data`) they also carry
``number_mask`` [B, T] bool, aligned with ``labels``: True on the answer tokens that the numeric
losses may score as numbers (from the tokenizer's offset mapping), False on the prompt, the EOS
and padding. Rows with a ``"loss_weight"`` give ``loss_weights`` [B, T] (that weight on the
row's tokens, 0 on padding; :mod:`emdlm.integrations.loss_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from emdlm.config import ConfigError
from emdlm.data import IGNORE_INDEX, pad_number_mask, require_pad_token_id
from emdlm.datasets.images import displayed_size, open_rgb
from emdlm.integrations.loss_weights import (
    LOSS_WEIGHT_KEY,
    TOKEN_WEIGHTS_KEY,
    has_loss_weights,
    pad_loss_weights,
)
from emdlm.number_scope import piece_masks, row_scopes
from emdlm.vlm.models import VisionSpec

PLAIN_TEMPLATES = {
    "qwen2_vl": "<|im_start|>user\n{image}{prompt}<|im_end|>\n<|im_start|>assistant\n",
    "llava": "USER: {image}\n{prompt} ASSISTANT:",
}


def open_image(image: Any) -> Any:
    """A PIL RGB image from a path or a PIL image (a ``datasets`` Image column), upright and
    converted from any mode as :func:`emdlm.datasets.images.to_rgb` says (16-bit scaled, alpha
    on white, ...): the one conversion every image takes on its way to the model."""
    return open_rgb(image)


class VLMCollator:
    """``features`` (dicts with image / prompt / completion) -> a padded model batch.

    ``generation=True``: prompts only, left-padded (for ``model.generate``); else prompt +
    completion + eos, right-padded, with labels. ``number_scope`` / ``task``: the rows'
    default number scope and their task (for "answer"), as in :func:`emdlm.data.build_dataset`;
    a scope other than "all" adds ``number_mask`` to training batches."""

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        spec: VisionSpec,
        model_config: Any,
        *,
        max_length: int = 512,
        add_eos: bool = True,
        image_key: str = "image",
        generation: bool = False,
        number_scope: str = "all",
        task: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.spec = spec
        self.config = model_config
        self.max_length = max_length
        self.add_eos = add_eos
        self.image_key = image_key
        self.generation = generation
        self.number_scope = number_scope
        self.task = task
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(spec.image_token))
        self.pad_id = require_pad_token_id(tokenizer.pad_token_id, "VLMCollator")

    # ------------------------------------------------------------------ text
    def prompt_text(self, prompt: str) -> str:
        """The prompt in the chat template (or the family's plain template), with ONE image
        placeholder (Qwen2-VL: wrapped in vision start/end)."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": prompt},
            ]}]
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        s = self.spec
        image = f"{s.vision_start or ''}{s.image_token}{s.vision_end or ''}"
        return PLAIN_TEMPLATES[s.family].format(image=image, prompt=prompt)

    def image_token_counts(self, images: dict[str, torch.Tensor]) -> list[int]:
        """Features per image that the vision tower will produce."""
        if self.spec.family == "qwen2_vl":
            merge = int(self.config.vision_config.spatial_merge_size)
            return (images["image_grid_thw"].prod(-1) // (merge * merge)).tolist()
        vision = self.config.vision_config
        side = images["pixel_values"].shape[-1]
        n = (side // int(vision.patch_size)) ** 2
        if getattr(self.config, "vision_feature_select_strategy", "default") == "full":
            n += 1
        return [n] * images["pixel_values"].shape[0]

    def _expand(self, ids: list[int], n_image: int, where: int) -> list[int]:
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != 1:
            raise ConfigError(
                f"example {where}: the templated prompt holds {len(at)} image placeholders "
                f"({self.spec.image_token!r}), expected exactly 1 (one image per example)"
            )
        k = at[0]
        return ids[:k] + [self.image_token_id] * n_image + ids[k + 1 :]

    def lengths(self, rows: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
        """(prompt tokens with the image's tokens, answer tokens with the EOS) per row, as
        :meth:`__call__` would build them, without processing every image: one image per
        distinct size is run through the image processor (the token count depends on the size
        only)."""
        from PIL import Image

        per_size: dict[tuple[int, int], int] = {}
        prompts = self.tokenizer([self.prompt_text(r["prompt"]) for r in rows])["input_ids"]
        comps = self.tokenizer(
            [r["completion"] for r in rows], add_special_tokens=False
        )["input_ids"]
        extra = 1 if self.add_eos else 0
        out = []
        for row, prompt, comp in zip(rows, prompts, comps, strict=True):
            image = row[self.image_key]
            if isinstance(image, Image.Image):
                size = displayed_size(image)
            else:
                with Image.open(Path(image)) as img:  # header only; upright as open_image
                    size = displayed_size(img)
            if size not in per_size:
                processed = self.image_processor(images=[open_image(image)], return_tensors="pt")
                per_size[size] = int(self.image_token_counts(processed)[0])
            # the one placeholder becomes per_size[size] image tokens
            out.append((len(prompt) - 1 + per_size[size], len(comp) + extra))
        return out

    # ------------------------------------------------------------------ batch
    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        images = self.image_processor(
            images=[open_image(f[self.image_key]) for f in features], return_tensors="pt"
        )
        counts = self.image_token_counts(images)
        prompts = self.tokenizer([self.prompt_text(f["prompt"]) for f in features])["input_ids"]
        rows: list[tuple[list[int], list[int]]] = []
        eos = [self.tokenizer.eos_token_id] if self.add_eos else []
        scopes, masks = None, None
        if not self.generation:
            texts = [f["completion"] for f in features]
            scopes = row_scopes(features, self.number_scope, self.task, "VLM batch")
            if scopes is None:
                comps = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            else:
                comps, masks = piece_masks(
                    self.tokenizer, texts, scopes, add_special_tokens=False
                )
        mask_rows: list[dict[str, list[bool]]] = []
        for i, (ids, n) in enumerate(zip(prompts, counts, strict=True)):
            prompt = self._expand(list(ids), int(n), i)
            if self.generation:
                rows.append((prompt, [IGNORE_INDEX] * len(prompt)))
                continue
            if len(prompt) + 1 > self.max_length:
                raise ConfigError(
                    f"example {i}: prompt with {n} image tokens is {len(prompt)} tokens, no room "
                    f"for an answer within data.max_length={self.max_length}"
                )
            answer = (list(comps[i]) + eos)[: self.max_length - len(prompt)]
            rows.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
            if masks is not None:
                in_scope = (masks[i] + [False] * len(eos))[: len(answer)]
                mask_rows.append({"number_mask": [False] * len(prompt) + in_scope})
        batch = self._pad(rows, left=self.generation)
        width = batch["input_ids"].shape[1]
        lengths = [len(ids) for ids, _ in rows]
        if masks is not None:
            batch["number_mask"] = pad_number_mask(mask_rows, lengths, width)
        if any(f.get(TOKEN_WEIGHTS_KEY) is not None for f in features):
            raise ConfigError(
                f"VLM batch: per-token {TOKEN_WEIGHTS_KEY!r} cannot follow image rows (their "
                f"token count depends on the image); give each row one {LOSS_WEIGHT_KEY!r}"
            )
        row_weights = [{LOSS_WEIGHT_KEY: f.get(LOSS_WEIGHT_KEY)} for f in features]
        if not self.generation and has_loss_weights(row_weights):
            batch[TOKEN_WEIGHTS_KEY] = pad_loss_weights(row_weights, lengths, width)
        batch["pixel_values"] = images["pixel_values"]
        if self.spec.family == "qwen2_vl":
            batch["image_grid_thw"] = images["image_grid_thw"]
            batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long()
            # a pad id equal to the image id would be miscounted; the tokens differ by build
        if self.generation:
            del batch["labels"]
        return batch

    def _pad(self, rows: list[tuple[list[int], list[int]]], *, left: bool) -> dict[str, Any]:
        width = max(len(ids) for ids, _ in rows)
        n = len(rows)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, (ids, labs) in enumerate(rows):
            span = slice(width - len(ids), width) if left else slice(0, len(ids))
            input_ids[i, span] = torch.tensor(ids, dtype=torch.long)
            labels[i, span] = torch.tensor(labs, dtype=torch.long)
            mask[i, span] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}
