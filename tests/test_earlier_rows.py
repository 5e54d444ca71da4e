"""--earlier-results: a grid carried across machines by its committed results.csv. The report
built from part of the folders plus the earlier file is the report of the whole grid; the file
is checked whole before anything is written; a folder here wins over the file."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from _experiment import FAKE_BASE
from emdlm.cli import app
from emdlm.experiments import expand_grid, run_experiment, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.earlier_rows import EarlierRowsError, read_earlier_rows
from emdlm.experiments.grid import parse_experiment
from emdlm.experiments.stats import compare_paired

SEEDS = [0, 1, 2, 3, 4, 5]
FINAL = {"ce": [9.0, 12.5, 7.0, 15.0, 8.0, 11.0], "ntil": [8.0, 10.0, 6.5, 11.0, 6.0, 9.5]}
HEADER = "task,variant,seed,step,metric,value\n"


def _spec(out) -> dict:
    return {"name": "carried", "base": FAKE_BASE, "seeds": SEEDS,
            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
            "eval": {"checkpoints": "final"}, "output_dir": str(out)}


def _finish(cell, err: float) -> None:
    folder = eval_dir(cell.folder, 20)
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"abs_error_mean": err, "n": 1}))
    (folder / "predictions.jsonl").write_text(json.dumps(
        {"prompt": "1+1=", "reference": "2", "prediction": "3", "correct": False,
         "abs_error": 1.0}) + "\n")
    (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 2.0}))


def _grid(out, seeds_here=SEEDS):
    exp = parse_experiment(_spec(out))
    cells = expand_grid(exp)
    for cell in cells:
        if cell.seed in seeds_here:
            _finish(cell, FINAL[cell.variant][SEEDS.index(cell.seed)])
    return exp, cells


@pytest.fixture
def whole(tmp_path):
    """The whole grid run on one machine: its report and results.csv."""
    exp, cells = _grid(tmp_path / "first")
    return write_outputs(exp, cells, command="emdlm experiment -c carried")


def _ntil_row(report: str) -> str:
    return next(line for line in report.splitlines()
                if line.startswith("| abs_error_mean | ntil |"))


def test_part_here_plus_the_earlier_file_is_the_whole_grids_report(tmp_path, whole):
    exp, cells = _grid(tmp_path / "second", seeds_here=[4, 5])  # seeds 0-3 only in the file
    earlier = read_earlier_rows(whole.results_csv, cells)
    result = write_outputs(exp, cells, command="emdlm experiment -c carried", earlier=earlier)
    report = result.report.read_text()
    assert result.results_csv.read_bytes() == whole.results_csv.read_bytes()
    assert _ntil_row(report) == _ntil_row(whole.report.read_text())
    final = compare_paired(FINAL["ce"], FINAL["ntil"])
    assert f"| abs_error_mean | ntil | {final.mean_diff:.4g} |" in _ntil_row(report)
    assert "Cells finished: 12/12; failed: 0" in report
    assert "8 of the finished cells were read from" in report
    assert "wall times of the 4 cells finished here: 8 s" in report  # 2 s each; none in the file
    passed_over = report.split("4 cell(s) of that file were read from their folders here "
                               "instead: ")[1].split(".")[0]
    assert passed_over == ("default/ce/seed4, default/ntil/seed4, default/ce/seed5, "
                           "default/ntil/seed5")


def test_a_folder_here_wins_over_the_file_and_is_named(tmp_path, whole):
    exp = parse_experiment(_spec(tmp_path / "second"))
    cells = expand_grid(exp)
    here = next(c for c in cells if c.key == "default/ntil/seed0")
    _finish(here, 100.0)
    result = write_outputs(exp, cells, earlier=read_earlier_rows(whole.results_csv, cells))
    text = result.results_csv.read_text()
    assert "default,ntil,0,20,abs_error_mean,100.0" in text
    assert "default,ntil,0,20,abs_error_mean,8.0" not in text
    assert "1 cell(s) of that file were read from their folders here instead: " \
           "default/ntil/seed0" in result.report.read_text()


def test_a_refused_folder_here_is_not_papered_over_by_the_file(tmp_path, whole):
    exp = parse_experiment(_spec(tmp_path / "second"))
    cells = expand_grid(exp)
    cell = next(c for c in cells if c.key == "default/ce/seed1")
    _finish(cell, 5.0)
    (cell.train_dir).mkdir(parents=True)
    (cell.train_dir / "run_config.yaml").write_text(yaml.safe_dump(
        {**yaml.safe_load(yaml.safe_dump(cell.config)), "optim": {"lr": 0.5}}))
    result = write_outputs(exp, cells, earlier=read_earlier_rows(whole.results_csv, cells))
    report = result.report.read_text()
    assert "refused, another definition's work: 1" in report
    assert "Cells finished: 11/12" in report
    assert "default,ce,1," not in result.results_csv.read_text()


@pytest.mark.parametrize(("body", "message"), [
    ("", "not a results.csv"),
    ("task,variant,seed,step,metric\n", "not a results.csv"),
    (HEADER + "default,ce,0,20,abs_error_mean\n", "line 2: 5 fields, expected 6"),
    (HEADER + "default,ce,zero,20,abs_error_mean,1.0\n", "line 2: seed 'zero' is not an integer"),
    (HEADER + "default,ce,0,20,abs_error_mean,big\n", "line 2: value 'big' is not a number"),
    (HEADER + "default,ce,0,20,abs_error_mean,inf\n", "line 2: value 'inf' is infinite"),
    (HEADER + ",ce,0,20,abs_error_mean,1.0\n", "must not be empty"),
    (HEADER + "default,ce,0,20,abs_error_mean,1.0\ndefault,ce,0,20,abs_error_mean,2.0\n",
     "line 3: default/ce/seed0 step 20 abs_error_mean appears twice"),
    (HEADER + "default,ce,9,20,abs_error_mean,1.0\ndefault,emo,0,20,x,1.0\n"
     "default,emo,0,20,y,1.0\n",
     "rows of 2 cell(s) this grid does not have (3 rows: default/ce/seed9, default/emo/seed0)"),
])
def test_a_bad_earlier_file_is_refused_naming_the_problem(tmp_path, body, message):
    _, cells = _grid(tmp_path / "g", seeds_here=[])
    path = tmp_path / "results.csv"
    path.write_text(body)
    with pytest.raises(EarlierRowsError, match=r"results\.csv") as err:
        read_earlier_rows(path, cells)
    assert message in str(err.value)


def test_nan_values_are_kept_and_an_unreadable_file_is_named(tmp_path):
    _, cells = _grid(tmp_path / "g", seeds_here=[])
    path = tmp_path / "results.csv"
    path.write_text(HEADER + "default,ce,0,20,abs_error_median,nan\n")
    rows = read_earlier_rows(path, cells).by_cell["default/ce/seed0"]
    assert len(rows) == 1 and rows[0].value != rows[0].value
    with pytest.raises(EarlierRowsError, match="cannot be read"):
        read_earlier_rows(tmp_path / "missing.csv", cells)


def _config(tmp_path, out) -> str:
    path = tmp_path / "carried.yaml"
    path.write_text(yaml.safe_dump(_spec(out)))
    return str(path)


def test_a_bad_file_stops_the_run_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    bad = tmp_path / "bad.csv"
    bad.write_text("not,a,results,file\n")
    with pytest.raises(EarlierRowsError):
        run_experiment(_config(tmp_path, out), report_only=True, earlier_results=bad)
    assert not out.exists()


def test_cli_rebuilds_a_report_from_the_earlier_file_and_names_it(tmp_path, whole):
    out = tmp_path / "second"
    kept = tmp_path / "kept.csv"
    shutil.copy(whole.results_csv, kept)
    result = CliRunner().invoke(app, ["experiment", "-c", _config(tmp_path, out),
                                      "--report-only", "--earlier-results", str(kept)])
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert f"--earlier-results {kept}" in report
    assert "Cells finished: 12/12" in report and "12 of the finished cells were read" in report
    assert (out / "results.csv").read_bytes() == kept.read_bytes()
