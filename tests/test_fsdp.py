"""Sharded training (FSDP2, gloo on CPU) and the sharded output embedding.

- ``emdlm train ... train.fsdp=true`` on 2 processes (torchrun) x batch 2 == 1 unsharded process
  x batch 4 (both with gradient accumulation 2): the same per-step losses and final weights,
  for CE and NTIL, on the logits and the from-hidden path. The parameters are really sharded
  (each rank holds about half of the elements, as DTensors): a run that fell back to DDP or to
  one process fails here.
- The from-hidden loss on a head that is an FSDP ``DTensor`` shard when the loss reads it: the
  gathered weight gives the single-process loss and gradients, for every registered objective
  with ``has_from_hidden`` (tests/_objectives.py ``SPECS``: a new objective is checked here by
  being registered; the conformance suite, tests/test_conformance.py, points here); the shard
  itself (or its local rows) is refused with a clear error; ``DTensor.full_tensor()`` alone
  gives wrong gradients.

One ``torchrun`` launch of this file runs the head checks and three of the four trainings
(``python tests/test_fsdp.py``, see ``_worker``); the fourth goes through the
command of docs/cli.md (``emdlm.cli train``). Budget: about a minute on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _torchrun import failure_text

pytestmark = pytest.mark.slow  # multi-process; still run in CI (pyproject markers)

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "model.params.n_layer=2", "model.params.n_embd=32", "data.train.n=64", "data.eval=null",
    "train.max_steps=3", "train.grad_accum=2", "train.save_steps=2", "train.save_total_limit=2",
    "train.progress_bar=false", "train.tensorboard=false",
]
# NTIL whose batch loss is a sum over tokens (static mix, per-token averaging, no Gumbel
# noise), so a 2 x 2 x 2 split is the same computation as 1 x 4 x 2 (see
# test_integrations_transformers).
OBJECTIVES = {
    "ce": ["objective.name=ce"],
    "ntil": ["objective.name=ntil", "objective.params.mix=static",
             "objective.params.averaging=token", "objective.params.value_mode=expected"],
}
COMBOS = [(obj, hidden) for obj in OBJECTIVES for hidden in (False, True)]
CLI_COMBO = ("ntil", True)  # trained through the torchrun command of docs/cli.md
PLACEHOLDER = "my_run.yaml"


def _overrides(obj: str, hidden: bool, out: Path, batch: int, fsdp: bool) -> list[str]:
    return [
        *COMMON, *OBJECTIVES[obj], f"train.batch_size={batch}", f"output_dir={out}",
        f"train.fused_linear={str(hidden).lower()}", f"train.fsdp={str(fsdp).lower()}",
    ]


def _name(obj: str, hidden: bool) -> str:
    return f"{obj}-{'hidden' if hidden else 'logits'}"


def readme_fsdp_command() -> str:
    """The torchrun line of the FSDP paragraph of docs/cli.md (a ```sh block: test_multiprocess
    runs the ```bash ones)."""
    text = (ROOT / "docs" / "cli.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.strip().startswith("torchrun") and "train.fsdp=true" in line:
                return line.split("#", 1)[0].strip()
    raise AssertionError("docs/cli.md: no ```sh block with the torchrun ... train.fsdp=true line")


def _env() -> dict[str, str]:
    return {
        **os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Output folders: {(obj, hidden): (one-process run, two-process sharded run)} and the head
    checks' results."""
    import yaml

    from emdlm.config import load_config
    from emdlm.training import run_training

    base = tmp_path_factory.mktemp("fsdp")
    folders, configs = {}, []
    for obj, hidden in COMBOS:
        one, two = base / f"one-{_name(obj, hidden)}", base / f"two-{_name(obj, hidden)}"
        cfg = load_config("arithmetic_ce", _overrides(obj, hidden, two, batch=2, fsdp=True))
        path = base / f"{_name(obj, hidden)}.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if (obj, hidden) != CLI_COMBO:
            configs.append(str(path))
        folders[(obj, hidden)] = (one, two, path)
    head = base / "head.json"
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2", __file__, str(head), *configs],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, failure_text(proc.stderr)
    one, two, path = folders[CLI_COMBO]
    argv = [path.as_posix() if a == PLACEHOLDER else a for a in shlex.split(readme_fsdp_command())]
    assert argv.count(path.as_posix()) == 1, argv
    assert argv.count("--output") == 1, argv  # the command's own run folder -> the test's
    argv[argv.index("--output") + 1] = two.as_posix()
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure_text(proc.stderr)
    assert "emdlm: FSDP2 over 2 processes (gloo)" in proc.stderr, proc.stderr[-3000:]
    assert "emdlm: world size 2 (torchrun)" in proc.stderr, proc.stderr[-3000:]
    for obj, hidden in COMBOS:  # the references: one process, unsharded, batch 4
        one = folders[(obj, hidden)][0]
        run_training(load_config("arithmetic_ce", _overrides(obj, hidden, one, 4, fsdp=False)))
    return {"folders": folders, "head": json.loads(head.read_text())}


