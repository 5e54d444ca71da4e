"""Experiment configs: validation, grid expansion, pairing of seeds, packaged experiments."""

from __future__ import annotations

import pytest
import torch
import yaml

from emdlm.config import ConfigError, build_config, packaged_experiments
from emdlm.experiments import expand_grid, load_experiment
from emdlm.experiments.grid import parse_experiment, select_cells

TINY_BASE = {
    "model": {"name": "tiny-gpt2", "params": {"n_layer": 1, "n_head": 2, "n_embd": 32,
                                              "n_positions": 32}},
    "tokenizer": "char",
    "data": {
        "train": {"task": "arithmetic", "n": 64, "params": {"max_digits": 2}},
        "eval": {"task": "arithmetic", "n": 8, "split": "test", "params": {"max_digits": 2}},
        "max_length": 24,
    },
    "train": {"batch_size": 8, "max_steps": 4, "save_steps": 2, "tensorboard": False},
    "eval": {"kind": "number", "max_new_tokens": 4},
}


def _exp(tmp_path, **extra):
    data = {
        "base": TINY_BASE,
        "variants": {"ce": ["objective.name=ce"], "ntil": ["objective.name=ntil"]},
        "seeds": [0, 1],
        "output_dir": str(tmp_path / "exp"),
        **extra,
    }
    return data


def test_expansion_order_folders_and_overrides(tmp_path):
    exp = parse_experiment(_exp(tmp_path, tasks={"d2": [], "d1": ["data.train.n=32"]}))
    cells = expand_grid(exp)
    assert [c.key for c in cells] == [
        "d2/ce/seed0", "d2/ntil/seed0", "d2/ce/seed1", "d2/ntil/seed1",
        "d1/ce/seed0", "d1/ntil/seed0", "d1/ce/seed1", "d1/ntil/seed1",
    ]
    assert exp.baseline == "ce"  # the first variant by default
    cell = cells[5]  # d1/ntil/seed0
    cfg = build_config(cell.config)
    assert cell.folder == tmp_path / "exp" / "d1" / "ntil" / "seed0"
    assert cfg.output_dir == str(cell.folder / "train")
    assert cfg.objective.name == "ntil" and cfg.train.seed == 0 and cfg.data.train.n == 32
    assert cfg.train.save_total_limit is None  # every checkpoint kept for the learning curve
    # variants of one seed differ only in their own overrides
    a, b = (build_config(c.config).to_dict() for c in cells[:2])
    a.pop("output_dir"), b.pop("output_dir")
    a["objective"].pop("name"), b["objective"].pop("name")
    assert a == b


def test_seed_count_and_cli_style_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(_exp(tmp_path)))
    exp = load_experiment(path, ["seeds=3", "base.train.max_steps=7", "baseline=ntil"])
    assert exp.seeds == [0, 1, 2] and exp.baseline == "ntil"
    assert all(build_config(c.config).train.max_steps == 7 for c in expand_grid(exp))


def test_base_from_packaged_run_config(tmp_path):
    data = _exp(tmp_path, base="arithmetic_ce", base_overrides=["train.max_steps=9"])
    exp = parse_experiment(data)
    cfg = build_config(expand_grid(exp)[0].config)
    assert cfg.tokenizer == "char" and cfg.train.max_steps == 9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"variants": {"ce": ["train.seed=3"]}}, "may not be overridden"),
        ({"variants": {}}, "non-empty mapping"),
        ({"baseline": "emo"}, "is not a variant"),
        ({"seeds": [0, 0]}, "duplicates"),
        ({"output_dir": None}, "output_dir"),
        ({"workers": 0}, "workers must be an integer >= 1"),
        ({"eval": {"checkpoints": "some"}}, "'all', 'final' or a list"),
        ({"eval": {"when": 1}}, "unknown key"),
        ({"varaints": {}}, "unknown experiment key"),
        ({"variants": {"ce": ["objective.nam=ce"]}}, "cell default/ce/seed0"),
        ({"variants": {"ce": "objective.name=ce"}}, "list of key=value"),
        ({"eval": {"extra": {"step-9": ["eval.kind=choice"]}}}, "may not start with 'step-'"),
        ({"eval": {"extra": {"choice": ["eval.kindd=choice"]}}}, r"\(eval.extra.choice\)"),
        ({"eval": {"extra": {"choice": ["train.seed=3"]}}}, "may not be overridden"),
    ],
)
def test_bad_experiments_are_named(tmp_path, change, message):
    data = {**_exp(tmp_path), **change}
    with pytest.raises(ConfigError, match=message):
        expand_grid(parse_experiment(data))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train.params.max_digit=3", r"cell late/ce/seed0: data.train: bad parameters for "
         r"task 'arithmetic': it takes no parameter 'max_digit' \(did you mean 'max_digits'\?\)"),
        ("data.eval.params.min_digits=-3", r"cell late/ce/seed0: data.eval: task 'arithmetic': "
         r"min_digits must be an integer in \[1, 15\], got -3"),
        ("data.eval.task=arithmatic", r"cell late/ce/seed0: data.eval: unknown task 'arithmatic'"),
    ],
)
def test_a_later_tasks_bad_task_parameter_fails_before_any_cell(tmp_path, override, message):
    """A task source's parameters are checked for every cell when the grid is expanded: a typo
    in the last task's overrides must not wait until its first cell starts (hours in)."""
    data = _exp(tmp_path, tasks={"early": [], "late": [override]})
    with pytest.raises(ConfigError, match=message):
        expand_grid(parse_experiment(data))
    assert not (tmp_path / "exp").exists()


