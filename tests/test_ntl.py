"""NTL-MSE family, NTL-WAS and the number-level loss (emdlm.losses.ntl): pinned to ntloss
0.3.2's own outputs on real tokenizers (NTL-WAS also to the digit EMD), hand-worked numbers,
properties on multi-digit classes, number_mask, edge inputs, float64 gradcheck of both paths,
and the from-hidden path on options."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import emdlm.ops.chunked
from _number_tokens import TOKENS, VOCAB, V
from emdlm.losses.ntil import DigitEMDLoss
from emdlm.losses.ntl import NTLMSELoss, NTLWASLoss, NumberLevelLoss
from emdlm.ops.chunked import chunked_linear_loss

ntloss = pytest.importorskip("ntloss")
F64 = torch.float64
LOSS_FUNCTIONS = {"mse": F.mse_loss, "l1": F.l1_loss, "huber": F.huber_loss}


def _batch(tok: Any, seed: int, dtype: torch.dtype, b: int = 3, t: int = 14):
    """Logits [b, t, V] leaning on the digits, and labels: digits (60%), other ids, '.' between
    digits (never a chain d.d.d), ignored positions."""
    vocab = len(tok)
    gen = torch.Generator().manual_seed(seed)
    digit_ids = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    dot = tok.convert_tokens_to_ids(".")
    logits = 2.0 * torch.randn(b, t, vocab, generator=gen, dtype=F64)
    logits[..., digit_ids] += 3.0
    other = torch.randint(0, vocab, (b, t), generator=gen)
    other = torch.where((other == dot) | torch.isin(other, digit_ids), 0, other)
    digits = digit_ids[torch.randint(0, 10, (b, t), generator=gen)]
    labels = torch.where(torch.rand(b, t, generator=gen) < 0.6, digits, other)
    labels[0, :5] = digit_ids[torch.tensor([1, 2, 0, 5, 7])]
    labels[0, 2] = dot  # "12.57"
    labels[1, :2] = -100
    labels[2, -1] = -100
    return logits.to(dtype), labels


def _real(name: str) -> Any:
    from emdlm.tokenizers import load_tokenizer

    return load_tokenizer(name)


# --- pinned: ntloss's own NTLossDotProduct / NumberLevelLoss -----------------------------


@pytest.mark.parametrize("tok_name", ["char", "gpt2"])
@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
@pytest.mark.parametrize("reweigh", [True, False])
def test_ntl_mse_equals_ntloss(tok_name: str, loss: str, reweigh: bool) -> None:
    """preset "ntloss": the NTL term is ntloss's NTLossDotProduct (value to 1e-12 in float64,
    1e-6 relative in float32) and CE + 0.3·NTL its recommended total, gradient included."""
    tok = _real(tok_name)
    n_before = len(tok)
    theirs_fn = ntloss.NTLossDotProduct(
        tok, vocab_size=len(tok), reweigh=reweigh, loss_function=LOSS_FUNCTIONS[loss]
    )
    assert len(tok) == n_before  # ntloss adds no token to these vocabularies
    ours_fn = NTLMSELoss(tok, preset="ntloss", loss=loss, reweigh=reweigh)
    # ntloss's Huber cannot take float64 logits (F.huber_loss of float64 ŷ and its float32 y)
    dtypes = ((F64, 1e-12),) if loss != "huber" else ()
    for dtype, rel in (*dtypes, (torch.float32, 1e-6)):
        logits, labels = _batch(tok, seed=1, dtype=dtype)
        x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = ours_fn(x1, labels)
        ntl = theirs_fn(x2, labels)
        flat = x2.reshape(-1, x2.shape[-1])
        want = F.cross_entropy(flat.float() if dtype != F64 else flat, labels.reshape(-1))
        want = want + 0.3 * ntl
        assert float(out.components["ntl"]) == pytest.approx(float(ntl), rel=rel, abs=rel)
        assert float(out.loss) == pytest.approx(float(want), rel=rel, abs=rel)
        if dtype == F64:
            out.loss.backward()
            want.backward()
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tok_name", ["char", "gpt2"])
@pytest.mark.parametrize("reweigh", [True, False])
@pytest.mark.parametrize("squash_factor", [None, 1.5, 30.0])
def test_ntl_was_equals_ntloss(tok_name: str, reweigh: bool, squash_factor: float | None) -> None:
    """preset "ntloss": the NTL term is ntloss's NTLoss (NTL-WAS; value to 1e-12 in float64,
    1e-6 relative in float32) and CE + 0.3·NTL its recommended total, gradient included;
    ``squash_factor`` as ntloss's (its squashed distance table, R = s in the reweigh)."""
    tok = _real(tok_name)
    theirs_fn = ntloss.NTLoss(
        tok, vocab_size=len(tok), reweigh=reweigh, squash_factor=squash_factor
    )
    ours_fn = NTLWASLoss(tok, preset="ntloss", reweigh=reweigh, squash_factor=squash_factor)
    for dtype, rel in ((F64, 1e-12), (torch.float32, 1e-6)):
        logits, labels = _batch(tok, seed=3, dtype=dtype)
        x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = ours_fn(x1, labels)
        ntl = theirs_fn(x2, labels)
        flat = x2.reshape(-1, x2.shape[-1])
        want = F.cross_entropy(flat.float() if dtype != F64 else flat, labels.reshape(-1))
        want = want + 0.3 * ntl
        assert float(ntl.detach()) > 0.1  # the batch scores digits: not a pin of 0 == 0
        assert float(out.components["ntl"]) == pytest.approx(float(ntl), rel=rel, abs=rel)
        assert float(out.loss) == pytest.approx(float(want), rel=rel, abs=rel)
        if dtype == F64:
            out.loss.backward()
            want.backward()
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)


