"""Settings that used to fail only after training (eval settings, eval.checkpoints that are never
saved) or in every cell (seeds numpy refuses) are refused before anything runs: one line naming
the key and the value, exit code 2, no folder written."""

from __future__ import annotations

import pytest
import yaml
from transformers import set_seed
from typer.testing import CliRunner

from _experiment import TINY_BASE
from emdlm.cli import app
from emdlm.config import ConfigError, build_config
from emdlm.experiments import expand_grid
from emdlm.experiments.grid import parse_experiment

LARGEST_SEED = 2**32 - 1  # numpy's np.random.seed, which transformers.set_seed calls


def _experiment_file(tmp_path):
    data = {"name": "early", "base": TINY_BASE, "variants": {"ce": ["objective.name=ce"]},
            "seeds": [0], "workers": 1, "eval": {"checkpoints": "all"},
            "output_dir": str(tmp_path / "grid")}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _error_line(result) -> str:
    """The command's only stderr line (a one-line error)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("base.eval.batch_size=0", "eval.batch_size must be an integer >= 1, got 0"),
        ("base.eval.batch_size=-4", "eval.batch_size must be an integer >= 1, got -4"),
        ("base.eval.max_new_tokens=0", "eval.max_new_tokens must be an integer >= 1, got 0"),
        ("eval.overrides=[eval.batch_size=0]",
         "cell default/ce/seed0 (eval): eval.batch_size must be an integer >= 1, got 0"),
        ("eval.checkpoints=[10,15]", "experiment.eval.checkpoints step 15 is not a multiple of "
                                     "train.save_steps=10 nor the final step 20"),
        ("eval.checkpoints=[30]",
         "experiment.eval.checkpoints step 30 is beyond train.max_steps=20"),
        ("seeds=[-1]", "experiment.seeds[0]=-1: a seed must be an integer from 0 to "
                       f"{LARGEST_SEED}"),
        ("seeds=0", "experiment.seeds=0: a count n means seeds 0 .. n-1 and must be >= 1"),
        ("base.data.train.params.max_digit=3", "cell default/ce/seed0: data.train: bad "
         "parameters for task 'arithmetic': it takes no parameter 'max_digit' (did you mean "
         "'max_digits'?)"),
    ],
    ids=["eval_batch_size_0", "eval_batch_size_negative", "eval_max_new_tokens_0",
         "eval_overrides_batch_size_0", "checkpoint_not_saved", "checkpoint_beyond_max_steps",
         "seed_negative", "seed_count_0", "task_parameter_misspelt"],
)
def test_experiment_refuses_before_any_cell_trains(tmp_path, override, message):
    """Before: the eval settings failed in every cell after its training, the checkpoints
    after all cells trained (the runner's RuntimeError), seeds=[-1] in every cell."""
    path = _experiment_file(tmp_path)
    result = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress", override])
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert line.startswith("error: ") and message in line
    assert not (tmp_path / "grid").exists()  # no cell folder, no checkpoint, no report


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.batch_size=0", "eval.batch_size must be an integer >= 1, got 0"),
        ("eval.max_new_tokens=-1", "eval.max_new_tokens must be an integer >= 1, got -1"),
        ("train.seed=-1", "train.seed=-1 is not a usable seed"),
        ("data.eval.params.max_digit=3", "data.eval: bad parameters for task 'arithmetic': it "
         "takes no parameter 'max_digit' (did you mean 'max_digits'?)"),
        ("data.train.n=1000000000000", "data.train: task 'arithmetic': n must be an integer "
         "in [1, 10000000], got 1000000000000"),
    ],
    ids=["eval_batch_size_0", "eval_max_new_tokens_negative", "train_seed_negative",
         "task_parameter_misspelt", "task_count_too_large"],
)
def test_train_refuses_bad_settings_writing_nothing(tmp_path, override, message):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(TINY_BASE))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "-c", str(config), f"output_dir={out}",
                                      "train.max_steps=2", override])
    assert result.exit_code == 2, result.output
    assert message in _error_line(result)
    assert not out.exists()


def test_eval_refuses_a_zero_batch_size_before_looking_for_the_model(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "no_model"), "--task", "arithmetic",
                                      "eval.batch_size=0"])
    assert result.exit_code == 2
    assert "eval.batch_size must be an integer >= 1, got 0" in _error_line(result)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"eval": {"do_sample": True, "temperature": 0.0}},
         "eval.temperature must be > 0 when sampling"),
        ({"eval": {"kind": "text", "top_p": 1.5}}, r"eval.top_p must be in \[0, 1\] when sampling"),
        ({"train": {"seed": 2**32}}, "train.seed=4294967296 is not a usable seed"),
        ({"data": {"train": {"task": "arithmetic", "seed": -3}}},
         "data.train.seed=-3 is not a usable seed"),
    ],
    ids=["sampling_temperature_0", "sampling_top_p_above_1", "train_seed_too_large",
         "data_seed_negative"],
)
def test_run_config_refuses_settings_that_fail_only_at_run_time(change, message):
    with pytest.raises(ConfigError, match=message):
        build_config({**TINY_BASE, **change})


