"""Cost of EMO distillation (dense target, EMO Eq. 15) next to CE + KL distillation.

Cases (forward + backward w.r.t. the student logits [N, V], fp32; the teacher's logits [N, V]
are given, detached, and not timed: a teacher forward costs the same for every objective):

    ce            F.cross_entropy(z, y)                                  (scale: no teacher)
    kl_torch      0.5·F.cross_entropy + 0.5·KL(p ‖ q) written with torch ops (F.kl_div)
    kl_distill    emdlm KLDistillLoss (the same CE + KL, plain autograd)
    emo_ref       emdlm.functional.emo_dense.emo_distill_loss (KL + DEMD, plain autograd)
    emo_chunked   EMODistillLoss(implementation="chunked") (KL + DEMD, its chunk objective)
    emo_chunked_none  the chunked path with base="none" (DEMD alone)

Every case runs in a fresh subprocess; time is the median over ``--reps`` after ``--warmup``
runs, memory ("extra") the peak resident memory above the inputs (CPU: VmHWM after
/proc/self/clear_refs, as benchmarks/bench_emo.py; CUDA: max_memory_allocated).

Usage:
    python benchmarks/bench_distill.py --n 2048 --vocab 32000 50257 --dim 768
Small check:
    python benchmarks/bench_distill.py --n 64 --vocab 500 --dim 32 --reps 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _timing import timed_passes
from bench_emo import CpuPeak, CudaPeak  # same folder: the memory probes

CASES = ("ce", "kl_torch", "kl_distill", "emo_ref", "emo_chunked", "emo_chunked_none")
MiB = 2**20


def build_case(case: str, args: argparse.Namespace, vocab: int) -> Callable[[], None]:
    """Inputs for ``case`` and a closure running forward + backward."""
    from emdlm.functional.emo_dense import emo_distill_loss, kl_distill_loss
    from emdlm.losses.emo_distill import EMODistillLoss

    device, n = args.device, args.n
    gen = torch.Generator(device=device).manual_seed(0)
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    logits = torch.empty(n, vocab, device=device).normal_(generator=gen)
    logits.mul_(args.logit_scale).requires_grad_(True)
    teacher = torch.empty(n, vocab, device=device).normal_(generator=gen).mul_(args.logit_scale)
    e_hat = torch.empty(vocab, args.dim, device=device).normal_(generator=gen)
    e_hat.div_(e_hat.norm(dim=1, keepdim=True))

    def loss() -> torch.Tensor:
        if case == "ce":
            return F.cross_entropy(logits, labels)
        if case == "kl_torch":
            kl = F.kl_div(
                F.log_softmax(logits, -1), F.log_softmax(teacher, -1), reduction="batchmean",
                log_target=True,
            )  # fmt: skip
            return 0.5 * F.cross_entropy(logits, labels) + 0.5 * kl
        if case == "kl_distill":
            return kl_distill_loss(logits, teacher, labels).loss
        if case == "emo_ref":
            return emo_distill_loss(logits, teacher, labels, e_hat).loss
        base = "none" if case == "emo_chunked_none" else "kl"
        loss_fn = EMODistillLoss(
            e_hat, base=base, chunk_size=args.chunk_size, implementation="chunked"
        )
        return loss_fn(logits, labels, teacher_logits=teacher).loss

    def run() -> None:
        logits.grad = None
        loss().backward()

    return run


def run_worker(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    run = build_case(args.worker, args, args.vocab[0])
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    probe: CpuPeak | CudaPeak = CudaPeak() if cuda else CpuPeak()
    probe.start()
    times = timed_passes(run, warmup=args.warmup, reps=args.reps, sync=sync)
    print(json.dumps({"time_s": statistics.median(times), "extra_bytes": probe.extra_bytes(),
                      "mem_method": probe.method}))  # fmt: skip


def _spawn(args: argparse.Namespace, case: str, vocab: int) -> dict[str, float]:
    cmd = [
        sys.executable, __file__, "--worker", case, "--vocab", str(vocab), "--n", str(args.n),
        "--dim", str(args.dim), "--device", args.device, "--reps", str(args.reps),
        "--warmup", str(args.warmup), "--chunk-size", str(args.chunk_size),
        "--logit-scale", str(args.logit_scale), "--threads", str(args.threads),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="positions N")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 50257])
    parser.add_argument("--dim", type=int, default=768, help="cost-embedding width d")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--logit-scale", type=float, default=4.0,
                        help="student and teacher logits ~ N(0, scale^2)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--case-timeout", type=float, default=1800.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    print(
        f"# EMO distillation benchmark: N={args.n}, d={args.dim}, fp32, device={args.device}, "
        f"torch {torch.__version__}, threads={args.threads or torch.get_num_threads()}, "
        f"chunk={args.chunk_size}, {platform.processor() or platform.machine()}, "
        f"reps={args.reps} (median), warmup={args.warmup}\n"
    )
    for vocab in args.vocab:
        results: dict[str, dict[str, float]] = {}
        for case in args.cases:
            try:
                results[case] = _spawn(args, case, vocab)
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
                print(f"  {case} V={vocab}: failed ({err})", file=sys.stderr)
        base = results.get("kl_torch")
        print(f"## V={vocab}\n")
        print("| case | fwd+bwd time (s) | vs kl_torch | extra peak memory (MiB) |")
        print("|---|---:|---:|---:|")
        for case, r in results.items():
            ratio = "-" if base is None else f"{r['time_s'] / base['time_s']:.2f}x"
            print(f"| {case} | {r['time_s']:.3f} | {ratio} | {r['extra_bytes'] / MiB:.0f} |")
        method = next(iter(results.values()))["mem_method"] if results else "-"
        print(f"\nmemory: {method}\n", flush=True)


if __name__ == "__main__":
    main()
