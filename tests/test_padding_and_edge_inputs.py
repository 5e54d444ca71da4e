"""Padding never leaks, and empty batches give an explicit 0.

For every registered objective and every implementation path: NaN, an all −inf row or a +inf
logit at IGNORED positions must give the same finite loss as clean logits, the same gradients on
the counted positions, and an exact 0 gradient on the ignored ones (0·NaN = NaN: masks must be
``where`` / fills, never multiplies). A time dimension of 0 and a batch of 0 give a loss of
exactly 0 with a zero, finite gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from _objectives import PATHS, SPECS, random_cost_embedding
from emdlm.functional._common import log_softmax_zero_ignored
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo import EMOLoss

BAD_FILLS = ("nan", "-inf_row", "+inf")
WIDTH = 12  # cost-embedding width for EMO


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(3)


def _emo_embedding(vocab: int) -> torch.Tensor:
    return random_cost_embedding(vocab, WIDTH, seed=1)


def _build(name: str, path: str | None, tokenizer: Any, vocab: int, **kw: Any) -> nn.Module:
    """Objective ``name`` on implementation path / preset ``path`` (tests/_objectives.py) for
    ``vocab`` logit rows, called as ``fn(logits, labels)`` (a distillation objective gets fixed
    teacher logits); noise (NTIL's Gumbel values) from a generator seeded alike every build."""
    spec = SPECS[name]
    if spec.draws_noise:
        kw["generator"] = _seeded()
    emb = _emo_embedding(vocab) if spec.needs_cost_embedding else None
    return spec.build(path, digits=tokenizer, cost_embedding=emb, fixed_teacher=True, **kw)


# (objective, path): every implementation path / preset of every registered objective
CASES = PATHS


def test_every_registered_objective_is_covered() -> None:
    """A new objective in the registry gets its padding / empty-input cases here: every entry
    of tests/_objectives.py (checked against the registry in test_objective_registry.py) has
    its paths among the cases."""
    assert {name for name, _ in CASES} == set(SPECS)


def _batch(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [3, 11] with numbers and ignored positions (prompt, right padding, a whole row)."""
    rows = ["12+34=46.5", "7*8=-56", "x"]
    labels = torch.full((3, 11), -100, dtype=torch.long)
    for r, text in enumerate(rows):
        ids = tokenizer.convert_tokens_to_ids(list(text))
        labels[r, : len(ids)] = torch.tensor(ids)
    labels[0, :5] = -100  # prompt "12+34" is not scored
    labels[2] = -100  # an all-ignored row
    vocab = len(tokenizer)
    logits = torch.randn(3, 11, vocab, generator=torch.Generator().manual_seed(0))
    return logits, labels


def _dirty(logits: torch.Tensor, ignored: torch.Tensor, fill: str) -> torch.Tensor:
    out = logits.clone()
    if fill == "nan":
        out[ignored] = float("nan")
    elif fill == "-inf_row":
        out[ignored] = float("-inf")
    else:  # one +inf logit per ignored row: softmax gives inf/inf = NaN there
        out[ignored, 3] = float("inf")
    return out


def _run(fn: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any]:
    x = logits.clone().requires_grad_(True)
    out = fn(x, labels)
    (2 * out.loss).backward()  # grad_output != 1
    return out.loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", BAD_FILLS)
@pytest.mark.parametrize(("name", "path"), CASES)
def test_non_finite_logits_at_ignored_positions_do_not_leak(
    char_tokenizer: Any, name: str, path: str, fill: str, dtype: torch.dtype
) -> None:
    logits, labels = _batch(char_tokenizer)
    logits = logits.to(dtype)
    ignored = labels == -100
    vocab = logits.shape[-1]
    clean_loss, clean_grad = _run(_build(name, path, char_tokenizer, vocab), logits, labels)
    loss, grad = _run(
        _build(name, path, char_tokenizer, vocab), _dirty(logits, ignored, fill), labels
    )
    assert torch.isfinite(clean_loss) and clean_loss > 0
    # Rows are computed independently: padding must not change a single bit elsewhere (up to
    # float32 summation order).
    torch.testing.assert_close(loss, clean_loss, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(grad).all(), f"{name}/{path}: non-finite gradient with {fill} padding"
    assert grad.dtype == dtype
    torch.testing.assert_close(grad[~ignored], clean_grad[~ignored], rtol=1e-6, atol=1e-7)
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert bool(clean_grad[~ignored].abs().sum() > 0)  # the counted rows do get a gradient


@pytest.mark.parametrize("fill", BAD_FILLS)
def test_emo_from_hidden_ignores_non_finite_hidden_at_padding(fill: str) -> None:
    """EMOLoss.from_hidden: a NaN / inf hidden state at a padding position changes nothing."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden_size = 23, 8
    hidden = torch.randn(2, 7, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (2, 7), generator=gen)
    labels[0, :3] = -100
    labels[1, 5:] = -100
    ignored = labels == -100
    fn = EMOLoss(_emo_embedding(vocab), chunk_size=4)

    def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hx, wx = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fn.from_hidden(hx, wx, labels)
        (2 * out.loss).backward()
        return out.loss.detach(), hx.grad, wx.grad

    dirty = _dirty(hidden, ignored, fill)
    clean_loss, clean_gh, clean_gw = run(hidden)
    loss, gh, gw = run(dirty)
    torch.testing.assert_close(loss, clean_loss)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(gw, clean_gw)
    torch.testing.assert_close(gh[~ignored], clean_gh[~ignored])
    assert torch.equal(gh[ignored], torch.zeros_like(gh[ignored]))


@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (0, 0)], ids=["T=0", "B=0", "B=T=0"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), CASES)
def test_empty_batch_gives_explicit_zero(
    char_tokenizer: Any, name: str, path: str, reduction: str, shape: tuple[int, int]
) -> None:
    vocab = len(char_tokenizer)
    fn = _build(name, path, char_tokenizer, vocab, reduction=reduction)
    x = torch.randn(*shape, vocab, requires_grad=True)
    labels = torch.zeros(shape, dtype=torch.long)
    out = fn(x, labels)
    assert out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert int(out.components["n_tokens"]) == 0


