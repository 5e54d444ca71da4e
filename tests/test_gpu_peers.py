"""The GPU suite's peer rows (benchmarks/gpu_peers.py) compute what emdlm's CE computes.

The peers that run on the CPU (TRL's fused head, the compiled chunked CE) are checked against
``F.cross_entropy`` on the full logits in float64, value and both gradients; the GPU-only ones
are checked to be a note on the CPU, never a silent absence.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_peers  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))


# TRL keeps its online-logsumexp statistics in float32 whatever the input dtype
TRL_TOL = 1e-6


def _inputs(n: int = 37, h: int = 8, v: int = 50) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = gpu_peers.IGNORE
    return hidden, weight, labels


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    loss = F.cross_entropy(hidden @ weight.T, labels, ignore_index=gpu_peers.IGNORE)
    return loss, *torch.autograd.grad(loss, (hidden, weight))


def _check(fn, tol: float = 1e-10) -> None:
    hidden, weight, labels = _inputs()
    want = _reference(hidden, weight, labels)
    loss = fn(hidden, weight, labels)
    got = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_chunked_ce_equals_full_logits_ce(monkeypatch):
    monkeypatch.setattr(gpu_peers, "CHUNK_ROWS", 8)  # 37 rows: 5 chunks, the last one short
    _check(gpu_peers.chunked_ce)


def test_trl_fused_head_equals_full_logits_ce():
    pytest.importorskip("trl")
    factory, note = gpu_peers._trl()
    assert note is None  # TRL's trainer imports here: the package's own module ran
    _check(factory(), tol=TRL_TOL)


def test_trl_fused_head_standalone_equals_full_logits_ce(monkeypatch):
    """Where TRL's trainer cannot import (the GPU machine has no ``datasets``), the kernel file
    runs standalone, says so, and still computes CE."""
    pytest.importorskip("trl")
    for name in [m for m in sys.modules if m == "trl" or m.startswith(("trl.", "_trl_"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    factory, note = gpu_peers._trl()
    assert note == gpu_peers.STANDALONE_TRL
    assert "trl.trainer.utils" not in sys.modules
    _check(factory(), tol=TRL_TOL)


def test_every_peer_is_a_builder_or_a_note_on_the_cpu():
    builders, notes = gpu_peers.peer_builders(torch.device("cpu"), "eager")
    for name in gpu_peers.PEERS:
        assert name in builders or name in notes, name
    for name in gpu_peers.GPU_ONLY:
        assert name not in builders
        assert notes[name].startswith(f"{name}: skipped on cpu"), notes[name]
