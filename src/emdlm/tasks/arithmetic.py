"""Integer arithmetic prompt/completion pairs: "12+345=" -> "357", vectorized with numpy.

Operands: for each operand a digit count is drawn uniformly from [min_digits, max_digits] and the
value uniformly among the numbers with that many digits (0 counts as a 1-digit number), so short
and long operands are equally common. Operators: "+" and "-" (and "*" if asked). With
``allow_negative=False``, subtraction puts the larger operand first.

Train/test disjointness: every problem (a, op, b) is hashed (a fixed integer mix, independent of
the seed) to a number u in [0, 1); problems with u < ``test_fraction`` belong to the test split
only, those with u in [test_fraction, test_fraction + dev_fraction) to the dev split only, the
rest to the train split only. So test, dev and train sets never overlap, whatever their seeds or
sizes. ``dev_fraction`` is 0 by default (no dev split, the train split as before); a run that
tunes on "dev" must give the same ``dev_fraction`` to its train split, or the train split would
still contain the dev problems (checked: "dev" with ``dev_fraction=0`` is an error).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from emdlm.config.errors import check_one_of
from emdlm.domains import Domain
from emdlm.tasks import DEV_FRACTION, TEST_FRACTION, check_dev_fraction, register_task

_OPS = {"+": 0, "-": 1, "*": 2}
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x & _MASK64


SPLITS = ("train", "dev", "test")


def problem_unit(a: np.ndarray, op: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[n] float64 in [0, 1): the seed-independent hash of each problem (a, op, b)."""
    with np.errstate(over="ignore"):
        key = _mix64(a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + op.astype(np.uint64))
        key = _mix64(key ^ (b.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))
    return (key >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def problem_is_test(
    a: np.ndarray, op: np.ndarray, b: np.ndarray, test_fraction: float
) -> np.ndarray:
    """[n] bool: which problems belong to the test split (seed-independent hash)."""
    return problem_unit(a, op, b) < test_fraction


def problem_split(
    a: np.ndarray, op: np.ndarray, b: np.ndarray, test_fraction: float, dev_fraction: float
) -> np.ndarray:
    """[n] int: 0 train, 1 dev, 2 test (index into ``SPLITS``), from the problem hash."""
    unit = problem_unit(a, op, b)
    return np.where(unit < test_fraction, 2, np.where(unit < test_fraction + dev_fraction, 1, 0))


def _sample_operands(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    digits = rng.integers(lo, hi + 1, size=n)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    high = 10**digits  # exclusive
    return (low + np.floor(rng.random(n) * (high - low))).astype(np.int64)


#: The legal values of the arithmetic task's numeric parameters (emdlm.domains): operands of
#: 1..15 digits; the body checks ``min_digits <= max_digits`` and that ``dev_fraction`` fits
#: beside ``test_fraction``.
ARITHMETIC_DOMAINS: dict[str, Domain] = {
    "min_digits": Domain(low=1, high=15, integer=True),
    "max_digits": Domain(low=1, high=15, integer=True),
    "test_fraction": TEST_FRACTION,
    "dev_fraction": DEV_FRACTION,
}


@register_task("arithmetic", splits=SPLITS, eval_kind="number", domains=ARITHMETIC_DOMAINS)
def arithmetic(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: str | list[str] = "+-",
    allow_negative: bool = True,
    test_fraction: float = 0.1,
    dev_fraction: float = 0.0,
) -> list[dict[str, Any]]:
    """``n`` problems like {"prompt": "12+345=", "completion": "357"}.

    Args:
        n: number of examples.
        split: "train", "dev" or "test" (disjoint; see the module docstring).
        seed: numpy seed; the same arguments give the same examples.
        min_digits, max_digits: operand digit-count range (inclusive), 1 <= min <= max <= 15.
        ops: operators to draw from uniformly, any of "+", "-", "*".
        allow_negative: if False, subtraction never goes below zero.
        test_fraction: share of the problem space reserved for the test split, in (0, 1).
        dev_fraction: share reserved for the dev split, in [0, 1 - test_fraction); give the
            same value to the train split of a run that is tuned on "dev".
    """
    check_one_of("split", split, SPLITS)
    if not 1 <= min_digits <= max_digits <= 15:
        raise ValueError(
            f"need 1 <= min_digits <= max_digits <= 15, got {min_digits}, {max_digits}"
        )
    op_list = list(ops)
    bad = [o for o in op_list if o not in _OPS]
    if not op_list or bad:
        raise ValueError(f"ops must be a non-empty selection of '+-*', got {ops!r}")
    check_dev_fraction(split, test_fraction, dev_fraction)
    # the train stream and the test stream are unchanged from before the dev split existed
    rng = np.random.default_rng([seed, {"train": 0, "test": 1, "dev": 2}[split]])
    want = SPLITS.index(split)
    chosen_a: list[np.ndarray] = []
    chosen_b: list[np.ndarray] = []
    chosen_op: list[np.ndarray] = []
    have = 0
    share = {"train": 1.0 - test_fraction - dev_fraction, "dev": dev_fraction,
             "test": test_fraction}[split]
    for _ in range(1000):  # rejection sampling; each round draws enough for the remainder
        m = int((n - have) / share * 1.2) + 16
        a = _sample_operands(rng, m, min_digits, max_digits)
        b = _sample_operands(rng, m, min_digits, max_digits)
        op = rng.choice(np.array([_OPS[o] for o in op_list]), size=m)
        if not allow_negative:
            swap = (op == _OPS["-"]) & (a < b)
            a, b = np.where(swap, b, a), np.where(swap, a, b)
        keep = problem_split(a, op, b, test_fraction, dev_fraction) == want
        chosen_a.append(a[keep])
        chosen_b.append(b[keep])
        chosen_op.append(op[keep])
        have += int(keep.sum())
        if have >= n:
            break
    else:  # pragma: no cover - only for a degenerate problem space
        raise ValueError(
            f"could not draw {n} {split} problems with digits {min_digits}..{max_digits}"
        )
    a = np.concatenate(chosen_a)[:n]
    b = np.concatenate(chosen_b)[:n]
    op = np.concatenate(chosen_op)[:n]
    result = np.select([op == 0, op == 1], [a + b, a - b], default=a * b)
    symbols = np.array(["+", "-", "*"])[op]
    return [
        {"prompt": f"{x}{s}{y}=", "completion": str(r)}
        for x, s, y, r in zip(
            a.tolist(), symbols.tolist(), b.tolist(), result.tolist(), strict=True
        )
    ]
