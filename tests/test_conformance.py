"""The conformance suite: one set of checks run over every registered objective.

A new objective is tested here by being registered: its entry in ``emdlm.objective_specs`` and
in tests/_objectives.py (``SPECS``, which tests/test_objective_registry.py holds equal to the
registry) parametrizes every check below, over each of its implementation paths / presets
(``PATHS``) where the path matters. A check is skipped only by what the objective declares, and
the skip names the declaration: ``has_from_hidden`` (the class, :class:`emdlm.losses.base.
EMDLMLoss`), ``reference`` (the spec: None when there is one implementation), or
``BATCH_LEVEL`` below (the documented exceptions to exact gradient accumulation). Every check
runs on tiny float64 (or float32) inputs: a number vocabulary with every kind of number token
(tests/_number_tokens.py), labels with numbers, other tokens and ignored positions, grad_output
= 2; distillation objectives get fixed random teacher logits.

What registering gives an objective, check by check:

1. ``test_path_equals_reference``: every implementation path equals the reference path of its
   spec (value, components and gradient, float64, the path's other options kept).
2. ``test_ignored_positions_never_leak``: ignored positions appended to a batch (random or NaN
   logits there, and the teacher's) change neither the loss nor the counted positions'
   gradient, and get an exact 0 gradient; ``test_all_ignored_is_a_finite_zero``: a batch
   whose every label is ignored (clean or NaN logits) gives a loss of exactly 0, a zero
   gradient and ``n_tokens`` 0, for both reductions.
3. ``test_sum_is_mean_times_scored_count``: reduction "sum" is "mean" x the scored count, value
   and gradient.
4. ``test_gradient_accumulation``: two micro-batches with reduction "sum", each divided by the
   total scored count (as ``make_compute_loss_func`` does), give the one batch's loss and
   gradient; for an objective of ``BATCH_LEVEL`` (a batch ratio or batch means, documented in
   ``emdlm.losses.ntil``) that holds under the options declared there, and with its own
   options the two differ (the documented difference, kept as a check so that a stale
   declaration fails).
5. ``test_from_hidden_equals_logits``: ``from_hidden(hidden, W, labels, b, ...)`` equals the
   logits path on ``hidden @ W.T + b`` (value, components and the gradients of hidden, weight
   and bias), plain and with ``logit_scale`` / ``softcap``; objectives with ``has_from_hidden``.
6. ``test_compiled_equals_eager``: the head and the loss compiled as one function
   (``torch.compile``, a graph-counting eager backend: Dynamo traces as inductor does, without
   codegen) give the eager loss and gradients, on the logits path and from hidden states.
7. Reduction in training: ``make_compute_loss_func`` refuses "mean" and a real
   ``transformers.Trainer`` step with gradient accumulation divides the summed loss by the
   step's token count, for every objective: tests/test_trainer_reduction.py (Trainer runs,
   kept there). FSDP: tests/test_fsdp.py trains CE and NTIL sharded on 2 gloo processes (one
   heavy launch, not per objective) and its worker compares the from-hidden loss on a sharded
   head with one process for every objective with ``has_from_hidden`` (its list is taken from
   ``SPECS``; a row split across ranks is exact under ``BATCH_LEVEL``'s options, as
   accumulation).
8. Declarations: tests/test_objective_registry.py checks that the registry and ``SPECS`` agree
   and that every class is an ``EMDLMLoss`` whose declarations (``needs_teacher``,
   ``takes_number_mask``, ``has_from_hidden``) are what the spec says.

Also over every path, elsewhere: non-finite logits (NaN, -inf rows, +inf) at ignored positions
in float32 and bfloat16, empty batches, float64 logits and narrow integer labels
(tests/test_padding_and_edge_inputs.py).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from _compile_marks import needs_dynamo
from _number_tokens import TOKENS, VOCAB, V
from _objectives import PATHS, SPECS, random_cost_embedding
from emdlm.losses.base import HIDDEN_TRANSFORMS

F64 = torch.float64
H = 8  # hidden size of the from-hidden and compile checks
COST = random_cost_embedding(V, 6, seed=11)  # EMO's cost embedding (d' = 6 != H)
PATH_IDS = [f"{name}-{path}" for name, path in PATHS]

#: Objectives whose loss with its own options is not a sum of per-token terms, so gradient
#: accumulation cannot be exact, mapped to the options under which it is (documented in the
#: classes): NTIL / digit EMD (emdlm.losses.ntil, emdlm.functional.ntil: the dynamic mix
#: λ·sg(CE/NTIL) is a ratio of batch means, and "batch" / "row" averaging are batch means;
#: mix="static", averaging="token" give Σ_t CE_t + λ·Σ NTIL terms; deterministic values, no
#: Gumbel noise per call; also in tests/test_integrations_transformers.py, through a model),
#: NTL (emdlm.losses.ntl: averaging="number" is a mean over the batch's number tokens;
#: averaging="token" divides by the counted labels).
BATCH_LEVEL: dict[str, dict[str, Any]] = {
    "emd": {"mix": "static", "averaging": "token"},
    "ntil": {"mix": "static", "averaging": "token", "value_mode": "expected"},
    "ntl_mse": {"averaging": "token"},
    "ntl_was": {"averaging": "token"},
    "number_level": {"averaging": "token"},
}


def build(name: str, path: str | None = None, **options: Any) -> nn.Module:
    """Objective ``name`` on ``path`` (None: the class defaults) with ``options`` over VOCAB /
    COST; noise (NTIL's Gumbel values) from a generator seeded alike on every build."""
    if SPECS[name].draws_noise:
        options.setdefault("generator", torch.Generator().manual_seed(7))
    return SPECS[name].build(path, digits=VOCAB, cost_embedding=COST, **options)


def make_labels(b: int, t: int, seed: int) -> torch.Tensor:
    """Runs of digits (numbers), other tokens and ignored labels; row 0 starts with an ignored
    prompt, so the rows score different counts."""
    gen = torch.Generator().manual_seed(seed)
    digits = torch.randint(0, 10, (b, t), generator=gen)
    other = torch.randint(28, len(TOKENS), (b, t), generator=gen)  # not number tokens
    pick = torch.rand(b, t, generator=gen)
    labels = torch.where(pick < 0.6, digits, other)
    labels[pick > 0.88] = -100
    labels[0, :3] = -100
    return labels


B, T = 4, 9
LABELS = make_labels(B, T, seed=3)
LOGITS = 2.0 * torch.randn(B, T, V, generator=torch.Generator().manual_seed(1), dtype=F64)
TEACHER = 2.0 * torch.randn(B, T + 3, V, generator=torch.Generator().manual_seed(2), dtype=F64)


def run(
    name: str, fn: nn.Module, logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss, gradient of the logits with grad_output 2, components); ``teacher`` is sliced to
    the logits' shape and passed to an objective that ``needs_teacher``."""
    x = logits.clone().requires_grad_()
    extra = {"teacher_logits": teacher[: x.shape[0], : x.shape[1]].to(x.dtype)}
    out = fn(x, labels, **(extra if fn.needs_teacher else {}))
    (2 * out.loss).backward()
    return out.loss.detach(), x.grad, {k: float(v) for k, v in out.components.items()}


def assert_components(got: dict[str, float], want: dict[str, float], rel: float) -> None:
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=rel, abs=rel), k


