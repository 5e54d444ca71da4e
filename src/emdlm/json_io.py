"""JSON reading for every data file emdlm takes from a user (JSONL rows, COCO ``instances.json``,
MathVista's ``testmini.json``, MathVision's ``test.jsonl``).

Three rules on top of ``json.loads``, each a :class:`JSONDataError` (one line; the caller adds
the file and line):

* A key written twice in one object is an error naming the key. ``json.loads`` keeps the last
  one silently (RFC 8259, section 4: "the names within an object SHOULD be unique", and
  implementations differ on which one wins), so a row with two ``"completion"`` fields trained
  on the second.
* Objects and arrays may nest :data:`MAX_DEPTH` levels deep. The parser's own limit is Python's
  recursion limit, hit as a ``RecursionError`` traceback; here both are this one error.
* A string (key or value) may not hold a lone surrogate (``"\\ud800"``: half of a UTF-16 pair,
  not a character). JSON's ``\\u`` escapes can write one, a UTF-8 file cannot; tokenizers refuse
  it with a ``TypeError`` and it cannot be written back as UTF-8.

https://www.rfc-editor.org/rfc/rfc8259#section-4
"""

from __future__ import annotations

import json
import re
from typing import Any

#: the deepest nesting of objects and arrays accepted (a top-level object is depth 1)
MAX_DEPTH = 100
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class JSONDataError(ValueError):
    """A JSON text that is not valid, repeats a key, nests too deeply or holds a lone surrogate
    (the message is one line; callers prefix where it was read)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The object of ``pairs``; JSONDataError naming the first key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONDataError(
                    f"key {key!r} is given twice in one object; JSON readers silently keep only "
                    "the last: remove one of them"
                )
            seen.add(key)
    return obj


def _surrogate_problem(text: str, where: str) -> str | None:
    found = _SURROGATE_RE.search(text)
    if found is None:
        return None
    return (
        f"{where} holds a lone surrogate \\u{ord(found.group()):04x} at character "
        f"{found.start() + 1} (half of a UTF-16 pair, not a character): remove it or write "
        "the whole pair"
    )


def _check_tree(value: Any) -> None:
    """Depth and lone surrogates, walked without recursion (containers only recurse)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            problem = _surrogate_problem(node, f"the string at {path or 'the top'}")
            if problem:
                raise JSONDataError(problem)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise JSONDataError(f"objects and arrays nest deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                problem = _surrogate_problem(key, f"a key of the object at {path or 'the top'}")
                if problem:
                    raise JSONDataError(problem)
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1, f"{path}[{key!r}]"))
        else:
            stack.extend(
                (item, depth + 1, f"{path}[{i}]") for i, item in enumerate(node)
                if isinstance(item, (dict, list, str))
            )


def parse_json(text: str) -> Any:
    """``json.loads(text)`` under the module's rules; JSONDataError (one line) when the text is
    not JSON, repeats a key in an object, nests deeper than :data:`MAX_DEPTH` or holds a lone
    surrogate.

    >>> parse_json('{"prompt": "1+1=", "completion": "2"}')
    {'prompt': '1+1=', 'completion': '2'}
    """
    try:
        value = json.loads(text, object_pairs_hook=_unique_object)
    except json.JSONDecodeError as err:
        raise JSONDataError(f"not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"
                            ) from None
    except RecursionError:
        raise JSONDataError(f"objects and arrays nest deeper than {MAX_DEPTH} levels") from None
    _check_tree(value)
    return value


__all__ = ["MAX_DEPTH", "JSONDataError", "parse_json"]
