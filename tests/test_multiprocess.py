"""The multi-process commands of docs/cli.md (the command-line tool's page), run verbatim (only
the config and the --output folder replaced): 2 CPU processes (gloo) with batch 4 each == 1
process with batch 8; and accelerate's MULTI_CPU trap (one process) is warned about."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from _torchrun import failure_text
from emdlm.config import load_config
from emdlm.training import run_training

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval=null",
    "train.max_steps=3", "train.grad_accum=1", "train.save_steps=100", "train.progress_bar=false",
    "train.tensorboard=false", "objective.name=mixce",
]
# MixCE: a per-token weighted CE, so the loss of a batch is a sum over tokens and a 2 x 4 split
# is the same computation as 1 x 8. (NTIL averages over the numbers of each process's batch:
# see test_integrations_transformers for what holds there.)
PLACEHOLDER = "my_run.yaml"
OUTPUT = re.compile(r"--output \S+")  # each command's own run folder, replaced by the test's


CLI_DOC = ROOT / "docs" / "cli.md"  # the README links there for launchers


def doc_multiprocess_commands() -> list[str]:
    """Every `accelerate launch` / `torchrun` line inside the ```bash blocks of docs/cli.md."""
    text = CLI_DOC.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(("accelerate launch", "torchrun")):
                commands.append(line)
    return commands


COMMANDS = doc_multiprocess_commands()


def test_readme_has_both_multiprocess_commands():
    assert [c.split()[0] for c in COMMANDS] == ["accelerate", "torchrun"], COMMANDS
    assert all(PLACEHOLDER in c for c in COMMANDS)
    outputs = [OUTPUT.findall(c) for c in COMMANDS]  # one --output each, never the same folder
    assert all(len(o) == 1 for o in outputs) and len({o[0] for o in outputs}) == len(COMMANDS)
    assert not any("src/" in c for c in COMMANDS)  # they work where emdlm is only installed


def _tiny_config(path: Path, out: Path, batch: int) -> Path:
    cfg = load_config("arithmetic_ce", [*COMMON, f"train.batch_size={batch}", f"output_dir={out}"])
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def _run(command: str, config: Path) -> subprocess.CompletedProcess:
    """``command`` with only the config placeholder replaced, run by bash (as typed in a
    terminal: ``$(emdlm config-path ...)`` expands) from the config's folder, outside the
    repository (so a packaged launcher config must be reached through the installed package);
    the venv's scripts on PATH."""
    argv = [config.as_posix() if arg == PLACEHOLDER else arg for arg in shlex.split(command)]
    assert argv.count(config.as_posix()) == 1
    line = command.replace(PLACEHOLDER, shlex.quote(config.as_posix()))
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }  # fmt: skip
    return subprocess.run(["bash", "-c", line], cwd=config.parent, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    one = tmp_path_factory.mktemp("one")
    cfg = load_config("arithmetic_ce", [*COMMON, "train.batch_size=8", f"output_dir={one}/run"])
    run_training(cfg)
    return one / "run"


@pytest.mark.parametrize("command", COMMANDS, ids=[c.split()[0] for c in COMMANDS])
def test_readme_command_trains_on_two_processes(tmp_path, one_process, command):
    two = tmp_path / "two"
    command = OUTPUT.sub(f"--output {shlex.quote(two.as_posix())}", command)
    proc = _run(command, _tiny_config(tmp_path / "tiny.yaml", two, batch=4))
    assert proc.returncode == 0, failure_text(proc.stderr)
    assert re.search(r"emdlm: world size 2 \(", proc.stderr), proc.stderr[-3000:]
    assert "but this run has" not in proc.stderr  # no launcher-mismatch warning
    assert "find_unused_parameters" not in proc.stderr  # no DDP search, no warning

    # both ranks consumed data: 3 steps x 2 x 4 examples of 64 is 0.375 epoch (0.1875 on one)
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["epoch"] == pytest.approx(3 * 2 * 4 / 64)
    log_two = [json.loads(x) for x in (two / "train_log.jsonl").read_text().splitlines()]
    log_one = [json.loads(x) for x in (one_process / "train_log.jsonl").read_text().splitlines()]
    assert len(log_two) == len(log_one) == 3  # rank 0 logs once per step
    # the run's train_loss is the mean step loss of all processes, as on one process
    one_summary = json.loads((one_process / "train_summary.json").read_text())
    assert summary["train_loss"] == pytest.approx(one_summary["train_loss"], rel=1e-5)
    for a, b in zip(log_two, log_one, strict=True):
        assert a["n_scored"] == b["n_scored"]  # the same 8 examples per step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    w_one = load_file(str(one_process / "model.safetensors"))
    w_two = load_file(str(two / "model.safetensors"))
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5)


def test_accelerate_multi_cpu_config_is_one_process_and_warned(tmp_path):
    """The trap the shipped config avoids: MULTI_CPU without a hostfile starts one process.
    emdlm says so (the run itself still completes)."""
    trap = tmp_path / "multi_cpu.yaml"
    trap.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
        "num_machines": 1, "num_processes": 2, "machine_rank": 0, "mixed_precision": "no",
        "use_cpu": True,
    }))  # fmt: skip
    command = f"accelerate launch --config_file {trap} -m emdlm.cli train -c {PLACEHOLDER}"
    out = tmp_path / "run"
    proc = _run(command, _tiny_config(tmp_path / "tiny.yaml", out, batch=4))
    assert proc.returncode == 0, failure_text(proc.stderr)
    assert "emdlm: world size 1 (accelerate launch)" in proc.stderr
    assert "accelerate launch was asked for 2 processes, but this run has 1" in proc.stderr
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["epoch"] == pytest.approx(3 * 4 / 64)  # one process's data only
