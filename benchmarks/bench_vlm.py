"""One training step of a tiny VLM on clock images: CE+NTIL against CE, and the tokenizer's cost.

Run: ``python benchmarks/bench_vlm.py`` (the tiny VLM of ``clock_ce.yaml``: tiny-qwen2-vl at
112 px -> 16 image tokens; char and qwen tokenizers, batch 16, the config's clock images, 10
timed steps per objective after 2 untimed). ``--model default`` times the builder's smaller
default tiny-qwen2-vl instead.

A step is what ``emdlm train`` does per optimizer step: the collator (image processor + template),
the model's forward, the loss through ``make_compute_loss_func`` (as the Trainer calls it),
backward and an AdamW step, on the SAME batch for every objective. The objectives' steps are
interleaved (ce, ntil, ce, ntil, ...) so that load from other processes hits both alike; the
figure is the median step time. Data throughput: images per second of the collator alone
(decode the cached PNG, Qwen2-VL image processor, tokenization) on the same rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch


def _parts(
    tokenizer_name: str, rows: list[dict[str, Any]], batch: int, model_cfg: Any
) -> tuple[Any, ...]:
    from emdlm.config import ObjectiveConfig
    from emdlm.integrations.transformers import make_compute_loss_func
    from emdlm.models import load_tokenizer, model_vocab_size
    from emdlm.objectives import build_objective
    from emdlm.vlm.collator import VLMCollator
    from emdlm.vlm.models import build_vlm, prepare_vlm_tokenizer

    tok = prepare_vlm_tokenizer(load_tokenizer(tokenizer_name), "qwen2_vl")
    torch.manual_seed(0)
    built = build_vlm(model_cfg, tok)
    model = built.model
    collator = VLMCollator(tok, built.image_processor, built.spec, model.config)
    losses = {
        name: make_compute_loss_func(build_objective(
            ObjectiveConfig(name=name), tokenizer=tok, model=model,
            vocab_size=model_vocab_size(model),
        ))
        for name in ("ce", "ntil")
    }
    return model, collator, losses, collator(rows[:batch])


def _step(model: Any, opt: Any, loss_fn: Any, batch: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    out = model(**inputs)
    loss = loss_fn(out, labels, num_items_in_batch=(labels[:, 1:] != -100).sum())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokenizers", default="char,qwen")
    parser.add_argument("--model", choices=("clock_ce", "default"), default="clock_ce")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from emdlm.config import ModelConfig, load_config
    from emdlm.tasks import generate_task

    cfg = load_config("clock_ce")
    model_cfg = cfg.model if args.model == "clock_ce" else ModelConfig(name="tiny-qwen2-vl")
    params = dict(cfg.data.train.params) if cfg.data.train is not None else {}
    with tempfile.TemporaryDirectory() as cache:
        rows = generate_task("clock", n=max(64, args.batch), split="train", seed=0,
                             cache_dir=cache, **params)
        print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, model "
              f"{model_cfg.name} {dict(model_cfg.params)}")
        print("| tokenizer | V | T | CE step s | CE+NTIL step s | ratio | collator img/s |")
        print("|---|---|---|---|---|---|---|")
        for name in args.tokenizers.split(","):
            model, collator, losses, batch = _parts(name, rows, args.batch, model_cfg)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            times: dict[str, list[float]] = {k: [] for k in losses}
            for rep in range(args.reps + 2):
                for key, fn in losses.items():
                    dt = _step(model, opt, fn, batch)
                    if rep >= 2:
                        times[key].append(dt)
            t0 = time.perf_counter()
            for start in range(0, len(rows), args.batch):
                collator(rows[start : start + args.batch])
            ips = len(rows) / (time.perf_counter() - t0)
            ce, ntil = (statistics.median(times[k]) for k in ("ce", "ntil"))
            vocab = model.get_output_embeddings().weight.shape[0]
            print(f"| {name} | {vocab} | {batch['input_ids'].shape[1]} | {ce:.3f} | {ntil:.3f} "
                  f"| {ntil / ce:.2f} | {ips:.0f} |")


if __name__ == "__main__":
    main()
