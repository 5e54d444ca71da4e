"""Evaluation outputs count only when whole: metrics.json is written last and counts the rows of
predictions.jsonl; the experiment runner and report take a step (a cell) as done only when the
two agree, and every file they write goes through a temporary name renamed into place.

The cut files here are what a killed ``emdlm eval`` left with the older writer (metrics.json
first, then the rows streamed in place): cut at a line boundary (29 of 50 rows) or mid-line."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from _experiment import FAKE_BASE
from emdlm.cli import app
from emdlm.eval_outputs import write_eval_outputs
from emdlm.experiments import expand_grid, run_cells, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.grid import parse_experiment

ROWS = 50  # rows of a whole test set
CUT = 29  # rows a killed write left behind


def _rows(n: int, seed: int = 0) -> list[dict]:
    """n predictions.jsonl rows of a numeric task: every answer off by ``seed``."""
    return [{"prompt": f"{i}+0=", "reference": str(i), "prediction": str(i + seed),
             "correct": seed == 0, "abs_error": float(seed)} for i in range(n)]


def _legacy_step(folder: Path, rows: list[dict], n: int | None = None) -> None:
    """An evaluation folder as emdlm wrote it before n_predictions: metrics.json (with the
    task's own count ``n``, or no count when ``n`` is None) and the rows, each in place."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {"exact_match": 1.0, "abs_error_mean": rows[0]["abs_error"] if rows else 0.0}
    if n is not None:
        metrics["n"] = n
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _grid(tmp_path: Path) -> tuple[object, list]:
    """A 2-variant x 2-seed grid (no training): final step 20, checkpoints 'final'."""
    exp = parse_experiment({"name": "cut", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "eval": {"checkpoints": "final"},
                            "output_dir": str(tmp_path / "out")})
    return exp, expand_grid(exp)


def _finish(cell, rows: list[dict], *, legacy: bool) -> Path:
    """Mark ``cell`` done with one evaluated step (20) holding ``rows``; its folder."""
    folder = eval_dir(cell.folder, 20)
    if legacy:
        _legacy_step(folder, rows, n=len(rows))
    else:
        write_eval_outputs(folder, {"exact_match": 1.0, "abs_error_mean": 0.0}, rows)
    (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0, "evaluated_steps": [20]}))
    return folder


