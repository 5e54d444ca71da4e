"""Train a tiny GPT-2 on addition with an emdlm loss in a plain PyTorch loop (no Trainer).

    python examples/plain_pytorch_loop.py --steps 200 --loss ntil

Any emdlm loss drops in: every loss module is called as ``loss_fn(logits, labels)`` on
aligned tensors and returns a ``LossOutput`` (``.loss`` to back-propagate, ``.components`` to
log). The causal shift is done here, once: position t predicts token t+1, so the call is
``loss_fn(logits[:, :-1], labels[:, 1:])``. :func:`build_loss` shows the swap: CE, NTIL and the
digit-EMD baseline go through the same loop unchanged (the number losses need to know which
ids are digits: a ``NumberVocab`` built from the token strings).

The data are character-level "a+b=c" strings with the loss on the answer only (prompt labels
are -100), so the example needs nothing from the network.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from emdlm.losses.ce import CrossEntropyLoss

PAD, EOS = 0, 1
CHARS = "0123456789+="
STOI = {c: i + 2 for i, c in enumerate(CHARS)}  # 0 = pad, 1 = end of answer
TOKENS = ["<pad>", "<eos>", *CHARS]  # the text of every id
VOCAB_SIZE = len(TOKENS)
LOSSES = ("ce", "ntil", "digit-emd")


def build_loss(name: str, seed: int = 0) -> torch.nn.Module:
    """An emdlm loss by name; each is called the same way and returns a LossOutput."""
    if name == "ce":
        return CrossEntropyLoss()
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
    from emdlm.numbers import NumberVocab

    number_vocab = NumberVocab.from_token_strings(TOKENS)  # digits '0'..'9' are ids 2..11
    if name == "ntil":
        # NTIL's Gumbel noise gets its own generator, so runs are reproducible
        return NTILLoss(number_vocab, generator=torch.Generator().manual_seed(seed))
    if name == "digit-emd":
        return DigitEMDLoss(number_vocab)
    raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES}")


def make_batch(
    rng: random.Random, batch_size: int, max_operand: int = 99
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and labels [B, T] for "a+b=c<eos>", right-padded; loss on "c<eos>"."""
    rows, prompt_lens = [], []
    for _ in range(batch_size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        prompt, answer = f"{a}+{b}=", str(a + b)
        rows.append([STOI[c] for c in prompt + answer] + [EOS])
        prompt_lens.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.full((batch_size, width), PAD, dtype=torch.long)  # [B, T]
    labels = torch.full((batch_size, width), -100, dtype=torch.long)  # [B, T]
    for i, (row, p) in enumerate(zip(rows, prompt_lens, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, p : len(row)] = ids[i, p : len(row)]
    return ids, labels


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer, 64-wide GPT-2 built from a config (random weights, nothing downloaded)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=32, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(
    loss_fn: torch.nn.Module | None = None,
    *,
    steps: int = 200,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
) -> list[float]:
    """Train a tiny GPT-2 for ``steps`` steps; return the loss of every step."""
    loss_fn = loss_fn if loss_fn is not None else CrossEntropyLoss()
    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    history: list[float] = []
    model.train()
    for step in range(steps):
        ids, labels = make_batch(rng, batch_size)
        attention_mask = (ids != PAD).long()
        logits = model(input_ids=ids, attention_mask=attention_mask).logits  # [B, T, V]
        out = loss_fn(logits[:, :-1], labels[:, 1:])  # the causal shift, done once here
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(out.loss.item())  # one host sync per step (fine on CPU; log less on GPU)
        if log_every and (step % log_every == 0 or step == steps - 1):
            parts = " ".join(f"{k}={v:.4g}" for k, v in out.detached_components().items())
            print(f"step {step:4d} loss {history[-1]:.4f} {parts}")
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss", choices=LOSSES, default="ce")
    args = parser.parse_args(argv)
    history = train(
        build_loss(args.loss, args.seed), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        seed=args.seed, log_every=max(1, args.steps // 10),
    )  # fmt: skip
    print(f"first loss {history[0]:.4f} -> last loss {history[-1]:.4f}")


if __name__ == "__main__":
    main()
