"""The data's per-row ``loss_weight`` through the trainers: row checks, the collators' weight
tensor, the weighted ``num_items_in_batch`` (2 micro-batches x accumulation 2 = one batch of 4,
loss and gradients, against a hand-written weighted mean), setup refusals, and the TRL route."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import TrainingArguments

from emdlm.config import ConfigError, ModelConfig
from emdlm.data import DataCollator, build_dataset, read_jsonl
from emdlm.integrations.loss_weights import dataset_loss_weights, weighted_item_count
from emdlm.integrations.patch import patch
from emdlm.integrations.transformers import (
    ComputeLoss,
    EMDLMTrainer,
    LossComponentsCallback,
    make_compute_loss_func,
)
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo_distill import KLDistillLoss
from emdlm.models import build_model
from emdlm.tasks import generate_task
from emdlm.tokenizers import load_tokenizer

#: row weights of the 4 training rows: mean 1.375 (so Σ w·n is not the token count), one is 0
WEIGHTS = (0.5, 2.0, 0.0, 3.0)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("char")


def _model(tok):
    torch.manual_seed(0)
    params = {"n_layer": 1, "n_embd": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0}
    return build_model(ModelConfig("tiny-gpt2", params), tok)


def _rows(n: int = 4, weights=WEIGHTS):
    rows = generate_task("arithmetic", n=n, seed=5, max_digits=3)
    return [{**r, "loss_weight": weights[i]} if i < len(weights) else r
            for i, r in enumerate(rows)]


# ------------------------------------------------------------------------------ the data field


@pytest.mark.parametrize("bad", ["-1", '"2"', "true", "1e999"])
def test_bad_row_weight_is_a_one_line_error_naming_the_line(tmp_path, bad):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "1+1=2"}\n{"text": "2+2=4", "loss_weight": ' + bad + "}\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: field 'loss_weight' must be a finite "
                                          r"number >= 0") as err:
        read_jsonl(path)
    assert "\n" not in str(err.value)


#: rows with a weight, without the field, with a JSON null, a zero: what a datasets column makes
#: of them is the same (None for the missing one)
MIXED = [{"text": "12+3=15", "loss_weight": 2.0}, {"text": "4+4=8"},
         {"text": "7+1=8", "loss_weight": None}, {"text": "9+9=18", "loss_weight": 0.5}]


def _collated_weights(tok, rows):
    """The [B, T] ``loss_weights`` the collator gives a dataset built from ``rows``."""
    ds = build_dataset(rows, tok, max_length=32)
    return DataCollator(tok.pad_token_id)([ds[i] for i in range(len(ds))])["loss_weights"]


def test_null_row_weight_is_no_weight_given(tmp_path, tok):
    """JSON null = the field absent = weight 1 (it used to be refused)."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    rows = read_jsonl(path)
    ds = build_dataset(rows, tok, max_length=32)
    assert "loss_weight" not in ds[1] and "loss_weight" not in ds[2]  # as a row without one
    w = _collated_weights(tok, rows)
    n = len(ds[2]["input_ids"])
    assert bool((w[2, :n] == 1.0).all()) and bool((w[1, : len(ds[1]["input_ids"])] == 1.0).all())
    assert float(w[0, 0]) == 2.0 and float(w[3, 0]) == 0.5


def test_jsonl_and_a_datasets_dataset_give_identical_weights(tmp_path, tok):
    """The same rows as a JSONL file (null and a missing field) and as
    ``datasets.Dataset.from_list`` (None in the column for both), handed to build_dataset, read
    from a save_to_disk folder, or checked by a trainer's setup: the same weights."""
    datasets = pytest.importorskip("datasets")
    from emdlm.config import DataSourceConfig
    from emdlm.data import load_examples

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    hf = datasets.Dataset.from_list(MIXED)
    assert hf["loss_weight"] == [2.0, None, None, 0.5]
    hf.save_to_disk(str(tmp_path / "folder"))
    from_jsonl = _collated_weights(tok, load_examples(DataSourceConfig(path=str(path)), seed=0))
    from_folder = _collated_weights(
        tok, load_examples(DataSourceConfig(path=str(tmp_path / "folder")), seed=0))
    for got in (from_folder, _collated_weights(tok, hf), _collated_weights(tok, list(hf))):
        assert torch.equal(got, from_jsonl)
    assert dataset_loss_weights(hf) is True
    # a column of None only is no weight given, as rows without the field
    none_only = datasets.Dataset.from_list([{"text": "1+1=2", "loss_weight": None}])
    assert dataset_loss_weights(none_only) is False


