"""make_compute_loss_func: label shift, num_items_in_batch normalization, exact accumulation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from _objectives import SPECS
from emdlm.config import ModelConfig, ObjectiveConfig, load_config
from emdlm.data import DataCollator, build_dataset
from emdlm.integrations.transformers import make_compute_loss_func
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.models import build_model
from emdlm.objectives import build_objective
from emdlm.tasks import generate_task
from emdlm.tokenizers import load_tokenizer
from emdlm.training import prepare_run, train
from test_conformance import BATCH_LEVEL

# Objectives whose summed loss is a sum of per-token terms: accumulation 4x2 == 8x1 exactly.
# id -> (objective name, params), derived from the registry (tests/_objectives.py SPECS, every
# objective without a teacher) and tests/test_conformance.py BATCH_LEVEL: an objective declared
# there (NTIL / digit EMD, NTL) belongs here with the options that make it exact, e.g. NTIL's
# mix="static", averaging="token": every term is a sum over the batch divided by the counted
# labels, so "sum" is sum_t CE_t + lam * sum of the NTIL terms (emdlm.functional.ntil), and
# value_mode "expected" / "argmax" (emd's default) keep the value deterministic (no Gumbel noise
# per call).
NO_TEACHER = [name for name, spec in SPECS.items() if not spec.needs_teacher]
EXACT_OBJECTIVES = {
    (f"{name}-exact" if name in BATCH_LEVEL else name): (name, dict(BATCH_LEVEL.get(name, {})))
    for name in NO_TEACHER
}
# With its own averaging (NTIL / digit EMD "batch": means over the numbers of the batch it is
# given; NTL "number") or the dynamic mix (a batch ratio sg(CE/NTIL), with any averaging), an
# objective of BATCH_LEVEL has "sum" = n x the micro-batch mean (emdlm.functional.ntil), so 4x2
# is by definition not the computation 8x1 is. What is exact: the accumulated gradient is the
# token-share weighted mean of the micro-batch losses, sum_i (n_i / N) grad L_i. Objectives
# drawing noise take value_mode "expected" (a deterministic value: no Gumbel noise per call).
DETERMINISTIC = {"value_mode": "expected"}
BATCH_MEAN_OBJECTIVES = {
    name: dict(DETERMINISTIC) if SPECS[name].draws_noise else {}
    for name in NO_TEACHER
    if name in BATCH_LEVEL
}
BATCH_MEAN_OBJECTIVES["ntil-dynamic-token"] = {**DETERMINISTIC, "averaging": "token"}


def test_every_objective_without_a_teacher_has_an_accumulation_case():
    """A new objective (tests/_objectives.py, checked against the registry in
    test_objective_registry.py) gets a case in EXACT_OBJECTIVES or BATCH_MEAN_OBJECTIVES; the
    distillation objectives (a teacher's logits per micro-batch) are checked through a Trainer
    in tests/test_trainer_reduction.py."""
    exact = {objective for objective, _ in EXACT_OBJECTIVES.values()}
    batch_mean = {case.split("-")[0] for case in BATCH_MEAN_OBJECTIVES}
    assert exact | batch_mean == {name for name, spec in SPECS.items() if not spec.needs_teacher}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("char")


@pytest.fixture(scope="module")
def batch8(tok):
    rows = generate_task("arithmetic", n=8, seed=3, max_digits=3)
    ds = build_dataset(rows, tok, max_length=32)
    collate = DataCollator(tok.pad_token_id, pad_to_multiple_of=16)  # one width for all
    items = [ds[i] for i in range(8)]
    return collate(items), [collate(items[:4]), collate(items[4:])]


def test_rejects_mean_reduction():
    # every registered objective: tests/test_trainer_reduction.py
    with pytest.raises(ValueError, match="reduction='sum'"):
        make_compute_loss_func(CrossEntropyLoss(reduction="mean"))


def test_shift_and_normalization():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    f = make_compute_loss_func(CrossEntropyLoss(reduction="sum"))
    ref_sum = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), reduction="sum"
    )
    n = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(f({"logits": logits}, labels, num_items_in_batch=None), ref_sum / n)
    torch.testing.assert_close(
        f({"logits": logits}, labels, num_items_in_batch=torch.tensor(20)), ref_sum / 20
    )
    comps = f.pop_components()
    # "loss" is the objective's mean over the scored tokens of both calls (whatever the
    # denominators were), never a sum over calls
    assert comps["n_scored"] == 2 * n
    assert comps["loss"] == pytest.approx(float(ref_sum / n), rel=1e-6)
    assert comps["ce"] == pytest.approx(float(ref_sum / n), rel=1e-6)
    assert f.pop_components() == {}


def _grads(model, clf, batches, n_items):
    model.zero_grad(set_to_none=True)
    for b in batches:
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        clf(out, b["labels"], num_items_in_batch=n_items).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _full_and_accumulated(tok, batch8, objective, params):
    """Gradients of the tiny model through make_compute_loss_func: 8x1 and 4x2."""
    torch.manual_seed(0)
    model = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)
    cost = "model" if SPECS[objective].needs_cost_embedding else None
    cfg = ObjectiveConfig(objective, dict(params), cost)
    loss = build_objective(cfg, tokenizer=tok, model=model, vocab_size=len(tok))
    clf = make_compute_loss_func(loss)
    full, micro = batch8
    n_items = (full["labels"][:, 1:] != -100).sum()
    return _grads(model, clf, [full], n_items), _grads(model, clf, micro, n_items), model, clf


@pytest.mark.parametrize("case", sorted(EXACT_OBJECTIVES))
def test_accumulation_4x2_equals_8x1(tok, batch8, case):
    objective, params = EXACT_OBJECTIVES[case]
    g_full, g_acc, model, clf = _full_and_accumulated(tok, batch8, objective, params)
    _, micro = batch8
    assert g_full.abs().max() > 1e-4
    torch.testing.assert_close(g_acc, g_full, rtol=1e-5, atol=1e-7)
    # negative control: a per-micro-batch mean (the pre-fix Trainer behaviour) is not exact,
    # because the two micro-batches score different token counts
    counts = [int((m["labels"][:, 1:] != -100).sum()) for m in micro]
    assert counts[0] != counts[1]
    if objective == "ce":
        g_mean = _grads(model, clf, micro, None) / 2
        assert not torch.allclose(g_mean, g_full, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    ("objective", "params"),
    [
        ("ntil", {"mix": "static", "value_mode": "expected"}),  # "batch" means
        ("ntil", {"averaging": "token", "value_mode": "expected"}),  # dynamic ratio
        ("emd", {"averaging": "token"}),  # dynamic ratio
    ],
)
def test_accumulation_not_exact_for_batch_means_or_dynamic_mix(tok, batch8, objective, params):
    """Negative controls for the exact cases above: per-batch means or the dynamic ratio
    sg(CE/NTIL) make 4x2 differ from 8x1 (the same comparison as the exact test)."""
    g_full, g_acc, _, _ = _full_and_accumulated(tok, batch8, objective, params)
    assert not torch.allclose(g_acc, g_full, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", sorted(BATCH_MEAN_OBJECTIVES))
def test_accumulation_is_token_weighted_mean_for_batch_averaged_objectives(tok, batch8, case):
    torch.manual_seed(0)
    model = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)
    objective = case.split("-")[0]
    params = dict(BATCH_MEAN_OBJECTIVES[case])
    loss = build_objective(
        ObjectiveConfig(objective, params), tokenizer=tok, model=model, vocab_size=len(tok)
    )
    clf = make_compute_loss_func(loss)
    _, micro = batch8
    n_items = sum((m["labels"][:, 1:] != -100).sum() for m in micro)
    g_acc = _grads(model, clf, micro, n_items)
    # reference: each micro-batch's mean-reduced loss, weighted by its token share
    mean_loss = type(loss)(loss.number_vocab, reduction="mean", **params)
    model.zero_grad(set_to_none=True)
    for m in micro:
        logits = model(input_ids=m["input_ids"], attention_mask=m["attention_mask"]).logits
        share = (m["labels"][:, 1:] != -100).sum() / n_items
        (share * mean_loss(logits[:, :-1], m["labels"][:, 1:]).loss).backward()
    g_ref = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert g_ref.abs().max() > 1e-4
    torch.testing.assert_close(g_acc, g_ref, rtol=1e-5, atol=1e-7)


def _one_sgd_step(tmp_path, name, objective, batch, accum, params=()):
    overrides = [
        *params,
        f"objective.name={objective}",
        "model.params.n_layer=1",
        "model.params.n_embd=32",
        "data.train.n=64",
        "data.eval=null",
        f"train.batch_size={batch}",
        f"train.grad_accum={accum}",
        "train.max_steps=1",
        "train.progress_bar=false",
        "train.tensorboard=false",
        "optim.optim=sgd",
        "optim.lr=1.0",
        "optim.max_grad_norm=0",
        "optim.scheduler=constant",
        "optim.warmup_ratio=0",
        "optim.weight_decay=0",
        "data.pad_to_multiple_of=16",
        f"output_dir={tmp_path / name}",
    ]
    if objective == "emo":
        overrides += ["objective.cost_embedding=model"]
    run = prepare_run(load_config("arithmetic_ce", overrides))
    before = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    train(run)
    return before, load_file(str(tmp_path / name / "model.safetensors"))


# From the CLI / a YAML config: objective.params: {mix: static, averaging: token}.
NTIL_TOKEN_OVERRIDES = (
    "objective.params.mix=static",
    "objective.params.averaging=token",
    "objective.params.value_mode=expected",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("objective", "params"), [("ce", ()), ("emo", ()), ("ntil", NTIL_TOKEN_OVERRIDES)]
)
def test_trainer_accumulation_same_weights(tmp_path, objective, params):
    """Through transformers.Trainer: one SGD step (lr 1, no clipping, so the update is the
    gradient) with batch 8 x accumulation 1 and 4 x 2 lands on the same weights."""
    before, w81 = _one_sgd_step(tmp_path, "b8", objective, 8, 1, params)
    _, w42 = _one_sgd_step(tmp_path, "b4", objective, 4, 2, params)
    moved = max(float((w81[k] - before[k]).abs().max()) for k in w81 if k in before)
    assert moved > 1e-3
    for key in w81:
        torch.testing.assert_close(w42[key], w81[key], rtol=1e-5, atol=1e-6)
