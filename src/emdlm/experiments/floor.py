"""The constant-answer floor of a numeric task: the errors of answering every test problem
with one constant (0, and the test median). A model that does not beat it has not learned the
task, and differences between its objectives say nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from emdlm.eval_outputs import read_predictions
from emdlm.experiments.cell_folder import CELL_DONE, final_predictions
from emdlm.experiments.grid import Cell


def constant_answer_floor(references: Sequence[str]) -> dict[str, dict[str, float]]:
    """Errors of answering every problem with one constant, on a numeric test set.

    Two constants: 0, and the references' median (the constant with the least mean absolute
    error over this set, chosen with the answers, so it flatters the constant). A model
    whose ``abs_error_mean`` does not beat them has learned nothing of its inputs that moves
    its answers closer (a learning floor, not a chance level). Per constant: ``abs_error_mean``,
    ``abs_error_median``, ``log10_error_mean`` (log10(1 + |c - r|)) and ``exact_match`` (share
    of references equal to it). References that do not parse are left out; empty dict when
    none parses.
    """
    from emdlm.metrics import parse_number

    values = np.array([v for v in (parse_number(str(r)) for r in references) if v is not None],
                      dtype=np.float64)
    if values.size == 0:
        return {}
    floor = {}
    for name, constant in (("0", 0.0), ("median", float(np.median(values)))):
        err = np.abs(values - constant)
        floor[name] = {"constant": constant, "abs_error_mean": float(err.mean()),
                       "abs_error_median": float(np.median(err)),
                       "log10_error_mean": float(np.log10(1.0 + err).mean()),
                       "exact_match": float(np.count_nonzero(err == 0)) / err.size}
    return floor


@dataclass
class TaskFloor:
    """The constant-answer floor of a task's test set (:func:`constant_answer_floor`), with the
    number of test problems it was computed on and how many of them are distinct by (prompt,
    reference) (None when the predictions carry no prompt)."""

    floor: dict[str, dict[str, float]]
    count: int
    distinct: int | None

    @property
    def best_abs_error(self) -> float:
        """The smaller abs_error_mean of the two constants (the median's, by construction)."""
        return min(c["abs_error_mean"] for c in self.floor.values())


def task_floor(cells: Sequence[Cell], task: str) -> TaskFloor | None:
    """The constant-answer floor on the task's test set, from one finished cell's last
    predictions (every cell of a task is scored on the same test set); None for a task whose
    answers are not numbers, or with no finished cell."""
    for cell in cells:
        if cell.task != task or not (cell.folder / CELL_DONE).is_file():
            continue
        path = final_predictions(cell.folder)
        if path is None:
            continue
        preds = read_predictions(path)
        if not preds or "abs_error" not in preds[0]:
            return None
        floor = constant_answer_floor([r["reference"] for r in preds])
        if not floor:
            return None
        # a problem is its question and its answer: an image task asks one question of many
        # figures ("What is the value of the red bar?"), the figure's answer tells them apart
        distinct = (len({(r.get("prompt"), r.get("reference")) for r in preds})
                    if "prompt" in preds[0] else None)
        return TaskFloor(floor, len(preds), distinct)
    return None


