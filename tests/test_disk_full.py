"""A full disk while `emdlm train` saves a checkpoint or the final model: exit code 3 and one line
saying the disk is full, naming what was being saved and where, and that the previous checkpoint
is intact (checkpoints are written under tmp-checkpoint-<step> and renamed into place, so it is);
the unfinished save is removed, and `--resume` after freeing space finishes the run.

The full disk is simulated at the writers, with the errors a real one gives (measured on a 440 KB
tmpfs with safetensors 0.8 and torch 2.13): safetensors raises SafetensorError("Error while
serializing: I/O error: No space left on device (os error 28)"); torch.save raises
RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos ...") during
RuntimeError("basic_ios::clear: iostream error"), with no errno, and the disk has no space
left."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.training.checkpoints import checkpoint_folders, checkpoint_problem, weights_problem

runner = CliRunner()
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval=null",
    "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
]
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


def _train(out: Path, *args: object) -> tuple[int, str]:
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}",
                                 *map(str, args)])
    return result.exit_code, result.output


def _full_after(monkeypatch: pytest.MonkeyPatch, writes: int) -> list[str]:
    """The disk fills up after ``writes`` model-weight files (transformers' safetensors writer
    raises what it raises on a full disk); returns the files it was asked to write."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_save_file
    asked: list[str] = []

    def writer(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        asked.append(str(filename))
        if len(asked) > writes:
            raise SafetensorError(SAFETENSORS_ENOSPC)
        real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", writer)
    return asked


def _disk_full_line(code: int, text: str) -> str:
    assert code == 3, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert "Traceback" not in text and "SafetensorError" not in text
    return errors[0]


def _only_checkpoint_is(out: Path, step: int) -> None:
    """``checkpoint-<step>`` is the only checkpoint, complete; no unfinished save is left."""
    assert checkpoint_folders(out) == [out / f"checkpoint-{step}"]
    assert checkpoint_problem(out / f"checkpoint-{step}") is None
    assert not list(out.glob("tmp-checkpoint-*"))


def test_disk_full_during_a_checkpoint_save(tmp_path, monkeypatch):
    out = tmp_path / "run"
    asked = _full_after(monkeypatch, writes=1)  # checkpoint-2 fits, checkpoint-4 does not
    code, text = _train(out, "train.max_steps=4", "train.save_steps=2")
    line = _disk_full_line(code, text)
    assert "tmp-checkpoint-4" in asked[-1]
    assert (f"disk full (No space left on device) while saving checkpoint-4 into "
            f"{out / 'tmp-checkpoint-4'}") in line
    assert f"the previous checkpoint {out / 'checkpoint-2'} is intact" in line
    assert "--resume" in line
    _only_checkpoint_is(out, 2)
    monkeypatch.undo()  # space freed: the run continues from checkpoint-2
    code, text = _train(out, "train.max_steps=4", "train.save_steps=2", "--resume")
    assert code == 0, text
    assert json.loads((out / "train_summary.json").read_text())["global_step"] == 4


def test_disk_full_while_torch_saves_the_optimizer_state(tmp_path, monkeypatch):
    """torch.save's full-disk error has no errno and says nothing of space: the disk itself is
    looked at (here: no space left)."""
    out = tmp_path / "run"
    real_save = torch.save
    saved: list[str] = []

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).endswith("optimizer.pt"):
            saved.append(str(f))
            if len(saved) > 1:  # the disk is full from the second checkpoint on
                monkeypatch.setattr(shutil, "disk_usage",
                                    lambda path: types.SimpleNamespace(total=1, used=1, free=0))
                try:
                    raise RuntimeError("basic_ios::clear: iostream error")
                except RuntimeError:
                    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                       "pos 69440 vs 69332") from None
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, text = _train(out, "train.max_steps=4", "train.save_steps=2")
    line = _disk_full_line(code, text)
    assert "disk full (a write failed with 0 bytes left on the disk) while saving checkpoint-4" \
        in line
    assert f"the previous checkpoint {out / 'checkpoint-2'} is intact" in line
    _only_checkpoint_is(out, 2)


def test_disk_full_during_the_final_model_save(tmp_path, monkeypatch):
    """The Trainer saved a checkpoint at the last step before the final model: the message
    points to it (it holds the trained model), and it evaluates."""
    out = tmp_path / "run"
    _full_after(monkeypatch, writes=1)  # checkpoint-2 (the last step) fits, the final model not
    code, text = _train(out, "train.max_steps=2", "train.save_steps=2")
    line = _disk_full_line(code, text)
    ckpt = out / "checkpoint-2"
    assert f"disk full (No space left on device) while saving the final model into {out}" in line
    assert f"the checkpoint {ckpt} is intact and holds the trained model (step 2)" in line
    assert f"`emdlm eval {ckpt}`" in line
    _only_checkpoint_is(out, 2)
    assert weights_problem(ckpt) is None and not (out / "train_summary.json").exists()
    monkeypatch.undo()  # space freed
    result = runner.invoke(app, ["eval", str(ckpt), "--task", "arithmetic", "--n", "2",
                                 "eval.max_new_tokens=2"])
    assert result.exit_code == 0, result.output


def test_other_save_errors_are_not_called_a_full_disk(tmp_path):
    """Only a full disk is reported as one: any other error, or torch's write error while the
    disk has space, is raised as it was."""
    from emdlm.training.saving import DiskFullError, disk_full_error

    assert disk_full_error(PermissionError(13, "Permission denied"), tmp_path, "x") is None
    assert disk_full_error(RuntimeError("CUDA out of memory"), tmp_path, "x") is None
    torch_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1")
    assert disk_full_error(torch_write, tmp_path, "x") is None  # tmp_path's disk has space
    full = disk_full_error(OSError(28, "No space left on device", str(tmp_path / "a.json")),
                           tmp_path, "a.json")
    assert isinstance(full, DiskFullError)
    assert str(full).startswith(f"disk full (No space left on device: {tmp_path / 'a.json'})")
    assert "there is no earlier checkpoint to resume from" in str(full)
