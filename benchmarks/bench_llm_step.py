"""One training step of a Qwen2-shaped model at Qwen's vocabulary: full logits vs from hidden.

The model is built from a transformers ``Qwen2Config`` with Qwen2-0.5B's
shapes (V = 151936, H = 896, intermediate 4864, 14 heads / 2 KV heads, tied embeddings) and
``--layers`` decoder layers (default 2: the head and the loss dominate at this vocabulary).
A step is forward, backward and ``torch.optim.AdamW.step()`` on a B x T batch (default 4 x 1024,
B·T = 4096), float32, CPU.

Rows (same model init, data and optimizer in each):
    logits_ce       today's path: ``model(input_ids, attention_mask, labels=labels).loss``
                    (full [B, T, V] logits, transformers' own ForCausalLMLoss)
    hidden_ce       ``CrossEntropyLoss().from_hidden(model.model(...)[0], lm_head.weight, y)``
    hidden_ce_ntil  ``NTILLoss(qwen tokenizer).from_hidden(...)`` (CE + NTIL, default preset)
    logits_emo      ``EMOLoss(cost)(model(...).logits, y)`` (full logits, emdlm's chunked EMO)
    hidden_emo      ``EMOLoss(cost).from_hidden(...)``
``y`` = the labels shifted left by one and padded with -100 (exactly transformers' shift).
EMO's cost embedding is a frozen copy of the initial head (``cost_embedding_from(model)``).

Data: random token ids; each sequence is a prompt (labels -100, 15-30 % of T), a response
with ~15 % of its tokens in numbers (runs of 1-6 Qwen digit tokens '0'..'9' after a space
token, so NTIL has numbers to score) and right padding (attention mask 0, labels -100) of 0-20 %
of T.

Measurement: every (row, round) runs in its own fresh subprocess; rounds interleave the rows
(a b c d e a b c d e ...) so all rows see the same background load. In a child: build model,
optimizer, data and loss; create AdamW's state with one step on zero gradients (no forward;
lr = 0, so the weights do not move); set the gradients to None; read RSS; reset the peak RSS
(Linux ``/proc/self/clear_refs``, else ``ru_maxrss`` is used); then run ``--steps`` timed steps.
Memory = peak RSS during the timed steps minus the RSS before them (activations, logits, loss
buffers, gradients and AdamW's temporaries; the parameters and AdamW state are in the base).
Time = median over all timed steps of all rounds. ``MALLOC_MMAP_THRESHOLD_`` is fixed at 1 MiB
so glibc returns freed large blocks and the RSS follows the live tensors.

``--interleave R`` measures time only, in one process: the rows alternate step by step for R
rounds (the fairest time comparison when the background load changes from minute to minute).

Run (about 20 min on 2 cores shared with a 2-process background job; a step is 1-2 min there):
    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        python benchmarks/bench_llm_step.py --rounds 2 --steps 1
    ... python benchmarks/bench_llm_step.py --interleave 3 --rows logits_ce hidden_ce_ntil
Small check: ``python benchmarks/bench_llm_step.py --vocab 4000 --batch 2 --seq 64 --layers 1``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from _rss import peak_rss_mib, reset_peak_rss, rss_mib

ROWS = ("logits_ce", "hidden_ce", "hidden_ce_ntil", "logits_emo", "hidden_emo")
# (row, reference row, max memory ratio, max time ratio or None): the goals, set before the run.
GOALS = (
    ("hidden_ce_ntil", "logits_ce", 0.5, 1.05),
    ("hidden_emo", "logits_emo", 0.5, None),
)
IGNORE = -100








def build_model(args: argparse.Namespace) -> Any:
    """A randomly initialized Qwen2ForCausalLM with Qwen2-0.5B's shapes and ``--layers`` layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq, 32768),
        tie_word_embeddings=True,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()


def digit_ids(vocab: int) -> tuple[list[int], int]:
    """Qwen's digit token ids '0'..'9' and its space token (fallback for a small --vocab)."""
    if vocab >= 151643:
        from emdlm.tokenizers import load_tokenizer

        tok = load_tokenizer("qwen")
        return list(tok.convert_tokens_to_ids([str(d) for d in range(10)])), 220
    return list(range(10)), 10


