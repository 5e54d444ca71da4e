"""emdlm CLI: help, configs and overrides, input errors before anything is written, and an
end-to-end train + eval."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, load_config, packaged_configs, parse_override

runner = CliRunner()
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval.n=16",
    "train.max_steps=2", "train.batch_size=8", "train.progress_bar=false",
    "train.tensorboard=false",
]


def _invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result, result.output  # stdout and stderr interleaved


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["demo"]])
def test_help(command):
    result, text = _invoke(*command, "--help")
    assert result.exit_code == 0
    assert "Usage" in text
    if command == ["train"]:
        assert "--resume" in text and "overrides" in text


@pytest.mark.parametrize("path", packaged_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.objective.name in ("ce", "emd", "ntil", "emo", "tailr", "mixce")
    assert cfg.data.train is not None


def test_shipped_accelerate_configs_parse():
    from pathlib import Path

    import emdlm

    folder = Path(emdlm.__file__).parent / "configs"
    names = {p.name for p in folder.glob("accelerate_*.yaml")}
    assert {"accelerate_fsdp.yaml", "accelerate_deepspeed.yaml", "accelerate_ddp_cpu.yaml"} <= names
    for name in names:
        data = yaml.safe_load((folder / name).read_text())
        assert data["num_processes"] == 2 and "distributed_type" in data


def test_overrides_and_errors(tmp_path):
    cfg = load_config("arithmetic_ce", [
        "objective.name=ntil", "optim.lr=1e-4", "train.max_steps=7", "data.train.params.ops=+",
        "lora.enabled=true", "lora.target_modules=[c_attn]",
    ])
    assert (cfg.objective.name, cfg.optim.lr, cfg.train.max_steps) == ("ntil", 1e-4, 7)
    assert cfg.data.train.params == {"min_digits": 1, "max_digits": 3, "ops": "+"}
    assert cfg.lora.enabled and cfg.lora.target_modules == ["c_attn"]
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        load_config("arithmetic_ce", ["train.max_step=3"])
    with pytest.raises(ConfigError, match=r"train\.seed must be int"):
        load_config("arithmetic_ce", ["train.seed=abc"])
    with pytest.raises(ConfigError, match=r"objective\.name must be one of"):
        load_config("arithmetic_ce", ["objective.name=mse"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config("arithmetic_ce", ["train.seed"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def _no_digit_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abc+=")}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(folder))
    return folder


def _small_model_folder(folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=20, n_layer=1, n_embd=16, n_head=2)).save_pretrained(
        str(folder)
    )
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_data", "data path not found"),
        ("bad_jsonl", "bad.jsonl:2: not valid JSON"),
        ("missing_model", r"model folder not found: .*no_model \(model\.name\)"),
        ("misspelt_model", r"'tiny-gtp2' is neither a named architecture "
                           r"\(did you mean 'tiny-gpt2'"),
        ("scheduler_typo", r"optim\.scheduler='cosin' is not valid \(did you mean 'cosine'\?\)"),
        ("optim_typo", r"optim\.optim='adamw_troch' is not valid \(did you mean 'adamw_torch'"),
        ("objective_param_typo", r"objective 'ntil' has no parameter objective\.params\.lamda "
                                 r"\(did you mean 'lam'\?\)"),
        ("emd_param_typo", r"no parameter objective\.params\.emd_wieght \(did you mean "
                           r"'emd_weight'"),
        ("non_utf8", r"latin1\.jsonl:2: not UTF-8"),
        ("missing_field", r"missing\.jsonl:1: field 'completion' is missing"),
        ("strict_truncation", r"[1-9]\d* of 64 examples truncated.*data\.on_truncate=error"),
        ("transformers_rejects", "transformers rejected the training settings: .*min_lr"),
        ("plateau_without_eval", "reduce_lr_on_plateau requires an eval strategy"),
        pytest.param(
            "optimizer_package_missing", "install `bitsandbytes`", marks=pytest.mark.skipif(
                __import__("importlib").util.find_spec("bitsandbytes") is not None,
                reason="bitsandbytes installed")),
        ("vocab_mismatch", "tokenizer/model vocab mismatch: the tokenizer has 89 tokens"),
        ("no_digits", "needs digit tokens: .* none of its 8 tokens is a run of ASCII digits"),
        ("emo_without_cost", "needs a cost embedding"),
        ("bad_cost_file", "cost embedding file or model folder not found"),
        ("missing_tokenizer", "tokenizer folder not found"),
        ("unknown_task", "unknown task"),
        ("fsdp_on_cpu", "train.fsdp=true shards the model over processes, but this run has 1"),
    ],
)
def test_bad_input_fails_before_writing(tmp_path, case, message):
    out = tmp_path / "out"
    args = ["train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}"]
    if case == "missing_data":
        args += ["data.train.task=null", f"data.train.path={tmp_path / 'nope.jsonl'}"]
    elif case == "bad_jsonl":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": \n')
        args += ["data.train.task=null", f"data.train.path={bad}"]
    elif case == "missing_model":
        args += [f"model.name={tmp_path / 'no_model'}", "model.params={}"]
    elif case == "misspelt_model":
        args += ["model.name=tiny-gtp2", "model.params={}"]
    elif case == "scheduler_typo":
        args += ["optim.scheduler=cosin"]
    elif case == "optim_typo":
        args += ["optim.optim=adamw_troch"]
    elif case == "objective_param_typo":
        args += ["objective.name=ntil", "objective.params.lamda=0.5"]
    elif case == "emd_param_typo":
        args += ["objective.name=emd", "objective.params.emd_wieght=0.5"]
    elif case == "non_utf8":
        bad = tmp_path / "latin1.jsonl"
        bad.write_bytes(b'{"prompt": "1+1=", "completion": "2"}\n{"prompt": "caf\xe9=", '
                        b'"completion": "2"}\n')
        args += ["data.train.task=null", f"data.train.path={bad}"]
    elif case == "missing_field":
        bad = tmp_path / "missing.jsonl"
        bad.write_text('{"prompt": "1+1="}\n')
        args += ["data.train.task=null", f"data.train.path={bad}"]
    elif case == "strict_truncation":  # 3-digit sums: some answers do not fit in 9 tokens
        args += ["data.max_length=9", "data.on_truncate=error", "data.eval=null"]
    elif case == "plateau_without_eval":
        args += ["optim.scheduler=reduce_lr_on_plateau"]
    elif case == "optimizer_package_missing":
        args += ["optim.optim=adamw_bnb_8bit"]
    elif case == "transformers_rejects":  # a cosine-with-min-lr schedule needs min_lr set
        args += ["optim.scheduler=cosine_with_min_lr"]
    elif case == "vocab_mismatch":
        args += [f"model.name={_small_model_folder(tmp_path / 'm')}", "model.params={}"]
    elif case == "no_digits":
        args += [f"tokenizer={_no_digit_tokenizer(tmp_path / 'tok')}", "objective.name=ntil"]
    elif case == "emo_without_cost":
        args += ["objective.name=emo"]
    elif case == "bad_cost_file":
        args += ["objective.name=emo", f"objective.cost_embedding={tmp_path / 'e.pt'}"]
    elif case == "missing_tokenizer":
        args += [f"tokenizer={tmp_path / 'no_tok'}"]
    elif case == "unknown_task":
        args += ["data.train.task=arithmetics"]
    elif case == "fsdp_on_cpu":
        args += ["train.fsdp=true"]
    result, text = _invoke(*args)
    assert result.exit_code == 2, text
    import re

    assert re.search(message, text), text
    assert not out.exists()  # nothing written half-way


def test_a_plain_value_for_data_train_is_one_line_naming_the_key(tmp_path):
    out = tmp_path / "out"
    result, text = _invoke("train", "-c", "arithmetic_ce", *TINY, "data.train=x",
                           f"output_dir={out}")
    assert result.exit_code == 2, text
    assert isinstance(result.exception, SystemExit) and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "data.train must be a mapping of path, task" in lines[0]
    assert "data.train.path=" in lines[0] and "got 'x'" in lines[0]
    assert not out.exists()


def _mapping_valued_keys(cls: type, where: str = "") -> list[str]:
    """Every key of the run config whose value is a mapping (a section or a dict field), read
    from the dataclasses, so a new one is checked without being listed here."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        allowed = [a for a in (typing.get_args(hint) if union else (hint,)) if a is not type(None)]
        section = next((a for a in allowed if dataclasses.is_dataclass(a)), None)
        if section is not None:
            keys += [where + f.name, *_mapping_valued_keys(section, f"{where}{f.name}.")]
        elif all(typing.get_origin(a) is dict for a in allowed):
            keys.append(where + f.name)
    return keys


