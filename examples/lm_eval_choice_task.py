"""Write two local multiple-choice tasks for lm-evaluation-harness (no hub): arithmetic problems
with the gold answer among distractors, as JSONL files and task YAMLs that read them.

    python examples/lm_eval_choice_task.py tasks/          # writes 2 JSONL + 2 YAML files
    lm_eval run --model hf --model_args pretrained=runs/arith,dtype=float32 \\
        --include_path tasks/ --tasks emdlm_arith_choice --device cpu
    emdlm eval runs/arith --data tasks/arith_choice.jsonl --kind choice

Each row has ``prompt``, ``completion`` (the gold answer), ``choices`` and ``label`` (the gold
index): the fields ``emdlm eval --kind choice`` reads, and those the YAML hands to lm-eval
(``doc_to_text``, ``doc_to_choice``, ``doc_to_target``; ``target_delimiter: ""`` so the
candidate follows the prompt with nothing in between, as emdlm scores it).

* ``emdlm_arith_choice``: the distractors differ from the gold answer in the units digit only,
  so every candidate has the same length. emdlm's choice score (mean NLL of the whole
  prompt + candidate text) and lm-eval's ``acc`` (summed log-likelihood of the candidate) and
  ``acc_norm`` (per character) then rank the candidates the same way.
* ``emdlm_arith_choice_mixed``: the distractors are the gold answer with a digit added or
  dropped (different lengths), where the three rules may disagree (docs/integrations.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from emdlm.tasks import generate_task

TASKS = {"emdlm_arith_choice": "arith_choice.jsonl",
         "emdlm_arith_choice_mixed": "arith_choice_mixed.jsonl"}

YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def same_length_distractors(gold: str) -> list[str]:
    """Three answers that differ from ``gold`` in the last digit only (same length, same sign)."""
    head, last = gold[:-1], int(gold[-1])
    return [f"{head}{(last + k) % 10}" for k in (1, 2, 3)]


def mixed_length_distractors(gold: str) -> list[str]:
    """Answers one digit longer and, where there is one to drop, one shorter than ``gold``."""
    longer = [gold + "0", gold + "7"]
    digits = gold.lstrip("-")
    shorter = [gold[:-1]] if len(digits) > 1 else [gold + "1"]
    return longer + shorter


def choice_rows(n: int, seed: int, mixed: bool) -> list[dict]:
    """``n`` arithmetic test problems (1-3 digit operands, + and -) as choice rows; the gold
    answer's position among the 4 candidates is drawn with ``seed``."""
    rng = random.Random(seed)
    rows = []
    problems = generate_task("arithmetic", n=n, split="test", seed=seed,
                             min_digits=1, max_digits=3, ops="+-")
    for ex in problems:
        gold = ex["completion"]
        choices = (mixed_length_distractors if mixed else same_length_distractors)(gold)
        label = rng.randrange(len(choices) + 1)
        choices.insert(label, gold)
        rows.append({"prompt": ex["prompt"], "completion": gold,
                     "choices": choices, "label": label})
    return rows


def write_tasks(folder: Path, n: int = 200, seed: int = 0) -> dict[str, Path]:
    """The JSONL files and task YAMLs in ``folder``; returns {task name: JSONL path}."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, name in TASKS.items():
        path = (folder / name).resolve()
        rows = choice_rows(n, seed, mixed=task.endswith("_mixed"))
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{task}.yaml").write_text(YAML.format(task=task, path=json.dumps(str(path))))
        written[task] = path
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where the JSONL and YAML files go")
    parser.add_argument("--n", type=int, default=200, help="problems per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for task, path in write_tasks(args.folder, args.n, args.seed).items():
        print(f"{task}: {path}")


if __name__ == "__main__":
    main()