# ------------------------------------------------------------------ 1. paths equal the reference
@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_path_equals_reference(name: str, path: str) -> None:
    spec = SPECS[name]
    if spec.reference is None:
        pytest.skip(f"{name}: reference is None in its spec (one implementation)")
    if path == spec.reference:
        pytest.skip(f"{name}: {path!r} is the reference path")
    options = {**spec.paths[path], **spec.paths[spec.reference]}  # the reference, same options
    loss, grad, comps = run(name, build(name, path), LOGITS, LABELS, TEACHER)
    ref_loss, ref_grad, ref_comps = run(name, build(name, **options), LOGITS, LABELS, TEACHER)
    assert loss.dtype == F64 and grad.dtype == F64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert_components(comps, ref_comps, rel=1e-9)
    assert float(grad.abs().max()) > 0


# ------------------------------------------------------------------ 2. padding never leaks
@pytest.mark.parametrize("fill", ["random", "nan"])
@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_ignored_positions_never_leak(name: str, path: str, fill: str) -> None:
    """Three ignored positions appended to every row (right padding): same loss, same gradient
    on the counted positions, exactly 0 gradient on the padding."""
    pad = 5 * torch.randn(B, 3, V, generator=torch.Generator().manual_seed(4), dtype=F64)
    if fill == "nan":
        pad[:] = float("nan")
    padded = torch.cat([LOGITS, pad], dim=1)
    padded_labels = torch.cat([LABELS, torch.full((B, 3), -100)], dim=1)
    loss, grad, comps = run(name, build(name, path), LOGITS, LABELS, TEACHER)
    p_loss, p_grad, p_comps = run(name, build(name, path), padded, padded_labels, TEACHER)
    assert torch.isfinite(p_loss) and torch.isfinite(p_grad).all()
    torch.testing.assert_close(p_loss, loss)
    torch.testing.assert_close(p_grad[:, :T], grad)
    assert float(p_grad[:, T:].abs().max()) == 0.0
    assert_components(p_comps, comps, rel=1e-9)
    assert float(grad.abs().max()) > 0


