"""The timing loop shared by the benchmarks: warm-up passes, then timed passes (median)."""

from __future__ import annotations

import time
from collections.abc import Callable


def _nothing() -> None:
    return None


def timed_passes(
    run: Callable[[], object], *, warmup: int, reps: int, sync: Callable[[], None] = _nothing,
    before_each: Callable[[], None] = _nothing, after_warmup: Callable[[], None] = _nothing,
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``run`` after ``warmup`` untimed ones.

    ``before_each`` runs before every call, untimed (e.g. clearing ``.grad``); ``after_warmup``
    once before the first timed call (e.g. resetting the peak-memory probe); ``sync`` right
    before the clock is read on both sides (``torch.cuda.synchronize`` on a GPU: kernels are
    asynchronous). Callers take the median, robust to a stray slow pass.
    """
    times = []
    for i in range(warmup + reps):
        before_each()
        if i == warmup:
            after_warmup()
        sync()
        start = time.perf_counter()
        run()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
