"""Per-token ``loss_weights`` (emdlm.losses.base): the weighted-CE family on both routes.

Semantics pinned here, for every objective that declares ``takes_loss_weights`` (taken from
the registry): "sum" is Σ_t w_t·l_t and "mean" Σ_t w_t·l_t / Σ_t w_t over the counted tokens;
a weight of 0 scores a token exactly as an ignored label (loss and gradients); all-zero
weights give an exact, finite 0; bad weights are a ValueError naming the problem; the logits
route equals the from-hidden route; CE, DFT and MixCE equal a hand-written reference built on
``F.cross_entropy(reduction="none")``, EMO, EMO distillation, the KL distillation baseline and
NTIL references of their own. An objective that does not declare it refuses by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _number_tokens import TOKENS as VOCAB_TOKENS
from _number_tokens import VOCAB, V
from _objectives import SPECS, random_cost_embedding
from emdlm.functional.digit_emd import weighted_digit_emd
from emdlm.functional.ntil import class_candidates, resolve_spans
from emdlm.losses.ntil import NTILLoss
from emdlm.objectives import weighable_objectives
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


def seeded(fn: nn.Module, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with a freshly seeded ``generator=`` for a loss that draws noise (NTIL's Gumbel
    values), so every call of a test draws the same noise."""
    if isinstance(fn, NTILLoss):
        kw.setdefault("generator", torch.Generator().manual_seed(11))
    if fn.needs_teacher:  # fixed teacher logits (a distillation's target)
        gen = torch.Generator().manual_seed(5)
        kw.setdefault("teacher_logits", torch.randn(B, T, V, generator=gen, dtype=F64))
    return kw


def on_logits(fn: nn.Module, d: dict[str, torch.Tensor], **kw: Any) -> tuple[Any, list[Any]]:
    """Loss of the unfused head's logits; gradients of hidden, weight and bias."""
    kw = seeded(fn, kw)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = fn(h @ w.T + b, kw.pop("labels", d["labels"]), **kw)
    out.loss.backward()
    return out, [h.grad, w.grad, b.grad]


def on_hidden(fn: nn.Module, d: dict[str, torch.Tensor], **kw: Any) -> tuple[Any, list[Any]]:
    """The same loss from hidden states (chunks of 4 rows: several chunks)."""
    if not fn.has_from_hidden:
        pytest.skip(f"{type(fn).__name__} has no from-hidden path")
    kw = seeded(fn, kw)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = fn.from_hidden(h, w, kw.pop("labels", d["labels"]), b, chunk_size=4, **kw)
    out.loss.backward()
    return out, [h.grad, w.grad, b.grad]


ROUTES = {"logits": on_logits, "hidden": on_hidden}


def assert_same_call(a: Any, grads_a: list[Any], b: Any, grads_b: list[Any]) -> None:
    """Two calls agree: loss, the same components with the same values, every gradient."""
    torch.testing.assert_close(a.loss, b.loss)
    assert a.components.keys() == b.components.keys()
    for key in a.components:
        torch.testing.assert_close(a.components[key], b.components[key], msg=key)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb)


def test_weighted_objectives_are_read_from_the_registry() -> None:
    """The declaration is read from the registry (``weighable_objectives``, the classes'
    ``takes_loss_weights``): every registered objective takes weights, the distillation ones
    included."""
    assert {name for name, _ in WEIGHTED} == set(weighable_objectives()) == set(SPECS)
    assert not REFUSING


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_logits_route_equals_from_hidden(name: str, path: str, reduction: str) -> None:
    d = inputs()
    fn = build(name, path, reduction=reduction)
    a, grads_a = on_logits(fn, d, loss_weights=d["weights"])
    b, grads_b = on_hidden(fn, d, loss_weights=d["weights"])
    assert_same_call(a, grads_a, b, grads_b)
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
    assert_same_call(a, grads_a, b, grads_b)


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


