"""One loss step for every route.

Every route — ``Trainer(compute_loss_func=...)``, :class:`EMDLMTrainer`, TRL's
:class:`EMDLMSFTTrainer`, :func:`emdlm.patch` on logits and from hidden states, and the
from-hidden ``compute_loss_func`` — goes through :class:`ComputeLoss`: the same value on the
same batch, a batch's ``number_mask`` honoured by every route, a teacher by every route that can
run one, and refused by name where it cannot. No route writes fields into the ComputeLoss.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import emdlm
from emdlm.integrations.loss_contract import declared_needs, loss_inputs
from emdlm.integrations.transformers import (
    ComputeLoss,
    EMDLMTrainer,
    emdlm_trainer,
    make_compute_loss_func,
)
from emdlm.losses.base import EMDLMLoss
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo_distill import KLDistillLoss
from emdlm.losses.ntil import NTILLoss

trl = pytest.importorskip("trl")
from emdlm.integrations.trl import EMDLMSFTTrainer  # noqa: E402
from test_trl_integration import addition_dataset, char_tokenizer, sft_config, tiny_gpt2  # noqa: E402

ROUTES = (
    "compute_loss_func", "emdlm_trainer", "sft_trainer", "patch_logits", "patch_hidden",
    "trainer_hidden", "sft_hidden",
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _batch(tok) -> dict[str, torch.Tensor]:
    """Two prompt/answer rows; the number mask leaves out the first answer's last digit, so a
    route that dropped the mask would give another NTIL value."""
    rows = [("12+34=", "46"), ("5+7=", "12")]
    ids, labels, masks = [], [], []
    for prompt, answer in rows:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
        masks.append([False] * len(p) + [True] * (len(a) - 1) + [False])
    masks[0][-2] = False
    width = max(map(len, ids))
    pad = tok.pad_token_id
    return {
        "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
        "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
        "number_mask": torch.tensor([x + [False] * (width - len(x)) for x in masks]),
    }


def _ntil(tok) -> NTILLoss:
    # static mix: under the dynamic one the NTIL term equals CE in value, mask or not
    return NTILLoss(tok, reduction="sum", value_mode="expected", mix="static")


def _reference(model, loss_fn, batch, teacher=None) -> torch.Tensor:
    """The loss written out by hand: shift once, sum, divide by the scored tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    if teacher is not None:
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = loss_fn(logits[:, :-1], labels, teacher_logits=t[:, :-1])
    else:
        out = loss_fn(logits[:, :-1], labels, number_mask=batch["number_mask"][:, 1:])
    return out.loss / (labels != -100).sum()


def _args(tmp_path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
        remove_unused_columns=False, disable_tqdm=True,
    )  # fmt: skip


def _route_loss(route, tmp_path, tok, model, loss_fn, batch, teacher=None) -> torch.Tensor:
    model.train()
    if route == "compute_loss_func":  # the plain adapter, extras as arguments
        cl = make_compute_loss_func(loss_fn)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        extras: dict[str, torch.Tensor] = {"number_mask": batch["number_mask"]}
        if teacher is not None:
            with torch.no_grad():
                extras = {"teacher_logits": teacher(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits}
        return cl(outputs, batch["labels"], **extras)
    if route in ("emdlm_trainer", "trainer_hidden"):
        cl = make_compute_loss_func(
            loss_fn, from_hidden=route == "trainer_hidden",
            model=model if route == "trainer_hidden" else None,
        )
        trainer = EMDLMTrainer(model=model, args=_args(tmp_path), compute_loss_func=cl,
                               teacher=teacher)
        return trainer.compute_loss(model, dict(batch))
    if route in ("sft_trainer", "sft_hidden"):
        trainer = EMDLMSFTTrainer(
            model=model, args=sft_config(tmp_path), train_dataset=addition_dataset(8),
            processing_class=tok, loss_fn=loss_fn, teacher=teacher,
            from_hidden=route == "sft_hidden",
        )  # fmt: skip
        loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
        assert ("emdlm_hidden" in outputs) == (route == "sft_hidden")
        return loss
    handle = emdlm.patch(model, loss_fn, from_hidden=route == "patch_hidden")
    try:
        out = model(**batch)
        if route == "patch_hidden":
            assert out.logits is None
        return out.loss
    finally:
        handle.undo()


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_gives_the_same_masked_ntil_loss(tmp_path, tok, route):
    model = tiny_gpt2(len(tok))
    batch = _batch(tok)
    loss_fn = _ntil(tok)
    with torch.no_grad():
        unmasked = _ntil(tok)(
            model(input_ids=batch["input_ids"]).logits[:, :-1], batch["labels"][:, 1:]
        ).loss / (batch["labels"][:, 1:] != -100).sum()
        expected = _reference(model, loss_fn, batch)
    assert not torch.isclose(expected, unmasked)  # the mask matters on this batch
    got = _route_loss(route, tmp_path, tok, model, loss_fn, batch)
    torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ["compute_loss_func", "emdlm_trainer", "sft_trainer"])
def test_every_route_that_runs_a_teacher_distils_from_it(tmp_path, tok, route):
    model, teacher = tiny_gpt2(len(tok), seed=0), tiny_gpt2(len(tok), seed=1).eval()
    batch = _batch(tok)
    loss_fn = KLDistillLoss(reduction="sum", alpha=0.5)
    with torch.no_grad():
        expected = _reference(model, loss_fn, batch, teacher=teacher)
    got = _route_loss(route, tmp_path, tok, model, loss_fn, batch, teacher=teacher)
    torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-6)


