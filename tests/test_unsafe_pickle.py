"""A model folder (or cost-embedding file) whose pickled weights would run code when unpickled:
torch's `weights_only` unpickler refuses it, and emdlm says so in one line naming the file,
wherever it loads one (`emdlm train` model / teacher / cost embedding, `emdlm eval`, VLM
folders), instead of torch's 100-line UnpicklingError. The pickle calls `os.system("touch
<marker>")` if ever unpickled unsafely; each test checks the marker was never created."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, ModelConfig
from emdlm.models import build_model, load_tokenizer

runner = CliRunner()
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=16", "data.eval=null",
    "train.batch_size=8", "train.max_steps=1", "train.progress_bar=false",
    "train.tensorboard=false",
]


class _RunsCode:
    """Unpickled without weights_only, this would call os.system("touch <marker>")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _poison(path: Path, marker: Path) -> Path:
    """A torch.save file (a valid zip archive) whose pickle calls os.system."""
    torch.save({"transformer.wte.weight": _RunsCode(marker)}, str(path))
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "code_ran"
    yield path
    assert not path.exists(), "the malicious pickle was executed"


@pytest.fixture
def evil_model(tmp_path: Path, marker: Path) -> Path:
    """A tiny GPT-2 folder (config.json, char tokenizer) whose only weights are a malicious
    pytorch_model.bin."""
    tok = load_tokenizer("char")
    folder = tmp_path / "evil_model"
    build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok).save_pretrained(
        str(folder))
    tok.save_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    _poison(folder / "pytorch_model.bin", marker)
    return folder


def _one_line_refusal(code: int, text: str, file: Path) -> str:
    """Exit 2 and one error line naming ``file``; none of torch's many-line message."""
    assert code == 2, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert f"refused to unpickle {file}: it is not a plain tensor file" in errors[0], text
    assert "weights_only" in errors[0]
    assert "Traceback" not in text and "Check the documentation of torch.load" not in text
    return errors[0]


def _train(out: Path, *args: object) -> tuple[int, str]:
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}",
                                 *map(str, args)])
    return result.exit_code, result.output


def test_train_with_a_malicious_model_folder_is_refused(tmp_path, evil_model, marker):
    code, text = _train(tmp_path / "run", f"model.name={evil_model}", "model.params={}")
    _one_line_refusal(code, text, evil_model / "pytorch_model.bin")
    assert not (tmp_path / "run").exists()


def test_train_with_a_malicious_teacher_is_refused(tmp_path, evil_model, marker):
    code, text = _train(tmp_path / "run", "objective.name=kl_distill", f"teacher={evil_model}")
    line = _one_line_refusal(code, text, evil_model / "pytorch_model.bin")
    assert f"teacher {evil_model}" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source", ["file", "folder"])
def test_train_with_a_malicious_cost_embedding_is_refused(tmp_path, evil_model, marker, source):
    path = _poison(tmp_path / "emb.pt", marker) if source == "file" else evil_model
    code, text = _train(tmp_path / "run", "objective.name=emo",
                        f"objective.cost_embedding={path}")
    file = path if source == "file" else evil_model / "pytorch_model.bin"
    line = _one_line_refusal(code, text, file)
    assert "cost embedding" in line
    assert not (tmp_path / "run").exists()


def test_eval_of_a_malicious_model_folder_is_refused(evil_model, marker):
    result = runner.invoke(app, ["eval", str(evil_model), "--task", "arithmetic", "--n", "2"])
    _one_line_refusal(result.exit_code, result.output, evil_model / "pytorch_model.bin")
    assert not (evil_model / "eval").exists()


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_a_malicious_vlm_folder_is_refused_for_training_and_eval(tmp_path, marker, name):
    from emdlm.config import load_config
    from emdlm.training.image_text import load_trained_vlm
    from emdlm.vlm.models import build_vlm, folder_model_type, named_family, prepare_vlm_tokenizer

    tok = prepare_vlm_tokenizer(load_tokenizer("char"), named_family(name))
    built = build_vlm(ModelConfig(name=name), tok)
    folder = tmp_path / "evil_vlm"
    built.model.save_pretrained(str(folder))
    built.image_processor.save_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    _poison(folder / "pytorch_model.bin", marker)
    expected = f"refused to unpickle {folder / 'pytorch_model.bin'}: it is not a plain tensor"
    with pytest.raises(ConfigError) as refused:
        build_vlm(ModelConfig(name=str(folder)), tok)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
    model_type = folder_model_type(folder)
    assert model_type is not None
    with pytest.raises(ConfigError) as refused:
        load_trained_vlm(folder, model_type, tok, load_config(None, []))
    assert expected in str(refused.value) and "\n" not in str(refused.value)
