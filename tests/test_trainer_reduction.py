"""Reduction decided in one place (ComputeLoss) for every registered
objective, checked through a real ``transformers.Trainer`` step with gradient accumulation; loss
components in the Trainer's logs via ``LossComponentsCallback``."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from _objectives import SPECS, random_cost_embedding
from emdlm.config import ModelConfig
from emdlm.data import DataCollator, build_dataset
from emdlm.integrations.transformers import (
    LossComponentsCallback,
    emdlm_trainer,
    make_compute_loss_func,
    require_sum_reduction,
)
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.models import build_model, model_vocab_size
from emdlm.numbers import NumberVocab
from emdlm.objectives import DISTILL
from emdlm.tasks import generate_task
from emdlm.tokenizers import load_tokenizer

# Every registered objective (tests/_objectives.py, checked against the registry in
# test_objective_registry.py): a loss added to the registry is tested here automatically.
OBJECTIVES = sorted(SPECS)
# Deterministic values for NTIL (no Gumbel noise), so the direct call below gives the same loss.
EXTRA = {"ntil": {"value_mode": "expected"}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("char")


@pytest.fixture(scope="module")
def vocab_size(tok):
    return model_vocab_size(_model(tok))


def _model(tok):
    torch.manual_seed(0)
    return build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)


def build_loss(name: str, reduction: str, tok, vocab_size: int) -> torch.nn.Module:
    """The registered class for ``name`` with its defaults, built with ``reduction`` (EMO, EMO
    distillation: a small random cost embedding)."""
    spec = SPECS[name]
    digits = NumberVocab.from_tokenizer(tok, vocab_size) if spec.needs_digits else None
    emb = random_cost_embedding(vocab_size, 8, seed=1) if spec.needs_cost_embedding else None
    return spec.build(
        digits=digits, cost_embedding=emb, reduction=reduction, **EXTRA.get(name, {})
    )


def _teacher(tok, name: str):
    """A frozen tiny teacher for the distillation objectives (None for the others)."""
    if not SPECS[name].needs_teacher:
        return None
    torch.manual_seed(7)
    teacher = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)
    return teacher.eval().requires_grad_(False)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_mean_reduction_is_refused_for_every_objective(tok, vocab_size, name):
    loss = build_loss(name, "mean", tok, vocab_size)
    assert loss.reduction == "mean"
    with pytest.raises(ValueError, match=r"reduction='sum'.*reduction='mean'"):
        make_compute_loss_func(loss)
    summed = build_loss(name, "sum", tok, vocab_size)
    assert summed.reduction == "sum"
    make_compute_loss_func(summed)  # accepted


def test_missing_or_unknown_reduction_is_not_sum():
    def bare(logits, labels):  # says nothing about its reduction
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="no `reduction` attribute"):
        make_compute_loss_func(bare)
    bare.reduction = "none"
    with pytest.raises(ValueError, match="reduction='none'"):
        make_compute_loss_func(bare)
    bare.reduction = "sum"
    make_compute_loss_func(bare)


def test_reduction_changed_after_building_is_refused_at_the_call():
    ce = CrossEntropyLoss(reduction="sum")
    f = make_compute_loss_func(ce)
    ce.reduction = "mean"
    with pytest.raises(ValueError, match="reduction='mean'"):
        f({"logits": torch.randn(1, 3, 5)}, torch.zeros(1, 3, dtype=torch.long))


def test_ntil_reduction_is_read_only(tok, vocab_size):
    loss = build_loss("ntil", "sum", tok, vocab_size)
    with pytest.raises(AttributeError):
        loss.reduction = "mean"
    require_sum_reduction(loss)


class Recorder:
    """Wraps the compute_loss_func: keeps every call's logits, labels, N and returned loss."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.teacher_calls: list[torch.Tensor | None] = []

    def __call__(self, outputs, labels, num_items_in_batch=None, **extras):
        teacher = extras.get("teacher_logits")  # given by the teacher trainer, else None
        loss = self.inner(outputs, labels, num_items_in_batch=num_items_in_batch, **extras)
        self.calls.append((outputs["logits"].detach().clone(), labels.clone(),
                           torch.as_tensor(num_items_in_batch), loss.detach().clone()))
        self.teacher_calls.append(None if teacher is None else teacher.clone())
        return loss


