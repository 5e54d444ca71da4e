"""Wall time of greedy against minimum-Bayes-risk decoding (``eval.decode``) on the arithmetic
task's model: the ``arithmetic_ce`` config's tiny GPT-2, random init, or a trained folder
(``--model``, e.g. a run or checkpoint folder of that config). A random model never writes
the newline that ends an answer, so every sample runs to max_new_tokens; a trained one stops.

Run: ``python benchmarks/bench_mbr_decode.py`` (200 test prompts of 1-3-digit add/sub,
eval.max_new_tokens 6, eval.batch_size 250 as in the config; k in {4, 16}).
Small check: ``python benchmarks/bench_mbr_decode.py --n 20 --samples 4 --reps 1``.

Each method scores the same prompts with :func:`emdlm.evaluation.evaluate_examples`
(perplexity off, so only decoding and scoring are timed). Time: median over ``--reps`` timed
calls after one untimed warm-up, as wall time and as this process's CPU time (user + system,
``time.process_time``: less sensitive to other jobs on a shared machine).
``eval.batch_size`` counts sequences per ``generate`` call, so greedy runs 250 prompts a call
and MBR 250 // k prompts x k samples. Output: a markdown table with the ratios to greedy.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from _timing import timed_passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="test prompts")
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 16], help="k of mbr")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default=None, help="a trained folder (default: random init)")
    args = parser.parse_args()

    from emdlm.config import build_config, load_config_dict
    from emdlm.data import load_examples
    from emdlm.evaluation import evaluate_examples
    from emdlm.models import build_model, load_tokenizer

    cfg = build_config(load_config_dict("arithmetic_ce"))
    assert cfg.data.eval is not None
    cfg.data.eval.n = args.n
    examples = load_examples(cfg.data.eval, seed=0)
    if args.model is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        torch.manual_seed(0)
        model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length).eval()
    else:
        from emdlm.training.text_eval import load_trained

        model, tokenizer = load_trained(args.model, cfg.tokenizer)

    scores: dict[tuple[str, int], dict[str, float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}

    def run(decode: str, k: int) -> None:
        start = time.process_time()
        scores[(decode, k)], _ = evaluate_examples(
            model, tokenizer, examples, kind="number", max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, with_perplexity=False, decode=decode, mbr_samples=k)
        cpu.setdefault((decode, k), []).append(time.process_time() - start)

    rows = [("greedy", 1)] + [("mbr", k) for k in args.samples]
    times = {}
    for decode, k in rows:
        times[(decode, k)] = statistics.median(
            timed_passes(lambda d=decode, kk=k: run(d, kk), warmup=1, reps=args.reps))
    base = times[("greedy", 1)]
    print(f"# greedy vs MBR decoding: {args.n} prompts, max_new_tokens={args.max_new_tokens}, "
          f"batch_size={args.batch_size}, model={args.model or 'random init'}, "
          f"torch={torch.__version__}, threads={torch.get_num_threads()}, "
          f"cpus={os.cpu_count()} {platform.machine()}\n")
    cpu_med = {key: statistics.median(v[1:]) for key, v in cpu.items()}  # the timed passes
    print("| decode | samples k | wall (s) | x greedy | CPU (s) | x greedy | CPU ms per prompt | "
          "exact_match | abs_error_mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (decode, k), t in times.items():
        m, c = scores[(decode, k)], cpu_med[(decode, k)]
        c0 = cpu_med[("greedy", 1)]
        print(f"| {decode} | {k} | {t:.3f} | {t / base:.2f} | {c:.3f} | {c / c0:.2f} | "
              f"{1000 * c / args.n:.1f} | {m['exact_match']:.3f} | {m['abs_error_mean']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
