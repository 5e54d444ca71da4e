"""The fast EMO paths (EMO's one chunk objective, run by both drivers of the chunk engine, and
the low-rank cost) against plain-PyTorch references.

References: an inline autograd version of EMO Eq. 14 / 19 (defined here, independent of the
library), the library's reference ``emdlm.functional.emo.emo_loss``, the official ``emoloss``
package (``emo.EMOLoss``) and POT's exact EMD for DEMD with a one-hot target.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from emdlm.functional.emo import emo_loss as functional_emo_loss
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo import EMOLoss
from emdlm.ops.chunked import HeadOptions, chunked_linear_loss, chunked_logits_loss
from emdlm.ops.lowrank import lowrank_cost_embedding
from emdlm.ops.objectives.emo import EMOObjective, demd_chunked, emo_cost

MODES = ("emo1", "emo2", "static")
V, D = 101, 16


def _emo(like, e_hat, mode, mu, max_ratio, cost_dtype, vocab):
    return EMOObjective(emo_cost(e_hat, like, vocab, cost_dtype), mode, mu, max_ratio)


def emo_loss_chunked(logits, labels, e_hat, *, mode="emo1", mu=1.0, reduction="mean",
                     ignore_index=-100, chunk_size=1024, cost_dtype=None, max_ratio=None,
                     inplace_backward=True):
    """EMO's chunk objective run by the logits driver, as ``EMOLoss(implementation="chunked")``
    runs it (pinned by test_module_runs_the_objective_on_both_drivers), with the engine's own
    knobs (``cost_dtype``, ``inplace_backward``) open."""
    objective = _emo(logits, e_hat, mode, mu, max_ratio, cost_dtype, logits.shape[-1])
    options = HeadOptions(ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size)
    return chunked_logits_loss(logits, labels, objective, options,
                               inplace_backward=inplace_backward)


def fused_linear_emo_loss(hidden, weight, labels, e_hat, bias=None, *, mode="emo1", mu=1.0,
                          reduction="mean", chunk_size=1024, inplace_backward=True):
    """The same objective from hidden states (``EMOLoss.from_hidden``'s driver)."""
    objective = _emo(hidden, e_hat, mode, mu, None, None, weight.shape[0])
    options = HeadOptions(reduction=reduction, chunk_size=chunk_size)
    return chunked_linear_loss(hidden, weight, bias, labels, objective, options,
                               inplace_backward=inplace_backward)


def inline_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    e_hat: torch.Tensor,
    mode: str = "emo1",
    mu: float = 1.0,
    reduction: str = "mean",
    max_ratio: float | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """EMO by plain autograd: DEMD = 1 - (Êᵀq)·ê_y (Eq. 14), mixed per Eq. 19 / emoloss mode 2."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.reshape(-1, logits.shape[-1]).to(dtype)
    y = labels.reshape(-1)
    valid = y != ignore_index
    ys = torch.where(valid, y, 0)
    log_q = z.log_softmax(-1)
    ce = -log_q.gather(1, ys[:, None])[:, 0]
    demd = 1 - ((log_q.exp() @ e_hat.to(dtype)) * e_hat.to(dtype)[ys]).sum(-1)
    if mode == "emo1":
        r = ce.detach() / (demd.detach().clamp_min(0) + 1e-10)
        if max_ratio is not None:
            r = r.clamp_max(max_ratio)
        per = 0.5 * (ce + r * demd)
    elif mode == "emo2":
        per = demd + demd.detach() / (ce.detach() + 1e-10) * ce
    else:
        per = ce + mu * demd
    total = torch.where(valid, per, 0.0).sum()
    return total / valid.sum().clamp_min(1) if reduction == "mean" else total


def functional_reference(logits, labels, e_hat, mode="emo1", mu=1.0, reduction="mean", **kw):
    return functional_emo_loss(logits, labels, e_hat, mode=mode, mu=mu, reduction=reduction, **kw)


def make_inputs(shape=(37,), vocab=V, width=D, dtype=torch.float32, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(*shape, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    flat = labels.view(-1)
    flat[::ignore_every] = -100
    e_hat = F.normalize(torch.randn(vocab, width, generator=g, dtype=torch.float64), dim=-1)
    return logits, labels, e_hat.to(torch.float64 if dtype == torch.float64 else torch.float32)


def mu_for(mode: str) -> float:
    return 0.7 if mode == "static" else 1.0


def loss_and_grad(fn, logits, *args, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    (grad,) = torch.autograd.grad(2.0 * loss, x)  # grad_output = 2, not 1
    return loss.detach(), grad, out


# ---------------------------------------------------------------------------------------------
# chunked path == references
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("shape", "chunk_size"), [((37,), 10), ((3, 13), 4), ((37,), 1024)])
def test_chunked_equals_references(mode, reduction, shape, chunk_size):
    logits, labels, e_hat = make_inputs(shape)
    mu = mu_for(mode)
    kw = {"mode": mode, "mu": mu, "reduction": reduction}
    loss, grad, out = loss_and_grad(
        emo_loss_chunked, logits, labels, e_hat, chunk_size=chunk_size, **kw
    )
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, logits, labels, e_hat, **kw)
    fn_loss, fn_grad, fn_out = loss_and_grad(functional_reference, logits, labels, e_hat, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, fn_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, fn_grad, rtol=1e-4, atol=1e-6)
    for key in ("ce", "demd"):
        torch.testing.assert_close(out.components[key], fn_out.components[key])
    assert int(out.components["n_tokens"]) == int((labels != -100).sum())
    assert grad.shape == logits.shape and grad.abs().sum() > 0


def test_chunked_max_ratio_equals_reference():
    logits, labels, e_hat = make_inputs((37,), seed=3)
    logits = logits * 3  # peaked q: small DEMD, ratios above the cap
    loss, grad, _ = loss_and_grad(emo_loss_chunked, logits, labels, e_hat, max_ratio=3.0)
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, logits, labels, e_hat, max_ratio=3.0)
    uncapped, _, _ = loss_and_grad(emo_loss_chunked, logits, labels, e_hat)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(loss, uncapped)  # the cap is active on these inputs


@pytest.mark.parametrize("mode", [1, 2])
def test_chunked_matches_official_emoloss_package(mode):
    """emoloss's EMOLoss (one-hot formulation, shifts internally, emo1 ratio capped at 3)."""
    emo = pytest.importorskip("emo")
    logits, labels, _ = make_inputs((2, 9), seed=4)
    raw = torch.randn(V, D, generator=torch.Generator().manual_seed(9))
    official = emo.EMOLoss(logits, labels, raw, mode=mode)
    ours = emo_loss_chunked(
        logits[:, :-1],
        labels[:, 1:],
        F.normalize(raw, dim=-1),
        mode="emo1" if mode == 1 else "emo2",
        max_ratio=3.0 if mode == 1 else None,
    ).loss
    torch.testing.assert_close(ours, official, rtol=1e-5, atol=1e-6)


def test_non_contiguous_logits():
    """A shifted slice [:, :-1] (not flattenable) and a transposed [N, V] layout."""
    logits, labels, e_hat = make_inputs((3, 12), seed=5)
    base = torch.cat([logits, torch.randn(3, 1, V)], dim=1).requires_grad_(True)  # [3, 13, V]
    sliced = base[:, :-1]
    assert not sliced.is_contiguous()
    out = emo_loss_chunked(sliced, labels, e_hat, chunk_size=5)
    (g,) = torch.autograd.grad(2 * out.loss, base)
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, logits, labels, e_hat)
    torch.testing.assert_close(out.loss.detach(), ref_loss)
    torch.testing.assert_close(g[:, :-1], ref_grad, rtol=1e-4, atol=1e-6)
    assert torch.all(g[:, -1] == 0)

    # 4-d, sliced in an inner dim: walked one [4, V] block at a time.
    logits4, labels4, _ = make_inputs((2, 3, 4), seed=6)
    base4 = torch.cat([torch.randn(2, 3, 1, V), logits4], dim=2).requires_grad_(True)
    out4 = emo_loss_chunked(base4[:, :, 1:], labels4, e_hat, mode="emo2", chunk_size=3)
    (g4,) = torch.autograd.grad(out4.loss, base4)
    ref4 = inline_reference(logits4.requires_grad_(True), labels4, e_hat, mode="emo2")
    (r4,) = torch.autograd.grad(ref4, logits4)
    torch.testing.assert_close(out4.loss.detach(), ref4.detach())
    torch.testing.assert_close(g4[:, :, 1:], r4, rtol=1e-4, atol=1e-6)

    flat_logits, flat_labels, _ = make_inputs((37,), seed=6)
    transposed = flat_logits.T.contiguous().T  # [N, V] with strides (1, N)
    assert transposed.stride() == (1, 37)
    loss, grad, _ = loss_and_grad(emo_loss_chunked, transposed, flat_labels, e_hat, chunk_size=8)
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, flat_logits, flat_labels, e_hat)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_is_zero_with_zero_grad(mode, reduction):
    logits, labels, e_hat = make_inputs((4, 5))
    labels.fill_(-100)
    loss, grad, out = loss_and_grad(
        emo_loss_chunked, logits, labels, e_hat, mode=mode, reduction=reduction, chunk_size=3
    )
    assert loss.item() == 0.0
    assert torch.all(grad == 0)
    assert out.components["ce"].item() == 0.0 and out.components["demd"].item() == 0.0
    assert int(out.components["n_tokens"]) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_half_precision_logits(dtype, mode):
    logits, labels, e_hat = make_inputs((37,), dtype=dtype, seed=7)
    loss, grad, _ = loss_and_grad(
        emo_loss_chunked, logits, labels, e_hat, mode=mode, mu=mu_for(mode), chunk_size=16
    )
    ref_loss, ref_grad, _ = loss_and_grad(
        inline_reference, logits, labels, e_hat, mode=mode, mu=mu_for(mode)
    )
    assert grad.dtype == dtype and torch.isfinite(grad).all() and torch.isfinite(loss)
    # Same fp32 math on the same half inputs: the loss agrees to fp32 rounding, the gradient to
    # one rounding of the half-precision buffer.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("mu", [1.0, 2.5])
