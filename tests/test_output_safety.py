"""Output folder safety: --overwrite deletes only what emdlm wrote,
refuses the current folder, its parents and folders holding the run's inputs; a rejected setting
leaves no folder behind, so the corrected command then runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.training.run_folder import MANIFEST, read_manifest

runner = CliRunner()
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval=null",
    "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
    "train.save_steps=1",
]


def _train(*args):
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *TINY, *map(str, args)])
    return result, result.output


def _jsonl(path, n=16):
    path.write_text("".join(
        json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(n)
    ))
    return path


def _fake_old_run(folder):
    """What an older run left: run_config.yaml, logs, a checkpoint, model files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run_config.yaml").write_text("objective: {name: ce}\n")
    (folder / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (folder / "checkpoint-7").mkdir()
    (folder / "checkpoint-7" / "model.safetensors").write_bytes(b"old")
    (folder / "model.safetensors").write_bytes(b"old")
    return folder


@pytest.mark.slow
def test_overwrite_removes_only_what_emdlm_wrote(tmp_path):
    out = tmp_path / "run"
    result, text = _train("train.max_steps=3", f"output_dir={out}")
    assert result.exit_code == 0, text
    assert {"checkpoint-3", "model.safetensors", "run_config.yaml"} <= read_manifest(out)
    # the user's things beside the run, and an eval folder the user added a file to
    (out / "notes.txt").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "data.csv").write_text("1,2")
    (out / "eval").mkdir()
    (out / "eval" / "metrics.json").write_text("{}")
    (out / "eval" / "my_analysis.md").write_text("keep me")

    result, text = _train("train.max_steps=2", f"output_dir={out}", "--overwrite")
    assert result.exit_code == 0, text
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "sub" / "data.csv").read_text() == "1,2"
    assert (out / "eval" / "my_analysis.md").exists()
    assert not (out / "checkpoint-3").exists()  # the old run's checkpoint is gone
    assert (out / "checkpoint-2").exists()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]  # the old run's records were removed
    assert "--overwrite: removed from" in text and "checkpoint-3" in text
    assert "kept: eval, notes.txt, sub" in text
    assert "notes.txt" not in read_manifest(out)


def test_overwrite_without_manifest_removes_known_names_only(tmp_path):
    from emdlm.training.run_folder import clear_run_folder

    out = _fake_old_run(tmp_path / "old")
    (out / "notes.txt").write_text("x")
    (out / "eval").mkdir()
    (out / "eval" / "predictions.jsonl").write_text("")
    removed, kept = clear_run_folder(out)
    assert removed == ["checkpoint-7", "eval", "model.safetensors", "run_config.yaml",
                       "train_log.jsonl"]
    assert kept == ["notes.txt"]



def test_eval_folder_with_a_contact_sheet_or_a_cut_write_is_emdlms(tmp_path):
    """An unrecorded eval/ that holds a VLM's contact sheet, or the temporary file of a write
    that was killed (.metrics.json.<random>.tmp), is still emdlm eval's own; one with a user's
    file, or a look-alike name, is kept."""
    from emdlm.training.run_folder import clear_run_folder

    out = _fake_old_run(tmp_path / "old")
    (out / "eval").mkdir()
    for name in ("predictions.jsonl", "contact_sheet.png", ".metrics.json.k2x9q1.tmp"):
        (out / "eval" / name).write_text("")
    removed, kept = clear_run_folder(out)
    assert "eval" in removed and kept == []
    out = _fake_old_run(tmp_path / "mine")
    (out / "eval").mkdir()
    (out / "eval" / "metrics.json").write_text("{}")
    (out / "eval" / ".my_notes.tmp").write_text("keep me")
    removed, kept = clear_run_folder(out)
    assert "eval" not in removed and kept == ["eval"]
    assert (out / "eval" / ".my_notes.tmp").exists()

def test_hand_edited_manifest_cannot_reach_outside(tmp_path):
    out = _fake_old_run(tmp_path / "run")
    (tmp_path / "precious.txt").write_text("x")
    (out / MANIFEST).write_text(json.dumps({"entries": ["../precious.txt", "..", "/etc"]}))
    assert read_manifest(out) == set()


@pytest.mark.parametrize("where", ["train_data", "eval_data", "config", "nested_data"])
def test_overwrite_refuses_a_folder_holding_the_runs_inputs(tmp_path, where):
    out = _fake_old_run(tmp_path / "run")
    (out / "notes.txt").write_text("x")
    args = [f"output_dir={out}", "train.max_steps=1", "--overwrite"]
    if where == "train_data":
        args += ["data.train.task=null", f"data.train.path={_jsonl(out / 'train.jsonl')}"]
    elif where == "eval_data":
        args += ["data.eval.task=null", f"data.eval.path={_jsonl(out / 'test.jsonl')}"]
    elif where == "nested_data":
        (out / "data").mkdir()
        args += ["data.train.task=null", f"data.train.path={_jsonl(out / 'data' / 't.jsonl')}"]
    else:
        config = out / "my.yaml"
        config.write_text("model: {name: tiny-gpt2}\ntokenizer: char\n")
        result = runner.invoke(app, [
            "train", "-c", str(config), *TINY, "data.train.task=arithmetic", *args])
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    if where != "config":
        result, _ = _train(*args)
    assert result.exit_code == 2, result.output
    assert "--overwrite refuses" in result.output and "holds this run's input" in result.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing touched


@pytest.mark.parametrize("target", [".", "..", "root"])
def test_overwrite_refuses_current_folder_and_parents(tmp_path, monkeypatch, target):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('hi')")
    (project / "run_config.yaml").write_text("objective: {name: ce}\n")  # a copied config
    monkeypatch.chdir(project / "src" if target == ".." else project)
    out = "/" if target == "root" else target
    result, text = _train(f"output_dir={out}", "train.max_steps=1", "--overwrite")
    assert result.exit_code == 2, text
    expected = {".": "the current folder", "..": "a parent of the current folder",
                "root": "a parent of the current folder"}[target]
    assert f"--overwrite refuses output_dir={out}: it is {expected}" in text
    assert (project / "src" / "main.py").exists() and (project / "run_config.yaml").exists()


def test_overwrite_refuses_empty_current_folder_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, text = _train("output_dir=.", "train.max_steps=1", "--overwrite")
    assert result.exit_code == 2 and "it is the current folder" in text
    assert list(tmp_path.iterdir()) == []


def test_resume_and_overwrite_together_is_an_error(tmp_path):
    out = _fake_old_run(tmp_path / "run")
    result, text = _train(f"output_dir={out}", "--overwrite", "--resume")
    assert result.exit_code == 2 and "give --resume or --overwrite, not both" in text
    assert (out / "checkpoint-7").exists()


@pytest.mark.slow
def test_scheduler_typo_writes_nothing_then_corrected_command_runs(tmp_path):
    out = tmp_path / "run"
    result, text = _train("optim.scheduler=cosin", "train.max_steps=1", f"output_dir={out}")
    assert result.exit_code == 2, text
    assert "did you mean 'cosine'?" in text
    assert not out.exists()
    result, text = _train("optim.scheduler=cosine", "train.max_steps=1", f"output_dir={out}")
    assert result.exit_code == 0, text
    assert "not empty" not in text and (out / "model.safetensors").exists()
