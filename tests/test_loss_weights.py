"""Per-token ``loss_weights`` (emdlm.losses.base): the weighted-CE family on both routes.

Semantics pinned here, for every objective that declares ``takes_loss_weights`` (taken from
the registry): "sum" is Σ_t w_t·l_t and "mean" Σ_t w_t·l_t / Σ_t w_t over the counted tokens;
a weight of 0 scores a token exactly as an ignored label (loss and gradients); all-zero
weights give an exact, finite 0; bad weights are a ValueError naming the problem; the logits
route equals the from-hidden route; CE, DFT and MixCE equal a hand-written reference built on
``F.cross_entropy(reduction="none")``. Objectives that do not declare it still refuse by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _number_tokens import VOCAB, V
from _objectives import SPECS, random_cost_embedding
from test_host_syncs import SyncCounter

F64 = torch.float64
B, T, H = 3, 6, 8
COST = random_cost_embedding(V, 6, seed=3)

#: (objective, path) of every registered objective that takes per-token weights.
WEIGHTED = [
    (name, path)
    for name, spec in sorted(SPECS.items())
    if spec.cls.takes_loss_weights
    for path in spec.paths
]
REFUSING = sorted(name for name, spec in SPECS.items() if not spec.cls.takes_loss_weights)


def build(name: str, path: str | None = None, **options: Any) -> nn.Module:
    return SPECS[name].build(path, digits=VOCAB, cost_embedding=COST, **options)


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Hidden states, head, labels (two ignored) and weights in [0, 2) with one exact 0."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, 0] = labels[2, 3] = -100
    weights = 2.0 * torch.rand(B, T, generator=gen, dtype=F64)
    weights[1, 4] = 0.0
    return {
        "hidden": torch.randn(B, T, H, generator=gen, dtype=F64),
        "weight": 0.7 * torch.randn(V, H, generator=gen, dtype=F64),
        "bias": torch.randn(V, generator=gen, dtype=F64),
        "labels": labels,
        "weights": weights,
    }


def on_logits(fn: nn.Module, d: dict[str, torch.Tensor], **kw: Any) -> tuple[Any, list[Any]]:
    """Loss of the unfused head's logits; gradients of hidden, weight and bias."""
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = fn(h @ w.T + b, kw.pop("labels", d["labels"]), **kw)
    out.loss.backward()
    return out, [h.grad, w.grad, b.grad]


def on_hidden(fn: nn.Module, d: dict[str, torch.Tensor], **kw: Any) -> tuple[Any, list[Any]]:
    """The same loss from hidden states (chunks of 4 rows: several chunks)."""
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = fn.from_hidden(h, w, kw.pop("labels", d["labels"]), b, chunk_size=4, **kw)
    out.loss.backward()
    return out, [h.grad, w.grad, b.grad]


ROUTES = {"logits": on_logits, "hidden": on_hidden}


def test_weighted_objectives_are_the_ce_family() -> None:
    """The declaration is read from the registry; today the weighted-CE family takes weights."""
    assert {name for name, _ in WEIGHTED} == {"ce", "dft", "mixce", "tailr"}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_logits_route_equals_from_hidden(name: str, path: str, reduction: str) -> None:
    d = inputs()
    fn = build(name, path, reduction=reduction)
    a, grads_a = on_logits(fn, d, loss_weights=d["weights"])
    b, grads_b = on_hidden(fn, d, loss_weights=d["weights"])
    torch.testing.assert_close(a.loss, b.loss)
    assert a.components.keys() == b.components.keys()
    for key in a.components:
        torch.testing.assert_close(a.components[key], b.components[key], msg=key)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb)
    unweighted, _ = on_logits(fn, d)  # the weights do change the loss
    assert not torch.allclose(a.loss, unweighted.loss)


def reference_per_token(name: str, path: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """l_t per token [N] by hand (0 where ignored): F.cross_entropy(reduction="none") with the
    objective's own terms."""
    opts = SPECS[name].paths[path]
    eps = opts.get("label_smoothing", 0.0)
    ce = F.cross_entropy(z, y, reduction="none", ignore_index=-100)
    per = F.cross_entropy(z, y, reduction="none", ignore_index=-100, label_smoothing=eps)
    if opts.get("z_loss", 0.0):
        lse = torch.logsumexp(z, dim=-1)
        per = per + opts["z_loss"] * torch.where(y != -100, lse * lse, 0.0)
    q = torch.exp(-ce).detach()
    if name == "dft":
        per = q * ce
    elif name == "mixce":
        eta = build(name, path).eta
        per = (eta + (1.0 - eta) * q) * ce
    return per


REFERENCED = [(n, p) for n, p in WEIGHTED if n in ("ce", "dft", "mixce")]


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), REFERENCED)
def test_equals_hand_written_reference(name: str, path: str, reduction: str, route: str) -> None:
    """Σ w_t·l_t (/ Σ w_t over counted tokens for "mean"), loss and gradients."""
    d = inputs(1)
    got, grads = ROUTES[route](build(name, path, reduction=reduction), d, loss_weights=d["weights"])
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    y, wt = d["labels"].reshape(-1), d["weights"].reshape(-1)
    per = reference_per_token(name, path, (h @ w.T + b).reshape(-1, V), y)
    total = (per * wt).sum()
    expected = total if reduction == "sum" else total / wt[y != -100].sum()
    expected.backward()
    torch.testing.assert_close(got.loss, expected)
    for g, ref in zip(grads, [h.grad, w.grad, b.grad], strict=True):
        torch.testing.assert_close(g, ref)
    ce = F.cross_entropy((h @ w.T + b).reshape(-1, V), y, reduction="none", ignore_index=-100)
    counted = wt[y != -100]
    torch.testing.assert_close(got.components["n_tokens"], counted.sum())
    torch.testing.assert_close(got.components["ce"], (ce * wt).sum().detach() / counted.sum())


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_entropy_is_weighted_like_the_other_components(route: str) -> None:
    """CE's entropy component with weights: Σ w_t·H_t / Σ w_t over counted tokens."""
    from emdlm.losses.ce import CrossEntropyLoss

    d = inputs(4)
    got, _ = ROUTES[route](CrossEntropyLoss(entropy=True), d, loss_weights=d["weights"])
    y, wt = d["labels"].reshape(-1), d["weights"].reshape(-1)
    logq = torch.log_softmax((d["hidden"] @ d["weight"].T + d["bias"]).reshape(-1, V), dim=-1)
    ent = -(logq.exp() * logq).sum(-1)
    keep = y != -100
    torch.testing.assert_close(got.components["entropy"],
                               (ent[keep] * wt[keep]).sum() / wt[keep].sum())


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_weight_zero_equals_ignored_label(name: str, path: str, route: str) -> None:
    """w_t = 0 at a scored token == that label ignored (same weights elsewhere): loss,
    components and gradients."""
    d = inputs(2)
    fn = build(name, path)
    ignored = d["labels"].clone()
    ignored[1, 4] = -100  # the token whose weight is 0
    a, grads_a = ROUTES[route](fn, d, loss_weights=d["weights"])
    b, grads_b = ROUTES[route](fn, d, labels=ignored, loss_weights=d["weights"])
    torch.testing.assert_close(a.loss, b.loss)
    for key in a.components:
        torch.testing.assert_close(a.components[key], b.components[key], msg=key)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_unit_weights_are_the_unweighted_loss(name: str, path: str, route: str) -> None:
    d = inputs(3)
    fn = build(name, path)
    a, grads_a = ROUTES[route](fn, d, loss_weights=torch.ones(B, T, dtype=F64))
    b, grads_b = ROUTES[route](fn, d)
    torch.testing.assert_close(a.loss, b.loss)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_all_zero_weights_give_an_exact_zero(name: str, path: str, reduction: str, route: str):
    d = inputs(4)
    out, grads = ROUTES[route](
        build(name, path, reduction=reduction), d, loss_weights=torch.zeros(B, T, dtype=F64)
    )
    assert float(out.loss.detach()) == 0.0
    for key, value in out.components.items():
        assert torch.isfinite(torch.as_tensor(value)).all(), key
    for g in grads:
        assert torch.count_nonzero(g) == 0


NAN = torch.ones(B, T, dtype=F64).index_fill_(1, torch.tensor([2]), float("nan"))
INF = torch.ones(B, T, dtype=F64).index_fill_(0, torch.tensor([0]), float("inf"))
BAD = {
    "shape": (torch.ones(B, T + 1, dtype=F64), r"labels' shape \(3, 6\), got \(3, 7\)"),
    "dtype": (torch.ones(B, T, dtype=torch.long), "floating-point tensor, got torch.int64"),
    "negative": (torch.full((B, T), -0.5, dtype=F64), f"{B * T} of {B * T} entries are negative"),
    "nan": (NAN, "finite and >= 0: 3 of 18 entries"),
    "inf": (INF, "finite and >= 0: 6 of 18 entries"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_weights_are_a_clear_error(bad: str, route: str) -> None:
    weights, message = BAD[bad]
    d = inputs(5)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    fn = build("ce")
    with pytest.raises(ValueError, match=message):
        if route == "logits":
            fn(h @ w.T + b, d["labels"], loss_weights=weights)
        else:
            fn.from_hidden(h, w, d["labels"], b, loss_weights=weights)
    assert h.grad is None and w.grad is None


@pytest.mark.parametrize("name", REFUSING)
def test_objectives_without_weights_refuse_by_name(name: str) -> None:
    fn = build(name)
    d = inputs(6)
    logits = d["hidden"] @ d["weight"].T
    teacher = {"teacher_logits": torch.zeros_like(logits)} if fn.needs_teacher else {}
    match = f"{type(fn).__name__} takes no loss_weights"
    with pytest.raises(NotImplementedError, match=match):
        fn(logits, d["labels"], loss_weights=d["weights"], **teacher)
    if fn.has_from_hidden:
        with pytest.raises(NotImplementedError, match=match):
            fn.from_hidden(d["hidden"], d["weight"], d["labels"], loss_weights=d["weights"])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_weights_keep_one_host_sync(route: str) -> None:
    """The weights' value check is read in the engine's one host sync of the call."""
    d = inputs(7)
    fn = build("ce", "smoothing-zloss-accuracy")
    ROUTES[route](fn, d, loss_weights=d["weights"])  # warm
    with SyncCounter() as counter:
        ROUTES[route](fn, d, loss_weights=d["weights"])
    assert counter.total <= 1, dict(counter.where)
