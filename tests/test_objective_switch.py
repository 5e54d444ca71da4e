"""Switching objectives with one override: ``objective.name=ce`` on an EMO
config drops what EMO's config set that CE does not take, says so in one line on stderr, and
builds; an explicit wrong parameter is still an error, and what the new objective takes stays.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import load_config, load_config_dict, overrides

TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval.n=8",
    "train.max_steps=1", "train.batch_size=8", "train.progress_bar=false",
    "train.tensorboard=false", "eval.max_new_tokens=4",
]
DROPPED = "dropped objective.params.mode, objective.cost_embedding (ce takes neither)"


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    """Each test sees its own lines (a process says each line once)."""
    monkeypatch.setattr(overrides, "_SAID", set())


def _write_config(tmp_path: Path, name: str, objective: dict, **top) -> Path:
    """The tiny packaged arithmetic config with ``objective`` (and top-level keys) replaced."""
    data = {**load_config_dict("arithmetic_ce"), "objective": objective, **top}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.fixture()
def emo_config(tmp_path) -> Path:
    return _write_config(tmp_path, "emo", {"name": "emo", "params": {"mode": "emo1"},
                                           "cost_embedding": "model"})


def _dropped_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "dropped" in line]


@pytest.mark.slow
def test_emo_config_trains_as_ce_with_one_override(tmp_path, emo_config):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "-c", str(emo_config), *TINY, f"output_dir={out}",
                                      "objective.name=ce"])
    assert result.exit_code == 0, result.output
    assert _dropped_lines(result.output) == [f"objective.name=ce replaces emo: {DROPPED}"]
    saved = yaml.safe_load((out / "run_config.yaml").read_text())["objective"]
    assert saved["name"] == "ce" and saved["params"] == {} and saved["cost_embedding"] is None
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1]


def test_explicit_wrong_param_is_still_an_error(tmp_path, emo_config):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "-c", str(emo_config), *TINY, f"output_dir={out}",
                                      "objective.name=ce", "objective.params.mode=emo1"])
    assert result.exit_code == 2, result.output
    assert "objective 'ce' has no parameter objective.params.mode; it takes ignore_index" in (
        result.output)
    # only the inherited cost embedding went; the explicit mode stayed, to be refused
    assert _dropped_lines(result.output) == [
        "objective.name=ce replaces emo: dropped objective.cost_embedding (ce does not take it)"]
    assert not out.exists()


@pytest.mark.parametrize(
    ("target", "params", "lam", "line"),
    [
        # NTIL and digit EMD take the same parameters and both have λ: nothing goes
        ("emd", {"preset": "paper", "sigma": 0.5, "lam": 0.2}, ("cosine", 0.1), None),
        ("mixce", {}, ("constant", 0.0),
         "objective.name=mixce replaces ntil: dropped objective.params.lam, "
         "objective.params.preset, objective.params.sigma, objective.lam_schedule, "
         "objective.lam_final (mixce takes none of them)"),
    ],
    ids=["emd", "mixce"],
)
def test_numeric_switch_keeps_what_the_new_objective_takes(
    tmp_path, capsys, target, params, lam, line
):
    path = _write_config(tmp_path, "ntil", {
        "name": "ntil", "params": {"preset": "paper", "sigma": 0.5, "lam": 0.2},
        "lam_schedule": "cosine", "lam_final": 0.1})
    cfg = load_config(path, [f"objective.name={target}"])
    assert cfg.objective.name == target and cfg.objective.params == params
    assert (cfg.objective.lam_schedule, cfg.objective.lam_final) == lam
    assert _dropped_lines(capsys.readouterr().err) == ([line] if line else [])


def test_same_objective_drops_nothing(capsys, emo_config):
    cfg = load_config(emo_config, ["objective.name=emo", "train.seed=3"])
    assert cfg.objective.params == {"mode": "emo1"} and cfg.objective.cost_embedding == "model"
    assert capsys.readouterr().err == ""


def test_distillation_to_ce_drops_the_teacher(tmp_path, capsys):
    path = _write_config(tmp_path, "kd", {"name": "kl_distill", "params": {"temperature": 2.0}},
                         teacher=str(tmp_path / "teacher"))
    cfg = load_config(path, ["objective.name=ce"])
    assert cfg.teacher is None and cfg.objective.params == {}
    assert _dropped_lines(capsys.readouterr().err) == [
        "objective.name=ce replaces kl_distill: dropped objective.params.temperature, teacher "
        "(ce takes neither)"]


def test_experiment_variant_switches_once_per_line(tmp_path, capsys, emo_config):
    """An EMO base with a CE variant expands; the switch is said once, not once per cell."""
    from emdlm.experiments.grid import expand_grid, load_experiment

    exp_file = tmp_path / "exp.yaml"
    exp_file.write_text(yaml.safe_dump({
        "base": str(emo_config), "variants": {"emo": [], "ce": ["objective.name=ce"]},
        "seeds": [0, 1, 2], "output_dir": str(tmp_path / "grid"),
    }), encoding="utf-8")
    cells = expand_grid(load_experiment(exp_file))
    objectives = {(c.variant, c.seed): c.config["objective"] for c in cells}
    assert len(objectives) == 6
    for seed in (0, 1, 2):
        assert objectives["ce", seed] == {"name": "ce", "params": {}}
        assert objectives["emo", seed]["params"] == {"mode": "emo1"}
    assert _dropped_lines(capsys.readouterr().err) == [
        f"objective.name=ce replaces emo: {DROPPED}"]

    # the command line's base.* overrides switch the base the same way
    exp = load_experiment(exp_file, ["base.objective.name=ce"])
    assert exp.base["objective"] == {"name": "ce", "params": {}}


def test_eval_config_switches_objective(tmp_path, capsys, emo_config):
    from emdlm.training.evaluate import resolve_eval_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(emo_config.read_text(), encoding="utf-8")
    cfg = resolve_eval_config(run, overrides=["objective.name=ce"])
    assert cfg.objective.name == "ce" and cfg.objective.params == {}
    assert cfg.objective.cost_embedding is None
    assert _dropped_lines(capsys.readouterr().err) == [
        f"objective.name=ce replaces emo: {DROPPED}"]