def test_task_variants_override_a_variant_in_one_task_only(tmp_path):
    """Each objective's learning rate chosen per task: a (task, variant) entry is applied after
    the variant's own overrides in that task's cells, and nowhere else."""
    data = _exp(tmp_path, tasks={"small": [], "large": ["data.train.params.max_digits=3"]},
                variants={"ce": ["objective.name=ce", "optim.lr=1.0e-3"],
                          "ntil": ["objective.name=ntil", "optim.lr=5.0e-4"]},
                task_variants={"large": {"ntil": ["optim.lr=2.0e-3"]}})
    lrs = {c.key: build_config(c.config).optim.lr for c in expand_grid(parse_experiment(data))}
    assert lrs == {"small/ce/seed0": 1e-3, "small/ntil/seed0": 5e-4,
                   "small/ce/seed1": 1e-3, "small/ntil/seed1": 5e-4,
                   "large/ce/seed0": 1e-3, "large/ntil/seed0": 2e-3,
                   "large/ce/seed1": 1e-3, "large/ntil/seed1": 2e-3}
    # a task added with its own settings leaves the other task's cells as they were (their
    # recorded definitions still match: finished cells are kept)
    alone = _exp(tmp_path, tasks={"small": []},
                 variants=data["variants"])
    before = {c.key: c.config for c in expand_grid(parse_experiment(alone))}
    after = {c.key: c.config for c in expand_grid(parse_experiment(data)) if c.task == "small"}
    assert before == after


@pytest.mark.parametrize(
    ("task_variants", "message"),
    [
        ({"larg": {"ce": ["optim.lr=1e-3"]}},
         r"experiment.task_variants.larg: 'larg' is not a task of this experiment: small, "
         r"large \(did you mean 'large'\?\)"),
        ({"large": {"cee": ["optim.lr=1e-3"]}},
         r"experiment.task_variants.large: 'cee' is not a variant: ce, ntil \(did you mean "
         r"'ce'\?\)"),
        ({"large": {"ce": ["train.seed=3"]}}, "may not be overridden per variant or task"),
        ({"large": {"ce": "optim.lr=1e-3"}}, "list of key=value strings"),
        ({"large": {}}, "non-empty mapping"),
        (["large"], "task_variants must be a mapping"),
        ({"large": {"ce": ["optim.lrr=1e-3"]}}, "cell large/ce/seed0"),
    ],
)
def test_bad_task_variants_are_named(tmp_path, task_variants, message):
    data = _exp(tmp_path, tasks={"small": [], "large": []}, task_variants=task_variants)
    with pytest.raises(ConfigError, match=message):
        expand_grid(parse_experiment(data))


def test_missing_test_set_is_an_error(tmp_path):
    base = {**TINY_BASE, "data": {**TINY_BASE["data"], "eval": None}}
    with pytest.raises(ConfigError, match="no test set"):
        expand_grid(parse_experiment(_exp(tmp_path, base=base)))