WEIGHABLE = sorted({name for name, _ in WEIGHTED})


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("name", WEIGHABLE)
def test_bad_weights_are_a_clear_error(name: str, bad: str, route: str) -> None:
    """The one check of every weighted objective (``check_loss_weights`` for the type and
    shape, the engine's host sync for the values): the same one-line error, no gradient."""
    weights, message = BAD[bad]
    d = inputs(5)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    fn = build(name)
    kw = seeded(fn, {"loss_weights": weights})
    with pytest.raises(ValueError, match=message) as err:
        if route == "logits":
            fn(h @ w.T + b, d["labels"], **kw)
        elif not fn.has_from_hidden:
            pytest.skip(f"{type(fn).__name__} has no from-hidden path")
        else:
            fn.from_hidden(h, w, d["labels"], b, **kw)
    assert "\n" not in str(err.value)
    assert h.grad is None and w.grad is None


@pytest.mark.parametrize("name", REFUSING or ["ce"])
def test_objectives_without_weights_refuse_by_name(name: str) -> None:
    """An objective that does not declare ``takes_loss_weights`` refuses them by name (every
    registered one declares it now: CE with the declaration turned off stands in)."""
    fn = build(name)
    if name not in REFUSING:
        fn.takes_loss_weights = False  # this instance only
    d = inputs(6)
    logits = d["hidden"] @ d["weight"].T
    teacher = {"teacher_logits": torch.zeros_like(logits)} if fn.needs_teacher else {}
    match = f"{type(fn).__name__} takes no loss_weights"
    with pytest.raises(NotImplementedError, match=match):
        fn(logits, d["labels"], loss_weights=d["weights"], **teacher)
    if fn.has_from_hidden:
        with pytest.raises(NotImplementedError, match=match):
            fn.from_hidden(d["hidden"], d["weight"], d["labels"], loss_weights=d["weights"])


# ---------------------------------------------------------------------------------------------
# EMO: w_t·L_t with L_t the per-token mix of CE_t and DEMD_t (its ratio per token)
# ---------------------------------------------------------------------------------------------


