"""Report, csv and plots from hand-made cell folders (no training): the numbers in report.md
are the statistics of the per-seed values written into the cells."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from _experiment import FAKE_BASE, finished_text_grid
from emdlm.experiments import expand_grid, write_outputs
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.grid import parse_experiment
from emdlm.experiments.runner import _models_to_evaluate
from emdlm.experiments.stats import (
    compare_paired,
    detectable_difference,
    mean_std,
    normalized_auc,
    seeds_for_power,
)

SEEDS = [0, 1, 2, 3, 4, 5]
# abs_error_mean at steps 10 and 20, per variant and seed
ERRORS = {
    "ce": {10: [30.0, 41.0, 28.0, 55.0, 33.0, 47.0], 20: [9.0, 12.5, 7.0, 15.0, 8.0, 11.0]},
    "ntil": {10: [25.0, 30.0, 27.0, 35.0, 31.0, 36.0], 20: [8.0, 10.0, 6.5, 11.0, 6.0, 9.5]},
}


def _fake_cell(cell, errors_by_step):
    for step, err in errors_by_step.items():
        folder = eval_dir(cell.folder, step)
        folder.mkdir(parents=True)
        metrics = {"exact_match": 0.5, "abs_error_mean": err, "abs_error_median": None, "n": 2}
        (folder / "metrics.json").write_text(json.dumps(metrics))
        preds = [{"prompt": "1+1=", "reference": "2", "prediction": "2", "correct": True,
                  "abs_error": 0.0},
                 {"prompt": "9+9=", "reference": "18", "prediction": "x", "correct": False,
                  "abs_error": None}]
        (folder / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 2.0}))


def _replace_predictions(folder, rows):
    """New predictions.jsonl rows for a step, with the row count metrics.json records (n) to
    match: the report refuses a file whose length disagrees with it (a cut-off write)."""
    metrics = json.loads((folder / "metrics.json").read_text())
    (folder / "metrics.json").write_text(json.dumps({**metrics, "n": len(rows)}))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def made(tmp_path):
    exp = parse_experiment({"name": "fake", "base": FAKE_BASE, "seeds": SEEDS,
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    for cell in cells:
        idx = SEEDS.index(cell.seed)
        _fake_cell(cell, {s: ERRORS[cell.variant][s][idx] for s in (10, 20)})
    return exp, cells, write_outputs(exp, cells, command="emdlm experiment -c fake")


def test_report_numbers_are_the_paired_statistics(made):
    _, _, result = made
    report = result.report.read_text()
    final = compare_paired(ERRORS["ce"][20], ERRORS["ntil"][20])
    row = (f"| abs_error_mean | ntil | {final.mean_diff:.4g} | [{final.ci_low:.4g}, "
           f"{final.ci_high:.4g}] | {final.p_wilcoxon:.3g} | {final.p_ttest:.3g} | "
           f"{final.p_ttest:.3g} | 6 |  |")  # one variant: Holm leaves its p as it is
    assert row in report
    # six seeds: no too-few-seeds note; the Wilcoxon p here is the exact 2/64 (all better)
    assert final.p_wilcoxon == pytest.approx(2 / 64, rel=1e-6)
    auc = [compare_paired(
        [normalized_auc([10, 20], [ERRORS["ce"][10][i], ERRORS["ce"][20][i]]) for i in range(6)],
        [normalized_auc([10, 20], [ERRORS["ntil"][10][i], ERRORS["ntil"][20][i]])
         for i in range(6)])][0]
    assert f"| abs_error_mean | ntil | {auc.mean_diff:.4g} |" in report
    mean, std, _ = mean_std(ERRORS["ntil"][20])
    assert f"| ntil | {mean:.4g} ± {std:.4g} (6) |" in report
    assert "Sum of the finished cells' wall times: 24 s" in report


def test_holm_column_adjusts_the_paired_t_within_each_metric(tmp_path):
    # three variants against ce on one metric: Holm multiplies the smallest p by 3, the next
    # by 2 (never below the one before), the largest by 1; a second metric is its own family
    seeds = [0, 1, 2, 3, 4]
    base = [10.0, 12.0, 9.0, 11.0, 13.0]
    shifts = {"a": [-2.0, -2.5, -1.5, -2.2, -1.8], "b": [-0.5, 0.4, -0.9, 0.1, -0.6],
              "c": [-1.0, -0.2, -1.4, -0.9, -0.3]}
    exp = parse_experiment({"name": "h", "base": FAKE_BASE, "seeds": seeds,
                            "variants": {"ce": [], **{v: ["objective.name=ce"] for v in shifts}},
                            "eval": {"checkpoints": "final"},
                            "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    value = {(v, s): base[s] + (shifts[v][s] if v in shifts else 0.0)
             for v in ["ce", *shifts] for s in seeds}
    for cell in cells:
        folder = eval_dir(cell.folder, 20)
        folder.mkdir(parents=True)
        err = value[(cell.variant, cell.seed)]
        (folder / "metrics.json").write_text(json.dumps(
            {"abs_error_mean": err, "exact_match": 1.0 / err, "n": 1}))
        (folder / "predictions.jsonl").write_text(json.dumps(
            {"prompt": "1+1=", "reference": "2", "prediction": "2", "correct": True,
             "abs_error": 0.0}) + "\n")
        (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    report = write_outputs(exp, cells, command="emdlm experiment -c h").report.read_text()
    raw = {v: compare_paired(base, [value[(v, s)] for s in seeds]).p_ttest for v in shifts}
    order = sorted(shifts, key=raw.get)
    by_hand, running = {}, 0.0
    for rank, v in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * raw[v]))
        by_hand[v] = running
    assert by_hand[order[0]] == pytest.approx(3 * raw[order[0]])
    for v in shifts:
        rows = [line for line in report.splitlines()
                if line.startswith(f"| abs_error_mean | {v} |")]
        cells_of_row = [c.strip() for c in rows[0].split("|")]
        assert cells_of_row[6] == f"{raw[v]:.3g}" and cells_of_row[7] == f"{by_hand[v]:.3g}"
    assert "Holm-adjusted over the variants compared on the same metric" in report


def test_csv_has_extras_and_null_metrics_as_nan(made):
    _, _, result = made
    with result.results_csv.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 6 * 2 * 10  # variants x seeds x steps x metrics
    # "n" is not a metric; null (NaN in metrics.json) stays as nan
    metrics = {r["metric"] for r in rows}
    assert metrics == {"exact_match", "abs_error_mean", "abs_error_median",
                       "log10_error_mean", "within_1pct", "within_5pct",
                       "magnitude_error_rate", "sign_error_rate", "digit_accuracy",
                       "leading_digit_accuracy"}
    # the one parsed answer ("2" for "2") has the right magnitude and sign
    assert {r["value"] for r in rows if r["metric"].endswith("error_rate")} == {"0.0"}
    assert {r["value"] for r in rows if r["metric"].endswith("digit_accuracy")} == {"1.0"}
    median = [r for r in rows if r["metric"] == "abs_error_median"]
    assert all(r["value"] == "nan" for r in median)
    within = [float(r["value"]) for r in rows if r["metric"] == "within_1pct"]
    assert within == [0.5] * 24  # one exact answer, one unparsed


def test_partial_grid_reports_what_is_finished(made):
    exp, cells, _ = made
    (cells[1].folder / CELL_DONE).unlink()  # ntil/seed0 unfinished: its pair is dropped
    result = write_outputs(exp, cells)
    report = result.report.read_text()
    assert "Cells finished: 11/12; failed: 0" in report
    final = compare_paired(ERRORS["ce"][20][1:], ERRORS["ntil"][20][1:])
    assert final.n == 5
    assert "only 5 seeds: Wilcoxon cannot reach p < 0.05 (needs >= 6)" in report


def test_checkpoints_to_evaluate(made):
    _, cells, _ = made
    cell = cells[0]
    for step in (10, 20):
        (cell.train_dir / f"checkpoint-{step}").mkdir(parents=True)
    assert _models_to_evaluate(cell, 20) == {10: cell.train_dir / "checkpoint-10",
                                             20: cell.train_dir}  # final model replaces ckpt
    # a checkpoint an interrupted run saved at its stop (step 7, save_steps 10) is not evaluated
    (cell.train_dir / "checkpoint-7").mkdir()
    assert list(_models_to_evaluate(cell, 20)) == [10, 20]
    cell.checkpoints = "final"
    assert _models_to_evaluate(cell, 20) == {20: cell.train_dir}
    cell.checkpoints = [10]
    assert list(_models_to_evaluate(cell, 20)) == [10, 20]
    cell.checkpoints = [15]
    with pytest.raises(RuntimeError, match=r"\[15\] were not saved"):
        _models_to_evaluate(cell, 20)


# accuracy of an extra evaluation (eval.extra.choice) of the final model, per variant and seed
CHOICE = {"ce": [0.50, 0.52, 0.48, 0.55, 0.51, 0.49], "ntil": [0.53, 0.56, 0.50, 0.58, 0.55, 0.50]}


def test_extra_evaluations_are_reported_with_their_prefix(tmp_path):
    exp = parse_experiment({"name": "fake", "base": FAKE_BASE, "seeds": SEEDS,
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "eval": {"extra": {"choice": ["eval.kind=choice"]}},
                            "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    for cell in cells:
        idx = SEEDS.index(cell.seed)
        _fake_cell(cell, {s: ERRORS[cell.variant][s][idx] for s in (10, 20)})
        folder = eval_dir(cell.folder, 20, "choice")
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps(
            {"accuracy": CHOICE[cell.variant][idx], "chance_rate": 0.5, "n": 152}))
        # one row per scored example: metrics.json's n counts them (a shorter file is cut off)
        (folder / "predictions.jsonl").write_text((json.dumps({"prediction": 1}) + "\n") * 152)
    result = write_outputs(exp, cells)
    report = result.report.read_text()
    diff = compare_paired(CHOICE["ce"], CHOICE["ntil"])
    assert (f"| choice.accuracy | ntil | {diff.mean_diff:.4g} | [{diff.ci_low:.4g}, "
            f"{diff.ci_high:.4g}] |") in report
    assert "higher for within_5pct, exact_match, choice.accuracy." in report
    # final model only: no area under a learning curve for it, nor a plot panel
    auc_section = report.split("### Area under the learning curve")[1].split("###")[0]
    assert "choice.accuracy" not in auc_section
    with result.results_csv.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["metric"].startswith("choice.")]
    assert {r["metric"] for r in rows} == {"choice.accuracy", "choice.chance_rate"}
    assert {r["step"] for r in rows} == {"20"} and len(rows) == 2 * 6 * 2


def test_the_learning_curves_legend_covers_no_panel_and_no_title(tmp_path, monkeypatch):
    """The variants' legend (8 variants, 4 metrics: the size of a real grid) sits outside every
    panel, its title, tick labels and axis label included, and below the figure's title."""
    from emdlm.experiments import plots
    from emdlm.experiments.results import Row

    variants = ["ce", "emd", "ntil", "ntil_stable", "ntil_no_exp_weights", "ntil_no_relative",
                "ntil_no_magnitude", "ce_tuned"]
    metrics = ["abs_error_mean", "log10_error_mean", "within_5pct", "exact_match"]
    rng = np.random.default_rng(0)
    rows = [Row("t", v, s, step, m, float(rng.random()) * (100 if m == "abs_error_mean" else 1))
            for v in variants for s in range(3) for step in (500, 1000, 1500) for m in metrics]
    saved = []
    keep = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (saved.append(fig), keep(fig, path)))
    assert plots.plot_learning_curves(rows, "t", variants, tmp_path / "c.png")
    (fig,) = saved
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the saved figure, drawn again as it was laid out
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert len(legends) == 1 and len(legends[0].get_texts()) == len(variants)
    box = legends[0].get_window_extent(renderer)
    assert len(fig.axes) == len(metrics)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()
    assert not box.overlaps(fig._suptitle.get_window_extent(renderer))
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")