def test_variants_of_a_seed_share_data_and_initial_weights(tmp_path):
    """The pairing the statistics rely on: same seed -> same data and same initial weights
    whatever the objective; another seed -> other weights."""
    from emdlm.training import prepare_run

    cells = expand_grid(parse_experiment(_exp(tmp_path)))
    runs = {c.key: prepare_run(build_config(c.config)) for c in cells[:3]}  # writes nothing
    ce0, ntil0, ce1 = runs["default/ce/seed0"], runs["default/ntil/seed0"], runs["default/ce/seed1"]
    assert type(ce0.loss_fn) is not type(ntil0.loss_fn)
    for name, tensor in ce0.model.state_dict().items():
        assert torch.equal(tensor, ntil0.model.state_dict()[name]), name
    assert any(not torch.equal(t, ce1.model.state_dict()[k])
               for k, t in ce0.model.state_dict().items())
    assert [ce0.train_dataset[i]["input_ids"] for i in range(8)] == [
        ntil0.train_dataset[i]["input_ids"] for i in range(8)]
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("path", packaged_experiments(), ids=lambda p: p.name)
def test_packaged_experiments_expand(path, tmp_path):
    exp = load_experiment(path.stem, [f"output_dir={tmp_path}"])
    cells = expand_grid(exp)  # builds and validates every cell's run config
    assert len(cells) == len(exp.variants) * len(exp.seeds) * len(exp.tasks)
    # comparison grids need 5+ paired seeds, EMO's protocol grids (emo_*) the paper's 3, a
    # replication of a finding on fresh seeds (name *_replication) its protocol's 3; a
    # dev-split tuning grid (name *_dev) may use 2
    three = exp.name.startswith("emo_") or exp.name.endswith("_replication")
    min_seeds = 2 if exp.name.endswith("_dev") else 3 if three else 5
    assert exp.baseline in exp.variants and len(exp.seeds) >= min_seeds


def test_extra_evaluations_stack_on_the_eval_overrides(tmp_path):
    """eval.extra.<name> = eval.overrides + its own items, per cell; checked at expansion."""
    data = _exp(tmp_path, eval={"checkpoints": "final", "overrides": ["data.eval.n=7"],
                                "extra": {"other": ["data.eval.split=dev", "data.eval.n=3"]}})
    cells = expand_grid(parse_experiment(data))
    assert all(c.extra_evals == {"other": ["data.eval.n=7", "data.eval.split=dev",
                                           "data.eval.n=3"]} for c in cells)
    assert all(c.eval_overrides == ["data.eval.n=7"] for c in cells)


def test_command_line_base_overrides_win_over_the_files_base_overrides(tmp_path):
    # a packaged experiment sets train.max_steps in base_overrides; the user's
    # base.train.max_steps on the command line must not be silently overwritten by it
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(_exp(tmp_path, base="arithmetic_ce",
                                        base_overrides=["train.max_steps=3000",
                                                        "train.save_steps=500"])))
    exp = load_experiment(path, ["base.train.max_steps=4"])
    cfg = build_config(expand_grid(exp)[0].config)
    assert cfg.train.max_steps == 4 and cfg.train.save_steps == 500
    replaced = load_experiment(path, ["base_overrides=[train.save_steps=2]"])
    cfg = build_config(expand_grid(replaced)[0].config)
    assert cfg.train.save_steps == 2 and cfg.train.max_steps != 3000
    packaged = load_experiment("arithmetic_how_fast", ["base.train.max_steps=5",
                                                       f"output_dir={tmp_path / 'x'}"])
    assert {build_config(c.config).train.max_steps for c in expand_grid(packaged)} == {5}


def test_select_cells_by_shell_pattern_keeps_grid_order(tmp_path):
    cells = expand_grid(parse_experiment(_exp(tmp_path, tasks={"d2": [], "d1": []})))
    keys = lambda picked: [c.key for c in picked]  # noqa: E731
    assert keys(select_cells(cells, ["*/ntil/seed1"])) == ["d2/ntil/seed1", "d1/ntil/seed1"]
    # several patterns: the union, in the grid's order, each cell once
    assert keys(select_cells(cells, ["d1/*/seed0", "*/ce/seed0"])) == [
        "d2/ce/seed0", "d1/ce/seed0", "d1/ntil/seed0"]
    assert keys(select_cells(cells, ["d2/*/seed[01]"])) == [c.key for c in cells[:4]]
    # a pattern that matches nothing is named, even beside one that matches
    with pytest.raises(ConfigError, match=r"--only 'd3/\*' matches no cell.*d2/ce/seed0"):
        select_cells(cells, ["d2/ce/seed0", "d3/*"])
    with pytest.raises(ConfigError, match="matches no cell"):
        select_cells(cells, ["ntil/seed1"])  # the task part is required