def test_every_mapping_valued_key_refuses_a_plain_value():
    from emdlm.config import RunConfig

    keys = _mapping_valued_keys(RunConfig)
    assert {"data", "data.train", "data.eval", "objective.params", "model.params",
            "data.train.params", "train.fsdp_config"} <= set(keys)
    for key in keys:
        for value in ("x", "3", "[1, 2]"):
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be a mapping") as err:
                load_config("arithmetic_ce", [f"{key}={value}"])
            assert "\n" not in str(err.value)


def test_existing_output_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something.txt").write_text("x")
    result, text = _invoke("train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}")
    assert result.exit_code == 2 and "--resume" in text
    result, text = _invoke("train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}",
                           "--overwrite")
    assert result.exit_code == 2 and "not an emdlm run folder" in text
    assert (out / "something.txt").exists()


@pytest.mark.slow
def test_train_then_eval_end_to_end(tmp_path):
    out = tmp_path / "run"
    result, text = _invoke("train", "-c", "arithmetic_ntil", *TINY, "--output", out)
    assert result.exit_code == 0, text
    assert (out / "model.safetensors").exists() and (out / "run_config.yaml").exists()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and "ntil" in log[0]

    result, text = _invoke("eval", out, "--n", 12, "eval.max_new_tokens=5")
    assert result.exit_code == 0, text
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    preds = [json.loads(x) for x in (out / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert metrics["n"] == 12 and len(preds) == 12
    assert {"exact_match", "abs_error_mean", "parse_failure_rate"} <= set(metrics)
    assert {"prompt", "reference", "prediction"} <= set(preds[0])
    assert "exact_match" in text  # the readable table
    assert f"written: {out / 'eval'}/metrics.json, predictions.jsonl\n" in text  # no picture

    # a JSONL test set and an explicit output folder
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                            for i in range(5)))
    result, text = _invoke("eval", out, "--data", data, "--out", tmp_path / "ev")
    assert result.exit_code == 0, text
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["n"] == 5
    # --n with --data keeps the file's first N (it used to set the generator's count only,
    # which a file does not have, and score all 5)
    result, text = _invoke("eval", out, "--data", data, "--n", 3, "--out", tmp_path / "ev3")
    assert result.exit_code == 0, text
    assert json.loads((tmp_path / "ev3" / "metrics.json").read_text())["n"] == 3
    lines = (tmp_path / "ev3" / "predictions.jsonl").read_text().splitlines()
    preds = [json.loads(x) for x in lines]
    assert [r["prompt"] for r in preds] == ["0+1=", "1+1=", "2+1="]

    result, text = _invoke("eval", tmp_path / "nothing_here")
    assert result.exit_code == 2 and "not found" in text


