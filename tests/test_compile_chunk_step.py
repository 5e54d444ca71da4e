"""The chunk step of every objective compiles with ``fullgraph=True``.

The engine (:mod:`emdlm.ops.chunked`) reads every data-dependent size of a call in one host
sync at the start of forward (``_Pass.of``, ``ChunkObjective.host_sizes`` / ``begin``), so the
per-chunk function ``objective.chunk(z, out, labels_c, valid_c, start, grad_scale)`` must be
free of them: no ``.item()`` / ``.tolist()`` / ``nonzero`` / ``data_ptr`` / Python branching on
tensor values. Here, for every registered objective (tests/_objectives.py ``SPECS``: every path
of ``PATHS`` of an objective with a from-hidden path, through the ChunkObjective its
``chunk_objective`` gives, so a newly registered one is covered; then option cases beyond the
paths, and EMO distillation's logits-only objective) and both paths of the engine:

* logits: ``z`` is a read-only chunk of the logits, ``out`` the driver's buffer (float32, and
  bfloat16 logits staged into a float32 ``out`` for a few cases);
* hidden: ``z`` IS ``out`` (the head output, overwritten in place), as from hidden states;

the objective is set up as the engine does (``_Pass.of`` then ``begin`` with the real sizes),
then each chunk is run by ``torch.compile(step, fullgraph=True, backend="aot_eager")`` (Dynamo
+ AOTAutograd, no C++ code generation) and by the eager step on a twin objective; loss, the
gradient buffer, the stats and the objective's kept state (NTIL's class-candidate logits) must
agree. ``start`` is a Python int: each chunk is its own specialization (``dynamic=False``).

The logits path of CE / TaiLr / MixCE / NTIL / digit EMD / EMO used to break
the graph at ``z.data_ptr() != out.data_ptr()`` (Dynamo: "Data pointer comparison"); the
objectives now test ``z is out``. The distillation objectives (EMO distillation, the CE + KL
baseline) have no from-hidden path: their chunk objectives run on the logits path only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from _compile_marks import needs_dynamo
from _objectives import PATHS, SPECS
from emdlm.functional.emo import normalize_cost_embedding
from emdlm.numbers import NumberVocab
from emdlm.ops._chunking import prepare_cost
from emdlm.ops.chunked import ChunkObjective, HeadOptions, _Pass
from emdlm.ops.objectives.candidates import CandidateLogits
from emdlm.ops.objectives.emo_distill import EMODistillObjective, KLDistillObjective

TOKENS = (
    [str(d) for d in range(10)]
    + [f"Ġ{d}" for d in range(10)]
    + ["12", "34", "Ġ45", ".", "-", "a", "b", "Ġc", "="]
)
V = len(TOKENS) + 3
VOCAB = NumberVocab.from_token_strings(TOKENS, V)
B, T, CHUNK = 2, 20, 16  # N = 40 rows: chunks of 16, 16 and 8 rows
N = B * T


def _labels() -> torch.Tensor:
    """[B, T] labels, about half digit tokens (numbers for NTIL), a few ignored."""
    gen = torch.Generator().manual_seed(3)
    digits = torch.randint(0, 20, (B, T), generator=gen)
    other = torch.randint(20, len(TOKENS), (B, T), generator=gen)
    labels = torch.where(torch.rand(B, T, generator=gen) < 0.5, digits, other)
    labels[0, :3] = -100
    labels[1, 9] = -100
    return labels


def _cost_embedding() -> torch.Tensor:
    return torch.randn(V, 6, generator=torch.Generator().manual_seed(5))


def _cost() -> torch.Tensor:
    return prepare_cost(normalize_cost_embedding(_cost_embedding()), None, torch.float32)


def _registered(
    name: str, path: str | None, **options: Any
) -> Callable[[torch.Tensor], ChunkObjective]:
    """The ChunkObjective ``from_hidden`` runs for objective ``name`` on ``path`` (with
    ``options`` on top): the loss's own ``chunk_objective`` on a zero-stride stand-in, as
    ``EMDLMLoss.from_hidden`` calls it; noise (NTIL's Gumbel values) from a generator seeded
    alike for both twins."""
    spec = SPECS[name]

    def make(labels: torch.Tensor) -> ChunkObjective:
        loss = spec.build(path, digits=VOCAB, cost_embedding=_cost_embedding(), **options)
        stand_in = torch.zeros(()).expand(*labels.shape, V)  # as EMDLMLoss.from_hidden
        extra = {"generator": torch.Generator().manual_seed(7)} if spec.draws_noise else {}
        objective, _ = loss.chunk_objective(stand_in, labels, **extra)
        return objective

    return make


def _distill(base: str, mode: str) -> Callable[[torch.Tensor], ChunkObjective]:
    teacher = torch.randn(N, V, generator=torch.Generator().manual_seed(9))
    opts = {"base": base, "mode": mode, "mu": 0.7, "temperature": 2.0, "max_ratio": None}
    return lambda labels: EMODistillObjective(teacher.view(B, T, V), _cost(), opts)


def _kl_distill(alpha: float, temperature: float) -> Callable[[torch.Tensor], ChunkObjective]:
    teacher = torch.randn(N, V, generator=torch.Generator().manual_seed(9))
    return lambda labels: KLDistillObjective(teacher.view(B, T, V), alpha, temperature)


#: case -> (registered objective, builder of its ChunkObjective from the labels, paths).
BOTH, LOGITS = ("logits", "hidden"), ("logits",)
CaseTable = dict[str, tuple[str, Callable[[torch.Tensor], ChunkObjective], tuple[str, ...]]]
#: Every path of every objective with a from-hidden path (tests/_objectives.py), but the
#: plain-autograd ``reference`` of its logits forward, whose ChunkObjective is the fast path's
#: (``chunk_objective`` does not depend on ``implementation``).
DERIVED: CaseTable = {
    f"{name}-{path}": (name, _registered(name, path), BOTH)
    for name, path in PATHS
    if SPECS[name].from_hidden and path != SPECS[name].reference
}
#: Options beyond the registered paths, and the objectives without a from-hidden path whose
#: logits path runs a ChunkObjective (the distillation ones: the teacher's [N, V] logits).
EXTRA: CaseTable = {
    "tailr_gamma_min_weight_smoothing": (
        "tailr",
        _registered("tailr", None, gamma=0.3, min_weight=0.1, label_smoothing=0.1),
        BOTH,
    ),
    "tailr_emo_repo_04": ("tailr", _registered("tailr", "emo_repo", mixing_ratio=0.4), BOTH),
    "ntl_l1_token": ("ntl_mse", _registered("ntl_mse", None, loss="l1", averaging="token"), BOTH),
    "emo1_max_ratio": ("emo", _registered("emo", None, max_ratio=3.0), BOTH),
    "emo_static": ("emo", _registered("emo", None, mode="static", mu=0.5), BOTH),
    "emo_distill_kl": ("emo_distill", _distill("kl", "static"), LOGITS),
    "emo_distill_ce_emo1": ("emo_distill", _distill("ce", "emo1"), LOGITS),
    "emo_distill_none_emo2": ("emo_distill", _distill("none", "emo2"), LOGITS),
    "kl_distill_tau1": ("kl_distill", _kl_distill(0.5, 1.0), LOGITS),
    "kl_distill_tau2": ("kl_distill", _kl_distill(0.3, 2.0), LOGITS),
}
assert not DERIVED.keys() & EXTRA.keys()
CASES: CaseTable = {**DERIVED, **EXTRA}
#: Registered objectives without a chunk step, and why.
NO_CHUNK_STEP: dict[str, str] = {}


def test_every_registered_objective_has_a_case() -> None:
    covered = {name for name, _, _ in CASES.values()}
    assert covered | set(NO_CHUNK_STEP) == set(SPECS)  # SPECS: one per registered objective
    assert not covered & set(NO_CHUNK_STEP)


def _setup(make: Callable[[torch.Tensor], ChunkObjective], labels: torch.Tensor) -> tuple:
    """The objective and the engine's pass, as ``chunked_logits_loss`` sets them up."""
    objective = make(labels)
    starts = list(range(0, N, CHUNK))
    bounds = [*starts, N]
    run = _Pass.of(labels, HeadOptions(chunk_size=CHUNK), torch.float32, V, objective, bounds, None)
    objective.begin(starts, N, run.objective_sizes)
    return objective, run, starts


def _state(objective: ChunkObjective) -> torch.Tensor | None:
    """What an objective keeps between chunks and hands to ``finish`` (the number objectives'
    class-candidate logits)."""
    kept = getattr(objective, "kept", None)
    if isinstance(kept, CandidateLogits):
        return kept.logits
    return None


def _run_chunks(
    objective: ChunkObjective,
    run: _Pass,
    starts: list[int],
    logits: torch.Tensor,
    path: str,
    with_grad: bool,
    backend: str | None,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """(loss, gradient, stats) of every chunk, eager (``backend`` None) or compiled."""
    grad_scale = run.scale if with_grad else None

    def step(
        z: torch.Tensor, out: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        res = objective.chunk(z, out, labels, valid, start, grad_scale)
        grad = None
        if res.grad is not None:  # the driver applies grad_scale where the objective left it
            grad = res.grad if res.scaled else res.grad * grad_scale
        return res.loss, grad, res.stats

    fn = step if backend is None else torch.compile(step, fullgraph=True, backend=backend)
    results = []
    for lo in starts:
        hi = min(lo + CHUNK, N)
        z = logits[lo:hi]
        out = torch.empty((hi - lo, V), dtype=torch.float32)
        if path == "hidden":  # the head output: z is out, overwritten by the objective
            z = out.copy_(z)
        loss, grad, stats = fn(z, out, run.labels[lo:hi], run.valid[lo:hi], lo)
        results.append((loss, None if grad is None else grad.clone(), stats))
    return results


def _cases() -> list[Any]:
    params = []
    for case, (_, _, paths) in CASES.items():
        for path in paths:
            params.append(pytest.param(case, path, torch.float32, True, id=f"{case}-{path}"))
    staging = ("ce-default", "tailr_gamma_min_weight_smoothing", "ntil-fused", "emo1_max_ratio")
    for case in (*staging, "emo_distill_kl", "kl_distill_tau2"):  # bf16 staged into float32
        params.append(pytest.param(case, "logits", torch.bfloat16, True, id=f"{case}-bf16"))
    for case in ("ce-default", "mixce-default", "ntil-fused", "emo_static", "emo_distill_kl"):
        params.append(pytest.param(case, "logits", torch.float32, False, id=f"{case}-values"))
    return params


@needs_dynamo
@pytest.mark.slow
@pytest.mark.parametrize(("case", "path", "dtype", "with_grad"), _cases())
def test_chunk_step_compiles_fullgraph_and_equals_eager(
    case: str, path: str, dtype: torch.dtype, with_grad: bool
) -> None:
    _, make, _ = CASES[case]
    labels = _labels()
    gen = torch.Generator().manual_seed(11)
    logits = (3.0 * torch.randn(N, V, generator=gen)).to(dtype)
    eager_obj, eager_run, starts = _setup(make, labels)
    compiled_obj, compiled_run, _ = _setup(make, labels)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=len(starts) + 2):
        got = _run_chunks(compiled_obj, compiled_run, starts, logits, path, with_grad, "aot_eager")
    want = _run_chunks(eager_obj, eager_run, starts, logits, path, with_grad, None)
    for k, ((loss, grad, stats), (loss_e, grad_e, stats_e)) in enumerate(
        zip(got, want, strict=True)
    ):

        def msg(m: str, k: int = k) -> str:
            return f"chunk {k}: {m}"

        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-6, msg=msg)
        torch.testing.assert_close(stats, stats_e, rtol=1e-5, atol=1e-6, msg=msg)
        assert (grad is None) == (grad_e is None) == (not with_grad)
        if grad is not None:
            valid = eager_run.valid[starts[k] : starts[k] + grad.shape[0]]
            # the drivers zero the ignored rows; the objective may leave anything there
            torch.testing.assert_close(grad[valid], grad_e[valid], rtol=1e-5, atol=1e-6, msg=msg)
    state, state_e = _state(compiled_obj), _state(eager_obj)
    if state_e is not None:
        assert state is not None
        torch.testing.assert_close(state, state_e, rtol=0, atol=0)
        assert bool(state_e.abs().sum() > 0)  # number positions were kept


def _breaks(objective: ChunkObjective, run: _Pass, z: torch.Tensor, out: torch.Tensor) -> Any:
    """``torch._dynamo.explain`` of the first chunk's step."""

    def step(z: torch.Tensor, out: torch.Tensor) -> Any:
        res = objective.chunk(z, out, run.labels[:CHUNK], run.valid[:CHUNK], 0, run.scale)
        return res.loss, res.grad, res.stats

    torch._dynamo.reset()
    return torch._dynamo.explain(step)(z, out)


@needs_dynamo
@pytest.mark.slow
def test_chunk_step_graph_has_no_break() -> None:
    """One chunk step per objective and path: one graph, no break (the reasons otherwise)."""
    labels = _labels()
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(13))
    for case, (_, make, paths) in CASES.items():
        for path in paths:
            objective, run, _ = _setup(make, labels)
            out = torch.empty(CHUNK, V)
            z = out.copy_(logits[:CHUNK]) if path == "hidden" else logits[:CHUNK]
            explained = _breaks(objective, run, z, out)
            reasons = [br.reason.splitlines()[0] for br in explained.break_reasons]
            assert explained.graph_break_count == 0, (case, path, reasons)
            assert explained.graph_count == 1, (case, path)


@needs_dynamo
@pytest.mark.slow
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_benchmark_script_runs(path: str) -> None:
    """``benchmarks/chunk_step_compile.py`` (the timing table of docs/results/torch_compile_cpu.md)
    on a tiny chunk: every objective of its path, compiled equal to eager."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "chunk_step_compile.py"
    spec = importlib.util.spec_from_file_location("chunk_step_compile", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = [n for n in bench.OBJECTIVES if path == "logits" or n != "emo_distill"]
    for name in names:
        row = bench.measure(name, "aot_eager", path, 24, 40, 8, 1, "cpu")
        assert row["loss_diff"] <= 1e-4 * max(1.0, abs(row["loss"])), row
        assert row["grad_diff"] <= 1e-6, row
        assert row["eager_s"] > 0 and row["aot_eager_s"] > 0