def test_greedy_evaluation_ignores_the_sampling_temperature():
    """temperature 0 means nothing without sampling (a common way to say "greedy"): kept; with
    sampling it is refused."""
    assert build_config({**TINY_BASE, "eval": {"temperature": 0.0}}).eval.temperature == 0.0
    with pytest.raises(ConfigError, match=r"eval\.temperature must be > 0"):
        build_config({**TINY_BASE, "eval": {"temperature": 0.0, "do_sample": True}})


def _grid(tmp_path, **change):
    data = {"base": TINY_BASE, "variants": {"ce": []}, "seeds": [0],
            "output_dir": str(tmp_path / "grid"), **change}
    return expand_grid(parse_experiment(data))


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        (-1, r"experiment.seeds=-1: a count n means seeds 0 .. n-1 and must be >= 1"),
        (0, r"experiment.seeds=0: a count n means seeds 0 .. n-1 and must be >= 1"),
        ([-1], r"experiment.seeds\[0\]=-1: a seed must be an integer from 0 to 4294967295"),
        ([0, 3, -2], r"experiment.seeds\[2\]=-2: a seed must be"),
        ([2**32], r"experiment.seeds\[0\]=4294967296: a seed must be"),
        ([0, 1.5], r"experiment.seeds\[1\]=1.5: a seed must be"),
        ([True], r"experiment.seeds\[0\]=True: a seed must be"),
        ([], r"experiment.seeds must be a count >= 1 or a non-empty list of seeds, got \[\]"),
        ("3", r"experiment.seeds must be a count >= 1 or a non-empty list of seeds, got '3'"),
        ([1, 2, 1], r"experiment.seeds has duplicates: \[1\] more than once in \[1, 2, 1\]"),
        # a typo, not a grid: refused before a billion-entry list is built
        (10**9, r"experiment.seeds=1000000000: at most 10000 seeds"),
        (list(range(10_001)), r"experiment.seeds lists 10001 seeds: at most 10000"),
    ],
    ids=["count_negative", "count_0", "negative", "negative_later_entry", "too_large", "float",
         "bool", "empty_list", "string", "duplicates", "count_huge", "list_huge"],
)
def test_bad_seeds_say_what_is_wrong(tmp_path, seeds, message):
    with pytest.raises(ConfigError, match=message):
        _grid(tmp_path, seeds=seeds)


def test_seeds_are_those_set_seed_accepts(tmp_path):
    """The bounds are transformers.set_seed's own: the largest seed it takes is accepted, the
    next is refused by both."""
    set_seed(LARGEST_SEED)
    with pytest.raises(ValueError, match="Seed must be between 0 and 2\\*\\*32 - 1"):
        set_seed(LARGEST_SEED + 1)
    assert [c.seed for c in _grid(tmp_path, seeds=[0, LARGEST_SEED])] == [0, LARGEST_SEED]
    assert [c.seed for c in _grid(tmp_path, seeds=3)] == [0, 1, 2]
    with pytest.raises(ConfigError, match="4294967296"):
        _grid(tmp_path, seeds=[LARGEST_SEED + 1])


def test_checkpoints_must_be_saved_steps_or_the_final_one(tmp_path):
    """save_steps 10, max_steps 25: 10 and 20 are saved, 25 is the final model; 15 is never
    saved and 30 never reached. With an epoch-based run the final step is unknown here, so
    only multiples of save_steps pass."""
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 25}}
    cells = _grid(tmp_path, base=base, eval={"checkpoints": [10, 20, 25]})
    assert cells[0].checkpoints == [10, 20, 25]
    for steps, message in (([15], "step 15 is not a multiple of train.save_steps=10 nor the "
                                  "final step 25"),
                           ([10, 30], "step 30 is beyond train.max_steps=25")):
        with pytest.raises(ConfigError, match=message):
            _grid(tmp_path, base=base, eval={"checkpoints": steps})
    epochs = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": -1, "epochs": 1}}
    assert _grid(tmp_path, base=epochs, eval={"checkpoints": [20]})[0].checkpoints == [20]
    with pytest.raises(ConfigError, match=r"step 25 is not a multiple of train.save_steps=10, "):
        _grid(tmp_path, base=epochs, eval={"checkpoints": [25]})
