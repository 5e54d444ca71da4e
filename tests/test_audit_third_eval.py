"""Third fault audit: experiment cells of another definition, and `emdlm eval`'s checks before
it generates (references that do not parse for the kind, rows longer than the model's context),
a full disk while it writes, a folder that holds no model."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from _experiment import FAKE_BASE, TINY_BASE
from emdlm.cli import app
from emdlm.config import build_config
from emdlm.eval_outputs import write_eval_outputs
from emdlm.experiments import expand_grid, run_experiment
from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
from emdlm.experiments.grid import load_experiment

runner = CliRunner()

# ------------------------------------------------------------------------------------------------
# Experiment cells: work of another definition is refused, never reported as the grid's cell
# ------------------------------------------------------------------------------------------------

VARIANTS = {"ce": ["objective.name=ce"], "ntil": ["objective.name=ntil"]}


def _write_exp(tmp_path: Path, variants: dict[str, list[str]] | None = None,
               **extra: Any) -> Path:
    data = {"name": "t", "base": FAKE_BASE, "variants": variants or VARIANTS, "seeds": [0],
            "workers": 1, "eval": {"checkpoints": "final"},
            "output_dir": str(tmp_path / "grid"), **extra}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _finish_by_hand(path: Path) -> None:
    """Every cell of the experiment at ``path`` finished as the runner leaves it, without
    training: train/run_config.yaml as training writes it (the resolved run config), one whole
    evaluation of the final step whose abs_error tells the variants apart, cell_done.json."""
    for cell in expand_grid(load_experiment(path)):
        cell.train_dir.mkdir(parents=True)
        config = build_config(cell.config).to_dict()
        (cell.train_dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        error = 1.0 if cell.variant == "ce" else 7.0
        write_eval_outputs(eval_dir(cell.folder, 20),
                           {"exact_match": 0.0, "abs_error_mean": error, "n": 1},
                           [{"prompt": "1+2=", "reference": "3", "prediction": "4",
                             "correct": False, "abs_error": error}])
        (cell.folder / CELL_DONE).write_text(json.dumps({"final_step": 20, "wall_s": 1.0}))


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _csv_variants(result: Any) -> set[str]:
    with result.results_csv.open() as fh:
        return {row["variant"] for row in csv.DictReader(fh)}


def test_a_cell_folder_copied_from_another_variant_is_refused(tmp_path):
    """X1: a cell folder copied from another variant is not counted as done, nor its numbers
    reported as this variant's; its folder is left as it is."""
    path = _write_exp(tmp_path)
    _finish_by_hand(path)
    ntil = tmp_path / "grid" / "default" / "ntil" / "seed0"
    shutil.rmtree(ntil)
    shutil.copytree(tmp_path / "grid" / "default" / "ce" / "seed0", ntil)
    before = _tree(ntil)
    result = run_experiment(path, progress=False)
    status = {o.key: o.status for o in result.outcomes}
    assert status == {"default/ce/seed0": "skipped", "default/ntil/seed0": "refused"}
    why = result.refused["default/ntil/seed0"]
    assert "objective.name 'ce' there, 'ntil' in the grid" in why
    assert str(ntil / "train" / "run_config.yaml") in why and "\n" not in why
    assert _csv_variants(result) == {"ce"}  # none of the copied numbers under ntil's name
    report = result.report.read_text()
    assert "Cells finished: 1/2" in report and "refused, another definition's work: 1" in report
    assert "## Cells refused" in report and "`default/ntil/seed0`" in report
    assert _tree(ntil) == before  # nothing deleted, moved or rewritten


def test_cells_of_a_variant_whose_overrides_changed_are_refused(tmp_path):
    """X2: after a variant's overrides change, its old cells are not reported under the new
    definition ("2/2 done (2 earlier)"): `emdlm experiment` names the differing key in one line
    per cell and exits 1; the other variant's cells still count."""
    path = _write_exp(tmp_path)
    _finish_by_hand(path)
    _write_exp(tmp_path, {"ce": ["objective.name=ce"],
                          "ntil": ["objective.name=ntil", "optim.lr=0.002"]})
    out = runner.invoke(app, ["experiment", "-c", str(path), "--no-progress"])
    assert out.exit_code == 1, out.output
    (line,) = [x for x in out.output.splitlines() if x.startswith("error: default/ntil/seed0")]
    assert "optim.lr 0.001 there, 0.002 in the grid" in line
    report = (tmp_path / "grid" / "report.md").read_text()
    assert "Cells finished: 1/2" in report and "optim.lr 0.001 there, 0.002" in report
    assert "| ntil | 7" not in report  # the old cell's numbers are not shown as ntil's