def test_gradcheck_float64(mu):
    """Static mode has no stop-gradient, so its analytic gradient must match finite differences;
    two values of mu pin the CE and the DEMD gradient separately."""
    logits, labels, e_hat = make_inputs(
        (7,), vocab=9, width=4, dtype=torch.float64, seed=8, ignore_every=3
    )
    x = logits.clone().requires_grad_(True)

    def f(z):
        return emo_loss_chunked(
            z, labels, e_hat, mode="static", mu=mu, chunk_size=3, inplace_backward=False
        ).loss  # inplace_backward=False: a repeatable backward

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", ["emo1", "emo2"])
def test_float64_dynamic_modes_match_reference_tightly(mode):
    logits, labels, e_hat = make_inputs((11,), vocab=13, width=5, dtype=torch.float64, seed=10)
    loss, grad, _ = loss_and_grad(emo_loss_chunked, logits, labels, e_hat, mode=mode, chunk_size=4)
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, logits, labels, e_hat, mode=mode)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_demd_chunked_equals_exact_emd_from_pot():
    """With a one-hot target DEMD is the exact EMD under C = 1 - Ê Êᵀ (EMO Eq. 14)."""
    ot = pytest.importorskip("ot")
    logits, labels, e_hat = make_inputs(
        (6,), vocab=12, width=5, dtype=torch.float64, seed=11, ignore_every=4
    )
    values = demd_chunked(logits, labels, e_hat, chunk_size=4)
    cost = (1 - e_hat @ e_hat.T).clamp_min(0).numpy()
    q = logits.softmax(-1).numpy()
    for t in range(6):
        if labels[t] == -100:
            assert values[t].item() == 0.0
            continue
        target = torch.zeros(12, dtype=torch.float64)
        target[labels[t]] = 1.0
        exact = ot.emd2(q[t], target.numpy(), cost)
        assert abs(values[t].item() - exact) < 1e-9


