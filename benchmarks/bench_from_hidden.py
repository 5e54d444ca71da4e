"""The loss alone from hidden states (forward + backward): full logits vs emdlm's chunked engine.

Run: ``python benchmarks/bench_from_hidden.py`` (N = 4096 rows, H = 896, V in {32000, 151936},
float32, 2 timed reps after 1 warm-up). Small check:
``python benchmarks/bench_from_hidden.py --rows 256 --vocab 4000 --reps 1 --warmup 0``.

Methods (same hidden states, head weight and labels; gradients w.r.t. hidden and weight):
    logits_ce       F.cross_entropy((h @ W.T), y): the [N, V] logits path, ratio 1.00
    logits_ntil     emdlm.NTILLoss (paper preset) on h @ W.T (its fused logits path)
    ce              emdlm.CrossEntropyLoss().from_hidden(h, W, y)      (emdlm.ops.chunked)
    ce_ntil         emdlm.NTILLoss(...).from_hidden(h, W, y)           (CE + NTIL, paper preset)
    tailr           emdlm.TaiLrLoss().from_hidden(h, W, y)
    ntl_mse         emdlm.NTLMSELoss(...).from_hidden(h, W, y)         (CE + 0.3 NTL-MSE)
    ntl_was         emdlm.NTLWASLoss(...).from_hidden(h, W, y)         (CE + 0.3 NTL-WAS)
    number_level    emdlm.NumberLevelLoss(...).from_hidden(h, W, y)    (CE + 0.3 number-level)
    dft             emdlm.DFTLoss().from_hidden(h, W, y)
    ce_options      CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-4, token_accuracy=True)
    ce_entropy      CrossEntropyLoss(entropy=True): the per-token entropy as a component
    ce_predicted    CrossEntropyLoss(predicted_tokens=True): the argmax token per position
    ce_weighted     CrossEntropyLoss() with per-token loss_weights (uniform in [0, 2), seed 0)
    ce_ntil_weighted  the ce_ntil loss with the same loss_weights
    cce_torch       Cut Cross-Entropy's ``linear_cross_entropy(..., impl="torch_compile")``
                    (only if ``cut_cross_entropy`` imports in the child's Python, --child-python)

Vocabulary: '0'..'9', 'Ġ0'..'Ġ9' and filler tokens (a NumberVocab from these strings, V rows);
labels: ~15 % digit tokens in runs of 1–6 digits, the rest filler; no ignored labels.

Time: median of ``--reps`` forward+backward passes after ``--warmup`` untimed ones; with
``--interleave R`` (time only, one process) the methods alternate for R rounds and each one's
fastest pass is reported, which is fairer on a loaded, shared machine.
Memory: each method runs in a fresh subprocess; peak resident set size minus the resident size
just before the first timed pass (inputs excluded; gradients of hidden and weight included). With
``--warmup`` > 0 the peak is reset after the warm-up (Linux ``/proc/self/clear_refs``), so
torch.compile's compilation is not counted; with 0 it is ``ru_maxrss``. PyTorch's CPU
allocator returns large blocks to the OS, so this tracks the tensors
alive at the peak (± a few MB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from _rss import peak_rss_mib, reset_peak_rss, rss_mib
from _table import print_ratio_table
from _timing import timed_passes

METHODS = ("logits_ce", "logits_ntil", "ce", "ce_ntil", "tailr", "ntl_mse", "ntl_was",
           "number_level", "dft", "ce_options", "ce_entropy", "ce_predicted", "ce_weighted",
           "ce_ntil_weighted", "cce_torch")








def make_inputs(rows: int, hidden: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden [N, H], weight [V, H] (leaves) and labels [1, N] with ~15 % digit runs."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(20, vocab, (rows,), generator=gen)
    starts = torch.randint(0, max(1, rows - 6), (max(1, int(0.15 * rows / 3.5)),), generator=gen)
    lengths = torch.randint(1, 7, starts.shape, generator=gen)
    offsets = torch.arange(6)
    pos = (starts[:, None] + offsets).clamp_max(rows - 1)
    keep = offsets < lengths[:, None]
    labels[pos[keep]] = torch.randint(0, 10, (int(keep.sum()),), generator=gen)
    h = (torch.randn(rows, hidden, generator=gen)).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    return h, w, labels[None]


def build(method: str, vocab: int) -> Any:
    """A callable (h, w, labels) -> scalar loss."""
    if method == "logits_ce":
        return lambda h, w, y: F.cross_entropy(h @ w.T, y.reshape(-1))
    if method == "cce_torch":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y.reshape(-1), impl="torch_compile")
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.dft import DFTLoss
    from emdlm.losses.ntil import NTILLoss
    from emdlm.losses.ntl import NTLMSELoss, NTLWASLoss, NumberLevelLoss
    from emdlm.losses.tailr import TaiLrLoss
    from emdlm.numbers import NumberVocab

    digits = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)]
    number_vocab = NumberVocab.from_token_strings(digits, vocab)
    if method == "logits_ntil":
        fn = NTILLoss(number_vocab, value_mode="argmax")
        return lambda h, w, y: fn(h @ w.T, y.reshape(-1)).loss
    fn = {
        "ce": CrossEntropyLoss(),
        "ce_ntil": NTILLoss(number_vocab, value_mode="argmax"),
        "tailr": TaiLrLoss(),
        "ntl_mse": NTLMSELoss(number_vocab),
        "ntl_was": NTLWASLoss(number_vocab),
        "number_level": NumberLevelLoss(number_vocab),
        "dft": DFTLoss(),
        "ce_options": CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-4, token_accuracy=True),
        "ce_entropy": CrossEntropyLoss(entropy=True),
        "ce_predicted": CrossEntropyLoss(predicted_tokens=True),
        "ce_weighted": CrossEntropyLoss(),
        "ce_ntil_weighted": NTILLoss(number_vocab, value_mode="argmax"),
    }[method]
    if method.endswith("_weighted"):
        def weighted(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator().manual_seed(0)
            weights = 2 * torch.rand(y.numel(), generator=gen, dtype=h.dtype)
            return fn.from_hidden(h, w, y.reshape(-1), loss_weights=weights).loss
        return weighted
    return lambda h, w, y: fn.from_hidden(h, w, y.reshape(-1)).loss


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    h, w, labels = make_inputs(args.rows, args.hidden, args.vocab)
    loss_fn = build(args.method, args.vocab)
    probe = {"base": rss_mib(), "reset": False}

    def clear_grads() -> None:
        h.grad, w.grad = None, None

    def start_probe() -> None:
        # After the warm-up (torch.compile's compilation included) measure from here on:
        # "5" in clear_refs resets the peak RSS (VmHWM) on Linux.
        probe["base"], probe["reset"] = rss_mib(), reset_peak_rss()

    times = timed_passes(lambda: loss_fn(h, w, labels).backward(), warmup=args.warmup,
                         reps=args.reps, before_each=clear_grads, after_warmup=start_probe)
    base, peak = probe["base"], peak_rss_mib(bool(probe["reset"]))
    print(json.dumps({"time": statistics.median(times), "peak": peak - base}))


def interleaved_times(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Min time per method over ``--interleave`` rounds, methods alternating in one process.

    On a shared machine the load changes between subprocess runs; alternating the methods and
    taking each one's fastest round compares them under the same conditions (time only).
    """
    torch.set_num_threads(args.threads)
    h, w, labels = make_inputs(args.rows, args.hidden, vocab)
    fns = {m: build(m, vocab) for m in args.methods}
    best = dict.fromkeys(args.methods, float("inf"))
    for _ in range(args.interleave):
        for m, fn in fns.items():
            h.grad, w.grad = None, None
            start = time.perf_counter()
            fn(h, w, labels).backward()
            best[m] = min(best[m], time.perf_counter() - start)
    return best