def test_routes_that_cannot_run_a_teacher_refuse_it_by_name(tmp_path, tok):
    model = tiny_gpt2(len(tok))
    loss_fn = KLDistillLoss(reduction="sum")
    with pytest.raises(ValueError, match=r"KLDistillLoss distils from a teacher.*EMDLMTrainer"):
        emdlm.patch(model, loss_fn)
    with pytest.raises(ValueError, match="KLDistillLoss distils from the teacher's logits"):
        make_compute_loss_func(loss_fn, from_hidden=True, model=model)
    with pytest.raises(ValueError, match="KLDistillLoss distils from a teacher: pass teacher="):
        EMDLMSFTTrainer(model=model, args=sft_config(tmp_path), train_dataset=addition_dataset(8),
                        processing_class=tok, loss_fn=loss_fn)
    cl = make_compute_loss_func(loss_fn)  # a plain Trainer has no teacher: refused at the call
    outputs = model(input_ids=_batch(tok)["input_ids"])
    with pytest.raises(RuntimeError, match="no teacher logits were given"):
        cl(outputs, _batch(tok)["labels"])
    with pytest.raises(ValueError, match="CrossEntropyLoss does not distil"):
        make_compute_loss_func(CrossEntropyLoss(reduction="sum"))(
            outputs, _batch(tok)["labels"], teacher_logits=outputs.logits
        )


def test_no_route_writes_fields_into_the_compute_loss(tmp_path, tok):
    """The ComputeLoss holds the loss, its settings and the components it records; the batch's
    mask and a teacher's logits are arguments of each call, never attributes."""
    model, teacher = tiny_gpt2(len(tok)), tiny_gpt2(len(tok), seed=1).eval()
    cl = make_compute_loss_func(_ntil(tok))
    before = set(vars(cl))
    trainer = EMDLMTrainer(model=model, args=_args(tmp_path), compute_loss_func=cl)
    trainer.compute_loss(model, dict(_batch(tok)))
    assert set(vars(cl)) == before
    assert not any(hasattr(cl, name) for name in ("teacher_logits", "number_mask"))
    distil = make_compute_loss_func(KLDistillLoss(reduction="sum"))
    EMDLMTrainer(model=model, args=_args(tmp_path), compute_loss_func=distil,
                 teacher=teacher).compute_loss(model, dict(_batch(tok)))
    assert not hasattr(distil, "teacher_logits")


def test_trainer_factory_keeps_its_teacher_and_the_old_aliases_are_gone(tok):
    import emdlm.integrations.transformers as glue

    model = tiny_gpt2(len(tok))
    cls = emdlm_trainer(emdlm_trainer(Trainer, teacher=model))
    assert cls.teacher is model  # the outer factory keeps the inner one's teacher
    assert issubclass(cls, Trainer) and cls.compute_loss is EMDLMTrainer.compute_loss
    assert emdlm_trainer(cls) is cls
    # the deprecated aliases (no warning, same class) are gone: one factory
    assert not any(hasattr(glue, name) for name in ("with_teacher", "with_number_mask"))


def test_loss_inputs_shift_once_by_hand():
    labels = torch.tensor([[-100, 5, 6, 7]])
    logits = torch.arange(4 * 3, dtype=torch.float).reshape(1, 4, 3)
    mask = torch.tensor([[False, True, False, True]])
    teacher = -logits
    got = loss_inputs(labels, logits=logits, number_mask=mask, teacher_logits=teacher)
    assert got.labels.tolist() == [[5, 6, 7]]
    assert got.logits.tolist() == logits[:, :3].tolist()
    assert got.number_mask.tolist() == [[True, False, True]]
    assert got.teacher_logits.tolist() == (-logits[:, :3]).tolist()
    same = loss_inputs(labels, logits=logits, number_mask=mask, shifted=True)
    assert same.labels is not None and same.labels.tolist() == labels.tolist()
    assert same.number_mask.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="labels=None"):
        loss_inputs(None, logits=logits)
    with pytest.raises(ValueError, match="exactly one of logits and hidden"):
        loss_inputs(labels)
    with pytest.raises(ValueError, match=r"teacher logits \(1, 4, 2\) do not match"):
        loss_inputs(labels, logits=logits, teacher_logits=logits[..., :2])


def test_needs_are_declared_not_probed():
    assert isinstance(CrossEntropyLoss(), EMDLMLoss)
    ntil = declared_needs(NTILLoss(char_tokenizer()))
    assert (ntil.takes_number_mask, ntil.needs_teacher, ntil.has_from_hidden) == (
        True, False, True)
    kl = declared_needs(KLDistillLoss())
    assert (kl.needs_teacher, kl.has_from_hidden) == (True, False)
    with pytest.raises(NotImplementedError, match="KLDistillLoss has no from-hidden path"):
        KLDistillLoss().from_hidden()

    class UserLoss:  # a user's callable: declares by attributes, or needs nothing
        reduction = "sum"

        def __call__(self, logits, labels):
            raise AssertionError("not called")

    user = declared_needs(UserLoss())
    assert user == declared_needs(UserLoss()) and not any(
        (user.needs_teacher, user.takes_number_mask, user.has_from_hidden))
    assert isinstance(ComputeLoss(UserLoss()), ComputeLoss)
