"""EMO (DEMD, generalized DEMD, EMOLoss) against exact OT, the emoloss package, hand-worked
numbers, float64 gradcheck and properties."""

from __future__ import annotations

import math

import numpy as np
import ot
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from emdlm.functional.emo import (
    demd,
    demd_bound_dense,
    emo_loss,
    generalized_demd,
    mix_emo,
    normalize_cost_embedding,
)
from emdlm.losses.emo import EMOLoss, cost_embedding_from

F64 = torch.float64


def _random_case(seed: int, vocab: int, width: int, n: int = 1, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, width, generator=gen, dtype=F64)
    logits = scale * torch.randn(n, vocab, generator=gen, dtype=F64)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    return normalize_cost_embedding(emb), logits, labels


def _cost_matrix(emb_hat: torch.Tensor) -> np.ndarray:
    """Dense C = 1 - ÊÊᵀ (test oracle only; the library never builds it)."""
    return (1.0 - emb_hat @ emb_hat.T).clamp_min(0.0).numpy()


# --------------------------------------------------------------------------------------------
# Exact OT (POT)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [2, 7, 32, 64])
def test_demd_equals_exact_emd_for_one_hot_targets(vocab: int) -> None:
    # With a one-hot target the only feasible plan moves all of q to y, so Eq. 14 is exact.
    for seed in range(25):
        emb_hat, logits, labels = _random_case(seed, vocab, width=5 + seed % 7, n=1)
        q = torch.softmax(logits, -1)[0].numpy()
        target = np.zeros(vocab)
        target[int(labels[0])] = 1.0
        exact = ot.emd2(q, target, _cost_matrix(emb_hat))
        ours = demd(logits, labels, emb_hat)[0].item()
        assert ours == pytest.approx(exact, abs=1e-10), (vocab, seed)


@pytest.mark.parametrize("concentration", [0.1, 1.0, 10.0])
def test_dense_bound_upper_bounds_exact_emd(concentration: float) -> None:
    rng = np.random.default_rng(int(concentration * 100))
    vocab = 32
    for seed in range(30):
        emb_hat, logits, _ = _random_case(seed, vocab, width=8)
        p = torch.from_numpy(rng.dirichlet(np.full(vocab, concentration)))[None]  # [1, V]
        q = torch.softmax(logits, -1)[0].numpy()
        exact = ot.emd2(q, p[0].numpy(), _cost_matrix(emb_hat))
        bound = demd_bound_dense(logits, p, emb_hat)[0].item()
        assert bound >= exact - 1e-9
        # The bound is qᵀCp written with the dense matrix (oracle): same number.
        assert bound == pytest.approx(float(q @ _cost_matrix(emb_hat) @ p[0].numpy()), abs=1e-10)


def test_generalized_demd_matches_dense_formula_and_one_hot_case() -> None:
    vocab = 16
    for seed in range(10):
        emb_hat, logits, labels = _random_case(seed, vocab, width=6, n=3)
        p = torch.softmax(torch.randn(3, vocab, dtype=F64), -1)
        q = torch.softmax(logits, -1)
        cost = torch.from_numpy(_cost_matrix(emb_hat))
        dense = ((q - p).abs() * (p @ cost.T)).sum(-1)  # |q - p|ᵀ C p, C symmetric
        torch.testing.assert_close(generalized_demd(logits, p, emb_hat), dense)
        one_hot = torch.nn.functional.one_hot(labels, vocab).to(F64)
        torch.testing.assert_close(
            generalized_demd(logits, one_hot, emb_hat), demd(logits, labels, emb_hat)
        )
        torch.testing.assert_close(
            demd_bound_dense(logits, one_hot, emb_hat), demd(logits, labels, emb_hat)
        )


def test_generalized_demd_is_zero_when_q_equals_p() -> None:
    emb_hat, _, _ = _random_case(0, 20, width=4)
    p = torch.distributions.Dirichlet(torch.full((20,), 0.5, dtype=F64)).sample((5,))
    logits = p.log()
    assert generalized_demd(logits, p, emb_hat).abs().max().item() < 1e-12
    # ... while the independent-plan bound is not zero there (it charges q ⊗ p's off-diagonal).
    assert demd_bound_dense(logits, p, emb_hat).min().item() > 1e-3