def test_ntl_was_without_reweigh_is_the_digit_emd() -> None:
    """On the ten digits, NTL-WAS without reweigh, averaged over digit tokens, is the NTIL
    paper's digit-EMD baseline with the same averaging and a static λ (σ = 0)."""
    tok = _real("char")
    logits, labels = _batch(tok, seed=4, dtype=F64)
    was = NTLWASLoss(tok, preset="ntloss", reweigh=False, lam=0.3)(logits, labels)
    emd = DigitEMDLoss(tok, preset="paper", mix="static", lam=0.3)(logits, labels)
    assert float(was.components["ntl"]) > 0.1
    assert float(was.loss) == pytest.approx(float(emd.loss), rel=1e-9)


@pytest.mark.parametrize("tok_name", ["char", "gpt2"])
@pytest.mark.parametrize("reweigh", [True, False])
@pytest.mark.parametrize("float_level", [False, True])
def test_number_level_equals_ntloss(tok_name: str, reweigh: bool, float_level: bool) -> None:
    tok = _real(tok_name)
    theirs_fn = ntloss.NumberLevelLoss(
        tok, vocab_size=len(tok), reweigh=reweigh, float_level=float_level
    )
    ours_fn = NumberLevelLoss(tok, preset="ntloss", reweigh=reweigh, float_level=float_level)
    for dtype, rel in ((F64, 1e-9), (torch.float32, 1e-6)):
        logits, labels = _batch(tok, seed=2, dtype=dtype)
        x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = ours_fn(x1, labels)
        ntl = theirs_fn(x2, labels)
        assert float(out.components["ntl"]) == pytest.approx(float(ntl), rel=rel, abs=rel)
        if dtype == F64:
            flat = x2.reshape(-1, x2.shape[-1])
            want = F.cross_entropy(flat, labels.reshape(-1)) + 0.3 * ntl  # CE + 0.3·NTL
            assert float(out.loss) == pytest.approx(float(want), rel=1e-9)
            out.loss.backward()
            want.backward()
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-7, atol=1e-10)


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Σ w_t·CE_t / Σ w_t over the counted labels, by hand."""
    flat, y, w = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), weights.reshape(-1)
    ce = F.cross_entropy(flat, y, reduction="none", ignore_index=-100)
    return (w * ce).sum() / w[y != -100].sum()


@pytest.mark.parametrize("tok_name", ["char", "gpt2"])
@pytest.mark.parametrize("kind", ["mse", "l1", "was", "was-squash"])
@pytest.mark.parametrize("reweigh", [True, False])
def test_token_level_loss_weights_equal_ntloss(tok_name: str, kind: str, reweigh: bool) -> None:
    """Per-token ``loss_weights`` (zeros included, one inside "12.57"): the NTL term is
    ntloss's own weighted output (Σ w·ℓ / Σ w over number tokens; 1e-12 in float64) and the
    loss the weighted CE + 0.3·NTL, gradient included, on both routes' logits route."""
    tok = _real(tok_name)
    if kind.startswith("was"):
        squash = 30.0 if kind == "was-squash" else None
        theirs_fn = ntloss.NTLoss(tok, vocab_size=len(tok), reweigh=reweigh, squash_factor=squash)
        ours_fn = NTLWASLoss(tok, preset="ntloss", reweigh=reweigh, squash_factor=squash)
    else:
        theirs_fn = ntloss.NTLossDotProduct(
            tok, vocab_size=len(tok), reweigh=reweigh, loss_function=LOSS_FUNCTIONS[kind]
        )
        ours_fn = NTLMSELoss(tok, preset="ntloss", loss=kind, reweigh=reweigh)
    logits, labels = _batch(tok, seed=5, dtype=F64)
    gen = torch.Generator().manual_seed(6)
    weights = 2.0 * torch.rand(labels.shape, generator=gen, dtype=F64)
    weights[0, 1] = weights[1, 5] = weights[2, 7] = 0.0  # [0, 1]: the '2' of "12.57"
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = ours_fn(x1, labels, loss_weights=weights)
    ntl = theirs_fn(x2, labels, loss_weights=weights)
    want = _weighted_ce(x2, labels, weights) + 0.3 * ntl
    unweighted = theirs_fn(logits, labels)
    assert float(ntl.detach()) > 0.1 and abs(float(ntl - unweighted)) > 1e-6  # not 0 == 0
    assert float(out.components["ntl"]) == pytest.approx(float(ntl), rel=1e-12, abs=1e-12)
    assert float(out.loss) == pytest.approx(float(want), rel=1e-12, abs=1e-12)
    out.loss.backward()
    want.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tok_name", ["char", "gpt2"])