def test_each_row_weight_is_checked_once_before_training(tmp_path, tok, monkeypatch):
    """One check per row and source: a JSONL file's as it is read (not again by build_dataset,
    a trainer's setup or the collator), a datasets.Dataset's once by the trainer's setup however
    often it asks."""
    datasets = pytest.importorskip("datasets")
    import emdlm.data
    import emdlm.integrations.loss_weights as lw

    calls = []
    real = lw.check_loss_weight

    def counted(value, where):
        calls.append(where)
        return real(value, where)

    monkeypatch.setattr(lw, "check_loss_weight", counted)
    monkeypatch.setattr(emdlm.data, "check_loss_weight", counted)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    ds = build_dataset(read_jsonl(path), tok, max_length=32)
    compute_loss = make_compute_loss_func(CrossEntropyLoss(reduction="sum"))
    compute_loss.check_dataset(ds)  # emdlm train's setup check, then the trainer's
    compute_loss.check_dataset(ds)
    DataCollator(tok.pad_token_id)([ds[i] for i in range(len(ds))])
    assert len(calls) == len(MIXED), calls
    calls.clear()
    hf = datasets.Dataset.from_list(MIXED)
    assert compute_loss.check_dataset(hf) is True
    assert compute_loss.check_dataset(hf) is True
    assert len(calls) == len(MIXED), calls


def test_bad_weight_of_a_generated_row_names_the_example(tok):
    rows = _rows(weights=(1.0, math.nan, 1.0, 1.0))
    with pytest.raises(ConfigError, match=r"train: example 1: field 'loss_weight'"):
        build_dataset(rows, tok, max_length=32, source="train")


def test_per_token_weights_in_a_text_row_are_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "12", "loss_weights": [1, 2]}) + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: field 'loss_weights'"):
        read_jsonl(path)


def test_collator_gives_the_row_weight_on_its_tokens(tok):
    ds = build_dataset(_rows(3, (2.0, 0.25)), tok, max_length=32)  # the third row: absent
    assert "loss_weight" not in ds[2]
    items = [ds[0], ds[1], ds[2]]
    items[1] = {**items[1], "loss_weights": [float(i) for i in range(len(items[1]["input_ids"]))]}
    batch = DataCollator(tok.pad_token_id)(items)
    w = batch["loss_weights"]
    assert w.dtype == torch.float32 and w.shape == batch["labels"].shape
    for i, expected in enumerate((2.0, 0.25, 1.0)):
        n = len(items[i]["input_ids"])
        per_token = torch.arange(n, dtype=torch.float32) if i == 1 else torch.ones(n)
        torch.testing.assert_close(w[i, :n], expected * per_token)  # row x per-token
        assert bool((w[i, n:] == 0).all())  # padding
    unweighted = DataCollator(tok.pad_token_id)([ds[2], ds[2]])
    assert "loss_weights" not in unweighted  # no row has one: the unweighted loss, unchanged
    bad = {**ds[0], "loss_weights": [1.0]}
    with pytest.raises(ConfigError, match="batch item 0: loss_weights has 1 entries"):
        DataCollator(tok.pad_token_id)([bad])



@pytest.mark.parametrize("bad", ["2", True, [2.0]], ids=["string", "bool", "list"])
def test_collator_refuses_a_row_weight_that_is_no_number(tok, bad):
    """A row of a dataset that no setup could read (an iterable one) reaches the collator
    unchecked: a string, a bool or a list is refused there with the setup check's words (a
    string was a bare float() error, a bool passed as weight 1), naming the batch item."""
    from emdlm.integrations.loss_weights import check_loss_weight

    ds = build_dataset(_rows(2, (1.0,)), tok, max_length=32)
    items = [ds[0], {**ds[1], "loss_weight": bad}]
    with pytest.raises(ConfigError) as setup:
        check_loss_weight(bad, "batch item 1")
    with pytest.raises(ConfigError) as err:
        DataCollator(tok.pad_token_id)(items)
    assert str(err.value) == str(setup.value) == (
        f"batch item 1: field 'loss_weight' must be a finite number >= 0, got {bad!r}")
    good = DataCollator(tok.pad_token_id)([ds[0], {**ds[1], "loss_weight": 2}])  # an int is one
    assert float(good["loss_weights"][1, 0]) == 2.0


