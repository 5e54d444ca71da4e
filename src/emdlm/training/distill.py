"""Distillation as its own piece of the ``emdlm train`` recipe: the teacher (``teacher:`` in
the config), loaded and checked against the student before training. Its logits reach the loss
through :func:`emdlm.integrations.transformers.emdlm_trainer` (``teacher=``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError, ModelConfig
from emdlm.models import build_model, load_tokenizer, model_vocab_size


def load_teacher(path: str, tokenizer: Any, vocab_size: int, dtype: str) -> Any:
    """The distillation teacher: a local causal-LM folder, frozen (eval mode, no gradients), in
    the student's dtype (it follows the student's device at the first batch).

    ConfigError when the folder is missing, its output layer has not ``vocab_size`` rows (the
    student's), or it ships a tokenizer whose vocabulary differs from the student's (the
    teacher's distribution must be over the same tokens, in the same order)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"teacher folder not found: {path} (teacher)")
    try:
        teacher = build_model(ModelConfig(name=str(folder), dtype=dtype), tokenizer)
    except ConfigError as err:
        raise ConfigError(f"teacher {path}: {err}") from err
    rows = model_vocab_size(teacher)
    if rows != vocab_size:
        raise ConfigError(
            f"teacher {path} has {rows} output rows but the student has {vocab_size}: teacher "
            "and student must share the vocabulary"
        )
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        teacher_vocab = load_tokenizer(str(folder)).get_vocab()
        if teacher_vocab != tokenizer.get_vocab():
            differ = sorted(set(teacher_vocab.items()) ^ set(tokenizer.get_vocab().items()))
            raise ConfigError(
                f"teacher {path} has a different tokenizer than the student "
                f"({len(teacher_vocab)} vs {len(tokenizer.get_vocab())} tokens; e.g. "
                f"{differ[:3]} differ): distillation needs the same token ids"
            )
    else:
        print(f"warning: teacher {path} has no tokenizer files; only its vocabulary size was "
              "checked against the student's", file=sys.stderr)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher
