"""Resident-memory probes shared by the CPU benchmarks (Linux /proc; MiB).

The peak of one measured pass is ``peak_rss_mib(reset) - base`` with ``base = rss_mib()`` taken
just before it and ``reset = reset_peak_rss()``: writing "5" to /proc/self/clear_refs sets the
high-water mark VmHWM to the current RSS (Linux >= 4.0), so the peak belongs to the pass alone.
Where that is not allowed, the process's lifetime peak (``ru_maxrss``) is used instead.
"""

from __future__ import annotations

import os
import resource


def rss_mib() -> float:
    """Current resident set size (MiB) from /proc/self/statm."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS; False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib(reset: bool = True) -> float:
    """Peak RSS (MiB) since the last reset, or since the process started when ``reset`` is
    False (the reset failed or was not tried)."""
    if reset:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
