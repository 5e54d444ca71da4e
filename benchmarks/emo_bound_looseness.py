"""How loose are EMO's dense-target surrogates compared with the exact EMD?

For a dense target p (soft labels, a teacher), EMO offers two closed forms that avoid solving
an OT problem (emdlm.functional.emo):

* the independent-plan bound qᵀCp = 1 - (Êᵀq)·(Êᵀp) (EMO Eq. 12-13), an upper bound on the
  exact EMD(q, p) because the product plan q ⊗ p is feasible;
* the generalized DEMD |q - p|ᵀ C p (EMO Eq. 15), zero at q = p but not a bound.

This script compares both with the exact EMD from POT (``ot.emd2``) on random cases: V tokens,
a random Gaussian cost embedding of width d, Dirichlet(α) targets p, and model distributions q
either independent of p (q = softmax(2·N(0, 1))) or near it (q = softmax(log p + σ·N(0, 1))).

Run:  python benchmarks/emo_bound_looseness.py [--vocab 32] [--cases 200] [--width 16]
Prints one row per (regime, α): mean and max of bound/EMD, mean/min/max of Eq15/EMD, and how
often Eq. 15 falls below the exact EMD.
"""

from __future__ import annotations

import argparse

import numpy as np
import ot
import torch

from emdlm.functional.emo import demd_bound_dense, generalized_demd, normalize_cost_embedding


def measure(
    vocab: int, cases: int, width: int, alpha: float, regime: str, seed: int
) -> dict[str, float]:
    """Ratios to the exact EMD over ``cases`` random (q, p, Ê) triples."""
    rng = np.random.default_rng(seed)
    bound_ratio, eq15_ratio = [], []
    for _ in range(cases):
        emb_hat = normalize_cost_embedding(torch.from_numpy(rng.standard_normal((vocab, width))))
        cost = (1.0 - emb_hat @ emb_hat.T).clamp_min(0.0).numpy()
        p = rng.dirichlet(np.full(vocab, alpha))
        p = np.clip(p, 1e-300, None)
        p = p / p.sum()
        if regime == "independent":
            logits = 2.0 * rng.standard_normal(vocab)
        else:  # "near": a model close to the target
            logits = np.log(p) + 0.5 * rng.standard_normal(vocab)
        logits_t = torch.from_numpy(logits)[None]
        q = torch.softmax(logits_t, -1)[0].numpy()
        exact = float(ot.emd2(q, p, cost))
        if exact < 1e-9:
            continue
        p_t = torch.from_numpy(p)[None]
        bound_ratio.append(demd_bound_dense(logits_t, p_t, emb_hat).item() / exact)
        eq15_ratio.append(generalized_demd(logits_t, p_t, emb_hat).item() / exact)
    b, g = np.array(bound_ratio), np.array(eq15_ratio)
    return {
        "n": float(len(b)),
        "bound_mean": float(b.mean()),
        "bound_max": float(b.max()),
        "bound_min": float(b.min()),
        "eq15_mean": float(g.mean()),
        "eq15_min": float(g.min()),
        "eq15_max": float(g.max()),
        "eq15_below_emd": float((g < 1.0 - 1e-9).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"V={args.vocab} d={args.width} cases={args.cases} seed={args.seed} (POT {ot.__version__})"
    )
    header = (
        f"{'regime':<12}{'alpha':>6}{'n':>5} | {'bound/EMD mean':>14}{'min':>7}{'max':>8} | "
        f"{'Eq15/EMD mean':>13}{'min':>7}{'max':>7}{'Eq15<EMD':>9}"
    )
    print(header)
    print("-" * len(header))
    for regime in ("independent", "near"):
        for alpha in args.alphas:
            r = measure(args.vocab, args.cases, args.width, alpha, regime, args.seed)
            print(
                f"{regime:<12}{alpha:>6g}{int(r['n']):>5} | {r['bound_mean']:>14.3f}"
                f"{r['bound_min']:>7.3f}{r['bound_max']:>8.2f} | {r['eq15_mean']:>13.3f}"
                f"{r['eq15_min']:>7.3f}{r['eq15_max']:>7.2f}{100 * r['eq15_below_emd']:>8.0f}%"
            )


if __name__ == "__main__":
    main()
