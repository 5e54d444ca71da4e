"""The README and the docs run as written, so the documentation cannot drift from the code.

- Every ```python block of README.md runs in a fresh subprocess, offline, from an empty folder;
  so does every ```python block of docs/*.md, except the excerpts listed in PYTHON_EXCERPTS with
  the test that runs each (with the names it uses defined).
- Every line of a ```bash block of README.md or docs/*.md that starts with ``emdlm `` is run
  (the README's JSONL block and the docs blocks of DOCS_BASH_RUN, whole, from an empty folder;
  docs/data.md's blocks in tests/test_data_docs.py) or listed in NOT_RUN with the reason.
- The README's Trainer snippet logs every loss component; the TRL block of docs/integrations.md
  trains in fp32, its LoRA trainer only the adapter.
- README.md stays short (MAX_README_LINES) and every relative link of README.md and docs/*.md
  points to an existing file or folder (anchors: the strict site build, tests/test_docs_site.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200
SNIPPET_TIMEOUT_S = 300  # each snippet takes seconds; the limit only stops a hung one

# ```bash lines starting with "emdlm " that no test runs as written here, and why
NOT_RUN = {
    "emdlm train -c arithmetic_ntil": "the demo's NTIL run: 1000 steps, minutes on a CPU "
    "(`make demo` runs it; tests/test_cli.py trains packaged configs with tiny overrides)",
    "emdlm train -c my_run.yaml objective.name=emo train.grad_accum=4 --output runs/emo":
    "my_run.yaml stands for the reader's config; overrides and --output: tests/test_cli.py",
    "emdlm train -c my_run.yaml --resume": "my_run.yaml stands for the reader's config; "
    "--resume: tests/test_cli.py, tests/test_resume_damaged.py",
    "emdlm eval runs/emo --task arithmetic --n 500": "needs the run of the line above; "
    "`emdlm eval` runs in the README's JSONL block and tests/test_cli.py",
    "emdlm eval runs/emo --data other_test.jsonl --out runs/emo/eval_other": "needs the run "
    "above; `emdlm eval --data ... --out`: tests/test_cli.py, tests/test_run_lock.py",
    "emdlm sample runs/lm --task english_continuation --out corpus.jsonl": "needs a trained "
    "language model (runs/lm); `emdlm sample`: tests/test_sample_corpus.py",
    "emdlm demo": "takes minutes (two 1000-step runs); `make demo` runs it, tests/test_cli.py "
    "checks its arguments",
}
# every ```bash block of the README and the docs: its emdlm lines are run or listed above
NOT_RUN.update({
    "emdlm train -c pretrain_gpt2_english": "EMO protocol step 1: pre-trains a model for hours "
    "(its config loads in tests/test_cli.py::test_every_shipped_config_loads)",
    "emdlm eval runs/pretrain_gpt2_english": "needs the pre-trained model of the line above",
    "emdlm train -c pretrain_gpt2_english train.seed=1 "
    "output_dir=runs/pretrain_gpt2_english_seed1": "the same pre-training with another seed "
    "(EMO's cost head in the oracle experiment): minutes to hours, as above",
    "emdlm experiment -c emo_finetune_news_dev": "an experiment grid (hours); every packaged grid "
    "expands in tests/test_experiment_grid.py and the runner is tested on tiny grids",
    "emdlm experiment -c emo_finetune_news": "an experiment grid (hours), as above",
    "emdlm sample runs/pretrain_gpt2_english --task english_continuation --split train \\":
    "needs the pre-trained model; `emdlm sample`: tests/test_sample_corpus.py",
    "emdlm sample runs/pretrain_gpt2_english --task english_continuation --split test \\":
    "needs the pre-trained model; `emdlm sample`: tests/test_sample_corpus.py",
    "emdlm experiment -c emo_oracle": "an experiment grid (hours) on the sampled corpus",
    "emdlm eval runs/news_emo_s0 --task polarity_choice --kind choice "
    "data.eval.params='{shots: 8}'": "needs a fine-tuned run; choice evaluation: "
    "tests/test_choice_eval.py",
    "emdlm experiment -c my_exp.yaml seeds=2 workers=1 threads_per_worker=2 "
    "output_dir=runs/w1t2": "my_exp.yaml stands for the reader's grid; workers and threads: "
    "tests/test_experiment_runner.py",
    "emdlm experiment -c my_exp.yaml seeds=2 workers=2 threads_per_worker=1 "
    "output_dir=runs/w2t1": "as the line above",
    "emdlm experiment -c arithmetic_objectives": "an experiment grid (hours), as above",
    "emdlm experiment -c my_exp.yaml seeds=3 base.train.max_steps=500 workers=2": "my_exp.yaml "
    "stands for the reader's grid; overrides: tests/test_experiment_grid.py",
    "emdlm experiment -c my_exp.yaml --earlier-results old/results.csv": "my_exp.yaml and "
    "old/results.csv stand for the reader's grid and its earlier file; --earlier-results: "
    "tests/test_earlier_rows.py (through the CLI too)",
    "emdlm experiment -c my_exp.yaml --report-only": "my_exp.yaml stands for the reader's grid; "
    "--report-only: tests/test_experiment_report.py",
    "emdlm experiment -c my_exp.yaml --only '*/ntil/seed4'": "my_exp.yaml stands for the "
    "reader's grid; --only: tests/test_experiment_runner.py",
    "emdlm experiment -c arithmetic_tokenizers output_dir=<new folder> base.train.max_steps=<2x> "
    "\\": "a template with placeholders for a replication (hours)",
    "emdlm experiment -c grid_ray.yaml": "a grid (hours) on a Ray cluster of several nodes; the "
    "Ray launcher runs on a local cluster in tests/test_launchers.py",
    "emdlm experiment -c grid_ray.yaml launcher.address=local": "the same grid (hours) on a "
    "local Ray; tests/test_launchers.py runs a tiny one",
    "emdlm experiment -c grid_slurm.yaml": "needs a SLURM cluster; its submission is checked in "
    "tests/test_launchers.py with a stand-in sbatch, the jobs run through submitit's local "
    "executor there",
    "emdlm experiment -c grid_slurm.yaml --report-only": "needs the SLURM grid above; "
    "--report-only: tests/test_experiment_report.py",
    "emdlm train -c arithmetic_ntil train.max_steps=200 output_dir=runs/arith": "the lm-eval "
    "block's run (minutes); tests/test_lm_eval_route.py runs the block with a 2-step model",
    "emdlm eval runs/arith --data tasks/arith_choice.jsonl --kind choice": "needs the run above; "
    "tests/test_lm_eval_route.py runs it on the 2-step model",
})
BASH_DOCS = (README, *sorted(DOCS.glob("*.md")))
RUN_WHOLE = {"data.md": "every bash block runs whole in tests/test_data_docs.py"}
# ```bash blocks of docs/ run whole here, from an empty folder: (page, marker) -> the run folder
# and the files it must hold afterwards
DOCS_BASH_RUN = {
    ("cli.md", "cat > lora.yaml"): ("runs/lora", ("adapter/adapter_config.json",
                                                  "model.safetensors")),
    ("emo_protocol.md", "cat > try_pre.yaml"): ("runs/try_emo", ("model.safetensors",
                                                                "eval/metrics.json")),
}
# ```python blocks of docs/ that are not whole programs, and the test that runs each with the
# names it uses defined (every other docs/ python block runs as written, from an empty folder)
PYTHON_EXCERPTS = {
    ("integrations.md", "make_compute_loss_func(loss_fn)  # shifts labels"): "the core of the "
    "README's Trainer snippet, which runs whole (test_readme_trainer_snippet_logs_components)",
    ("data.md", "read_icdar2015"): "tests/test_data_docs.py, on an ICDAR2015 folder laid out as "
    "the page says",
}
RUN_BLOCK_MARKER = "cat > tiny.yaml"  # the README block `emdlm train` on your own JSONL


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def python_block(marker: str, path: Path = README) -> str:
    """The one ```python block of ``path`` that contains ``marker``."""
    blocks = [b for b in _blocks(path, "python") if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of {path.name} contain {marker!r}"
    return blocks[0]


def _env() -> dict[str, str]:
    return {
        **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # fmt: skip


def _failure(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-3000:], proc.stderr[-3000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


README_PYTHON = _blocks(README, "python")


def test_readme_has_the_three_examples():
    assert len(README_PYTHON) == 2, "README: the plain-loop and Trainer snippets (python)"
    run_blocks = [b for b in _blocks(README, "bash") if RUN_BLOCK_MARKER in b]
    assert len(run_blocks) == 1, "README: the `emdlm train` on your own JSONL block (bash)"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(README_PYTHON)))
def test_every_readme_python_block_runs(tmp_path, index):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(README_PYTHON[index])
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, _failure(proc)


def _emdlm_lines(block: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line.startswith("emdlm ")]


def test_every_emdlm_bash_line_is_run_or_listed():
    listed, run = set(), set()
    for path in BASH_DOCS:
        for block in _blocks(path, "bash"):
            whole = ((path == README and RUN_BLOCK_MARKER in block) or path.name in RUN_WHOLE
                     or any(path.name == p and m in block for p, m in DOCS_BASH_RUN))
            target = run if whole else listed
            target.update(_emdlm_lines(block))
    assert run, "the README's JSONL block has no emdlm line"
    unlisted = listed - NOT_RUN.keys()
    assert not unlisted, f"emdlm lines neither run nor listed in NOT_RUN: {sorted(unlisted)}"
    stale = NOT_RUN.keys() - listed
    assert not stale, f"NOT_RUN names lines that are no longer in the docs: {sorted(stale)}"


@pytest.mark.slow
def test_readme_jsonl_block_trains_and_evaluates(tmp_path):
    (block,) = [b for b in _blocks(README, "bash") if RUN_BLOCK_MARKER in b]
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, _failure(proc)
    run = tmp_path / "runs" / "tiny"  # the block's --output, inside the temporary folder
    for name in ("model.safetensors", "train_log.jsonl", "train_summary.json",
                 "eval/metrics.json", "eval/predictions.jsonl"):  # fmt: skip
        assert (run / name).is_file(), name
    assert "exact_match" in proc.stdout


@pytest.mark.slow
def test_readme_trainer_snippet_logs_components(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet writes to "out"
    namespace: dict = {}
    exec(python_block("LossComponentsCallback(compute_loss)"), namespace)
    history = [h for h in namespace["trainer"].state.log_history if "loss" in h]
    assert history, "the snippet logged nothing"
    for record in history:
        for key in ("emdlm/ce", "emdlm/ntil", "emdlm/mix_coef", "emdlm/loss"):
            assert key in record, (key, record)
        assert record["emdlm/loss"] == pytest.approx(record["loss"], rel=1e-5)


@pytest.mark.slow
def test_readme_trl_snippet_trains_in_fp32(tmp_path, monkeypatch):
    """The TRL block of docs/integrations.md, whole (name kept: docs/audit.md U3 cites it)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")

    monkeypatch.chdir(tmp_path)  # the block writes to "out"
    namespace: dict = {}
    exec(python_block("EMDLMSFTTrainer(", DOCS / "integrations.md"), namespace)
    for name in ("trainer", "lora"):
        trainer = namespace[name]
        assert trainer.args.bf16 is False and trainer.state.global_step == 2, name
        assert any("emdlm/ntil" in h for h in trainer.state.log_history), name
    trainable = [n for n, p in namespace["lora"].model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # only the adapter trained


@pytest.mark.slow
@pytest.mark.parametrize(("page", "marker"), list(DOCS_BASH_RUN), ids=[p for p, _ in DOCS_BASH_RUN])
def test_docs_bash_block_runs(tmp_path, page, marker):
    (block,) = [b for b in _blocks(DOCS / page, "bash") if marker in b]
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"{page}: " + _failure(proc)
    folder, files = DOCS_BASH_RUN[(page, marker)]
    for name in files:
        assert (tmp_path / folder / name).is_file(), f"{page}: {folder}/{name}"


def _docs_python_blocks() -> list[tuple[str, str]]:
    return [(path.name, block) for path in sorted(DOCS.glob("*.md"))
            for block in _blocks(path, "python")]


def _excerpt(page: str, block: str) -> bool:
    return any(page == p and marker in block for p, marker in PYTHON_EXCERPTS)


DOCS_PYTHON = [(page, b) for page, b in _docs_python_blocks() if not _excerpt(page, b)]


def test_every_docs_python_block_runs_or_is_listed():
    listed = [(p, m) for p, m in PYTHON_EXCERPTS
              if any(page == p and m in b for page, b in _docs_python_blocks())]
    assert listed == list(PYTHON_EXCERPTS), "PYTHON_EXCERPTS names blocks no page has"
    assert DOCS_PYTHON, "no whole-program python block in docs/"


@pytest.mark.slow
@pytest.mark.parametrize(("page", "block"), DOCS_PYTHON, ids=[p for p, _ in DOCS_PYTHON])
def test_every_docs_python_block_runs(tmp_path, page, block):
    script = tmp_path / "block.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"{page}: " + _failure(proc)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md: {n} lines, at most {MAX_README_LINES}: use docs/"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor do code spans
    targets = [m.group(1).split("#", 1)[0] for m in LINK.finditer(text)]
    # not http:, mailto:, ...
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(path):
    links = _relative_links(path)
    missing = [t for t in links if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_docs_index_lists_every_page():
    linked = set(_relative_links(DOCS / "index.md"))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert not pages - linked, f"docs/index.md does not link {sorted(pages - linked)}"
