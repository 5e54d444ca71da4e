"""CrossEntropyLoss's options (label smoothing, z-loss, token accuracy, entropy) against torch and
Liger-Kernel's definitions restated, equal on the logits path and from hidden states, float64
gradcheck; the defaults are today's CE exactly."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import emdlm.ops.chunked
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.ops.chunked import chunked_linear_loss

F64 = torch.float64


def _case(seed: int, dtype: torch.dtype = F64, vocab: int = 13):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(3, 6, vocab, generator=gen, dtype=F64)
    labels = torch.randint(0, vocab, (3, 6), generator=gen)
    labels[0, 3:] = -100
    labels[2, 1] = -100
    return logits.to(dtype), labels


def _liger(logits: torch.Tensor, labels: torch.Tensor, eps: float, s: float):
    """Liger-Kernel ops/cross_entropy.py, per non-ignored row (its kernel comments):
    loss = (1−ε)(lse − x_y) + (−Σ_i ε/V·x_i + ε·lse) + s·lse², reduction "mean" over the
    non-ignored rows; z_loss = s·lse² (same mean); dx = ((1 + 2s·lse)·softmax − ε/V
    − (1−ε)·onehot) / n."""
    flat, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    keep = y != -100
    x, y = flat[keep], y[keep]
    vocab, n = x.shape[-1], x.shape[0]
    lse = torch.logsumexp(x, -1)
    x_y = x.gather(1, y.unsqueeze(1)).squeeze(1)
    smooth = -(eps / vocab) * x.sum(-1) + eps * lse
    loss = (1 - eps) * (lse - x_y) + smooth + s * lse * lse
    soft = torch.softmax(x, -1)
    grad = (1 + 2 * s * lse).unsqueeze(1) * soft - eps / vocab
    grad = grad - (1 - eps) * F.one_hot(y, vocab).to(x.dtype)
    full = torch.zeros_like(flat)
    full[keep] = grad / n
    return loss.sum() / n, (s * lse * lse).sum() / n, full.view_as(logits)


def test_defaults_are_todays_ce_exactly() -> None:
    logits, labels = _case(0, torch.float32)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = CrossEntropyLoss()(x1, labels)
    want = F.cross_entropy(x2.reshape(-1, 13), labels.reshape(-1))
    assert torch.equal(out.loss, want)
    assert set(out.components) == {"ce", "n_tokens"}
    out.loss.backward()
    want.backward()
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize(("eps", "s"), [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3), (1.0, 0.0)])
def test_equals_liger_definitions(eps: float, s: float) -> None:
    logits, labels = _case(1)
    x = logits.clone().requires_grad_()
    out = CrossEntropyLoss(label_smoothing=eps, z_loss=s)(x, labels)
    loss, z_loss, grad = _liger(logits, labels, eps, s)
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-14)
    out.loss.backward()
    torch.testing.assert_close(x.grad, grad, rtol=1e-10, atol=1e-14)
    if s > 0:
        torch.testing.assert_close(out.components["z_loss"], z_loss, rtol=1e-12, atol=0)
    else:
        assert "z_loss" not in out.components


def test_label_smoothing_equals_torch() -> None:
    logits, labels = _case(2)
    for eps in (0.05, 0.3):
        x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = CrossEntropyLoss(label_smoothing=eps, reduction="sum")(x1, labels)
        want = F.cross_entropy(
            x2.reshape(-1, 13), labels.reshape(-1), label_smoothing=eps, reduction="sum"
        )
        torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
        out.loss.backward()
        want.backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-14)
        # "ce" stays the plain CE
        plain = F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1))
        torch.testing.assert_close(out.components["ce"], plain, rtol=1e-12, atol=0)


def test_token_accuracy() -> None:
    """argmax == label over the counted tokens; a tie counts for the first maximal id."""
    z = torch.tensor([[[3.0, 1.0, 0.0], [0.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.0, 0.0, 5.0]]])
    labels = torch.tensor([[0, 2, 0, -100]])  # right, tie lost to id 1, tie won by id 0
    out = CrossEntropyLoss(token_accuracy=True)(z, labels)
    assert float(out.components["token_accuracy"]) == pytest.approx(2 / 3)
    hidden = CrossEntropyLoss(token_accuracy=True).from_hidden(z, torch.eye(3), labels)
    assert float(hidden.components["token_accuracy"]) == pytest.approx(2 / 3)
    none = CrossEntropyLoss(token_accuracy=True)(z, torch.full((1, 4), -100))
    assert float(none.components["token_accuracy"]) == 0.0


def _entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over the counted tokens of −Σ_v q_v·log q_v, one token at a time in float64
    (0·log 0 taken as 0)."""
    total, count = 0.0, 0
    for row, label in zip(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1),
                          strict=True):
        if int(label) == -100:
            continue
        q = torch.softmax(row, dim=0)
        total += -sum(float(p) * float(torch.log(p)) for p in q if float(p) > 0.0)
        count += 1
    return total / max(count, 1)