def test_weights_of_a_torch_or_numpy_formatted_dataset_are_numbers(tok):
    """A ``datasets`` column in torch / numpy format gives 0-d tensors / numpy scalars: they
    are weights like the numbers they hold (a 0-d bool tensor is no number, as True is not)."""
    import datasets
    import numpy as np

    from emdlm.integrations.loss_weights import check_loss_weight, row_weight

    torch_ds = datasets.Dataset.from_list(
        [{"loss_weight": 0.5}, {"loss_weight": 2.0}]).with_format("torch")
    assert isinstance(torch_ds[0]["loss_weight"], torch.Tensor)
    assert dataset_loss_weights(torch_ds) is True
    assert [check_loss_weight(v, "row") for v in torch_ds["loss_weight"]] == [0.5, 2.0]
    assert row_weight(np.float32(0.25)) == 0.25 and row_weight(np.array(3)) == 3.0
    ds = build_dataset(_rows(2, (1.0,)), tok, max_length=32)
    batch = DataCollator(tok.pad_token_id)(
        [{**ds[0], "loss_weight": torch_ds[0]["loss_weight"]}, ds[1]])
    first = batch["loss_weights"][0]
    assert set(first[first > 0].tolist()) == {0.5}
    for bad in (torch.tensor(True), np.bool_(True), torch.tensor([1.0, 2.0])):
        with pytest.raises(ConfigError, match="must be a finite number >= 0"):
            row_weight(bad, "batch item 0")
        with pytest.raises(ConfigError, match="must be a finite number >= 0"):
            check_loss_weight(bad, "row 0")


def test_weighted_item_count_is_the_weight_sum_of_the_scored_labels(tok):
    ds = build_dataset(_rows(), tok, max_length=32)
    collate = DataCollator(tok.pad_token_id)
    first, second = collate([ds[0], ds[1]]), collate([ds[2], ds[3]])
    expected = sum(
        WEIGHTS[i] * sum(lab != -100 for lab in ds[i]["labels"][1:]) for i in range(4)
    )
    assert float(weighted_item_count([first, second])) == pytest.approx(expected)
    plain = {k: v for k, v in second.items() if k != "loss_weights"}  # a batch without: weight 1
    n_plain = sum(sum(lab != -100 for lab in ds[i]["labels"][1:]) for i in (2, 3))
    expected_mixed = expected - sum(
        WEIGHTS[i] * sum(lab != -100 for lab in ds[i]["labels"][1:]) for i in (2, 3)
    ) + n_plain
    assert float(weighted_item_count([first, plain])) == pytest.approx(expected_mixed)
    assert weighted_item_count([plain]) is None


# ------------------------------------------------------------------- the trainer, accumulation


def _reference_grads(tok, ds, teacher=None, alpha=0.0, temperature=1.0):
    """Σ w_t·l_t / Σ w_t over the scored tokens of all 4 rows, on the initial model, by hand
    (F.cross_entropy per token, the weights applied here): (loss, gradients). With a
    ``teacher``, l_t = (1-α)·CE_t + α·τ²·KL(p_τ ‖ q_τ)_t on the teacher's logits."""
    model = _model(tok)
    batch = DataCollator(tok.pad_token_id)([ds[i] for i in range(4)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = model(**inputs).logits
    labels, w = batch["labels"][:, 1:], batch["loss_weights"][:, 1:]
    z = logits[:, :-1].reshape(-1, logits.shape[-1])
    per = torch.nn.functional.cross_entropy(z, labels.reshape(-1), reduction="none",
                                            ignore_index=-100)
    if teacher is not None:
        with torch.no_grad():
            u = teacher(**inputs).logits[:, :-1].reshape(-1, logits.shape[-1])
        log_p = torch.log_softmax(u / temperature, -1)
        kl = (log_p.exp() * (log_p - torch.log_softmax(z / temperature, -1))).sum(-1)
        per = (1.0 - alpha) * per + alpha * temperature**2 * kl
    scored = labels.reshape(-1) != -100
    weights = torch.where(scored, w.reshape(-1), 0.0)
    loss = (weights * torch.where(scored, per, 0.0)).sum() / weights.sum()
    loss.backward()
    return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters()]


def _one_step(tmp_path, tok, ds, batch_size, accumulation, from_hidden, loss_fn=None,
              teacher=None):
    model = _model(tok)
    start = [p.detach().clone() for p in model.parameters()]
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out{batch_size}"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        seed=0, data_seed=0,
    )  # fmt: skip
    loss_fn = loss_fn or CrossEntropyLoss(reduction="sum")
    compute_loss = make_compute_loss_func(
        loss_fn, from_hidden=from_hidden, model=model if from_hidden else None
    )
    trainer = EMDLMTrainer(
        model=model, args=args, train_dataset=ds, data_collator=DataCollator(tok.pad_token_id),
        compute_loss_func=compute_loss, callbacks=[LossComponentsCallback(compute_loss)],
        teacher=teacher,
    )  # fmt: skip
    trainer.train()
    step = [s - p.detach() for s, p in zip(start, model.parameters(), strict=True)]  # lr = 1
    return trainer.state.log_history[0], step


