"""The peers of the GPU suite's loss-alone section, each a (hidden, weight, labels) -> mean CE
callable, or a note saying why it cannot run here.

Every peer computes the same quantity as emdlm's from-hidden CE: the mean over the scored
positions of −log softmax(hidden @ weightᵀ)[label], labels of −100 ignored, forward and backward
through hidden [N, H] and weight [V, H]. The rows:

- ``Liger FLCE (Triton)``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` with the Triton
  implementation forced (``LIGER_KERNEL_IMPL=nvidia-triton``),
  https://github.com/linkedin/Liger-Kernel/blob/main/src/liger_kernel/ops/fused_linear_cross_entropy.py
- ``Liger FLCE (CuTe DSL)``: the same module with ``LIGER_KERNEL_IMPL=nvidia-cutedsl`` and
  ``LIGER_KERNEL_STRICT=1`` (an unusable CuTe backend raises instead of falling back to
  Triton); Hopper or newer and the ``nvidia-cutlass-dsl`` package.
- ``QuACK chunked linear CE``: ``quack.linear_cross_entropy.chunked_linear_cross_entropy``
  (https://github.com/Dao-AILab/quack/blob/main/quack/linear_cross_entropy.py), CuTe DSL too.
- ``CCE (cce)`` and ``CCE (torch_compile)``: Cut Cross-Entropy's ``linear_cross_entropy`` with
  ``impl="cce"`` (Triton) and ``impl="torch_compile"``,
  https://github.com/apple/ml-cross-entropy
- ``TRL fused head``: TRL's ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py) as its
  SFTTrainer calls it (the scored positions only, its vocabulary chunk size), Triton on a GPU
  and torch elsewhere. The file is loaded on its own, so TRL's other dependencies need not be
  installed.
- ``torch.compile chunked CE``: the plain recipe a user writes without a kernel library: row
  chunks of 4096, each chunk's logits recomputed in backward (activation checkpointing), the
  whole function under ``torch.compile``.

The torch CE on full logits (the baseline column) stays in gpu_suite.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Factory = Callable[[], LossFn]

LIGER_TRITON = "Liger FLCE (Triton)"
LIGER_CUTE = "Liger FLCE (CuTe DSL)"
QUACK = "QuACK chunked linear CE"
CCE = "CCE (cce)"
CCE_COMPILE = "CCE (torch_compile)"
TRL = "TRL fused head"
COMPILED_CHUNKED = "torch.compile chunked CE"
PEERS = (LIGER_TRITON, LIGER_CUTE, QUACK, CCE, CCE_COMPILE, TRL, COMPILED_CHUNKED)
# the peers whose kernels need a CUDA device (Triton or CuTe DSL); the others run anywhere
GPU_ONLY = frozenset({LIGER_TRITON, LIGER_CUTE, QUACK, CCE})
# why a CuTe DSL peer may be missing on the GPU machine: its CUDA libraries do not travel
CUTE_WHEEL_NOTE = (
    "nvidia-cutlass-dsl's CUDA library wheel (nvidia-cutlass-dsl-libs-cu13 4.8.1) is 92 MB, "
    "more than the 64 MiB that travels to the GPU machine"
)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of one call, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _flat(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h.reshape(-1, h.shape[-1]), y.reshape(-1)


def _liger(impl: str) -> Factory:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    def factory() -> LossFn:
        loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)

        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h2, y2 = _flat(h, y)
            with _environ(LIGER_KERNEL_IMPL=impl, LIGER_KERNEL_STRICT="1"):
                return loss_fn(w, h2, y2)
        return fn
    return factory


def _liger_cute() -> Factory:
    import cutlass.cute  # noqa: F401  (the CuTe DSL itself; Liger imports it lazily)

    return _liger("nvidia-cutedsl")


def _quack() -> Factory:
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def factory() -> LossFn:
        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h2, y2 = _flat(h, y)
            return chunked_linear_cross_entropy(h2, w, y2, ignore_index=IGNORE)
        return fn
    return factory


def _cce(impl: str) -> Factory:
    from cut_cross_entropy import linear_cross_entropy

    def factory() -> LossFn:
        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h2, y2 = _flat(h, y)
            return linear_cross_entropy(h2, w, y2, ignore_index=IGNORE, impl=impl)
        return fn
    return factory


STANDALONE_TRL = (
    "TRL fused head: TRL's trainer dependencies are missing here, so trl/kernels/"
    "chunked_logprob.py runs standalone, its one TRL import (maybe_gather_lm_head_ctx, a "
    "DeepSpeed ZeRO-3 gather that is a null context without ZeRO-3) replaced by a null context"
)


def _trl_kernel() -> tuple[Any, str | None]:
    """TRL's ``ChunkedLogProbFunction``, and a note when it had to be loaded standalone.

    With TRL's trainer importable, the package's own module. Otherwise (the GPU machine has no
    ``datasets``) the file is loaded under a stand-in package whose ``trainer.utils`` holds only
    the null gather its backward imports.
    """
    try:
        import trl.trainer.utils  # noqa: F401  (the backward imports it)
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction, None
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] == "trl":
            raise
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("No module named 'trl'")
    path = Path(next(iter(spec.submodule_search_locations))) / "kernels" / "chunked_logprob.py"
    if not path.is_file():
        raise ImportError(f"this TRL has no kernels/{path.name} (TRL >= 1.16 has it)")
    root = "_trl_standalone"
    for name in (root, f"{root}.kernels", f"{root}.trainer"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules.setdefault(name, package)
    utils = types.ModuleType(f"{root}.trainer.utils")
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # type: ignore[attr-defined]
    sys.modules.setdefault(utils.__name__, utils)
    module_spec = importlib.util.spec_from_file_location(f"{root}.kernels.chunked_logprob", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module.ChunkedLogProbFunction, STANDALONE_TRL


TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


def _trl() -> tuple[Factory, str | None]:
    function, note = _trl_kernel()

    def factory() -> LossFn:
        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h2, y2 = _flat(h, y)
            mask = y2 != IGNORE
            # as SFTTrainer does on a Triton device: only the scored positions go in
            out = function.apply(h2[mask], w, None, y2[mask], 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())
            return -out[0].sum() / mask.sum().clamp(min=1)
        return fn
    return factory, note


CHUNK_ROWS = 4096


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """16-bit logits are reduced in float32; float32 and float64 in their own precision."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_ce_sum(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = (h @ w.T).to(_accum_dtype(h.dtype))
    return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")