def emo_per_token(fn: nn.Module, z: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """L_t token by token (EMO Eq. 14, 19; emo2: DEMD + sg(DEMD/CE)·CE), 0 where ignored."""
    e = fn.cost_embedding_normalized.to(z.dtype)
    out = []
    for t in range(y.numel()):
        if int(y[t]) == -100:
            out.append(z.new_zeros(()))
            continue
        log_q = torch.log_softmax(z[t], dim=-1)
        ce = -log_q[y[t]]
        demd = 1.0 - (log_q.exp() * (e @ e[y[t]])).sum()
        if fn.mode == "emo1":
            ratio = (ce / (demd.clamp_min(0.0) + 1e-10)).detach()
            out.append(0.5 * (ce + ratio * demd))
        elif fn.mode == "emo2":
            out.append(demd + (demd / (ce + 1e-10)).detach() * ce)
        else:
            out.append(ce + fn.mu * demd)
    return out


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("path", sorted(SPECS["emo"].paths))
def test_emo_equals_hand_written_reference(path: str, reduction: str, route: str) -> None:
    """Σ w_t·L_t (/ Σ w_t for "mean"), "ce" and "demd" the same weighted means."""
    d = inputs(8)
    fn = build("emo", path, reduction=reduction)
    got, grads = ROUTES[route](fn, d, loss_weights=d["weights"])
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    y, wt = d["labels"].reshape(-1), d["weights"].reshape(-1)
    per = emo_per_token(fn, (h @ w.T + b).reshape(-1, V), y)
    total = sum(wt[t] * per[t] for t in range(y.numel()))
    n = wt[y != -100].sum()
    expected = total if reduction == "sum" else total / n
    expected.backward()
    torch.testing.assert_close(got.loss, expected)
    for g, ref in zip(grads, [h.grad, w.grad, b.grad], strict=True):
        torch.testing.assert_close(g, ref)
    torch.testing.assert_close(got.components["n_tokens"], n)
    ce = F.cross_entropy((d["hidden"] @ d["weight"].T + d["bias"]).reshape(-1, V), y,
                         reduction="none", ignore_index=-100)
    torch.testing.assert_close(got.components["ce"], (ce * wt).sum() / n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("path", sorted(SPECS["emo_distill"].paths))
def test_emo_distill_equals_hand_written_reference(path: str, reduction: str) -> None:
    """Σ w_t·L_t (/ Σ w_t), L_t the unweighted reference's loss of token t alone."""
    d = inputs(12)
    fn = build("emo_distill", path, reduction=reduction)
    got, grads = on_logits(fn, d, loss_weights=d["weights"])
    teacher = seeded(fn, {})["teacher_logits"].reshape(-1, V)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    z, y, wt = (h @ w.T + b).reshape(-1, V), d["labels"].reshape(-1), d["weights"].reshape(-1)
    opts = SPECS["emo_distill"].paths[path]
    ref = build("emo_distill", reduction="sum", implementation="reference",
                **{k: v for k, v in opts.items() if k not in ("implementation", "chunk_size")})
    total = z.sum() * 0.0
    for t in range(y.numel()):
        if int(y[t]) != -100:
            one = ref(z[t : t + 1], y[t : t + 1], teacher_logits=teacher[t : t + 1]).loss
            total = total + wt[t] * one
    n = wt[y != -100].sum()
    expected = total if reduction == "sum" else total / n
    expected.backward()
    torch.testing.assert_close(got.loss, expected)
    for g, r in zip(grads, [h.grad, w.grad, b.grad], strict=True):
        torch.testing.assert_close(g, r)
    torch.testing.assert_close(got.components["n_tokens"], n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("alpha", "temperature"), [(0.3, 2.5), (1.0, 0.5), (0.0, 3.0)])
def test_kl_distill_equals_hand_written_reference(
    alpha: float, temperature: float, reduction: str
) -> None:
    """Σ w_t·L_t (/ Σ w_t over the counted tokens), L_t = (1-α)·CE_t + α·τ²·KL(p_τ ‖ q_τ)_t
    written out in float64 (log-softmax by hand, τ ≠ 1): loss, gradients, components."""
    d = inputs(13)
    fn = build("kl_distill", alpha=alpha, temperature=temperature, reduction=reduction)
    got, grads = on_logits(fn, d, loss_weights=d["weights"])
    u = seeded(fn, {})["teacher_logits"].reshape(-1, V)
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    z, y, wt = (h @ w.T + b).reshape(-1, V), d["labels"].reshape(-1), d["weights"].reshape(-1)
    keep = y != -100

    def log_softmax(x: torch.Tensor) -> torch.Tensor:
        return x - torch.log(torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)) \
            - x.amax(-1, keepdim=True)

    ce = -log_softmax(z).gather(1, torch.where(keep, y, 0)[:, None]).squeeze(1)
    log_p, log_q = log_softmax(u / temperature), log_softmax(z / temperature)
    kl = temperature**2 * (log_p.exp() * (log_p - log_q)).sum(-1)
    per = torch.where(keep, (1.0 - alpha) * ce + alpha * kl, 0.0)
    n = wt[keep].sum()
    total = (wt * per).sum()
    expected = total if reduction == "sum" else total / n
    expected.backward()
    assert got.loss.dtype == F64
    torch.testing.assert_close(got.loss, expected)
    for g, r in zip(grads, [h.grad, w.grad, b.grad], strict=True):
        torch.testing.assert_close(g, r)
    torch.testing.assert_close(got.components["n_tokens"], n)
    torch.testing.assert_close(got.components["ce"], (wt * torch.where(keep, ce, 0.0)).sum() / n)
    torch.testing.assert_close(got.components["kl"], (wt * torch.where(keep, kl, 0.0)).sum() / n)
    unweighted, _ = on_logits(fn, d)
    assert not torch.allclose(got.loss, unweighted.loss)


# ---------------------------------------------------------------------------------------------
# NTIL and digit EMD: weight 0 is an ignored label before the spans; token terms weighted by
# w_m, number terms by the number's mean weight
# ---------------------------------------------------------------------------------------------

TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB_TOKENS)}
#: Three rows with numbers of several tokens (a decimal, a multi-digit run, a signed one).
NUMBER_ROWS = [
    ["1", "2", "3", ".", "4", "Ġ45"],
    ["Ġ1", "2", "b", "7", "12", "34"],
    [None, "-", "5", "9", "0", "0"],
]