def run_case(args: argparse.Namespace, method: str, vocab: int) -> dict[str, float] | str:
    python = args.child_python if method == "cce_torch" and args.child_python else sys.executable
    cmd = [python, __file__, "--child", method, "--vocab", str(vocab)]
    for name in ("rows", "hidden", "reps", "warmup", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    # A fixed mmap threshold keeps glibc from caching freed blocks of up to 32 MiB on the heap
    # after a warm-up (its dynamic threshold), which would hide them from the peak above base.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--methods", nargs="+", default=list(METHODS[:5]), choices=METHODS)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child-python", default=None, help="Python for cce_torch")
    parser.add_argument(
        "--interleave", type=int, default=0, help="time only: min over R alternating rounds"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.method, args.vocab = args.child, args.vocab[0]
        child(args)
        return
    print(
        f"# Loss from hidden states: N={args.rows} H={args.hidden} float32 cpu "
        f"torch={torch.__version__} threads={args.threads}\n"
    )
    if args.interleave:
        for vocab in args.vocab:
            best = interleaved_times(args, vocab)
            print(f"V = {vocab}, min over {args.interleave} alternating rounds\n")
            print("| method | fwd+bwd (s) | x logits CE |\n|---|---:|---:|")
            ref = best.get("logits_ce")
            for m, t in best.items():
                print(f"| {m} | {t:.3f} | {t / ref:.2f} |" if ref else f"| {m} | {t:.3f} | - |")
            print(flush=True)
        return
    for vocab in args.vocab:
        results = {m: run_case(args, m, vocab) for m in args.methods}
        print_ratio_table(vocab, results, reference="logits_ce", time_digits=3)

if __name__ == "__main__":
    main()
