"""Dotted ``key=value`` overrides of a raw config mapping, and what switching ``objective.name``
drops of the settings the old objective left."""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import yaml

from emdlm.config.errors import ConfigError
from emdlm.config.schema import ObjectiveConfig
from emdlm.objective_specs import OBJECTIVE_SPECS
from emdlm.yaml_io import RefusedYAMLError, safe_load_unique


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=1e-3"`` -> (["a", "b"], 0.001); the value is parsed as a YAML scalar/flow."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.seed=1)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = safe_load_unique(raw) if raw.strip() else ""
    except RefusedYAMLError as err:  # a key given twice, a bomb of aliases
        raise ConfigError(f"override {item!r}: {err}") from err
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the raw config mapping with dotted overrides applied.

    An override that switches ``objective.name`` to another objective than ``data``'s drops the
    objective settings inherited from ``data`` that the new objective does not take (see
    :func:`switch_objective`), with one line on stderr saying what was dropped (once per
    process for each distinct line)."""
    out = copy.deepcopy(data)
    set_paths: list[tuple[str, ...]] = []
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = {}
                node[part] = nxt
            elif not isinstance(nxt, dict):
                # "tokenizer=char" style leaves can't take sub-keys
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = nxt
        node[path[-1]] = value
        set_paths.append(tuple(path))
    note = switch_objective(data, out, set_paths)
    if note is not None:
        _say_once(note)
    return out


def _objective_name(mapping: dict[str, Any]) -> Any:
    """The objective a raw config mapping names (the default when it names none)."""
    section = mapping.get("objective")
    if section is None:
        return ObjectiveConfig.name
    return section.get("name", ObjectiveConfig.name) if isinstance(section, dict) else None


def switch_objective(
    before: dict[str, Any], after: dict[str, Any], set_paths: list[tuple[str, ...]]
) -> str | None:
    """Drop from ``after`` (in place) what the objective of ``before`` left that the objective of
    ``after`` does not take, when the two differ; return the line saying what was dropped, or
    None when nothing was.

    Only settings inherited from ``before`` go: a setting under one of ``set_paths`` (the
    overrides that made ``after``) stays, so an explicit wrong parameter is still reported by
    the objective factory. Dropped are the ``objective.params`` keys the new objective's class
    does not take, ``objective.cost_embedding`` when it takes none, a λ schedule
    (``objective.lam_schedule`` / ``lam_final`` other than their defaults) when it has no
    numeric term, and ``teacher`` when it distils from none. With this, ``objective.name=ce``
    turns an EMO config into a CE one in one override. A user's class (``<module>:<Class>``)
    is not imported here: nothing is dropped for it."""
    old, new = _objective_name(before), _objective_name(after)
    if (old == new or not isinstance(new, str) or new not in OBJECTIVE_SPECS
            or not isinstance(after.get("objective"), dict)):  # a user's class: nothing known
        return None
    spec = OBJECTIVE_SPECS[new]
    section = after["objective"]

    def inherited(*key: str) -> bool:  # no override set this key, a part of it or a section of it
        return not any(p[: len(key)] == key or key[: len(p)] == p for p in set_paths)

    dropped: list[str] = []
    params = section.get("params")
    if isinstance(params, dict):
        for key in list(params):
            if key not in spec.params and inherited("objective", "params", key):
                del params[key]
                dropped.append(f"objective.params.{key}")
    if (section.get("cost_embedding") is not None and not spec.cost_embedding
            and inherited("objective", "cost_embedding")):
        del section["cost_embedding"]
        dropped.append("objective.cost_embedding")
    if not spec.numeric:
        for key, default in (("lam_schedule", ObjectiveConfig.lam_schedule),
                             ("lam_final", ObjectiveConfig.lam_final)):
            if key in section and section[key] != default and inherited("objective", key):
                del section[key]
                dropped.append(f"objective.{key}")
    if after.get("teacher") is not None and not spec.teacher and inherited("teacher"):
        del after["teacher"]
        dropped.append("teacher")
    if not dropped:
        return None
    takes = ("does not take it" if len(dropped) == 1 else "takes neither" if len(dropped) == 2
             else "takes none of them")
    return f"objective.name={new} replaces {old}: dropped {', '.join(dropped)} ({new} {takes})"


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    """``line`` on stderr, once per process (an experiment grid applies the same switch to every
    cell) and only on the first process of a launch (RANK unset or 0)."""
    if line in _SAID or os.environ.get("RANK", "0") != "0":
        return
    _SAID.add(line)
    print(line, file=sys.stderr, flush=True)
