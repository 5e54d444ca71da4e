"""The loss alone from hidden states against peer fused-linear cross-entropies (CPU).

Forward + backward of the LM-head loss only (gradients
w.r.t. the hidden states and the head weight), N rows, H = 896, float32, at
V in {32000, 151936, 128256}.

Methods (same hidden states, head weight and labels; ~10 % of the labels ignored):
    logits_ce     ``F.cross_entropy(h @ W.T, y)``: the full [N, V] logits path, ratio 1.00
    emdlm_ce      ``emdlm.CrossEntropyLoss().from_hidden(h, W, y)`` (emdlm.ops.chunked, default
                  chunk 2^26 / V rows)
    cce_torch     Cut Cross-Entropy's ``linear_cross_entropy(h, W, y, impl="torch_compile")``
                  (its pure-PyTorch fallback: torch.compile of the logits -> CE computation)
    liger_flce    Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss()(W, h, y)`` (a Triton
                  kernel; on a CPU-only machine it is expected to fail, and the error is reported)

The peers are optional and never imported by emdlm: they run in ``--peer-python`` (default: this
Python), e.g. a separate venv that sees emdlm's site-packages through a ``.pth`` file:

    python3 -m venv /tmp/ext
    SITE=/tmp/ext/lib/python3.11/site-packages
    echo /work/main/.venv/lib/python3.11/site-packages > $SITE/zz_emdlm_venv.pth
    /tmp/ext/bin/pip install --no-deps cut-cross-entropy==25.1.1 triton==3.9.0 liger-kernel==0.8.5

(cut_cross_entropy imports triton even for its torch fallback; triton imports without a GPU.)

Measurement as in ``bench_from_hidden.py``: each (method, V) runs in a fresh subprocess, after
``--warmup`` untimed passes (torch.compile's compilation happens there and is not counted) the
peak RSS is reset (Linux ``/proc/self/clear_refs``); memory = peak RSS during the ``--reps``
timed passes minus the RSS before them (inputs excluded; gradients of hidden and weight
included); time = median of the timed passes. Methods run in the order given for each V, so
neighbouring rows see similar background load.

Run: ``OMP_NUM_THREADS=2 python benchmarks/bench_loss_peers.py --peer-python /tmp/ext/bin/python``
Small check: ``python benchmarks/bench_loss_peers.py --rows 256 --vocab 4000 --methods logits_ce
emdlm_ce``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _rss import peak_rss_mib, reset_peak_rss, rss_mib
from _table import print_ratio_table
from _timing import timed_passes

METHODS = ("logits_ce", "emdlm_ce", "cce_torch", "liger_flce")
PEERS = ("cce_torch", "liger_flce")
IGNORE = -100








def make_inputs(
    rows: int, hidden: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden [N, H] and weight [V, H] (leaves), labels [N] with ~10 % ignored."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[torch.rand(rows, generator=gen) < 0.1] = IGNORE
    h = torch.randn(rows, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    return h, w, labels


def build(method: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A callable (h, w, labels) -> scalar mean CE over the counted labels."""
    if method == "logits_ce":
        return lambda h, w, y: F.cross_entropy(h @ w.T, y, ignore_index=IGNORE)
    if method == "emdlm_ce":
        from emdlm.losses.ce import CrossEntropyLoss

        loss_fn = CrossEntropyLoss()
        return lambda h, w, y: loss_fn.from_hidden(h, w, y).loss
    if method == "cce_torch":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(
            h, w, y, ignore_index=IGNORE, impl="torch_compile"
        )
    if method == "liger_flce":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)
        return lambda h, w, y: liger(w, h, y)
    raise ValueError(f"unknown method {method!r}")


def child(args: argparse.Namespace) -> None:
    """One method at one V in this fresh process: print {"time", "peak", "loss"} as JSON."""
    torch.set_num_threads(args.threads)
    h, w, labels = make_inputs(args.rows, args.hidden, args.vocab[0])
    loss_fn = build(args.child)
    state = {"base": rss_mib(), "reset": False, "loss": float("nan")}

    def clear_grads() -> None:
        h.grad, w.grad = None, None

    def start_probe() -> None:
        state["base"], state["reset"] = rss_mib(), reset_peak_rss()

    def step() -> None:
        out = loss_fn(h, w, labels)
        out.backward()
        state["loss"] = out.detach()  # read after the clock stops (float() would sync)

    times = timed_passes(step, warmup=args.warmup, reps=args.reps, before_each=clear_grads,
                         after_warmup=start_probe)
    base, reset, loss = state["base"], bool(state["reset"]), float(state["loss"])
    if not reset:
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): no fair peak")
    peak = peak_rss_mib(reset) - base
    print(json.dumps({"time": statistics.median(times), "peak": peak, "loss": loss}))


def run_case(args: argparse.Namespace, method: str, vocab: int) -> dict[str, float] | str:
    """Run one (method, V) in a fresh subprocess; its JSON result or its last error line."""
    python = args.peer_python if method in PEERS and args.peer_python else sys.executable
    cmd = [python, __file__, "--child", method, "--vocab", str(vocab)]
    for name in ("rows", "hidden", "reps", "warmup", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:160]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936, 128256])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-python", default=None, help="Python that imports the peers")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"# Loss alone (fwd + bwd), N={args.rows} H={args.hidden} float32, "
        f"{platform.machine()} cpu, torch {torch.__version__}, threads={args.threads}, "
        f"warmup={args.warmup} reps={args.reps}\n",
        flush=True,
    )
    for vocab in args.vocab:
        results = {m: run_case(args, m, vocab) for m in args.methods}
        print_ratio_table(vocab, results, reference="logits_ce", with_loss=True)


if __name__ == "__main__":
    main()
