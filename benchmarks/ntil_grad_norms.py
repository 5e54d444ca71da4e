"""Gradient-norm distribution of CE, CE + digit EMD and CE + NTIL (each term on / off) in training.

Trains a tiny GPT-2 on integer arithmetic (operands 1–5 digits, answers up to
6 digits, "+" and "-") with a plain PyTorch loop (AdamW, lr 1e-3, clipping at 1.0) and records per
step the total gradient norm *before* clipping (the value returned by ``clip_grad_norm_``), the
loss components (CE, W·EMD, relative, magnitude, NTIL) and the mix coefficient λ·sg(CE/NTIL).
Every variant uses the same seed, the same initial weights and the same batches. After
training, greedy answers on held-out problems give exact match and mean absolute error.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        .venv/bin/python benchmarks/ntil_grad_norms.py --tokenizer char --out runs.jsonl

``--legacy`` builds the number losses with the settings that reproduce the NTIL of before the
stable preset (no cap on the mix ratio, W·EMD averaged over tokens, magnitude smoothed by one
unit only): the "before" column of docs/results/ntil_grad_norms.md. Variants:

* ``ce``: cross-entropy alone.
* ``emd``: CE + digit EMD (:class:`emdlm.losses.ntil.DigitEMDLoss`, σ = 0).
* ``ntil``: CE + NTIL, default (stable) preset (λ = 0.3, α = β = σ = 0.2); ``--legacy``: the
  paper preset (no stabiliser).
* ``ntil_sigma0`` / ``ntil_alpha0`` / ``ntil_beta0``: NTIL with σ, α or β set to 0.

One JSON line per run: the settings, per-step arrays and the summary (median / p99 / max of the
gradient norm, mix coefficient, terms; held-out metrics).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import Any

import numpy as np
import torch

VARIANTS = ("ce", "emd", "ntil", "ntil_sigma0", "ntil_alpha0", "ntil_beta0")
#: NTILLoss keywords that give the pre-fix behaviour (see emdlm.functional.ntil, NOTE lines).
LEGACY = {"max_ratio": None, "per_number": False, "magnitude_floor": 0.0}


def build_loss(variant: str, tokenizer: Any, vocab_size: int, seed: int, legacy: bool) -> Any:
    """The loss module of one variant (Gumbel noise from its own seeded generator)."""
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss

    if variant == "ce":
        return CrossEntropyLoss()
    extra = dict(LEGACY) if legacy else {}
    if variant == "emd":
        return DigitEMDLoss(tokenizer, vocab_size=vocab_size, **extra)
    terms = {"ntil": {}, "ntil_sigma0": {"sigma": 0.0}, "ntil_alpha0": {"alpha": 0.0}}
    terms["ntil_beta0"] = {"beta": 0.0}
    gen = torch.Generator().manual_seed(seed)
    return NTILLoss(tokenizer, vocab_size=vocab_size, generator=gen, **terms[variant], **extra)


def encode(tokenizer: Any, rows: list[dict[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per example: the prompt masked with -100, the answer + EOS scored."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        answer = [*answer, tokenizer.eos_token_id]
        out.append((prompt + answer, [-100] * len(prompt) + answer))
    return out


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids [B, T], labels [B, T] (-100 on padding) and the attention mask."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(items):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
    lengths = torch.tensor([len(row_ids) for row_ids, _ in items])  # [B]
    mask = (torch.arange(width)[None] < lengths[:, None]).long()  # [B, T]
    return ids, labels, mask


def tiny_gpt2(vocab_size: int, pad_id: int, eos_id: int, seed: int) -> torch.nn.Module:
    """3 layers, width 128, 4 heads (≈ 0.6M parameters besides the embedding), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=128, n_layer=3, n_head=4,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def quantiles(x: list[float]) -> dict[str, float]:
    """Median, 99th percentile and max of a list (finite entries only; NaN count kept)."""
    a = np.asarray(x, dtype=np.float64)
    finite = a[np.isfinite(a)]
    if finite.size == 0:
        return {"median": math.nan, "p99": math.nan, "max": math.nan, "nonfinite": int(a.size)}
    return {
        "median": float(np.median(finite)),
        "p99": float(np.percentile(finite, 99)),
        "max": float(finite.max()),
        "nonfinite": int(a.size - finite.size),
    }