@pytest.mark.parametrize("reweigh", [True, False])
@pytest.mark.parametrize("float_level", [False, True])
def test_number_level_loss_weights_equal_ntloss(
    tok_name: str, reweigh: bool, float_level: bool
) -> None:
    """Per-token ``loss_weights`` equal within each number (ntloss weighs a number by its first
    digit's weight, emdlm by its tokens' mean weight: the same here) and 0 on a few non-number
    tokens: the NTL term is ntloss's weighted output, the loss the weighted CE + 0.3·NTL,
    gradient included."""
    tok = _real(tok_name)
    theirs_fn = ntloss.NumberLevelLoss(
        tok, vocab_size=len(tok), reweigh=reweigh, float_level=float_level
    )
    ours_fn = NumberLevelLoss(tok, preset="ntloss", reweigh=reweigh, float_level=float_level)
    logits, labels = _batch(tok, seed=2, dtype=F64)
    weights = torch.tensor([0.5, 1.7, 1.2], dtype=F64)[:, None].expand(labels.shape).clone()
    digits = torch.tensor([tok.convert_tokens_to_ids(str(k)) for k in range(10)])
    dot = tok.convert_tokens_to_ids(".")
    other = ~torch.isin(labels, digits) & (labels != dot) & (labels != -100)
    weights[other & (torch.arange(labels.shape[1]) % 2 == 0)] = 0.0  # zeros off the numbers
    assert (weights == 0).any()
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = ours_fn(x1, labels, loss_weights=weights)
    ntl = theirs_fn(x2, labels, loss_weights=weights)
    want = _weighted_ce(x2, labels, weights) + 0.3 * ntl
    assert float(ntl.detach()) > 0.01 and abs(float(ntl - theirs_fn(logits, labels))) > 1e-6
    assert float(out.components["ntl"]) == pytest.approx(float(ntl), rel=1e-9, abs=1e-12)
    assert float(out.loss) == pytest.approx(float(want), rel=1e-9)
    out.loss.backward()
    want.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-7, atol=1e-10)