def test_a_cell_that_failed_before_training_runs_once_its_overrides_are_fixed(tmp_path):
    """X2: a cell whose training never started (a bad override: its folder holds only
    cell_definition.json and error.txt) is not refused once the variant is fixed."""
    from emdlm.experiments.cell_record import record_definition, refusal

    path = _write_exp(tmp_path, {"ce": ["objective.name=ce", "optim.lr=5.0"]})
    (cell,) = expand_grid(load_experiment(path))
    cell.folder.mkdir(parents=True)
    record_definition(cell)
    (cell.folder / "error.txt").write_text("Traceback ...\nValueError: diverged\n")
    _write_exp(tmp_path, {"ce": ["objective.name=ce", "optim.lr=0.001"]})
    (fixed,) = expand_grid(load_experiment(path))
    assert refusal(fixed) is None
    (fixed.train_dir).mkdir()  # once its training started, the old definition's work is there
    config = build_config(cell.config).to_dict()
    (fixed.train_dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert "optim.lr 5.0 there, 0.001 in the grid" in (refusal(fixed) or "")


def test_cells_written_before_the_record_are_accepted_when_they_match(tmp_path):
    """X4 (compatibility): cells holding only train/run_config.yaml, as every emdlm version
    writes it, are accepted when it matches the grid's resolved cell config, although keys that
    define neither weights nor metrics differ (threads) and a setting newer than the cell is
    missing from it (taken at its default)."""
    path = _write_exp(tmp_path)
    _finish_by_hand(path)
    for cell in expand_grid(load_experiment(path)):
        config = yaml.safe_load((cell.train_dir / "run_config.yaml").read_text())
        del config["train"]["fused_linear"]  # as if written before the setting existed
        (cell.train_dir / "run_config.yaml").write_text(yaml.safe_dump(config))
    _write_exp(tmp_path, threads_per_worker=2)
    result = run_experiment(path, progress=False)
    assert {o.status for o in result.outcomes} == {"skipped"} and not result.refused
    assert _csv_variants(result) == {"ce", "ntil"}


def test_evaluations_under_changed_eval_overrides_are_refused(tmp_path):
    """X3: cell_definition.json (written by the runner when it starts a cell) records each
    evaluation's resolved config, which run_config.yaml does not hold: a cell evaluated before
    experiment.eval.overrides changed is refused, naming the key."""
    from emdlm.experiments.cell_record import record_definition

    path = _write_exp(tmp_path)
    _finish_by_hand(path)
    for cell in expand_grid(load_experiment(path)):
        record_definition(cell)
    _write_exp(tmp_path, eval={"checkpoints": "final", "overrides": ["data.eval.n=3"]})
    result = run_experiment(path, progress=False)
    assert set(result.refused) == {"default/ce/seed0", "default/ntil/seed0"}
    assert "evaluated (main)" in result.refused["default/ce/seed0"]
    assert "data.eval.n 4 there, 3 in the grid" in result.refused["default/ce/seed0"]
    assert _csv_variants(result) == set()


@pytest.mark.slow
def test_a_trained_cell_matches_its_record_and_is_refused_once_changed(tmp_path):
    """X2, X4 on a cell that really trained: its run_config.yaml matches the grid (skipped on the
    next invocation, cell_definition.json written), and once the variant changes it is refused
    and its folder left as it is."""
    base = json.loads(json.dumps(TINY_BASE))
    base["train"].update(max_steps=2, save_steps=2)
    data = {"name": "t", "base": base, "variants": {"ce": ["objective.name=ce"]}, "seeds": [0],
            "workers": 1, "eval": {"checkpoints": "final", "overrides": ["data.eval.n=2"]},
            "output_dir": str(tmp_path / "grid")}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    first = run_experiment(path, progress=False)
    assert [o.status for o in first.outcomes] == ["done"]
    cell = tmp_path / "grid" / "default" / "ce" / "seed0"
    assert (cell / "cell_definition.json").is_file()
    again = run_experiment(path, progress=False)
    assert [o.status for o in again.outcomes] == ["skipped"] and not again.refused
    before = _tree(cell)
    data["variants"] = {"ce": ["objective.name=ce", "data.add_eos=false"]}
    path.write_text(yaml.safe_dump(data))
    changed = run_experiment(path, progress=False)
    assert [o.status for o in changed.outcomes] == ["refused"]
    assert "data.add_eos True there, False in the grid" in changed.refused["default/ce/seed0"]
    assert _tree(cell) == before
    # asked to, the runner renames the folder beside itself (nothing deleted) and runs the cell
    said: list[str] = []
    rerun = run_experiment(path, progress=False, rerun_refused=True, echo=said.append)
    aside = cell.with_name("seed0.other-definition-1")
    assert said == [f"default/ce/seed0: its folder held another definition's work, moved to "
                    f"{aside}; the cell runs again"]
    assert [o.status for o in rerun.outcomes] == ["done"] and not rerun.refused
    assert {k: v for k, v in _tree(aside).items() if k != "cell.lock"} == {
        k: v for k, v in before.items() if k != "cell.lock"}
    trained = yaml.safe_load((cell / "train" / "run_config.yaml").read_text())
    assert trained["data"]["add_eos"] is False


# ------------------------------------------------------------------------------------------------
# `emdlm eval`: what would fail after every answer was generated is checked before generating
# ------------------------------------------------------------------------------------------------

CONTEXT = 32  # the tiny model's positions


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 (context 32) with the char tokenizer, saved as a trained folder."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from emdlm.tokenizers import load_tokenizer

    tok = load_tokenizer("char")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_positions=CONTEXT, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    out = tmp_path_factory.mktemp("model") / "run"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _rows(tmp_path: Path, completions: list[str], prompts: list[str] | None = None) -> Path:
    path = tmp_path / "test.jsonl"
    prompts = prompts or ["1+2="] * len(completions)
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                            for p, c in zip(prompts, completions, strict=True)))
    return path


