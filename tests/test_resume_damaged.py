"""Resume from damaged checkpoints: the checkpoint is checked before the run
folder changes, a damaged newest one is skipped with a warning naming the file, checkpoints are
saved under a temporary name, and train_loss after a resume covers the whole run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, load_config
from emdlm.training import latest_checkpoint, prepare_run, run_training, train
from emdlm.training.checkpoints import checkpoint_problem

pytestmark = pytest.mark.slow

STEPS = 6


def _cfg(out, *extra):
    return load_config("arithmetic_ntil", [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=200",
        "data.eval=null", "train.batch_size=8", "train.grad_accum=2", f"train.max_steps={STEPS}",
        "train.save_steps=3", "train.save_total_limit=null", "train.progress_bar=false",
        "train.tensorboard=false", "optim.warmup_ratio=0.2",
        "objective.params.value_mode=expected", f"output_dir={out}", *extra,
    ])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_training(_cfg(out))
    return out


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _copy_run(reference, out, checkpoints=(3, 6)):
    out.mkdir()
    for step in checkpoints:
        shutil.copytree(reference / f"checkpoint-{step}", out / f"checkpoint-{step}")
    for name in ("run_config.yaml", "train_log.jsonl"):
        shutil.copy(reference / name, out / name)


def _assert_same_weights(a, b):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7)


def test_reference_checkpoints_are_complete(reference):
    for step in (3, 6):
        assert checkpoint_problem(reference / f"checkpoint-{step}") is None
    assert not list(reference.glob("tmp-checkpoint-*"))  # renamed into place


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate_weights", r"checkpoint-6/model\.safetensors is damaged or truncated"),
        ("remove_optimizer", r"checkpoint-6/optimizer\.pt is missing"),
        ("truncate_optimizer", r"checkpoint-6/optimizer\.pt is damaged or truncated"),
        ("truncate_state", r"checkpoint-6/trainer_state\.json is damaged or truncated"),
        ("remove_state", r"checkpoint-6/trainer_state\.json is missing"),
    ],
)
def test_checkpoint_problem_names_the_file(reference, tmp_path, damage, message):
    ckpt = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", ckpt)
    target = {"truncate_weights": "model.safetensors", "truncate_optimizer": "optimizer.pt",
              "truncate_state": "trainer_state.json", "remove_optimizer": "optimizer.pt",
              "remove_state": "trainer_state.json"}[damage]
    if damage.startswith("truncate"):
        _truncate(ckpt / target)
    else:
        (ckpt / target).unlink()
    problem = checkpoint_problem(ckpt)
    assert problem is not None
    import re

    assert re.search(message, problem), problem


def test_damaged_newest_falls_back_and_matches_uninterrupted(reference, tmp_path, capsys):
    out = tmp_path / "run"
    _copy_run(reference, out)
    _truncate(out / "checkpoint-6" / "model.safetensors")
    before = {n: (out / n).read_bytes() for n in ("run_config.yaml", "train_log.jsonl")}

    run = prepare_run(_cfg(out), resume=True)
    warning = capsys.readouterr().err
    assert run.resume_from == out / "checkpoint-3"
    assert "checkpoint-6" in warning and "model.safetensors is damaged" in warning
    assert "resuming from checkpoint-3" in warning
    # the check read only: nothing in the folder changed yet
    assert {n: (out / n).read_bytes() for n in before} == before

    summary = train(run)
    _assert_same_weights(reference, out)
    assert checkpoint_problem(out / "checkpoint-6") is None  # saved again, complete
    ref_summary = json.loads((reference / "train_summary.json").read_text())
    # transformers alone would average steps 4-6 only; the summary covers steps 1-6
    assert summary["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-5)
    assert summary["resumed_from_step"] == 3
    written = json.loads((out / "train_summary.json").read_text())
    assert written["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-5)


def test_no_complete_checkpoint_refuses_and_changes_nothing(reference, tmp_path):
    out = tmp_path / "run"
    _copy_run(reference, out)
    _truncate(out / "checkpoint-6" / "model.safetensors")
    (out / "checkpoint-3" / "scheduler.pt").unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match="no complete checkpoint") as err:
        prepare_run(_cfg(out), resume=True)
    text = str(err.value)
    assert "checkpoint-6/model.safetensors" in text and "checkpoint-3/scheduler.pt" in text
    assert "--resume-from" in text
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_explicit_resume_from_damaged_checkpoint_is_an_error(reference, tmp_path):
    out = tmp_path / "run"
    _copy_run(reference, out)
    _truncate(out / "checkpoint-6" / "model.safetensors")
    result = CliRunner().invoke(app, [
        "train", "-c", "arithmetic_ntil", "model.params.n_layer=1", "model.params.n_embd=32",
        "data.train.n=200", "data.eval=null", f"output_dir={out}",
        "--resume-from", str(out / "checkpoint-6"),
    ])
    assert result.exit_code == 2, result.output
    assert "cannot resume from" in result.output
    assert "checkpoint-6/model.safetensors is damaged or truncated" in result.output
    assert "Traceback" not in result.output


def test_eval_on_damaged_weights_names_the_file(reference, tmp_path):
    ckpt = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", ckpt)
    shutil.copy(reference / "run_config.yaml", tmp_path / "run_config.yaml")
    _truncate(ckpt / "model.safetensors", keep=0.9)
    result = CliRunner().invoke(app, ["eval", str(ckpt), "--task", "arithmetic", "--n", "4"])
    assert result.exit_code == 2, result.output
    assert f"{ckpt}/model.safetensors is damaged or truncated" in result.output
    assert len(result.output.splitlines()) <= 2  # one clear line, not a traceback


def test_kill_during_save_leaves_no_complete_looking_checkpoint(reference, tmp_path, monkeypatch):
    from transformers import Trainer

    out = tmp_path / "run"
    original = Trainer._save_rng_state

    def dies_at_step_6(self, output_dir):
        if self.state.global_step == STEPS:  # model and optimizer already written
            raise SystemExit("killed during the save")
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", dies_at_step_6)
    with pytest.raises(SystemExit):
        run_training(_cfg(out))
    monkeypatch.undo()
    assert not (out / "checkpoint-6").exists()
    assert (out / "tmp-checkpoint-6" / "checkpoint-6" / "model.safetensors").exists()
    assert latest_checkpoint(out) == out / "checkpoint-3"

    run_training(_cfg(out), resume=True)  # resumes from 3, removes the unfinished save
    assert not list(out.glob("tmp-checkpoint-*"))
    _assert_same_weights(reference, out)


def test_eval_on_unfinished_run_points_to_a_checkpoint(reference, tmp_path):
    out = tmp_path / "run"
    _copy_run(reference, out)  # checkpoints only: the run was stopped before its final save
    _truncate(out / "checkpoint-6" / "model.safetensors")
    result = CliRunner().invoke(app, ["eval", str(out), "--task", "arithmetic", "--n", "4"])
    assert result.exit_code == 2, result.output
    assert "holds no model (config.json missing)" in result.output
    assert f"emdlm eval {out / 'checkpoint-3'}" in result.output  # the newest complete one


def test_log_truncation_interrupted_keeps_the_old_log(tmp_path, monkeypatch):
    """Resuming cuts train_log.jsonl back to the checkpoint's step through a temporary file: a
    kill between writing and renaming leaves the whole old log (not an empty or cut one)."""
    import emdlm._files as files
    from emdlm.training.folder_guard import truncate_log

    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    before = log.read_bytes()

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(files.os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            truncate_log(log, 2)
    assert log.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [log.name]
    truncate_log(log, 2)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]
