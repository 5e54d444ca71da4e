"""Legal values of numeric settings, declared as data: a :class:`Domain` per setting.

The objective registry (:mod:`emdlm.objective_specs`) declares one for each numeric parameter
of every objective, and the run configuration (:mod:`emdlm.config`) one for each numeric run
setting; both check a value with :meth:`Domain.problem`, so the loss classes, the objective
factory and the config refuse the same values with the same words.

A domain is an interval of real numbers (each end open or closed, or an interval of integers),
plus a few other legal values (``None`` for "off", a name such as ``"preset"``). NaN and ±inf
lie in no domain; a bool is not a number here (``True`` would pass as 1); an integer must fit in
64 bits (torch and numpy hold step counts and sizes as int64: a larger one is an
``OverflowError`` deep inside them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The largest integer a setting may hold: int64, as torch and numpy store it.
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Domain:
    """The legal values of one numeric setting.

    low, high: the interval's ends (±inf: unbounded on that side; the value itself must be
        finite all the same).
    low_open, high_open: the end itself is not legal (``> low`` rather than ``>= low``).
    integer: only integers (a float such as 2.0 is refused: the setting counts something).
    others: further legal values, compared by identity or equality (``None``, ``"preset"``).
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    others: tuple[Any, ...] = ()

    def or_(self, *others: Any) -> Domain:
        """This domain with ``others`` legal too (e.g. ``POSITIVE.or_(None)``)."""
        return Domain(self.low, self.high, self.low_open, self.high_open, self.integer,
                      (*self.others, *others))

    def describe(self) -> str:
        """The domain in words: "a finite number >= 0", "an integer >= 1, or None", ..."""
        kind = "an integer" if self.integer else "a finite number"
        low, high = _number(self.low), _number(self.high)
        if math.isinf(self.low) and math.isinf(self.high):
            words = kind
        elif math.isinf(self.high):
            words = f"{kind} {'>' if self.low_open else '>='} {low}"
        elif math.isinf(self.low):
            words = f"{kind} {'<' if self.high_open else '<='} {high}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            words = f"{kind} in {left}{low}, {high}{right}"
        if self.others:
            words += ", or " + " or ".join(repr(o) for o in self.others)
        return words

    def problem(self, value: Any) -> str | None:
        """None when ``value`` is legal, else what it must be, in words ("must be a finite
        number >= 0"); the caller names the setting and the value."""
        for other in self.others:
            if value is other or (type(value) is type(other) and value == other):
                return None
        wrong = f"must be {self.describe()}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return wrong
        if isinstance(value, numbers.Integral):
            if abs(int(value)) > INT64_MAX:
                return f"{wrong} (at most {INT64_MAX}: 64 bits)"
        elif self.integer:
            return wrong
        number = float(value)
        if not math.isfinite(number):
            return wrong
        below = number <= self.low if self.low_open else number < self.low
        above = number >= self.high if self.high_open else number > self.high
        return wrong if below or above else None


def _number(bound: float) -> str:
    """A bound as written: 0 rather than 0.0."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _short(value: Any) -> str:
    """A huge integer in a few characters (a 400-digit one is not echoed in full)."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"


def domain_problems(
    domains: Mapping[str, Domain], values: Mapping[str, Any], prefix: str = ""
) -> list[str]:
    """``"<prefix><key> must be <domain>, got <value>"`` for each value of ``values`` outside
    its declared domain (keys without a domain are not checked here)."""
    found = []
    for key, value in values.items():
        domain = domains.get(key)
        problem = None if domain is None else domain.problem(value)
        if problem is not None:
            found.append(f"{prefix}{key} {problem}, got {shown_value(value)}")
    return found


def shown_value(value: Any) -> str:
    """``value`` for a message: its repr, a huge integer cut to a few characters."""
    return _short(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)


NONNEGATIVE = Domain(low=0.0)  # a weight: 0 turns its term off
POSITIVE = Domain(low=0.0, low_open=True)  # a scale, temperature or step size
UNIT = Domain(low=0.0, high=1.0)  # a probability or mixing ratio
INTEGER = Domain(integer=True)  # any integer (an ignore_index may be negative)
COUNT = Domain(low=1, integer=True)  # how many of something: at least one
NONNEGATIVE_COUNT = Domain(low=0, integer=True)
#: The largest seed transformers.set_seed accepts: it seeds numpy (np.random.seed), whose seeds
#: are 0 .. 2**32 - 1; a negative seed fails there, after a run has started.
MAX_SEED = 2**32 - 1
SEED = Domain(low=0, high=MAX_SEED, integer=True)  # a seed numpy (and so set_seed) accepts
#: The most examples one task generator call makes: every generated set is held in memory as
#: Python dicts (hundreds of bytes each, an image task's far more), so a count past this is a
#: typo or a resource bomb, refused before anything is generated rather than ending in a
#: MemoryError after minutes. The packaged corpora configs ask for 10**6 at most.
MAX_GENERATED = 10_000_000
GENERATED_COUNT = Domain(low=1, high=MAX_GENERATED, integer=True)


__all__ = [
    "COUNT", "GENERATED_COUNT", "INT64_MAX", "INTEGER", "MAX_GENERATED", "MAX_SEED",
    "NONNEGATIVE", "NONNEGATIVE_COUNT", "POSITIVE",
    "SEED", "UNIT",
    "Domain", "domain_problems", "shown_value",
]
