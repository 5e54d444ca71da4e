"""docs/results/integrations.md from the result files of ``make integrations``
(``.integrations/results/<framework>.json``, written by ``run_<framework>.py``).

    python benchmarks/integrations/report.py .integrations/results docs/results/integrations.md
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

FRAMEWORKS = ("axolotl", "ms-swift", "llamafactory")
FILES = {"axolotl": "axolotl.json", "ms-swift": "swift.json", "llamafactory": "llamafactory.json"}

HEADER = """# Integrations: Axolotl, ms-swift, LLaMA-Factory (the output of `make integrations`)

[all docs](../index.md) · [integrations](../integrations.md)

Written by `make integrations` on {when} ({machine}); each framework in its own venv
(`benchmarks/integrations/build_venvs.sh`: the framework's own resolved dependencies, torch
2.13.0 CPU, this checkout's wheel). Each ran a real training through its own entry point: a tiny
LLaMA built from a config (1 layer, hidden size 32, emdlm's char tokenizer), arithmetic rows,
{steps} optimizer steps of 16 rows on the CPU, once with CE and once with NTIL (preset
`stable`). What success looks like: every logged step carries emdlm's components and
`emdlm/loss` (the value emdlm's `ComputeLoss` returned for that batch) equals the trainer's
logged `loss` (the value it optimised) to 1e-5; an NTIL run logs `emdlm/ntil` and its loss is
not its CE component. Then the route's unit tests ran in the same venv, against the
framework's real classes (Axolotl's `BasePlugin`, ms-swift's `BaseLoss` and `loss_map`); they
compare the installed loss with emdlm's loss computed directly on the same batch.
"""


def _row(name: str, result: dict | None) -> list[str]:
    if result is None:
        return [name, "—", "—", "did not run (no result file)", "—", "—"]
    versions = result["versions"]
    version = versions.get(name) or versions.get(name.replace("-", "_"))
    runs = []
    for objective, run in result["runs"].items():
        ok = run["exit_code"] == 0 and not run.get("problems")
        first = run.get("first_step", {})
        value = (f"loss {first['loss']:.6f}, emdlm/loss {first['emdlm/loss']:.6f}"
                 if "loss" in first and "emdlm/loss" in first else "no loss logged")
        runs.append(f"{objective}: {'trained' if ok else 'FAILED'} ({run.get('steps_logged', 0)}"
                    f" steps; first step {value})")  # fmt: skip
    hooks = result.get("hook_tests", {})
    return [name, str(version), str(versions.get("transformers")), "<br>".join(runs),
            hooks.get("summary", "not run"), result["entry"]]  # fmt: skip


def _problems(results: dict[str, dict | None]) -> list[str]:
    lines = []
    for name, result in results.items():
        if result is None:
            continue
        for objective, run in result["runs"].items():
            for problem in run.get("problems", []):
                lines.append(f"- {name} {objective}: {problem} (log: `{run.get('log')}`)")
            if run["exit_code"] != 0:
                lines.append(f"- {name} {objective}: exit code {run['exit_code']} "
                             f"(log: `{run.get('log')}`)")  # fmt: skip
        if result.get("hook_tests", {}).get("exit_code", 0) != 0:
            lines.append(f"- {name}: the unit tests failed in its venv")
    return lines


def main() -> None:
    results_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    results = {}
    for name in FRAMEWORKS:
        path = results_dir / FILES[name]
        results[name] = json.loads(path.read_text()) if path.exists() else None
    steps = next((len(r["runs"]) and r["runs"][next(iter(r["runs"]))].get("steps_logged")
                  for r in results.values() if r), "?")  # fmt: skip
    text = HEADER.format(
        when=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.machine()}, {platform.system()}, CPU only", steps=steps,
    )
    table = [["framework", "version", "transformers", "what ran (CE, NTIL)",
              "unit tests in its venv", "entry point"],
             ["---"] * 6] + [_row(n, r) for n, r in results.items()]  # fmt: skip
    text += "\n" + "\n".join("| " + " | ".join(row) + " |" for row in table) + "\n"
    problems = _problems(results)
    text += "\n## What did not work\n\n" + ("\n".join(problems) if problems else
                                           "Nothing: every run and test above passed.") + "\n"
    text += ("\nNot exercised by these trainings: `from_hidden` and `number_scope` (only by the "
             "unit tests, in each venv); LoRA, gradient accumulation, more than one process "
             "and a GPU (not at all).\n")  # fmt: skip
    notes = [f"- {n}: {r['note']}" for n, r in results.items() if r and r.get("note")]
    if notes:
        text += "\n## Notes\n\n" + "\n".join(notes) + "\n"
    tested = sorted({r["versions"]["transformers"] for r in results.values() if r},
                    key=lambda v: tuple(int(p) for p in v.split(".")[:3] if p.isdigit()))
    text += ("\n## transformers versions tested\n\n"
             f"{', '.join(tested)} here, with 5.23.0 (the pinned set, CI).\n")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
