"""2 CPU processes (torchrun, gloo) with batch 4 each == 1 process with batch 8."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from emdlm.config import load_config
from emdlm.training import run_training

pytestmark = pytest.mark.slow

COMMON = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval=null",
    "train.max_steps=3", "train.grad_accum=1", "train.save_steps=100", "train.progress_bar=false",
    "train.tensorboard=false", "objective.name=mixce",
]
# MixCE: a per-token weighted CE, so the loss of a batch is a sum over tokens and a 2 x 4 split
# is the same computation as 1 x 8. (NTIL averages over the numbers of each process's batch:
# see test_integrations_transformers for what holds there.)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "emdlm.cli", "train", "-c", "arithmetic_ce", *COMMON, "train.batch_size=4",
        f"output_dir={two}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = tmp_path / "one"
    run_training(load_config("arithmetic_ce", [*COMMON, "train.batch_size=8", f"output_dir={one}"]))

    log_two = [json.loads(x) for x in (two / "train_log.jsonl").read_text().splitlines()]
    log_one = [json.loads(x) for x in (one / "train_log.jsonl").read_text().splitlines()]
    assert len(log_two) == len(log_one) == 3  # rank 0 logs once per step
    for a, b in zip(log_two, log_one, strict=True):
        assert a["n_scored"] == b["n_scored"]  # the same 8 examples per step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    w_one = load_file(str(one / "model.safetensors"))
    w_two = load_file(str(two / "model.safetensors"))
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5)
