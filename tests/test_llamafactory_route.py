"""LLaMA-Factory's route (``emdlm.integrations.llamafactory``) without LLaMA-Factory: the config
check, ``run`` handing LLaMA-Factory's ``run_exp`` the config without the ``emdlm:`` section
(a stand-in ``llamafactory.train.tuner`` module records the call), and ``EMDLMCallback`` in a
real ``transformers.Trainer`` run, whose logged loss is emdlm's. ``make integrations`` runs a
real LLaMA-Factory training with it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from emdlm.config import ConfigError
from emdlm.integrations import llamafactory as route
from emdlm.integrations.framework_objective import parse_settings
from emdlm.tokenizers import load_tokenizer

EMDLM = {"objective": {"name": "ntil", "params": {"preset": "stable"}}}


@pytest.mark.parametrize(("cfg", "message"), [
    ({"emdlm": EMDLM, "enable_liger_kernel": True}, "enable_liger_kernel: false"),
    ({"emdlm": EMDLM, "use_dft_loss": True}, "use_dft_loss"),
    ({"emdlm": EMDLM, "use_asft_loss": True, "use_eaft_loss": True},
     "use_asft_loss: false and use_eaft_loss: false"),
    ({"emdlm": EMDLM, "stage": "dpo"}, "stage 'dpo'"),
    ({"emdlm": {**EMDLM, "number_scope": "regex:\\d+"}}, "number_mask"),
    ({"emdlm": {"objective": {"name": "ntil", "params": {"alpha2": 1}}}}, "takes no"),
])  # fmt: skip
def test_conflicts_and_bad_settings_are_refused(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        route.check_config(cfg)


def test_run_hands_llamafactory_the_config_without_the_emdlm_section(monkeypatch) -> None:
    calls = []
    tuner = types.ModuleType("llamafactory.train.tuner")
    tuner.run_exp = lambda args, callbacks: calls.append((args, callbacks))
    for name in ("llamafactory", "llamafactory.train"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "llamafactory.train.tuner", tuner)
    route.run({"emdlm": EMDLM, "stage": "sft", "model_name_or_path": "m", "use_dft_loss": False})
    ((args, callbacks),) = calls
    assert args == {"stage": "sft", "model_name_or_path": "m", "use_dft_loss": False}
    (callback,) = callbacks
    assert isinstance(callback, route.EMDLMCallback)
    assert callback.settings.objective.name == "ntil"


def test_the_callback_makes_emdlms_loss_the_optimised_one(tmp_path) -> None:
    tok = load_tokenizer("char")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ))  # fmt: skip
    rows = [tok(f"{a}+{b}={a + b}")["input_ids"] for a in range(8) for b in range(4)]
    # the first label unscored, as in SFT rows (the Trainer counts every label != -100 in
    # num_items_in_batch, also a row's first, which no position predicts)
    data = Dataset.from_list([{"input_ids": r, "labels": [-100, *r[1:]]}
                              for r in rows if len(r) == 5])  # fmt: skip
    callback = route.EMDLMCallback(parse_settings(EMDLM, "emdlm"))
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=2,
                             per_device_train_batch_size=4, logging_steps=1, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
                      callbacks=[callback])  # fmt: skip
    trainer.train()
    records = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert len(records) == 2
    for h in records:
        assert {"emdlm/ce", "emdlm/ntil", "emdlm/loss"} <= set(h)
        assert h["loss"] == pytest.approx(h["emdlm/loss"], rel=1e-5)  # emdlm's value, optimised
        assert h["loss"] != pytest.approx(h["emdlm/ce"], rel=1e-4)  # not the plain CE
    assert callback.handle is not None and callback.handle.model is model


def test_load_config_reads_yaml_and_refuses_a_missing_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("stage: sft\nemdlm:\n  objective: {name: ce}\n")
    assert route.load_config(path) == {"stage": "sft", "emdlm": {"objective": {"name": "ce"}}}
    with pytest.raises(ConfigError, match="not found"):
        route.load_config(tmp_path / "none.yaml")
    with pytest.raises(SystemExit, match="usage"):
        route.main([])
