"""ms-swift's route (``emdlm.integrations.swift``) without ms-swift: a plain dict as its
``loss_map`` and a real ``transformers.Trainer`` calling the loss as ms-swift's trainer does
(``loss(outputs, labels, num_items_in_batch=N, loss_scale=None, trainer=t)``, model run
without labels). ``make integrations`` runs the same file where ms-swift is installed (its
``BaseLoss`` and ``loss_map``) and a real ``swift sft``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import emdlm
from emdlm.config import ConfigError
from emdlm.integrations import swift as route
from emdlm.integrations.transformers import LossComponentsCallback, make_compute_loss_func
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.objectives import DISTILL
from emdlm.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("char")


def _trainer(tok: Any, tmp_path: Any) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ))  # fmt: skip  (train mode: from_hidden's forward acts only while training)
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    return Trainer(model=model, args=args, processing_class=tok)


def _batch(tok: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([tok("12+34=46")["input_ids"], tok("7+15=22")["input_ids"] + [0]])
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, -1] = -100
    return ids, labels


def _swift_call(loss: Any, trainer: Trainer, ids: torch.Tensor, labels: torch.Tensor,
                n: int | None = None, loss_scale: Any = None) -> torch.Tensor:
    outputs = trainer.model(input_ids=ids)  # ms-swift pops the labels before the forward
    return loss(outputs, labels, num_items_in_batch=n, loss_scale=loss_scale, trainer=trainer)


def test_every_objective_but_distillation_is_registered_by_name() -> None:
    loss_map: dict = {"cross_entropy": object}
    added = route.register_losses(loss_map=loss_map)
    want = {f"emdlm_{n}" for n in OBJECTIVE_SPECS if n not in DISTILL}
    assert set(added) == want and want <= set(loss_map) and loss_map["cross_entropy"] is object
    with pytest.raises(ValueError, match="already has a loss named 'cross_entropy'"):
        route.register_losses({"cross_entropy": {}}, loss_map=loss_map)
    with pytest.raises(ConfigError, match="takes no"):
        route.register_losses({"emdlm_x": {"objective": {"name": "ntil", "params": {"z": 1}}}},
                              loss_map={})  # fmt: skip
    with pytest.raises(ValueError, match="number_scope"):
        route.register_losses({"emdlm_x": {"objective": "ntil", "number_scope": "regex:\\d"}},
                              loss_map={})  # fmt: skip


def test_the_loss_is_emdlms_divided_by_num_items(tok, tmp_path) -> None:
    cls = route.register_losses(loss_map={})["emdlm_ntil"]
    trainer = _trainer(tok, tmp_path)
    loss = cls(trainer.args, trainer)
    ids, labels = _batch(tok)
    torch.manual_seed(1)  # NTIL's Gumbel noise: the same draw in both calls
    got = _swift_call(loss, trainer, ids, labels, n=20)
    reference = make_compute_loss_func(emdlm.NTILLoss(tok, reduction="sum"))
    torch.manual_seed(1)
    want = reference(trainer.model(input_ids=ids), labels, num_items_in_batch=20)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    callbacks = [c for c in trainer.callback_handler.callbacks
                 if isinstance(c, LossComponentsCallback)]  # fmt: skip
    assert len(callbacks) == 1 and callbacks[0].compute_loss is loss.compute_loss
    assert {"ce", "ntil"} <= set(loss.compute_loss.pop_components())
    _swift_call(loss, trainer, ids, labels)  # the second call builds nothing new
    assert len([c for c in trainer.callback_handler.callbacks
                if isinstance(c, LossComponentsCallback)]) == 1  # fmt: skip


def test_loss_scale_weights_are_refused(tok, tmp_path) -> None:
    cls = route.register_losses(loss_map={})["emdlm_ce"]
    trainer = _trainer(tok, tmp_path)
    ids, labels = _batch(tok)
    ones = torch.ones(labels.shape)
    assert _swift_call(cls(trainer.args, trainer), trainer, ids, labels, loss_scale=ones) > 0
    with pytest.raises(NotImplementedError, match="loss_scale"):
        _swift_call(cls(trainer.args, trainer), trainer, ids, labels, loss_scale=ones * 2)


def test_from_hidden_equals_the_logits_path(tok, tmp_path) -> None:
    settings = {"emdlm_ce_fh": {"objective": "ce", "from_hidden": True}, "emdlm_ce": {}}
    classes = route.register_losses(settings, loss_map={})
    fh_trainer, plain_trainer = _trainer(tok, tmp_path), _trainer(tok, tmp_path)
    fh = classes["emdlm_ce_fh"](fh_trainer.args, fh_trainer)
    plain = classes["emdlm_ce"](plain_trainer.args, plain_trainer)
    ids, labels = _batch(tok)
    first = _swift_call(fh, fh_trainer, ids, labels)  # from logits: the forward had run
    assert fh_trainer.model(input_ids=ids).logits is None  # now the forward gives hidden states
    second = _swift_call(fh, fh_trainer, ids, labels)
    want = _swift_call(plain, plain_trainer, ids, labels)
    assert first.item() == pytest.approx(want.item(), rel=1e-6)
    assert second.item() == pytest.approx(want.item(), rel=1e-5)


def test_registered_in_swifts_own_loss_map_where_installed(tok, tmp_path) -> None:
    swift_loss = pytest.importorskip("swift.loss")  # make integrations: ms-swift's venv
    added = route.register_losses()
    assert swift_loss.loss_map["emdlm_ntil"] is added["emdlm_ntil"]
    assert issubclass(added["emdlm_ntil"], swift_loss.BaseLoss)
    trainer = _trainer(tok, tmp_path)
    ids, labels = _batch(tok)
    got = _swift_call(added["emdlm_ce"](trainer.args, trainer), trainer, ids, labels)
    want = make_compute_loss_func(emdlm.CrossEntropyLoss(reduction="sum"))(
        trainer.model(input_ids=ids), labels
    )
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