def number_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`inputs` with labels of numbers, weights in [0.2, 2) and two zeros inside
    numbers ('2' of 123.4, the first '0' of 5900)."""
    d = inputs(seed)
    d["labels"] = torch.tensor(
        [[-100 if tok is None else TOKEN_ID[tok] for tok in row] for row in NUMBER_ROWS]
    )
    gen = torch.Generator().manual_seed(seed + 100)
    d["weights"] = 0.2 + 1.8 * torch.rand(B, T, generator=gen, dtype=F64)
    d["weights"][0, 1] = d["weights"][2, 4] = 0.0
    return d


NTIL_CASES = {
    "stable": {},
    "paper": {"preset": "paper"},
    "official": {"preset": "official"},
    "token-static": {"averaging": "token", "mix": "static"},
    "row-per-number": {"averaging": "row", "per_number": True},
}


def ntil_reference(fn: NTILLoss, z: torch.Tensor, d: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weighted NTIL loss by hand: weight-0 labels ignored, CE and the token-level EMD
    weighted by w, the number-level terms by each number's mean weight, averaged in loops.
    Per-item values come from the unweighted building blocks: W·EMD per token from
    ``weighted_digit_emd``, a number's relative / magnitude deviation from the unweighted
    reference loss with that number alone in its ``number_mask``."""
    s = fn.settings
    y = d["labels"].masked_fill(d["weights"] == 0, -100)
    flat_y, wt = y.reshape(-1), d["weights"].reshape(-1)
    zf = z.reshape(-1, V)
    counted = [t for t in range(flat_y.numel()) if int(flat_y[t]) != -100]
    n = sum(wt[t] for t in counted)
    ce_t = F.cross_entropy(zf, flat_y, reduction="none", ignore_index=-100)
    ce = sum(wt[t] * ce_t[t] for t in counted) / n
    spans = resolve_spans(y, VOCAB, fn.span_options)
    cands = class_candidates(VOCAB, spans)
    zc = zf[spans.flat_index[:, None], cands.ids].double()
    sigma = 0.0 if s.per_number else s.sigma
    emd_m = weighted_digit_emd(zc, cands.mask, cands.values, spans.gold_column,
                               spans.num_digits, spans.digits_right, sigma)
    members = [[m for m in range(spans.n_tokens) if int(spans.number_id[m]) == k]
               for k in range(spans.n_numbers)]
    w_m = [wt[int(spans.flat_index[m])] for m in range(spans.n_tokens)]
    omega = [sum(w_m[m] for m in ms) / len(ms) for ms in members]
    row_of_number = [int(r) for r in spans.number_row]
    ce_unweighted = F.cross_entropy(zf, flat_y, ignore_index=-100)
    deviation = {}
    for name, (alpha, beta) in {"relative": (1.0, 0.0), "magnitude": (0.0, 1.0)}.items():
        alone = NTILLoss(VOCAB, preset=fn.preset, mix="static", lam=1.0, emd_weight=0.0,
                         alpha=alpha, beta=beta, value_mode=s.value_mode, averaging="batch",
                         smoothing=s.smoothing, magnitude_floor=s.magnitude_floor,
                         implementation="reference")
        values = []
        for ms in members:
            mask = torch.zeros(B * T, dtype=torch.bool)
            mask[spans.flat_index[ms]] = True
            out = alone(z, y, number_mask=mask.view(B, T))
            values.append(out.loss - ce_unweighted)
        deviation[name] = values

    def average(items: list[tuple[Any, Any, int]]) -> Any:
        """(value, weight, row) items, averaged as ``s.averaging`` asks, by hand."""
        if s.averaging == "token":
            return sum(w * v for v, w, _ in items) / n
        if s.averaging == "batch":
            norm = sum(w for _, w, _ in items)
            return sum(w * v for v, w, _ in items) / norm if items else z.sum() * 0.0
        rows = []
        for r in range(B):
            mine = [(v, w) for v, w, row in items if row == r]
            rows.append(sum(w * v for v, w in mine) / sum(w for _, w in mine) if mine else 0.0)
        return sum(rows) / B

    if s.per_number:
        per_number = []
        for ms in members:
            wr = [(1.0 + s.sigma) ** int(spans.digits_right[m]) * w_m[m] for m in ms]
            per_number.append(sum(a * emd_m[m] for a, m in zip(wr, ms, strict=True)) / sum(wr))
        emd = average(list(zip(per_number, omega, row_of_number, strict=True)))
    else:
        emd = average([(emd_m[m], w_m[m], row_of_number[int(spans.number_id[m])])
                       for m in range(spans.n_tokens)])
    rel = average(list(zip(deviation["relative"], omega, row_of_number, strict=True)))
    mag = average(list(zip(deviation["magnitude"], omega, row_of_number, strict=True)))
    ntil = s.emd_weight * emd + s.alpha * rel + s.beta * mag
    if s.mix == "static":
        coef = s.lam
    else:
        ratio = float(ce / (ntil + s.mix_eps)) if s.mix_eps else float(ce / ntil)
        coef = s.lam * (ratio if s.max_ratio is None else min(ratio, s.max_ratio))
    total = ce + coef * ntil
    return total if s.reduction == "mean" else n * total


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(NTIL_CASES))
def test_ntil_equals_hand_written_reference(case: str, reduction: str, route: str) -> None:
    """Loss and gradients of NTIL with weights (zeros inside numbers) == :func:`ntil_reference`."""
    d = number_inputs(9)
    fn = NTILLoss(VOCAB, value_mode="expected", reduction=reduction, **NTIL_CASES[case])
    got, grads = ROUTES[route](fn, d, loss_weights=d["weights"])
    h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    expected = ntil_reference(fn, h @ w.T + b, d)
    expected.backward()
    torch.testing.assert_close(got.loss, expected)
    for g, ref in zip(grads, [h.grad, w.grad, b.grad], strict=True):
        torch.testing.assert_close(g, ref)
    unweighted, _ = ROUTES[route](fn, d)
    assert not torch.allclose(got.loss, unweighted.loss)


