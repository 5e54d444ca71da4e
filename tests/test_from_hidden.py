"""The from-hidden path (emdlm.ops.chunked) equals the logits path: objective-specific cases.

Every registered objective with ``has_from_hidden``, on every implementation path, is compared
with its logits path in tests/test_conformance.py (float64 and float32, plain and with
``logit_scale`` / ``softcap``, bfloat16, NaN hidden states at ignored positions, an all-ignored
batch). Here: options that are not a path of tests/_objectives.py (TaiLr's weight options,
NTIL's argmax values and token averaging, EMO's capped ratio and static mix), chunk sizes, the
engine's drivers, gradcheck and errors. The oracle is the module itself on the full logits
``hidden @ W.T + b``: loss, components and the gradients w.r.t. hidden, weight and bias are
compared, with grad_output = 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import emdlm.ops.chunked
from _number_tokens import TOKENS, VOCAB, V
from _objectives import SPECS, random_cost_embedding
from emdlm.functional.emo import emo_loss
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo import EMOLoss
from emdlm.losses.ntil import NTILLoss
from emdlm.ops.chunked import (
    HeadOptions,
    chunked_linear_loss,
    chunked_logits_loss,
    default_chunk_rows,
)
from emdlm.ops.objectives.ce import WeightedCEObjective, mixce_weights

H = 16


def make_labels(b: int, t: int, seed: int) -> torch.Tensor:
    """Many numbers (runs of digits), other tokens, ignored labels, and one row without numbers."""
    gen = torch.Generator().manual_seed(seed)
    digits = torch.randint(0, 10, (b, t), generator=gen)
    other = torch.randint(28, len(TOKENS), (b, t), generator=gen)  # non-number tokens
    pick = torch.rand(b, t, generator=gen)
    labels = torch.where(pick < 0.6, digits, other)
    labels[pick > 0.9] = -100
    labels[-1] = torch.where(labels[-1] < 28, 30, labels[-1])  # last row: no number at all
    return labels


LossFactory = Callable[[str], nn.Module]

# EMO's cost embedding (d' = 6 != H); the logits path of EMOLoss is its plain-autograd reference.
E_RAW = random_cost_embedding(V, 6, seed=11)


def _build(name: str, path: str | None = None, **options: Any) -> nn.Module:
    """Objective ``name`` (tests/_objectives.py) on ``path`` (None: the class defaults) with
    ``options``, over VOCAB and E_RAW."""
    return SPECS[name].build(path, digits=VOCAB, cost_embedding=E_RAW, **options)


# case -> factory(reduction): the modules the tests below use
OBJECTIVES: dict[str, LossFactory] = {
    "ce": lambda r: _build("ce", reduction=r),
    "tailr": lambda r: _build(
        "tailr", gamma=0.3, min_weight=0.1, label_smoothing=0.1, reduction=r
    ),
    "mixce": lambda r: _build("mixce", eta=0.3, reduction=r),
    "digit_emd_token": lambda r: _build("emd", mix="static", averaging="token", reduction=r),
    "ntil_argmax": lambda r: _build("ntil", value_mode="argmax", reduction=r),
    "ntil_official_token": lambda r: _build(
        "ntil", preset="official", value_mode="expected", averaging="token", reduction=r
    ),
    "emo_capped": lambda r: _build("emo", "reference", max_ratio=3.0, reduction=r),
    "emo_static": lambda r: _build("emo", "reference", mode="static", mu=0.7, reduction=r),
}
# the options that are no path of tests/_objectives.py (the paths: tests/test_conformance.py)
VARIANTS = [
    "tailr",
    "digit_emd_token",
    "ntil_argmax",
    "ntil_official_token",
    "emo_capped",
    "emo_static",
]


def inputs(dtype: torch.dtype, seed: int = 0, b: int = 3, t: int = 11) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.7
    bias = torch.randn(V, generator=gen)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype)


def head(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scale: float | None, cap: float | None
) -> torch.Tensor:
    """The unfused head: cap·tanh(s·(h Wᵀ + b)/cap), soft-cap in float32 as the engine."""
    z = h @ w.T + b
    if scale is None and cap is None:
        return z
    z = z.float() if z.dtype != torch.float64 else z
    if scale is not None:
        z = z * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z


def both_paths(
    name: str,
    reduction: str,
    dtype: torch.dtype = torch.float32,
    chunk_size: int | None = 5,
    scale: float | None = None,
    cap: float | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], dict, dict]:
    """(loss, grad_h, grad_w, grad_b) and components of the from-hidden and the logits path."""
    hidden, weight, bias = inputs(dtype)
    labels = make_labels(3, 11, seed=3) if labels is None else labels
    results, comps = [], []
    for path in ("hidden", "logits"):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        fn = OBJECTIVES[name](reduction)
        if path == "hidden":
            out = fn.from_hidden(
                h, w, labels, b, chunk_size=chunk_size, logit_scale=scale, softcap=cap
            )
        else:
            out = fn(head(h, w, b, scale, cap), labels)
        (2 * out.loss).backward()  # grad_output != 1
        results.append((out.loss.detach(), h.grad, w.grad, b.grad))
        comps.append({k: float(v) for k, v in out.components.items()})
    return results[0], results[1], comps[0], comps[1]


def assert_same(got: tuple, want: tuple, rtol: float, atol: float, scaled: bool = False) -> None:
    """Loss and gradients close; ``scaled``: atol relative to the tensor's largest entry (bf16,
    where a sum of rounded terms can cancel to a small entry with a large relative error)."""
    for label, g, r in zip(("loss", "hidden", "weight", "bias"), got, want, strict=True):
        assert g.dtype == r.dtype, label
        if scaled:
            atol = atol * max(float(r.abs().max()), 1.0)
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=lambda m, k=label: f"{k}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", VARIANTS)
def test_from_hidden_equals_logits_path(name: str, reduction: str) -> None:
    # chunk_size 5 over 33 rows of 11: chunks end mid-row and split numbers.
    # float64: the chunked path sums in another order, so float32 agreement depends on the
    # machine's BLAS (a CI run once missed 2e-6 in tests/test_ntl.py's "sum" case); float32 and
    # bf16 equality of every objective's defaults: tests/test_conformance.py
    got, want, comp_got, comp_want = both_paths(name, reduction, dtype=torch.float64)
    assert got[0].dtype == torch.float64 and got[2].dtype == torch.float64
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    assert comp_got.keys() == comp_want.keys()
    for k in comp_got:
        assert comp_got[k] == pytest.approx(comp_want[k], rel=1e-10, abs=1e-12), k
    if name.startswith(("ntil", "digit")):
        assert comp_got["n_numbers"] > 0 and comp_got["ntil"] > 0  # the NTIL part is exercised


@pytest.mark.parametrize("chunk_size", [1, 7, 1000, None])
def test_chunk_sizes_ntil(chunk_size: int | None) -> None:
    got, want, _, _ = both_paths("ntil_argmax", "mean", chunk_size=chunk_size)
    assert_same(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["tailr", "ntil_argmax"])
def test_bf16_inputs(name: str) -> None:
    """Options that are no path (every objective's defaults: tests/test_conformance.py)."""
    got, want, _, _ = both_paths(name, "mean", dtype=torch.bfloat16)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    # The logits path rounds the [N, V] gradient to bf16 once; here CE and NTIL parts are
    # rounded separately and grad_W is accumulated in float32.
    assert_same(got, want, rtol=2e-2, atol=1e-2, scaled=True)


@pytest.mark.parametrize("name", ["tailr", "ntil_argmax", "emo_static"])
def test_softcap_and_logit_scale(name: str) -> None:
    """Options that are no path (every path: tests/test_conformance.py)."""
    got, want, _, _ = both_paths(name, "mean", scale=0.8, cap=3.0)
    assert_same(got, want, rtol=2e-5, atol=2e-6)
    plain, _, _, _ = both_paths(name, "mean")
    assert not torch.allclose(got[0], plain[0])  # the cap changes the loss


def test_no_grad_path_same_value() -> None:
    hidden, weight, bias = inputs(torch.float32)
    labels = make_labels(3, 11, seed=3)
    fn = OBJECTIVES["ntil_argmax"]("mean")
    with torch.no_grad():
        plain = fn.from_hidden(hidden, weight, labels, bias, chunk_size=5)
    logits = fn(hidden @ weight.T + bias, labels)
    torch.testing.assert_close(plain.loss, logits.loss.detach(), rtol=1e-6, atol=1e-6)
    assert plain.loss.grad_fn is None


def test_gradcheck_engine_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    # gradcheck back-propagates one graph several times: keep the gradients (no hand-over).
    keep = functools.partial(chunked_linear_loss, inplace_backward=False)
    monkeypatch.setattr(emdlm.ops.chunked, "chunked_linear_loss", keep)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = make_labels(2, 5, seed=9)
    loss_fn = NTILLoss(VOCAB, value_mode="expected", mix="static")

    def ntil(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return loss_fn.from_hidden(h, w, labels, b, chunk_size=3, softcap=4.0).loss

    def tailr(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # a_t depends on sg(q_y): gradcheck needs a constant weight, so take CE with smoothing.
        objective = WeightedCEObjective(None, label_smoothing=0.2)
        options = HeadOptions(chunk_size=3, logit_scale=1.5, reduction="sum")
        return chunked_linear_loss(h, w, b, labels, objective, options, inplace_backward=False).loss

    emo_fn = EMOLoss(E_RAW, mode="static", mu=0.7)  # no stop-gradient: a true derivative

    def emo(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return emo_fn.from_hidden(h, w, labels, b, chunk_size=3, logit_scale=1.5, softcap=4.0).loss

    assert torch.autograd.gradcheck(ntil, (hidden, weight, bias))
    assert torch.autograd.gradcheck(tailr, (hidden, weight, bias))
    assert torch.autograd.gradcheck(emo, (hidden, weight, bias))


def test_default_chunk_saves_memory_at_qwen_vocab() -> None:
    vocab, n = 151936, 4096
    rows = default_chunk_rows(vocab)
    assert rows == 441
    # The CE family's one float32 [rows, V] buffer is under 1/8 of the float32 [N, V] logits.
    assert rows * vocab <= n * vocab / 8


def test_bad_inputs_raise() -> None:
    hidden, weight, _ = inputs(torch.float32)
    labels = make_labels(3, 11, seed=3)
    fn = CrossEntropyLoss()
    with pytest.raises(ValueError, match="chunk_size"):
        fn.from_hidden(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="softcap"):
        fn.from_hidden(hidden, weight, labels, softcap=-1.0)
    with pytest.raises(ValueError, match="weight must have shape"):
        fn.from_hidden(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="shape mismatch"):
        fn.from_hidden(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="out of range"):
        NTILLoss(VOCAB).from_hidden(hidden, weight, labels.clamp_min(0) + V)


def test_backward_twice_raises() -> None:
    hidden, weight, _ = inputs(torch.float32)
    h = hidden.requires_grad_()
    out = CrossEntropyLoss().from_hidden(h, weight, make_labels(3, 11, seed=3))
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward was called twice"):
        out.loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", ["emo1", "emo2", "static"])
def test_emo_through_both_drivers_equals_reference(
    mode: str, reduction: str, dtype: torch.dtype
) -> None:
    """EMO's one chunk objective from hidden states (chunked_linear_loss) and from logits
    (chunked_logits_loss) equals the functional reference."""
    hidden, weight, bias = inputs(dtype)
    labels = make_labels(3, 11, seed=3)
    e_hat = F.normalize(torch.randn(V, 6, generator=torch.Generator().manual_seed(2)), dim=-1)
    kw = {"mode": mode, "reduction": reduction, "mu": 0.7 if mode == "static" else 1.0}
    module = EMOLoss(e_hat, implementation="chunked", chunk_size=5, **kw)  # type: ignore[arg-type]
    e_module = module.cost_embedding_normalized
    results, comps = [], []
    for path in ("hidden", "logits", "reference"):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        if path == "hidden":
            out = module.from_hidden(h, w, labels, b)
        elif path == "logits":  # F.linear: one addmm, the rounding of the engine's head
            out = module(F.linear(h, w, b), labels)
        else:
            out = emo_loss(h @ w.T + b, labels, e_module, **kw)
        (2 * out.loss).backward()
        results.append((out.loss.detach(), h.grad, w.grad, b.grad))
        comps.append({k: float(v) for k, v in out.components.items()})
    tol = (2e-5, 2e-6) if dtype == torch.float32 else (2e-2, 1e-2)
    assert_same(results[0], results[1], *tol, scaled=True)  # from hidden == chunked logits
    assert_same(results[0], results[2], *tol, scaled=True)  # from hidden == reference
    assert comps[0].keys() == comps[1].keys()
    for k in comps[0]:
        assert comps[0][k] == pytest.approx(comps[1][k], rel=1e-4, abs=1e-5), k


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["ce", "mixce"])
def test_logits_driver_runs_the_same_objectives(name: str, reduction: str) -> None:
    """The engine's logits driver with the CE-family objectives equals the modules on the full
    logits: a sliced [B, T-1, V] view (read chunk by chunk, chunks ending mid-row), NaN logits
    at ignored positions, grad_output = 2."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, 12, V, generator=gen) * 2
    labels = make_labels(3, 11, seed=5)
    base[:, :-1][labels == -100] = float("nan")  # padding garbage: must change nothing
    results = []
    for path in ("driver", "module"):
        x = base.clone().requires_grad_()
        logits = x[:, :-1]
        module = OBJECTIVES[name](reduction)
        if path == "driver":
            objective, _ = module.chunk_objective(logits, labels)
            options = HeadOptions(reduction=reduction, chunk_size=4)
            out = chunked_logits_loss(logits, labels, objective, options)
        else:
            safe = torch.where(labels[..., None] == -100, 0.0, logits)
            out = module(safe, labels)
        (2 * out.loss).backward()
        results.append((out.loss.detach(), x.grad))
    (loss, grad), (ref_loss, ref_grad) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert bool((grad[:, :-1][labels == -100] == 0).all()) and bool((grad[:, -1] == 0).all())


def test_logits_driver_refuses_head_options() -> None:
    logits = torch.randn(2, 5, V)
    labels = make_labels(2, 5, seed=1)
    with pytest.raises(ValueError, match="softcap"):
        chunked_logits_loss(logits, labels, WeightedCEObjective(), HeadOptions(softcap=3.0))


class _UnscaledCE(WeightedCEObjective):
    """MixCE that leaves grad_scale to the driver (``ChunkOut.scaled = False``), in every chunk
    or only in the first one (the drivers must scale exactly those)."""

    def __init__(self, first_only: bool) -> None:
        super().__init__(mixce_weights(0.3))
        self.first_only = first_only

    def chunk(self, z, out, labels, valid, start, grad_scale):  # type: ignore[no-untyped-def]
        if grad_scale is None or (self.first_only and start > 0):
            return super().chunk(z, out, labels, valid, start, grad_scale)
        res = super().chunk(z, out, labels, valid, start, torch.ones_like(grad_scale))
        res.scaled = False
        return res


@pytest.mark.parametrize("first_only", [False, True])
def test_drivers_apply_the_scale_an_objective_left_out(first_only: bool) -> None:
    hidden, weight, bias = inputs(torch.float32)
    labels = make_labels(3, 11, seed=3)
    results = []
    for unscaled in (True, False):

        def objective(u: bool = unscaled) -> WeightedCEObjective:
            return _UnscaledCE(first_only) if u else WeightedCEObjective(mixce_weights(0.3))

        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        options = HeadOptions(chunk_size=4, logit_scale=1.3)
        out = chunked_linear_loss(h, w, b, labels, objective(), options)
        (2 * out.loss).backward()
        z = (1.3 * (hidden @ weight.T + bias)).requires_grad_()
        out_z = chunked_logits_loss(z, labels, objective(), HeadOptions(chunk_size=4))
        (2 * out_z.loss).backward()
        results.append((out.loss.detach(), h.grad, w.grad, b.grad, out_z.loss.detach(), z.grad))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
