"""TaiLr (both presets) and MixCE against the official codes' semantics (restated here as plain
references), hand-worked numbers, closed-form gradients, gradcheck and properties.

What every registered objective must do (padding never leaks, an all-ignored batch is an exact
0, "sum" = "mean" x count, exact gradient accumulation, from-hidden and compiled paths) is
checked for both presets of TaiLr and for MixCE in tests/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch

from emdlm.functional.mixce import mixce_loss
from emdlm.functional.tailr import tailr_loss
from emdlm.losses.mixce import MixCELoss
from emdlm.losses.tailr import TaiLrLoss

F64 = torch.float64


def _case(seed: int, dtype: torch.dtype = F64, vocab: int = 23):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(3, 8, vocab, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (3, 8), generator=gen)
    labels[0, 5:] = -100
    labels[2, 0] = -100
    return logits, labels


# --- plain references restating the official codes (not the library's code path) ------------


def _fairseq_tailr(logits, labels, eps, min_weight, gamma):
    """thu-coai/TaiLr fairseq/criterions/tailr.py: weight from the model's softmax probability
    of the target, log-space ratio, clamp; (1-eps)*sum(w*nll) + eps/V*sum(smooth); divided by
    the token count (fairseq's sample_size)."""
    flat = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1, 1)
    pad = target.eq(-100)
    safe = target.clamp_min(0)
    lprobs = torch.softmax(flat, -1).log()
    nll = (-lprobs.gather(-1, safe)).masked_fill(pad, 0.0)
    smooth = (-lprobs.sum(-1, keepdim=True)).masked_fill(pad, 0.0)
    with torch.no_grad():
        w = torch.softmax(flat, -1).gather(-1, safe)
        w = (w.log() - (gamma + (1 - gamma) * w).log()).exp().clamp(min_weight, 1.0)
    loss = (1.0 - eps) * (w * nll).sum() + eps / flat.shape[-1] * smooth.sum()
    return loss / (~pad).sum()


def _drsy_emo_tvd(logits, labels, ratio):
    """DRSY/EMO language_modeling/gpt2.py 'tvd' branch (unshifted inputs)."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    mask = (flat_labels != -100).to(flat.dtype)
    mle = torch.nn.functional.cross_entropy(flat, flat_labels, reduction="none")
    with torch.no_grad():
        q = torch.exp(-mle.detach())
    weight = torch.clamp(q / ((1 - ratio) + ratio * q), min=0.2, max=1.0)
    mle = ratio * mle + (1.0 - ratio) * weight * mle
    return (mle * mask).sum() / (1e-15 + mask.sum())


def _bloomberg_mixce(logits, labels, ratio):
    """bloomberg/MixCE-acl2023 gpt2.py (unshifted inputs)."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    mask = (flat_labels != -100).to(flat.dtype)
    mle = torch.nn.functional.cross_entropy(flat, flat_labels, reduction="none")
    with torch.no_grad():
        q = torch.exp(-mle.detach())
    mle = ratio * mle + (1.0 - ratio) * q * mle
    return (mle * mask).sum() / (1e-15 + mask.sum())


def _compare(ours_fn, ref_fn, logits, tol):
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ours, ref = ours_fn(a), ref_fn(b)
    (2.0 * ours).backward()
    (2.0 * ref).backward()
    torch.testing.assert_close(ours.to(F64), ref.to(F64), rtol=tol, atol=tol)
    torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


TOLS = [(F64, 1e-12), (torch.float32, 1e-5)]


@pytest.mark.parametrize(("dtype", "tol"), TOLS, ids=["f64", "f32"])
@pytest.mark.parametrize(
    ("eps", "min_weight", "gamma"), [(0.0, 0.2, 1e-7), (0.1, 0.2, 1e-7), (0.0, 0.0, 0.5)]
)
def test_tailr_paper_matches_official_criterion(dtype, tol, eps, min_weight, gamma) -> None:
    for seed in range(3):
        logits, labels = _case(seed, dtype)
        _compare(
            lambda z, labels=labels: (
                tailr_loss(z, labels, gamma=gamma, min_weight=min_weight, label_smoothing=eps).loss
            ),
            lambda z, labels=labels: _fairseq_tailr(z, labels, eps, min_weight, gamma),
            logits,
            tol,
        )


