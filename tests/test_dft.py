"""DFT (dynamic fine-tuning): pinned to TRL 1.16's own ``loss_type="dft"`` loss, a restated
reference, hand-worked numbers, float64 gradcheck and the from-hidden path."""

from __future__ import annotations

import math

import pytest
import torch

from emdlm.functional.dft import dft_loss
from emdlm.losses.dft import DFTLoss

F64 = torch.float64


def _case(seed: int, dtype: torch.dtype = F64, vocab: int = 19):
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(3, 7, vocab, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (3, 7), generator=gen)
    labels[0, 4:] = -100
    labels[2, 0] = -100
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRL's lines restated: -log_probs * exp(log_probs).detach(), summed, / count (≥ 1)."""
    log_probs = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1))
    log_probs = log_probs.squeeze(-1).masked_fill(labels == -100, 0.0)
    per_token = -log_probs * log_probs.exp().detach()
    return per_token.sum() / (labels != -100).sum().clamp(min=1)


def test_hand_worked() -> None:
    """Uniform logits over 4 tokens: q_y = 1/4, CE = log 4, L = log(4)/4 per token."""
    out = DFTLoss()(torch.zeros(1, 3, 4, dtype=F64), torch.tensor([[1, -100, 3]]))
    assert float(out.loss) == pytest.approx(math.log(4) / 4, rel=1e-12)
    assert float(out.components["weight_mean"]) == pytest.approx(0.25)
    assert int(out.components["n_tokens"]) == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_equals_restated_trl_lines(seed: int) -> None:
    logits, labels = _case(seed)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = DFTLoss()(x1, labels).loss
    want = _reference(x2, labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    (2 * got).backward()
    (2 * want).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-14)


def test_gradient_is_q_y_times_ce_gradient() -> None:
    """dL/dz = sg(q_y)·(q − onehot)/n: the weight is a constant to autograd."""
    logits, labels = _case(2)
    x = logits.clone().requires_grad_()
    DFTLoss(reduction="sum")(x, labels).loss.backward()
    q = torch.softmax(logits, -1)
    valid = labels != -100
    onehot = torch.nn.functional.one_hot(labels.clamp_min(0), logits.shape[-1]).to(F64)
    q_y = q.gather(-1, labels.clamp_min(0).unsqueeze(-1))
    want = torch.where(valid.unsqueeze(-1), q_y * (q - onehot), 0.0)
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-14)


def _central_differences(fn, x: torch.Tensor, step: float = 1e-6) -> torch.Tensor:
    """Numerical gradient of the scalar fn at x (float64), entry by entry."""
    grad = torch.zeros_like(x)
    flat, out = x.detach().clone().reshape(-1), grad.reshape(-1)
    for i in range(flat.numel()):
        keep = float(flat[i])
        flat[i] = keep + step
        up = float(fn(flat.view_as(x)))
        flat[i] = keep - step
        down = float(fn(flat.view_as(x)))
        flat[i] = keep
        out[i] = (up - down) / (2 * step)
    return grad


def test_gradcheck_float64_with_the_weight_held() -> None:
    """Float64 gradcheck of both paths against central differences of L(z) = Σ w·CE(z)/n with
    w = q_y(z₀) held (the stop-gradient: torch's gradcheck would differentiate the weight)."""
    logits, labels = _case(3, vocab=7)
    z0, y = logits[:2, :4].clone(), labels[:2, :4]
    valid = y != -100
    w0 = torch.softmax(z0, -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)

    def held(z: torch.Tensor) -> torch.Tensor:
        ce = -torch.log_softmax(z, -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return torch.where(valid, w0 * ce, 0.0).sum() / valid.sum()

    x = z0.clone().requires_grad_()
    dft_loss(x, y).loss.backward()
    torch.testing.assert_close(x.grad, _central_differences(held, z0), rtol=1e-6, atol=1e-8)
    # from hidden states: z = h Wᵀ, the same held weight
    gen = torch.Generator().manual_seed(8)
    h0 = torch.randn(2, 4, 5, generator=gen, dtype=F64)
    w = torch.randn(7, 5, generator=gen, dtype=F64)
    z0 = h0 @ w.T
    w0 = torch.softmax(z0, -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    h = h0.clone().requires_grad_()
    DFTLoss().from_hidden(h, w, y, chunk_size=3).loss.backward()
    want = _central_differences(lambda a: held(a @ w.T), h0)
    torch.testing.assert_close(h.grad, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_from_hidden_equals_logits(reduction: str) -> None:
    gen = torch.Generator().manual_seed(4)
    # float64: the chunked path sums in another order; float32 agreement would depend on the BLAS
    h = torch.randn(3, 7, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(19, 6, generator=gen, dtype=torch.float64)
    _, labels = _case(4)
    fn = DFTLoss(reduction=reduction)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = fn.from_hidden(h1, w1, labels, chunk_size=4)
    want = fn(h2 @ w2.T, labels)
    (2 * got.loss).backward()
    (2 * want.loss).backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    assert got.components.keys() == want.components.keys()
    for k in got.components:
        assert float(got.components[k]) == pytest.approx(float(want.components[k]), rel=1e-10)


def test_all_ignored_and_half_precision() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 3, 11).to(dtype).requires_grad_()
        out = DFTLoss()(x, torch.full((2, 3), -100))
        assert float(out.loss) == 0.0
        out.loss.backward()
        assert torch.equal(x.grad, torch.zeros_like(x.grad))
        labels = torch.randint(0, 11, (2, 3))
        assert torch.isfinite(DFTLoss()(x, labels).loss)


def test_bad_labels_raise() -> None:
    with pytest.raises(ValueError, match="labels out of range"):
        DFTLoss()(torch.zeros(1, 2, 4), torch.tensor([[1, 9]]))
    with pytest.raises(ValueError, match="reduction"):
        DFTLoss(reduction="none")  # type: ignore[arg-type]


# --- pinned: TRL's own SFTTrainer.compute_loss with loss_type="dft" ------------------------


def test_equals_trl_sft_trainer_dft(tmp_path) -> None:
    """TRL 1.16 ``SFTTrainer(args=SFTConfig(loss_type="dft")).compute_loss`` on a tiny GPT-2
    and a real batch equals DFTLoss on the same model's shifted logits (value and gradient),
    for the micro-batch's own count and for a given ``num_items_in_batch``."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from test_trl_integration import char_tokenizer, tiny_gpt2

    tok = char_tokenizer()
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in
            [(3, 4), (12, 30), (7, 99), (55, 5), (1, 0), (40, 41)]]  # fmt: skip
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=6,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, max_length=32,
        disable_tqdm=True, bf16=False, loss_type="dft",
    )  # fmt: skip
    model = tiny_gpt2(len(tok))
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
    )  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    labels = batch["labels"][:, 1:]
    n_scored = int((labels != -100).sum())
    assert 0 < n_scored < labels.numel()
    fn = DFTLoss(reduction="sum")
    worst = 0.0
    for n_items in (None, 50):
        model.zero_grad()
        theirs = trainer.compute_loss(model, dict(batch), num_items_in_batch=n_items)
        theirs.backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        ours = fn(out.logits[:, :-1], labels).loss / (n_items or n_scored)
        ours.backward()
        worst = max(worst, abs(float(ours) - float(theirs)))
        assert float(ours) == pytest.approx(float(theirs), rel=1e-6, abs=1e-7)
        for p, g in zip(model.parameters(), ref, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    print(f"max |DFTLoss - TRL dft| = {worst:.3g}")
