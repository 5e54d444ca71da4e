"""Tokenizer and model construction: local Hugging Face folders or named tiny architectures.

Named architectures are randomly initialised from a config whose vocab size is the tokenizer's
length (dropout 0 by default so runs are deterministic and multi-process runs match):

* "tiny-gpt2": ``GPT2Config`` (defaults n_layer=2, n_head=4, n_embd=64).
* "tiny-llama": ``LlamaConfig`` (defaults 2 layers, hidden 64, 4 heads, 2 kv heads).

Any other name must be an existing folder holding a Hugging Face causal-LM checkpoint.
Pickled weights (``pytorch_model.bin``, ``.pt``) are only ever loaded with torch's
``weights_only`` unpickler; a file it refuses (one that would run code when unpickled) is
reported in one line naming the file, never loaded, and a folder with its own code (an
``auto_map``) is refused, never run (:mod:`emdlm.weights`).
Vision-language models (named tiny VLMs and image-text-to-text folders) are built by
:mod:`emdlm.vlm.models`; :mod:`emdlm.training.train` picks that path with ``is_vlm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import torch

from emdlm.config import ConfigError, ModelConfig, did_you_mean

# PICKLE_SUFFIXES, output_embedding_from_folder, refused_pickle_message, weights_only_refusal:
# also importable from here, their home before emdlm.weights
from emdlm.weights import (
    PICKLE_SUFFIXES,  # noqa: F401
    model_load_error,
    output_embedding_from_folder,  # noqa: F401
    refuse_folder_code,
    refused_pickle_message,  # noqa: F401
    weights_only_refusal,  # noqa: F401
)

NAMED_MODELS = ("tiny-gpt2", "tiny-llama")
#: Named tiny vision-language models (built by :mod:`emdlm.vlm.models`, which is above this one).
VLM_NAMES = ("tiny-qwen2-vl", "tiny-llava")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype named by ``model.dtype`` ("float32" | "bfloat16" | "float16");
    ConfigError naming the choices for anything else. Shared by the text and VLM builders."""
    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {cfg.dtype!r}")
    return _DTYPES[cfg.dtype]


def load_tokenizer(name_or_path: str) -> Any:
    """A local tokenizer folder (``AutoTokenizer``), or a named offline one via
    :func:`emdlm.tokenizers.load_tokenizer` ("gpt2", "qwen", "llama3-like", "char").
    A pad token is set to eos when the tokenizer has none."""
    path = Path(name_or_path)
    if path.is_dir():
        from transformers import AutoTokenizer

        refuse_folder_code(path)  # before transformers, which would prompt to run it
        try:
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except Exception as err:  # transformers raises many types here; name the folder
            raise ConfigError(f"could not load a tokenizer from folder {path}: {err}") from err
    else:
        if _looks_like_path(name_or_path):
            raise ConfigError(f"tokenizer folder not found: {name_or_path}")
        try:
            from emdlm.tokenizers import load_tokenizer as load_named
        except ImportError as err:  # pragma: no cover - the module ships with emdlm
            raise ConfigError(f"named tokenizers need emdlm.tokenizers: {err}") from err
        try:
            tok = load_named(name_or_path)
        except (ValueError, KeyError, FileNotFoundError, OSError) as err:
            raise ConfigError(f"tokenizer {name_or_path!r}: {err}") from err
    if getattr(tok, "pad_token_id", None) is None:
        if getattr(tok, "eos_token", None) is None:
            raise ConfigError(f"tokenizer {name_or_path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if getattr(tok, "eos_token_id", None) is None:
        raise ConfigError(f"tokenizer {name_or_path!r} has no eos token (needed after completions)")
    return tok


def _tiny_config(name: str, vocab_size: int, params: dict[str, Any], tokenizer: Any) -> Any:
    ids = {
        "bos_token_id": getattr(tokenizer, "bos_token_id", None) or tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if name == "tiny-gpt2":
        from transformers import GPT2Config

        base = dict(
            n_layer=2, n_head=4, n_embd=64, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cls = GPT2Config
    else:
        from transformers import LlamaConfig

        base = dict(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0,
            tie_word_embeddings=True,
        )
        cls = LlamaConfig
    merged = {**base, **ids, **params, "vocab_size": vocab_size}
    try:
        return cls(**merged)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model {name} with params {params}: {err}") from err


def build_model(cfg: ModelConfig, tokenizer: Any, *, max_length: int | None = None) -> Any:
    """The causal LM described by ``cfg`` (its vocab is checked against ``tokenizer``)."""
    from transformers import AutoModelForCausalLM

    dtype = model_dtype(cfg)
    if cfg.name in NAMED_MODELS:
        params = dict(cfg.params)
        if max_length is not None:
            key = "n_positions" if cfg.name == "tiny-gpt2" else "max_position_embeddings"
            params.setdefault(key, max(max_length, 8))
        config = _tiny_config(cfg.name, len(tokenizer), params, tokenizer)
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    else:
        path = Path(cfg.name)
        if not path.is_dir():
            _missing_model(cfg.name)
        if not (path / "config.json").exists():
            raise ConfigError(f"model folder {path} has no config.json")
        if cfg.params:
            raise ConfigError("model.params only apply to named architectures, not to folders")
        refuse_folder_code(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype, trust_remote_code=False)
        except Exception as err:  # name the folder whatever transformers raised
            raise model_load_error(f"could not load a causal LM from {path}", path, err) from err
    check_vocab(model, tokenizer)
    return model


def _looks_like_path(name: str) -> bool:
    return any(sep in name for sep in ("/", "\\")) or name.startswith((".", "~"))


def _missing_model(name: str) -> NoReturn:
    """ConfigError for a model name that is neither a named architecture nor a folder: a
    path-like name is a missing folder, any other a possibly misspelt architecture."""
    if _looks_like_path(name):
        if Path(name).expanduser().is_file():
            raise ConfigError(f"model.name {name} is a file, not a checkpoint folder")
        raise ConfigError(f"model folder not found: {name} (model.name)")
    names = (*NAMED_MODELS, *VLM_NAMES)
    raise ConfigError(
        f"model {name!r} is neither a named architecture{did_you_mean(name, names)} "
        f"({', '.join(names)}) nor an existing checkpoint folder"
    )


def model_vocab_size(model: Any) -> int:
    """Rows of the output layer (the logits' last dimension)."""
    out = model.get_output_embeddings()
    if out is not None and hasattr(out, "weight"):
        return int(out.weight.shape[0])
    return int(model.config.vocab_size)


def check_vocab(model: Any, tokenizer: Any) -> None:
    """ConfigError when the tokenizer can emit ids the model has no embedding row for."""
    rows = int(model.get_input_embeddings().weight.shape[0])
    n_tok = len(tokenizer)
    if n_tok > rows or n_tok > model_vocab_size(model):
        raise ConfigError(
            f"tokenizer/model vocab mismatch: the tokenizer has {n_tok} tokens but the model's "
            f"embedding has {rows} rows and its output layer {model_vocab_size(model)}"
        )


def apply_lora(model: Any, *, r: int, alpha: int, dropout: float, target_modules: Any) -> Any:
    """Wrap ``model`` with a peft LoRA adapter (only the adapter is trained)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    kwargs: dict[str, Any] = dict(
        r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM"
    )
    if target_modules is not None:  # a str is a regex over full module names (peft)
        kwargs["target_modules"] = (
            target_modules if isinstance(target_modules, str) else list(target_modules)
        )
    try:
        return get_peft_model(model, PeftLoraConfig(**kwargs))
    except ValueError as err:
        raise ConfigError(f"LoRA: {err}") from err
