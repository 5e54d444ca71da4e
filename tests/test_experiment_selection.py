"""A dev sweep's selection rule (``experiment.select``): its checks, hand-worked picks, and the
report's "Selection" subsection from hand-made cell folders (no training)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from _experiment import FAKE_BASE
from emdlm.config import ConfigError
from emdlm.experiments import expand_grid, load_experiment, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.grid import parse_experiment
from emdlm.experiments.selection import parse_selection, pick_group

VARIANTS = ["ce_lr1", "ce_lr2", "ce_lr3", "ntil_lr1", "ntil_lr2", "ntil_lr3"]
GROUPS = {"ce": "ce_lr*", "ntil": ["ntil_lr1", "ntil_lr2", "ntil_lr3"]}


def _rule(**extra):
    return parse_selection({"metric": "abs_error_mean", "groups": GROUPS, **extra}, VARIANTS)


def test_groups_from_a_glob_or_a_list_keep_the_sweep_order():
    rule = _rule(tie="*_lr2")
    assert rule.groups == {"ce": ("ce_lr1", "ce_lr2", "ce_lr3"),
                           "ntil": ("ntil_lr1", "ntil_lr2", "ntil_lr3")}
    assert rule.tie == {"ce": "ce_lr2", "ntil": "ntil_lr2"}
    assert rule.better == "lower"
    assert parse_selection(None, VARIANTS) is None


@pytest.mark.parametrize(("select", "words"), [
    ({"metric": "abs_error_mean", "groups": GROUPS, "rule": "min"}, "unknown experiment.select"),
    ({"metric": "loss_of_vibes", "groups": GROUPS}, "better direction"),
    ({"groups": GROUPS}, "experiment.select.metric"),
    ({"metric": "abs_error_mean"}, "experiment.select.groups must be"),
    ({"metric": "abs_error_mean", "groups": {"emd": "emd_lr*"}}, "matches no variant"),
    ({"metric": "abs_error_mean", "groups": {"ce": ["ce_lr1", "ce_lr9"]}}, "['ce_lr9'] not"),
    ({"metric": "abs_error_mean", "groups": {"ce": ["ce_lr1", "ce_lr1"]}}, "lists a variant twice"),
    ({"metric": "abs_error_mean", "groups": {"a": "*_lr1", "b": ["ce_lr1"]}},
     "in both 'a' and 'b'"),
    ({"metric": "abs_error_mean", "groups": GROUPS, "tie": "ce_*"}, "at most one variant"),
    ({"metric": "abs_error_mean", "groups": GROUPS, "tie": 2}, "must be a glob"),
    ("abs_error_mean", "must be a mapping"),
])
def test_bad_rules_are_refused_naming_the_problem(select, words):
    with pytest.raises(ConfigError, match=r"experiment\.select") as err:
        parse_selection(select, VARIANTS)
    assert words in str(err.value)


def test_the_lowest_mean_over_seeds_is_picked_and_an_end_of_the_sweep_flagged():
    rule = _rule()
    # means: lr1 (10 + 14) / 2 = 12, lr2 (11 + 12) / 2 = 11.5, lr3 (9 + 20) / 2 = 14.5: lr2,
    # though lr3 has the best single seed
    final = {"ce_lr1": {0: 10.0, 1: 14.0}, "ce_lr2": {0: 11.0, 1: 12.0},
             "ce_lr3": {0: 9.0, 1: 20.0}}
    got = pick_group(rule, "ce", final, [0, 1])
    assert (got.pick, got.edge, got.missing) == ("ce_lr2", False, 0)
    assert got.means == {"ce_lr1": 12.0, "ce_lr2": 11.5, "ce_lr3": 14.5}
    final["ce_lr1"] = {0: 8.0, 1: 9.0}
    got = pick_group(rule, "ce", final, [0, 1])
    assert (got.pick, got.edge) == ("ce_lr1", True)


def test_higher_is_better_for_exact_match():
    rule = parse_selection({"metric": "exact_match", "groups": GROUPS}, VARIANTS)
    final = {"ntil_lr1": {0: 0.2}, "ntil_lr2": {0: 0.6}, "ntil_lr3": {0: 0.4}}
    assert pick_group(rule, "ntil", final, [0]).pick == "ntil_lr2"


def test_an_exact_tie_goes_to_the_tie_variant_else_to_the_first_tied():
    final = {"ce_lr1": {0: 5.0}, "ce_lr2": {0: 7.0}, "ce_lr3": {0: 5.0}}
    assert pick_group(_rule(), "ce", final, [0]).pick == "ce_lr1"
    assert pick_group(_rule(tie="*_lr3"), "ce", final, [0]).pick == "ce_lr3"
    # the tie variant is not among the tied: the first tied still wins
    assert pick_group(_rule(tie="*_lr2"), "ce", final, [0]).pick == "ce_lr1"


def test_no_pick_until_every_cell_of_the_group_has_finished():
    final = {"ce_lr1": {0: 5.0, 1: 6.0}, "ce_lr2": {0: 1.0}, "ce_lr3": {}}
    got = pick_group(_rule(), "ce", final, [0, 1])
    assert got.pick is None and got.missing == 3
    assert got.means == {"ce_lr1": 5.5} and got.seeds == {"ce_lr1": 2, "ce_lr2": 1, "ce_lr3": 0}


def test_a_nan_mean_is_never_picked():
    final = {"ce_lr1": {0: math.nan}, "ce_lr2": {0: 50.0}, "ce_lr3": {0: 70.0}}
    assert pick_group(_rule(), "ce", final, [0]).pick == "ce_lr2"
    final = {v: {0: math.nan} for v in ("ce_lr1", "ce_lr2", "ce_lr3")}
    got = pick_group(_rule(), "ce", final, [0])
    assert got.pick is None and got.missing == 0


def _grid(tmp_path, errors: dict[str, list[float]], seeds: list[int],
          variants: dict[str, list[str]] | None = None):
    exp = parse_experiment({
        "name": "sweep", "base": FAKE_BASE, "seeds": seeds,
        "variants": variants or {v: [] for v in VARIANTS},
        "select": {"metric": "abs_error_mean", "groups": GROUPS, "tie": "*_lr2"},
        "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    for cell in cells:
        if cell.variant not in errors or seeds.index(cell.seed) >= len(errors[cell.variant]):
            continue  # unfinished
        folder = eval_dir(cell.folder, 20)
        folder.mkdir(parents=True)
        err = errors[cell.variant][seeds.index(cell.seed)]
        (folder / "metrics.json").write_text(json.dumps(
            {"exact_match": 0.0, "abs_error_mean": err, "n": 1}))
        (folder / "predictions.jsonl").write_text(json.dumps(
            {"prompt": "1+1=", "reference": "2", "prediction": "3", "correct": False,
             "abs_error": err}) + "\n")
        (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    return write_outputs(exp, cells).report.read_text()


def test_the_report_states_each_groups_pick_and_what_is_unfinished(tmp_path):
    errors = {"ce_lr1": [4.0, 6.0], "ce_lr2": [3.0, 3.5], "ce_lr3": [9.0, 1.0],
              "ntil_lr1": [2.0, 2.0], "ntil_lr2": [5.0]}  # ntil_lr2 seed 1, ntil_lr3: running
    report = _grid(tmp_path, errors, [0, 1])
    assert ("### Selection by the config's rule: the lower mean `abs_error_mean` at the final "
            "checkpoint over seeds 0, 1") in report
    assert "| ce | ce_lr1 5; **ce_lr2 3.25**; ce_lr3 5 | `ce_lr2` |" in report
    assert ("| ntil | ntil_lr1 2; ntil_lr2 (1/2 seeds); ntil_lr3 (0/2 seeds) | not yet: 3 "
            "cell(s) unfinished |") in report


def test_the_report_flags_a_pick_at_the_edge_of_the_sweep(tmp_path):
    errors = {v: [1.0 + i] for i, v in enumerate(VARIANTS)}  # lr1 best in both groups
    report = _grid(tmp_path, errors, [0])
    assert "| ce | **ce_lr1 1**; ce_lr2 2; ce_lr3 3 | `ce_lr1` (edge of the sweep) |" in report
    assert "`ntil_lr1` (edge of the sweep)" in report


def test_the_report_writes_the_decided_picks_as_task_variants(tmp_path):
    """The picks, as a test grid's ``task_variants`` block: group name -> the picked variant's
    overrides (YAML that a test grid loads as it is); undecided groups are named, not guessed."""
    variants = {v: [f"optim.lr={i + 1}.0e-3", "train.logging_steps=7"]
                for i, v in enumerate(VARIANTS)}
    errors = {"ce_lr1": [4.0, 6.0], "ce_lr2": [3.0, 3.5], "ce_lr3": [9.0, 1.0],
              "ntil_lr1": [2.0, 2.0], "ntil_lr2": [5.0]}  # ntil undecided
    report = _grid(tmp_path, errors, [0, 1], variants)
    head = ("The picks as a test grid's `task_variants` entry (each group as a variant of that "
            "name, with the picked variant's overrides); not yet decided: ntil:")
    assert head in report
    block = report.split(head, 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == {
        "task_variants": {"default": {"ce": ["optim.lr=2.0e-3", "train.logging_steps=7"]}}}
    assert "# ce_lr2" in block
    test_grid = parse_experiment({
        "base": FAKE_BASE, "variants": {"ce": [], "ntil": []}, "output_dir": str(tmp_path / "t"),
        **yaml.safe_load(block)})
    assert test_grid.task_variants == {"default": {"ce": ["optim.lr=2.0e-3",
                                                          "train.logging_steps=7"]}}
    nothing = _grid(tmp_path / "b", {"ce_lr1": [1.0]}, [0, 1], variants)
    assert "task_variants" not in nothing  # no group decided: no block


def test_the_packaged_dev_sweep_states_its_rule_as_a_select():
    exp = load_experiment("objectives_at_tuned_lr_dev")
    rule = exp.select
    assert rule is not None and rule.metric == "abs_error_mean" and rule.better == "lower"
    assert set(rule.groups) == {"ce", "ntil", "emd", "ntl_was"}
    assert all(len(members) == 4 for members in rule.groups.values())
    assert {g: v.rsplit("_lr", 1)[1] for g, v in rule.tie.items()} == dict.fromkeys(
        rule.groups, "2e-3")
    # every variant is in exactly one group, in the config's sweep order
    assert sorted(v for m in rule.groups.values() for v in m) == sorted(exp.variants)
