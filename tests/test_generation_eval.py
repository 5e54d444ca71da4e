"""Task metrics during training (train.eval_steps + data.eval): the numbers logged at each
evaluation are what emdlm.evaluation.evaluate_examples gives on the same model and rows."""

from __future__ import annotations

import json

import pytest

from emdlm.config import load_config
from emdlm.evaluation import evaluate_examples
from emdlm.training import run_training
from emdlm.training.evaluate import load_trained
from emdlm.training.generation_eval import check_generation_eval_kind, numeric_log
from emdlm.training.train import generation_eval_rows

pytestmark = pytest.mark.slow

ROWS = 6


def _cfg(out, *extra):
    return load_config("arithmetic_ntil", [
        # trained enough (seed 0) that some answers at step 15 parse as numbers
        "model.params.n_layer=1", "model.params.n_embd=64", "data.train.n=400",
        "data.eval.n=20", "train.batch_size=8", "train.max_steps=30", "train.eval_steps=15",
        "train.save_steps=15", "train.save_total_limit=null", "train.progress_bar=false",
        "train.tensorboard=false", "optim.lr=1e-2", f"eval.rows_during_training={ROWS}",
        "eval.batch_size=4", f"output_dir={out}", *extra,
    ])


def _history(out, last):
    state = json.loads((out / f"checkpoint-{last}" / "trainer_state.json").read_text())
    return state["log_history"]


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_logged_task_metrics_equal_evaluate_examples_at_each_eval_step(tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(out)
    run_training(cfg)
    history = _history(out, 30)
    logged = {r["step"]: r for r in history if "eval_exact_match" in r}
    assert sorted(logged) == [15, 30]
    assert {r["step"] for r in history if "eval_loss" in r} == {15, 30}
    rows = generation_eval_rows(cfg, "text", True)
    assert rows is not None and len(rows) == ROWS
    finite = 0
    for step in (15, 30):
        model, tokenizer = load_trained(out / f"checkpoint-{step}")
        metrics, _ = evaluate_examples(model, tokenizer, rows, kind="number",
                                       max_new_tokens=cfg.eval.max_new_tokens,
                                       with_perplexity=False)
        expected = numeric_log(metrics)
        assert {"eval_exact_match", "eval_abs_error_mean", "eval_parse_failure_rate",
                "eval_n"} <= set(expected)
        for key, value in expected.items():
            assert logged[step][key] == pytest.approx(value, nan_ok=True), (step, key)
        finite += expected["eval_abs_error_mean"] == expected["eval_abs_error_mean"]
    assert finite >= 1  # the errors of parsed answers were compared, not only NaN


def test_switched_off_logs_eval_loss_only_and_generating_leaves_training_alone(tmp_path):
    short = ("train.max_steps=4", "train.eval_steps=2", "train.save_steps=2")
    off, on = tmp_path / "off", tmp_path / "on"
    run_training(_cfg(off, "eval.rows_during_training=0", *short))
    history = _history(off, 4)
    assert {r["step"] for r in history if "eval_loss" in r} == {2, 4}
    assert not any("eval_exact_match" in r for r in history)
    run_training(_cfg(on, *short))
    assert any("eval_exact_match" in r for r in _history(on, 4))
    losses = [[r["loss"] for r in _log(folder)] for folder in (off, on)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]  # greedy: the RNG is not touched


def test_kinds_without_a_short_answer_are_not_generated_during_training(tmp_path):
    with pytest.raises(ValueError, match=r"eval\.rows_during_training=0"):
        check_generation_eval_kind("text")
    assert generation_eval_rows(_cfg(tmp_path, "eval.kind=text"), "text", True) is None
    assert generation_eval_rows(_cfg(tmp_path, "train.eval_steps=null"), "text", True) is None
    assert generation_eval_rows(_cfg(tmp_path, "eval.rows_during_training=0"), "text",
                                True) is None


def test_numeric_log_keeps_numbers_only():
    assert numeric_log({"exact_match": 0.5, "n": 3, "decode": "greedy", "flag": True}) == {
        "eval_exact_match": 0.5, "eval_n": 3.0}


def test_a_negative_row_count_is_refused_naming_the_key(tmp_path):
    from emdlm.config import ConfigError

    with pytest.raises(ConfigError, match=r"eval\.rows_during_training"):
        _cfg(tmp_path, "eval.rows_during_training=-1").validate()