def run(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """Train one variant and return its record."""
    from emdlm.generation import generate_answers
    from emdlm.metrics import exact_match_rate, numeric_errors
    from emdlm.tasks import generate_task
    from emdlm.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    task = {"min_digits": 1, "max_digits": args.max_digits, "ops": "+-"}
    train = generate_task("arithmetic", n=args.steps * args.batch, seed=args.seed, **task)
    test = generate_task("arithmetic", n=args.eval_n, split="test", seed=args.seed, **task)
    data = encode(tokenizer, train)
    model = tiny_gpt2(vocab_size, pad_id, tokenizer.eos_token_id, args.seed)
    loss_fn = build_loss(variant, tokenizer, vocab_size, args.seed, args.legacy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    random.Random(args.seed).shuffle(data)
    log: dict[str, list[float]] = {"grad_norm": [], "loss": []}
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        ids, labels, mask = collate(data[step * args.batch : (step + 1) * args.batch], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = loss_fn(logits[:, :-1], labels[:, 1:])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["grad_norm"].append(float(norm))
        log["loss"].append(float(out.loss.detach()))
        for key in ("ce", "emd", "relative", "magnitude", "ntil", "mix_coef"):
            if key in out.components:
                log.setdefault(key, []).append(float(out.components[key]))
    train_s = time.perf_counter() - start
    prompts = [row["prompt"] for row in test]
    refs = [row["completion"] for row in test]
    preds = generate_answers(model, tokenizer, prompts, max_new_tokens=10, batch_size=100)
    errors = numeric_errors(preds, refs)
    summary = {k: quantiles(v) for k, v in log.items()}
    return {
        "tokenizer": args.tokenizer,
        "variant": variant,
        "legacy": args.legacy,
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "train_seconds": round(train_s, 1),
        "loss_settings": {
            k: getattr(loss_fn.settings, k, None) if hasattr(loss_fn, "settings") else None
            for k in ("max_ratio", "per_number", "magnitude_floor", "lam", "alpha", "beta", "sigma")
        },
        "summary": summary,
        "eval": {
            "exact_match": exact_match_rate(preds, refs),
            "abs_error_mean": errors["abs_error_mean"],
            "abs_error_median": errors["abs_error_median"],
            "parse_failure_rate": errors["parse_failure_rate"],
            "n": len(refs),
        },
        "log": log,
    }


def load_records(path: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(tokenizer, variant) -> record of a JSONL file written by this script (last one wins)."""
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return {(r["tokenizer"], r["variant"]): r for r in records}


def _stat(rec: dict[str, Any] | None, key: str, stat: str, fmt: str = "{:.3g}") -> str:
    """One summary statistic of a record, "–" when absent."""
    if rec is None or key not in rec["summary"]:
        return "–"
    return fmt.format(rec["summary"][key][stat])


def _metric(rec: dict[str, Any] | None, key: str, fmt: str) -> str:
    """One held-out metric of a record, "–" when absent."""
    return "–" if rec is None else fmt.format(rec["eval"][key])


def markdown_table(before_path: str, after_path: str) -> str:
    """Before / after table: gradient norm median / p99 / max, max mix coefficient, held-out
    exact match and MAE; CE's row is shared (CE did not change)."""
    before, after = load_records(before_path), load_records(after_path)
    lines = [
        "| tokenizer | variant | grad median before → after | p99 before → after | "
        "max before → after | p99 / CE p99 before → after | max λ·ratio before → after | "
        "EM before → after | MAE before → after |",
        "|" + "---|" * 9,
    ]
    order = sorted(before, key=lambda k: (k[0], VARIANTS.index(k[1])))
    for tok, variant in order:
        b = before[(tok, variant)]
        a = after.get((tok, variant), b if variant == "ce" else None)
        ce_p99 = before[(tok, "ce")]["summary"]["grad_norm"]["p99"]
        rel_b = f"{b['summary']['grad_norm']['p99'] / ce_p99:.2f}"
        rel_a = "–" if a is None else f"{a['summary']['grad_norm']['p99'] / ce_p99:.2f}"
        cells = [
            f"{_stat(b, 'grad_norm', stat)} → {_stat(a, 'grad_norm', stat)}"
            for stat in ("median", "p99", "max")
        ]
        cells += [
            f"{rel_b} → {rel_a}",
            f"{_stat(b, 'mix_coef', 'max')} → {_stat(a, 'mix_coef', 'max')}",
            f"{_metric(b, 'exact_match', '{:.3f}')} → {_metric(a, 'exact_match', '{:.3f}')}",
            f"{_metric(b, 'abs_error_mean', '{:.4g}')} → {_metric(a, 'abs_error_mean', '{:.4g}')}",
        ]
        lines.append(f"| {tok} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def term_tails(n_seeds: int = 200, digits: int = 6) -> str:
    """Gradient norm (w.r.t. the logits) of the relative and the magnitude term alone, for random
    logits at a random ``digits``-digit gold number, one draw per seed, before / after.

    Isolates the terms from training: λ = 1, static mix, only the term under test weighted 1.
    """
    from emdlm.losses.ntil import NTILLoss
    from emdlm.numbers import NumberVocab

    tokens = [str(d) for d in range(10)] + ["a", "="]
    vocab = NumberVocab.from_token_strings(tokens)
    rows = []
    for term, weights in (("relative", {"alpha": 1.0}), ("magnitude", {"beta": 1.0})):
        for name, extra in (("before", LEGACY), ("after", {})):
            norms = []
            for seed in range(n_seeds):
                gen = torch.Generator().manual_seed(seed)
                gold = torch.randint(0, 10, (digits,), generator=gen)
                gold[0] = torch.randint(1, 10, (1,), generator=gen)
                labels = torch.cat([torch.tensor([10, 11]), gold, torch.tensor([10])])[None]
                z = (torch.randn(1, labels.shape[1], len(tokens), generator=gen) * 3).double()
                z.requires_grad_()
                kw = {"alpha": 0.0, "beta": 0.0, "emd_weight": 0.0, **weights, **extra}
                fn = NTILLoss(vocab, mix="static", lam=1.0, generator=gen, **kw)
                fn.implementation = "reference"
                out = fn(z, labels)
                ce = torch.nn.functional.cross_entropy(z[0], labels[0])
                (g,) = torch.autograd.grad(out.loss - ce, z)
                norms.append(float(g.norm()))
            q = quantiles(norms)
            rows.append(
                f"| {term} | {name} | {q['median']:.3g} | {q['p99']:.3g} | {q['max']:.3g} |"
            )
    head = "| term | settings | median | p99 | max |\n|---|---|---|---|---|"
    return head + "\n" + "\n".join(rows)


def _step_split(rec: dict[str, Any] | None, warmup: int = 20) -> str:
    """ "step-0 norm / p99 after ``warmup`` steps / max after ``warmup`` steps" of a record."""
    if rec is None:
        return "–"
    g = np.asarray(rec["log"]["grad_norm"])
    tail = g[warmup:]
    return f"{g[0]:.3g} / {np.percentile(tail, 99):.3g} / {tail.max():.3g}"


def markdown_steps_table(before_path: str, after_path: str) -> str:
    """The gradient norm at step 0 (random init) apart from the rest: step 0 / p99 / max over
    steps 20+, before → after."""
    before, after = load_records(before_path), load_records(after_path)
    lines = [
        "| tokenizer | variant | before: step 0 / p99 / max (steps ≥ 20) | after: same |",
        "|---|---|---|---|",
    ]
    for tok, variant in sorted(before, key=lambda k: (k[0], VARIANTS.index(k[1]))):
        b = before[(tok, variant)]
        a = after.get((tok, variant), b if variant == "ce" else None)
        lines.append(f"| {tok} | {variant} | {_step_split(b)} | {_step_split(a)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="char", choices=("char", "gpt2", "qwen"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-digits", type=int, default=5, help="operand digits (1..max)")
    parser.add_argument("--eval-n", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--legacy", action="store_true", help="pre-fix NTIL settings")
    parser.add_argument("--out", help="JSONL file to append one line per run to")
    parser.add_argument(
        "--table", nargs=2, metavar=("BEFORE", "AFTER"), help="print the markdown table and exit"
    )
    parser.add_argument(
        "--term-tails", action="store_true", help="per-term gradient tails on random logits"
    )
    args = parser.parse_args()
    if args.term_tails:
        print(term_tails())
        return
    if args.table:
        print(markdown_table(*args.table))
        print()
        print(markdown_steps_table(*args.table))
        return
    if not args.out:
        parser.error("--out is required to train")
    for variant in args.variants:
        record = run(args, variant)
        s, e = record["summary"], record["eval"]
        coef = s.get("mix_coef", {}).get("max", math.nan)
        print(
            f"{args.tokenizer:5s} {variant:12s} legacy={args.legacy!s:5s} "
            f"grad median {s['grad_norm']['median']:.3g} p99 {s['grad_norm']['p99']:.3g} "
            f"max {s['grad_norm']['max']:.3g} | mix max {coef:.3g} | EM {e['exact_match']:.3f} "
            f"MAE {e['abs_error_mean']:.4g} | {record['train_seconds']} s",
            flush=True,
        )
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