@pytest.fixture
def generated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many prompts were handed to generation (each batch of generate_answers)."""
    import emdlm.evaluation as evaluation

    real = evaluation.generate_answers
    calls: list[int] = []

    def counting(model: Any, tokenizer: Any, prompts: Any, **kw: Any) -> list[str]:
        calls.append(len(prompts))
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(evaluation, "generate_answers", counting)
    return calls


def _one_error_line(result: Any, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize(("reference", "shown"), [
    ("two", "'two'"),
    ("1e400", "'1e400'"),  # beyond a float
    ("9" * 400, "(400 characters)"),  # cut in the message
    ("(10,20),(30,40)", "'(10,20),(30,40)'"),  # box data on a number run
])
def test_a_reference_the_kind_cannot_read_fails_before_generating(
    tmp_path, model_folder, generated, reference, shown
):
    """X5: references that do not parse as the run's kind (number) fail in one line, exit 2,
    naming the row, before any answer is generated and before anything is written."""
    data = _rows(tmp_path, ["3", "4", reference])
    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data), "--out",
                                 str(out), "eval.batch_size=1", "eval.max_new_tokens=2"])
    line = _one_error_line(result)
    assert "row 2: reference is not a valid number" in line and shown in line, line
    assert "(eval.kind=number)" in line and len(line) < 300
    assert generated == [] and not out.exists()


def test_a_kind_the_references_are_not_fails_before_generating(tmp_path, model_folder,
                                                               generated):
    """X6: `--kind clock` on a test set of numbers: one line before generating."""
    data = _rows(tmp_path, ["3", "4"])
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data), "--kind",
                                 "clock", "--out", str(tmp_path / "eval")])
    line = _one_error_line(result)
    assert "row 0: reference is not a valid clock time (H_MM): '3' (eval.kind=clock)" in line
    assert generated == []


def test_a_prompt_beyond_the_context_fails_before_generating(tmp_path, model_folder,
                                                             generated):
    """X7: a test row whose prompt leaves no room for eval.max_new_tokens, after rows that fit:
    one line before the first batch is generated (not after the batches before it)."""
    data = _rows(tmp_path, ["3", "4", "5"], ["1+2=", "2+2=", "1+" * 20 + "1="])
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data),
                                 "eval.batch_size=1", "eval.max_new_tokens=4",
                                 "--out", str(tmp_path / "eval")])
    line = _one_error_line(result)
    assert f"exceeds the model's context length {CONTEXT}" in line
    assert generated == []


def test_a_completion_too_long_for_its_perplexity_fails_before_generating(
    tmp_path, model_folder, generated
):
    """X8: a row whose prompt + completion (+ EOS) exceed the context: its perplexity cannot be
    computed, which today fails after every answer was generated."""
    data = _rows(tmp_path, ["3", "1" * 40])
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data),
                                 "eval.max_new_tokens=2", "--out", str(tmp_path / "eval")])
    line = _one_error_line(result)
    assert "row 1: its prompt and completion and EOS are" in line
    assert f"tokens, beyond the model's context length {CONTEXT}" in line
    assert generated == []


def test_a_test_set_that_fits_is_still_evaluated(tmp_path, model_folder, generated):
    """The checks pass a test set that can be scored: the evaluation runs as before."""
    data = _rows(tmp_path, ["3", "4"])
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data),
                                 "eval.max_new_tokens=2", "--out", str(tmp_path / "eval")])
    assert result.exit_code == 0, result.output
    assert generated == [2] and (tmp_path / "eval" / "metrics.json").is_file()


def test_a_full_disk_while_eval_writes_is_one_line_and_exit_3(tmp_path, model_folder,
                                                              monkeypatch):
    """X9: a full disk while `emdlm eval --out` writes its files: exit 3 and one line (as
    `emdlm train`'s full disk), no Errno 28 traceback, no metrics.json that reads as
    finished."""
    import errno

    import emdlm.eval_outputs as eval_outputs

    real = eval_outputs.atomic_write

    class FullDisk:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def write(self, text: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    import contextlib

    @contextlib.contextmanager
    def full(path: Path, **kw: Any) -> Any:
        with real(path, **kw) as fh:
            yield FullDisk(fh)

    monkeypatch.setattr(eval_outputs, "atomic_write", full)
    data = _rows(tmp_path, ["3", "4"])
    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", str(model_folder), "--data", str(data),
                                 "eval.max_new_tokens=2", "--out", str(out)])
    line = _one_error_line(result, code=3)
    assert f"disk full (No space left on device) while saving the evaluation into {out}" in line
    assert "free some space and run it again" in line
    assert not (out / "metrics.json").exists()


def test_eval_of_a_folder_without_a_model_says_so(tmp_path):
    """X10: `emdlm eval notarun` (a folder, no model, no run_config.yaml) says it holds no
    model, not that there is no test set."""
    folder = tmp_path / "notarun"
    folder.mkdir()
    line = _one_error_line(runner.invoke(app, ["eval", str(folder)]))
    assert line == f"error: {folder} holds no model (config.json missing)"


def test_a_cell_whose_test_references_cannot_be_read_fails_before_training(tmp_path):
    """X11: in a grid, the same reference check runs before training (as the context check
    does): a test set with a reference its kind cannot read fails the cell at once, naming the
    row, with no training step run (not after the training and every answer)."""
    data = _rows(tmp_path, ["3", "two"], ["1+2=", "2+2="])
    base = json.loads(json.dumps(TINY_BASE))
    spec = {"name": "t", "base": base, "variants": {"ce": ["objective.name=ce"]}, "seeds": [0],
            "workers": 1, "eval": {"checkpoints": "final", "overrides": [
                "data.eval.task=null", f"data.eval.path={data}", "data.eval.split=null"]},
            "output_dir": str(tmp_path / "grid")}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_experiment(path, progress=False)
    assert [o.status for o in result.outcomes] == ["failed"]
    cell = tmp_path / "grid" / "default" / "ce" / "seed0"
    assert "row 1: reference is not a valid number: 'two' (eval.kind=number)" in (
        cell / "error.txt").read_text()
    assert not (cell / "train" / "train_summary.json").exists()
    assert not list((cell / "train").glob("checkpoint-*"))
