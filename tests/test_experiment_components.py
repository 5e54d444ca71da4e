"""Training-loss components of a grid's runs: window means by hand, the report's table."""

from __future__ import annotations

import json

import pytest

from _experiment import FAKE_BASE
from emdlm.experiments import expand_grid, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE
from emdlm.experiments.components import (
    TRAIN_LOG,
    component_summary,
    read_train_log,
    window_means,
)
from emdlm.experiments.grid import parse_experiment


def _log(n_steps: int, ce_at, extra=None) -> list[dict]:
    rows = []
    for step in range(1, n_steps + 1):
        row = {"step": step, "epoch": step / 7, "lr": 1e-3, "loss": 2 * ce_at(step),
               "ce": ce_at(step), "n_tokens": 40.0}
        if extra:
            row.update(extra(step))
        rows.append(row)
    return rows


def test_window_means_by_hand() -> None:
    # steps 1..20: start = steps 1-2, middle = steps 10-11 (> 9, <= 11), end = steps 19-20
    rows = _log(20, lambda s: float(s), lambda s: {"mix_coef": 0.5, "bad": float("nan")})
    means = window_means(rows)
    assert means["ce"] == {"start": 1.5, "middle": 10.5, "end": 19.5}
    assert means["loss"] == {"start": 3.0, "middle": 21.0, "end": 39.0}
    assert means["mix_coef"] == {"start": 0.5, "middle": 0.5, "end": 0.5}
    assert "bad" not in means  # non-finite values are skipped, never averaged into NaN
    assert not {"step", "epoch", "lr", "n_tokens"} & set(means)  # bookkeeping, not components
    assert window_means([]) == {}


def test_read_train_log_keeps_numbers_only(tmp_path) -> None:
    path = tmp_path / TRAIN_LOG
    path.write_text('{"step": 1, "ce": 2, "objective": "ntil", "flag": true}\n\n'
                    '{"step": 2, "ce": 1.5}\n', encoding="utf-8")
    assert read_train_log(path) == [{"step": 1.0, "ce": 2.0}, {"step": 2.0, "ce": 1.5}]


def test_read_train_log_leaves_out_a_torn_last_line(tmp_path, capsys) -> None:
    """A run killed while appending leaves half a line at the end: the report reads the rest
    and says what it left out; a bad line in the middle is an error naming it."""
    path = tmp_path / TRAIN_LOG
    path.write_text('{"step": 1, "ce": 2}\n{"step": 2, "ce": 1.5}\n{"step": 3, "c', "utf-8")
    assert read_train_log(path) == [{"step": 1.0, "ce": 2.0}, {"step": 2.0, "ce": 1.5}]
    assert "its last line is incomplete" in capsys.readouterr().err
    path.write_text('{"step": 1, "ce": 2}\n{"step": 2, "c\n{"step": 3, "ce": 1}\n', "utf-8")
    with pytest.raises(ValueError, match=r"train_log.jsonl, line 2: not JSON"):
        read_train_log(path)
    path.write_text('{"step": 1, "ce": 2}\n{"step": 2, "c\n', "utf-8")  # complete, yet bad
    with pytest.raises(ValueError, match=r"line 2: not JSON"):
        read_train_log(path)


@pytest.fixture
def grid(tmp_path):
    exp = parse_experiment({"name": "fake", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    for cell in cells:
        offset = float(cell.seed)  # seed 1's CE is 1 higher at every step
        extra = (lambda s: {"ntil": 3.0 - s / 10, "mix_coef": 0.2}) if cell.variant == "ntil" \
            else None
        rows = _log(20, lambda s, o=offset: 10.0 - s / 4 + o, extra)
        cell.train_dir.mkdir(parents=True)
        (cell.train_dir / TRAIN_LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if not (cell.variant == "ntil" and cell.seed == 1):  # one unfinished cell: left out
            (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    return exp, cells


def test_summary_averages_finished_seeds(grid) -> None:
    _, cells = grid
    summary = component_summary(cells, "default")
    # ce: start mean over steps 1-2 = 10 - 0.375 = 9.625, seeds 0 and 1 -> 10.125
    assert summary["ce"].seeds == 2 and summary["ntil"].seeds == 1  # ntil seed 1 unfinished
    assert summary["ce"].means["ce"]["start"] == pytest.approx(10.125)
    assert summary["ce"].means["ce"]["end"] == pytest.approx(10.0 - 4.875 + 0.5)
    assert summary["ntil"].means["ce"]["start"] == pytest.approx(9.625)
    assert summary["ntil"].means["ntil"]["end"] == pytest.approx(3.0 - 1.95)
    assert "ntil" not in summary["ce"].means


def test_report_has_the_components_table(grid) -> None:
    exp, cells = grid
    for cell in cells:  # write_outputs needs an evaluation per finished cell
        if (cell.folder / CELL_DONE).is_file():
            step = cell.folder / "eval" / "step-20"
            step.mkdir(parents=True)
            (step / "metrics.json").write_text(json.dumps({"exact_match": 0.5}))
            (step / "predictions.jsonl").write_text("")
    report = write_outputs(exp, cells).report.read_text()
    assert "### Training-loss components" in report

    def cell(*windows: float) -> str:
        return " → ".join(f"{w:.3g}" for w in windows)

    ce0 = (9.625, 7.375, 5.125)  # 10 - s/4 over steps 1-2, 10-11, 19-20 (seed 0)
    expected = [
        f"| ce (2) | {cell(*(2 * (c + 0.5) for c in ce0))} | {cell(*(c + 0.5 for c in ce0))} "
        "| – | – |",  # seeds 0 and 1: CE 0.5 higher on average
        f"| ntil (1) | {cell(*(2 * c for c in ce0))} | {cell(*ce0)} | {cell(0.2, 0.2, 0.2)} "
        f"| {cell(2.85, 1.95, 1.05)} |",
    ]
    assert "| variant | loss | ce | mix_coef | ntil |" in report
    for line in expected:
        assert line in report.splitlines()
