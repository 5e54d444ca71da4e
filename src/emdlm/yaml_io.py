"""YAML reading for every file emdlm takes from a user (run configs, experiment configs, saved
``run_config.yaml``, accelerate configs, ``key=value`` override values).

Two rules on top of ``yaml.safe_load`` (no ``!!python`` tags, no code):

* A key written twice in one mapping is an error naming the key and both lines. YAML's own
  loaders keep the last one silently, so a config with two ``objective:`` blocks trained the
  second and an experiment with two ``ce:`` variants ran the second under the first's label.
  Keys brought in by a merge key (``<<: *base``) may still be overridden: that is what merge
  keys are for.
* Nothing else changes: anchors and aliases work as in ``yaml.safe_load``.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping in a YAML document names the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated within one mapping."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:  # `<<: *base`: overriding its keys is allowed
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first_line.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise DuplicateKeyError(
                        f"key {key!r} is given twice in one mapping (lines {seen} and {line}); "
                        "YAML would silently keep only the second: remove or merge one of them"
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load(text)`` that raises :class:`DuplicateKeyError` (a ``yaml.YAMLError``)
    for a key written twice in one mapping, naming the key and both lines (1-based)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)