@pytest.mark.parametrize(("name", "path"), CASES)
def test_float64_logits_give_a_float64_loss(char_tokenizer: Any, name: str, path: str) -> None:
    """Every objective keeps float64 (compute-dtype rule); CE used to return float32."""
    logits, labels = _batch(char_tokenizer)
    fn = _build(name, path, char_tokenizer, logits.shape[-1])
    x = logits.double().requires_grad_(True)
    out = fn(x, labels)
    assert out.loss.dtype == torch.float64
    out.loss.backward()
    assert x.grad is not None and x.grad.dtype == torch.float64


def test_cross_entropy_float64_matches_torch_in_float64(char_tokenizer: Any) -> None:
    logits, labels = _batch(char_tokenizer)
    x = logits.double()
    got = CrossEntropyLoss()(x, labels).loss
    want = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


def test_log_softmax_zero_ignored_gradient() -> None:
    """The custom backward is torch's log-softmax backward with ignored rows set to 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    valid = torch.tensor([True, False, True, True, False])
    weights = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    a = x.clone().requires_grad_(True)
    (log_softmax_zero_ignored(a, valid) * weights).sum().backward()
    b = x.clone().requires_grad_(True)
    (torch.log_softmax(b, -1) * weights).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad[valid], b.grad[valid], rtol=1e-14, atol=0)
    assert torch.equal(a.grad[~valid], torch.zeros(2, 7, dtype=torch.float64))
    # With every row counted it is log_softmax, gradient included (gradcheck in float64).
    all_rows = torch.ones(5, dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda t: log_softmax_zero_ignored(t, all_rows), (x.clone().requires_grad_(True),)
    )
    # Without autograd it is plain log_softmax.
    torch.testing.assert_close(log_softmax_zero_ignored(x, valid), torch.log_softmax(x, -1))


@pytest.mark.parametrize("name", [name for name, spec in SPECS.items() if spec.needs_digits])
def test_numeric_losses_with_other_label_ranks(char_tokenizer: Any, name: str) -> None:
    """1-D labels [0] and 3-D labels [B, C, 0] (T = 0) also give an explicit 0 (the class
    defaults: NTIL's fused path)."""
    vocab = len(char_tokenizer)
    for shape in ((0,), (2, 3, 0)):
        fn = _build(name, None, char_tokenizer, vocab)
        x = torch.randn(*shape, vocab, requires_grad=True)
        out = fn(x, torch.zeros(shape, dtype=torch.long))
        assert float(out.loss.detach()) == 0.0
        out.loss.backward()
        assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
@pytest.mark.parametrize(("name", "path"), CASES)
def test_narrow_integer_labels_equal_int64_labels(
    gpt2_tokenizer: Any, name: str, path: str, dtype: torch.dtype
) -> None:
    """Valid labels in any accepted integer dtype give the int64 loss and gradient at a real
    vocabulary size (GPT-2, V = 50257). The range check once compared in the labels' dtype,
    where V wraps (int16: 50257 -> -15279, int8 / uint8: -> 81): valid labels were "out of
    range". uint8 cannot hold ignore_index = -100, so its rows are scored in full."""
    vocab = len(gpt2_tokenizer)
    info = torch.iinfo(dtype)
    # char-level ids of "12+34=46" (digits 15-24), plus a token above 81 that fits the dtype
    ids = gpt2_tokenizer.convert_tokens_to_ids(list("12+34=46"))
    high = 3510 if info.max >= 3510 else 100  # GPT-2 " 46"-like multi-digit token / 'd'
    labels = torch.tensor([[*ids, high], [high, *reversed(ids)]])
    if info.min <= -100:
        labels[0, :3] = -100  # the prompt "12+" is not scored
    logits = torch.randn(2, labels.shape[1], vocab, generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grad = _run(_build(name, path, gpt2_tokenizer, vocab), logits, labels)
    loss, grad = _run(_build(name, path, gpt2_tokenizer, vocab), logits, labels.to(dtype))
    assert torch.isfinite(ref_loss) and ref_loss > 0
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
