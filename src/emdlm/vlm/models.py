"""Vision-language models: named tiny VLMs built from a config, and local image-text-to-text
checkpoint folders (``AutoModelForImageTextToText``, never ``trust_remote_code``).

Named architectures (randomly initialised; the text vocab is the tokenizer's length after the
family's special tokens are added, see :func:`prepare_vlm_tokenizer`):

* "tiny-qwen2-vl": ``Qwen2VLConfig`` with a 1-block vision tower (embed dim 32, patch 14, 2x2
  patch merge) and a 2-layer text model (hidden 64); images are resized by Qwen2-VL's image
  processor to at most ``image_size``² pixels (default 112: 8x8 patches, 16 image tokens).
* "tiny-llava": ``LlavaConfig`` with a 1-layer CLIP vision tower (hidden 32, patch 14) and a
  2-layer LLaMA (hidden 64); images are resized and centre-cropped to ``image_size`` (default
  56: 16 image tokens, the CLS feature dropped as in LLaVA-1.5).

``params`` keys: ``image_size``; ``vision_<key>`` for the vision config (``vision_depth``,
``vision_embed_dim``...); any other key goes to the text config (``hidden_size``,
``num_hidden_layers``...).

Image processors are the Pillow/numpy ones (``Qwen2VLImageProcessorPil``,
``CLIPImageProcessorPil``): transformers' default processors need torchvision, whose PyPI wheel
fails to import beside the CPU torch wheel ("operator torchvision::nms does not exist").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from emdlm.config import ConfigError, ModelConfig
from emdlm.models import VLM_NAMES, check_vocab, model_dtype
from emdlm.weights import model_load_error, refuse_folder_code

# model_type -> family; the family decides the prompt template and the image processor
_FAMILIES = {
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "llava": "llava",
}
QWEN_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>")
LLAVA_TOKENS = ("<image>",)


@dataclass
class VisionSpec:
    """What the collator needs to know about a VLM: its family ("qwen2_vl" | "llava"), the
    image placeholder token and (Qwen2-VL) the start/end tokens around it."""

    family: str
    image_token: str
    vision_start: str | None = None
    vision_end: str | None = None


def family_of(model_type: str) -> str:
    """The emdlm family of a transformers ``model_type``; ConfigError for unsupported ones."""
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"image-text-to-text model type {model_type!r} is not supported yet; supported: "
            f"{', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]


def spec_for(family: str) -> VisionSpec:
    if family == "qwen2_vl":
        return VisionSpec("qwen2_vl", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    return VisionSpec("llava", "<image>")


def folder_model_type(path: Path) -> str | None:
    """``model_type`` of a checkpoint folder's config.json when it is an image-text-to-text
    model, else None."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return model_type if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else None


def is_vlm(name: str) -> bool:
    """True for a named tiny VLM or a folder holding an image-text-to-text checkpoint."""
    if name in VLM_NAMES:
        return True
    path = Path(name).expanduser()
    return path.is_dir() and folder_model_type(path) is not None


def named_family(name: str) -> str:
    return "qwen2_vl" if name == "tiny-qwen2-vl" else "llava"


def prepare_vlm_tokenizer(tokenizer: Any, family: str) -> Any:
    """Add the family's special tokens (Qwen2-VL's vision/chat tokens, LLaVA's ``<image>``)
    that ``tokenizer`` lacks, so a small-vocabulary tokenizer ("char") can drive a VLM. The
    offline "qwen" tokenizer already has Qwen2-VL's tokens at their real ids."""
    wanted = QWEN_VL_TOKENS if family == "qwen2_vl" else LLAVA_TOKENS
    vocab = tokenizer.get_vocab()
    missing = [t for t in wanted if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing},
                                     replace_extra_special_tokens=False)
    return tokenizer


