"""lm-evaluation-harness on an emdlm run folder: ``lm_eval run --model hf --model_args
pretrained=<run>`` on local multiple-choice tasks (a JSONL file and a task YAML, no hub), against
``emdlm eval --kind choice`` on the same rows and model.

What is compared (the scoring rules, with P the prompt's summed NLL, S_i candidate i's summed
NLL given the prompt, L_p and L_i their token counts; char tokenizer: one token per character):

* emdlm's choice score: mean NLL of the whole text, (P + S_i) / (L_p - 1 + L_i) (the first
  token is not predicted); the lowest wins.
* lm-eval ``acc``: the highest log-likelihood -S_i; ``acc_norm``: the highest -S_i / len(i).

Same-length candidates: the three pick the same candidate, so the accuracies are equal. Mixed
lengths: they may differ; the test pins the decomposition (lm-eval's per-candidate
log-likelihood is emdlm's completion NLL, and emdlm's text score is (P + S_i) / (L_p - 1 + L_i)).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _example_module():
    spec = importlib.util.spec_from_file_location(
        "lm_eval_choice_task", ROOT / "examples" / "lm_eval_choice_task.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_and_tasks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run folder of ``emdlm train`` (NTIL, 2 steps), the local tasks, lm-eval's samples."""
    from typer.testing import CliRunner

    from emdlm.cli import app

    base = tmp_path_factory.mktemp("lm_eval_route")
    run = base / "run"
    result = CliRunner().invoke(app, [
        "train", "-c", "arithmetic_ntil", f"output_dir={run}", "model.params.n_layer=1",
        "model.params.n_embd=32", "data.train.n=64", "data.eval.n=8", "train.max_steps=2",
        "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    tasks = base / "tasks"
    script = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lm_eval_choice_task.py"), str(tasks),
         "--n", "60"], capture_output=True, text=True, env={**os.environ, **OFFLINE},
        timeout=300,
    )  # fmt: skip
    assert script.returncode == 0, script.stderr
    jsonl = {t: Path(p) for t, p in (line.split(": ", 1) for line in script.stdout.splitlines())}
    out = base / "lm_eval_out"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf",
         "--model_args", f"pretrained={run},dtype=float32", "--tasks", ",".join(jsonl),
         "--include_path", str(tasks), "--device", "cpu", "--batch_size", "16",
         "--log_samples", "--output_path", str(out)],
        capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {task: _samples(out, task) for task in jsonl}
    return {"run": run, "jsonl": jsonl, "results": json.loads(results_file.read_text())["results"],
            "samples": samples}


def _samples(out: Path, task: str) -> list[dict]:
    """lm-eval's logged samples of ``task`` (``samples_<task>_<timestamp>.jsonl``), by doc."""
    (path,) = (p for p in out.rglob("samples_*.jsonl")
               if p.stem.rsplit("_", 1)[0] == f"samples_{task}")
    return sorted((json.loads(line) for line in path.open()), key=lambda s: s["doc_id"])


def _emdlm_choice(run: Path, jsonl: Path, out: Path) -> tuple[dict, list[dict]]:
    """``emdlm eval <run> --data <jsonl> --kind choice``: (metrics.json, predictions rows)."""
    from typer.testing import CliRunner

    from emdlm.cli import app

    result = CliRunner().invoke(
        app, ["eval", str(run), "--data", str(jsonl), "--kind", "choice", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "predictions.jsonl").open()]
    return metrics, rows


def _lm_eval_logliks(sample: dict) -> list[float]:
    return [float(resp[0]) for resp in sample["filtered_resps"]]


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def test_same_length_choices_give_the_same_accuracy(run_and_tasks: dict, tmp_path: Path) -> None:
    task = "emdlm_arith_choice"
    metrics, rows = _emdlm_choice(run_and_tasks["run"], run_and_tasks["jsonl"][task], tmp_path)
    lm = run_and_tasks["results"][task]
    samples = run_and_tasks["samples"][task]
    assert len(samples) == len(rows) == metrics["n"] == 60
    # per example: emdlm's pick (lowest mean NLL) is lm-eval's (highest log-likelihood)
    lm_picks = [_argmax(_lm_eval_logliks(s)) for s in samples]
    assert [r["prediction"] for r in rows] == lm_picks
    assert [s["acc"] for s in samples] == [float(r["correct"]) for r in rows]
    assert metrics["accuracy"] == pytest.approx(lm["acc,none"], abs=1e-12)
    assert lm["acc_norm,none"] == pytest.approx(lm["acc,none"], abs=1e-12)


def test_mixed_lengths_decompose_into_lm_evals_log_likelihoods(
    run_and_tasks: dict, tmp_path: Path
) -> None:
    from emdlm.evaluation import score_choices
    from emdlm.generation import sequence_nlls
    from emdlm.training.text_eval import load_trained

    task = "emdlm_arith_choice_mixed"
    examples = [json.loads(line) for line in run_and_tasks["jsonl"][task].open()]
    metrics, rows = _emdlm_choice(run_and_tasks["run"], run_and_tasks["jsonl"][task], tmp_path)
    model, tok = load_trained(run_and_tasks["run"])
    completion = score_choices(model, tok, examples, scoring="completion")
    prompt_nll = sequence_nlls(model, tok, [ex["prompt"] for ex in examples])
    lm = run_and_tasks["results"][task]
    lm_samples = run_and_tasks["samples"][task]
    norm_picks = []
    for ex, row, comp, (p_sum, p_count), sample in zip(
        examples, rows, completion, prompt_nll, lm_samples, strict=True
    ):
        loglik = _lm_eval_logliks(sample)
        lengths = [len(c) for c in ex["choices"]]  # tokens = characters = bytes here
        summed = [m * n for m, n in zip(comp, lengths, strict=True)]
        # lm-eval's log-likelihood of a candidate = -(emdlm's summed completion NLL)
        assert loglik == pytest.approx([-s for s in summed], rel=1e-4, abs=1e-4)
        # emdlm's text score = (prompt NLL + candidate NLL) / (scored tokens of the text)
        assert row["mean_nll"] == pytest.approx(
            [(p_sum + s) / (p_count + n) for s, n in zip(summed, lengths, strict=True)],
            rel=1e-4,
        )
        norm_picks.append(max(range(len(loglik)), key=lambda i: loglik[i] / lengths[i]))
    # acc_norm (per character) picks emdlm's completion-scored candidate (mean NLL per token)
    assert norm_picks == [min(range(len(c)), key=c.__getitem__) for c in completion]
    labels = [ex["label"] for ex in examples]
    sum_picks = [_argmax(_lm_eval_logliks(s)) for s in lm_samples]
    assert lm["acc,none"] == pytest.approx(_hit_rate(sum_picks, labels), abs=1e-12)
    assert lm["acc_norm,none"] == pytest.approx(_hit_rate(norm_picks, labels), abs=1e-12)
    assert metrics["accuracy"] == pytest.approx(
        _hit_rate([r["prediction"] for r in rows], labels), abs=1e-12
    )


def _hit_rate(picks: list[int], labels: list[int]) -> float:
    return sum(p == y for p, y in zip(picks, labels, strict=True)) / len(labels)
