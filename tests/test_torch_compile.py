"""Training through ``torch.compile(model)`` gives the eager losses and weights.

CE and NTIL on the logits path: a compiled tiny Llama and an eager copy take the same 2 SGD steps.
The loss runs eagerly outside the compiled module (as ``transformers.Trainer`` with
``torch_compile=True`` does), so the objective is not what is compiled here. Every registered
objective's loss compiled together with the head (logits path and from hidden states; the
chunked kernels as graph breaks) equals eager in tests/test_conformance.py. The full sweep
(every objective, both paths, graph breaks) is ``benchmarks/compile_check.py``; findings in
``docs/results/torch_compile_cpu.md``.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable

import pytest
import torch
from torch import nn

from _compile_marks import needs_dynamo
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.ntil import NTILLoss
from emdlm.numbers import NumberVocab

TOKENS = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)] + ["a", "b", ".", "=", "x"]
V = len(TOKENS) + 3


pytestmark = [needs_dynamo, pytest.mark.slow]
# inductor compiles CPU kernels with a C++ compiler; the "eager" backend needs none
needs_inductor = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler for torch.compile's inductor backend",
)


def tiny_model() -> nn.Module:
    """A 1-layer Llama (hidden 32, untied head), eval mode (no dropout), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module, nn.Module]:
    """(eager model, model to compile, its compiled wrapper): compiled once for the module;
    each test resets both models' weights in place, which needs no recompilation."""
    eager = tiny_model()
    model = copy.deepcopy(eager)
    return eager, model, torch.compile(model)


def batches() -> list[torch.Tensor]:
    """Two [2, 12] batches, about half digit tokens (numbers for NTIL)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        digits = torch.randint(0, 20, (2, 12), generator=gen)
        other = torch.randint(20, len(TOKENS), (2, 12), generator=gen)
        out.append(torch.where(torch.rand(2, 12, generator=gen) < 0.5, digits, other))
    return out


def train(runner: nn.Module, params: nn.Module, loss_fn: nn.Module) -> list[float]:
    """Two SGD steps of ``loss_fn(runner(ids).logits[:, :-1], ids[:, 1:])``; the losses."""
    opt = torch.optim.SGD(params.parameters(), lr=0.5)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(runner(input_ids=ids).logits[:, :-1], ids[:, 1:]).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


LOSSES: dict[str, Callable[[], nn.Module]] = {
    "ce": CrossEntropyLoss,
    # argmax values: deterministic, so eager and compiled runs score the same predictions
    "ntil": lambda: NTILLoss(NumberVocab.from_token_strings(TOKENS, V), value_mode="argmax"),
}


@needs_inductor
@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_model_trains_like_eager(
    name: str, models: tuple[nn.Module, nn.Module, nn.Module]
) -> None:
    eager, model, compiled = models
    start = tiny_model().state_dict()
    with torch.no_grad():  # in place: the compiled graph keeps its parameters
        eager.load_state_dict(start)
        model.load_state_dict(start)
    eager_losses = train(eager, eager, LOSSES[name]())
    compiled_losses = train(compiled, model, LOSSES[name]())
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-5)
    moved = 0.0
    for (key, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        moved = max(moved, float((p - start[key]).abs().max()))
    assert moved > 1e-3  # the comparison is not between two untouched models
