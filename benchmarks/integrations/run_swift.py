"""ms-swift with the emdlm losses, for real: ``swift sft`` (its own CLI) on a tiny LLaMA for a
few CPU steps with ``--loss_type emdlm_ce`` and ``emdlm_ntil_stable`` (registered by
examples/swift_emdlm_plugin.py through ``--external_plugins``), then the route's unit tests
against ms-swift's real ``BaseLoss``.

    .integrations/swift/bin/python benchmarks/integrations/run_swift.py WORK RESULT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from tiny import (
    BATCH_SIZE,
    MAX_STEPS,
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

LOSS_TYPES = {"ce": "emdlm_ce", "ntil": "emdlm_ntil_stable"}


def command(model: Path, data: Path, out: Path, loss_type: str) -> list[str]:
    swift = str(Path(sys.executable).parent / "swift")
    return [
        swift, "sft", "--model", str(model), "--model_type", "llama", "--template", "default",
        "--dataset", str(data), "--tuner_type", "full", "--torch_dtype", "float32",
        "--external_plugins", str(ROOT / "examples" / "swift_emdlm_plugin.py"),
        "--loss_type", loss_type, "--max_steps", str(MAX_STEPS),
        "--per_device_train_batch_size", str(BATCH_SIZE), "--gradient_accumulation_steps", "1",
        "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
        "--logging_steps", "1", "--save_steps", str(MAX_STEPS), "--max_length", "256",
        "--dataset_num_proc", "1", "--dataloader_num_workers", "0", "--split_dataset_ratio",
        "0", "--output_dir", str(out), "--add_version", "false", "--report_to", "none",
        "--use_hf", "true", "--seed", "0",
    ]  # fmt: skip


def main() -> None:
    work, result_path = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    model = make_tiny_model(work / "model")
    data = write_jsonl(work / "data.jsonl", [
        {"messages": [{"role": "user", "content": r["prompt"]},
                      {"role": "assistant", "content": r["completion"]}]}
        for r in arithmetic_rows()
    ])  # fmt: skip
    result = {"framework": "ms-swift", "versions": environment("ms-swift"),
              "entry": "swift sft --external_plugins examples/swift_emdlm_plugin.py "
                       "--loss_type emdlm_<objective>",
              "note": "ms-swift loads every model with trust_remote_code=True (its loaders' "
                      "default); the tiny model folder emdlm wrote carries no code",
              "runs": {}}  # fmt: skip
    for name, loss_type in LOSS_TYPES.items():
        out = work / f"out_{name}"
        code = run_logged(command(model, data, out, loss_type), work / f"{name}.log", work)
        run = {"exit_code": code, "loss_type": loss_type, "log": shown(work / f"{name}.log")}
        run.update(run_history(out, "checkpoint-*/trainer_state.json", name))
        result["runs"][name] = run
    result["hook_tests"] = run_hook_tests(ROOT / "tests" / "test_swift_loss.py",
                                          work / "hook_tests.log", ROOT)  # fmt: skip
    write_result(result_path, result)


if __name__ == "__main__":
    main()
