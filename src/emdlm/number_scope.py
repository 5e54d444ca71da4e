"""Number scope: which numbers of a target the numeric objectives (NTIL, digit EMD, NTL) score
(ntloss issue #65).

``data.number_scope`` (default for every row) or a row's own ``"number_scope"`` field is one of

* ``"all"`` (default): every number of the target; no ``number_mask`` is built;
* ``"answer"``: only the numbers inside the task's answer pattern (a box, a time, a list of
  boxes: :data:`ANSWER_PATTERNS`, keyed by the row's ``"task"`` field or the data source's
  task); ``"answer:<task>"`` names the task explicitly (e.g. for a JSONL file of clock rows);
* ``"regex:<pattern>"``: only the numbers inside matches of the Python regex over the
  completion (the text, for text rows).

A token is in scope when every non-space character of it lies inside a match (tokenizer offset
mapping, :func:`in_scope_tokens`); the data then carries ``number_mask`` (:mod:`emdlm.data`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from emdlm.config import ConfigError
from emdlm.tasks import answer_patterns


class _AnswerPatterns(Mapping[str, re.Pattern[str]]):
    """A read-only view of the task registry's answer patterns, read on each access."""

    def __getitem__(self, task: str) -> re.Pattern[str]:
        return answer_patterns()[task]

    def __iter__(self) -> Iterator[str]:
        return iter(answer_patterns())

    def __len__(self) -> int:
        return len(answer_patterns())

    def __repr__(self) -> str:
        return f"ANSWER_PATTERNS({answer_patterns()!r})"


#: The answer pattern of each task for ``number_scope="answer"``: the numbers inside its
#: matches are scored. Registered with the task, next to its generator
#: (``register_task(..., answer_pattern=...)``, :mod:`emdlm.tasks`); this is a read-only view
#: of that registry. :func:`register_answer_pattern` adds one for any task name.
ANSWER_PATTERNS: Mapping[str, re.Pattern[str]] = _AnswerPatterns()
NUMBER_SCOPE_KEY = "number_scope"  # the row field


def scope_pattern(scope: Any, task: str | None, where: str) -> re.Pattern[str] | None:
    """The regex of a number scope (None for "all"); ConfigError naming ``where`` otherwise.

    ``scope``: "all", "answer" (``task``'s pattern), "answer:<task>" or "regex:<pattern>".
    """
    if not isinstance(scope, str):
        raise ConfigError(f"{where}: number_scope must be a string, got {type(scope).__name__}")
    if scope == "all":
        return None
    if scope.startswith("regex:"):
        try:
            return re.compile(scope[len("regex:") :])
        except re.error as err:
            raise ConfigError(
                f"{where}: number_scope {scope!r} is not a valid regex ({err})"
            ) from None
    if scope == "answer" or scope.startswith("answer:"):
        name = scope[len("answer:") :] if scope.startswith("answer:") else task
        patterns = answer_patterns()
        if not name:
            raise ConfigError(
                f"{where}: number_scope='answer' needs the task (a row field 'task', a data "
                f"source with `task:`, or 'answer:<task>'); tasks with an answer pattern: "
                f"{', '.join(sorted(patterns))}"
            )
        if name not in patterns:
            raise ConfigError(
                f"{where}: task {name!r} has no answer pattern for number_scope='answer' (known: "
                f"{', '.join(sorted(patterns))}); use 'regex:<pattern>' or "
                "emdlm.tasks.register_answer_pattern"
            )
        return patterns[name]
    raise ConfigError(
        f"{where}: number_scope must be 'all', 'answer', 'answer:<task>' or 'regex:<pattern>', "
        f"got {scope!r}"
    )


def in_scope_tokens(
    text: str, offsets: Sequence[Sequence[int]], pattern: re.Pattern[str] | None
) -> list[bool]:
    """Per token of ``text`` (character ``offsets`` [start, end)): is it inside the scope?

    True when the token is not empty and every non-space character of it lies inside a match of
    ``pattern`` (every non-empty token for None). Spaces are neutral because byte-level
    tokenizers put the leading space into the token ('Ġ12' covers " 12"). Vectorized with a
    prefix sum of the out-of-scope characters.
    """
    if not offsets:
        return []
    span = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, end = span[:, 0], span[:, 1]
    inside = np.zeros(len(text) + 1, dtype=np.int64)  # +1 at each match start, -1 at its end
    if pattern is None:
        inside[0], inside[len(text)] = 1, -1
    else:
        for m in pattern.finditer(text):  # per match, not per token
            inside[m.start()] += 1
            inside[m.end()] -= 1
    covered = np.cumsum(inside[:-1]) > 0  # [chars]
    spaces = np.fromiter((c.isspace() for c in text), dtype=bool, count=len(text))
    out = np.concatenate([[0], np.cumsum(~covered & ~spaces)])  # [chars + 1]
    end = np.clip(end, 0, len(text))
    start = np.clip(start, 0, end)
    return ((end > start) & (out[end] - out[start] == 0)).tolist()


def piece_masks(
    tokenizer: Any,
    texts: Sequence[str],
    scopes: Sequence[re.Pattern[str] | None],
    *,
    add_special_tokens: bool,
) -> tuple[list[list[int]], list[list[bool]]]:
    """Tokenize ``texts`` (one batched call) and give each token's number scope.

    Returns (input_ids, masks). ConfigError when the tokenizer has no offset mapping (a slow
    tokenizer: the token-to-character alignment a scope needs is unknown).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"number_scope other than 'all' needs a fast tokenizer (offset mapping); "
            f"{type(tokenizer).__name__} has none"
        )
    enc = tokenizer(
        list(texts), add_special_tokens=add_special_tokens, return_offsets_mapping=True
    )
    masks = [
        in_scope_tokens(text, offsets, scope)
        for text, offsets, scope in zip(texts, enc["offset_mapping"], scopes, strict=True)
    ]
    return [list(ids) for ids in enc["input_ids"]], masks


def row_scopes(
    rows: Sequence[dict[str, Any]], default: str, task: str | None, source: str
) -> list[re.Pattern[str] | None] | None:
    """The scope regex of every row (row field over ``default``), or None when all are "all"."""
    scopes = [
        scope_pattern(
            row.get(NUMBER_SCOPE_KEY, default), row.get("task", task),
            f"{source}: example {i}" if NUMBER_SCOPE_KEY in row else f"{source}: data.number_scope",
        )
        for i, row in enumerate(rows)
    ]
    return None if all(s is None for s in scopes) else scopes