def _split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    vision = {k[len("vision_"):]: v for k, v in params.items() if k.startswith("vision_")}
    text = {k: v for k, v in params.items() if not k.startswith("vision_") and k != "image_size"}
    size = params.get("image_size")
    if size is not None and (not isinstance(size, int) or size < 28):
        raise ConfigError(f"model.params.image_size must be an integer >= 28, got {size!r}")
    return text, vision, size


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's multimodal RoPE split of the head's rotary pairs into (time, height, width);
    sums to ``head_dim // 2`` ([16, 24, 24] for head_dim 128, as in Qwen2-VL)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _tiny_qwen2_vl(tokenizer: Any, params: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    text, vision, size = _split_params(params)
    text = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        **text,
    }
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    text.setdefault("rope_parameters", {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim),
    })
    vision = {
        "depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, **vision,
        "hidden_size": text["hidden_size"],  # the merger projects into the text model
    }
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    config = Qwen2VLConfig(
        text_config={**text, **_token_ids(tokenizer), "vocab_size": len(tokenizer)},
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    side = size or 112
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    processor = Qwen2VLImageProcessorPil(
        min_pixels=factor * factor, max_pixels=side * side, patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
    )
    return config, processor


def _tiny_llava(tokenizer: Any, params: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import LlavaConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    text, vision, size = _split_params(params)
    side = size or 56
    text = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, **text,
    }
    vision = {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 14, **vision,
        "image_size": side,
    }
    if side % vision["patch_size"]:
        raise ConfigError(
            f"tiny-llava: image_size {side} must be a multiple of the patch size "
            f"{vision['patch_size']}"
        )
    config = LlavaConfig(
        text_config={**text, **_token_ids(tokenizer), "vocab_size": len(tokenizer)},
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(side // vision["patch_size"]) ** 2,
        vision_feature_layer=-1,  # the tower has one layer
    )
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
    )
    return config, processor


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    return {
        "bos_token_id": getattr(tokenizer, "bos_token_id", None) or tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def load_image_processor(folder: Path, model_type: str) -> Any:
    """The Pillow image processor saved in ``folder`` (preprocessor_config.json)."""
    if not (folder / "preprocessor_config.json").is_file():
        raise ConfigError(f"{folder} has no preprocessor_config.json (the image processor)")
    if family_of(model_type) == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as cls,
        )
    else:
        from transformers.models.clip.image_processing_pil_clip import (
            CLIPImageProcessorPil as cls,
        )
    try:
        return cls.from_pretrained(str(folder))
    except Exception as err:  # name the folder whatever transformers raised
        raise ConfigError(f"could not load the image processor in {folder}: {err}") from err


@dataclass
class BuiltVLM:
    model: Any
    image_processor: Any
    spec: VisionSpec


def build_vlm(cfg: ModelConfig, tokenizer: Any) -> BuiltVLM:
    """The VLM described by ``cfg`` with its image processor. ``tokenizer`` must already hold
    the family's special tokens (:func:`prepare_vlm_tokenizer`)."""
    from transformers import AutoModelForImageTextToText

    dtype = model_dtype(cfg)
    if cfg.name in VLM_NAMES:
        build = _tiny_qwen2_vl if cfg.name == "tiny-qwen2-vl" else _tiny_llava
        try:
            config, processor = build(tokenizer, dict(cfg.params))
            model = AutoModelForImageTextToText.from_config(config).to(dtype)
        except (TypeError, ValueError, KeyError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"model {cfg.name} with params {cfg.params}: {err}") from err
        family = named_family(cfg.name)
    else:
        path = Path(cfg.name).expanduser()
        model_type = folder_model_type(path)
        if model_type is None:
            raise ConfigError(f"{path} holds no image-text-to-text model (config.json)")
        if cfg.params:
            raise ConfigError("model.params only apply to named architectures, not to folders")
        family = family_of(model_type)
        refuse_folder_code(path)
        processor = load_image_processor(path, model_type)
        try:  # local files only; remote code is never run
            model = AutoModelForImageTextToText.from_pretrained(
                str(path), dtype=dtype, trust_remote_code=False
            )
        except Exception as err:  # name the folder (the refused file) whatever was raised
            raise model_load_error(f"could not load a VLM from {path}", path, err) from err
    check_vocab(model, tokenizer)
    return BuiltVLM(model, processor, spec_for(family))


def vision_modules(model: Any) -> list[torch.nn.Module]:
    """The vision tower(s) and projector of a VLM (``visual`` in Qwen2-VL, ``vision_tower`` and
    ``multi_modal_projector`` in LLaVA)."""
    inner = getattr(model, "model", model)
    names = ("visual", "vision_tower", "multi_modal_projector")
    return [getattr(inner, n) for n in names if isinstance(getattr(inner, n, None),
                                                             torch.nn.Module)]


def freeze_vision(model: Any) -> int:
    """Stop gradients into the vision tower and projector; returns the frozen parameter count.
    ConfigError when the model has no recognised vision module."""
    modules = vision_modules(model)
    if not modules:
        raise ConfigError("model.freeze_vision: no vision tower found in this model")
    frozen = 0
    for module in modules:
        for p in module.parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


# LoRA on the language model only: peft matches this regex against full module names, so the
# vision tower's attention projections (``visual.blocks.*.attn.qkv``) are left alone.
LANGUAGE_LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
