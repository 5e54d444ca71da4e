"""A key written twice in YAML is an error naming the key and both lines, everywhere emdlm reads
YAML: run configs, experiment configs, a run's saved run_config.yaml, override values, accelerate
configs. YAML's own loaders keep the last key silently."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, load_config, load_config_dict, parse_override
from emdlm.experiments import load_experiment
from emdlm.training.evaluate import resolve_eval_config
from emdlm.training.launch import accelerate_requested_processes
from emdlm.yaml_io import DuplicateKeyError, safe_load_unique

runner = CliRunner()

TWO_OBJECTIVES = """\
model:
  name: tiny-gpt2
objective:
  name: ntil
train:
  max_steps: 2
objective:
  name: ce
"""


def test_a_key_given_twice_names_the_key_and_both_lines():
    with pytest.raises(DuplicateKeyError, match=r"'objective' is given twice .*lines 3 and 7"):
        safe_load_unique(TWO_OBJECTIVES)
    nested = "train:\n  max_steps: 2\n  seed: 1\n  max_steps: 9\n"
    with pytest.raises(DuplicateKeyError, match=r"'max_steps' .*lines 2 and 4"):
        safe_load_unique(nested)
    # a flow mapping, and keys that Python's dict would fold together (1 and 1.0)
    with pytest.raises(DuplicateKeyError, match="'a'"):
        safe_load_unique("x: {a: 1, b: 2, a: 3}")
    with pytest.raises(DuplicateKeyError, match="given twice"):
        safe_load_unique("1: a\n1.0: b\n")


def test_what_is_not_a_duplicate_still_loads():
    # the same key in two different mappings, list items, and a merge key overridden on purpose
    text = """\
defaults: &defaults
  lr: 0.1
  seed: 1
a:
  <<: *defaults
  lr: 0.5
b: {lr: 0.2}
items: [{lr: 1}, {lr: 2}]
"""
    data = safe_load_unique(text)
    assert data["a"] == {"lr": 0.5, "seed": 1}
    assert data["b"] == {"lr": 0.2} and data["items"] == [{"lr": 1}, {"lr": 2}]
    assert safe_load_unique(text) == yaml.safe_load(text)
    # still a safe loader: python tags are refused
    with pytest.raises(yaml.YAMLError):
        safe_load_unique("x: !!python/object/apply:os.system ['true']")


def test_run_config_with_two_objective_blocks_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(TWO_OBJECTIVES)
    with pytest.raises(ConfigError, match=r"run.yaml: key 'objective' is given twice"):
        load_config_dict(path)
    with pytest.raises(ConfigError, match="lines 3 and 7"):
        load_config(path)


def test_cli_train_refuses_before_writing(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(TWO_OBJECTIVES)
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", "-c", str(path), "-o", str(out)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "'objective' is given twice" in lines[0], result.output
    assert not out.exists()


def test_experiment_with_two_variants_of_one_name_is_refused(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        "base: arithmetic_ce\n"
        "variants:\n"
        "  ce: [objective.name=ce]\n"
        "  ntil: [objective.name=ntil]\n"
        "  ce: [objective.name=emd]\n"
        f"seeds: 2\noutput_dir: {tmp_path / 'exp'}\n"
    )
    with pytest.raises(ConfigError, match=r"exp.yaml: key 'ce' is given twice .*lines 3 and 5"):
        load_experiment(path)
    result = runner.invoke(app, ["experiment", "-c", str(path), "--no-progress"])
    assert result.exit_code == 2 and "'ce' is given twice" in result.output
    assert not (tmp_path / "exp").exists()


def test_a_saved_run_config_with_a_duplicate_is_refused_by_eval(tmp_path):
    (tmp_path / "run_config.yaml").write_text(TWO_OBJECTIVES)
    with pytest.raises(ConfigError, match=r"run_config.yaml: key 'objective' is given twice"):
        resolve_eval_config(tmp_path)


def test_override_value_with_a_duplicate_key_is_refused():
    with pytest.raises(ConfigError, match=r"override .*'a' is given twice"):
        parse_override("objective.params={a: 1, a: 2}")
    assert parse_override("objective.params={a: 1, b: 2}") == (
        ["objective", "params"], {"a": 1, "b": 2})


def test_accelerate_config_with_two_process_counts_is_not_read(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("num_processes: 2\ndistributed_type: MULTI_CPU\nnum_processes: 4\n")
    argv = ["accelerate", "launch", "--config_file", str(path), "-m", "emdlm.cli", "train"]
    assert accelerate_requested_processes(argv) is None  # unknown, not a guess of 2 or 4
    path.write_text("num_processes: 2\ndistributed_type: MULTI_CPU\n")
    assert accelerate_requested_processes(argv) == 2
