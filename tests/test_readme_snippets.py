"""The README's Trainer and TRL snippets, executed as written (tiny model and data defined here
under the names the snippets use), so the documentation cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import emdlm
from emdlm.config import ModelConfig
from emdlm.data import DataCollator, build_dataset
from emdlm.models import build_model
from emdlm.tasks import generate_task
from emdlm.tokenizers import load_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(marker: str) -> str:
    """The one ```python block of the README that contains ``marker``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if marker in b]  # fmt: skip
    assert len(blocks) == 1, f"{len(blocks)} README python blocks contain {marker!r}"
    return blocks[0]


@pytest.mark.slow
def test_readme_trainer_snippet_logs_components(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet writes to "out"
    tok = load_tokenizer("char")
    torch.manual_seed(0)
    model = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)
    ds = build_dataset(generate_task("arithmetic", n=16, seed=0, max_digits=2), tok, max_length=32)
    namespace = {"emdlm": emdlm, "tok": tok, "model": model, "ds": ds,
                 "collate": DataCollator(tok.pad_token_id)}  # fmt: skip
    exec(python_block("LossComponentsCallback(compute_loss)"), namespace)
    history = [h for h in namespace["trainer"].state.log_history if "loss" in h]
    assert history, "the snippet logged nothing"
    for record in history:
        for key in ("emdlm/ce", "emdlm/ntil", "emdlm/mix_coef", "emdlm/loss"):
            assert key in record, (key, record)
        assert record["emdlm/loss"] == pytest.approx(record["loss"], rel=1e-5)


@pytest.mark.slow
def test_readme_trl_snippet_trains_in_fp32(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tests.test_trl_integration import addition_dataset, char_tokenizer, tiny_gpt2

    monkeypatch.chdir(tmp_path)
    hf_tok = char_tokenizer()
    namespace = {"emdlm": emdlm, "hf_tok": hf_tok, "model": tiny_gpt2(len(hf_tok)),
                 "sft_ds": addition_dataset(16)}  # fmt: skip
    assert isinstance(namespace["sft_ds"], datasets.Dataset)
    exec(python_block("EMDLMSFTTrainer("), namespace)
    trainer = namespace["trainer"]
    assert trainer.args.bf16 is False and trainer.state.global_step == 2
    assert any("emdlm/ntil" in h for h in trainer.state.log_history)