def make_batch(args: argparse.Namespace, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels [B, T] (labels unshifted, as transformers takes them)."""
    gen = torch.Generator().manual_seed(seed)
    b, t = args.batch, args.seq
    digits, space = digit_ids(args.vocab)
    text_hi = min(args.vocab, 151643)  # ordinary tokens only, no specials
    ids = torch.randint(100, text_hi, (b, t), generator=gen)
    # Numbers: runs of 1-6 digits after a space token, ~15 % of the tokens.
    n_runs = max(1, int(0.15 * b * t / 4.5))
    rows = torch.randint(0, b, (n_runs,), generator=gen)
    starts = torch.randint(0, max(1, t - 7), (n_runs,), generator=gen)
    lengths = torch.randint(1, 7, (n_runs,), generator=gen)
    offsets = torch.arange(7)
    cols = starts[:, None] + offsets  # [R, 7]: space, then up to 6 digits
    keep = offsets <= lengths[:, None]
    values = torch.tensor(digits)[torch.randint(0, 10, cols.shape, generator=gen)]
    values[:, 0] = space
    ids[rows[:, None].expand_as(cols)[keep], cols[keep]] = values[keep]
    labels = ids.clone()
    mask = torch.ones(b, t, dtype=torch.long)
    prompt = (t * (0.15 + 0.15 * torch.rand(b, generator=gen))).long()
    pad = (t * 0.2 * torch.rand(b, generator=gen)).long()
    pos = torch.arange(t)
    labels[pos[None] < prompt[:, None]] = IGNORE
    padded = pos[None] >= (t - pad)[:, None]
    labels[padded] = IGNORE
    mask[padded] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """labels[:, 1:] padded with -100 at the end: transformers' causal shift, aligned with T."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def build_step_loss(row: str, model: Any, args: argparse.Namespace) -> Any:
    """A callable batch -> scalar loss for ``row`` (everything V-sized built here, not in it)."""
    if row == "logits_ce":
        return lambda batch: model(**batch).loss
    y_of = shifted
    if row in ("logits_emo", "hidden_emo"):
        from emdlm.losses.emo import EMOLoss, cost_embedding_from

        kwargs = {} if args.emo_chunk is None else {"chunk_size": args.emo_chunk}
        loss_fn: Any = EMOLoss(cost_embedding_from(model), **kwargs)
    elif row == "hidden_ce":
        from emdlm.losses.ce import CrossEntropyLoss

        loss_fn = CrossEntropyLoss()
    elif row == "hidden_ce_ntil":
        from emdlm.losses.ntil import NTILLoss
        from emdlm.numbers import NumberVocab

        if args.vocab >= 151643:
            from emdlm.tokenizers import load_tokenizer

            loss_fn = NTILLoss(load_tokenizer("qwen"))
        else:
            strings = [str(i) if i < 10 else f"tok{i}" for i in range(args.vocab)]
            loss_fn = NTILLoss(NumberVocab.from_token_strings(strings, args.vocab))
    else:
        raise ValueError(f"unknown row {row!r}")
    head = model.get_output_embeddings()

    if row == "logits_emo":

        def step_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return loss_fn(out.logits, y_of(batch["labels"])).loss

        return step_loss

    def hidden_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state  # [B, T, H]
        kw = {} if args.chunk is None or row == "hidden_emo" else {"chunk_size": args.chunk}
        return loss_fn.from_hidden(hidden, head.weight, y_of(batch["labels"]), **kw).loss

    return hidden_loss


def setup(args: argparse.Namespace) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """Model, batch and an AdamW whose state already exists (so it is in the base memory)."""
    torch.set_num_threads(args.threads)
    model = build_model(args)
    batch = make_batch(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # AdamW's state (exp_avg, exp_avg_sq) is part of the model's resident memory, not of a
    # step's peak: create it with one lr = 0 step on zero gradients (no forward/backward).
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group in opt.param_groups:
        group["lr"] = 1e-5
    opt.zero_grad(set_to_none=True)
    return model, batch, opt


def train_step(step_loss: Any, batch: dict[str, torch.Tensor], opt: Any) -> tuple[float, float]:
    """Forward, backward, AdamW step; returns (seconds, loss)."""
    start = time.perf_counter()
    loss = step_loss(batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(loss.detach())


def child(args: argparse.Namespace) -> None:
    """One row in this fresh process: print {"times", "peak", "base", "loss"} as JSON."""
    model, batch, opt = setup(args)
    step_loss = build_step_loss(args.child, model, args)
    base = rss_mib()
    reset = reset_peak_rss()
    times, losses = [], []
    for _ in range(args.steps):
        seconds, loss = train_step(step_loss, batch, opt)
        times.append(seconds)
        losses.append(loss)
    peak = peak_rss_mib(reset)
    print(json.dumps({"times": times, "peak": peak - base, "base": base, "loss": losses[0]}))


def interleaved_times(args: argparse.Namespace) -> None:
    """Time only, one process: the rows alternate step by step for ``--interleave`` rounds.

    Under a changing background load this compares the rows under the same conditions better
    than separate processes do (memory is not measured here: the rows share one process).
    """
    model, batch, opt = setup(args)
    fns = {row: build_step_loss(row, model, args) for row in args.rows}
    times: dict[str, list[float]] = {row: [] for row in args.rows}
    for rnd in range(args.interleave):
        for row, fn in fns.items():
            seconds, loss = train_step(fn, batch, opt)
            times[row].append(seconds)
            print(f"round {rnd} {row}: {seconds:.2f} s, loss {loss:.4f}", flush=True)
    ref = args.rows[0]
    print(f"\n| row | median step (s) | min (s) | median x {ref} | min x {ref} |")
    print("|---|---:|---:|---:|---:|")
    med0, min0 = statistics.median(times[ref]), min(times[ref])
    for row, ts in times.items():
        med, low = statistics.median(ts), min(ts)
        print(f"| {row} | {med:.2f} | {low:.2f} | {med / med0:.2f} | {low / min0:.2f} |")


def run_child(args: argparse.Namespace, row: str) -> dict[str, Any] | str:
    """Run one row in a fresh subprocess; its JSON result or the last line of its error."""
    cmd = [sys.executable, __file__, "--child", row]
    for name in ("vocab", "hidden", "intermediate", "layers", "batch", "seq", "steps", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    for name in ("chunk", "emo_chunk"):
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MALLOC_MMAP_THRESHOLD_": "1048576",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:160]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per row: median step time over all timed steps, max / min peak over rounds, first loss."""
    out = {}
    for row, runs in results.items():
        times = [t for r in runs for t in r["times"]]
        peaks = [r["peak"] for r in runs]
        out[row] = {
            "time": statistics.median(times),
            "peak": max(peaks),
            "peak_min": min(peaks),
            "base": runs[0]["base"],
            "loss": runs[0]["loss"],
            "n": len(times),
        }
    return out


def print_tables(summary: dict[str, dict[str, float]], failed: dict[str, str]) -> None:
    """Markdown tables: per row with ratios to both full-logits rows, then the goals."""
    print(
        "| row | step (s) | x logits_ce | peak above base (MiB) | x logits_ce | x logits_emo "
        "| loss (1st step) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ce, emo = summary.get("logits_ce"), summary.get("logits_emo")
    for row, s in summary.items():
        t_ce = f"{s['time'] / ce['time']:.2f}" if ce else "-"
        m_ce = f"{s['peak'] / ce['peak']:.2f}" if ce else "-"
        m_emo = f"{s['peak'] / emo['peak']:.2f}" if emo else "-"
        spread = "" if s["peak"] - s["peak_min"] < 1 else f" (min {s['peak_min']:.0f})"
        print(
            f"| {row} | {s['time']:.2f} | {t_ce} | {s['peak']:.0f}{spread} | {m_ce} | {m_emo} "
            f"| {s['loss']:.4f} |"
        )
    for row, err in failed.items():
        print(f"| {row} | failed: {err} | | | | | |")
    print("\n| goal | measured | met |\n|---|---|---|")
    for row, ref, mem_goal, time_goal in GOALS:
        if row not in summary or ref not in summary:
            continue
        mem = summary[row]["peak"] / summary[ref]["peak"]
        line = f"memory {row} / {ref} <= {mem_goal}"
        print(f"| {line} | {mem:.2f} | {'yes' if mem <= mem_goal else 'NO'} |")
        if time_goal is not None:
            tr = summary[row]["time"] / summary[ref]["time"]
            line = f"time {row} / {ref} <= {time_goal}"
            print(f"| {line} | {tr:.2f} | {'yes' if tr <= time_goal else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (a b c a b c)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per child")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=None, help="from-hidden CE/NTIL chunk rows")
    parser.add_argument("--emo-chunk", type=int, default=None, help="EMOLoss chunk_size")
    parser.add_argument(
        "--interleave", type=int, default=0, help="time only: R rounds alternating in one process"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"# One training step (fwd + bwd + AdamW), Qwen2-shaped: V={args.vocab} H={args.hidden} "
        f"I={args.intermediate} layers={args.layers} B x T = {args.batch} x {args.seq}, float32, "
        f"{platform.machine()} cpu, torch {torch.__version__}, threads={args.threads}, "
        f"rounds={args.rounds} x steps={args.steps}, chunk={args.chunk}, "
        f"emo_chunk={args.emo_chunk}\n",
        flush=True,
    )
    if args.interleave:
        interleaved_times(args)
        return
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        for row in args.rows:
            if row in failed:
                continue
            start = time.perf_counter()
            r = run_child(args, row)
            wall = time.perf_counter() - start
            if isinstance(r, str):
                failed[row] = r
                results.pop(row, None)
            else:
                results[row].append(r)
            print(
                f"round {rnd} {row}: {r if isinstance(r, str) else json.dumps(r)} "
                f"(child wall {wall:.0f} s, load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    print()
    print_tables(summarize(results), failed)


if __name__ == "__main__":
    main()