@pytest.mark.parametrize(("dtype", "tol"), TOLS, ids=["f64", "f32"])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_tailr_emo_repo_matches_drsy_emo_tvd(dtype, tol, ratio) -> None:
    logits, labels = _case(1, dtype)
    _compare(
        lambda z: tailr_loss(z, labels, preset="emo_repo", mixing_ratio=ratio).loss,
        lambda z: _drsy_emo_tvd(z, labels, ratio),
        logits,
        tol,
    )


@pytest.mark.parametrize(("dtype", "tol"), TOLS, ids=["f64", "f32"])
@pytest.mark.parametrize("eta", [0.0, 0.1, 0.5, 1.0])
def test_mixce_matches_bloomberg(dtype, tol, eta) -> None:
    logits, labels = _case(2, dtype)
    _compare(
        lambda z: mixce_loss(z, labels, eta=eta).loss,
        lambda z: _bloomberg_mixce(z, labels, eta),
        logits,
        tol,
    )


def test_emo_repo_and_paper_agree_only_at_half() -> None:
    # emo_repo = η·CE + (1-η)·w_{γ=1-η}·CE; with η = 0.5 and the paper's γ = 0.5 the weights
    # coincide but emo_repo adds 0.5·CE: emo_repo = 0.5·CE + 0.5·paper.
    logits, labels = _case(3)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 23), labels.reshape(-1))
    paper = tailr_loss(logits, labels, gamma=0.5, min_weight=0.2).loss
    repo = tailr_loss(logits, labels, preset="emo_repo", mixing_ratio=0.5).loss
    torch.testing.assert_close(repo, 0.5 * ce + 0.5 * paper)
    repo3 = tailr_loss(logits, labels, preset="emo_repo", mixing_ratio=0.3).loss
    paper3 = tailr_loss(logits, labels, gamma=0.3, min_weight=0.2).loss
    assert abs(repo3.item() - (0.3 * ce + 0.7 * paper3).item()) > 1e-3


# --- hand-worked three-token case -------------------------------------------------------------


def _hand_case():
    # V = 2, gold = 0 everywhere: q_y = 1/2, 4/5, 1/10; CE = ln 2, ln 1.25, ln 10.
    logits = torch.tensor([[[0.0, 0.0], [math.log(4.0), 0.0], [0.0, math.log(9.0)]]], dtype=F64)
    labels = torch.zeros(1, 3, dtype=torch.long)
    return logits, labels


def test_hand_worked_mixce() -> None:
    logits, labels = _hand_case()
    # η = 0.5: multipliers 0.5 + 0.5q = 0.75, 0.9, 0.55
    # (0.75·0.693147 + 0.9·0.223144 + 0.55·2.302585) / 3 = 1.987111 / 3 = 0.662370
    out = mixce_loss(logits, labels, eta=0.5)
    assert out.loss.item() == pytest.approx(0.662370460916491, abs=1e-12)
    assert out.components["weight_mean"].item() == pytest.approx((0.75 + 0.9 + 0.55) / 3)
    assert out.components["ce"].item() == pytest.approx(math.log(2 * 1.25 * 10) / 3)