def test_entropy_equals_a_hand_reference_on_every_route() -> None:
    """"entropy" is the mean predicted-distribution entropy over counted tokens: a uniform
    row over V ids is log V, a one-hot-like row ~0; equal to the token-by-token float64
    reference on the logits route, from hidden states (chunks of 4 rows, e = exp(z − max)) and
    through chunked_logits_loss (given logits, e = q); a −inf logit and NaN in an ignored row
    add nothing; no counted token gives 0."""
    from emdlm.ops.chunked import HeadOptions, chunked_logits_loss
    from emdlm.ops.objectives.ce import WeightedCEObjective

    logits, labels = _case(7)
    logits[1, 0] = 0.0  # uniform: log 13
    logits[1, 1] = 0.0
    logits[1, 1, 4] = 80.0  # almost one-hot
    logits[2, 2, 5] = float("-inf")
    want = _entropy_reference(logits, labels)
    uniform = torch.zeros(1, 1, 13, dtype=F64)
    out = CrossEntropyLoss(entropy=True)(uniform, torch.tensor([[3]]))
    assert float(out.components["entropy"]) == pytest.approx(float(torch.log(torch.tensor(13.0))))
    fn = CrossEntropyLoss(entropy=True)
    padded = logits.clone()
    padded[0, 3:] = float("nan")  # the ignored positions
    got = fn(padded, labels).components["entropy"]
    assert float(got) == pytest.approx(want, rel=1e-12)
    chunked = chunked_logits_loss(
        padded, labels, WeightedCEObjective(entropy=True), HeadOptions(chunk_size=4)
    )
    assert float(chunked.components["entropy"]) == pytest.approx(want, rel=1e-12)
    finite = torch.where(torch.isfinite(logits), logits, -1e4)  # the head cannot give -inf
    eye = torch.eye(13, dtype=F64)
    hidden = fn.from_hidden(finite, eye, labels, chunk_size=4).components["entropy"]
    assert float(hidden) == pytest.approx(want, rel=1e-10)
    assert float(fn(logits, torch.full_like(labels, -100)).components["entropy"]) == 0.0
    assert "entropy" not in CrossEntropyLoss()(logits, labels).components


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("eps", "s"), [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
def test_from_hidden_equals_logits(eps: float, s: float, reduction: str) -> None:
    gen = torch.Generator().manual_seed(3)
    # float64: the chunked path sums in another order; float32 agreement would depend on the BLAS
    f64 = torch.float64
    h0 = torch.randn(3, 6, 8, generator=gen, dtype=f64)
    w0, b0 = torch.randn(13, 8, generator=gen, dtype=f64), None
    _, labels = _case(3)
    fn = CrossEntropyLoss(
        label_smoothing=eps, z_loss=s, token_accuracy=True, entropy=True, reduction=reduction
    )
    results = []
    for path in ("hidden", "logits"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn.from_hidden(h, w, labels, b0, chunk_size=4) if path == "hidden" else fn(
            h @ w.T, labels
        )
        (2 * out.loss).backward()
        results.append((out, h.grad, w.grad))
    (got, gh, gw), (want, rh, rw) = results
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)
    assert got.components.keys() == want.components.keys()
    for k in got.components:
        assert float(got.components[k]) == pytest.approx(float(want.components[k]), rel=1e-10), k


def test_gradcheck_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    keep = functools.partial(chunked_linear_loss, inplace_backward=False)
    monkeypatch.setattr(emdlm.ops.chunked, "chunked_linear_loss", keep)
    logits, labels = _case(4, vocab=7)
    y = labels[:2, :4]
    fn = CrossEntropyLoss(label_smoothing=0.2, z_loss=0.05)
    x = logits[:2, :4].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: fn(z, y).loss, (x,))
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 4, 5, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(7, 5, generator=gen, dtype=F64, requires_grad=True)

    def hidden(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fn.from_hidden(a, b, y, chunk_size=3, softcap=3.0, logit_scale=1.5).loss

    assert torch.autograd.gradcheck(hidden, (h, w))


def test_nan_padding_and_half_precision() -> None:
    fn = CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3, token_accuracy=True, entropy=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits, labels = _case(6, torch.float32)
        logits[0, 3:] = float("nan")  # the ignored positions
        x = logits.to(dtype).requires_grad_()
        out = fn(x, labels)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
        assert torch.isfinite(out.components["entropy"])
        assert torch.equal(x.grad[0, 3:], torch.zeros_like(x.grad[0, 3:]))


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="label_smoothing"):
        CrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss"):
        CrossEntropyLoss(z_loss=-1.0)