@pytest.mark.slow
@pytest.mark.parametrize("from_hidden", [False, True], ids=["logits", "from_hidden"])
def test_accumulated_weighted_step_equals_one_batch_and_the_hand_reference(
    tmp_path, tok, from_hidden
):
    """2 micro-batches x accumulation 2 = one batch of 4 = the hand-written weighted mean
    Σ w·CE / Σ w over the 4 rows: the logged loss and the SGD step (the gradient, lr = 1)."""
    ds = build_dataset(_rows(), tok, max_length=32)
    ref_loss, ref_grads = _reference_grads(tok, ds)
    big = _one_step(tmp_path, tok, ds, 4, 1, from_hidden)
    acc = _one_step(tmp_path, tok, ds, 2, 2, from_hidden)
    for log, _ in (big, acc):
        assert log["emdlm/loss"] == pytest.approx(ref_loss, rel=1e-5)
    _assert_steps_match_the_reference([big, acc], ds, ref_loss, ref_grads)


def _assert_steps_match_the_reference(steps, ds, ref_loss, ref_grads):
    """Each (log, gradients) step: the logged loss is the reference's, the logged count the
    weight sum of the scored labels, and every gradient the reference's."""
    assert max(float(g.abs().max()) for g in ref_grads) > 1e-3
    for log, grads in steps:
        assert log["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert log["emdlm/n_scored"] == pytest.approx(
            sum(w * sum(lab != -100 for lab in ds[i]["labels"][1:])
                for i, w in enumerate(WEIGHTS)))
        for a, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_distillation_accumulated_weighted_step_equals_one_batch_and_the_hand_reference(
    tmp_path, tok
):
    """kl_distill with a teacher (EMDLMTrainer, weighted rows): 2 micro-batches x
    accumulation 2 = one batch of 4 = Σ w·((1-α)·CE + α·τ²·KL) / Σ w by hand, τ = 2."""
    torch.manual_seed(1)
    teacher = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok).eval()
    teacher.requires_grad_(False)
    ds = build_dataset(_rows(), tok, max_length=32)
    alpha, temperature = 0.3, 2.0
    ref_loss, ref_grads = _reference_grads(tok, ds, teacher, alpha, temperature)

    def loss_fn():
        return KLDistillLoss(alpha=alpha, temperature=temperature, reduction="sum")

    big = _one_step(tmp_path, tok, ds, 4, 1, False, loss_fn(), teacher)
    acc = _one_step(tmp_path, tok, ds, 2, 2, False, loss_fn(), teacher)
    _assert_steps_match_the_reference([big, acc], ds, ref_loss, ref_grads)


class _Unweighable(CrossEntropyLoss):
    """CE declared to take no per-token weights (as any objective without them)."""

    takes_loss_weights = False


def test_loss_without_weights_and_weighted_data_is_refused_before_any_step(tmp_path, tok):
    ds = build_dataset(_rows(), tok, max_length=32)
    assert dataset_loss_weights(ds) is True
    model = _model(tok)
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"objective _Unweighable takes no per-token loss "
                                         r"weights \(takes_loss_weights is False\)"):
        _one_step(tmp_path, tok, ds, 2, 1, False, loss_fn=_Unweighable(reduction="sum"))
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
    # a weighted batch reaching such a loss directly: refused by the same error
    compute_loss = make_compute_loss_func(_Unweighable(reduction="sum"))
    batch = DataCollator(tok.pad_token_id)([ds[0]])
    logits = torch.zeros(*batch["labels"].shape, 40)
    with pytest.raises(ValueError, match="the batch has loss_weights"):
        compute_loss({"logits": logits}, batch["labels"], loss_weights=batch["loss_weights"])


