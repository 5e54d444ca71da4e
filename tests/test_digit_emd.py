"""Digit / class EMD (emdlm.functional.digit_emd) against exact optimal transport and by hand."""

from __future__ import annotations

import math

import numpy as np
import ot
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import wasserstein_distance

from emdlm.functional.digit_emd import (
    class_emd,
    masked_class_softmax,
    position_weight,
    weighted_digit_emd,
)

DIGITS = torch.arange(10, dtype=torch.float64)


def _digit_emd(probs: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    m = probs.shape[0]
    return class_emd(probs, DIGITS.expand(m, 10), gold, torch.ones(m, dtype=torch.long))


@given(
    st.lists(st.floats(0.0, 1.0), min_size=10, max_size=10).filter(lambda w: sum(w) > 1e-3),
    st.integers(0, 9),
)
@settings(max_examples=60, deadline=None)
def test_single_digit_emd_equals_scipy_w1(weights: list[float], gold: int) -> None:
    p = torch.tensor(weights, dtype=torch.float64)
    p = p / p.sum()
    ours = float(_digit_emd(p[None], torch.tensor([gold]))[0])
    truth = wasserstein_distance(np.arange(10), [gold], p.numpy())
    assert ours == pytest.approx(truth, abs=1e-12)


@pytest.mark.parametrize("num_digits", [2, 3])
def test_multi_digit_class_emd_equals_pot(num_digits: int) -> None:
    """Class EMD == ot.emd2 with cost |v_i − v_j| / 10^(L−1) and a one-hot target."""
    gen = torch.Generator().manual_seed(num_digits)
    k = 37  # a class with 37 members, values spread over the L-digit range
    values = torch.randperm(10**num_digits, generator=gen)[:k].sort().values.double()
    logits = torch.randn(5, k, generator=gen, dtype=torch.float64) * 2
    probs = torch.softmax(logits, -1)
    gold = torch.randint(0, k, (5,), generator=gen)
    ours = class_emd(probs, values.expand(5, k), gold, torch.full((5,), num_digits))
    cost = (values[:, None] - values[None, :]).abs().numpy() / 10 ** (num_digits - 1)
    for i in range(5):
        target = np.zeros(k)
        target[int(gold[i])] = 1.0
        truth = ot.emd2(probs[i].numpy(), target, cost)
        assert float(ours[i]) == pytest.approx(truth, rel=1e-9, abs=1e-12)


def test_closer_value_costs_less_in_multi_digit_class() -> None:
    values = torch.arange(100, dtype=torch.float64)[None]  # '00'..'99'
    gold = torch.tensor([42])
    costs = []
    for predicted in (42, 43, 47, 52, 99):
        probs = torch.zeros(1, 100, dtype=torch.float64)
        probs[0, predicted] = 1.0
        costs.append(float(class_emd(probs, values, gold, torch.tensor([2]))[0]))
    assert costs[0] == 0.0
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    assert costs[3] == pytest.approx(1.0)  # 10 away = one unit of the leading (tens) place


def test_paper_figure2_same_ce_different_emd() -> None:
    """Fig. 2: both predictions give the gold '3' probability 0.5 (same CE) but put the rest
    on '4' or on '9': EMD 0.5 vs 3.0."""
    near = torch.zeros(10, dtype=torch.float64)
    far = torch.zeros(10, dtype=torch.float64)
    near[3], near[4] = 0.5, 0.5
    far[3], far[9] = 0.5, 0.5
    emd = _digit_emd(torch.stack([near, far]), torch.tensor([3, 3]))
    assert -math.log(near[3]) == -math.log(far[3])
    assert emd.tolist() == pytest.approx([0.5, 3.0])


def test_position_weight_and_weighted_emd_by_hand() -> None:
    assert position_weight(torch.tensor([0, 1, 3]), 0.2).tolist() == pytest.approx(
        [1.0, 1.2, 1.728]
    )
    # '7' as the hundreds digit (2 digits to its right): uniform prediction over 0..9.
    logits = torch.zeros(1, 10, dtype=torch.float64)
    mask = torch.ones(1, 10, dtype=torch.bool)
    out = weighted_digit_emd(
        logits, mask, DIGITS[None], torch.tensor([7]), torch.tensor([1]), torch.tensor([2]), 0.2
    )
    expected = sum(abs(k - 7) for k in range(10)) / 10 * 1.2**2  # 2.5 * 1.44
    assert float(out[0]) == pytest.approx(expected)


def test_padding_columns_get_no_mass() -> None:
    logits = torch.tensor([[0.0, 1.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    probs = masked_class_softmax(logits, mask)
    assert float(probs[0, 2]) == 0.0
    assert float(probs.sum()) == pytest.approx(1.0)


def test_perfect_prediction_has_zero_emd_and_emd_is_nonnegative() -> None:
    logits = torch.full((3, 10), -1e4, dtype=torch.float64)
    gold = torch.tensor([0, 5, 9])
    logits[torch.arange(3), gold] = 1e4
    probs = masked_class_softmax(logits, torch.ones(3, 10, dtype=torch.bool))
    assert _digit_emd(probs, gold).abs().max() == 0.0
    rand = torch.softmax(torch.randn(50, 10, dtype=torch.float64), -1)
    assert (_digit_emd(rand, torch.randint(0, 10, (50,))) >= 0).all()


def test_weighted_emd_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[0, 10:] = False
    values = torch.arange(12, dtype=torch.float64).expand(4, 12) * 7
    gold = torch.tensor([3, 0, 11, 5])

    def f(z: torch.Tensor) -> torch.Tensor:
        return weighted_digit_emd(
            z, mask, values, gold, torch.tensor([2, 2, 2, 2]), torch.tensor([3, 1, 0, 2]), 0.2
        )

    assert torch.autograd.gradcheck(f, (logits,))
