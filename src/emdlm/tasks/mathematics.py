"""DeepMind mathematics-dataset ``arithmetic__mixed`` (and siblings) as a named task.

The package (mathematics-dataset 1.0.1) imports ``base_solution_linear`` from
``sympy.solvers.diophantine``, which sympy >= 1.13 no longer exports there: :func:`_shim` puts it
back from ``sympy.solvers.diophantine.diophantine`` before the import. Answers may be fractions
("-6/11"). Train/test are disjoint by the dataset's own hash rule on the question text
(``train_test_split.is_train``); "test" draws from the interpolation difficulty.
"""

from __future__ import annotations

import hashlib
import importlib
import random
from typing import Any

import numpy as np

from emdlm.domains import COUNT
from emdlm.tasks import register_task


def _shim() -> None:
    # importlib, not "import ... as": sympy.solvers.diophantine is also a function's name
    dioph = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(dioph, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        dioph.base_solution_linear = base_solution_linear


def _is_train(question: str) -> bool:
    # same rule as mathematics_dataset.modules.train_test_split.is_train
    return int(hashlib.md5(question.encode("utf-8")).hexdigest(), 16) % 2 == 0


DIFFICULTY_LEVELS = ("easy", "medium", "hard")
# train and test draw from seeds 2·seed and 2·seed + 1 (the mapping fixes the published data);
# numpy's legacy seeding takes 0 .. 2**32 - 1, so this task takes seeds below 2**31
MAX_TASK_SEED = 2**31


def _entropy_level(level: int, levels: int = len(DIFFICULTY_LEVELS)) -> Any:
    """The entropy sub-range of difficulty ``level``: [x, x + y] -> [x + y*level/levels,
    x + y*(level+1)/levels], the rule of mathematics_dataset's generate.py for its
    train-easy / -medium / -hard files."""

    def restrict(entropy_range: tuple[float, float]) -> tuple[float, float]:
        low, length = entropy_range[0], entropy_range[1] - entropy_range[0]
        return (low + length * level / levels, low + length * (level + 1) / levels)

    return restrict


#: The legal values of the mathematics-dataset task's numeric parameters (emdlm.domains).
MATH_DOMAINS = {"max_tries_per_example": COUNT}


@register_task("math_arithmetic", eval_kind="number", domains=MATH_DOMAINS)
def math_arithmetic(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    module: str = "mixed",
    difficulty: str = "all",
    max_tries_per_example: int = 50,
) -> list[dict[str, Any]]:
    """``n`` problems from mathematics-dataset's arithmetic module ``module`` (default "mixed").

    Prompt is the question followed by " Answer: ", completion is the answer text.

    ``difficulty``: "all" (default) draws train problems over the module's whole training
    entropy range and test problems from its *interpolate* set, as the dataset's own splits;
    "easy" / "medium" / "hard" draw BOTH splits from that third of the training entropy range
    (the dataset's train-easy / -medium / -hard levels), still disjoint by the question-hash
    rule: a CPU-scale model that cannot learn the full task can be compared on the easy level.
    """
    if difficulty != "all" and difficulty not in DIFFICULTY_LEVELS:
        raise ValueError(f"difficulty must be 'all' or one of {', '.join(DIFFICULTY_LEVELS)}, "
                         f"got {difficulty!r}")
    if not 0 <= seed < MAX_TASK_SEED:
        raise ValueError(f"arithmetic__mixed takes seeds 0 .. {MAX_TASK_SEED - 1}, got {seed}")
    _shim()
    from mathematics_dataset.modules import arithmetic as md_arith

    if difficulty != "all":
        mods = md_arith.train(_entropy_level(DIFFICULTY_LEVELS.index(difficulty)))
    else:
        mods = md_arith.train(lambda r: r) if split == "train" else md_arith.test()
    if module not in mods:
        raise ValueError(f"unknown arithmetic module {module!r}; known: {', '.join(sorted(mods))}")
    gen = mods[module]
    random.seed(seed * 2 + (split == "test"))
    np.random.seed(seed * 2 + (split == "test"))
    out: list[dict[str, Any]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > n * max_tries_per_example:
            raise RuntimeError(f"mathematics-dataset produced too few {split} problems")
        problem = gen()
        question, answer = str(problem.question), str(problem.answer)
        if _is_train(question) != (split == "train"):
            continue
        out.append({"prompt": f"{question} Answer: ", "completion": answer})
    return out


# The name for it.
register_task("arithmetic__mixed", eval_kind="number")(math_arithmetic)  # checked: MATH_DOMAINS