def test_emdlm_train_refuses_weighted_rows_for_a_loss_without_weights(tmp_path, monkeypatch):
    """``emdlm train``: a ConfigError naming the objective before the run folder is written
    (CE declared without weights here, standing in for any objective that takes none)."""
    from emdlm.config import load_config
    from emdlm.training.train import prepare_run

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = load_config("arithmetic_ce", [
        "model.params.n_layer=1", "model.params.n_embd=32", f"data.train={{path: {path}}}",
        "data.eval=null",
        f"output_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    monkeypatch.setattr(CrossEntropyLoss, "takes_loss_weights", False)
    with pytest.raises(ConfigError, match=r"train\.jsonl: rows carry 'loss_weight', but "
                                          r"objective 'ce' \(CrossEntropyLoss\) takes no"):
        prepare_run(cfg)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert prepare_run(cfg).train_dataset[0]["loss_weight"] == WEIGHTS[0]  # CE takes them


def test_patched_forward_refuses_weighted_batches(tok):
    model = _model(tok)
    handle = patch(model, CrossEntropyLoss(reduction="sum"), from_hidden=True)
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(ValueError, match=r"emdlm\.patch got a batch with loss_weights"):
        model(input_ids=ids, labels=ids, loss_weights=torch.ones(1, 4))
    handle.undo()


# ------------------------------------------------------------------------------- the TRL route


def test_trl_route_keeps_the_weights_and_scores_with_them(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from emdlm.integrations.trl import EMDLMSFTTrainer, RowWeightCollator
    from test_trl_integration import char_tokenizer, sft_config, tiny_gpt2

    tok = char_tokenizer()
    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a), "loss_weight": w}
            for a, w in zip((12, 34, 56, 78), WEIGHTS, strict=True)]
    trainer = EMDLMSFTTrainer(
        model=tiny_gpt2(len(tok)), train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
        args=sft_config(tmp_path, per_device_train_batch_size=4, max_steps=1),
    )  # fmt: skip
    assert isinstance(trainer.data_collator, RowWeightCollator)
    batch = next(iter(trainer.get_train_dataloader()))  # TRL kept the column through pruning
    assert "loss_weight" not in batch and batch["loss_weights"].shape == batch["labels"].shape
    lengths = batch["attention_mask"].sum(-1)
    row_w = batch["loss_weights"].amax(-1)
    assert sorted(row_w.tolist()) == sorted(WEIGHTS)
    assert torch.equal(batch["loss_weights"] > 0,
                       (batch["attention_mask"] > 0) & (row_w[:, None] > 0))
    assert int(lengths.min()) > 0
    model = trainer.model
    model.train()
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=None)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels, w = batch["labels"][:, 1:], batch["loss_weights"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    weights = torch.where(labels.reshape(-1) != -100, w.reshape(-1), 0.0)
    torch.testing.assert_close(loss.detach(), (weights * ce).sum() / weights.sum(), rtol=1e-5,
                               atol=1e-6)


def test_trl_padding_free_weights_follow_the_concatenated_rows():
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from emdlm.integrations.trl import RowWeightCollator

    collate = RowWeightCollator(DataCollatorForLanguageModeling(pad_token_id=0,
                                                                padding_free=True), True)
    batch = collate([{"input_ids": [5, 6, 7], "loss_weight": 2.0}, {"input_ids": [8, 9]}])
    assert batch["labels"].shape == (1, 5)
    assert batch["loss_weights"].tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0]]


def test_trl_refuses_weighted_rows_for_a_loss_without_weights(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from emdlm.integrations.trl import EMDLMSFTTrainer
    from test_trl_integration import char_tokenizer, sft_config, tiny_gpt2

    tok = char_tokenizer()
    ds = datasets.Dataset.from_list([{"prompt": "1+1=", "completion": "2", "loss_weight": 2.0}])
    with pytest.raises(ValueError, match="train_dataset has loss weights"):
        EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), train_dataset=ds, processing_class=tok,
            loss_fn=_Unweighable(reduction="sum"), args=sft_config(tmp_path),
        )  # fmt: skip
    bad = datasets.Dataset.from_list([{"prompt": "1+1=", "completion": "2", "loss_weight": -1.0}])
    with pytest.raises(ConfigError, match=r"train_dataset: row 0: field 'loss_weight'"):
        EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), train_dataset=bad, processing_class=tok,
            loss_fn=CrossEntropyLoss(reduction="sum"), args=sft_config(tmp_path),
        )  # fmt: skip


def test_logged_loss_of_a_step_whose_weight_sum_is_below_one_is_the_weighted_mean():
    """The logged loss and components divide by Σw, also when 0 < Σw < 1 (not by max(Σw, 1):
    that logged a quarter of the loss for weights 0.05 on five tokens)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (1, 6))
    weights = torch.full((1, 6), 0.05, dtype=torch.float64)
    call = ComputeLoss(CrossEntropyLoss(reduction="sum"))
    call(logits, labels, loss_weights=weights)
    logged = call.pop_components()
    per_token = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")
    w = weights[0, 1:]
    assert logged["n_scored"] == pytest.approx(float(w.sum()))
    assert logged["loss"] == pytest.approx(float((w * per_token).sum() / w.sum()), rel=1e-9)