def test_float_level_chain_is_the_documented_difference() -> None:
    """"5.8.2": ntloss reads one number (582), emdlm 5.8 and 2 (emdlm.functional.ntl NOTE)."""
    tok = _real("char")
    ids = [tok.convert_tokens_to_ids(c) for c in "5.8.2x"]
    labels = torch.tensor([ids])
    logits = torch.randn(1, 6, len(tok), dtype=F64, generator=torch.Generator().manual_seed(0))
    ours = NumberLevelLoss(tok, preset="ntloss", float_level=True, reweigh=False)(logits, labels)
    theirs = ntloss.NumberLevelLoss(tok, vocab_size=len(tok), float_level=True, reweigh=False)
    assert int(ours.components["n_numbers"]) == 2
    assert float(ours.components["ntl"]) != pytest.approx(float(theirs(logits, labels)))


# --- hand-worked numbers and properties ------------------------------------------------------


def _digit_logits(probs: list[float]) -> torch.Tensor:
    """[1, 1, V] logits whose softmax puts ``probs`` on '0'..'9' of VOCAB and ~0 elsewhere."""
    z = torch.full((1, 1, V), -60.0, dtype=F64)
    z[0, 0, :10] = torch.tensor(probs, dtype=F64).clamp_min(1e-300).log()
    return z


def test_hand_worked_mse_and_reweigh() -> None:
    """p = ½·'2' + ½·'6' against gold '3': ŷ = 4, MSE 1, L1 1; with half the mass on 'a'
    the reweighed MSE is 1·½ + 1.01·81·½."""
    probs = [0, 0, 0.5, 0, 0, 0, 0.5, 0, 0, 0]
    labels = torch.tensor([[3]])
    for loss in ("mse", "l1"):
        out = NTLMSELoss(VOCAB, loss=loss, reweigh=False)(_digit_logits(probs), labels)
        assert float(out.components["ntl"]) == pytest.approx(1.0)
    z = _digit_logits(probs)
    z[0, 0, TOKENS.index("a")] = torch.logsumexp(z[0, 0, :10], 0)  # as much mass on 'a'
    out = NTLMSELoss(VOCAB)(z, labels)
    assert float(out.components["number_mass"]) == pytest.approx(0.5)
    assert float(out.components["ntl"]) == pytest.approx(0.5 + 1.01 * 81 * 0.5)


def test_hand_worked_was() -> None:
    """p = ½·'3' + ½·'5' against gold '4': NTL-WAS = ½·1 + ½·1 = 1 where NTL-MSE is 0 (ŷ = 4);
    against gold '3' it is ½·2 = 1; with half the mass on 'a' the reweighed value is
    1·½ + 1.01·9·½ (R = 9, the digits' range)."""
    probs = [0, 0, 0, 0.5, 0, 0.5, 0, 0, 0, 0]
    for gold, want in ((4, 1.0), (3, 1.0), (0, 4.0)):
        labels = torch.tensor([[gold]])
        out = NTLWASLoss(VOCAB, reweigh=False)(_digit_logits(probs), labels)
        assert float(out.components["ntl"]) == pytest.approx(want)
    mse = NTLMSELoss(VOCAB, reweigh=False)(_digit_logits(probs), torch.tensor([[4]]))
    assert float(mse.components["ntl"]) == pytest.approx(0.0, abs=1e-12)
    z = _digit_logits(probs)
    z[0, 0, TOKENS.index("a")] = torch.logsumexp(z[0, 0, :10], 0)  # as much mass on 'a'
    out = NTLWASLoss(VOCAB)(z, torch.tensor([[4]]))
    assert float(out.components["ntl"]) == pytest.approx(0.5 + 1.01 * 9 * 0.5)