def chunked_ce(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean CE over row chunks of ``CHUNK_ROWS``; each chunk's [rows, V] logits are rebuilt in
    backward instead of kept (``torch.utils.checkpoint``)."""
    h2, y2 = _flat(h, y)
    total = h2.new_zeros((), dtype=_accum_dtype(h2.dtype))
    for start in range(0, h2.shape[0], CHUNK_ROWS):
        stop = start + CHUNK_ROWS
        total = total + checkpoint(_chunk_ce_sum, h2[start:stop], w, y2[start:stop],
                                   use_reentrant=False)
    return total / (y2 != IGNORE).sum().clamp(min=1)


def _compiled_chunked(backend: str) -> Factory:
    def factory() -> LossFn:
        return torch.compile(chunked_ce, backend=backend, dynamic=False)
    return factory


def peer_builders(device: torch.device, compile_backend: str
                  ) -> tuple[dict[str, Factory], dict[str, str]]:
    """The peers that can run on ``device`` (name -> factory), and a note for every other."""
    makers: dict[str, Callable[[], Factory | tuple[Factory, str | None]]] = {
        LIGER_TRITON: lambda: _liger("nvidia-triton"),
        LIGER_CUTE: _liger_cute,
        QUACK: _quack,
        CCE: lambda: _cce("cce"),
        CCE_COMPILE: lambda: _cce("torch_compile"),
        TRL: _trl,
        COMPILED_CHUNKED: lambda: _compiled_chunked(compile_backend),
    }
    builders: dict[str, Factory] = {}
    notes: dict[str, str] = {}
    for name in PEERS:
        try:
            made = makers[name]()
            factory, note = made if isinstance(made, tuple) else (made, None)
            builders[name] = factory
            if note:
                notes[name] = note
            missing = ""
        except Exception as err:  # any import failure: a note with the reason
            first = (str(err).strip().splitlines() or [""])[0][:140]
            why = f"{type(err).__name__}: {first}".replace("|", "/")
            extra = f"; {CUTE_WHEEL_NOTE}" if name in (LIGER_CUTE, QUACK) else ""
            missing = f"not importable ({why}){extra}"
        if name in GPU_ONLY and device.type != "cuda":
            builders.pop(name, None)
            notes[name] = (f"{name}: skipped on {device.type} (its kernels need a CUDA GPU)"
                           + (f"; here {missing}" if missing else ""))
        elif missing:
            notes[name] = f"{name}: {missing}"
    return builders, notes
