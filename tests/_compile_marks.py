"""Skip marks shared by the tests that compile with torch.compile (Dynamo)."""

from __future__ import annotations

import pytest


def _no_dynamo() -> str | None:
    """None if Dynamo supports this Python and platform, else the reason to skip."""
    import torch._dynamo

    if torch._dynamo.is_dynamo_supported():
        return None
    return "torch.compile (Dynamo) is not supported on this Python/platform"


_NO_DYNAMO = _no_dynamo()
#: module-level ``pytestmark`` of a file whose every test compiles
needs_dynamo = pytest.mark.skipif(_NO_DYNAMO is not None, reason=_NO_DYNAMO or "")