def test_hand_worked_squash_factor() -> None:
    """ntloss's squashed distances, 1 + (d − d_min)·(s − 1)/(d_max − d_min) for d > 0:

    * digits (d_min 1, d_max 9), s = 5: p = ½·'3' + ½·'9' against gold '1' has distances 2 and
      8, squashed to 1.5 and 4.5, so NTL-WAS = 3 (unsquashed 5); s = 9 is the unsquashed loss;
      with half the mass on 'a' the reweighed value is 3·½ + 1.01·5·½ (R = s).
    * the class {'00', '12', '34', '99'} (leading-place units 0, 1.2, 3.4, 9.9: d_min 1.2,
      d_max 9.9), s = 5: p = ½·'34' + ½·'99' against gold '12' has distances 2.2 and 8.7,
      squashed to 1 + 1.0·4/8.7 and 1 + 7.5·4/8.7: NTL-WAS = 1 + 17/8.7.
    * a class of one token ('Ġ123'): no wrong candidate, NTL-WAS 0 (finite) with reweigh."""
    probs = [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0.5]
    gold = torch.tensor([[1]])
    for s_, want in ((5.0, 3.0), (9.0, 5.0), (None, 5.0)):
        out = NTLWASLoss(VOCAB, reweigh=False, squash_factor=s_)(_digit_logits(probs), gold)
        assert float(out.components["ntl"]) == pytest.approx(want, rel=1e-12)
    z = _digit_logits(probs)
    z[0, 0, TOKENS.index("a")] = torch.logsumexp(z[0, 0, :10], 0)  # as much mass on 'a'
    out = NTLWASLoss(VOCAB, squash_factor=5.0)(z, gold)
    assert float(out.components["ntl"]) == pytest.approx(3.0 * 0.5 + 1.01 * 5.0 * 0.5)
    z = torch.full((1, 1, V), -60.0, dtype=F64)
    z[0, 0, [TOKENS.index("34"), TOKENS.index("99")]] = 0.0
    out = NTLWASLoss(VOCAB, reweigh=False, squash_factor=5.0)(z, torch.tensor([[20]]))
    assert TOKENS[20] == "12"
    assert float(out.components["ntl"]) == pytest.approx(1 + 17 / 8.7, rel=1e-12)
    z = torch.randn(1, 1, V, dtype=F64)
    out = NTLWASLoss(VOCAB, squash_factor=5.0)(z, torch.tensor([[TOKENS.index("Ġ123")]]))
    assert float(out.components["ntl"]) == 0.0


@pytest.mark.parametrize(
    "bad", [1.0, 1, 0.5, 0.0, -3.0, float("nan"), float("inf"), True, "2"]
)
def test_squash_factor_out_of_domain_is_refused(bad: Any) -> None:
    """ntloss asserts squash_factor > 1 (at 1 every wrong digit costs the same); emdlm also
    refuses NaN, ±inf and non-numbers, when the loss is built and in the settings alone."""
    from emdlm.functional.ntl import NTLSettings

    want = r"squash_factor must be a finite number > 1, or None"
    with pytest.raises(ValueError, match=want):
        NTLWASLoss(VOCAB, squash_factor=bad)
    with pytest.raises(ValueError, match=want):
        NTLSettings(loss="was", squash_factor=bad)


def test_squash_factor_is_ntl_was_only() -> None:
    """ntloss takes it on NTLoss (NTL-WAS) only: the other losses have no such parameter, and
    settings that pair it with another token loss are refused."""
    from emdlm.functional.ntl import NTLSettings

    with pytest.raises(ValueError, match="squash_factor applies to NTL-WAS"):
        NTLSettings(loss="mse", squash_factor=2.0)
    with pytest.raises(TypeError, match="squash_factor"):
        NTLMSELoss(VOCAB, squash_factor=2.0)  # type: ignore[call-arg]


def test_hand_worked_number_level() -> None:
    """Gold "12" with '1' sure and p('2') = p('4') = ½ at the units: Ŷ = 13, |13−12|/25."""
    z = torch.full((1, 2, V), -60.0, dtype=F64)
    z[0, 0, 1] = 0.0
    z[0, 1, 2] = z[0, 1, 4] = 0.0
    out = NumberLevelLoss(VOCAB, reweigh=False)(z, torch.tensor([[1, 2]]))
    assert float(out.components["ntl"]) == pytest.approx(1 / 25, rel=1e-6)
    assert int(out.components["n_numbers"]) == 1