def _log(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("obj", "hidden"), COMBOS, ids=[_name(*c) for c in COMBOS])
def test_two_sharded_processes_match_one_process(runs, obj, hidden):
    from safetensors.torch import load_file

    one, two, _ = runs["folders"][(obj, hidden)]
    summary = json.loads((two / "train_summary.json").read_text())
    fsdp = summary["fsdp"]  # written by the sharded run: absent under DDP / one process
    assert fsdp["world_size"] == 2 and fsdp["backend"] == "gloo"
    assert fsdp["trained_as"] == "FSDPGPT2LMHeadModel"  # FSDP2's class, no DDP around it
    # each rank holds its rows of every parameter: half, up to one row of odd-sized tensors
    assert fsdp["param_elements"] / 2 <= fsdp["local_param_elements_rank0"]
    assert fsdp["local_param_elements_rank0"] <= 0.51 * fsdp["param_elements"]
    assert summary["epoch"] == pytest.approx(3 * 8 / 64)  # both ranks consumed their data

    log_one, log_two = _log(one), _log(two)
    assert len(log_one) == len(log_two) == 3
    for a, b in zip(log_two, log_one, strict=True):
        assert a["n_scored"] == b["n_scored"]  # the same 8 examples per optimizer step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        if obj == "ntil":
            assert a["ntil"] == pytest.approx(b["ntil"], rel=1e-4, abs=1e-6)
    w_one = load_file(str(one / "model.safetensors"))
    w_two = load_file(str(two / "model.safetensors"))  # gathered from the shards on save
    moved = load_file(str(two / "checkpoint-2" / "model.safetensors"))  # a mid-run checkpoint
    for key, w in w_one.items():
        assert tuple(w_two[key].shape) == tuple(w.shape), key  # full tensors, not shards
        torch.testing.assert_close(w_two[key], w, rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(moved[k], w_two[k]) for k in w_one)  # step 3 changed weights


def test_emdlm_eval_reads_the_sharded_run(runs):
    """The final folder of a sharded run is an ordinary model folder: emdlm eval loads it and
    predicts exactly what the one-process model predicts."""
    from emdlm.training.evaluate import evaluate_run, resolve_eval_config

    one, two, _ = runs["folders"][("ce", False)]
    eval_args = ["data.eval.task=arithmetic", "data.eval.n=16", "data.eval.split=test"]
    metrics = {}
    for label, folder in (("one", one), ("two", two)):
        cfg = resolve_eval_config(folder, overrides=eval_args)
        metrics[label] = evaluate_run(folder, cfg, out_dir=folder.parent / f"eval-{label}")
        metrics[label].pop("seconds", None)
    preds = [
        (folder.parent / f"eval-{label}" / "predictions.jsonl").read_text()
        for label, folder in (("one", one), ("two", two))
    ]
    assert preds[0] == preds[1]
    assert len(preds[0].splitlines()) == 16


def test_sharded_head_is_gathered_for_the_from_hidden_loss(runs):
    """A head in its own FSDP unit is a DTensor shard when the from-hidden loss reads it (its
    module never runs): gathered, the 2-rank loss and every gradient equal one process's."""
    head = runs["head"]
    assert head["head_is_dtensor"] and head["shard_rows"] < head["vocab"]
    assert head["loss_diff"] < 1e-5
    assert head["grad_diff"]["gathered"] < 1e-5
    assert head["max_grad"] > 1e-3  # the gradients compared are not all zero


