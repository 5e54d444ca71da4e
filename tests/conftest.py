"""Shared session fixtures: the real tokenizers and their NumberVocabs (built once per session).

The expensive tokenizers ("qwen", "llama3-like") are cached on disk under ``$EMDLM_CACHE``
(default ``~/.cache/emdlm``), so only the first test session pays for building them (~15 s).

Fixtures:
    gpt2_tokenizer, qwen_tokenizer, llama3_tokenizer, char_tokenizer
    gpt2_vocab, qwen_vocab (151936 rows, as Qwen2.5's logits), llama3_vocab, char_vocab
    real_tokenizer: parametrized over REAL_TOKENIZERS, yields (name, tokenizer, vocab)

Every test starts from the same torch RNG state (an autouse fixture), so a test that draws
random inputs without its own generator gives the same inputs on every run: CI cannot flake.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from emdlm.numbers import NumberVocab
from emdlm.tokenizers import load_tokenizer

REAL_TOKENIZERS = ("gpt2", "qwen", "llama3-like")
QWEN25_LOGIT_ROWS = 151936


@pytest.fixture(autouse=True)
def _fixed_torch_seed() -> None:
    import torch

    torch.manual_seed(20261123)


@pytest.fixture(scope="session")
def gpt2_tokenizer() -> Any:
    return load_tokenizer("gpt2")


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    return load_tokenizer("qwen")


@pytest.fixture(scope="session")
def llama3_tokenizer() -> Any:
    return load_tokenizer("llama3-like")


@pytest.fixture(scope="session")
def char_tokenizer() -> Any:
    return load_tokenizer("char")


@pytest.fixture(scope="session")
def gpt2_vocab(gpt2_tokenizer: Any) -> NumberVocab:
    return NumberVocab.from_tokenizer(gpt2_tokenizer)


@pytest.fixture(scope="session")
def qwen_vocab(qwen_tokenizer: Any) -> NumberVocab:
    return NumberVocab.from_tokenizer(qwen_tokenizer, vocab_size=QWEN25_LOGIT_ROWS)


@pytest.fixture(scope="session")
def llama3_vocab(llama3_tokenizer: Any) -> NumberVocab:
    return NumberVocab.from_tokenizer(llama3_tokenizer)


@pytest.fixture(scope="session")
def char_vocab(char_tokenizer: Any) -> NumberVocab:
    return NumberVocab.from_tokenizer(char_tokenizer)


_FIXTURE_PREFIX = {"gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}


@pytest.fixture(scope="session", params=REAL_TOKENIZERS)
def real_tokenizer(request: pytest.FixtureRequest) -> tuple[str, Any, NumberVocab]:
    """(name, tokenizer, NumberVocab) for each real tokenizer in turn."""
    prefix = _FIXTURE_PREFIX[request.param]
    return (
        request.param,
        request.getfixturevalue(f"{prefix}_tokenizer"),
        request.getfixturevalue(f"{prefix}_vocab"),
    )


#: tests that take minutes: collected first, so that under ``pytest -n 2`` one worker starts
#: them at once instead of finishing the suite with them
LONGEST_FIRST = ("test_wheel_install.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of :data:`LONGEST_FIRST` go first. ``cuda`` tests run on
    ``EMDLM_TEST_DEVICE`` when set (tests/test_cuda.py's ``device`` fixture); a forced device
    that this machine lacks skips them with the reason, instead of failing every test on the
    first tensor moved there."""
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: order kept
    forced = os.environ.get("EMDLM_TEST_DEVICE")
    if not forced:
        return
    import torch

    try:
        kind = torch.device(forced).type
    except RuntimeError as err:
        raise pytest.UsageError(f"EMDLM_TEST_DEVICE={forced!r}: {err}") from err
    backend = getattr(torch, kind, None)  # torch.cuda, torch.xpu, torch.mps
    if kind == "cpu" or bool(getattr(backend, "is_available", lambda: False)()):
        return
    skip = pytest.mark.skip(reason=f"EMDLM_TEST_DEVICE={forced} but no such device here")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