def test_hand_worked_tailr_paper_and_emo_repo() -> None:
    logits, labels = _hand_case()
    # paper, γ = 0.5: w = q/(0.5 + 0.5q) = 2q/(1+q) = 2/3, 8/9, 2/11 -> clamped to 0.2
    # (0.666667·0.693147 + 0.888889·0.223144 + 0.2·2.302585) / 3 = 1.120965 / 3 = 0.373655
    out = tailr_loss(logits, labels, gamma=0.5, min_weight=0.2)
    assert out.loss.item() == pytest.approx(0.37365498745417164, abs=1e-12)
    assert out.components["weight_mean"].item() == pytest.approx((2 / 3 + 8 / 9 + 0.2) / 3)
    # emo_repo, η = 0.3: w = q/(0.7 + 0.3q) = 0.588235, 0.851064, 0.136986 -> 0.2;
    # multipliers 0.3 + 0.7w = 0.711765, 0.895745, 0.44
    # (0.711765·0.693147 + 0.895745·0.223144 + 0.44·2.302585) / 3 = 1.706375 / 3 = 0.568792
    repo = tailr_loss(logits, labels, preset="emo_repo", mixing_ratio=0.3)
    assert repo.loss.item() == pytest.approx(0.5687915963925771, abs=1e-12)


# --- gradients ------------------------------------------------------------------------------


def test_closed_form_gradients() -> None:
    """∇_z of w·CE with w frozen is w·(q - e_y); TaiLr's smoothing adds ε/V·(V·q - 1)."""
    logits, labels = _case(4)
    valid = (labels != -100).unsqueeze(-1).to(F64)
    n = valid.sum()
    q = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(labels.clamp_min(0), 23).to(F64)
    q_gold = (q * onehot).sum(-1, keepdim=True)
    eps, gamma, wmin, eta = 0.1, 0.05, 0.2, 0.3

    x = logits.clone().requires_grad_()
    tailr_loss(x, labels, gamma=gamma, min_weight=wmin, label_smoothing=eps).loss.backward()
    w = (q_gold / (gamma + (1 - gamma) * q_gold)).clamp(wmin, 1.0)
    expected = ((1 - eps) * w * (q - onehot) + eps / 23 * (23 * q - 1)) * valid / n
    torch.testing.assert_close(x.grad, expected)

    x = logits.clone().requires_grad_()
    mixce_loss(x, labels, eta=eta).loss.backward()
    expected = (eta + (1 - eta) * q_gold) * (q - onehot) * valid / n
    torch.testing.assert_close(x.grad, expected)


def test_gradcheck_with_frozen_weights() -> None:
    """float64 gradcheck of each objective with its sg() weight held at the current value; the
    library's gradient must equal that frozen-weight function's gradient."""
    logits, labels = _case(5, vocab=6)
    logits, labels = logits[:, :4].contiguous(), labels[:, :4].contiguous()
    valid = labels != -100
    with torch.no_grad():
        q_gold = torch.softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1))[..., 0]

    def weighted_ce(z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(
            z.reshape(-1, 6), labels.reshape(-1), reduction="none"
        ).reshape(labels.shape)
        return (weight * ce * valid).sum() / valid.sum()

    cases = [
        (
            lambda z: tailr_loss(z, labels, gamma=0.1, min_weight=0.2),
            (q_gold / (0.1 + 0.9 * q_gold)).clamp(0.2, 1.0),
        ),
        (
            lambda z: tailr_loss(z, labels, preset="emo_repo", mixing_ratio=0.4),
            0.4 + 0.6 * (q_gold / (0.6 + 0.4 * q_gold)).clamp(0.2, 1.0),
        ),
        (lambda z: mixce_loss(z, labels, eta=0.2), 0.2 + 0.8 * q_gold),
    ]
    for fn, weight in cases:
        x = logits.clone().requires_grad_()
        y = logits.clone().requires_grad_()
        out = fn(x).loss
        frozen = weighted_ce(y, weight)
        out.backward()
        frozen.backward()
        torch.testing.assert_close(out, frozen)
        torch.testing.assert_close(x.grad, y.grad)
        assert torch.autograd.gradcheck(
            lambda z, weight=weight: weighted_ce(z, weight), (logits.clone().requires_grad_(),)
        )
    # The smoothing term has no sg(): gradcheck TaiLr directly with w pinned to 1 (w_min = 1).
    assert torch.autograd.gradcheck(
        lambda z: tailr_loss(z, labels, gamma=1e-7, min_weight=1.0, label_smoothing=0.2).loss,
        (logits.clone().requires_grad_(),),
    )


# --- properties -------------------------------------------------------------------------------

LOSSES = {
    "tailr": lambda z, y, **kw: tailr_loss(z, y, **kw),
    "tailr_ls": lambda z, y, **kw: tailr_loss(z, y, label_smoothing=0.1, **kw),
    "emo_repo": lambda z, y, **kw: tailr_loss(z, y, preset="emo_repo", mixing_ratio=0.5, **kw),
    "mixce": lambda z, y, **kw: mixce_loss(z, y, eta=0.3, **kw),
}


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_and_extreme_logits_are_finite(name: str, dtype: torch.dtype) -> None:
    logits, labels = _case(7, torch.float32)
    low = (logits * 30).to(dtype).requires_grad_()  # q_y underflows to 0 for many tokens
    out = LOSSES[name](low, labels)
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss) and torch.isfinite(low.grad.float()).all()
    torch.testing.assert_close(out.loss, LOSSES[name](low.detach().float(), labels).loss)