def test_every_objective_from_hidden_on_a_sharded_head(runs):
    """As above for every registered objective with a from-hidden path (class defaults; an
    objective with batch-level terms under the options that make a row split exact,
    tests/test_conformance.py BATCH_LEVEL): 2 ranks x 2 rows equal 1 process x 4 rows."""
    from _objectives import SPECS

    objectives = runs["head"]["objectives"]
    assert set(objectives) == {n for n, spec in SPECS.items() if spec.cls.has_from_hidden}
    for name, result in objectives.items():
        assert result["head_is_dtensor"], name
        assert result["loss_diff"] < 1e-5 * max(1.0, result["loss"]), (name, result)
        assert result["grad_diff"] < 1e-5, (name, result)
        assert result["max_grad"] > 1e-3, (name, result)


def test_a_head_shard_reaching_the_loss_is_refused(runs):
    """Without the gather the loss would see a DTensor or its local rows: both are refused,
    naming the shapes; DTensor.full_tensor() (whose backward keeps only the local rank's part
    of the head's gradient) gives wrong gradients: the gather's backward must reduce."""
    head = runs["head"]
    for kind in ("dtensor", "local_rows"):
        assert "a shard of a sharded model (FSDP / ZeRO-3) reached the loss" in head[kind]
    assert f"[{head['shard_rows']}, 16]" in head["local_rows"]
    assert head["grad_diff"]["full_tensor"] > 1e-3


