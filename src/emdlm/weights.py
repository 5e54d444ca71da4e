"""Reading model weights files safely: a pickle is never unpickled with code, and a folder's
own code is never run.

Pickled weights (``pytorch_model.bin``, ``.pt``) are only ever loaded with torch's
``weights_only`` unpickler; a file it refuses (one that would run code when unpickled) is
reported in one line naming the file (:func:`weights_only_refusal`), never loaded. The output
embedding of a checkpoint folder is read from its safetensors without building the model where
possible (:func:`output_embedding_from_folder`). Used to build models (:mod:`emdlm.models`), cost
embeddings (:mod:`emdlm.objectives`) and to check run folders (:mod:`emdlm.training.run_folder`).

A model, tokenizer or processor folder whose configuration maps a class to a Python file of its
own (an ``auto_map`` entry: transformers' "custom code",
https://huggingface.co/docs/transformers/custom_models) is refused in one line naming the file
(:func:`refuse_folder_code`) before transformers sees it, and every ``from_pretrained`` passes
``trust_remote_code=False``: transformers would otherwise ask "[y/N]" on stdin, and a ``y``
piped in would run the folder's code.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch

from emdlm.config import ConfigError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # weights stored with torch.save (a pickle)
# the line of torch's weights_only message that says what was refused, e.g. "Trying to load
# unsupported GLOBAL posix.system whose module posix is blocked." (torch 2.13) or
# "Unsupported global: GLOBAL posix.system was not an allowed global by default" (older)
_REFUSAL_LINE = re.compile(r"GLOBAL|[Uu]nsupported|not an allowed|blocked|WeightsUnpickler")


def _auto_map_of(file: Path) -> dict[str, object] | None:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable or not JSON: transformers reports it
        return None
    auto_map = data.get("auto_map") if isinstance(data, dict) else None
    return auto_map if isinstance(auto_map, dict) and auto_map else None


def refuse_folder_code(folder: str | Path) -> None:
    """ConfigError naming the file when a configuration file of ``folder`` (``config.json``,
    ``tokenizer_config.json``, ``preprocessor_config.json``, ``processor_config.json``: every
    ``*config.json`` there) has an ``auto_map``, the entry through which transformers loads
    classes from Python files in the folder. Reads only; a folder without one passes. Call it
    before any ``from_pretrained`` of a folder a user names (model, tokenizer, oracle, cost
    embedding, VLM), so that no prompt appears and no code runs."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for file in sorted(folder.glob("*config.json")):
        auto_map = _auto_map_of(file)
        if auto_map is None:
            continue
        named = sorted({str(v) for value in auto_map.values()
                        for v in (value if isinstance(value, list) else [value]) if v})
        raise ConfigError(
            f"{file} has an auto_map ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''})"
            f": the folder's own Python code, which emdlm never runs (trust_remote_code is off);"
            " use a folder of classes transformers ships, or remove the auto_map entry if the "
            "classes it names are transformers' own"
        )


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

    refuse_folder_code(folder)
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