def test_emo_repo_eta_one_with_underflowing_q_is_plain_ce() -> None:
    logits = torch.tensor([[[0.0, 200.0]]], dtype=torch.float32, requires_grad=True)
    labels = torch.tensor([[0]])  # q_y = exp(-200) underflows to 0 in float32
    out = tailr_loss(logits, labels, preset="emo_repo", mixing_ratio=1.0)
    assert out.loss.item() == pytest.approx(200.0)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_modules_are_the_functions() -> None:
    """The modules call the functions with their options ("sum" = "mean" x count:
    tests/test_conformance.py)."""
    logits, labels = _case(8)
    for module, fn in (
        (TaiLrLoss(gamma=0.1), lambda r: tailr_loss(logits, labels, gamma=0.1, reduction=r)),
        (
            TaiLrLoss(preset="emo_repo", mixing_ratio=0.2),
            lambda r: tailr_loss(logits, labels, preset="emo_repo", mixing_ratio=0.2, reduction=r),
        ),
        (MixCELoss(eta=0.1), lambda r: mixce_loss(logits, labels, eta=0.1, reduction=r)),
    ):
        out = module(logits, labels)
        torch.testing.assert_close(out.loss, fn("mean").loss)
        assert set(out.components) == {"ce", "weight_mean", "n_tokens"}
        assert 0.0 < float(out.components["weight_mean"]) <= 1.0


def test_non_contiguous_view() -> None:
    logits, labels = _case(9)
    view = logits.transpose(0, 1)
    a = tailr_loss(view, labels.T, gamma=0.3).loss
    b = tailr_loss(view.contiguous(), labels.T.contiguous(), gamma=0.3).loss
    torch.testing.assert_close(a, b)


def test_errors() -> None:
    logits, labels = _case(10)
    with pytest.raises(ValueError, match="mixing_ratio"):
        tailr_loss(logits, labels, preset="emo_repo")
    with pytest.raises(ValueError, match="mixing_ratio"):
        TaiLrLoss(mixing_ratio=0.3)
    with pytest.raises(ValueError, match="label smoothing"):
        TaiLrLoss(preset="emo_repo", mixing_ratio=0.3, label_smoothing=0.1)
    with pytest.raises(ValueError, match="gamma"):
        TaiLrLoss(gamma=0.0)
    with pytest.raises(ValueError, match="min_weight"):
        TaiLrLoss(min_weight=1.5)
    with pytest.raises(ValueError, match="preset"):
        TaiLrLoss(preset="official")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eta"):
        MixCELoss(eta=1.2)
    with pytest.raises(ValueError, match="out of range"):
        mixce_loss(logits, torch.full((3, 8), 23), eta=0.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        tailr_loss(logits, labels[:, :4])
