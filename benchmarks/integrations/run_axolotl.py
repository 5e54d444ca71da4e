"""Axolotl with the emdlm plugin, for real: ``python -m axolotl.cli.train <config>`` (Axolotl's
own entry point, without its accelerate launcher) on a tiny LLaMA for a few CPU steps, once
with CE and once with NTIL, then the plugin's unit tests against Axolotl's real ``BasePlugin``.

    .integrations/axolotl/bin/python benchmarks/integrations/run_axolotl.py WORK RESULT.json
"""

from __future__ import annotations

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


def config(model: Path, data: Path, out: Path, objective: dict) -> dict:
    """An Axolotl config: the tiny model, plain-text rows, fp32 on CPU, the emdlm plugin."""
    return {
        "base_model": str(model), "model_type": "AutoModelForCausalLM",
        "tokenizer_type": "AutoTokenizer",
        "datasets": [{"path": str(data), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(out / "prepared"), "val_set_size": 0,
        "output_dir": str(out), "sequence_len": 32, "sample_packing": False,
        "micro_batch_size": BATCH_SIZE, "gradient_accumulation_steps": 1, "max_steps": MAX_STEPS,
        "learning_rate": 1e-3, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "logging_steps": 1, "save_strategy": "steps", "save_steps": MAX_STEPS,
        "bf16": False, "fp16": False, "tf32": False, "seed": 0,
        "plugins": ["emdlm.integrations.axolotl.EMDLMPlugin"],
        "emdlm": {"objective": objective},
    }  # fmt: skip


def main() -> None:
    work, result_path = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    model = make_tiny_model(work / "model")
    data = write_jsonl(work / "data.jsonl",
                       [{"text": r["prompt"] + r["completion"]} for r in arithmetic_rows()])
    result = {"framework": "axolotl", "versions": environment("axolotl"),
              "entry": "python -m axolotl.cli.train <config.yaml>", "runs": {}}  # fmt: skip
    for name, objective in OBJECTIVES.items():
        out = work / f"out_{name}"
        cfg_path = work / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(config(model, data, out, objective)))
        code = run_logged([sys.executable, "-m", "axolotl.cli.train", str(cfg_path)],
                          work / f"{name}.log", work)  # fmt: skip
        run = {"exit_code": code, "log": shown(work / f"{name}.log")}
        run.update(run_history(out, "checkpoint-*/trainer_state.json", name))
        result["runs"][name] = run
    result["hook_tests"] = run_hook_tests(ROOT / "tests" / "test_axolotl_plugin.py",
                                          work / "hook_tests.log", ROOT)  # fmt: skip
    write_result(result_path, result)


if __name__ == "__main__":
    main()
