"""CE learning curves of the tiny VLM on the built-in image tasks, with data and step throughput.

Run: ``OMP_NUM_THREADS=1 python benchmarks/vlm_learning_curves.py --tasks clock`` (add
``grounding,text_detection`` when there is time; each task trains one run).

Per task: one ``emdlm train`` run (CE) of the packaged clock model (``clock_ce.yaml``'s
``model``, ``optim`` and ``train`` settings) on that task's generator, saving a checkpoint
every ``--every`` steps; every checkpoint is then evaluated greedily on the held-out split
(``emdlm eval`` metrics of the task's kind: clock -> exact match and time gap; grounding ->
Acc@0.5 / mean IoU; text_detection -> F1 at IoU 0.5), plus two perplexities of the held-out
answers: with their own images (``perplexity``) and with every image swapped for the next
row's (``perplexity_other_images``, both from ``emdlm eval``). Equal values mean the model
ignores the image; the gap is how much of what it learned comes from the picture. Also
printed: images per second of the generator (render + PNG into a fresh cache), of the collator
(decode + image processor + template) and training steps per second, so that one sees whether
data is the bottleneck.

Prints a Markdown table per task (step, train loss, held-out metrics) and the throughput line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

IMAGE_USE = ("perplexity", "perplexity_other_images")
# task -> (eval kind, answer length in tokens for generation, extra data params, metrics shown)
TASKS: dict[str, tuple[str, int, list[str], tuple[str, ...]]] = {
    "clock": ("clock", 6, [], ("exact_match", "hour_accuracy", "minute_accuracy",
                                "time_gap_mean_worst", "parse_failure_rate", *IMAGE_USE)),
    "grounding": ("box", 24, ["image_size=112"], ("acc_iou50", "mean_iou",
                                                  "parse_failure_rate", *IMAGE_USE)),
    "text_detection": ("boxes", 64, ["image_size=112"], ("f1", "precision", "recall",
                                                          "parse_failure_rate", *IMAGE_USE)),
}


def task_overrides(
    task: str, out: Path, cache: Path, steps: int, every: int, data_params: list[str] = ()
) -> list[str]:
    """``load_config("clock_ce", ...)`` overrides that train ``task`` instead of the clock;
    ``data_params`` (``name=value``) go to the generator of both splits, after the defaults."""
    kind, new_tokens, extra, _ = TASKS[task]
    extra = [*extra, *data_params]
    common = [
        f"output_dir={out / task}", f"train.max_steps={steps}", f"train.save_steps={every}",
        "train.save_total_limit=100", "train.progress_bar=false", "train.tensorboard=false",
        f"data.train.params.cache_dir={cache}", f"data.eval.params.cache_dir={cache}",
    ]
    params = [f"data.{s}.params.{p}" for s in ("train", "eval") for p in extra]
    if task == "clock":
        return [*common, *params]
    return [*common, f"data.train.task={task}", f"data.eval.task={task}", *params,
            f"eval.kind={kind}", f"eval.max_new_tokens={new_tokens}", "data.max_length=256"]


def load_task_config(task: str, overrides: list[str]) -> Any:
    """clock_ce.yaml with ``overrides``; for other tasks the clock-only data params are
    dropped before validation."""
    from emdlm.config import apply_overrides, build_config, load_config_dict

    raw = load_config_dict("clock_ce")
    if task != "clock":
        for split in ("train", "eval"):
            raw["data"][split]["params"] = {}
    return build_config(apply_overrides(raw, overrides))


def data_throughput(task: str, cfg: Any, n: int = 200) -> tuple[float, float]:
    """(generator images/s into a fresh cache, collator images/s) on ``n`` training rows."""
    from emdlm.tasks import generate_task
    from emdlm.training.image_text import prepare_vlm_run

    params = {k: v for k, v in cfg.data.train.params.items() if k != "cache_dir"}
    with tempfile.TemporaryDirectory() as fresh:
        generate_task(task, n=2, split="train", seed=99, cache_dir=fresh, **params)  # warm-up
        t0 = time.perf_counter()
        rows = generate_task(task, n=n, split="train", seed=7, cache_dir=fresh, **params)
        render = n / (time.perf_counter() - t0)
        collator = prepare_vlm_run(cfg).collator  # the run's collator, no output folder
        t0 = time.perf_counter()
        for start in range(0, n, 16):
            collator(rows[start : start + 16])
        collate = n / (time.perf_counter() - t0)
    return render, collate


def train_run(cfg: Any) -> float:
    """Train ``cfg`` (checkpoints every ``train.save_steps``); steps per second incl. start-up."""
    from emdlm.training.train import run_training

    t0 = time.perf_counter()
    summary = run_training(cfg, overwrite=True)
    return summary["global_step"] / (time.perf_counter() - t0)


def evaluate_checkpoints(task: str, run_dir: Path, cfg: Any) -> list[dict[str, Any]]:
    """Greedy held-out metrics of every ``checkpoint-*`` in ``run_dir`` (and the last train
    loss logged up to it), one row per checkpoint in step order."""
    from emdlm.tasks.clock import reading_accuracy
    from emdlm.training.evaluate import evaluate_run

    log = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines() if x]
    rows = []
    ckpts = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for ckpt in ckpts:
        step = int(ckpt.name.split("-")[1])
        out = run_dir / "curve" / ckpt.name
        metrics = dict(evaluate_run(ckpt, cfg, out_dir=out)["metrics"])
        if task == "clock":
            preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()
                     if x.strip()]
            metrics.update(reading_accuracy([r["prediction"] for r in preds],
                                            [r["reference"] for r in preds]))
        losses = [r.get("ce", r["loss"]) for r in log if "loss" in r and r.get("step", 0) <= step]
        rows.append({"step": step, "train_loss": losses[-1] if losses else None, **metrics})
    return rows


def markdown(task: str, rows: list[dict[str, Any]]) -> str:
    keys = ("step", "train_loss", *TASKS[task][3])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [row.get(k) for k in keys]
        lines.append("| " + " | ".join(
            f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="clock")
    parser.add_argument("--steps", type=int, default=None, help="default: clock_ce.yaml's")
    parser.add_argument("--every", type=int, default=300)
    parser.add_argument("--out", default="runs/vlm_learning_curves")
    parser.add_argument("--data-params", default="",
                        help="generator parameters for both splits, e.g. "
                             "'min_objects=1,max_objects=2,noise=0'")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-config overrides after the task's, e.g. model.name=tiny-llava")
    parser.add_argument("--from-run", default=None,
                        help="a finished run folder of this script (or clock_ce) with its "
                             "checkpoints and run_config.yaml: evaluate only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from emdlm.config import load_config

    steps = args.steps or load_config("clock_ce").train.max_steps
    out = Path(args.out)
    cache = out / "cache"
    print(f"torch threads {torch.get_num_threads()}")
    for task in args.tasks.split(","):
        if task not in TASKS:
            raise SystemExit(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        if args.from_run:  # evaluate the checkpoints of a finished run
            run_dir = Path(args.from_run)
            cfg = load_config(str(run_dir / "run_config.yaml"), [f"output_dir={run_dir}"])
            if cfg.data.eval.task != task:
                raise SystemExit(f"{run_dir} trained {cfg.data.eval.task!r}, not {task!r}")
            summary = json.loads((run_dir / "train_summary.json").read_text())
            steps_per_s = summary["global_step"] / summary["train_runtime"]
            timing = "training loop only"
        else:
            data_params = [p for p in args.data_params.split(",") if p]
            cfg = load_task_config(
                task, [*task_overrides(task, out, cache, steps, args.every, data_params),
                       *args.set])
            run_dir = Path(cfg.output_dir)
            steps_per_s = train_run(cfg)
            timing = "incl. start-up"
        rows = evaluate_checkpoints(task, run_dir, cfg)
        data = {k: v for k, v in cfg.data.train.params.items() if k != "cache_dir"}
        print(f"\n### {task} (CE, {cfg.model.name} {dict(cfg.model.params)}, batch "
              f"{cfg.train.batch_size}; data {data}; overrides {args.set})\n")
        print(markdown(task, rows), flush=True)
        render, collate = data_throughput(task, cfg)
        print(f"\ntraining {steps_per_s:.2f} steps/s ({steps_per_s * cfg.train.batch_size:.0f} "
              f"images/s, {timing}); generator {render:.0f} images/s (render + PNG); "
              f"collator {collate:.0f} images/s")


if __name__ == "__main__":
    main()