def test_fsdp_needs_several_processes(tmp_path, monkeypatch):
    from emdlm.config import ConfigError, load_config
    from emdlm.training import prepare_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config("arithmetic_ce", _overrides("ce", False, tmp_path / "o", 4, fsdp=True))
    with pytest.raises(ConfigError, match=r"this run has 1: launch with torchrun"):
        prepare_run(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    bad = load_config("arithmetic_ce", [*_overrides("ce", False, tmp_path / "o", 4, True),
                                        "train.fsdp_config={layer_classes: [GPT2Block]}"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['layer_classes'\]"):
        prepare_run(bad)
    wrong = load_config("arithmetic_ce", [
        *_overrides("ce", False, tmp_path / "o", 4, True),
        "train.fsdp_config={transformer_layer_cls_to_wrap: [LlamaDecoderLayer]}"])
    with pytest.raises(ConfigError, match=r"no module of class \['LlamaDecoderLayer'\]"):
        prepare_run(wrong)
    assert not (tmp_path / "o").exists()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=8))


@pytest.mark.parametrize("shard", ["rows", "zero3_empty", "columns"])
def test_hidden_loss_refuses_a_head_shard(monkeypatch, shard):
    """One process: whatever slice of the head would reach the loss (FSDP rows, a ZeRO-3
    0-element partition) is refused with the shapes, instead of a softmax over part of the
    vocabulary."""
    import emdlm.integrations.hidden_forward as hidden_mod
    from emdlm.losses.ce import CrossEntropyLoss

    model = _tiny_gpt2()
    full = hidden_mod.output_head(model)
    part = {"rows": full.weight[:20], "zero3_empty": full.weight.new_empty(0),
            "columns": full.weight[:, :8]}[shard]
    monkeypatch.setattr(hidden_mod, "output_head", lambda m: hidden_mod.OutputHead(
        part, None, None, None, module=full.module))
    hidden = torch.randn(2, 6, 16)
    labels = torch.randint(0, 40, (2, 6))
    with pytest.raises(ValueError, match=r"the head maps 16 -> 40: a shard"):
        hidden_mod.hidden_loss(CrossEntropyLoss(reduction="sum"), model, hidden, labels)


def test_unsharded_head_passes_through_unchanged():
    from emdlm.integrations.sharding import full_tensor, gathered_head

    head = _tiny_gpt2().lm_head
    assert full_tensor(head.weight) is head.weight
    with gathered_head(head.weight, None) as (weight, bias):
        assert weight is head.weight and bias is None


# ---------------------------------------------------------------- the torchrun worker
def _head_checks() -> dict:
    """Rank-local: a tiny untied LLaMA whose lm_head is its own FSDP unit (resharded after
    forward), the from-hidden CE of 2 ranks x 2 rows vs the logits-path CE of 4 rows on an
    unsharded copy."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import emdlm.integrations.sharding as sharding
    from emdlm.integrations.transformers import make_compute_loss_func
    from emdlm.losses.ce import CrossEntropyLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 23  # odd: the shards have 12 and 11 rows
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    ))
    model = copy.deepcopy(ref)
    fully_shard(model.lm_head, reshard_after_forward=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    n_items = int((labels[:, 1:] != -100).sum())

    ref_loss = make_compute_loss_func(CrossEntropyLoss(reduction="sum"))(
        ref(input_ids=ids), labels, num_items_in_batch=n_items)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    compute_loss = make_compute_loss_func(
        CrossEntropyLoss(reduction="sum"), from_hidden=True, model=model)
    rows = slice(2 * rank, 2 * rank + 2)
    seen: dict = {}

    def step() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids[rows])
        seen["dtensor"] = isinstance(model.lm_head.weight, DTensor)
        loss = compute_loss(out, labels[rows], num_items_in_batch=n_items)
        (loss * world).backward()  # as the Trainer: FSDP averages gradients over ranks
        total = loss.detach().clone()
        dist.all_reduce(total)
        grad_diff = 0.0
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad_diff = max(grad_diff, float((g - ref_grads[name]).abs().max()))
        return abs(float(total) - float(ref_loss)), grad_diff

    result: dict = {"vocab": vocab, "world": world, "grad_diff": {}}
    result["loss_diff"], result["grad_diff"]["gathered"] = step()
    result["head_is_dtensor"] = seen["dtensor"]
    result["shard_rows"] = model.lm_head.weight.to_local().shape[0]
    result["max_grad"] = max(float(g.abs().max()) for g in ref_grads.values())
    original = sharding.full_tensor
    try:
        for kind, fake in (("dtensor", lambda w: w), ("local_rows", lambda w: w.to_local())):
            sharding.full_tensor = fake
            try:
                step()
                result[kind] = "no error"
            except ValueError as err:
                result[kind] = str(err)
        sharding.full_tensor = lambda w: w.full_tensor() if isinstance(w, DTensor) else w
        result["grad_diff"]["full_tensor"] = step()[1]
    finally:
        sharding.full_tensor = original
    for kind in ("dtensor", "local_rows"):  # the message of rank 0's shard (12 rows)
        if rank != 0:
            result.pop(kind)
    result["objectives"] = _every_objective(ref, ids, labels, n_items)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    objectives = {
        name: gathered[0]["objectives"][name] | {
            k: max(r["objectives"][name][k] for r in gathered) for k in ("loss_diff", "grad_diff")
        } | {"head_is_dtensor": all(r["objectives"][name]["head_is_dtensor"] for r in gathered)}
        for name in result["objectives"]
    }
    return gathered[0] | {"objectives": objectives, "grad_diff": {
        k: max(r["grad_diff"][k] for r in gathered) for k in result["grad_diff"]}}


def _every_objective(ref, ids, labels, n_items) -> dict:
    """Rank-local: for every registered objective with a from-hidden path, a fresh sharded copy
    of ``ref`` (lm_head its own FSDP unit), its from-hidden loss of this rank's 2 rows against
    the logits-path loss of all 4 rows on ``ref``: loss and gradient differences."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from _objectives import SPECS, random_cost_embedding
    from emdlm.integrations.transformers import make_compute_loss_func
    from emdlm.numbers import NumberVocab
    from test_conformance import BATCH_LEVEL

    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = ref.config.vocab_size
    tokens = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)] + [".", "-", "a"]
    digits = NumberVocab.from_token_strings(tokens[:vocab], vocab)
    cost = random_cost_embedding(vocab, 6, seed=3)
    rows = slice(2 * rank, 2 * rank + 2)
    out: dict = {}
    for name, spec in SPECS.items():
        if not spec.cls.has_from_hidden:
            continue
        options = BATCH_LEVEL.get(name, {})  # a row split is exact under these
        loss_fn = spec.build(digits=digits, cost_embedding=cost, reduction="sum", **options)
        ref.zero_grad(set_to_none=True)
        ref_loss = make_compute_loss_func(loss_fn)(
            ref(input_ids=ids), labels, num_items_in_batch=n_items)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        fully_shard(model.lm_head, reshard_after_forward=True)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        compute_loss = make_compute_loss_func(loss_fn, from_hidden=True, model=model)
        hidden_out = model(input_ids=ids[rows])
        is_dtensor = isinstance(model.lm_head.weight, DTensor)
        loss = compute_loss(hidden_out, labels[rows], num_items_in_batch=n_items)
        (loss * world).backward()  # as the Trainer: FSDP averages gradients over ranks
        total = loss.detach().clone()
        dist.all_reduce(total)
        grad_diff = 0.0
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad_diff = max(grad_diff, float((g - ref_grads[n]).abs().max()))
        out[name] = {
            "loss": abs(float(ref_loss)), "loss_diff": abs(float(total) - float(ref_loss)),
            "grad_diff": grad_diff, "head_is_dtensor": is_dtensor,
            "max_grad": max(float(g.abs().max()) for g in ref_grads.values()),
        }
    return out


