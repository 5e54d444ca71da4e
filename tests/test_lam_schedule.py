"""The λ schedule of the numeric term: formula by hand, config checks, a training run's log."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from emdlm.cli import app
from emdlm.config import ConfigError, build_config
from emdlm.training.lam_schedule import lam_schedule_callback, scheduled_lam


def test_scheduled_lam_by_hand() -> None:
    assert scheduled_lam("constant", 0.3, 0.0, 0.7) == 0.3
    assert scheduled_lam("linear", 0.3, 0.0, 0.25) == pytest.approx(0.225)
    assert scheduled_lam("linear", 0.1, 0.5, 0.5) == pytest.approx(0.3)  # may rise too
    assert scheduled_lam("cosine", 0.3, 0.1, 0.0) == pytest.approx(0.3)
    assert scheduled_lam("cosine", 0.3, 0.1, 0.5) == pytest.approx(0.2)
    assert scheduled_lam("cosine", 0.3, 0.1, 1.0) == pytest.approx(0.1)
    # cos(π/4) = √2/2: 0.1 + 0.2·(1 + √2/2)/2
    assert scheduled_lam("cosine", 0.3, 0.1, 0.25) == pytest.approx(
        0.1 + 0.2 * (1 + math.sqrt(2) / 2) / 2)
    assert scheduled_lam("linear", 0.3, 0.0, 1.5) == 0.0  # progress clamped to [0, 1]
    with pytest.raises(ValueError, match="lam schedule"):
        scheduled_lam("step", 0.3, 0.0, 0.5)


def test_callback_sets_lam_from_the_global_step() -> None:
    from emdlm.losses.ntil import NTILLoss
    from emdlm.numbers import NumberVocab
    from emdlm.tokenizers import load_tokenizer

    tok = load_tokenizer("char")
    loss = NTILLoss(NumberVocab.from_tokenizer(tok, len(tok)), lam=0.4)
    callback = lam_schedule_callback(loss, "linear", 0.1)

    class State:
        max_steps = 10
        global_step = 0

    for step, expected in ((0, 0.4), (5, 0.25), (10, 0.1), (2, 0.34)):  # a resume: step alone
        State.global_step = step
        callback.on_step_begin(None, State, None)
        assert loss.settings.lam == pytest.approx(expected)
    with pytest.raises(TypeError, match="no λ to schedule"):
        lam_schedule_callback(object(), "linear", 0.0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"objective": {"name": "ce", "lam_schedule": "linear"}}, "has none"),
    ({"objective": {"name": "ntil", "lam_schedule": "cosin"}}, "did you mean 'cosine'"),
    ({"objective": {"name": "ntil", "lam_schedule": "linear", "lam_final": -1}}, "lam_final"),
    ({"objective": {"name": "ntil", "lam_final": 0.1}}, "no effect with"),
])
def test_config_checks(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(changes)


def test_training_log_follows_the_schedule(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["train", "-c", "arithmetic_ntil", "model.params.n_layer=1", "model.params.n_embd=32",
            "data.train.n=64", "data.eval.n=16", "train.max_steps=6", "train.batch_size=8",
            "train.logging_steps=1", "train.progress_bar=false", "train.tensorboard=false",
            "objective.params.mix=static", "objective.params.lam=0.3",
            "objective.lam_schedule=linear", "objective.lam_final=0.06", "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    # static mix: the logged coefficient is λ itself, set before step k from k-1 done steps
    assert [r["mix_coef"] for r in log] == pytest.approx(
        [0.3 + (0.06 - 0.3) * (r["step"] - 1) / 6 for r in log])