def test_demd_chunked_equals_functional_demd():
    from emdlm.functional.emo import demd

    logits, labels, e_hat = make_inputs((3, 13), seed=15)
    torch.testing.assert_close(
        demd_chunked(logits, labels, e_hat, chunk_size=5), demd(logits, labels, e_hat)
    )


def test_bf16_cost_dtype_is_close():
    logits, labels, e_hat = make_inputs((37,), seed=12)
    exact = demd_chunked(logits, labels, e_hat)
    approx = demd_chunked(logits, labels, e_hat, cost_dtype=torch.bfloat16)
    err = (exact - approx).abs().max().item()
    assert 0 < err < 2e-2  # bf16 rounding of Ê and of S: visible but small
    loss, grad, _ = loss_and_grad(
        emo_loss_chunked, logits, labels, e_hat, mode="static", cost_dtype=torch.bfloat16
    )
    ref_loss, ref_grad, _ = loss_and_grad(inline_reference, logits, labels, e_hat, mode="static")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad, ref_grad, rtol=5e-2, atol=1e-3)


def test_no_grad_values_equal_grad_path():
    logits, labels, e_hat = make_inputs((37,), seed=13)
    with torch.no_grad():
        values = emo_loss_chunked(logits, labels, e_hat, chunk_size=8)
    with_grad = emo_loss_chunked(logits.clone().requires_grad_(True), labels, e_hat, chunk_size=8)
    torch.testing.assert_close(values.loss, with_grad.loss.detach())
    assert values.loss.grad_fn is None


