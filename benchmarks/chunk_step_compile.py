"""Eager vs ``torch.compile(fullgraph=True)`` of one objective's chunk step
(docs/results/torch_compile_cpu.md).

Run: ``OMP_NUM_THREADS=2 python benchmarks/chunk_step_compile.py`` (defaults: N = 1024 rows,
V = 32000, H = 256, backends eager, aot_eager, inductor; every objective). Quick:
``--objectives ce emo --backends eager aot_eager --reps 3``. ``--json out.json`` writes the rows.

What is timed: ``objective.chunk(z, out, labels, valid, 0, grad_scale)`` on ONE chunk of N rows
(the engine's default chunk at V = 32000 is 2097 rows, so N = 1024 is one chunk), set up as the
engine does (``_Pass.of`` then ``begin``), with the gradient (grad_scale given):

* ``--path logits`` (default): z is a read-only float32 chunk of the logits, ``out`` the driver's
  [N, V] buffer (what ``chunked_logits_loss`` does);
* ``--path hidden``: z IS ``out`` (the head output from hidden states, overwritten): each call
  first copies the logits into ``out`` (the copy is timed in every backend alike).

Objectives: ce, tailr (paper preset, label smoothing 0.1), mixce, emd, ntil (argmax values), emo
(emo1, cost embedding [V, H]), emo_distill (base kl, static, teacher logits [N, V]). Per
objective and backend: the first call (compilation included) and the median of ``--reps``
calls after a second warm-up call (EMO recompiles once: its scratch buffer is made on the first
call), and the max |difference| of loss and gradient from eager. ``--device cuda`` times on a
GPU (``torch.cuda.synchronize`` around each call); the default is the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

OBJECTIVES = ("ce", "tailr", "mixce", "emd", "ntil", "emo", "emo_distill")
TOKENS = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)] + ["12", "Ġ45", ".", "a"]


def build(name: str, labels: torch.Tensor, vocab: int, width: int) -> Any:
    """The ChunkObjective of ``name`` for ``labels`` [N] (set up by :func:`prepare`)."""
    from emdlm.functional.emo import normalize_cost_embedding
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.mixce import MixCELoss
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
    from emdlm.losses.tailr import TaiLrLoss
    from emdlm.numbers import NumberVocab
    from emdlm.ops._chunking import prepare_cost
    from emdlm.ops.objectives.emo import EMOObjective
    from emdlm.ops.objectives.emo_distill import EMODistillObjective

    gen = torch.Generator().manual_seed(5)
    device = labels.device
    stand_in = torch.zeros((), device=device).expand(labels.shape[0], vocab)  # as from_hidden

    def cost() -> torch.Tensor:
        emb = torch.randn(vocab, width, generator=gen).to(device)
        return prepare_cost(normalize_cost_embedding(emb), None, torch.float32)

    def numeric(cls: type) -> Any:
        number_vocab = NumberVocab.from_token_strings(TOKENS, vocab)
        loss = cls(number_vocab, value_mode="argmax")
        return loss.chunk_objective(stand_in, labels)[0]

    factories: dict[str, Callable[[], Any]] = {
        "ce": lambda: CrossEntropyLoss().chunk_objective(stand_in, labels)[0],
        "tailr": lambda: TaiLrLoss(label_smoothing=0.1).chunk_objective(stand_in, labels)[0],
        "mixce": lambda: MixCELoss(eta=0.3).chunk_objective(stand_in, labels)[0],
        "emd": lambda: numeric(DigitEMDLoss),
        "ntil": lambda: numeric(NTILLoss),
        "emo": lambda: EMOObjective(cost(), "emo1", 1.0, None),
        "emo_distill": lambda: EMODistillObjective(
            torch.randn(labels.shape[0], vocab, generator=gen).to(device),
            cost(),
            {"base": "kl", "mode": "static", "mu": 1.0, "temperature": 1.0, "max_ratio": None},
        ),
    }
    return factories[name]()


def prepare(objective: Any, labels: torch.Tensor, vocab: int) -> Any:
    """``_Pass.of`` and ``begin`` as the engine runs them (one chunk of all rows)."""
    from emdlm.ops.chunked import HeadOptions, _Pass

    n = labels.shape[0]
    run = _Pass.of(labels, HeadOptions(chunk_size=n), torch.float32, vocab, objective, [0, n], None)
    objective.begin([0], n, run.objective_sizes)
    return run


def measure(
    name: str, backend: str, path: str, n: int, vocab: int, width: int, reps: int, device: str
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    digits = torch.randint(0, 20, (n,), generator=gen)
    other = torch.randint(20, vocab, (n,), generator=gen)
    labels = torch.where(torch.rand(n, generator=gen) < 0.5, digits, other)
    labels[:8] = -100
    labels = labels.to(device)
    logits = (3.0 * torch.randn(n, vocab, generator=gen)).to(device)
    out = torch.empty(n, vocab, device=device)
    sync = torch.cuda.synchronize if out.is_cuda else (lambda: None)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    row: dict[str, Any] = {"objective": name, "backend": backend, "path": path, "device": device}
    for which in ("eager", backend) if backend != "eager" else ("eager",):
        objective = build(name, labels, vocab, width)
        run = prepare(objective, labels, vocab)

        def step(z: torch.Tensor, buf: torch.Tensor, objective: Any = objective, run: Any = run):
            res = objective.chunk(z, buf, run.labels, run.valid, 0, run.scale)
            g = res.grad if res.scaled else res.grad * run.scale
            return res.loss, g

        fn = step
        if which != "eager":
            torch._dynamo.reset()
            fn = torch.compile(step, fullgraph=True, backend=which)
        times = []
        for _ in range(reps + 2):
            sync()
            start = time.perf_counter()
            z = out.copy_(logits) if path == "hidden" else logits
            loss, g = fn(z, out)
            sync()
            times.append(time.perf_counter() - start)
        results[which] = (loss.detach().clone(), g.detach().clone())
        row[f"{which}_first_s"] = times[0]
        row[f"{which}_s"] = statistics.median(times[2:])  # after a second warm-up call
    if backend != "eager":
        (loss_e, g_e), (loss_c, g_c) = results["eager"], results[backend]
        valid = labels != -100
        row["loss"] = float(loss_e)  # a sum over the chunk's counted tokens
        row["loss_diff"] = float((loss_e - loss_c).abs())
        row["grad_diff"] = float((g_e[valid] - g_c[valid]).abs().max())
        row["speedup"] = row["eager_s"] / row[f"{backend}_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--path", default="logits", choices=("logits", "hidden"))
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256, help="width of EMO's cost embedding")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="e.g. cuda (timed with synchronize)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name in args.objectives:
        for backend in args.backends:
            row = measure(
                name, backend, args.path, args.n, args.vocab, args.hidden, args.reps, args.device
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
