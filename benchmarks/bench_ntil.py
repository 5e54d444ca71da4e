"""Speed and memory of CE + NTIL against CE alone and the peers (forward + backward).

Run: ``python benchmarks/bench_ntil.py`` (full size: B=8, T=512, V in {32000, 151936}, fp32).
Small check: ``python benchmarks/bench_ntil.py --batch 2 --time 128 --vocab 8000 --reps 2``.

Methods (same logits and labels for all):
    ce              F.cross_entropy (mean over counted labels): the baseline, ratio 1.00
    ntil_fused      emdlm.NTILLoss (paper preset, Gumbel values), fused path (emdlm.ops)
    ntil_official   emdlm.NTILLoss (official preset, argmax values), fused path
    ntil_reference  emdlm.NTILLoss, plain autograd (implementation="reference")
    digit_emd       emdlm.DigitEMDLoss, fused path
    ntloss          CE + 0.3 · ntloss.NTLoss (NTL-WAS, PyPI ``ntloss``) on the same inputs

Vocabulary: a synthetic WordLevel tokenizer with exactly V tokens: '0'..'9' (one digit per token,
as Qwen / LLaMA-2), 'Ġ0'..'Ġ9' and filler words. Labels: ~15% digit tokens in runs of 1–6
digits ("numbers"), the rest filler words; no ignored labels.

Time: median over ``--reps`` timed forward+backward passes after ``--warmup`` untimed ones.
Memory: peak bytes allocated during one forward+backward above what was allocated before it
(logits and labels excluded; the logits' gradient included). CUDA: torch.cuda.max_memory_allocated.
CPU: each method runs in a fresh subprocess and the peak is the process's peak resident set size
(``resource.getrusage(...).ru_maxrss``) minus its resident size just before the first pass;
PyTorch's CPU allocator returns large blocks to the OS, so this tracks the tensors alive at the peak
(± a few MB of allocator and library overhead).
Output: a markdown table per vocabulary size with ratios to CE.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Any

import torch
import torch.nn.functional as F

from _timing import timed_passes

METHODS = ("ce", "ntil_fused", "ntil_official", "ntil_reference", "digit_emd", "ntloss")


def synthetic_tokens(vocab: int) -> list[str]:
    digits = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)]
    return digits + [f"w{i}" for i in range(vocab - len(digits))]


def make_inputs(
    batch: int, time_: int, vocab: int, device: str, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (leaf, requires grad) and labels with ~15% digit tokens in runs of 1–6."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(20, vocab, (batch, time_), generator=gen)
    n_runs = max(1, int(0.15 * batch * time_ / 3.5))
    for _ in range(n_runs):
        b = int(torch.randint(0, batch, (1,), generator=gen))
        length = int(torch.randint(1, 7, (1,), generator=gen))
        t = int(torch.randint(0, max(1, time_ - length), (1,), generator=gen))
        labels[b, t : t + length] = torch.randint(0, 10, (length,), generator=gen)
    logits = torch.randn(batch, time_, vocab, generator=gen, dtype=torch.float32)
    logits = logits.to(device=device, dtype=dtype).requires_grad_()
    return logits, labels.to(device)


def build_loss(method: str, vocab: int) -> Any:
    """A callable (logits, labels) -> scalar loss for ``method``."""
    if method == "ce":
        return lambda x, y: F.cross_entropy(x.reshape(-1, x.shape[-1]).float(), y.reshape(-1))
    if method == "ntloss":
        from ntloss import NTLoss
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from transformers import PreTrainedTokenizerFast

        tokens = synthetic_tokens(vocab)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, "w0"))
        )
        ntl = NTLoss(tok, vocab_size=vocab)

        def ce_plus_ntl(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ce = F.cross_entropy(x.reshape(-1, x.shape[-1]).float(), y.reshape(-1))
            return ce + 0.3 * ntl(x, y)

        return ce_plus_ntl
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
    from emdlm.numbers import NumberVocab

    number_vocab = NumberVocab.from_token_strings(synthetic_tokens(vocab))
    if method == "ntil_fused":
        fn = NTILLoss(number_vocab, generator=torch.Generator().manual_seed(0))
    elif method == "ntil_official":
        fn = NTILLoss(number_vocab, preset="official", value_mode="argmax")
    elif method == "ntil_reference":
        fn = NTILLoss(number_vocab, implementation="reference")
    elif method == "digit_emd":
        fn = DigitEMDLoss(number_vocab)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return lambda x, y: fn(x, y).loss


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(method: str, args: argparse.Namespace) -> dict[str, float]:
    """Peak memory of the first pass, then the median time of ``reps`` passes."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    logits, labels = make_inputs(args.batch, args.time, args.vocab, args.device, dtype)
    loss_fn = build_loss(method, args.vocab)
    _sync(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    loss_fn(logits, labels).backward()
    _sync(args.device)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - before
    else:  # ru_maxrss is in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before

    def clear_grad() -> None:
        logits.grad = None

    times = timed_passes(lambda: loss_fn(logits, labels).backward(), warmup=args.warmup,
                         reps=args.reps, sync=lambda: _sync(args.device), before_each=clear_grad)
    return {"time_s": statistics.median(times), "peak_bytes": float(peak)}


def run_isolated(method: str, args: argparse.Namespace) -> dict[str, float]:
    """Run ``measure`` in a fresh subprocess (clean peak-memory accounting)."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--batch",
        str(args.batch),
        "--time",
        str(args.time),
        "--vocab",
        str(args.vocab),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(vocab: int, results: dict[str, dict[str, Any]]) -> str:
    ce = results.get("ce", {})
    lines = [
        f"V = {vocab}",
        "",
        "| method | fwd+bwd (s) | x CE | peak memory (MiB) | x CE |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, res in results.items():
        if "error" in res:
            lines.append(f"| {method} | error: {res['error']} | | | |")
            continue
        t, m = res["time_s"], res["peak_bytes"]
        t_ratio = t / ce["time_s"] if "time_s" in ce else float("nan")
        m_ratio = m / ce["peak_bytes"] if ce.get("peak_bytes") else float("nan")
        lines.append(f"| {method} | {t:.3f} | {t_ratio:.2f} | {m / 2**20:.0f} | {m_ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time", type=int, default=512)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker is not None:
        args.vocab = args.vocab[0] if isinstance(args.vocab, list) else args.vocab
        print(json.dumps(measure(args.worker, args)))
        return
    print(
        f"# CE + NTIL benchmark: B={args.batch} T={args.time} dtype={args.dtype} "
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}\n"
    )
    for vocab in args.vocab:
        sub = argparse.Namespace(**{**vars(args), "vocab": vocab})
        results = {m: run_isolated(m, sub) for m in args.methods}
        print(table(vocab, results) + "\n", flush=True)


if __name__ == "__main__":
    main()