def test_backward_twice_raises_unless_not_inplace():
    logits, labels, e_hat = make_inputs((5,))
    x = logits.requires_grad_(True)
    loss = emo_loss_chunked(x, labels, e_hat).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="called twice"):
        loss.backward()
    x.grad = None
    loss = emo_loss_chunked(x, labels, e_hat, inplace_backward=False).loss
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_bad_inputs_raise_clear_errors():
    logits, labels, e_hat = make_inputs((5,))
    x = logits.requires_grad_(True)  # the chunked path
    with pytest.raises(ValueError, match="cost_embedding must have shape"):
        EMOLoss(e_hat[:-1], implementation="chunked")(x, labels)
    with pytest.raises(ValueError, match="frozen"):
        emo_loss_chunked(logits, labels, e_hat.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="mode"):
        EMOLoss(e_hat, mode="emo3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        EMOLoss(e_hat, chunk_size=0)
    with pytest.raises(ValueError, match="out of range"):
        EMOLoss(e_hat, implementation="chunked")(x, torch.full((5,), V))
    with pytest.raises(ValueError, match="reduction"):
        EMOLoss(e_hat, reduction="none")  # type: ignore[arg-type]


def test_module_runs_the_objective_on_both_drivers():
    """EMOLoss's chunked logits path and from_hidden are the objective on the two drivers (what
    the helpers above run), values and gradients."""
    logits, labels, e_hat = make_inputs((3, 13), seed=21)
    module = EMOLoss(e_hat, mode="emo2", chunk_size=4, implementation="chunked")
    e_module = module.cost_embedding_normalized
    loss, grad, _ = loss_and_grad(module, logits, labels)
    ref, ref_grad, _ = loss_and_grad(
        emo_loss_chunked, logits, labels, e_module, mode="emo2", chunk_size=4)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
    hidden, weight, bias, lab, e2 = make_linear(seed=22)
    module = EMOLoss(e2, mode="static", mu=0.5, chunk_size=10)
    a, ga = grads_of(lambda h, w, b: module.from_hidden(h, w, lab, b), (hidden, weight, bias))
    e_module = module.cost_embedding_normalized
    b_, gb = grads_of(
        lambda h, w, b: fused_linear_emo_loss(
            h, w, lab, e_module, b, mode="static", mu=0.5, chunk_size=10),
        (hidden, weight, bias))
    torch.testing.assert_close(a, b_, rtol=0, atol=0)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# fused linear == unfused
# ---------------------------------------------------------------------------------------------

H = 24


def make_linear(shape=(37,), dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (0.4 * torch.randn(V, H, generator=g)).to(dtype)
    b = (0.5 * torch.randn(V, generator=g)).to(dtype) if bias else None
    labels = torch.randint(0, V, shape, generator=g)
    labels.view(-1)[::4] = -100
    e_hat = F.normalize(torch.randn(V, D + 3, generator=g), dim=-1)  # d' != H
    return hidden, weight, b, labels, e_hat


def grads_of(fn, tensors, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*leaves, *args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    grads = torch.autograd.grad(2.0 * loss, [t for t in leaves if t is not None])
    return loss.detach(), grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_equals_unfused(mode, reduction, with_bias):
    hidden, weight, bias, labels, e_hat = make_linear(bias=with_bias, seed=1)
    kw = {"mode": mode, "mu": mu_for(mode), "reduction": reduction}

    def fused(h, w, b=None):
        return fused_linear_emo_loss(h, w, labels, e_hat, b, chunk_size=10, **kw)

    def unfused(h, w, b=None):
        z = h @ w.T if b is None else h @ w.T + b
        return functional_reference(z, labels, e_hat, **kw)

    loss, grads = grads_of(fused, (hidden, weight, bias))
    ref_loss, ref_grads = grads_of(unfused, (hidden, weight, bias))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert len(grads) == (3 if with_bias else 2)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_precision_close_to_unfused(dtype):
    hidden, weight, bias, labels, e_hat = make_linear(shape=(3, 11), dtype=dtype, seed=2)

    def fused(h, w, b):
        return fused_linear_emo_loss(h, w, labels, e_hat, b, chunk_size=7)

    def unfused(h, w, b):  # F.linear is what nn.Linear runs (one addmm, like the fused head)
        return functional_reference(F.linear(h, w, b), labels, e_hat)

    loss, grads = grads_of(fused, (hidden, weight, bias))
    ref_loss, ref_grads = grads_of(unfused, (hidden, weight, bias))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype and torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), r.float(), rtol=3e-2, atol=3e-3)


def test_fused_frozen_weight_and_all_ignored():
    hidden, weight, bias, labels, e_hat = make_linear(seed=3)
    h = hidden.clone().requires_grad_(True)
    out = fused_linear_emo_loss(h, weight, labels, e_hat, bias, chunk_size=8)
    (gh,) = torch.autograd.grad(out.loss, h)
    ref = functional_reference(h @ weight.T + bias, labels, e_hat).loss
    (rh,) = torch.autograd.grad(ref, h)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-6)

    labels.fill_(-100)
    loss, grads = grads_of(
        lambda a, b, c: fused_linear_emo_loss(a, b, labels, e_hat, c), (hidden, weight, bias)
    )
    assert loss.item() == 0.0 and all(torch.all(g == 0) for g in grads)


