"""Run emdlm's chunked loss kernels eagerly when ``torch.compile`` traces their caller.

The kernels (custom autograd Functions looping over row chunks, with gradients computed in the
forward and handed over in backward) do not trace: Dynamo fails on their ``try: view`` fallbacks
and on the gradients they keep on the autograd context. Inside a compiled region (a compiled
training step, or a model whose own ``forward`` returns the emdlm loss) they therefore run as
one graph break: the compiled graphs before and after them stay compiled, and the kernel runs
exactly as in eager mode. ``torch.compiler.disable`` is looked up only while compiling, so
importing emdlm does not import ``torch._dynamo`` (about 1.5 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped by ``torch.compiler.disable`` (built once per function)."""
    return torch.compiler.disable(fn)


def eager_under_compile(fn: F) -> F:
    """Decorator: ``fn`` runs unchanged in eager mode and as a graph break under torch.compile."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
