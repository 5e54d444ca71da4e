"""`emdlm sample`: a corpus of a model's own continuations (EMO's oracle experiment), and a
model folder as EMO's cost embedding (the oracle's head for a student trained from scratch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError
from emdlm.objectives import load_cost_embedding
from emdlm.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 with the char tokenizer, saved as a Hugging Face folder."""
    tok = load_tokenizer("char")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    out = tmp_path_factory.mktemp("oracle") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i} + {i} =", "completion": " x"} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sample_writes_prompt_completion_rows(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus.jsonl"
    args = ["sample", str(folder), "--data", str(_prompts(tmp_path)), "--num-samples", "2",
            "--out", str(out), "eval.max_new_tokens=5", "eval.seed=3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = _read(out)
    kept = int(result.output.split("written: ")[1].split(": ")[1].split(" rows")[0])
    assert len(rows) == kept and kept + int(result.output.split("(")[1].split(" empty")[0]) == 6
    assert [r["prompt"] for r in rows] == sorted(r["prompt"] for r in rows)  # prompt-major
    assert all(set(r) == {"prompt", "completion"} and r["completion"].strip() for r in rows)
    # same seed, same samples; the file is not replaced without --overwrite
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "exists; pass --overwrite" in again.output
    assert CliRunner().invoke(app, [*args, "--overwrite"]).exit_code == 0
    assert _read(out) == rows


def test_sample_n_takes_the_first_prompts_of_a_file(folder: Path, tmp_path: Path) -> None:
    """--n with --data keeps the file's first N prompts (its help says so): 2 of the 3."""
    out = tmp_path / "corpus.jsonl"
    args = ["sample", str(folder), "--data", str(_prompts(tmp_path)), "--n", "2",
            "--out", str(out), "eval.max_new_tokens=3", "eval.seed=3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert " from 2 prompts x 1 samples" in result.output
    assert {r["prompt"] for r in _read(out)} <= {"0 + 0 =", "1 + 1 ="}


def test_sample_text_format_and_empty_samples_are_counted(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emdlm.config import build_config
    from emdlm.training import sample as sample_mod

    fake = iter([[" one", "  ", " three"]])
    monkeypatch.setattr("emdlm.generation.generate_answers", lambda *a, **k: next(fake))
    prompts = str(_prompts(tmp_path))
    cfg = build_config({"tokenizer": str(folder), "data": {"eval": {"path": prompts}},
                        "eval": {"num_samples": 1}})
    summary = sample_mod.sample_corpus(folder, cfg, tmp_path / "t.jsonl", fmt="text")
    assert summary["rows"] == 2 and summary["empty_samples"] == 1 and summary["prompts"] == 3
    assert _read(tmp_path / "t.jsonl") == [{"text": "0 + 0 = one"}, {"text": "2 + 2 = three"}]
    with pytest.raises(ConfigError, match="--format must be one of"):
        sample_mod.sample_corpus(folder, cfg, tmp_path / "u.jsonl", fmt="csv")
    assert not (tmp_path / "u.jsonl").exists()


def test_model_folder_as_cost_embedding(folder: Path) -> None:
    model = GPT2LMHeadModel.from_pretrained(folder)
    emb = load_cost_embedding(str(folder), model=None, vocab_size=model.config.vocab_size)
    assert torch.equal(emb, model.lm_head.weight.detach().float())
    with pytest.raises(ConfigError, match=r"must be \[V=7, d\]"):
        load_cost_embedding(str(folder), model=None, vocab_size=7)
    with pytest.raises(ConfigError, match="not a causal-LM folder"):
        load_cost_embedding(str(folder.parent), model=None, vocab_size=7)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_cost_embedding_folder_is_read_without_building_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool, shard: str | None
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from emdlm.models import output_embedding_from_folder

    config = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=101,
                         tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "m", **kwargs)
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file() == bool(shard)

    def no_full_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_full_load)
    head = output_embedding_from_folder(tmp_path / "m")
    assert torch.equal(head, model.get_output_embeddings().weight.detach())
    emb = load_cost_embedding(str(tmp_path / "m"), model=None, vocab_size=101)
    assert emb.dtype == torch.float32 and torch.equal(emb, head.float())


def test_cost_embedding_folder_without_safetensors_loads_the_model(
    folder: Path, tmp_path: Path
) -> None:
    from emdlm.models import output_embedding_from_folder

    model = GPT2LMHeadModel.from_pretrained(folder)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    for name in ("config.json",):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    head = output_embedding_from_folder(tmp_path)  # no safetensors: the model is loaded
    assert torch.equal(head, model.lm_head.weight.detach())


def test_sample_killed_before_the_rename_leaves_the_old_file(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample file is written through a temporary file: an interruption between writing and
    renaming (KeyboardInterrupt at os.replace) leaves the previous file whole and no temp file."""
    import emdlm._files as files

    out = tmp_path / "corpus.jsonl"
    out.write_text('{"prompt": "old", "completion": " kept"}\n')
    before = out.read_bytes()

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    args = ["sample", str(folder), "--data", str(_prompts(tmp_path)), "--num-samples", "2",
            "--out", str(out), "--overwrite", "eval.max_new_tokens=5", "eval.seed=3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130  # the CLI's exit status for Ctrl-C
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "prompts.jsonl"]