def _trainer(
    tmp_path, tok, compute_loss, n_rows, max_steps, logging_steps, callbacks=(), teacher=None
):
    rows = generate_task("arithmetic", n=n_rows, seed=5, max_digits=3)
    ds = build_dataset(rows, tok, max_length=32)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=1e-3,
        logging_steps=logging_steps, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, remove_unused_columns=False, seed=0, data_seed=0,
    )  # fmt: skip
    trainer_cls = Trainer
    if teacher is not None:  # the distillation objectives get the teacher's logits
        trainer_cls = emdlm_trainer(Trainer, teacher=teacher)
    trainer = trainer_cls(
        model=_model(tok), args=args, train_dataset=ds,
        data_collator=DataCollator(tok.pad_token_id), compute_loss_func=compute_loss,
        callbacks=list(callbacks),
    )  # fmt: skip
    return trainer, ds


@pytest.mark.parametrize("name", OBJECTIVES)
def test_trainer_loss_is_answer_token_sum_over_num_items(tmp_path, tok, vocab_size, name):
    """One optimizer step = 2 micro-batches of 2 problems (all 4 rows of the data): each
    micro-batch loss is the summed loss of its answer tokens / N, N = answer tokens of the
    whole step, and the Trainer's logged loss is their sum."""
    loss_sum = build_loss(name, "sum", tok, vocab_size)
    rec = Recorder(make_compute_loss_func(loss_sum))
    trainer, ds = _trainer(tmp_path, tok, rec, n_rows=4, max_steps=1, logging_steps=1,
                           teacher=_teacher(tok, name))  # fmt: skip
    trainer.train()

    answer_tokens = sum(int((torch.tensor(ds[i]["labels"][1:]) != -100).sum()) for i in range(4))
    assert len(rec.calls) == 2
    direct_total = 0.0
    for (logits, labels, n_items, loss), teacher in zip(rec.calls, rec.teacher_calls, strict=True):
        assert int(n_items) == answer_tokens  # the whole accumulated step's answer tokens
        extra = {} if teacher is None else {"teacher_logits": teacher[:, :-1]}
        assert (teacher is not None) == (name in DISTILL)
        with torch.no_grad():
            direct = loss_sum(logits[:, :-1], labels[:, 1:], **extra).loss
        torch.testing.assert_close(loss, direct / answer_tokens, rtol=1e-5, atol=1e-7)
        direct_total += float(direct)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["loss"] == pytest.approx(direct_total / answer_tokens, rel=1e-5)
    # Negative control: the per-token mean divided by N again (the silent 1/N scaling this
    # guards against) is far smaller.
    mean_fn = build_loss(name, "mean", tok, vocab_size)
    with torch.no_grad():
        logits, labels, _, loss = rec.calls[0]
        first = rec.teacher_calls[0]
        extra = {} if first is None else {"teacher_logits": first[:, :-1]}
        doubly_divided = mean_fn(logits[:, :-1], labels[:, 1:], **extra).loss / answer_tokens
    assert float(doubly_divided) < 0.5 * float(loss)


