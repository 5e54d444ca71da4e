"""What a failed multi-process launch printed, for assertion messages of the torchrun tests."""

from __future__ import annotations

import re


def failure_text(stderr: str) -> str:
    """The lines that name a cause first (a C++ abort such as "terminate called ..." is
    otherwise lost in front of torchrun's long traceback), then the tail."""
    causes = [line for line in stderr.splitlines()
              if re.search(r"terminate called|what\(\)|Error|error:", line)]
    return "\n".join(causes[:20]) + "\n---\n" + stderr[-3000:]
