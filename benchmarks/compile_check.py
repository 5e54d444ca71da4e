"""torch.compile with every objective on both paths: does it run, does it equal eager, where are
the graph breaks.

Run: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/compile_check.py`` (all objectives,
both paths, inductor, 3 SGD steps). Quick: ``--objectives ce ntil --paths logits --steps 2``;
``--backend aot_eager`` checks dynamo + AOTAutograd without inductor's C++ code generation.
``--json out.json`` writes the rows.

For each objective (ce, emd, ntil, emo, tailr, mixce) and path:
    logits       ``loss_fn(compiled_model(ids).logits[:, :-1], ids[:, 1:])``
    from_hidden  ``loss_fn.from_hidden(compiled_backbone(ids)[0][:, :-1], lm_head.weight, ...)``
an eager and a compiled copy of the same tiny Llama (2 layers, hidden 64, V = 40, untied head)
take ``--steps`` SGD steps (lr 0.5) on the same batches (the loss itself runs eagerly, outside the
compiled module, as in ``transformers.Trainer`` with ``torch_compile=True``). Reported: the largest
|loss difference| over the steps, the largest |weight difference| after them, the wall time of
the first compiled step (compilation included), the mean of the later steps and the last step.

Scopes (``--scope``): "model" compiles the model (or backbone) only, "step" compiles forward +
loss as one function, "patched" compiles a model patched by ``emdlm.patch`` (reduction "sum"),
whose own forward computes the loss.

Graph breaks: ``torch._dynamo.explain`` on the whole forward + loss (model and loss in one
function), i.e. what happens if a user compiles the training step including the loss; the
report lists the number of graphs, the number of breaks and each distinct break reason with its
user frame. Breaks inside the loss are acceptable (the model's graphs stay whole); this says
where they are.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

OBJECTIVES = ("ce", "emd", "ntil", "emo", "tailr", "mixce")
PATHS = ("logits", "from_hidden")
TOKENS = (
    [str(d) for d in range(10)]
    + [f"Ġ{d}" for d in range(10)]
    + ["12", "Ġ45", ".", "-", "a", "b", "Ġc", "=", "Ġ.", "x", "y", "z"]
)
V = len(TOKENS) + 8  # a few rows without a token string (padding of the head)


def tiny_model(seed: int = 0) -> nn.Module:
    """A 2-layer Llama with an untied head (hidden 64, V rows), dropout off, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()  # eval: no dropout; gradients still flow


def make_loss(name: str, model: nn.Module, reduction: str = "mean") -> nn.Module:
    """The objective ``name`` (reduction mean). NTIL uses deterministic argmax values so that
    eager and compiled runs see the same loss (its Gumbel noise would be drawn differently)."""
    from emdlm.losses.ce import CrossEntropyLoss
    from emdlm.losses.emo import EMOLoss
    from emdlm.losses.mixce import MixCELoss
    from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
    from emdlm.losses.tailr import TaiLrLoss
    from emdlm.numbers import NumberVocab

    vocab = NumberVocab.from_token_strings(list(TOKENS), V)
    factories: dict[str, Callable[[], nn.Module]] = {
        "ce": lambda: CrossEntropyLoss(reduction=reduction),
        "emd": lambda: DigitEMDLoss(vocab, reduction=reduction),
        "ntil": lambda: NTILLoss(vocab, value_mode="argmax", reduction=reduction),
        "emo": lambda: EMOLoss.from_model(model, reduction=reduction),
        "tailr": lambda: TaiLrLoss(gamma=0.3, min_weight=0.1, reduction=reduction),
        "mixce": lambda: MixCELoss(eta=0.3, reduction=reduction),
    }
    return factories[name]()