def test_smallest_at_gold_and_grows_with_distance() -> None:
    """Peaked on digit j against gold i: NTL-MSE grows with |j − i| and is ~0 at j = i."""
    values = []
    for j in range(10):
        probs = [1e-9] * 10
        probs[j] = 1.0
        values.append(float(NTLMSELoss(VOCAB)(_digit_logits(probs), torch.tensor([[4]])).loss))
    assert min(range(10), key=values.__getitem__) == 4
    assert all(values[4 + k] < values[4 + k + 1] for k in range(5))
    assert all(values[4 - k] < values[4 - k - 1] for k in range(4))


def test_multi_digit_tokens_are_scored_in_their_class() -> None:
    """'12' (class of bare 2-digit tokens: 00, 12, 34, 99) is scored in units of ten; preset
    "ntloss" leaves it out."""
    z = torch.full((1, 1, V), -60.0, dtype=F64)
    z[0, 0, TOKENS.index("34")] = 0.0  # sure of '34'
    labels = torch.tensor([[TOKENS.index("12")]])
    out = NTLMSELoss(VOCAB, reweigh=False)(z, labels)
    assert float(out.components["ntl"]) == pytest.approx((3.4 - 1.2) ** 2)
    assert int(out.components["n_digit_tokens"]) == 1
    none = NTLMSELoss(VOCAB, preset="ntloss")(z, labels)
    assert int(none.components["n_digit_tokens"]) == 0 and float(none.components["ntl"]) == 0.0