NUMBER_OBJECTIVES = [
    *((cls, case, NTIL_CASES[case]) for cls in ("ntil", "emd") for case in sorted(NTIL_CASES)),
    *((name, path, SPECS[name].paths[path]) for name in ("ntl_mse", "ntl_was", "number_level")
      for path in sorted(SPECS[name].paths)),
]


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(("name", "case", "options"), NUMBER_OBJECTIVES,
                         ids=[f"{n}-{c}" for n, c, _ in NUMBER_OBJECTIVES])
def test_weight_zero_inside_a_number_equals_an_ignored_label(
    name: str, case: str, options: dict[str, Any], route: str
) -> None:
    """w = 0 at a digit inside a number == that label ignored: the number ends there (loss,
    components and gradients)."""
    d = number_inputs(10)
    fn = SPECS[name].cls(VOCAB, **options)
    ignored = d["labels"].masked_fill(d["weights"] == 0, -100)
    a, grads_a = ROUTES[route](fn, d, loss_weights=d["weights"])
    b, grads_b = ROUTES[route](fn, d, labels=ignored, loss_weights=d["weights"])
    assert_same_call(a, grads_a, b, grads_b)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(("name", "path"), WEIGHTED)
def test_weights_keep_one_host_sync(name: str, path: str, route: str) -> None:
    """The weights' value check (and the number objectives' sizes) are read in the engine's
    one host sync of the call."""
    d = number_inputs(7)
    fn = build(name, path)
    ROUTES[route](fn, d, loss_weights=d["weights"])  # warm
    with SyncCounter() as counter:
        ROUTES[route](fn, d, loss_weights=d["weights"])
    assert counter.total <= 1, dict(counter.where)
