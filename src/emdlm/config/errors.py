"""The configuration's error and how its messages name a choice."""

from __future__ import annotations

import difflib
from typing import Any


class ConfigError(ValueError):
    """A configuration problem found before anything is run or written."""


def did_you_mean(value: str, choices: Any) -> str:
    """``" (did you mean 'cosine'?)"`` for the nearest of ``choices`` (difflib), or ``""``."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_one_of(
    name: str, value: Any, choices: Any, error: type[ValueError] = ValueError
) -> None:
    """``error`` saying ``"<name> must be one of a, b, got 'c'"`` unless ``value`` is one of
    ``choices``: the check of an argument that picks one of a few named options."""
    options = tuple(choices)
    if value not in options:
        raise error(f"{name} must be one of {', '.join(map(str, options))}, got {value!r}")


def check_choice(key: str, value: Any, choices: Any) -> None:
    """ConfigError naming ``key``, the nearest valid value and all of them, unless ``value`` is
    one of ``choices``."""
    options = [str(c) for c in choices]
    if value not in options:
        raise ConfigError(
            f"{key}={value!r} is not valid{did_you_mean(value, options)}; "
            f"choose one of {', '.join(options)}"
        )
