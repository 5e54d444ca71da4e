"""What every framework run of ``make integrations`` shares: a tiny LLaMA built from a config
(char tokenizer, 1 layer, hidden size 32: CPU, seconds per step), arithmetic training rows
written in each framework's dataset format, and the checks on a training log.

Run inside a framework's venv (which has this checkout's wheel installed), by the
``run_<framework>.py`` scripts beside this file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OFFLINE = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled", "DISABLE_VERSION_CHECK": "1", "USE_MODELSCOPE_HUB": "0",
}  # fmt: skip
OBJECTIVES = {"ce": {"name": "ce"}, "ntil": {"name": "ntil", "params": {"preset": "stable"}}}
MAX_STEPS = 3
ROOT = Path(__file__).resolve().parents[2]
# one micro-batch per optimizer step: the trainer's logged loss is then the optimised value of
# that batch, which emdlm's record must equal (with accumulation, Axolotl 0.19 averages the
# micro-batches' means instead of dividing by the accumulated token count: see the report)
BATCH_SIZE = 16


def make_tiny_model(folder: Path) -> Path:
    """A 1-layer LLaMA (hidden 32) with emdlm's char tokenizer, saved as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from emdlm.tokenizers import load_tokenizer

    if (folder / "config.json").exists():
        return folder
    import torch

    torch.manual_seed(0)
    tok = load_tokenizer("char")
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    ))  # fmt: skip
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def arithmetic_rows(n: int = 128) -> list[dict[str, str]]:
    """``n`` training problems (1-3 digit + and -) as prompt / completion pairs."""
    from emdlm.tasks import generate_task

    return generate_task("arithmetic", n=n, split="train", seed=0, min_digits=1,
                         max_digits=3, ops="+-")  # fmt: skip


def shown(path: Path) -> str:
    """``path`` relative to the repository root where it lies inside it (for the report)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_logged(
    cmd: list[str], log: Path, cwd: Path, timeout: int = 1200, extra_env: dict | None = None,
) -> int:
    """Run ``cmd`` offline (no telemetry), stdout and stderr to ``log``; its exit code."""
    env = {**os.environ, **OFFLINE, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **(extra_env or {})}  # fmt: skip
    with log.open("w") as out:
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                  timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            out.write(f"\n(timed out after {timeout} s)\n")
            return 124


def run_history(out: Path, pattern: str, objective: str) -> dict[str, Any]:
    """:func:`check_history` of the newest ``trainer_state.json`` under ``out`` (``pattern``:
    where the framework writes it, for ``Path.rglob``), or the problem when there is none."""
    states = sorted(out.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not states:
        return {"problems": ["no trainer_state.json (the run did not reach its checkpoint)"]}
    return check_history(json.loads(states[-1].read_text())["log_history"], objective)


def check_history(history: list[dict[str, Any]], objective: str) -> dict[str, Any]:
    """The checks on a run's training records (``trainer_state.json``'s ``log_history``):
    every step logged ``emdlm/loss`` equal to the trainer's ``loss`` (the value it optimised;
    1e-5 relative), and, for a numeric objective, its components (``emdlm/ntil`` next to
    ``emdlm/ce``, the loss not equal to the CE component). Returns what was found."""
    steps = [h for h in history if "loss" in h and "step" in h]
    found: dict[str, Any] = {"steps_logged": len(steps), "problems": []}
    if not steps:
        found["problems"].append("no training record with a loss")
        return found
    found["components"] = sorted(k for k in steps[0] if k.startswith("emdlm/"))
    for h in steps:
        if "emdlm/loss" not in h:
            found["problems"].append(f"step {h['step']}: no emdlm/loss in the record")
            continue
        if not math.isclose(h["loss"], h["emdlm/loss"], rel_tol=1e-5):
            found["problems"].append(
                f"step {h['step']}: trainer loss {h['loss']} != emdlm/loss {h['emdlm/loss']}"
            )
    first = steps[0]
    found["first_step"] = {k: first[k] for k in ("loss", "emdlm/loss", "emdlm/ce", "emdlm/ntil")
                           if k in first}  # fmt: skip
    if objective == "ntil":
        if "emdlm/ntil" not in first:
            found["problems"].append("NTIL run without an emdlm/ntil component")
        elif math.isclose(first["loss"], first.get("emdlm/ce", float("nan")), rel_tol=1e-6):
            found["problems"].append("NTIL run whose loss equals its CE component")
    return found


def environment(framework: str) -> dict[str, Any]:
    """Versions of the framework's venv."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in (framework, "transformers", "torch", "trl", "peft", "emdlm"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def run_hook_tests(test_file: Path, log: Path, cwd: Path) -> dict[str, Any]:
    """``pytest`` on emdlm's unit test of this route, in this venv (the framework's real
    classes instead of the stand-ins); the pytest summary line and exit code."""
    start = time.perf_counter()
    code = run_logged([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       str(test_file)], log, cwd)  # fmt: skip
    lines = [x for x in log.read_text().splitlines() if " passed" in x or " failed" in x]
    return {"exit_code": code, "summary": lines[-1] if lines else "(no summary)",
            "seconds": round(time.perf_counter() - start, 1)}


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
