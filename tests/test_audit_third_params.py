"""Third fault audit, parameters and run settings: objective parameters outside their declared
domain, run settings outside theirs (and an integer too big for 64 bits), a resume that would
change what was trained, ``emdlm.patch`` on a model without an output head, and a tokenizer
whose only number tokens have two digits (docs/audit.md, "Parameters, run settings, resume,
patch").

The objective cases iterate the registry (``emdlm.objective_specs.OBJECTIVE_SPECS``) and each
class's signature, so a new objective or parameter is covered by being registered. Symbols
that the fix added are imported inside the tests, so that each test fails on its own against
the code before it.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from _number_tokens import VOCAB
from _objectives import SPECS, random_cost_embedding
from emdlm.cli import app
from emdlm.config import ConfigError, ObjectiveConfig, build_config, load_config
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.objectives import _init_parameters, build_objective, objective_class

runner = CliRunner()
NUMBER_ANNOTATION = re.compile(r"\b(float|int)\b")
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval.n=16",
    "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
]
# what a legal value of a parameter needs besides itself (the class's own rules of combination)
CONTEXT: dict[tuple[str, str], dict[str, Any]] = {
    ("emo", "mu"): {"mode": "static"},
    ("emo_distill", "max_ratio"): {"mode": "emo1"},
    ("tailr", "mixing_ratio"): {"preset": "emo_repo"},
}


def _numeric_params() -> list[tuple[str, str, str]]:
    """(objective, parameter, annotation) of every settable float or int parameter of every
    registered objective, read from the class signatures (not from the declared domains)."""
    from emdlm.objectives import settable_parameters

    found = []
    for name in OBJECTIVE_SPECS:
        cls = objective_class(name)
        settable = set(settable_parameters(name, cls))
        for param in _init_parameters(cls):
            annotation = param.annotation
            text = annotation if isinstance(annotation, str) else inspect.formatannotation(
                annotation)
            if param.name in settable and NUMBER_ANNOTATION.search(text):
                found.append((name, param.name, text))
    return found


NUMERIC_PARAMS = _numeric_params()
FLOAT_PARAMS = [(n, p) for n, p, text in NUMERIC_PARAMS if "float" in text]


def _build(name: str, **kwargs: Any) -> torch.nn.Module:
    return SPECS[name].build(None, digits=VOCAB,
                             cost_embedding=random_cost_embedding(VOCAB.vocab_size, 4, 0),
                             **kwargs)


def _config(name: str, **params: Any) -> Any:
    data: dict[str, Any] = {"objective": {"name": name, "params": params}}
    if OBJECTIVE_SPECS[name].teacher:
        data["teacher"] = "teacher-folder"  # validate checks no file
    return build_config(data)


def _illegal(domain: Any) -> list[Any]:
    """NaN, ±inf, and the values just outside each finite end of ``domain``."""
    values: list[Any] = [math.nan, math.inf, -math.inf]
    if math.isfinite(domain.low):
        values.append(domain.low if domain.low_open else domain.low - 1)
    if math.isfinite(domain.high):
        values.append(domain.high if domain.high_open else domain.high + 1)
    if domain.integer:
        values.append(1.5)
    return values


def _boundaries(domain: Any) -> list[float]:
    """The legal values at (or, for an open end, just inside) each finite end of ``domain``."""
    values = []
    if math.isfinite(domain.low):
        values.append(domain.low + 1e-6 if domain.low_open else float(domain.low))
    if math.isfinite(domain.high):
        values.append(domain.high - 1e-6 if domain.high_open else float(domain.high))
    return values or [0.0]


def test_the_registry_covers_every_numeric_parameter() -> None:
    """Every float or int parameter that ``objective.params`` may set has a declared domain:
    the one table the classes and the config check (the audit found NTIL's ``lam`` unchecked)."""
    assert ("ntil", "lam") in FLOAT_PARAMS and ("emo", "mu") in FLOAT_PARAMS
    missing = [f"{n}.{p}" for n, p, _ in NUMERIC_PARAMS if p not in OBJECTIVE_SPECS[n].domains]
    assert not missing, f"declare a domain for: {missing}"


@pytest.mark.parametrize(("name", "param"), [(n, p) for n, p, _ in NUMERIC_PARAMS],
                         ids=[f"{n}-{p}" for n, p, _ in NUMERIC_PARAMS])
def test_out_of_domain_values_are_refused_by_the_class_and_the_config(name: str,
                                                                      param: str) -> None:
    """NaN, ±inf and values outside the declared domain: a ValueError naming the class and the
    parameter when the loss is built, a ConfigError naming ``objective.params.<param>`` when
    the config is validated (before anything is loaded)."""
    domain = OBJECTIVE_SPECS[name].domains[param]
    cls_name = objective_class(name).__name__
    for value in _illegal(domain):
        with pytest.raises(ValueError, match=rf"^{cls_name}: {param} must be .*got {value!r}"):
            _build(name, **{param: value})
        with pytest.raises(ConfigError, match=rf"objective\.params\.{param} must be "):
            _config(name, **{param: value})


@pytest.mark.parametrize(("name", "param"), FLOAT_PARAMS,
                         ids=[f"{n}-{p}" for n, p in FLOAT_PARAMS])
def test_boundary_values_are_accepted(name: str, param: str) -> None:
    """The legal ends of each float parameter's domain build the loss and pass the config."""
    domain = OBJECTIVE_SPECS[name].domains[param]
    context = CONTEXT.get((name, param), {})
    for value in _boundaries(domain):
        loss = _build(name, **context, **{param: value})
        assert isinstance(loss, torch.nn.Module)
        _config(name, **context, **{param: value})


def _train(*args: str) -> Any:
    return runner.invoke(app, ["train", *args])


def _error_lines(result: Any) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.name=ntil", "objective.params.lam=.nan"], "objective.params.lam must be"),
        (["objective.name=ntil", "objective.params.lam=-1"], "objective.params.lam must be"),
        (["objective.name=ntil", "objective.params.alpha=-1"], "objective.params.alpha must"),
        (["objective.name=ntil", "objective.params.beta=.nan"], "objective.params.beta must"),
        (["objective.name=ntil", "objective.params.emd_weight=.inf"], "params.emd_weight must"),
        (["objective.name=emd", "objective.params.lam=.nan"], "objective.params.lam must be"),
        (["objective.name=emd", "objective.params.lam=-1"], "objective.params.lam must be"),
        (["objective.name=emo", "objective.params.mu=.nan"], "objective.params.mu must be"),
        (["train.max_steps=0"], "train.max_steps must be an integer >= 1, or -1, got 0"),
        (["train.max_steps=-2"], "train.max_steps must be an integer >= 1, or -1, got -2"),
        (["optim.weight_decay=-5"], "optim.weight_decay must be a finite number >= 0"),
        (["optim.lr=.nan"], "optim.lr must be a finite number > 0, got nan"),
        (["optim.lr=0"], "optim.lr must be a finite number > 0, got 0"),
        (["optim.betas=[0.9, 1.0]"], r"optim.betas must be Adam's two numbers"),
        (["lora.dropout=1"], "lora.dropout must be a finite number in [0, 1)"),
        (["optim.warmup_ratio=2"], "optim.warmup_ratio must be a finite number in [0, 1]"),
    ],
)
def test_cli_refuses_bad_parameters_in_one_line_before_the_run_folder(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    out = tmp_path / "run"
    result = _train("-c", "arithmetic_ntil", *TINY, "train.max_steps=2", *overrides,
                    f"output_dir={out}")
    assert result.exit_code == 2, result.output
    lines = _error_lines(result)
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_a_too_big_integer_in_yaml_is_one_line(tmp_path: Path) -> None:
    """``train.max_steps`` with 401 digits in a YAML file: one line, no OverflowError."""
    config = tmp_path / "big.yaml"
    config.write_text("data: {train: {task: arithmetic, n: 64}}\n"
                      f"train: {{max_steps: {10**400}}}\n", encoding="utf-8")
    out = tmp_path / "run"
    result = _train("-c", str(config), "tokenizer=char", f"output_dir={out}")
    assert result.exit_code == 2, result.output
    lines = _error_lines(result)
    assert len(lines) == 1 and "train.max_steps must be an integer >= 1, or -1" in lines[0]
    assert "64 bits" in lines[0] and len(lines[0]) < 300  # the 401 digits are not echoed
    assert not out.exists()


def test_every_run_setting_domain_refuses_nan_and_inf() -> None:
    """Each declared run setting refuses NaN and ±inf by name; max_steps keeps -1 (train for
    train.epochs) and any count >= 1."""
    from emdlm.config import RUN_SETTING_DOMAINS

    assert {"optim.lr", "optim.weight_decay", "train.max_steps"} <= set(RUN_SETTING_DOMAINS)
    for key in RUN_SETTING_DOMAINS:
        for value in (".nan", ".inf", "-.inf"):
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be "):
                load_config("arithmetic_ce", [f"{key}={value}"])
    assert load_config("arithmetic_ce", ["train.max_steps=-1"]).train.max_steps == -1
    assert load_config("arithmetic_ce", ["train.max_steps=1"]).train.max_steps == 1
    assert load_config("arithmetic_ce", ["optim.weight_decay=0"]).optim.weight_decay == 0


def test_max_steps_minus_one_trains_by_epochs(tmp_path: Path) -> None:
    """-1, the default, leaves the length to train.epochs (transformers' max_steps=-1)."""
    from emdlm.training.train import training_arguments

    cfg = load_config("arithmetic_ce", ["train.max_steps=-1", "train.epochs=2"])
    args = training_arguments(cfg, tmp_path, has_eval=False)
    assert (args.max_steps, args.num_train_epochs) == (-1, 2)
    with pytest.raises(ConfigError, match=r"set train\.max_steps >= 1 or train\.epochs > 0"):
        load_config("arithmetic_ce", ["train.max_steps=-1", "train.epochs=0"])


# ---------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A 2-step NTIL run with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("resume") / "run"
    args = ["-c", "arithmetic_ntil", *TINY, "train.max_steps=2", "train.save_steps=2",
            f"output_dir={out}"]
    result = _train(*args)
    assert result.exit_code == 0, result.output
    return out, args


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["objective.name=ce"], "objective.name ('ntil' -> 'ce')"),
        (["model.params.n_layer=2"], "model.params.n_layer (1 -> 2)"),
        (["optim.lr=0.5", "train.seed=3"], "optim.lr (0.002 -> 0.5), train.seed (0 -> 3)"),
        (["objective.params.lam=0.9"], "objective.params.lam ((absent) -> 0.9)"),
    ],
)
def test_resume_that_changes_the_training_is_refused_before_writing(
    trained_run: tuple[Path, list[str]], change: list[str], named: str
) -> None:
    out, args = trained_run
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    result = _train(*args, "--resume", *change)
    assert result.exit_code == 2, result.output
    lines = _error_lines(result)
    assert len(lines) == 1 and "would change what it was trained with" in lines[0], result.output
    assert named in lines[0]
    assert "Traceback" not in result.output
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # run_config.yaml, train_summary.json, the log: untouched