def test_fused_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 8, 2, 2])
    e_hat = F.normalize(torch.randn(9, 4, generator=g, dtype=torch.float64), dim=-1)

    def f(h, w, b):
        return fused_linear_emo_loss(
            h, w, labels, e_hat, b, mode="static", mu=1.5, chunk_size=4, inplace_backward=False
        ).loss

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_cross_entropy_equals_torch(reduction):
    hidden, weight, bias, labels, _ = make_linear(shape=(2, 19), seed=5)

    def fused(h, w, b):
        return CrossEntropyLoss(reduction=reduction).from_hidden(h, w, labels, b, chunk_size=6)

    def unfused(h, w, b):
        z = (h @ w.T + b).reshape(-1, V)
        return F.cross_entropy(z, labels.reshape(-1), reduction=reduction)

    loss, grads = grads_of(fused, (hidden, weight, bias))
    ref_loss, ref_grads = grads_of(unfused, (hidden, weight, bias))
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_fused_bad_inputs():
    hidden, weight, bias, labels, e_hat = make_linear()
    with pytest.raises(ValueError, match=r"weight must have shape \[V, H\]"):
        fused_linear_emo_loss(hidden, weight[:, :-1], labels, e_hat)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_linear_emo_loss(hidden, weight, labels[:-1], e_hat)
    with pytest.raises(ValueError, match="bias"):
        fused_linear_emo_loss(hidden, weight, labels, e_hat, bias[:-1])
    with pytest.raises(ValueError, match="cost_embedding must have shape"):
        fused_linear_emo_loss(hidden, weight, labels, e_hat[:-2])


# ---------------------------------------------------------------------------------------------
# low-rank cost embedding
# ---------------------------------------------------------------------------------------------


def test_lowrank_full_rank_keeps_the_gram_matrix():
    _, _, e_hat = make_inputs(vocab=50, width=8, dtype=torch.float64)
    full = lowrank_cost_embedding(e_hat, 8)
    torch.testing.assert_close(full @ full.T, e_hat @ e_hat.T)


def test_lowrank_is_exact_on_a_low_rank_embedding_and_errs_otherwise():
    g = torch.Generator().manual_seed(14)
    e_hat = F.normalize(torch.randn(60, 3, generator=g) @ torch.randn(3, 10, generator=g), dim=-1)
    reduced = lowrank_cost_embedding(e_hat, 3)
    assert reduced.shape == (60, 3)
    torch.testing.assert_close(reduced.norm(dim=-1), torch.ones(60))
    torch.testing.assert_close(reduced @ reduced.T, e_hat @ e_hat.T, rtol=1e-5, atol=1e-5)
    crude = lowrank_cost_embedding(e_hat, 1)
    assert ((crude @ crude.T) - e_hat @ e_hat.T).abs().max() > 0.1
    with pytest.raises(ValueError, match="rank"):
        lowrank_cost_embedding(e_hat, 11)
