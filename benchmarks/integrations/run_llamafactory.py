"""LLaMA-Factory with the emdlm objective, for real: ``python -m emdlm.integrations.llamafactory
<config.yaml>`` (LLaMA-Factory's own ``run_exp`` with emdlm's callback) on a tiny LLaMA for a
few CPU steps, once with CE and once with NTIL, then the route's unit tests in its venv.

    .integrations/llamafactory/bin/python benchmarks/integrations/run_llamafactory.py \\
        WORK RESULT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from tiny import (
    BATCH_SIZE,
    MAX_STEPS,
    OBJECTIVES,
    ROOT,
    arithmetic_rows,
    environment,
    make_tiny_model,
    run_history,
    run_hook_tests,
    run_logged,
    shown,
    write_jsonl,
    write_result,
)

# LLaMA-Factory 0.9.5 imports torchaudio when it starts (data/mm_plugin.py), and no torchaudio
# build loads beside torch 2.13 (the newest, 2.11.1, fails to load its library): the run puts
# this empty stand-in first on the path. Text SFT never calls it; any use raises.
TORCHAUDIO_STAND_IN = '''"""Stand-in torchaudio (none loads beside torch 2.13)."""


def __getattr__(name):
    raise ImportError(f"torchaudio.{name}: this is emdlm's stand-in; no torchaudio is installed")
'''


def stand_in_path(work: Path) -> Path:
    folder = work / "stand_in"
    (folder / "torchaudio").mkdir(parents=True, exist_ok=True)
    (folder / "torchaudio" / "__init__.py").write_text(TORCHAUDIO_STAND_IN)
    return folder


def config(model: Path, data_dir: Path, out: Path, objective: dict) -> dict:
    """A LLaMA-Factory SFT config (full fine-tune, fp32, CPU) plus the ``emdlm:`` section."""
    return {
        "model_name_or_path": str(model), "trust_remote_code": False, "stage": "sft",
        "do_train": True, "finetuning_type": "full", "dataset": "emdlm_arith",
        "dataset_dir": str(data_dir), "template": "empty", "cutoff_len": 128,
        "max_steps": MAX_STEPS, "per_device_train_batch_size": BATCH_SIZE,
        "gradient_accumulation_steps": 1, "learning_rate": 1e-3,
        "lr_scheduler_type": "constant", "logging_steps": 1, "save_steps": MAX_STEPS,
        "output_dir": str(out), "overwrite_output_dir": True, "report_to": "none",
        "bf16": False, "seed": 0, "emdlm": {"objective": objective},
    }  # fmt: skip


def main() -> None:
    work, result_path = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    model = make_tiny_model(work / "model")
    write_jsonl(work / "data" / "arith.jsonl",
                [{"instruction": r["prompt"], "input": "", "output": r["completion"]}
                 for r in arithmetic_rows()])  # fmt: skip
    (work / "data" / "dataset_info.json").write_text(json.dumps(
        {"emdlm_arith": {"file_name": "arith.jsonl", "formatting": "alpaca"}}
    ))  # fmt: skip
    result = {"framework": "llamafactory", "versions": environment("llamafactory"),
              "entry": "python -m emdlm.integrations.llamafactory <config.yaml>",
              "note": "a stand-in torchaudio module on PYTHONPATH: LLaMA-Factory 0.9.5 imports "
                      "torchaudio at start and none loads beside torch 2.13",
              "runs": {}}  # fmt: skip
    for name, objective in OBJECTIVES.items():
        out = work / f"out_{name}"
        cfg_path = work / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(config(model, work / "data", out, objective)))
        code = run_logged([sys.executable, "-m", "emdlm.integrations.llamafactory",
                           str(cfg_path)], work / f"{name}.log", work,
                          extra_env={"PYTHONPATH": str(stand_in_path(work))})  # fmt: skip
        run = {"exit_code": code, "log": shown(work / f"{name}.log")}
        run.update(run_history(out, "trainer_state.json", name))
        result["runs"][name] = run
    result["hook_tests"] = run_hook_tests(ROOT / "tests" / "test_llamafactory_route.py",
                                          work / "hook_tests.log", ROOT)  # fmt: skip
    write_result(result_path, result)


if __name__ == "__main__":
    main()