def test_resume_may_extend_the_run_and_change_logging_and_eval(
    trained_run: tuple[Path, list[str]]
) -> None:
    """train.max_steps (longer), logging, saving and eval settings may change on resume."""
    import yaml

    out, args = trained_run
    result = _train(*args, "--resume", "train.max_steps=3", "train.logging_steps=3",
                    "eval.batch_size=4")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "run_config.yaml").read_text())
    assert saved["train"]["max_steps"] == 3 and saved["objective"]["name"] == "ntil"


def test_resume_rule_is_checked_against_the_saved_config(tmp_path: Path) -> None:
    """The rule itself: keys of RESUME_MAY_CHANGE pass, others are named; a key an older
    run_config.yaml lacks counts as its default."""
    import yaml

    from emdlm.training.folder_guard import RESUME_MAY_CHANGE, check_resume_settings

    cfg = load_config("arithmetic_ntil")
    saved = cfg.to_dict()
    del saved["train"]["fused_linear"]  # written by an older emdlm: the default
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(saved))
    check_resume_settings(tmp_path, cfg)
    assert "eval" in RESUME_MAY_CHANGE and "train.max_steps" in RESUME_MAY_CHANGE
    check_resume_settings(tmp_path, load_config("arithmetic_ntil", [
        "train.max_steps=5000", "eval.kind=text", "data.eval=null", "train.save_steps=7"]))
    with pytest.raises(ConfigError, match=r"train\.fused_linear \(False -> True\)"):
        check_resume_settings(tmp_path, load_config("arithmetic_ntil",
                                                    ["train.fused_linear=true"]))
    with pytest.raises(ConfigError, match=r"data\.train\.n \(40000 -> 5\)"):
        check_resume_settings(tmp_path, load_config("arithmetic_ntil", ["data.train.n=5"]))