def _worker(head_json: str, configs: list[str]) -> None:
    """Under torchrun: the head checks (rank 0 writes ``head_json``), then ``emdlm train`` on
    each config, one after the other in the same processes."""
    from emdlm.config import load_config
    from emdlm.training import run_training
    from emdlm.training.launch import close_process_group
    from emdlm.training.train import training_arguments

    first = load_config(configs[0]) if configs else load_config("arithmetic_ce")
    _ = training_arguments(first, Path(first.output_dir), False).device  # the process group
    result = _head_checks()
    if int(os.environ["RANK"]) == 0:
        Path(head_json).write_text(json.dumps(result))
    for path in configs:
        run_training(load_config(path), config_path=path)
    close_process_group(finished=True)  # as `emdlm train` ends (no teardown crash at exit)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])


def test_zero3_partitioned_head_is_gathered_around_the_loss(monkeypatch):
    """The ZeRO-3 branch of ``gathered_head`` with a stand-in ``deepspeed`` (DeepSpeed itself is
    not installed here): a head whose data is a 0-element partition is gathered by
    ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)`` for exactly the duration
    of the loss, so the loss equals the unsharded one; without deepspeed it is an error.
    (This test found that the head lookup refused the 0-element partition before the gather.)"""
    import enum
    import sys
    import types

    import emdlm.integrations.hidden_forward as hidden_mod
    from emdlm.losses.ce import CrossEntropyLoss

    model = _tiny_gpt2()
    head = model.lm_head
    hidden = torch.randn(2, 6, 16)
    labels = torch.randint(0, 40, (2, 6))
    expected, _ = hidden_mod.hidden_loss(CrossEntropyLoss(reduction="sum"), model, hidden, labels)

    status = enum.Enum("ZeroParamStatus", "AVAILABLE NOT_AVAILABLE")
    full_data = head.weight.data
    head.weight.data = full_data.new_empty(0)  # what a ZeRO-3 rank holds outside a gather
    head.weight.ds_id, head.weight.ds_status = 0, status.NOT_AVAILABLE
    head.weight.ds_shape = full_data.shape  # as DeepSpeed records the full shape
    calls = []

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None):
        calls.append(([id(p) for p in params], modifier_rank))
        for p in params:
            p.data, p.ds_status = full_data, status.AVAILABLE
        yield
        for p in params:
            p.data, p.ds_status = full_data.new_empty(0), status.NOT_AVAILABLE

    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(GatheredParameters=gathered)
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    got, _ = hidden_mod.hidden_loss(CrossEntropyLoss(reduction="sum"), model, hidden, labels)
    assert calls == [([id(head.weight)], None)]
    torch.testing.assert_close(got.loss, expected.loss)
    assert head.weight.numel() == 0  # partitioned again after the loss

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(RuntimeError, match="ZeRO-3 partitioned head, but no deepspeed"):
        hidden_mod.hidden_loss(CrossEntropyLoss(reduction="sum"), model, hidden, labels)
