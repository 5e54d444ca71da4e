"""YAML reading for every file emdlm takes from a user (run configs, experiment configs, saved
``run_config.yaml``, accelerate configs, ``key=value`` override values).

Two rules on top of ``yaml.safe_load`` (no ``!!python`` tags, no code):

* A key written twice in one mapping is an error naming the key and both lines. YAML's own
  loaders keep the last one silently, so a config with two ``objective:`` blocks trained the
  second and an experiment with two ``ce:`` variants ran the second under the first's label.
  Keys brought in by a merge key (``<<: *base``) may still be overridden: that is what merge
  keys are for.
* Bounded size (:class:`YAMLTooLargeError`): anchors and aliases work as in ``yaml.safe_load``,
  but a document may expand to at most :data:`MAX_NODES` nodes, counting an aliased node once
  per alias (a 741-byte "billion laughs" of nine aliases nested nine deep expands to 9^9
  strings, which ``yaml.safe_load`` builds as shared lists in an instant and every copy or
  dump of the config then writes out in full), nest at most :data:`MAX_DEPTH` levels deep
  (aliases included; deeper, PyYAML's recursive composer ends in a RecursionError traceback),
  and no alias may sit inside the node it names (a config that contains itself). The limit is
  the one XML parsers apply to entity expansion, "billion laughs":
  https://en.wikipedia.org/wiki/Billion_laughs_attack
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

MERGE_TAG = "tag:yaml.org,2002:merge"
#: Most nodes one document may expand to (each alias counted as the whole node it names).
#: The largest packaged config expands to well under a thousand.
MAX_NODES = 100_000
#: Most levels of nesting of one document, aliases expanded.
MAX_DEPTH = 100


class RefusedYAMLError(yaml.YAMLError):
    """A YAML document emdlm will not read although YAML allows it (the message says why, in
    one line)."""


class DuplicateKeyError(RefusedYAMLError):
    """A mapping in a YAML document names the same key twice."""


class YAMLTooLargeError(RefusedYAMLError):
    """A YAML document that expands past :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels,
    or holds an alias inside the node it names."""


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _too_deep(where: Node | yaml.Event) -> YAMLTooLargeError:
    return YAMLTooLargeError(
        f"the YAML is nested deeper than {MAX_DEPTH} levels (line {where.start_mark.line + 1}); "
        "no emdlm config needs that many"
    )


def check_expanded_size(root: Node) -> None:
    """:class:`YAMLTooLargeError` when the node graph of one document, each alias expanded,
    holds more than :data:`MAX_NODES` nodes or nests deeper than :data:`MAX_DEPTH` levels, or
    when an alias sits inside the node it names. Linear in the nodes as written (each shared
    node is measured once), iterative (no recursion to run out of)."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
    open_nodes: set[int] = set()  # on the current path: an alias back to one is a loop
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            kids = [measured[id(kid)] for kid in _children(node)]
            size = 1 + sum(n for n, _ in kids)
            depth = 1 + max((d for _, d in kids), default=0)
            open_nodes.discard(key)
            if size > MAX_NODES:
                raise YAMLTooLargeError(
                    f"the YAML expands to more than {MAX_NODES} values through its aliases "
                    f"(the node on line {node.start_mark.line + 1}): no config needs that "
                    "many; write the values out instead of nesting aliases"
                )
            if depth > MAX_DEPTH:
                raise _too_deep(node)
            measured[key] = (size, depth)
            continue
        if key in measured:
            continue
        if key in open_nodes:
            raise YAMLTooLargeError(
                f"the node on line {node.start_mark.line + 1} contains an alias to itself: "
                "the config would be infinitely deep"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in measured)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated within one mapping and a document larger
    than :data:`MAX_NODES` / deeper than :data:`MAX_DEPTH` (see the module note)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        # PyYAML composes nested collections recursively: stop before Python's recursion limit
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self.peek_event())
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node:
        node = super().compose_document()
        check_expanded_size(node)
        return node

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
    """``yaml.safe_load(text)`` that raises :class:`DuplicateKeyError` for a key written twice
    in one mapping, naming the key and both lines (1-based), and :class:`YAMLTooLargeError`
    for a document past the size limits; both are :class:`RefusedYAMLError` (a
    ``yaml.YAMLError``) with a one-line message."""
    return yaml.load(text, Loader=_UniqueKeyLoader)
