"""Training recipe: resume equals an uninterrupted run; Ctrl-C leaves a usable checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from emdlm.config import load_config
from emdlm.training import TrainingInterrupted, latest_checkpoint, prepare_run, run_training, train

pytestmark = pytest.mark.slow

STEPS = 6


def _cfg(out, *extra):
    return load_config("arithmetic_ntil", [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=200",
        "data.eval=null", "train.batch_size=8", "train.grad_accum=2", f"train.max_steps={STEPS}",
        "train.save_steps=3", "train.save_total_limit=null", "train.progress_bar=false",
        "train.tensorboard=false", "optim.warmup_ratio=0.2",
        # deterministic NTIL value so the comparison is not about RNG streams
        "objective.params.value_mode=expected", f"output_dir={out}", *extra,
    ])


def _log(folder):
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]


class _InterruptAt(TrainerCallback):
    """At the end of ``step``: send SIGINT to this process (a real Ctrl-C), or raise
    KeyboardInterrupt directly (what a second, impatient Ctrl-C does)."""

    def __init__(self, step, how):
        self.step, self.how = step, how

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if self.how == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_training(_cfg(out, "train.tensorboard=true"))
    return out


def test_outputs_and_component_log(reference):
    assert (reference / "model.safetensors").exists() and (reference / "tokenizer.json").exists()
    log = _log(reference)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for key in ("loss", "ce", "emd", "relative", "magnitude", "ntil", "lr", "n_scored"):
        assert key in log[0]
    assert all(r["loss"] > r["ce"] > 0 for r in log)  # CE + lam * (positive NTIL share)
    assert latest_checkpoint(reference).name == f"checkpoint-{STEPS}"
    assert any((reference / "tb").iterdir())  # TensorBoard events


def test_resume_from_checkpoint_matches_uninterrupted(reference, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")
    shutil.copy(reference / "run_config.yaml", out / "run_config.yaml")
    shutil.copy(reference / "train_log.jsonl", out / "train_log.jsonl")  # has steps 4-6 too
    summary = run_training(_cfg(out), resume=True)
    ref_w = load_file(str(reference / "model.safetensors"))
    new_w = load_file(str(out / "model.safetensors"))
    for key in ref_w:
        torch.testing.assert_close(new_w[key], ref_w[key], rtol=1e-6, atol=1e-7)
    # train_loss covers steps 1-6 as the uninterrupted run's does (not only steps 4-6)
    ref_summary = json.loads((reference / "train_summary.json").read_text())
    assert summary["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-5)
    ref_log = _log(reference)
    new_log = _log(out)
    assert [r["step"] for r in new_log] == list(range(1, STEPS + 1))  # no duplicated steps
    for r, ref in zip(new_log, ref_log, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)


def test_resume_after_a_torn_log_line_matches_uninterrupted(reference, tmp_path, capsys):
    """Killed while appending step 4's record: train_log.jsonl ends in half a line. --resume
    from checkpoint-3 reads the log (the torn line said and dropped) and ends as the
    uninterrupted run."""
    out = tmp_path / "torn"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")
    shutil.copy(reference / "run_config.yaml", out / "run_config.yaml")
    lines = (reference / "train_log.jsonl").read_text().splitlines()
    (out / "train_log.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])
    summary = run_training(_cfg(out), resume=True)
    assert "its last line is incomplete" in capsys.readouterr().err
    assert [r["step"] for r in _log(out)] == list(range(1, STEPS + 1))
    ref_summary = json.loads((reference / "train_summary.json").read_text())
    assert summary["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-5)


def test_resume_of_a_finished_run_trains_nothing(reference, tmp_path, capsys):
    """--resume of a run already at its last step: no step is run (the weights, the log and the
    whole-run loss stay), and the console says so instead of "mean train loss 0"."""
    out = tmp_path / "finished"
    shutil.copytree(reference, out)
    before = (out / "model.safetensors").read_bytes()
    summary = run_training(_cfg(out), resume=True)
    assert [r["step"] for r in _log(out)] == list(range(1, STEPS + 1))
    assert (out / "model.safetensors").read_bytes() == before
    ref_summary = json.loads((reference / "train_summary.json").read_text())
    assert summary["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-6)
    printed = capsys.readouterr()
    assert f"done: nothing left to train (resumed at step {STEPS}, the last" in printed.err
    assert "mean train loss" not in printed.out + printed.err


@pytest.mark.parametrize(("how", "saved_at"), [("signal", 2), ("raise", 1)])
def test_ctrl_c_saves_checkpoint_and_resume_matches(reference, tmp_path, how, saved_at):
    out = tmp_path / "interrupted"
    run = prepare_run(_cfg(out))
    with pytest.raises(TrainingInterrupted) as err:
        train(run, callbacks=[_InterruptAt(saved_at, how)])  # not a save_steps multiple
    # SIGINT is seen by the stop callback at the end of the step it arrived in (or the next)
    assert err.value.checkpoint.name in (f"checkpoint-{saved_at}", f"checkpoint-{saved_at + 1}")
    assert (err.value.checkpoint / "optimizer.pt").exists()
    assert not (out / "model.safetensors").exists()
    run_training(_cfg(out), resume=True)
    ref_w = load_file(str(reference / "model.safetensors"))
    new_w = load_file(str(out / "model.safetensors"))
    for key in ref_w:
        torch.testing.assert_close(new_w[key], ref_w[key], rtol=1e-6, atol=1e-7)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    from emdlm.config import ConfigError

    with pytest.raises(ConfigError, match="no checkpoint"):
        prepare_run(_cfg(tmp_path / "empty"), resume=True)
    assert not (tmp_path / "empty").exists()


def test_lora_run_saves_adapter_and_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    cfg = _cfg(out, "lora.enabled=true", "lora.r=2", "lora.target_modules=[c_attn]",
               "train.max_steps=1", "objective.name=ce", "objective.params={}")
    run = prepare_run(cfg)
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in run.model.parameters())
    assert 0 < trainable < total / 5  # only the adapter trains
    train(run)
    assert (out / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.parametrize(("mode", "noted"), [("emo1", True), ("static", False)])
def test_emo1_run_says_why_its_loss_equals_ce(tmp_path, capsys, mode, noted):
    """Under emo1 the logged loss equals ce in value at every step (Eq. 19); the run
    says so once and logs demd, where EMO's effect shows."""
    run_training(_cfg(
        tmp_path / "run", "objective.name=emo", "objective.cost_embedding=model",
        f"objective.params={{mode: {mode}}}", "train.max_steps=2", "train.save_steps=10",
    ))
    err = capsys.readouterr().err
    assert ("EMO mode emo1: the logged loss equals ce in value" in err) == noted
    for record in _log(tmp_path / "run"):
        assert record["demd"] > 0
        assert (record["loss"] == pytest.approx(record["ce"], rel=1e-5)) == noted