def test_sixteen_variants_get_sixteen_distinguishable_lines(tmp_path, monkeypatch):
    """A 4 x 4 learning-rate grid: no two variants' curves share colour and line style (the
    default 10-colour cycle gave the 1st and the 11th the same blue)."""
    from matplotlib.colors import to_hex

    from emdlm.experiments import plots
    from emdlm.experiments.results import Row

    variants = [f"{o}_lr{lr}" for o in ("ce", "ntil", "emd", "ntl_was")
                for lr in ("5e-4", "1e-3", "2e-3", "4e-3")]
    rows = [Row("t", v, 0, step, "abs_error_mean", 1.0 + i + step / 1000)
            for i, v in enumerate(variants) for step in (500, 1000)]
    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig))
    plots.plot_learning_curves(rows, "t", variants, tmp_path / "c.png")
    lines = saved[0].axes[0].get_lines()
    assert len(lines) == 16
    assert len({(to_hex(ln.get_color()), ln.get_linestyle()) for ln in lines}) == 16
    assert len({style for style in plots.variant_styles(45)}) == 45  # past 20: dashes too


def test_single_step_grid_plots_final_values_and_a_text_note(tmp_path):
    """checkpoints: final (one evaluated step): final values, not curves; text metrics explained."""
    from emdlm.experiments.plots import plot_learning_curves
    from emdlm.experiments.results import Row

    rows = [Row("default", v, s, 20, m, 1.0 + s) for v in ("ce", "emo") for s in (0, 1)
            for m in ("mauve", "ppl_test")]
    assert not plot_learning_curves(rows, "default", ["ce", "emo"], tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()
    exp, cells = finished_text_grid(tmp_path / "out", [0, 1], lambda v, s: {
        "mauve": 0.5, "ppl_test": 30.0})
    result = write_outputs(exp, cells)
    report = result.report.read_text()
    assert [p.name for p in result.plots] == ["default_final.png"]
    assert result.plots[0].read_bytes().startswith(b"\x89PNG") and "Text metrics" in report
    assert "Numeric errors come first" not in report


def test_constant_answer_floor_by_hand():
    from emdlm.experiments.floor import constant_answer_floor

    # references 2, -1, 1/2, 10 and one unparsable answer (left out)
    floor = constant_answer_floor(["2", "-1", "1/2", "10", "n/a"])
    zero = floor["0"]  # |errors| 2, 1, 0.5, 10
    assert zero["abs_error_mean"] == pytest.approx(13.5 / 4)
    assert zero["abs_error_median"] == pytest.approx(1.5)
    assert zero["exact_match"] == 0.0
    assert zero["log10_error_mean"] == pytest.approx(
        (math.log10(3) + math.log10(2) + math.log10(1.5) + math.log10(11)) / 4)
    med = floor["median"]  # median of -1, 0.5, 2, 10 is 1.25: |errors| 0.75, 2.25, 0.75, 8.75
    assert med["constant"] == pytest.approx(1.25)
    assert med["abs_error_mean"] == pytest.approx(12.5 / 4)
    assert med["abs_error_mean"] <= zero["abs_error_mean"]  # the median minimises it
    assert constant_answer_floor(["x", ""]) == {}
    assert constant_answer_floor(["7", "7", "3"])["median"]["exact_match"] == pytest.approx(2 / 3)


def test_report_states_the_constant_answer_floor(made):
    _, _, result = made
    report = result.report.read_text()
    # the fake predictions: references "2" and "18" (both parse; the second answer did not)
    assert ("Floor, the same 2 (2 distinct) test problems answered with one constant: 0 gives "
            "abs_error_mean 10, median 10,") in report
    assert "the test median (10, the best constant for abs_error_mean) gives abs_error_mean 8," \
        in report


def test_clock_extras_by_hand():
    from emdlm.experiments.results import clock_extras

    rows = [{"reference": "9_15", "prediction": "9_45", "time_gap": 0.5},   # hour right
            {"reference": "10_15", "prediction": "2_15", "time_gap": 4.0},  # minutes right
            {"reference": "12_00", "prediction": "0_00", "time_gap": 0.0},  # both (same dial)
            {"reference": "3_30", "prediction": "x", "time_gap": None}]    # unparsed: neither
    assert clock_extras(rows) == {"hour_accuracy": 0.5, "minute_accuracy": 0.5}
    assert clock_extras([{"reference": "2", "prediction": "2", "abs_error": 0.0}]) == {}


def test_report_has_power_planning_figures(made):
    _, _, result = made
    report = result.report.read_text()
    d = np.subtract(ERRORS["ntil"][20], ERRORS["ce"][20])
    sd = float(np.std(d, ddof=1))
    need = seeds_for_power(float(d.mean()), sd)
    row = (f"| abs_error_mean | ntil | 6 | {sd:.4g} | {detectable_difference(6, sd):.4g} | "
           f"{need} |")
    assert "### Power of the final comparison" in report
    assert row in report.splitlines()
    assert 2 <= need <= 6  # a difference these 6 seeds already show (t p = 0.013) needs <= 6


def test_report_has_the_baseline_plateau_check(made):
    _, _, result = made
    report = result.report.read_text()
    before, last = np.mean(ERRORS["ce"][10]), np.mean(ERRORS["ce"][20])
    line = next(ln for ln in report.splitlines() if ln.startswith("Plateau check"))
    assert line.startswith("Plateau check, baseline `ce` (mean over seeds), steps 10 → 20: ")
    assert (f"abs_error_mean {before:.4g} → {last:.4g} ({(last - before) / before:+.1%})"
            in line)
    assert "exact_match 0.5 → 0.5 (+0.0%)" in line
    assert line.endswith("the plateau test is a longer schedule, paired by seed "
                         "(`base.train.max_steps=<2x>` into a new folder; docs/experiments.md).")


def test_report_has_digit_accuracy_by_place(made):
    exp, cells, _ = made
    # ntil's final answers: '104' for 1004 (units and tens right, hundreds wrong, thousands
    # missing) on even seeds, '1004' (all right) on odd seeds; ce keeps '2' for '2'
    for cell in cells:
        if cell.variant == "ntil":
            answer = "104" if cell.seed % 2 == 0 else "1004"
            row = {"prompt": "1000+4=", "reference": "1004", "prediction": answer,
                   "correct": answer == "1004", "abs_error": abs(1004 - int(answer))}
            _replace_predictions(eval_dir(cell.folder, 20), [row])
    report = write_outputs(exp, cells, command="emdlm experiment -c fake").report.read_text()
    lines = report.splitlines()
    assert "### Digit accuracy by place value (final checkpoint, integer answers)" in lines
    assert "| variant | 10^0 | 10^1 | 10^2 | 10^3 |" in lines
    assert "| ce (6) | 1.000 ± 0.000 | – | – | – |" in lines
    half = f"0.500 ± {np.std([0, 1] * 3, ddof=1):.3f}"
    assert f"| ntil (6) | 1.000 ± 0.000 | 1.000 ± 0.000 | {half} | {half} |" in lines


def test_floor_line_counts_distinct_test_problems(made):
    exp, cells, _ = made
    row = {"prompt": "9+0=", "reference": "9", "prediction": "9", "correct": True,
           "abs_error": 0.0}
    for cell in cells:  # a test set drawn with replacement can repeat a small problem
        _replace_predictions(eval_dir(cell.folder, 20), [row] * 3)
    report = write_outputs(exp, cells, command="emdlm experiment -c fake").report.read_text()
    assert "Floor, the same 3 (1 distinct) test problems answered with one constant" in report
    # an image task: one question, told apart by the figure's answer
    rows = [{**row, "prompt": "What is the value of the red bar?", "reference": ref,
             "prediction": ref, "image": f"{k}.png"} for k, ref in enumerate("3593")]
    for cell in cells:
        _replace_predictions(eval_dir(cell.folder, 20), rows)
    report = write_outputs(exp, cells, command="emdlm experiment -c fake").report.read_text()
    assert "Floor, the same 4 (3 distinct) test problems answered with one constant" in report


def test_report_of_a_two_seed_pilot_with_a_large_effect(tmp_path):
    # the paired differences (-20.0, -21.0) have dz ~ 29: the power search passes nc > 9, where
    # scipy's noncentral t returned NaN and the report crashed (a partial 8000-step grid did)
    exp = parse_experiment({"name": "pilot", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": [], "ntil": ["objective.name=ntil"]},
                            "output_dir": str(tmp_path / "out")})
    cells = expand_grid(exp)
    errors = {"ce": (30.0, 32.0), "ntil": (10.0, 11.0)}
    for cell in cells:
        _fake_cell(cell, {10: errors[cell.variant][cell.seed] + 5.0,
                          20: errors[cell.variant][cell.seed]})
    report = write_outputs(exp, cells, command="emdlm experiment -c pilot").report.read_text()
    sd = float(np.std([-20.0, -21.0], ddof=1))
    # the smallest detectable difference is still printed (finite); the seeds for the observed
    # difference are not estimated from 2 seeds (they would read "2": the pilot would look
    # conclusive)
    row = (f"| abs_error_mean | ntil | 2 | {sd:.4g} | {detectable_difference(2, sd):.4g} | "
           "not estimated from 2 seeds |")
    assert row in report.splitlines()
    assert seeds_for_power(-20.5, sd) == 2


def test_report_names_the_evaluation_split(made, tmp_path):
    """A grid evaluated on the dev split says so (it once read "the test set" whatever the
    config), and the test grid names its test split."""
    _, _, result = made
    assert "Metric values are on task arithmetic (test) (data.eval)." in (
        result.report.read_text())
    exp = parse_experiment({"name": "dev", "base": FAKE_BASE, "seeds": [0, 1],
                            "variants": {"ce": []}, "output_dir": str(tmp_path / "dev"),
                            "eval": {"overrides": ["data.eval.split=dev"]}})
    cells = expand_grid(exp)
    for cell in cells:
        _fake_cell(cell, {10: 3.0, 20: 2.0})
    report = write_outputs(exp, cells).report.read_text()
    assert "Metric values are on task arithmetic (dev) (data.eval)." in report
    assert "test set" not in report


def test_plots_of_a_grid_without_tasks_are_titled_after_the_experiment(made, monkeypatch):
    """The one task of a grid without ``tasks:`` is ``default/`` on disk but named after the
    experiment in the plots' titles, as in the report's text; file names keep the task."""
    from emdlm.experiments import plots

    exp, cells, _ = made
    titles: list[str] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: titles.append(fig._suptitle.get_text()))
    result = write_outputs(exp, cells)
    assert titles and all(t.startswith("fake: ") for t in titles), titles
    assert {p.name for p in result.plots} <= {"default_curves.png", "default_final.png",
                                              "default_errors.png"}


def test_the_report_names_the_per_task_variant_settings(tmp_path):
    """A grid with ``task_variants`` says in its header which variant ran with what in which
    task (the learning rates chosen per task), and one without says nothing of them."""
    exp, cells = finished_text_grid(tmp_path / "out", [0, 1], lambda v, s: {
        "mauve": 0.5, "ppl_test": 30.0})
    assert "Per task" not in write_outputs(exp, cells).report.read_text()
    exp.task_variants = {"default": {"emo": ["optim.lr=5e-4", "train.max_steps=20"]}}
    report = write_outputs(exp, cells).report.read_text()
    assert ("Per task, after the variant's own overrides: default: emo "
            "`optim.lr=5e-4 train.max_steps=20`.") in report