@pytest.mark.parametrize("fill", ["clean", "nan"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_all_ignored_is_a_finite_zero(name: str, path: str, reduction: str, fill: str) -> None:
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(5))
    if fill == "nan":
        logits[:] = float("nan")
    labels = torch.full((2, 3), -100)
    loss, grad, comps = run(name, build(name, path, reduction=reduction), logits, labels, TEACHER)
    assert loss.dim() == 0 and float(loss) == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert int(comps["n_tokens"]) == 0


# ------------------------------------------------------------------ 3. reduction
@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_sum_is_mean_times_scored_count(name: str, path: str) -> None:
    count = int((LABELS != -100).sum())
    mean_fn, sum_fn = build(name, path), build(name, path, reduction="sum")
    assert (mean_fn.reduction, sum_fn.reduction) == ("mean", "sum")
    loss, grad, comps = run(name, mean_fn, LOGITS, LABELS, TEACHER)
    s_loss, s_grad, s_comps = run(name, sum_fn, LOGITS, LABELS, TEACHER)
    torch.testing.assert_close(s_loss, loss * count, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s_grad, grad * count, rtol=1e-10, atol=1e-12)
    assert int(s_comps["n_tokens"]) == int(comps["n_tokens"]) == count


# ------------------------------------------------------------------ 4. gradient accumulation
def _accumulate(name: str, path: str, options: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(loss, grad) of the whole batch and of its two micro-batches (rows 0-1, 2-3), each
    micro-batch's "sum" divided by the whole batch's scored count, and the micro-batches'
    "mean" losses and counts."""
    total = int((LABELS != -100).sum())
    full_loss, full_grad, _ = run(name, build(name, path, reduction="sum", **options),
                                  LOGITS, LABELS, TEACHER)  # fmt: skip
    acc_loss, acc_grads, mean_losses, counts = 0.0, [], [], []
    for rows in (slice(0, 2), slice(2, 4)):
        teacher = TEACHER[rows]
        loss, grad, _ = run(name, build(name, path, reduction="sum", **options),
                            LOGITS[rows], LABELS[rows], teacher)  # fmt: skip
        acc_loss = acc_loss + loss / total
        acc_grads.append(grad / total)
        mean_losses.append(run(name, build(name, path, **options), LOGITS[rows], LABELS[rows],
                               teacher)[0])  # fmt: skip
        counts.append(int((LABELS[rows] != -100).sum()))
    assert counts[0] != counts[1]  # unequal micro-batches: a mean of means would differ
    return (full_loss / total, full_grad / total, acc_loss, torch.cat(acc_grads),
            torch.stack(mean_losses), torch.tensor(counts, dtype=F64) / total)  # fmt: skip


@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_gradient_accumulation(name: str, path: str) -> None:
    per_token = BATCH_LEVEL.get(name, {})
    full, full_grad, acc, acc_grad, _, _ = _accumulate(name, path, per_token)
    torch.testing.assert_close(acc, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(acc_grad, full_grad, rtol=1e-9, atol=1e-12)
    own = SPECS[name].paths[path]
    if per_token and {**own, **per_token} != own:
        # the declared difference: with its own options, the accumulated loss is the token-share
        # weighted mean of the micro-batch means, and its gradient is not the whole batch's
        # (the dynamic mix's value can still agree: CE + λ·sg(CE/EMD)·EMD = (1 + λ)·CE)
        _, full_grad, acc, acc_grad, means, shares = _accumulate(name, path, {})
        torch.testing.assert_close(acc, (shares * means).sum(), rtol=1e-10, atol=1e-12)
        assert not torch.allclose(acc_grad, full_grad, rtol=1e-4, atol=1e-6)


def test_batch_level_declarations_are_registered_objectives() -> None:
    assert set(BATCH_LEVEL) <= set(SPECS)


# ------------------------------------------------------------------ 4b. one call signature
#: The keywords of every loss call, on both routes (emdlm.losses.base).
CALL_KEYWORDS = ("number_mask", "teacher_logits", "loss_weights")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_one_call_signature(name: str) -> None:
    """``forward`` and ``from_hidden`` of every registered objective take the same keyword-only
    ``number_mask``, ``teacher_logits``, ``loss_weights`` (default None)."""
    cls = SPECS[name].cls
    for method in (cls.forward, cls.from_hidden):
        params = inspect.signature(method).parameters
        for key in CALL_KEYWORDS:
            assert key in params, f"{cls.__name__}.{method.__name__} lacks {key}="
            assert params[key].kind is inspect.Parameter.KEYWORD_ONLY, (cls.__name__, key)
            assert params[key].default is None, (cls.__name__, key)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_call_keywords_not_declared_are_refused_by_name(name: str) -> None:
    """A keyword the objective does not take is an error naming it, on both routes: loss
    weights without ``takes_loss_weights`` (never silently ignored; where taken, weights of 1
    give the unweighted loss), a number mask without ``takes_number_mask``, teacher logits
    without ``needs_teacher`` (and none with it)."""
    fn = build(name)
    cls_name = type(fn).__name__
    teacher = {"teacher_logits": TEACHER[:, :T]} if fn.needs_teacher else {}
    x = LOGITS.clone().requires_grad_()
    ones = torch.ones(B, T, dtype=F64)
    if fn.takes_loss_weights:
        got = fn(x, LABELS, loss_weights=ones, **teacher).loss
        torch.testing.assert_close(got, fn(x, LABELS, **teacher).loss)
    else:
        with pytest.raises(NotImplementedError, match=f"{cls_name} takes no loss_weights"):
            fn(x, LABELS, loss_weights=ones, **teacher)
    if not fn.takes_number_mask:
        with pytest.raises(ValueError, match=f"{cls_name} scores no numbers"):
            fn(x, LABELS, number_mask=torch.ones(B, T, dtype=torch.bool), **teacher)
    if fn.needs_teacher:
        with pytest.raises(ValueError, match=f"{cls_name} distils from a teacher"):
            fn(x, LABELS)
    else:
        with pytest.raises(ValueError, match=f"{cls_name} does not distil"):
            fn(x, LABELS, teacher_logits=LOGITS)
    if fn.has_from_hidden:
        h, w, b = hidden_inputs()
        if fn.takes_loss_weights:
            got = fn.from_hidden(h, w, LABELS, b, loss_weights=ones).loss
            torch.testing.assert_close(got, fn.from_hidden(h, w, LABELS, b).loss)
        else:
            with pytest.raises(NotImplementedError, match=f"{cls_name} takes no loss_weights"):
                fn.from_hidden(h, w, LABELS, b, loss_weights=ones)
        if not fn.takes_number_mask:
            with pytest.raises(ValueError, match=f"{cls_name} scores no numbers"):
                fn.from_hidden(h, w, LABELS, b, number_mask=torch.ones(B, T, dtype=torch.bool))
        with pytest.raises(ValueError, match=f"{cls_name} does not distil"):
            fn.from_hidden(h, w, LABELS, b, teacher_logits=LOGITS)


# ------------------------------------------------------------------ 5. from hidden states
def hidden_inputs(dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(B, T, H, generator=gen, dtype=F64)
    weight = 0.7 * torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype)


def head(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
         scale: float | None = None, cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """The unfused head cap·tanh(s·(h Wᵀ + b)/cap) (float64 inputs stay float64)."""
    z = h @ w.T if b is None else h @ w.T + b
    if scale is not None:
        z = z * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z


def _skip_without_from_hidden(name: str) -> None:
    if not SPECS[name].cls.has_from_hidden:
        pytest.skip(f"{name}: {SPECS[name].cls.__name__}.has_from_hidden is False")


def _skip_without_transforms(name: str) -> None:
    taken = getattr(SPECS[name].cls, "hidden_transforms", HIDDEN_TRANSFORMS)
    if not {"logit_scale", "softcap"} <= set(taken):
        pytest.skip(f"{name}: {SPECS[name].cls.__name__}.hidden_transforms is {taken}")


def both_paths(
    name: str, path: str | None, dtype: torch.dtype, scale: float | None, cap: float | None
) -> tuple[list[tuple[torch.Tensor, ...]], list[dict[str, float]]]:
    """[(loss, grad_hidden, grad_weight, grad_bias)] and [components] of the from-hidden path
    (chunk_size 5 over 36 rows of 9: chunks end mid-row and split numbers) and of the logits
    path on the unfused head, grad_output 2."""
    results, comps = [], []
    for which in ("hidden", "logits"):
        h, w, b = (x.clone().requires_grad_() for x in hidden_inputs(dtype))
        fn = build(name, path)
        if which == "hidden":
            out = fn.from_hidden(h, w, LABELS, b, chunk_size=5, logit_scale=scale, softcap=cap)
        else:
            out = fn(head(h, w, b, scale, cap), LABELS)
        (2 * out.loss).backward()
        results.append((out.loss.detach(), h.grad, w.grad, b.grad))
        comps.append({k: float(v) for k, v in out.components.items()})
    return results, comps


def assert_same(got: tuple, want: tuple, rtol: float, atol: float, scaled: bool = False) -> None:
    """Loss and gradients close, same dtype; ``scaled``: atol relative to the tensor's largest
    entry (bf16, where a sum of rounded terms can cancel to a small entry with a large relative
    error)."""
    for label, g, r in zip(("loss", "hidden", "weight", "bias"), got, want, strict=True):
        assert g.dtype == r.dtype, label
        tol = atol * max(float(r.abs().max()), 1.0) if scaled else atol
        torch.testing.assert_close(g, r, rtol=rtol, atol=tol, msg=lambda m, k=label: f"{k}: {m}")


# dtype -> (rtol, atol) of loss and gradients, (rel = abs) of the components
FROM_HIDDEN_TOLS = {torch.float64: ((1e-9, 1e-12), 1e-9), torch.float32: ((2e-5, 2e-6), 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("transform", ["plain", "scale+softcap"])
@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_from_hidden_equals_logits(
    name: str, path: str, transform: str, dtype: torch.dtype
) -> None:
    _skip_without_from_hidden(name)
    scale, cap = None, None
    if transform != "plain":
        _skip_without_transforms(name)
        scale, cap = 0.8, 3.0
    (got, want), (comps, want_comps) = both_paths(name, path, dtype, scale, cap)
    (rtol, atol), rel = FROM_HIDDEN_TOLS[dtype]
    assert got[0].dtype == dtype
    assert_same(got, want, rtol, atol)
    assert_components(comps, want_comps, rel=rel)
    if transform != "plain":  # the transform is applied, not ignored by both paths
        h, w, b = hidden_inputs(dtype)
        plain = build(name, path)(head(h, w, b), LABELS).loss
        assert not torch.allclose(got[0], plain)


@pytest.mark.parametrize("name", list(SPECS))
def test_from_hidden_bf16(name: str) -> None:
    """The class defaults on bfloat16 hidden states and head: the logits path rounds the
    [N, V] gradient to bf16 once; the from-hidden path rounds its parts separately and
    accumulates grad_W in float32."""
    _skip_without_from_hidden(name)
    (got, want), _ = both_paths(name, None, torch.bfloat16, None, None)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert_same(got, want, rtol=2e-2, atol=1e-2, scaled=True)


@pytest.mark.parametrize(("name", "path"), PATHS, ids=PATH_IDS)
def test_from_hidden_ignored_positions_never_leak(name: str, path: str) -> None:
    """NaN hidden states at ignored positions (a whole ignored row among them) change nothing,
    bit for bit; an all-ignored batch gives exactly 0 with zero gradients (soft-capped head,
    chunks of 4 rows)."""
    _skip_without_from_hidden(name)
    hidden, weight, bias = hidden_inputs(torch.float32)
    labels = LABELS.clone()
    labels[1] = -100
    for all_ignored in (False, True):
        lab = torch.full_like(labels, -100) if all_ignored else labels
        runs = []
        for poison in (0.0, float("nan")):
            h = hidden.clone()
            h[lab == -100] = poison  # padding rows hold NaN in the second run
            h.requires_grad_()
            w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            out = build(name, path).from_hidden(h, w, lab, b, chunk_size=4, softcap=5.0)
            out.loss.backward()
            assert torch.isfinite(out.loss)
            runs.append((out.loss.detach(), h.grad, w.grad, b.grad))
        assert_same(runs[1], runs[0], rtol=0, atol=0)  # NaN padding changes nothing
        if all_ignored:
            assert float(runs[0][0]) == 0.0
            assert all(float(g.abs().max()) == 0.0 for g in runs[0][1:])
        else:
            assert float(runs[0][1].abs().max()) > 0


# ------------------------------------------------------------------ 6. torch.compile
class _Graphs:
    """A torch.compile backend that runs the traced graphs eagerly and counts them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.count += 1
        return gm.forward


@needs_dynamo
@pytest.mark.slow
@pytest.mark.parametrize("where", ["logits", "from_hidden"])
@pytest.mark.parametrize("name", list(SPECS))
def test_compiled_equals_eager(name: str, where: str) -> None:
    """The class defaults (the path training takes), float32: head + loss as one compiled
    function (as a model whose forward returns the loss); the chunked kernels run as graph
    breaks (emdlm.ops._compile)."""
    if where == "from_hidden":
        _skip_without_from_hidden(name)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(B, T + 1, H, generator=gen)  # one more position: the shift below
    weight = 0.7 * torch.randn(V, H, generator=gen)
    teacher = TEACHER[:, :T].float()

    def step(fn: nn.Module, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A stand-in model (sin, head) and the loss on the shifted, non-contiguous slices."""
        z = torch.sin(h)
        if where == "from_hidden":
            return fn.from_hidden(z[:, :-1], w, LABELS, chunk_size=5).loss
        extra = {"teacher_logits": teacher} if fn.needs_teacher else {}
        return fn((z @ w.T)[:, :-1], LABELS, **extra).loss

    results = []
    backend = _Graphs()
    torch._dynamo.reset()  # a fresh cache: no earlier objective's guards, no recompile limit
    for runner in (step, torch.compile(step, backend=backend)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = runner(build(name), h, w)
        (2 * loss).backward()
        results.append((loss.detach(), h.grad, w.grad))
    torch._dynamo.reset()
    assert backend.count > 0  # Dynamo traced (a graph before the loss at least)
    for label, got, want in zip(("loss", "hidden", "weight"), *results[::-1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=label: f"{k}: {m}")  # fmt: skip