# --------------------------------------------------------------------------------------------
# The official codes: emoloss (pip) and DRSY/EMO's formula
# --------------------------------------------------------------------------------------------


def _official_drsy_emo(logits: torch.Tensor, labels: torch.Tensor, emb: torch.Tensor):
    """DRSY/EMO language_modeling/gpt2.py 'emo' branch semantics, restated (unshifted inputs):
    dense one-hot + 1e-15, L1-normalized, times the row-normalized embedding; ratio
    CE / (DEMD + 1e-10) detached, no cap; masked mean with 1e-15."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    mask = (flat_labels != -100).to(flat.dtype)
    mle = torch.nn.functional.cross_entropy(flat, flat_labels, reduction="none")
    safe = flat_labels.clamp_min(0)
    one_hot = torch.nn.functional.one_hot(safe, flat.shape[-1]).to(flat.dtype) + 1e-15
    one_hot = one_hot / one_hot.sum(-1, keepdim=True)
    emb_hat = emb / emb.norm(dim=1, keepdim=True)
    dist = 1 - ((one_hot @ emb_hat) * (torch.softmax(flat, -1) @ emb_hat)).sum(-1)
    loss = (mle + (mle / (dist + 1e-10)).detach() * dist) * 0.5
    return (loss * mask).sum() / (1e-15 + mask.sum())


def _shifted_case(seed: int, dtype: torch.dtype = F64, vocab: int = 37, width: int = 11):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(3, 9, vocab, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (3, 9), generator=gen)
    labels[0, 5:] = -100
    labels[2, 1] = -100
    emb = torch.randn(vocab, width, generator=gen, dtype=dtype)
    return logits, labels, emb


@pytest.mark.parametrize(
    ("dtype", "tol"), [(F64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
@pytest.mark.parametrize(("mode", "pkg_mode", "max_ratio"), [("emo1", 1, 3.0), ("emo2", 2, None)])
def test_matches_emoloss_package_value_and_gradient(dtype, tol, mode, pkg_mode, max_ratio) -> None:
    emo_pkg = pytest.importorskip("emo.loss")  # the emoloss package (pinned in requirements)
    for seed in range(3):
        logits, labels, emb = _shifted_case(seed, dtype)
        ours_in = logits.clone().requires_grad_()
        ref_in = logits.clone().requires_grad_()
        # emoloss shifts inside; ours takes aligned labels.
        ours = emo_loss(
            ours_in[:, :-1],
            labels[:, 1:],
            normalize_cost_embedding(emb),
            mode=mode,
            max_ratio=max_ratio,
        ).loss
        ref = emo_pkg.EMOLoss(ref_in, labels, emb, mode=pkg_mode)
        (2.0 * ours).backward()
        (2.0 * ref).backward()
        torch.testing.assert_close(ours.to(F64), ref.to(F64), rtol=tol, atol=tol)
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=tol, atol=tol)


def test_emo1_default_equals_emoloss_where_its_cap_is_inactive() -> None:
    # Logits peaked on the gold token: CE/DEMD ~ -log(q_y)/(1 - q_y) < 3, so emoloss's cap never
    # binds and the paper form (no cap) must equal emoloss mode 1 exactly.
    emo_pkg = pytest.importorskip("emo.loss")
    logits, labels, emb = _shifted_case(12)
    gold = torch.nn.functional.one_hot(labels.roll(-1, dims=1).clamp_min(0), 37).to(F64)
    logits = 0.3 * logits + 6.0 * gold
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ours = emo_loss(a[:, :-1], labels[:, 1:], normalize_cost_embedding(emb)).loss
    ref = emo_pkg.EMOLoss(b, labels, emb, mode=1)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_emo1_default_matches_drsy_emo_formula_without_cap() -> None:
    for seed in range(3):
        logits, labels, emb = _shifted_case(seed)
        a = logits.clone().requires_grad_()
        b = logits.clone().requires_grad_()
        ours = emo_loss(a, labels, normalize_cost_embedding(emb)).loss
        ref = _official_drsy_emo(b, labels, emb)
        (2.0 * ours).backward()
        (2.0 * ref).backward()
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
        # The emoloss cap (3.0) is active on these inputs (CE/DEMD > 3), so it does change the
        # gradient: the two official codes really differ here.
        c = logits.clone().requires_grad_()
        emo_loss(c, labels, normalize_cost_embedding(emb), max_ratio=3.0).loss.mul(2).backward()
        assert (c.grad - a.grad).abs().max().item() > 1e-4


# --------------------------------------------------------------------------------------------
# Hand-worked numbers
# --------------------------------------------------------------------------------------------


def _hand_case():
    # Ê rows e0=(1,0), e1=(0,1), e2=(-1,0): C01 = C12 = 1, C02 = 2, C_ii = 0.
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=F64)
    # token 1: q = (1/3, 1/3, 1/3), y = 0 -> DEMD = 0 + 1/3 + 2/3 = 1,   CE = ln 3
    # token 2: q = (1/4, 1/2, 1/4), y = 1 -> DEMD = 1/4 + 0 + 1/4 = 1/2, CE = ln 2
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]]], dtype=F64)
    labels = torch.tensor([[0, 1]])
    return emb, logits, labels


def test_hand_worked_two_tokens() -> None:
    emb, logits, labels = _hand_case()
    emb_hat = normalize_cost_embedding(emb)
    torch.testing.assert_close(demd(logits, labels, emb_hat), torch.tensor([[1.0, 0.5]], dtype=F64))
    # emo1: per token 0.5*(CE + (CE/DEMD)*DEMD) = CE -> (ln 3 + ln 2)/2 = ln(6)/2 = 0.895879...
    out = emo_loss(logits, labels, emb_hat, mode="emo1")
    assert out.loss.item() == pytest.approx(0.8958797346140275, abs=1e-9)
    assert out.components["demd"].item() == pytest.approx(0.75)
    assert out.components["ce"].item() == pytest.approx(math.log(6.0) / 2)
    assert int(out.components["n_tokens"]) == 2
    # emo2: per token DEMD + (DEMD/CE)*CE = 2*DEMD -> (2 + 1)/2 = 1.5
    assert emo_loss(logits, labels, emb_hat, mode="emo2").loss.item() == pytest.approx(1.5)
    # static, mu = 0.5: (ln 3 + 0.5 + ln 2 + 0.25)/2 = (ln 6 + 0.75)/2 = 1.27087...
    static = emo_loss(logits, labels, emb_hat, mode="static", mu=0.5).loss.item()
    assert static == pytest.approx(1.2708797346140275, abs=1e-9)
    # sum reduction: twice the mean here
    summed = emo_loss(logits, labels, emb_hat, reduction="sum").loss.item()
    assert summed == pytest.approx(math.log(6.0))


def test_hand_worked_emo1_gradient() -> None:
    emb, logits, labels = _hand_case()
    x = logits.clone().requires_grad_()
    emo_loss(x, labels, normalize_cost_embedding(emb)).loss.backward()
    # token 2: c = C(., y=1) = (1, 0, 1), q.c = 1/2, dDEMD/dz = q*(c - q.c) = (1/8, -1/4, 1/8);
    # dCE/dz = q - e_y = (1/4, -1/2, 1/4); ratio = ln2 / (1/2) = 2 ln 2.
    # grad = 0.5*((1/4)(1,-2,1) + 2ln2*(1/8)(1,-2,1)) / 2 tokens = (1 + ln 2)/16 * (1, -2, 1)
    k = (1.0 + math.log(2.0)) / 16.0  # 0.10582...
    torch.testing.assert_close(x.grad[0, 1], torch.tensor([k, -2 * k, k], dtype=F64))
    # token 1: c = (0, 1, 2), q.c = 1, dDEMD = (1/3)(-1, 0, 1); dCE = (-2/3, 1/3, 1/3);
    # ratio = ln 3; grad = 0.5*(dCE + ln3*dDEMD)/2
    l3 = math.log(3.0)
    expected = 0.25 * torch.tensor([-2 / 3 - l3 / 3, 1 / 3, 1 / 3 + l3 / 3], dtype=F64)
    torch.testing.assert_close(x.grad[0, 0], expected)


def test_hand_worked_dense_bound_and_generalized() -> None:
    emb, _, _ = _hand_case()
    emb_hat = normalize_cost_embedding(emb)
    # q = (1/2, 1/2, 0) (logit -inf replaced by a very negative number), p = (0, 1/2, 1/2).
    logits = torch.tensor([[0.0, 0.0, -1e4]], dtype=F64)
    p = torch.tensor([[0.0, 0.5, 0.5]], dtype=F64)
    # qᵀCp = 1/2*(1/2*C01 + 1/2*C02) + 1/2*(1/2*C11 + 1/2*C12) = 1/2*1.5 + 1/2*0.5 = 1
    assert demd_bound_dense(logits, p, emb_hat).item() == pytest.approx(1.0)
    # exact EMD: move 1/2 from token 0 to token 2 (cost 2)... or 0->1 and 1->2 (1/2 + 1/2) = 1
    exact = ot.emd2(np.array([0.5, 0.5, 0.0]), p[0].numpy(), _cost_matrix(emb_hat))
    assert exact == pytest.approx(1.0)
    # Eq. 15: |q-p| = (1/2, 0, 1/2); Cp = (1.5, 0.5, 0.5) -> 1/2*1.5 + 1/2*0.5 = 1
    assert generalized_demd(logits, p, emb_hat).item() == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------
# Gradients (float64 gradcheck)
# --------------------------------------------------------------------------------------------


def test_gradcheck_demd_and_dense_forms() -> None:
    emb_hat, _, _ = _random_case(1, 6, width=3)
    logits = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    labels = torch.tensor([[0, 5, -100], [3, 3, 1]])
    p = torch.softmax(torch.randn(2, 3, 6, dtype=F64), -1).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: demd(z, labels, emb_hat), (logits,))
    assert torch.autograd.gradcheck(lambda z, t: demd_bound_dense(z, t, emb_hat), (logits, p))
    assert torch.autograd.gradcheck(lambda z: generalized_demd(z, p.detach(), emb_hat), (logits,))
    assert torch.autograd.gradcheck(
        lambda z: emo_loss(z, labels, emb_hat, mode="static", mu=0.7).loss, (logits,)
    )


@pytest.mark.parametrize(("mode", "max_ratio"), [("emo1", None), ("emo1", 1.5), ("emo2", None)])
def test_dynamic_modes_gradient_is_the_stop_gradient_mix(mode: str, max_ratio) -> None:
    """sg() freezes the ratio: the gradient must equal that of the mix with the ratio held at
    its current value, a smooth function that gradcheck verifies."""
    emb_hat, _, _ = _random_case(2, 7, width=4)
    logits = torch.randn(2, 4, 7, dtype=F64)
    labels = torch.tensor([[0, 6, -100, 2], [3, -100, 1, 1]])
    valid = labels != -100
    with torch.no_grad():
        ce0 = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 7), labels.reshape(-1), reduction="none"
        ).reshape(2, 4)
        d0 = demd(logits, labels, emb_hat)
        if mode == "emo1":
            ratio = ce0 / (d0 + 1e-10)
            ratio = ratio if max_ratio is None else ratio.clamp_max(max_ratio)
        else:
            ratio = d0 / (ce0 + 1e-10)

    def frozen(z: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(
            z.reshape(-1, 7), labels.reshape(-1), reduction="none"
        ).reshape(2, 4)
        d = demd(z, labels, emb_hat)
        per = 0.5 * (ce + ratio * d) if mode == "emo1" else d + ratio * ce
        return (per * valid).sum() / valid.sum()

    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    loss = emo_loss(x, labels, emb_hat, mode=mode, max_ratio=max_ratio).loss
    loss.backward()
    frozen(y).backward()
    torch.testing.assert_close(loss, frozen(logits))
    torch.testing.assert_close(x.grad, y.grad)
    assert torch.autograd.gradcheck(frozen, (logits.clone().requires_grad_(),))


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 40),
    width=st.integers(1, 9),
    scale=st.floats(0.0, 30.0),
)
def test_demd_in_range_and_finite(seed: int, vocab: int, width: int, scale: float) -> None:
    emb_hat, logits, labels = _random_case(seed, vocab, width, n=4, scale=scale)
    value = demd(logits, labels, emb_hat)
    assert torch.isfinite(value).all()
    assert value.min().item() >= -1e-12
    assert value.max().item() <= 2.0 + 1e-12


def test_demd_zero_at_perfect_prediction_with_distinct_rows() -> None:
    emb_hat, _, _ = _random_case(3, 12, width=6)
    labels = torch.arange(12)
    logits = 60.0 * torch.nn.functional.one_hot(labels, 12).to(F64)
    assert demd(logits, labels, emb_hat).abs().max().item() < 1e-14  # rounding of |ê| = 1
    out = emo_loss(logits.requires_grad_(), labels, emb_hat)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert out.loss.item() < 1e-20


def test_duplicate_cost_rows_give_zero_demd_and_finite_emo1() -> None:
    # Tokens 0 and 1 share a cost row: mass split between them costs nothing (DEMD = 0 while
    # CE = ln 2). The ratio's 1e-10 guard keeps everything finite.
    emb = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]], dtype=F64)
    logits = torch.tensor([[0.0, 0.0, -1e3]], dtype=F64, requires_grad=True)
    labels = torch.tensor([0])
    emb_hat = normalize_cost_embedding(emb)
    assert demd(logits, labels, emb_hat).item() == pytest.approx(0.0, abs=1e-15)
    for mode in ("emo1", "emo2", "static"):
        out = emo_loss(logits, labels, emb_hat, mode=mode)
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("mode", ["emo1", "emo2", "static"])
def test_padding_with_ignored_positions_changes_nothing(mode: str) -> None:
    logits, labels, emb = _shifted_case(4)
    emb_hat = normalize_cost_embedding(emb)
    padded_logits = torch.cat([logits, 5 * torch.randn(3, 4, 37, dtype=F64)], dim=1)
    padded_labels = torch.cat([labels, torch.full((3, 4), -100)], dim=1)
    a = logits.clone().requires_grad_()
    b = padded_logits.clone().requires_grad_()
    la = emo_loss(a, labels, emb_hat, mode=mode).loss
    lb = emo_loss(b, padded_labels, emb_hat, mode=mode).loss
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(a.grad, b.grad[:, :9])
    assert b.grad[:, 9:].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_finite_and_close(dtype: torch.dtype) -> None:
    logits, labels, emb = _shifted_case(5, torch.float32)
    emb_hat = normalize_cost_embedding(emb)
    low = (logits * 4).to(dtype).requires_grad_()  # large logits: overflow-prone in half
    out = emo_loss(low, labels, emb_hat)
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss) and torch.isfinite(low.grad.float()).all()
    assert low.grad.dtype == dtype
    ref = emo_loss(low.detach().float(), labels, emb_hat).loss
    torch.testing.assert_close(out.loss, ref)


@pytest.mark.parametrize("mode", ["emo1", "emo2", "static"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_gradient(mode: str, reduction: str) -> None:
    emb_hat, _, _ = _random_case(6, 10, width=3)
    logits = torch.randn(2, 3, 10, requires_grad=True)
    labels = torch.full((2, 3), -100)
    out = emo_loss(logits, labels, emb_hat, mode=mode, reduction=reduction)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert logits.grad is not None and logits.grad.abs().max().item() == 0.0
    assert int(out.components["n_tokens"]) == 0
    assert float(out.components["demd"]) == 0.0


def test_non_contiguous_logits_view() -> None:
    logits, labels, emb = _shifted_case(7)
    emb_hat = normalize_cost_embedding(emb)
    view = logits.transpose(0, 1)  # [T, B, V], non-contiguous
    assert not view.is_contiguous()
    a = emo_loss(view, labels.T, emb_hat).loss
    b = emo_loss(view.contiguous(), labels.T.contiguous(), emb_hat).loss
    torch.testing.assert_close(a, b)


def test_sum_reduction_is_count_times_mean() -> None:
    logits, labels, emb = _shifted_case(8)
    emb_hat = normalize_cost_embedding(emb)
    mean = emo_loss(logits, labels, emb_hat)
    summed = emo_loss(logits, labels, emb_hat, reduction="sum")
    count = int((labels != -100).sum())
    assert int(mean.components["n_tokens"]) == count
    torch.testing.assert_close(summed.loss, mean.loss * count)


def test_emo1_value_equals_mean_ce() -> None:
    # 0.5*(CE + sg(CE/DEMD)*DEMD) has the value of CE (up to the 1e-10 guard).
    logits, labels, emb = _shifted_case(9)
    out = emo_loss(logits, labels, normalize_cost_embedding(emb))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), labels.reshape(-1))
    torch.testing.assert_close(out.loss, ce)
    torch.testing.assert_close(out.components["ce"], ce)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_zero_rows_warn_and_non_finite_rows_are_reported_with_indices() -> None:
    emb = torch.randn(8, 3)
    emb[2] = 0.0
    emb[5] = 0.0
    with pytest.warns(UserWarning, match=r"2 zero row\(s\) \(indices \[2, 5\]"):
        emb_hat = normalize_cost_embedding(emb)
    assert torch.equal(emb_hat[[2, 5]], torch.zeros(2, 3))  # cosine 0 with every token
    emb[5] = float("nan")
    emb[6, 1] = float("inf")
    with pytest.raises(ValueError, match=r"2 row\(s\) with non-finite entries at indices \[5, 6\]"):
        EMOLoss(emb)
    assert normalize_cost_embedding(torch.randn(4, 3, dtype=torch.bfloat16)).dtype == torch.float32


def test_vocab_mismatch_and_bad_inputs() -> None:
    emb_hat = normalize_cost_embedding(torch.randn(10, 4))
    logits = torch.randn(2, 3, 11)
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"V=11.*10 rows"):
        emo_loss(logits, labels, emb_hat)
    with pytest.raises(ValueError, match="V=11"):
        demd(logits, labels, emb_hat)
    with pytest.raises(ValueError, match="V=11"):
        generalized_demd(logits, torch.softmax(logits, -1), emb_hat)
    with pytest.raises(ValueError, match="out of range"):
        emo_loss(logits[..., :10], torch.full((2, 3), 10), emb_hat)
    with pytest.raises(ValueError, match="shape"):
        demd_bound_dense(logits[..., :10], torch.rand(2, 10), emb_hat)
    with pytest.raises(ValueError, match="mode"):
        emo_loss(logits[..., :10], labels, emb_hat, mode="emo3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mu"):
        emo_loss(logits[..., :10], labels, emb_hat, mode="emo1", mu=0.5)
    with pytest.raises(ValueError, match="cost_embedding must have shape"):
        normalize_cost_embedding(torch.randn(10))


# --------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 13, hidden: int = 6) -> None:
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_cost_embedding_from_is_a_frozen_fp32_copy() -> None:
    model = _TinyLM().to(torch.bfloat16)
    cost = cost_embedding_from(model)
    assert cost.dtype == torch.float32 and not cost.requires_grad
    before = cost.clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    torch.testing.assert_close(cost, before)
    with pytest.raises(TypeError, match="get_output_embeddings"):
        cost_embedding_from(nn.Linear(2, 2))


def test_module_buffer_and_reference_path() -> None:
    model = _TinyLM()
    loss_fn = EMOLoss.from_model(model, mode="emo2", implementation="reference")
    assert "cost_embedding_normalized" not in loss_fn.state_dict()
    norms = loss_fn.cost_embedding_normalized.norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(13))
    logits = torch.randn(2, 5, 13, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5))
    labels[1, 3] = -100
    out = loss_fn(logits, labels)
    ref = emo_loss(logits, labels, normalize_cost_embedding(model.head.weight), mode="emo2")
    torch.testing.assert_close(out.loss, ref.loss)
    assert set(out.components) >= {"ce", "demd", "n_tokens"}
    with pytest.raises(ValueError, match="max_ratio"):
        EMOLoss(model.head.weight, mode="emo2", max_ratio=3.0)
    with pytest.raises(ValueError, match="implementation"):
        EMOLoss(model.head.weight, implementation="fast")  # type: ignore[arg-type]


def test_module_resolves_implementation() -> None:
    loss_fn = EMOLoss(torch.randn(9, 4))
    assert loss_fn.resolved_implementation(torch.randn(2, 9, requires_grad=True)) == "chunked"
    assert loss_fn.resolved_implementation(torch.randn(2, 9)) == "reference"
    forced = EMOLoss(torch.randn(9, 4), implementation="reference")
    assert forced.resolved_implementation(torch.randn(2, 9, requires_grad=True)) == "reference"


@pytest.mark.parametrize(
    ("mode", "max_ratio"), [("emo1", None), ("emo1", 3.0), ("emo2", None), ("static", None)]
)
def test_module_chunked_path_equals_reference(mode: str, max_ratio) -> None:
    gen = torch.Generator().manual_seed(11)
    emb = torch.randn(29, 7, generator=gen)
    logits = 3 * torch.randn(3, 7, 29, generator=gen)
    labels = torch.randint(0, 29, (3, 7), generator=gen)
    labels[0, :3] = -100
    mu = 0.4 if mode == "static" else 1.0
    kwargs = {"mode": mode, "mu": mu, "max_ratio": max_ratio}
    chunked = EMOLoss(emb, implementation="chunked", chunk_size=5, **kwargs)
    reference = EMOLoss(emb, implementation="reference", **kwargs)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    out_a, out_b = chunked(a, labels), reference(b, labels)
    (2 * out_a.loss).backward()
    (2 * out_b.loss).backward()
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    for key in ("ce", "demd"):
        torch.testing.assert_close(out_a.components[key], out_b.components[key])


def test_emo1_treats_a_demd_rounded_below_zero_as_zero() -> None:
    # 1 - ê_y·(Êᵀq) can land a few ulps below 0 in float32; without clamping, the ratio
    # CE / (DEMD + 1e-10) ~ 1e10·CE would turn -1e-7 into a value of about -1000·CE.
    from emdlm.ops._chunking import mode_coefficients

    ce = torch.tensor([2.0, 2.0], dtype=torch.float64, requires_grad=True)
    demd_value = torch.tensor([-1e-7, 0.5], dtype=torch.float64, requires_grad=True)
    mixed = mix_emo(ce, demd_value, mode="emo1")
    assert torch.allclose(mixed.detach(), torch.tensor([1.0, 2.0], dtype=torch.float64))
    mixed.sum().backward()
    assert demd_value.grad[0] == 0.0  # clamped: no push from a rounding error
    assert torch.isclose(
        demd_value.grad[1], torch.tensor(0.5 * 2.0 / (0.5 + 1e-10), dtype=torch.float64)
    )

    valid = torch.tensor([True, True])
    _a, b, value = mode_coefficients(ce.detach(), demd_value.detach(), valid, "emo1", 1.0)
    assert torch.allclose(value, mixed.detach())
    assert b[0] == 0.0 and torch.isclose(b[1], demd_value.grad[1])


def test_from_hidden_equals_logits_path() -> None:
    # The fused-linear entry point must give the loss and gradients of head(hidden) -> forward.
    torch.manual_seed(3)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    head = nn.Linear(8, 13, bias=True).double()
    labels = torch.randint(0, 13, (2, 5))
    labels[0, 0] = -100
    loss_fn = EMOLoss(torch.randn(13, 6, dtype=torch.float64), implementation="reference")
    fused = loss_fn.from_hidden(hidden, head.weight, labels, head.bias)
    (2 * fused.loss).backward()
    grads_fused = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()
    plain = loss_fn(head(hidden), labels)
    (2 * plain.loss).backward()
    assert torch.allclose(fused.loss, plain.loss, atol=1e-10)
    want_grads = [hidden.grad, head.weight.grad, head.bias.grad]
    for got, want in zip(grads_fused, want_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-10)