def _cut_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` whole lines of ``path`` (a write cut at a line boundary)."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:keep]))


def _cut_mid_line(path: Path, line: int) -> None:
    """Cut ``path`` half-way through its ``line``-th line (1-based)."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: line - 1]) + lines[line - 1][: len(lines[line - 1]) // 2])


def _csv_cells(path: Path) -> set[tuple[str, str]]:
    with path.open() as fh:
        return {(r["variant"], r["seed"]) for r in csv.DictReader(fh)}


# ---------------------------------------------------------------------------------------------
# the report: a cut step is never a source of numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [True, False], ids=["older_metrics_n", "n_predictions"])
def test_report_leaves_out_a_step_cut_at_a_line_boundary(tmp_path, legacy):
    """29 of 50 rows and a metrics.json counting 50 (the task's ``n`` in folders of older
    emdlm, ``n_predictions`` now): the cell is left out, named with the file, and nothing of it
    reaches results.csv; the whole cells (older format included) are reported as before."""
    exp, cells = _grid(tmp_path)
    folders = [_finish(cell, _rows(ROWS, cell.seed), legacy=legacy) for cell in cells]
    cut = folders[1] / "predictions.jsonl"  # ntil/seed0
    _cut_lines(cut, CUT)
    result = write_outputs(exp, cells)
    assert _csv_cells(result.results_csv) == {("ce", "0"), ("ce", "1"), ("ntil", "1")}
    (why,) = result.left_out.values()
    assert list(result.left_out) == ["default/ntil/seed0"]
    assert f"{cut} has {CUT} rows but" in why and f"records {ROWS}" in why
    report = result.report.read_text()
    assert "Cells finished: 3/4; failed: 0; left out, outputs not whole: 1" in report
    assert f"- `default/ntil/seed0`: {why}" in report.splitlines()


def test_report_names_a_predictions_file_cut_mid_line_in_one_line(tmp_path):
    """`emdlm experiment --report-only` over a cell whose predictions.jsonl ends half-way
    through row 30: no JSONDecodeError traceback; one warning line naming file:line; the
    other cells are reported."""
    _, cells = _grid(tmp_path)
    folders = [_finish(cell, _rows(ROWS), legacy=True) for cell in cells]
    cut = folders[2] / "predictions.jsonl"  # ce/seed1
    _cut_mid_line(cut, CUT + 1)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "cut", "base": FAKE_BASE, "seeds": [0, 1],
                                    "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                                    "eval": {"checkpoints": "final"},
                                    "output_dir": str(tmp_path / "out")}))
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--report-only"])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and "JSONDecodeError" not in res.output
    warnings = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: default/ce/seed1 left out of the report: {cut}:30:")
    assert _csv_cells(tmp_path / "out" / "results.csv") == {("ce", "0"), ("ntil", "0"),
                                                           ("ntil", "1")}


def test_report_names_a_broken_line_inside_a_file_of_the_right_length(tmp_path):
    """50 lines, as metrics.json counts, but line 12 is not JSON: left out, named file:line."""
    exp, cells = _grid(tmp_path)
    folders = [_finish(cell, _rows(ROWS), legacy=False) for cell in cells]
    broken = folders[0] / "predictions.jsonl"
    lines = broken.read_text().splitlines(keepends=True)
    lines[11] = '{"prompt": "11+0=", "refer\n'
    broken.write_text("".join(lines))
    result = write_outputs(exp, cells)
    assert result.left_out["default/ce/seed0"].startswith(f"{broken}:12: not valid JSON")
    assert ("ce", "0") not in _csv_cells(result.results_csv)


def test_a_torn_cell_done_record_is_not_a_finished_cell(tmp_path):
    """cell_done.json cut mid-write by an older emdlm: the report does not crash on it, names
    it, and counts the cell as not finished."""
    exp, cells = _grid(tmp_path)
    for cell in cells:
        _finish(cell, _rows(ROWS), legacy=False)
    (cells[3].folder / CELL_DONE).write_text('{"wall_s": 1.0, "evalua')
    result = write_outputs(exp, cells)
    assert "ntil/seed1/cell_done.json is not a JSON object" in result.left_out["default/ntil/seed1"]
    assert "Cells finished: 3/4" in result.report.read_text()


# ---------------------------------------------------------------------------------------------
# the runner: a cut step is evaluated again, a cell marked done with one runs again
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_eval(monkeypatch):
    """evaluate_run replaced by a writer of 50 whole rows; the list of folders it wrote."""
    import emdlm.training

    calls: list[Path] = []

    def evaluate_run(model_dir, cfg, *, out_dir=None, name=None):
        calls.append(Path(out_dir))
        metrics = {"exact_match": 0.5, "abs_error_mean": 3.0, "n": ROWS}
        write_eval_outputs(out_dir, metrics, _rows(ROWS, 3))
        return {"name": name, "metrics": metrics, "out_dir": str(out_dir)}

    monkeypatch.setattr(emdlm.training, "evaluate_run", evaluate_run)
    return calls


def test_runner_evaluates_again_a_step_cut_at_a_line_boundary(tmp_path, fake_eval):
    from emdlm.experiments.runner import _evaluate_once

    target = tmp_path / "step-20"
    _legacy_step(target, _rows(CUT), n=ROWS)  # an older emdlm's killed write
    assert _evaluate_once(tmp_path, None, target)["abs_error_mean"] == 3.0
    assert fake_eval == [target]
    assert len((target / "predictions.jsonl").read_text().splitlines()) == ROWS
    _evaluate_once(tmp_path, None, target)  # now whole: read back, not evaluated again
    assert fake_eval == [target]


def test_a_cell_marked_done_with_a_cut_step_runs_again(tmp_path, fake_eval, monkeypatch):
    """An older emdlm took a cut step as evaluated and wrote cell_done.json: the next
    invocation does not skip the cell; it evaluates the step again (training is not redone)
    and writes a new record."""
    from emdlm.experiments import runner

    monkeypatch.setattr(runner, "_train", lambda cell: {"global_step": 20})
    _, cells = _grid(tmp_path)
    cell = cells[0]
    folder = _finish(cell, _rows(ROWS), legacy=True)
    _cut_mid_line(folder / "predictions.jsonl", CUT + 1)
    (outcome,) = run_cells([cell], workers=1, threads=1, progress=False)
    assert outcome.status == "done"
    assert fake_eval == [folder]
    assert json.loads((folder / "metrics.json").read_text())["n_predictions"] == ROWS
    assert json.loads((cell.folder / CELL_DONE).read_text())["evaluated_steps"] == [20]
    (again,) = run_cells([cell], workers=1, threads=1, progress=False)
    assert again.status == "skipped" and fake_eval == [folder]


def test_a_cut_step_whose_checkpoint_is_gone_fails_the_cell_naming_the_folder(
        tmp_path, fake_eval, monkeypatch):
    """checkpoints 'all' with the checkpoints deleted (keep_checkpoints: false): the cut
    step 10 cannot be evaluated again, so the cell fails and says which folder to delete;
    it is not marked done around the hole."""
    from emdlm.experiments import runner

    monkeypatch.setattr(runner, "_train", lambda cell: {"global_step": 20})
    exp = parse_experiment({"name": "gone", "base": FAKE_BASE, "variants": {"ce": []},
                            "output_dir": str(tmp_path / "out")})
    (cell,) = expand_grid(exp)
    _finish(cell, _rows(ROWS), legacy=True)  # step 20, whole
    cut = eval_dir(cell.folder, 10)
    _legacy_step(cut, _rows(CUT), n=ROWS)
    (outcome,) = run_cells([cell], workers=1, threads=1, progress=False)
    assert outcome.status == "failed" and fake_eval == []
    assert f"delete {cut} to finish the cell without that step" in outcome.error
    assert not (cell.folder / CELL_DONE).exists()


# ---------------------------------------------------------------------------------------------
# the writers: whole files or none
# ---------------------------------------------------------------------------------------------


def _rows_failing_at(k: int) -> list[dict]:
    """50 rows whose k-th cannot be written (not JSON): the writer stops there, as if killed."""
    rows = _rows(ROWS)
    rows[k] = {"prompt": object()}
    return rows


def test_a_write_cut_short_leaves_nothing_that_looks_finished(tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(TypeError):
        write_eval_outputs(out, {"exact_match": 1.0, "n": ROWS}, _rows_failing_at(CUT))
    assert sorted(p.name for p in out.iterdir()) == []  # no metrics, no partial rows, no temp
    # over an earlier, finished evaluation: its metrics.json goes first, so the folder no
    # longer reads as finished; its rows stay whole (the new ones never replaced them)
    write_eval_outputs(out, {"exact_match": 1.0}, _rows(ROWS))
    with pytest.raises(TypeError):
        write_eval_outputs(out, {"exact_match": 0.0}, _rows_failing_at(CUT))
    assert sorted(p.name for p in out.iterdir()) == ["predictions.jsonl"]
    assert len((out / "predictions.jsonl").read_text().splitlines()) == ROWS


def test_metrics_json_counts_the_rows_and_the_readers_check_them(tmp_path):
    out = tmp_path / "eval"
    write_eval_outputs(out, {"exact_match": 1.0}, iter(_rows(ROWS)))  # any iterable of rows
    assert json.loads((out / "metrics.json").read_text())["n_predictions"] == ROWS
    from emdlm.eval_outputs import (
        EvalOutputError,
        eval_outputs_problem,
        read_eval_outputs,
        read_predictions,
    )

    assert eval_outputs_problem(out) is None and len(read_eval_outputs(out)[1]) == ROWS
    preds = out / "predictions.jsonl"
    _cut_mid_line(preds, CUT + 1)
    assert eval_outputs_problem(out).startswith(f"{preds}:{CUT + 1}: the last line is cut off")
    with pytest.raises(EvalOutputError, match=f"predictions.jsonl:{CUT + 1}: "):
        read_predictions(preds)
    # a folder of an older emdlm with no row count at all: the ending newline is the check
    old = tmp_path / "old"
    _legacy_step(old, _rows(CUT), n=None)
    assert eval_outputs_problem(old) is None
    _cut_mid_line(old / "predictions.jsonl", CUT)
    assert f"predictions.jsonl:{CUT}: the last line is cut off" in eval_outputs_problem(old)


@pytest.fixture
def renames(monkeypatch):
    """Every os.replace (source, destination): how a file written whole is put in place."""
    done: list[tuple[Path, Path]] = []
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        done.append((Path(src), Path(dst)))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return done


def test_cell_done_json_is_written_whole(tmp_path, fake_eval, monkeypatch):
    """cell_done.json goes through a temporary file renamed into place: a process killed
    before the rename leaves no record (and no temporary file once the error unwinds)."""
    from emdlm.experiments import runner

    monkeypatch.setattr(runner, "_train", lambda cell: {"global_step": 20})
    real = os.replace

    def killed_at_the_record(src, dst, *args, **kwargs):
        if Path(dst).name == CELL_DONE:
            raise OSError("killed before the rename")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killed_at_the_record)
    _, cells = _grid(tmp_path)
    (outcome,) = run_cells([cells[0]], workers=1, threads=1, progress=False)
    assert outcome.status == "failed" and "killed before the rename" in outcome.error
    assert not (cells[0].folder / CELL_DONE).exists()
    assert not list(cells[0].folder.glob(".*.tmp"))


def test_report_files_and_plots_are_written_whole(tmp_path, renames):
    exp, cells = _grid(tmp_path)
    for cell in cells:
        _finish(cell, _rows(ROWS, cell.seed), legacy=False)
    result = write_outputs(exp, cells)
    placed = {dst for _, dst in renames}
    assert {result.results_csv, result.report, *result.plots} <= placed
    assert result.plots and all(src.parent == dst.parent for src, dst in renames)


def test_contact_sheet_is_written_whole(tmp_path, renames):
    from PIL import Image

    from emdlm.contact_sheet import make_contact_sheet

    image = tmp_path / "2_55.png"
    Image.new("RGB", (40, 40), (255, 255, 255)).save(image)
    sheet = make_contact_sheet([{"image": str(image), "completion": "2_55"}], ["2_55"],
                               tmp_path / "eval" / "contact_sheet.png", kind="clock")
    assert [dst for _, dst in renames] == [sheet]
    assert sheet.read_bytes().startswith(b"\x89PNG")