def batches(steps: int, b: int = 4, t: int = 24, seed: int = 1) -> list[torch.Tensor]:
    """Token ids, ~half digits (numbers for NTIL/EMD), the rest other tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        digits = torch.randint(0, 20, (b, t), generator=gen)
        other = torch.randint(20, len(TOKENS), (b, t), generator=gen)
        out.append(torch.where(torch.rand(b, t, generator=gen) < 0.5, digits, other))
    return out


def step_loss(
    model: nn.Module, runner: nn.Module, loss_fn: nn.Module, path: str, ids: torch.Tensor
) -> torch.Tensor:
    """Forward (``runner`` is the model or its backbone, compiled or not) and the loss."""
    labels = ids[:, 1:]
    if path == "logits":
        logits = runner(input_ids=ids).logits
        return loss_fn(logits[:, :-1], labels).loss
    hidden = runner(input_ids=ids)[0]
    return loss_fn.from_hidden(hidden[:, :-1], model.lm_head.weight, labels).loss


def patched_loss(
    model: nn.Module, runner: nn.Module, loss_fn: nn.Module, path: str, ids: torch.Tensor
) -> torch.Tensor:
    """``runner(input_ids=ids, labels=ids).loss`` of a model patched by ``emdlm.patch`` (the
    model shifts the labels; the loss has reduction "sum", which the patch requires)."""
    return runner(input_ids=ids, labels=ids).loss


def train(
    model: nn.Module,
    loss_fn: nn.Module,
    path: str,
    data: list[torch.Tensor],
    compile_as: str | None,
    scope: str = "model",
) -> tuple[list[float], list[float]]:
    """SGD steps; returns the losses and the wall time of each step. ``scope`` "model" compiles
    the model (or backbone) only, "step" compiles forward + loss as one function."""
    runner = model if path == "logits" else model.model
    forward = step_loss
    if scope == "patched":  # emdlm.patch: the model's own forward returns the loss
        from emdlm.integrations.patch import patch

        patch(model, loss_fn, from_hidden=path == "from_hidden")
        runner = model if compile_as is None else torch.compile(model, backend=compile_as)
        forward = patched_loss
    elif compile_as is not None and scope == "model":
        runner = torch.compile(runner, backend=compile_as)
    elif compile_as is not None:
        forward = torch.compile(step_loss, backend=compile_as)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, times = [], []
    for ids in data:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward(model, runner, loss_fn, path, ids)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, times


def short_error(err: Exception) -> str:
    """The exception's type, first line and dynamo's "Explanation:" line, if any (<= 400 chars)."""
    lines = str(err).splitlines() or [""]
    explanation = [ln.strip() for ln in lines if ln.strip().startswith("Explanation:")]
    return f"{type(err).__name__}: {' '.join(lines[:1] + explanation[:1])}"[:400]


def graph_breaks(name: str, path: str, ids: torch.Tensor) -> dict[str, Any]:
    """``torch._dynamo.explain`` of model forward + loss (+ nothing else) as one function."""
    torch._dynamo.reset()
    model = tiny_model()
    loss_fn = make_loss(name, model)
    runner = model if path == "logits" else model.model

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return step_loss(model, runner, loss_fn, path, x)

    try:
        exp = torch._dynamo.explain(fwd)(ids)
    except Exception as err:  # report, do not stop the sweep
        return {"explain_error": short_error(err)}
    reasons: dict[str, int] = {}
    for br in exp.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = (
            f"{frame.filename.split('/src/')[-1]}:{frame.lineno} ({frame.name})" if frame else "?"
        )
        key = f"{br.reason.splitlines()[0][:160]} @ {where}"
        reasons[key] = reasons.get(key, 0) + 1
    return {"graphs": exp.graph_count, "breaks": exp.graph_break_count, "reasons": reasons}


def check(
    name: str, path: str, steps: int, backend: str, explain: bool, scope: str = "model"
) -> dict[str, Any]:
    """Eager vs compiled for one objective and path."""
    data = batches(steps)
    torch._dynamo.reset()
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    row: dict[str, Any] = {"objective": name, "path": path, "backend": backend, "scope": scope}
    reduction = "sum" if scope == "patched" else "mean"
    eager_losses, eager_times = train(
        eager, make_loss(name, eager, reduction), path, data, None, scope
    )
    try:
        loss_fn = make_loss(name, compiled, reduction)
        losses, times = train(compiled, loss_fn, path, data, backend, scope)
    except Exception as err:
        row["error"] = short_error(err)
        return row
    row["loss_diff"] = max(abs(a - b) for a, b in zip(eager_losses, losses, strict=True))
    row["weight_diff"] = max(
        float((p - q).abs().max())
        for p, q in zip(eager.parameters(), compiled.parameters(), strict=True)
    )
    row["losses"] = losses
    row["first_step_s"] = times[0]
    row["eager_step_s"] = sum(eager_times[1:]) / max(1, len(eager_times) - 1)
    row["compiled_step_s"] = sum(times[1:]) / max(1, len(times) - 1)
    row["last_step_s"] = times[-1]  # after recompilations (if any) settled
    if explain and scope != "patched":  # the patched forward runs the same code as "step"
        row.update(graph_breaks(name, path, data[0]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--scope", default="model", choices=("model", "step", "patched"),
        help="compile the model only (default), forward + loss as one function, or a model "
        "patched by emdlm.patch (its forward returns the loss)",
    )  # fmt: skip
    parser.add_argument("--no-explain", action="store_true", help="skip the graph-break pass")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name in args.objectives:
        for path in args.paths:
            row = check(name, path, args.steps, args.backend, not args.no_explain, args.scope)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
