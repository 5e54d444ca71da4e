"""The training-loss components of a grid's runs (their ``train_log.jsonl``), early vs late.

When a numeric objective helps early and costs late, the components say why: which term
dominates at the end, how the dynamic mix coefficient moves, how the CE component itself
falls. Every emdlm objective logs its components each step (``ce``, ``emd``, ``relative``,
``magnitude``, ``ntil``, ``mix_coef``, EMO's ``emo`` ...); this module averages each one over
three windows of the run, the first, middle and last tenth of its logged steps, per seed and
then over seeds.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from emdlm._files import read_appended_jsonl
from emdlm.experiments.cell_folder import CELL_DONE
from emdlm.experiments.grid import Cell

TRAIN_LOG = "train_log.jsonl"
#: (name, first, last) fractions of the final logged step.
WINDOWS: tuple[tuple[str, float, float], ...] = (
    ("start", 0.0, 0.1), ("middle", 0.45, 0.55), ("end", 0.9, 1.0))
#: Logged fields that are bookkeeping, not loss components (counts start with ``n_``).
NOT_COMPONENTS = frozenset({"step", "epoch", "lr", "learning_rate"})


def read_train_log(path: Path) -> list[dict[str, float]]:
    """The per-step records of one run (numeric fields only)."""
    return [{k: float(v) for k, v in row.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for row in read_appended_jsonl(path)]


def window_means(records: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """component -> window name -> mean of the component over the records whose step lies in
    that window ((first, last] fractions of the last step; the first window includes step 0).
    Components absent from a window's records are left out of it."""
    if not records:
        return {}
    last = max(r["step"] for r in records)
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for name, lo, hi in WINDOWS:
        rows = [r for r in records
                if (lo == 0.0 or r["step"] > lo * last) and r["step"] <= hi * last]
        sums: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            for key, value in r.items():
                if key not in NOT_COMPONENTS and not key.startswith("n_") and math.isfinite(value):
                    sums[key].append(value)
        for key, values in sums.items():
            out[key][name] = sum(values) / len(values)
    return dict(out)


@dataclass
class VariantComponents:
    """One variant's components: component -> window -> mean over its ``seeds`` finished runs."""

    seeds: int
    means: dict[str, dict[str, float]]


def component_summary(cells: Sequence[Cell], task: str) -> dict[str, VariantComponents]:
    """variant -> its components' window means over the task's finished cells (seeds)."""
    per_seed: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)
    for cell in cells:
        log = cell.train_dir / TRAIN_LOG
        if cell.task == task and (cell.folder / CELL_DONE).is_file() and log.is_file():
            per_seed[cell.variant].append(window_means(read_train_log(log)))
    summary: dict[str, VariantComponents] = {}
    for variant, seeds in per_seed.items():
        acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for seed in seeds:
            for component, windows in seed.items():
                for window, value in windows.items():
                    acc[component][window].append(value)
        summary[variant] = VariantComponents(
            seeds=len(seeds),
            means={c: {w: sum(v) / len(v) for w, v in ws.items()} for c, ws in acc.items()})
    return summary


def component_lines(cells: Sequence[Cell], task: str, variants: Sequence[str]) -> list[str]:
    """A Markdown table: per variant and component, start → middle → end (means over seeds)."""
    summary = component_summary(cells, task)
    if not summary:
        return []
    components = sorted({c for v in summary.values() for c in v.means},
                        key=lambda c: (c not in ("loss", "ce"), c != "loss", c))
    names = [w for w, _, _ in WINDOWS]
    lines = ["### Training-loss components (train_log.jsonl)", "",
             "Mean of each logged component over the first, middle and last tenth of the "
             "training steps (" + " → ".join(names) + "), averaged over the seeds (n). `loss` is "
             "what was back-propagated; `ce` the cross-entropy part of it. An objective may log "
             "terms it does not train on, as diagnostics (digit EMD and the NTIL ablations log "
             "the relative and magnitude deviations whatever their weight).", "",
             "| variant | " + " | ".join(components) + " |",
             "|---" * (len(components) + 1) + "|"]
    for variant in variants:
        if variant not in summary:
            continue
        row = []
        for component in components:
            windows = summary[variant].means.get(component, {})
            row.append(" → ".join(f"{windows[w]:.3g}" if w in windows else "–" for w in names)
                       if windows else "–")
        lines.append(f"| {variant} ({summary[variant].seeds}) | " + " | ".join(row) + " |")
    return [*lines, ""]
