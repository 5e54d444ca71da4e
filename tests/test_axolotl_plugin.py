"""The Axolotl plugin's hooks (``emdlm.integrations.axolotl``), without Axolotl: a plain dict as
its config and a real ``transformers.Trainer`` as the trainer it builds. The same hooks against
the real Axolotl are run by ``make integrations`` (docs/results/integrations.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import emdlm
from emdlm.config import ConfigError
from emdlm.integrations import axolotl as plugin_module
from emdlm.integrations.framework_objective import (
    NumberMaskCollator,
    number_mask_of,
    parse_settings,
    token_texts,
)
from emdlm.integrations.transformers import LossComponentsCallback, make_compute_loss_func
from emdlm.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("char")


def _model(tok: Any) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).eval()  # fmt: skip (eval: no dropout, so two forwards agree)


def _batch(tok: Any) -> dict[str, torch.Tensor]:
    ids = torch.tensor([tok("12+34=46")["input_ids"], tok("7+15=22")["input_ids"] + [0]])
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, -1] = -100
    return {"input_ids": ids, "attention_mask": (labels != -100) | (ids != 0), "labels": labels}


def _trainer(tok: Any, tmp_path: Any) -> Trainer:
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    return Trainer(model=_model(tok), args=args, processing_class=tok)


CFG = {"emdlm": {"objective": {"name": "ntil", "params": {"preset": "stable"}}}}


def test_the_plugin_class_imports_without_axolotl() -> None:
    cls = plugin_module.EMDLMPlugin
    assert issubclass(cls, plugin_module.EMDLMPluginMixin)
    assert cls().get_input_args() == "emdlm.integrations.axolotl.EMDLMArgs"
    pytest.importorskip("pydantic")  # Axolotl's schema library (here through typer)
    assert plugin_module.EMDLMArgs(**CFG).emdlm == CFG["emdlm"]  # what Axolotl imports by name


@pytest.mark.parametrize(("cfg", "message"), [
    ({**CFG, "liger_fused_linear_cross_entropy": True}, "liger_fused_linear_cross_entropy"),
    ({**CFG, "cut_cross_entropy": True}, "cut_cross_entropy: false"),
    ({**CFG, "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]},
     "replace.*forward"),
    ({"emdlm": {"objective": {"name": "ntill"}}}, "did you mean 'ntil'"),
    ({"emdlm": {"objective": {"name": "ntil", "params": {"lamda": 1}}}}, "takes no"),
    ({"emdlm": {"objective": {"name": "kl_distill"}}}, "distils from a teacher"),
    ({"emdlm": {"number_scope": "numbers"}}, "number_scope"),
    ({"emdlm": {"objective": "ntil", "number_scope": "regex:=.*", }, "sample_packing": True},
     "sample_packing"),
    ({"emdlm": {"from_hidden": "yes"}}, "from_hidden must be true or false"),
])  # fmt: skip
def test_bad_settings_and_conflicts_are_refused_by_name(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plugin_module.check_config(cfg)
    pytest.importorskip("pydantic")
    with pytest.raises(ValueError, match=message):  # Axolotl's pydantic validation says so too
        plugin_module.EMDLMArgs(**cfg)


def test_the_installed_loss_is_emdlms_and_its_components_are_logged(tok, tmp_path) -> None:
    plugin = plugin_module.EMDLMPlugin()
    trainer = _trainer(tok, tmp_path)
    (callback,) = plugin.add_callbacks_post_trainer(CFG, trainer)
    plugin.post_trainer_create(CFG, trainer)  # the same patch, not a second one
    assert isinstance(callback, LossComponentsCallback)
    batch = _batch(tok)
    torch.manual_seed(1)  # the same Gumbel noise for NTIL's number values in both calls
    got = trainer.model(**batch).loss
    reference_model = _model(tok)
    reference = make_compute_loss_func(emdlm.NTILLoss(tok, reduction="sum", preset="stable"))
    torch.manual_seed(1)
    want = reference(reference_model(**{k: v for k, v in batch.items() if k != "labels"}),
                     batch["labels"])  # fmt: skip
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # the CE of the same batch differs: the model's own loss was replaced
    assert got.item() != pytest.approx(reference_model(**batch).loss.item(), rel=1e-3)
    components = plugin.handle.compute_loss.pop_components()
    assert {"ce", "ntil", "loss"} <= set(components)
    assert components["loss"] == pytest.approx(got.item(), rel=1e-6)


def test_from_hidden_gives_the_same_loss(tok, tmp_path) -> None:
    cfg = {"emdlm": {**CFG["emdlm"], "from_hidden": True}}
    plugin = plugin_module.EMDLMPlugin()
    trainer = _trainer(tok, tmp_path)
    plugin.add_callbacks_post_trainer(cfg, trainer)
    torch.manual_seed(1)
    out = trainer.model(**_batch(tok))
    assert out.logits is None  # the forward never built the [B, T, V] logits
    plain = plugin_module.EMDLMPlugin()
    plain_trainer = _trainer(tok, tmp_path)
    plain.add_callbacks_post_trainer(CFG, plain_trainer)
    torch.manual_seed(1)
    assert out.loss.item() == pytest.approx(plain_trainer.model(**_batch(tok)).loss.item(),
                                            rel=1e-5)  # fmt: skip


def test_the_collator_adds_the_number_mask_only_when_the_objective_takes_one(tok) -> None:
    plugin = plugin_module.EMDLMPlugin()
    assert plugin.get_collator_cls_and_kwargs(CFG) is None  # scope "all": Axolotl's collator
    ce = {"emdlm": {"objective": "ce", "number_scope": "regex:(?<==)-?\\d+"}}
    assert plugin.get_collator_cls_and_kwargs(ce) is None  # CE scores no numbers
    scoped = {"emdlm": {"objective": "ntil", "number_scope": "regex:(?<==)-?\\d+"}}
    cls, kwargs = plugin.get_collator_cls_and_kwargs(scoped)
    assert cls is NumberMaskCollator and kwargs == {"number_scope": "regex:(?<==)-?\\d+"}
    collate = cls(tok, padding=True, **kwargs)  # as Axolotl builds it: collator(tokenizer, ...)
    batch = _batch(tok)
    features = [{"input_ids": ids[m].tolist(), "labels": y[m].tolist()}
                for ids, y, m in zip(batch["input_ids"], batch["labels"],
                                     batch["input_ids"] != 0, strict=True)]  # fmt: skip
    out = collate(features)
    # scored text "+34=46" / "+15=22": only the answer after "=" is in scope
    masked = [[tok.convert_ids_to_tokens(int(i)) for i in row[m]]
              for row, m in zip(out["input_ids"], out["number_mask"], strict=True)]
    assert masked == [["4", "6"], ["2", "2"]]
    assert out["number_mask"].shape == out["labels"].shape


def test_number_mask_of_spans_multi_character_tokens() -> None:
    pieces = ["<pad>", " 12", "+", "3", "=", "15"]
    mask = number_mask_of([1, 2, 3, 4, 5], [-100, 2, 3, 4, 5], pieces, "regex:(?<==)\\d+")
    assert mask == [False, False, False, False, True]  # "=15": the whole "15" token is inside
    assert number_mask_of([1, 5], [1, 5], pieces, "all") == [True, True]


def test_token_texts_match_the_tokenizer(tok) -> None:
    texts = token_texts(tok)
    ids = tok("12+3")["input_ids"]
    assert "".join(texts[i] for i in ids) == "12+3"


def test_settings_mirror_the_run_configs_objective() -> None:
    s = parse_settings({"objective": {"name": "emo", "cost_embedding": "model"}}, "emdlm")
    assert (s.objective.name, s.objective.cost_embedding, s.from_hidden) == ("emo", "model", False)
    assert parse_settings(None, "emdlm").objective.name == "ce"
    with pytest.raises(ConfigError, match="unknown key"):
        parse_settings({"objectives": {}}, "emdlm")