class _SeeLogs(TrainerCallback):
    """Runs after LossComponentsCallback: what the console / progress bar would print."""

    def __init__(self):
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_components_callback_logs_step_averages(tmp_path, tok, vocab_size):
    """4 steps x 2 micro-batches, a log every 2 steps: emdlm/<component> is the mean over the 2
    steps of each step's token-weighted micro-batch mean, and emdlm/loss equals Trainer's loss."""
    loss_sum = build_loss("ntil", "sum", tok, vocab_size)
    compute_loss = make_compute_loss_func(loss_sum)
    rec = Recorder(compute_loss)
    see = _SeeLogs()
    trainer, _ = _trainer(
        tmp_path, tok, rec, n_rows=16, max_steps=4, logging_steps=2,
        callbacks=[LossComponentsCallback(compute_loss), see],
    )  # fmt: skip
    trainer.train()
    assert len(rec.calls) == 8

    # expected: per step, weights = scored tokens of each micro-batch
    per_step: list[dict[str, float]] = []
    for step in range(4):
        sums: dict[str, float] = {}
        weight = 0.0
        for logits, labels, _, _ in rec.calls[2 * step: 2 * step + 2]:
            with torch.no_grad():
                out = loss_sum(logits[:, :-1], labels[:, 1:])
            w = float((labels[:, 1:] != -100).sum())
            weight += w
            sums["loss"] = sums.get("loss", 0.0) + float(out.loss)
            for k, v in out.components.items():
                sums[k] = sums.get(k, 0.0) + (float(v) if k.startswith("n_") else float(v) * w)
        per_step.append({k: (v if k.startswith("n_") else v / weight) for k, v in sums.items()}
                        | {"n_scored": weight})
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == 2
    for i, record in enumerate(train_logs):
        steps = per_step[2 * i: 2 * i + 2]
        for key in ("loss", "ce", "emd", "relative", "magnitude", "ntil", "mix_coef",
                    "n_scored", "n_numbers"):
            expected = (steps[0][key] + steps[1][key]) / 2
            assert record[f"emdlm/{key}"] == pytest.approx(expected, rel=1e-5, abs=1e-8), key
        assert record["emdlm/loss"] == pytest.approx(record["loss"], rel=1e-5)
        assert record["emdlm/ntil"] > 0  # arithmetic answers are numbers: NTIL is active
    # callbacks after it (console, progress bar) see the same values
    seen = [s for s in see.seen if "loss" in s]
    assert [s["emdlm/ce"] for s in seen] == [r["emdlm/ce"] for r in train_logs]
    # evaluation / final summary records are left alone
    assert not any(k.startswith("emdlm/") for k in trainer.state.log_history[-1])


def test_components_callback_needs_compute_loss():
    with pytest.raises(TypeError, match="ComputeLoss"):
        LossComponentsCallback(CrossEntropyLoss(reduction="sum"))


def _fused_log(tmp_path, tok, from_hidden: bool) -> dict:
    """One log record of 2 steps x 2 micro-batches of CE with token_accuracy and entropy,
    trained from the logits or from the final hidden states."""
    model = _model(tok)
    compute_loss = make_compute_loss_func(
        CrossEntropyLoss(reduction="sum", token_accuracy=True, entropy=True),
        from_hidden=from_hidden, model=model if from_hidden else None,
    )
    ds = build_dataset(generate_task("arithmetic", n=8, seed=5, max_digits=3), tok, max_length=32)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out{from_hidden}"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3, logging_steps=2,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, seed=0, data_seed=0,
    )  # fmt: skip
    trainer = emdlm_trainer(Trainer)(
        model=model, args=args, train_dataset=ds, data_collator=DataCollator(tok.pad_token_id),
        compute_loss_func=compute_loss, callbacks=[LossComponentsCallback(compute_loss)],
    )  # fmt: skip
    trainer.train()
    (record,) = [h for h in trainer.state.log_history if "loss" in h]
    return record


def test_accuracy_and_entropy_reach_the_logs_from_hidden_states(tmp_path, tok):
    """The fused from-hidden route logs emdlm/token_accuracy and emdlm/entropy (no logits are
    built there), equal to the logits route's over the same steps."""
    fused = _fused_log(tmp_path, tok, from_hidden=True)
    full = _fused_log(tmp_path, tok, from_hidden=False)
    for key in ("emdlm/token_accuracy", "emdlm/entropy", "emdlm/ce", "loss"):
        assert key in fused, key
        assert fused[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), key
    assert 0.0 <= fused["emdlm/token_accuracy"] <= 1.0
    assert fused["emdlm/entropy"] > 0.0