def test_number_mask_leaves_numbers_out() -> None:
    """A number with a token outside the mask is not scored; CE stays on every label."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(1, 6, V, dtype=F64, generator=gen)
    labels = torch.tensor([[1, 2, TOKENS.index("a"), 3, 4, 5]])  # "12" and "345"
    mask = torch.tensor([[True, True, True, True, False, True]])
    for cls in (NTLMSELoss, NumberLevelLoss):
        full = cls(VOCAB)(z, labels)
        masked = cls(VOCAB)(z, labels, number_mask=mask)
        assert int(full.components["n_digit_tokens"]) == 5
        assert int(masked.components["n_digit_tokens"]) == 2
        assert float(masked.components["ce"]) == float(full.components["ce"])


def test_no_numbers_all_ignored_and_half_precision() -> None:
    gen = torch.Generator().manual_seed(4)
    words = torch.full((2, 5), TOKENS.index("b"))
    for cls in (NTLMSELoss, NumberLevelLoss):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn(2, 5, V, generator=gen).to(dtype).requires_grad_()
            out = cls(VOCAB)(x, words)  # no number: the loss is CE
            ce = F.cross_entropy(x.float().reshape(-1, V), words.reshape(-1))
            assert float(out.loss) == pytest.approx(float(ce), rel=1e-3)
            assert float(out.components["ntl"]) == 0.0
            digits = torch.randint(0, 10, (2, 5), generator=gen)
            assert torch.isfinite(cls(VOCAB)(x, digits).loss)
            out = cls(VOCAB)(x, torch.full((2, 5), -100))
            assert float(out.loss) == 0.0
            out.loss.backward()
            assert torch.equal(x.grad, torch.zeros_like(x.grad))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="labels out of range"):
        NTLMSELoss(VOCAB)(torch.zeros(1, 2, V), torch.tensor([[1, V + 2]]))
    with pytest.raises(ValueError, match="loss must be"):
        NTLMSELoss(VOCAB, loss="l3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preset"):
        NumberLevelLoss(VOCAB, preset="paper")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocabulary rows"):
        NTLMSELoss(VOCAB)(torch.zeros(1, 2, V + 1), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="number_mask"):
        mask = torch.ones(3, dtype=torch.bool)
        NTLMSELoss(VOCAB)(torch.zeros(1, 2, V), torch.tensor([[1, 2]]), number_mask=mask)


# --- gradcheck and the from-hidden path -------------------------------------------------------


def _labels(b: int, t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    numbers = torch.randint(0, 28, (b, t), generator=gen)  # every kind of number token
    other = torch.randint(28, len(TOKENS), (b, t), generator=gen)
    pick = torch.rand(b, t, generator=gen)
    labels = torch.where(pick < 0.7, numbers, other)
    labels[pick > 0.92] = -100
    return labels


CASES = {
    "mse": (NTLMSELoss, {}),
    "l1-ntloss-token": (NTLMSELoss, {"loss": "l1", "preset": "ntloss", "averaging": "token"}),
    "huber-no-reweigh": (NTLMSELoss, {"loss": "huber", "reweigh": False}),
    "was": (NTLWASLoss, {}),
    "was-ntloss-token-no-reweigh": (
        NTLWASLoss, {"preset": "ntloss", "averaging": "token", "reweigh": False}
    ),
    "was-squash": (NTLWASLoss, {"squash_factor": 3.0}),
    "was-ntloss-squash-no-reweigh": (
        NTLWASLoss, {"preset": "ntloss", "reweigh": False, "squash_factor": 20.0}
    ),
    "number": (NumberLevelLoss, {}),
    "number-float-token": (NumberLevelLoss, {"float_level": True, "averaging": "token"}),
    "number-no-reweigh": (NumberLevelLoss, {"reweigh": False, "preset": "ntloss"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck_float64(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stop-gradient in NTL: torch's gradcheck on the logits path and from hidden states
    (soft-cap and logit scale on; chunks of 3 rows split numbers)."""
    keep = functools.partial(chunked_linear_loss, inplace_backward=False)
    monkeypatch.setattr(emdlm.ops.chunked, "chunked_linear_loss", keep)
    cls, options = CASES[case]
    fn = cls(VOCAB, **options)
    labels = _labels(2, 5, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, V, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: fn(z, labels).loss, (x,))
    h = torch.randn(2, 5, 4, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(V, 4, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(V, generator=gen, dtype=F64, requires_grad=True)

    def hidden(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fn.from_hidden(h, w, labels, b, chunk_size=3, softcap=4.0, logit_scale=1.5).loss

    assert torch.autograd.gradcheck(hidden, (h, w, b))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_from_hidden_equals_logits(case: str, reduction: str) -> None:
    cls, options = CASES[case]
    fn = cls(VOCAB, reduction=reduction, **options)
    labels = _labels(3, 11, seed=8)
    gen = torch.Generator().manual_seed(9)
    # float64: the chunked path sums in another order, so float32 agreement depends on the
    # machine's BLAS (a CI run once missed 2e-6 by 1.5e-6 on one gradient element of "sum")
    h0 = torch.randn(3, 11, 16, generator=gen, dtype=F64)
    w0 = torch.randn(V, 16, generator=gen, dtype=F64) * 0.7
    b0 = torch.randn(V, generator=gen, dtype=F64)
    mask = torch.rand(3, 11, generator=gen) < 0.9
    results = []
    for path in ("hidden", "logits"):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        if path == "hidden":
            out = fn.from_hidden(h, w, labels, b, chunk_size=5, number_mask=mask)
        else:
            out = fn(h @ w.T + b, labels, number_mask=mask)
        (2 * out.loss).backward()
        results.append((out, h.grad, w.grad, b.grad))
    (got, *g_got), (want, *g_want) = results
    assert float(want.components["n_digit_tokens"]) > 0
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-12)
    for g, r in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert got.components.keys() == want.components.keys()
    for k in got.components:
        want_k = float(want.components[k])
        assert float(got.components[k]) == pytest.approx(want_k, rel=1e-10, abs=1e-12), k


def test_lam_is_read_from_settings_each_call() -> None:
    """objective.lam_schedule replaces ``settings`` (dataclasses.replace) between steps."""
    import dataclasses

    fn = NTLMSELoss(VOCAB)
    x, labels = torch.randn(1, 4, V), torch.tensor([[1, 2, 3, 30]])
    first = fn(x, labels)
    fn.settings = dataclasses.replace(fn.settings, lam=0.0)
    assert float(fn(x, labels).loss) == pytest.approx(float(first.components["ce"]), rel=1e-6)
