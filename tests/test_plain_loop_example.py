"""The plain-PyTorch example trains: a few steps with an emdlm loss lower the loss."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from emdlm._output import LossOutput
from emdlm.losses.ce import CrossEntropyLoss

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_pytorch_loop.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plain_pytorch_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_batches_score_only_the_answer(example: ModuleType) -> None:
    ids, labels = example.make_batch(random.Random(0), 4)
    assert ids.shape == labels.shape
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist(), strict=True):
        eq = row_ids.index(example.STOI["="])
        assert all(v == -100 for v in row_labels[: eq + 1])  # the prompt "a+b=" is not scored
        scored = [v for v in row_labels if v != -100]
        assert scored[-1] == example.EOS and len(scored) >= 2


def test_loss_goes_down_with_ce(example: ModuleType) -> None:
    history = example.train(CrossEntropyLoss(), steps=20, batch_size=16, seed=0)
    assert len(history) == 20
    assert all(torch.isfinite(torch.tensor(history)))
    assert statistics.fmean(history[-5:]) < 0.8 * history[0]


class _SumThenMeanCE(torch.nn.Module):
    """A stand-in for any emdlm loss: the interface is all the loop relies on."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = CrossEntropyLoss(reduction="sum")

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        out = self.inner(logits, labels)
        return LossOutput(out.loss / out.components["n_tokens"], {"custom": out.loss.detach()})


def test_any_emdlm_style_loss_drops_in(example: ModuleType) -> None:
    reference = example.train(CrossEntropyLoss(), steps=3, seed=1)
    custom = example.train(_SumThenMeanCE(), steps=3, seed=1)
    assert custom == pytest.approx(reference, rel=1e-5)


def test_main_runs(example: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    example.main(["--steps", "2", "--batch-size", "4"])
    assert "first loss" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["ntil", "digit-emd"])
def test_number_losses_drop_in_and_train(example: ModuleType, name: str) -> None:
    pytest.importorskip("emdlm.losses.ntil")
    loss_fn = example.build_loss(name)
    history = example.train(loss_fn, steps=12, batch_size=16, seed=0)
    assert all(torch.isfinite(torch.tensor(history)))
    assert statistics.fmean(history[-4:]) < 0.85 * history[0]
    logits = torch.randn(2, 5, example.VOCAB_SIZE)
    labels = torch.tensor([[2, 3, 4, example.EOS, -100]] * 2)  # the number "012"
    out = loss_fn(logits, labels)
    assert float(out.components["n_numbers"]) == 2.0  # the loss sees the digits


def test_unknown_loss_name(example: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown loss 'mse'"):
        example.build_loss("mse")
