"""The Markdown table the subprocess benchmarks print: one row per method, time and peak memory
with their ratios against a reference method (a method that failed shows its error line)."""

from __future__ import annotations

from collections.abc import Mapping


def print_ratio_table(
    vocab: int, results: Mapping[str, Mapping[str, float] | str], *, reference: str,
    time_digits: int = 2, with_loss: bool = False,
) -> None:
    """Print ``V = vocab`` and the table of ``results`` (method -> {"time", "peak"[, "loss"]} or
    an error string), ratios against ``results[reference]`` ("-" when it failed or is absent)."""
    ref = results.get(reference)
    cols = ["method", "fwd+bwd (s)", f"x {reference}", "peak memory (MiB)", f"x {reference}"]
    cols += ["loss"] if with_loss else []
    print(f"V = {vocab}\n")
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    for method, r in results.items():
        if isinstance(r, str):
            print(f"| {method} | failed: {r} |" + " |" * (len(cols) - 2))
            continue
        ok = isinstance(ref, Mapping)
        t_ratio = f"{r['time'] / ref['time']:.2f}" if ok else "-"  # type: ignore[index]
        m_ratio = f"{r['peak'] / ref['peak']:.2f}" if ok else "-"  # type: ignore[index]
        cells = [method, f"{r['time']:.{time_digits}f}", t_ratio, f"{r['peak']:.0f}", m_ratio]
        cells += [f"{r['loss']:.5f}"] if with_loss else []
        print("| " + " | ".join(cells) + " |")
    print(flush=True)
