"""``objective.name=<module>:<Class>``: a user's loss class trains by name (emdlm.objectives).

The class is the worked example of docs/objectives.md ("Your own loss class"), read from the
page, so the page's code is the code that trains here. Its checks (import, attribute, base
class, parameters, contract) each fail in one line before anything is written; reading a
config never imports the module.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, ObjectiveConfig, build_config, load_config
from emdlm.experiments import expand_grid
from emdlm.experiments.grid import parse_experiment
from emdlm.losses.base import EMDLMLoss
from emdlm.objective_specs import LOSS_BASE
from emdlm.objectives import build_objective, settable_parameters
from emdlm.training.evaluate import resolve_eval_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval.n=8",
    "train.max_steps=2", "train.batch_size=8", "train.progress_bar=false",
    "train.tensorboard=false", "train.logging_steps=1",
]


def _docs_example() -> str:
    """The python block of docs/objectives.md's "Your own loss class" section."""
    doc = (ROOT / "docs" / "objectives.md").read_text(encoding="utf-8")
    section = doc.split("## Your own loss class", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture()
def user_module(tmp_path, monkeypatch) -> str:
    """The docs' ScaledCE as module ``scaled_ce`` on sys.path, plus classes that break the
    contract in one way each; forgotten again after the test."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "scaled_ce.py").write_text(_docs_example() + '''

class NotALoss:
    pass


class NoChunkObjective(ScaledCE):
    has_from_hidden = True


from emdlm.losses.ntil import NTILLoss


class MyNTIL(NTILLoss):
    """NTIL under a name of one's own."""


class NumericWithoutLam(ScaledCE):
    takes_number_mask = True

    def __init__(self, number_vocab, reduction: str = "mean", ignore_index: int = -100):
        super().__init__(reduction=reduction, ignore_index=ignore_index)

    def logits_loss(self, logits, labels, number_mask=None):
        return super().logits_loss(logits, labels)


class NoLoss(EMDLMLoss):
    has_from_hidden = False

    def __init__(self, reduction: str = "mean", ignore_index: int = -100):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index


class KeepsMean(ScaledCE):
    def __init__(self, reduction: str = "mean", ignore_index: int = -100):
        super().__init__(reduction=reduction, ignore_index=ignore_index)
        self.reduction = "mean"
''', encoding="utf-8")
    (folder / "broken_module.py").write_text("raise RuntimeError('boom at import\\nline 2')\n")
    monkeypatch.syspath_prepend(str(folder))
    yield "scaled_ce"
    for name in ("scaled_ce", "broken_module"):
        sys.modules.pop(name, None)


def _build(name: str, char_tokenizer, **params):
    return build_objective(ObjectiveConfig(name=name, params=params), tokenizer=char_tokenizer,
                           model=None, vocab_size=len(char_tokenizer))


def test_the_base_class_path_is_the_loss_base() -> None:
    assert f"{EMDLMLoss.__module__}.{EMDLMLoss.__qualname__}" == LOSS_BASE


def test_a_user_loss_class_trains_by_module_and_class(tmp_path, user_module) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}",
        f"objective.name={user_module}:ScaledCE", "objective.params.scale=2.0",
    ])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "run_config.yaml").read_text())["objective"]
    assert saved == {**saved, "name": "scaled_ce:ScaledCE", "params": {"scale": 2.0}}
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ce" in r and "loss" in r]
    assert len(steps) == 2
    for row in steps:  # the class's own loss: twice its cross-entropy, per scored token
        assert math.isfinite(row["ce"]) and row["ce"] > 0
        assert row["loss"] == pytest.approx(2.0 * row["ce"], rel=1e-4)
    # the run continues under the same class (the resume check compares the saved settings)
    again = CliRunner().invoke(app, [
        "train", "-c", "arithmetic_ce", *TINY, f"output_dir={out}", "train.max_steps=3",
        f"objective.name={user_module}:ScaledCE", "objective.params.scale=2.0", "--resume",
    ])
    assert again.exit_code == 0, again.output
    assert "over 3 steps" in again.output
    # evaluating the run reads its saved config, naming the class, without importing it
    sys.modules.pop(user_module)
    cfg = resolve_eval_config(out)
    assert cfg.objective.name == "scaled_ce:ScaledCE" and user_module not in sys.modules


def test_user_class_parameters_are_checked(user_module, char_tokenizer) -> None:
    loss = _build(f"{user_module}:ScaledCE", char_tokenizer, scale=0.5)
    assert type(loss).__name__ == "ScaledCE" and loss.reduction == "sum" and loss.scale == 0.5
    assert settable_parameters(f"{user_module}:ScaledCE", type(loss)) == ["scale",
                                                                          "ignore_index"]
    with pytest.raises(ConfigError, match=r"has no parameter objective\.params\.scal "
                                          r"\(did you mean 'scale'\?\); it takes scale, "
                                          r"ignore_index$"):
        _build(f"{user_module}:ScaledCE", char_tokenizer, scal=2.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"objective\.params\.scale must be a finite "
                                              r"number > 0"):
            _build(f"{user_module}:ScaledCE", char_tokenizer, scale=bad)
    # the API path checks the same declared domain
    with pytest.raises(ValueError, match="ScaledCE: scale must be a finite number > 0"):
        type(loss)(scale=-1.0)


@pytest.mark.parametrize(("name", "message"), [
    ("no_such_module_xyz:Loss", r"module 'no_such_module_xyz' is not importable "
                                r"\(ModuleNotFoundError"),
    ("broken_module:Loss", r"module 'broken_module' is not importable \(RuntimeError: boom"),
    ("scaled_ce:ScaledEC", r"module 'scaled_ce' has no attribute 'ScaledEC' "
                           r"\(did you mean 'ScaledCE'\?\)"),
    ("scaled_ce:NotALoss", r"class NotALoss does not derive from "
                           r"emdlm\.losses\.base\.EMDLMLoss"),
    ("scaled_ce:F", r"'F' is a module, not a loss class \(a subclass of "
                    r"emdlm\.losses\.base\.EMDLMLoss\)"),
    ("scaled_ce:NoChunkObjective", r"declares has_from_hidden .* implements no "
                                   r"chunk_objective"),
    ("scaled_ce:KeepsMean", r"must keep reduction='sum' as built .* got 'mean'"),
    ("scaled_ce:NoLoss", r"implements no logits_loss\(logits, labels, \.\.\.\) \(nor forward\)"),
])
def test_each_broken_user_class_is_one_line(user_module, char_tokenizer, name, message):
    with pytest.raises(ConfigError, match=message) as caught:
        _build(name, char_tokenizer)
    assert "\n" not in str(caught.value)


def test_a_subclass_of_a_registered_class_keeps_its_contract(user_module, char_tokenizer):
    """Built as its base is (the NumberVocab first), with its base's parameters and domains."""
    cfg = ObjectiveConfig(name=f"{user_module}:MyNTIL", params={"lam": 0.5},
                          lam_schedule="linear", lam_final=0.1)
    loss = build_objective(cfg, tokenizer=char_tokenizer, model=None,
                           vocab_size=len(char_tokenizer))
    assert type(loss).__name__ == "MyNTIL" and loss.settings.lam == 0.5
    assert loss.reduction == "sum"
    with pytest.raises(ConfigError, match=r"objective\.params\.lam must be a finite number >= 0"):
        _build(f"{user_module}:MyNTIL", char_tokenizer, lam=-1.0)


def test_a_teacher_or_a_schedule_the_class_does_not_take_is_refused(
    user_module, char_tokenizer
) -> None:
    with pytest.raises(ConfigError, match="takes no target distribution"):
        build_objective(ObjectiveConfig(name="scaled_ce:ScaledCE"), tokenizer=char_tokenizer,
                        model=None, vocab_size=len(char_tokenizer), teacher=object())
    with pytest.raises(ConfigError, match="objective 'scaled_ce:ScaledCE' has none"):
        build_objective(ObjectiveConfig(name="scaled_ce:ScaledCE", lam_schedule="linear"),
                        tokenizer=char_tokenizer, model=None, vocab_size=len(char_tokenizer))


@pytest.mark.parametrize("name", [":ScaledCE", "scaled ce:X", "a:b:c", "1x:Y", "x.:Y"])
def test_a_malformed_class_reference_is_refused_when_read(name) -> None:
    with pytest.raises(ConfigError, match=r"is not of the form <module>:<Class>"):
        load_config("arithmetic_ce", [f"objective.name={name}"])


def test_a_name_that_yaml_reads_as_a_mapping_is_a_config_error() -> None:
    """``scaled_ce:`` is the YAML mapping {scaled_ce: null}: an error naming the key, not a
    TypeError from switching objectives."""
    with pytest.raises(ConfigError, match=r"^objective\.name must be str, got \{'scaled_ce'"):
        load_config("arithmetic_ce", ["objective.name=scaled_ce:"])


def test_reading_a_config_never_imports_the_module(tmp_path, monkeypatch) -> None:
    """Only building the objective for training imports the named module."""
    (tmp_path / "loud_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config("arithmetic_ce", ["objective.name=loud_module:Loss"])
    assert cfg.objective.name == "loud_module:Loss"
    assert not (tmp_path / "imported").exists() and "loud_module" not in sys.modules


def test_the_cli_refuses_a_missing_module_before_writing(tmp_path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "-c", "arithmetic_ce", *TINY,
                                      f"output_dir={out}", "objective.name=no_such_xyz:Loss"])
    assert result.exit_code == 2
    assert "module 'no_such_xyz' is not importable" in result.output
    assert not out.exists()


def test_an_experiment_grid_takes_a_user_class(tmp_path) -> None:
    base = {**load_config("arithmetic_ce").to_dict(), "output_dir": "unused"}
    exp = parse_experiment({
        "base": base, "seeds": [0], "output_dir": str(tmp_path / "exp"),
        "variants": {"ce": ["objective.name=ce"],
                     "mine": ["objective.name=scaled_ce:ScaledCE", "objective.params.scale=2"]},
    })
    cells = {c.variant: c for c in expand_grid(exp)}
    cfg = build_config(cells["mine"].config)
    assert cfg.objective.name == "scaled_ce:ScaledCE" and cfg.objective.params == {"scale": 2}


@pytest.mark.parametrize(("cls", "extra", "message"), [
    ("ScaledCE", ["train.fused_linear=true"], r"train\.fused_linear .*\(ScaledCE\) has no "
                                              r"from-hidden path"),
    ("NumericWithoutLam", ["objective.lam_schedule=linear", "objective.lam_final=0.1"],
     r"objective\.lam_schedule=linear sets the loss's λ \(settings\.lam\) before each step; "
     r"NumericWithoutLam has none"),
])
def test_a_setting_the_built_class_cannot_serve_is_refused_before_writing(
    tmp_path, user_module, cls, extra, message
) -> None:
    from emdlm.training import prepare_run

    out = tmp_path / "run"
    cfg = load_config("arithmetic_ce", [*TINY, f"output_dir={out}",
                                        f"objective.name={user_module}:{cls}", *extra])
    with pytest.raises(ConfigError, match=message):
        prepare_run(cfg)
    assert not out.exists()


def test_fused_linear_on_a_distillation_objective_is_refused_before_writing(tmp_path) -> None:
    """The distillation objectives have no from-hidden path either: refused before the run
    folder is written, not by a traceback after it."""
    import torch

    from emdlm.config import ModelConfig
    from emdlm.models import build_model
    from emdlm.tokenizers import load_tokenizer
    from emdlm.training import prepare_run

    tok = load_tokenizer("char")
    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok).save_pretrained(
        str(teacher))
    tok.save_pretrained(str(teacher))
    out = tmp_path / "run"
    cfg = load_config("arithmetic_ce", [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=16",
        "objective.name=kl_distill", f"teacher={teacher}", "train.fused_linear=true",
        f"output_dir={out}",
    ])
    with pytest.raises(ConfigError, match=r"'kl_distill' \(KLDistillLoss\) has no from-hidden"):
        prepare_run(cfg)
    assert not out.exists()