def _hand_argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The predicted token at each position, one position at a time: the lowest id whose logit
    is the row's maximum; -100 where the label is ignored."""
    out = torch.full(labels.shape, -100, dtype=torch.long)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in labels.shape]):
        pos = tuple(int(i) for i in index)
        if int(labels[pos]) == -100:
            continue
        row = logits[pos].tolist()
        out[pos] = row.index(max(row))
    return out


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_predicted_tokens_equal_a_hand_argmax_on_every_route(dtype: torch.dtype) -> None:
    """``out.predicted_tokens``: the argmax id per position (labels' shape, -100 where ignored)
    on the logits route (with and without options), through the chunk engine (per-token
    weights), and from hidden states (chunks of 4 rows, a bias, a soft-cap), equal to a hand
    argmax of the same logits; not asked: None.

    In bf16 the unfused head (``F.linear`` over [B, T, H]) and the fused one (``addmm`` per
    chunk) may round a logit differently, so there each route is held to the hand argmax of
    its own logits (the fused one's: :func:`head_logits`, the engine's head)."""
    from emdlm.ops.chunked import HeadOptions, head_logits

    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(3, 6, 8, generator=gen, dtype=F64).to(dtype)
    weight = torch.randn(13, 8, generator=gen, dtype=F64).to(dtype)
    bias = torch.randn(13, generator=gen, dtype=F64).to(dtype)
    _, labels = _case(5)
    logits = F.linear(hidden, weight, bias)  # the unfused head, as a model computes it
    want = _hand_argmax(logits.float(), labels)
    fused_logits = head_logits(hidden.reshape(-1, 8), weight, bias, HeadOptions()).view(3, 6, 13)
    want_fused = _hand_argmax(fused_logits.float(), labels)
    if dtype != torch.bfloat16:
        assert torch.equal(want_fused, want)  # the same logits, so the same argmax
    assert int((want != -100).sum()) == int((labels != -100).sum())
    for options in ({}, {"label_smoothing": 0.1, "z_loss": 1e-3, "token_accuracy": True}):
        fn = CrossEntropyLoss(predicted_tokens=True, **options)
        got = fn(logits, labels).predicted_tokens
        assert got is not None and got.dtype == torch.long and got.shape == labels.shape
        assert torch.equal(got, want), options
        weighted = fn(logits, labels, loss_weights=torch.rand(labels.shape, generator=gen))
        assert torch.equal(weighted.predicted_tokens, want), options
        fused = fn.from_hidden(hidden, weight, labels, bias, chunk_size=4)
        assert torch.equal(fused.predicted_tokens, want_fused), options
    capped = CrossEntropyLoss(predicted_tokens=True).from_hidden(
        hidden, weight, labels, bias, softcap=2.0, chunk_size=4)
    z = head_logits(hidden.reshape(-1, 8), weight, bias, HeadOptions(softcap=2.0))
    assert torch.equal(capped.predicted_tokens, _hand_argmax(z.view(3, 6, 13), labels))
    assert CrossEntropyLoss()(logits, labels).predicted_tokens is None
    assert CrossEntropyLoss().from_hidden(hidden, weight, labels).predicted_tokens is None


def test_predicted_tokens_break_ties_at_the_first_id_as_torch_argmax() -> None:
    """Exact ties (integer logits, an embedding with two equal rows): the lowest id wins on
    every route, as ``torch.argmax``; a row of equal logits predicts id 0."""
    weight = torch.tensor([[0.0, 1.0], [2.0, 0.0], [1.0, 1.0], [2.0, 0.0], [0.0, 0.0]])  # 1 = 3
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [3.0, 1.0]]])
    labels = torch.tensor([[4, 4, 4, -100]])
    logits = hidden @ weight.T  # rows: ids 1 and 3 tie; all equal; ids 0 and 2 tie; ignored
    assert torch.equal(logits.argmax(-1)[:, :3], torch.tensor([[1, 0, 0]]))
    want = torch.tensor([[1, 0, 0, -100]])
    fn = CrossEntropyLoss(predicted_tokens=True)
    assert torch.equal(fn(logits, labels).predicted_tokens, want)
    assert torch.equal(fn.from_hidden(hidden, weight, labels, chunk_size=1).predicted_tokens, want)
    weighted = fn(logits, labels, loss_weights=torch.ones(1, 4))
    assert torch.equal(weighted.predicted_tokens, want)


def test_predicted_tokens_keep_one_host_sync_and_the_gradient() -> None:
    """Asking for predicted tokens changes neither the loss nor its gradients, and the fused
    route still syncs with the host once (the engine's label check)."""
    from emdlm.ops import chunked as engine

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=gen, dtype=F64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    plain = CrossEntropyLoss().from_hidden(hidden, weight, labels, chunk_size=3)
    g_plain = torch.autograd.grad(plain.loss, (hidden, weight))
    calls = []
    original = torch.Tensor.tolist

    def counting(self):
        calls.append(1)
        return original(self)

    torch.Tensor.tolist = counting
    try:
        asked = CrossEntropyLoss(predicted_tokens=True).from_hidden(
            hidden, weight, labels, chunk_size=3)
    finally:
        torch.Tensor.tolist = original
    assert len(calls) == 1 and engine.DEFAULT_CHUNK_ELEMENTS > 0
    g_asked = torch.autograd.grad(asked.loss, (hidden, weight))
    assert torch.equal(asked.loss, plain.loss)
    for a, b in zip(g_asked, g_plain, strict=True):
        assert torch.equal(a, b)