@pytest.mark.slow
def test_train_with_eval_evaluates_the_final_model(tmp_path):
    """`emdlm train --eval` (eval.at_end) evaluates on data.eval after training, as
    `emdlm eval <output>` would, and one line ends a normal run."""
    out = tmp_path / "run"
    result, text = _invoke("train", "-c", "arithmetic_ntil", *TINY, "eval.max_new_tokens=5",
                           "--output", out, "--eval")
    assert result.exit_code == 0, text
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert metrics["n"] == 16 and "exact_match" in text
    assert f"saved: {out} (train loss" in text
    assert f"written: {out / 'eval'}/metrics.json, predictions.jsonl" in text
    result, text = _invoke("train", "-c", "arithmetic_ntil", *TINY, "data.eval=null",
                           "--output", tmp_path / "no_eval", "--eval")
    assert result.exit_code == 2 and "eval.at_end" in text and "data.eval" in text
    assert not (tmp_path / "no_eval").exists()  # refused before anything was written


@pytest.mark.slow
def test_demo_runs_both_objectives_and_prints_table(tmp_path):
    result, text = _invoke(
        "demo", "--out", tmp_path / "demo", "model.params.n_layer=1", "model.params.n_embd=32",
        "data.train.n=64", "data.eval.n=8", "train.max_steps=2", "train.progress_bar=false",
        "train.tensorboard=false",
    )
    assert result.exit_code == 0, text
    rows = json.loads((tmp_path / "demo" / "demo_metrics.json").read_text())
    assert list(rows) == ["ce", "ntil"]
    assert list(rows["ce"])[:2] == ["abs_error_mean", "abs_error_median"]  # numeric error first
    table = (tmp_path / "demo" / "demo_results.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| metric"))
    assert header.split("|")[2].strip() == "ce" and header.split("|")[3].strip() == "ntil"
    assert "one seed" in table
    # the rows that are not comparable across objectives say so
    assert "final_train_loss is each run's own objective" in table
    assert "a cost, not a result" in table
    for name in ("ce", "ntil"):
        assert (tmp_path / "demo" / name / "eval" / "metrics.json").exists()


@pytest.mark.slow
def test_cut_examples_are_reported_and_summarised(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "completion": "2"}] * 6 + [
        {"prompt": "1+1=", "completion": "2" * 20},  # cut: loses its end and EOS
        {"prompt": "9" * 30, "completion": "1"},  # the prompt fills max_length: dropped
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    result, text = _invoke("train", "-c", "arithmetic_ce", *TINY, "data.eval=null",
                           "data.train.task=null", f"data.train.path={data}",
                           "data.max_length=16", "train.max_steps=1", f"output_dir={out}")
    assert result.exit_code == 0, text
    assert f"{data}: 1 of 8 examples truncated, 1 dropped (data.max_length=16)" in text
    cuts = json.loads((out / "train_summary.json").read_text())["data"]["train"]
    assert (cuts["examples"], cuts["truncated"], cuts["dropped"]) == (8, 1, 1)


def test_config_path_prints_the_installed_packaged_file(tmp_path, monkeypatch):
    """Launcher configs are reached by name, not by a path into the repository."""
    monkeypatch.chdir(tmp_path)  # not the repository
    for name in ("accelerate_ddp_cpu", "arithmetic_ntil", "arithmetic_objectives"):
        result, text = _invoke("config-path", name)
        assert result.exit_code == 0, text
        path = Path(text.strip())
        assert path.is_absolute() and path.is_file() and path.stem == name
    assert yaml.safe_load(Path(_invoke("config-path", "accelerate_ddp_cpu")[1].strip())
                          .read_text())["num_processes"] == 2
    result, text = _invoke("config-path", "accelerate_ddp_cp")
    assert result.exit_code == 2 and "did you mean 'accelerate_ddp_cpu'" in text
