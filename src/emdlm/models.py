"""Tokenizer and model construction: local Hugging Face folders or named tiny architectures.

Named architectures are randomly initialised from a config whose vocab size is the tokenizer's
length (dropout 0 by default so runs are deterministic and multi-process runs match):

* "tiny-gpt2": ``GPT2Config`` (defaults n_layer=2, n_head=4, n_embd=64).
* "tiny-llama": ``LlamaConfig`` (defaults 2 layers, hidden 64, 4 heads, 2 kv heads).

Any other name must be an existing folder holding a Hugging Face causal-LM checkpoint.
Pickled weights (``pytorch_model.bin``, ``.pt``) are only ever loaded with torch's
``weights_only`` unpickler; a file it refuses (one that would run code when unpickled) is
reported in one line naming the file (:func:`weights_only_refusal`), never loaded.
Vision-language models (named tiny VLMs and image-text-to-text folders) are built by
:mod:`emdlm.vlm.models`; :mod:`emdlm.training.train` picks that path with ``is_vlm``.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, NoReturn

import torch

from emdlm.config import ConfigError, ModelConfig, did_you_mean

NAMED_MODELS = ("tiny-gpt2", "tiny-llama")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # weights stored with torch.save (a pickle)
# the line of torch's weights_only message that says what was refused, e.g. "Trying to load
# unsupported GLOBAL posix.system whose module posix is blocked." (torch 2.13) or
# "Unsupported global: GLOBAL posix.system was not an allowed global by default" (older)
_REFUSAL_LINE = re.compile(r"GLOBAL|[Uu]nsupported|not an allowed|blocked|WeightsUnpickler")


def _unpickling_errors(err: BaseException) -> list[pickle.UnpicklingError]:
    """The ``UnpicklingError`` s in ``err`` and the exceptions it came from, outermost first."""
    found: list[pickle.UnpicklingError] = []
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        seen.append(current)
        if isinstance(current, pickle.UnpicklingError):
            found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _refusal_detail(errors: list[pickle.UnpicklingError]) -> str:
    """What torch's unpickler refused, in a few words, from its (many-line) messages."""
    lines = [" ".join(line.split()) for e in reversed(errors) for line in str(e).splitlines()]
    lines = [line for line in lines if line]
    detail = next((line for line in lines if _REFUSAL_LINE.search(line)), lines[0] if lines
                  else "")
    detail = detail.removeprefix("WeightsUnpickler error:").strip()
    return detail if len(detail) <= 200 else detail[:197] + "..."


def _refused_file(source: Path) -> Path:
    """The pickled weights file in ``source`` (a file, or a folder) that weights_only refuses:
    the only pickled file there, else the first one whose weights_only load fails (torch
    never runs code under weights_only), else the folder itself."""
    if not source.is_dir():
        return source
    files = sorted(p for p in source.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file()
                   and p.name != "training_args.bin")
    if len(files) == 1:
        return files[0]
    for file in files:
        try:
            torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            return file
        except Exception:  # another problem with this file: not the one refused
            continue
    return source


def refused_pickle_message(file: Path, detail: str) -> str:
    """The one line emdlm prints for a weights file torch's weights_only unpickler refuses."""
    why = f": {detail.rstrip('.')}" if detail else ""
    return (
        f"refused to unpickle {file}: it is not a plain tensor file (torch.load weights_only"
        f"{why}); loading it could run code, so emdlm does not: use weights you trust, saved "
        "as safetensors"
    )


def weights_only_refusal(err: BaseException, source: Path) -> str | None:
    """One line naming the file when ``err`` (from loading ``source``: a weights file or a
    model folder) is torch's ``weights_only`` refusal to unpickle it, else None.

    transformers and ``torch.load(weights_only=True)`` raise it as an UnpicklingError of ~100
    lines that names no file; the refused file is found here without ever unpickling it
    unsafely."""
    errors = _unpickling_errors(err)
    if not errors:
        return None
    return refused_pickle_message(_refused_file(source), _refusal_detail(errors))


def model_load_error(prefix: str, source: Path, err: BaseException) -> ConfigError:
    """ConfigError for a model that failed to load from ``source``: the weights_only refusal
    line, or ``prefix: <err>`` on one line (transformers' messages run over several)."""
    refusal = weights_only_refusal(err, source)
    return ConfigError(refusal or f"{prefix}: {' '.join(str(err).split())}")


def load_tokenizer(name_or_path: str) -> Any:
    """A local tokenizer folder (``AutoTokenizer``), or a named offline one via
    :func:`emdlm.tokenizers.load_tokenizer` ("gpt2", "qwen", "llama3-like", "char").
    A pad token is set to eos when the tokenizer has none."""
    path = Path(name_or_path)
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path))
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

    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {cfg.dtype!r}")
    dtype = _DTYPES[cfg.dtype]
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
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
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
    from emdlm.vlm.models import VLM_NAMES

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


def output_embedding_from_folder(folder: Path) -> torch.Tensor:
    """The output embedding (LM head weight) [V, d] of the causal LM saved in ``folder``.

    Read from the folder's safetensors files alone when they hold it (a skeleton of the model on
    the meta device names the head's parameter, tied or not; ``model.safetensors`` or the shards
    of ``model.safetensors.index.json``): no model is built, so an 8B checkpoint costs its
    ~1 GB head, not 16 GB. Otherwise (``.bin`` weights, renamed keys) the model is loaded.
    No remote code either way.

    Raises:
        ConfigError: ``folder`` is not a causal-LM folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder}: not a causal-LM folder ({err})") from err
    head = getattr(skeleton.get_output_embeddings(), "weight", None)
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is head]
    weight = _safetensors_tensor(folder, names)
    if head is not None and weight is not None and weight.shape == head.shape:
        return weight
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        refusal = weights_only_refusal(err, folder)
        raise ConfigError(refusal or f"{folder}: not a causal-LM folder ({err})") from err
    return model.get_output_embeddings().weight.detach()


def _safetensors_tensor(folder: Path, names: list[str]) -> torch.Tensor | None:
    """The first of ``names`` stored in the folder's safetensors weights (None if none is)."""
    import json

    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = {name: folder / weight_map[name] for name in names if name in weight_map}
    elif (folder / "model.safetensors").is_file():
        files = dict.fromkeys(names, folder / "model.safetensors")
    else:
        return None
    for name, file in files.items():
        with safe_open(str(file), framework="pt") as fh:
            if name in fh.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return fh.get_tensor(name)
    return None


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