# ---------------------------------------------------------------- emdlm.patch


def test_patch_refuses_a_model_without_an_output_head() -> None:
    """GPT2Model (the backbone, no LM head) ignores labels: patching it would train nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    import emdlm
    from emdlm.losses.ce import CrossEntropyLoss

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    for from_hidden in (False, True):
        with pytest.raises(TypeError, match=r"emdlm\.patch: GPT2Model has no output head"):
            emdlm.patch(GPT2Model(config), CrossEntropyLoss(reduction="sum"),
                        from_hidden=from_hidden)
        model = GPT2LMHeadModel(config)
        handle = emdlm.patch(model, CrossEntropyLoss(reduction="sum"), from_hidden=from_hidden)
        ids = torch.tensor([[1, 2, 3, 4]])
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
        handle.undo()


# ---------------------------------------------------------------- two-digit number tokens


def _two_digit_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer whose only number tokens are '00'..'99' (no '0'..'9')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "+", "=", *(f"{i:02d}" for i in range(100))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(folder))
    return folder


def test_two_digit_number_tokens_cli_and_api_agree(tmp_path: Path) -> None:
    """Only '00'..'99': NTIL / digit EMD / NTL score them (each a class of 100 candidates), so
    the factory the CLI uses accepts the tokenizer as the API does; where only '0'..'9' would
    be scored (digits_only, the official preset) both refuse with the same true reason."""
    from emdlm.losses.ntil import NTILLoss
    from emdlm.tokenizers import load_tokenizer

    tok = load_tokenizer(str(_two_digit_tokenizer(tmp_path / "tok")))
    vocab = len(tok)
    for name in ("ntil", "emd", "ntl_mse"):
        loss = build_objective(ObjectiveConfig(name=name), tokenizer=tok, model=None,
                               vocab_size=vocab)
        labels = torch.tensor([[5, 17, 3, 40]])  # '02', '14', '+', '37'
        out = loss(torch.randn(1, 4, vocab), labels)
        assert out.components["n_digit_tokens"] == 3  # the number tokens are scored
    NTILLoss(tok, vocab_size=vocab)
    reason = "digits_only scores only the single-digit tokens '0'..'9'"
    with pytest.raises(ValueError, match=re.escape(reason)):
        NTILLoss(tok, vocab_size=vocab, preset="official")
    with pytest.raises(ConfigError, match=re.escape(reason)):
        build_objective(ObjectiveConfig(name="ntil", params={"preset": "official"}),
                        tokenizer=tok, model=None, vocab_size=vocab)
    out = tmp_path / "run"
    result = _train("-c", "arithmetic_ntil", *TINY, "train.max_steps=1",
                    f"tokenizer={tmp_path / 'tok'}", "objective.params.preset=official",
                    "model.params.n_positions=64", f"output_dir={out}")
    assert result.exit_code == 2, result.output
    assert reason in _error_lines(result)[0] and "run of digits" not in result.output
    assert not out.exists()
