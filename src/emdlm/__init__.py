"""emdlm: Earth Mover's Distance objectives for autoregressive language models.

Public names are imported lazily so ``import emdlm`` stays cheap (no transformers import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LossOutput": "emdlm._output",
    "NumberVocab": "emdlm.numbers",
    "NTILLoss": "emdlm.losses.ntil",
    "DigitEMDLoss": "emdlm.losses.ntil",
    "CrossEntropyLoss": "emdlm.losses.ce",
    "EMOLoss": "emdlm.losses.emo",
    "TaiLrLoss": "emdlm.losses.tailr",
    "MixCELoss": "emdlm.losses.mixce",
    "DFTLoss": "emdlm.losses.dft",
    "NTLMSELoss": "emdlm.losses.ntl",
    "NTLWASLoss": "emdlm.losses.ntl",
    "NumberLevelLoss": "emdlm.losses.ntl",
    "EMODistillLoss": "emdlm.losses.emo_distill",
    "KLDistillLoss": "emdlm.losses.emo_distill",
    "cost_embedding_from": "emdlm.losses.emo",
    "find_number_spans": "emdlm.number_spans",
    "SpanOptions": "emdlm.number_spans",
    "load_tokenizer": "emdlm.tokenizers",
    "lowrank_cost_embedding": "emdlm.ops.lowrank",
    "compute_task_metrics": "emdlm.metrics",
    "evaluate_examples": "emdlm.evaluation",
    "patch": "emdlm.integrations.patch",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'emdlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
