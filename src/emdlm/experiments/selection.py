"""A dev grid's selection rule, written in its config and applied by the report.

A sweep (say, each objective at four learning rates on the dev split) is run to *choose*
settings for a later test grid. Writing the rule down before the run is what keeps the choice
honest; ``select`` makes the written rule the one that is applied::

    select:
      metric: abs_error_mean       # a metric the report knows (its better direction is known)
      groups:                      # name -> the variants one is chosen among, in sweep order:
        ce: "ce_lr*"               #   a glob over the variant names, or a list of names
        ntil: [ntil_lr5e-4, ntil_lr1e-3, ntil_lr2e-3, ntil_lr4e-3]
      tie: "*_lr2e-3"              # optional: the variant an exact tie goes to (a glob)

For each task and group the pick is the variant with the best mean of ``metric`` at the final
checkpoint over *all* the grid's seeds; a group is decided only when every one of its cells has
finished (else the report says how many are missing and picks nothing). An exact tie of means
goes to the ``tie`` variant when it is among the tied, else to the first tied in sweep order;
a NaN mean (no answer parsed on some seed, for an error metric) is never picked.
A pick at either end of its group's sweep order is flagged as an edge of the sweep (the best
value may lie beyond it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from emdlm.config import ConfigError
from emdlm.experiments.metric_names import better_direction

SELECT_KEYS = ("metric", "groups", "tie")


@dataclass(frozen=True)
class SelectionRule:
    """``metric``; ``groups``: name -> variants in sweep order; ``tie``: group -> variant."""

    metric: str
    groups: dict[str, tuple[str, ...]]
    tie: dict[str, str]

    @property
    def better(self) -> str:
        return better_direction(self.metric) or "lower"


@dataclass(frozen=True)
class GroupPick:
    """One group's outcome in one task: the mean over seeds of every variant that has all its
    seeds (``means``), the pick (None until every cell of the group has finished), whether the
    pick is at an end of the sweep, and how many of the group's cells are missing."""

    group: str
    means: dict[str, float]
    seeds: dict[str, int]
    pick: str | None
    edge: bool
    missing: int


def _group_variants(name: str, value: Any, variants: list[str]) -> tuple[str, ...]:
    where = f"experiment.select.groups.{name}"
    if isinstance(value, str):
        found = tuple(v for v in variants if fnmatchcase(v, value))
        if not found:
            raise ConfigError(f"{where}: the pattern {value!r} matches no variant "
                              f"(variants: {', '.join(variants)})")
        return found
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a glob over variant names or a non-empty list of "
                          f"variant names, got {value!r}")
    unknown = [v for v in value if v not in variants]
    if unknown:
        raise ConfigError(f"{where}: {unknown} not variants of this experiment "
                          f"(variants: {', '.join(variants)})")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where} lists a variant twice: {value}")
    return tuple(value)


def parse_selection(value: Any, variants: list[str]) -> SelectionRule | None:
    """Validate ``experiment.select`` against the experiment's variants (ConfigError naming
    the first problem); None when the key is absent."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"experiment.select must be a mapping with {', '.join(SELECT_KEYS)}, "
                          f"got {value!r}")
    unknown = sorted(set(value) - set(SELECT_KEYS))
    if unknown:
        raise ConfigError(f"unknown experiment.select key(s) {unknown}; valid keys: "
                          f"{', '.join(SELECT_KEYS)}")
    metric = value.get("metric")
    if not isinstance(metric, str) or better_direction(metric) is None:
        raise ConfigError(f"experiment.select.metric must name a metric whose better direction "
                          f"the report knows (e.g. abs_error_mean, exact_match), got {metric!r}")
    raw_groups = value.get("groups")
    if not isinstance(raw_groups, dict) or not raw_groups:
        raise ConfigError("experiment.select.groups must be a non-empty mapping of name -> "
                          "variants (a glob or a list)")
    groups = {str(k): _group_variants(str(k), v, variants) for k, v in raw_groups.items()}
    owner: dict[str, str] = {}
    for name, members in groups.items():
        for v in members:
            if v in owner:
                raise ConfigError(f"experiment.select.groups: variant {v!r} is in both "
                                  f"{owner[v]!r} and {name!r}")
            owner[v] = name
    tie: dict[str, str] = {}
    pattern = value.get("tie")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(f"experiment.select.tie must be a glob over variant names, "
                              f"got {pattern!r}")
        for name, members in groups.items():
            hits = [v for v in members if fnmatchcase(v, pattern)]
            if len(hits) > 1:
                raise ConfigError(f"experiment.select.tie {pattern!r} matches {hits} in group "
                                  f"{name!r}: it must name at most one variant a group")
            if hits:
                tie[name] = hits[0]
    return SelectionRule(metric=metric, groups=groups, tie=tie)


def pick_group(rule: SelectionRule, group: str,
               final: dict[str, dict[int, float]], seeds: list[int]) -> GroupPick:
    """Apply the rule to one group of one task. ``final``: variant -> seed -> the metric at
    that seed's final checkpoint (finished cells only); ``seeds``: the grid's seeds."""
    members = rule.groups[group]
    means: dict[str, float] = {}
    counts: dict[str, int] = {}
    missing = 0
    for v in members:
        values = [final.get(v, {}).get(s) for s in seeds]
        present = [x for x in values if x is not None]
        counts[v] = len(present)
        missing += len(seeds) - len(present)
        if len(present) == len(seeds):
            means[v] = math.fsum(present) / len(present)
    comparable = {v: m for v, m in means.items() if not math.isnan(m)}
    if missing or not comparable:
        return GroupPick(group, means, counts, None, False, missing)
    sign = 1.0 if rule.better == "lower" else -1.0
    best = min(sign * m for m in comparable.values())
    tied = [v for v in members if v in comparable and sign * comparable[v] == best]
    pick = rule.tie[group] if rule.tie.get(group) in tied else tied[0]
    edge = len(members) > 1 and pick in (members[0], members[-1])
    return GroupPick(group, means, counts, pick, edge, missing)
