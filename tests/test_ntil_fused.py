"""NTIL's fused logits path (its chunk objective, emdlm.ops.objectives.ntil, on the engine's
logits driver) equals the reference autograd path."""

from __future__ import annotations

import pytest
import torch

from _number_tokens import TOKENS, VOCAB, V
from emdlm.functional.ntil import resolve_spans
from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
from emdlm.number_spans import SpanOptions
from emdlm.numbers import NumberVocab
from emdlm.ops.chunked import HeadOptions, chunked_logits_loss


def random_labels(b: int, t: int, seed: int, numeric: float = 0.6) -> torch.Tensor:
    """Labels with many numbers: digits mostly, some other tokens, some ignored."""
    gen = torch.Generator().manual_seed(seed)
    digits = torch.randint(0, 10, (b, t), generator=gen)
    other = torch.randint(0, len(TOKENS), (b, t), generator=gen)
    pick = torch.rand(b, t, generator=gen)
    labels = torch.where(pick < numeric, digits, other)
    labels[pick > 0.93] = -100
    return labels


def run(
    impl: str,
    base: torch.Tensor,
    labels: torch.Tensor,
    view: bool = False,
    cls: type[NTILLoss] = NTILLoss,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    x = base.clone().requires_grad_()
    logits = x[:, :-1] if view else x
    fn = cls(VOCAB, implementation=impl, generator=torch.Generator().manual_seed(7), **kw)
    out = fn(logits, labels)
    (2 * out.loss).backward()  # grad_output != 1
    comps = {k: float(v) for k, v in out.components.items()}
    return out.loss.detach(), x.grad, comps


CASES = [
    (preset, mode, reduction, mix, averaging)
    for preset in ("paper", "official")
    for mode in ("argmax", "expected", "gumbel")
    for reduction in ("mean", "sum")
    for mix in ("dynamic", "static")
    for averaging in (None, "token")  # None: the preset's ("batch" / "row")
]


@pytest.mark.parametrize(("preset", "mode", "reduction", "mix", "averaging"), CASES)
def test_fused_equals_reference(
    preset: str, mode: str, reduction: str, mix: str, averaging: str | None
) -> None:
    labels = random_labels(3, 13, seed=len(preset) + len(mode))  # odd sizes
    base = torch.randn(3, 13, V, generator=torch.Generator().manual_seed(1)) * 3
    kw = {
        "preset": preset,
        "value_mode": mode,
        "reduction": reduction,
        "mix": mix,
        "averaging": averaging,
        "chunk_elements": 4 * V,
    }  # several chunks
    loss_f, grad_f, comp_f = run("fused", base, labels, **kw)
    loss_r, grad_r, comp_r = run("reference", base, labels, **kw)
    torch.testing.assert_close(loss_f, loss_r, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(grad_f, grad_r, rtol=1e-5, atol=1e-7)
    assert comp_f.keys() == comp_r.keys()
    for k in comp_f:
        assert comp_f[k] == pytest.approx(comp_r[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_fused_non_contiguous_view(preset: str) -> None:
    labels = random_labels(2, 9, seed=3)
    base = torch.randn(2, 10, V, generator=torch.Generator().manual_seed(2))
    loss_f, grad_f, _ = run(
        "fused", base, labels, view=True, preset=preset, value_mode="argmax", chunk_elements=3 * V
    )
    loss_r, grad_r, _ = run(
        "reference", base, labels, view=True, preset=preset, value_mode="argmax"
    )
    torch.testing.assert_close(loss_f, loss_r, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(grad_f, grad_r, rtol=1e-5, atol=1e-7)
    assert grad_f[:, -1].abs().max() == 0


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_fused_half_precision(dtype: torch.dtype, tol: float) -> None:
    labels = random_labels(2, 11, seed=4)
    base = (torch.randn(2, 11, V, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    loss_f, grad_f, _ = run("fused", base, labels, value_mode="argmax", chunk_elements=2 * V)
    loss_r, grad_r, _ = run("reference", base, labels, value_mode="argmax")
    assert loss_f.dtype == torch.float32 and grad_f.dtype == dtype
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_f.float(), grad_r.float(), rtol=tol, atol=tol * 0.05)


@pytest.mark.parametrize("averaging", [None, "token"])
def test_fused_digit_emd_loss_and_edge_cases(averaging: str | None) -> None:
    base = torch.randn(2, 7, V, generator=torch.Generator().manual_seed(5))
    labels = random_labels(2, 7, seed=5)
    kw = {"cls": DigitEMDLoss, "averaging": averaging}
    for lab in (labels, torch.full_like(labels, -100), torch.full_like(labels, len(TOKENS) - 3)):
        loss_f, grad_f, comp_f = run("fused", base, lab, **kw)
        loss_r, grad_r, comp_r = run("reference", base, lab, **kw)
        torch.testing.assert_close(loss_f, loss_r, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(grad_f, grad_r, rtol=1e-5, atol=1e-7)
        assert comp_f == pytest.approx(comp_r, rel=1e-5, abs=1e-7)
        assert torch.isfinite(grad_f).all()


def test_fused_gradcheck_float64() -> None:
    labels = random_labels(2, 5, seed=6)
    spans = resolve_spans(labels, VOCAB, SpanOptions(join_decimal=True, signed=True))
    assert spans.n_tokens > 0
    for mode, averaging in (("expected", "batch"), ("argmax", "batch"), ("expected", "token")):
        kw = {"mix": "static", "value_mode": mode, "sigma": 0.2, "averaging": averaging}
        if mode == "argmax":  # straight-through: only the EMD part has a true derivative
            kw = {"mix": "static", "value_mode": mode, "alpha": 0.0, "beta": 0.0}
        loss_fn = NTILLoss(VOCAB, preset="paper", **kw)  # type: ignore[arg-type]
        logits = torch.randn(2, 5, V, dtype=torch.float64, requires_grad=True)

        def f(z: torch.Tensor, fn: NTILLoss = loss_fn) -> torch.Tensor:
            # the fused path's objective and driver, keeping the gradient for gradcheck's
            # repeated backward (inplace_backward=False)
            objective, y = fn.chunk_objective(z, labels)
            options = HeadOptions(chunk_size=3)
            return chunked_logits_loss(z, y, objective, options, inplace_backward=False).loss

        assert torch.autograd.gradcheck(f, (logits,), fast_mode=True)


def test_fused_backward_twice_raises_and_eval_uses_reference() -> None:
    labels = random_labels(1, 6, seed=8)
    x = torch.randn(1, 6, V, requires_grad=True)
    out = NTILLoss(VOCAB)(x, labels)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        out.loss.backward()
    with torch.no_grad():
        plain = NTILLoss(VOCAB, value_mode="argmax")(x, labels)
    fused = NTILLoss(VOCAB, value_mode="argmax")(x, labels)
    assert float(plain.loss) == pytest.approx(fused.loss.item(), rel=1e-6)


def test_fused_llama3_like_multi_digit_classes(
    llama3_tokenizer: object, llama3_vocab: NumberVocab
) -> None:
    """1–3 digit tokens: classes up to 1000 candidates; fused == reference, 2-D inputs too."""
    text = "Total: 1234567 items, 3.14159 and -2048 or 7 8 9 and 100000."
    labels = torch.tensor([llama3_tokenizer(text)["input_ids"]] * 2)  # type: ignore[operator]
    labels[1, :3] = -100
    assert int(llama3_vocab.num_digits[labels[labels >= 0]].max()) == 3
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(*labels.shape, llama3_vocab.vocab_size, generator=gen) * 2
    for shape in (base.shape, (-1, base.shape[-1])):
        results = []
        for impl in ("fused", "reference"):
            x = base.clone().requires_grad_()
            fn = NTILLoss(llama3_vocab, value_mode="expected", implementation=impl)
            out = fn(x.reshape(shape), labels.reshape(shape[:-1]))
            (3 * out.loss).backward()
            results.append((out.loss.detach(), x.grad, out.components))
        (loss_f, grad_f, comp_f), (loss_r, grad_r, comp_r) = results
        assert float(comp_f["ntil"]) == pytest.approx(float(comp_r["ntil"]), rel=1e-6)
        torch.testing.assert_close(loss_f, loss_r, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(grad_f, grad_r, rtol=1e-5, atol=1e-7)
        assert int(comp_f["n_numbers"]) == 7 + 7  # per row: 1234567, 3.14159, -2048, 7, 8, 9,
        # 100000 (row 2 loses nothing: its first 3 labels are words)
