"""Resuming a model with a tied LM head: transformers' "missing keys" warning names only keys
that are really missing, not the head that shares its tensor with the input embedding."""

from __future__ import annotations

import pytest
from torch.nn.modules.module import _IncompatibleKeys
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from emdlm.training.checkpoints import tied_missing_keys
from emdlm.training.saving import atomic_checkpoint_trainer


def _tiny_gpt2(tied: bool) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                        tie_word_embeddings=tied)
    return GPT2LMHeadModel(config)


def test_tied_head_is_not_missing():
    model = _tiny_gpt2(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert tied_missing_keys(model, ["lm_head.weight"]) == {"lm_head.weight"}
    # both names missing: the tensor was not loaded under either, so both stay missing
    assert tied_missing_keys(model, ["lm_head.weight", "transformer.wte.weight"]) == set()


def test_untied_head_stays_missing():
    model = _tiny_gpt2(tied=False)
    assert tied_missing_keys(model, ["lm_head.weight"]) == set()


@pytest.mark.parametrize(("tied", "missing", "warned"), [
    (True, ["lm_head.weight"], None),
    (True, ["lm_head.weight", "transformer.h.0.attn.c_attn.weight"],
     ["transformer.h.0.attn.c_attn.weight"]),
    (False, ["lm_head.weight"], ["lm_head.weight"]),
])
def test_resume_warning_names_only_really_missing_keys(tmp_path, monkeypatch, tied, missing,
                                                        warned):
    import transformers.trainer as trainer_module

    messages: list[str] = []
    monkeypatch.setattr(trainer_module.logger, "warning", lambda msg, *a, **k: messages.append(msg))
    trainer_cls = atomic_checkpoint_trainer(Trainer)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = trainer_cls(model=_tiny_gpt2(tied), args=args)
    trainer._issue_warnings_after_load(_IncompatibleKeys(missing, []))
    missing_messages = [m for m in messages if "missing keys" in m]
    if warned is None:
        assert missing_messages == []
    else:
        expected = f"There were missing keys in the checkpoint model loaded: {warned}."
        assert missing_messages == [expected]
