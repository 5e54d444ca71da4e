"""At most one host synchronisation per loss call.

On an accelerator every read of a device value on the host (``.item()``, ``bool(t)``,
``.tolist()``, ``nonzero``, ``unique``, a host→device copy of a Python list...) waits for the
whole queue of kernels before it. One forward + backward of every registered objective, on the
logits path and from hidden states, for reduction "sum" and "mean", may do at most ONE such
read: the one ``.tolist()`` that reads every data-dependent size of the call together with the
label-range check.

The counter runs on CPU, where nothing waits, so it counts what WOULD sync on a GPU:

* ops seen by a ``TorchDispatchMode``: ``_local_scalar_dense`` (``.item()``, ``bool``, ``int``,
  ``float``), ``nonzero`` (not ``nonzero_static``, which takes its size from the caller),
  ``unique*``, ``masked_select``, ``repeat_interleave``, ``is_nonzero``, ``equal``;
* ``Tensor.tolist`` (read in C++, invisible to a dispatch mode): patched;
* ``torch.tensor`` / ``torch.as_tensor`` with an explicit ``device=``: host data copied to the
  inputs' device, a synchronous copy on CUDA.

The logits driver skips the in-place scaling of its [N, V] gradient buffer when grad_output is
exactly 1 only where reading that value is free (CPU tensors); the counter applies the
accelerator policy (never read it), pinned on its own by
``test_backward_never_reads_device_factor``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import emdlm
from _number_tokens import TOKENS, VOCAB, V
from _objectives import SPECS, random_cost_embedding
from emdlm.losses.ntil import NTILLoss

H = 16
EMB = random_cost_embedding(V, 6, seed=11)

#: Overload packets that read a device value on the host (or size an output by one).
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "masked_select",
        "repeat_interleave",
        "is_nonzero",
        "equal",
    }
)


class SyncCounter(TorchDispatchMode):
    """Counts host syncs (see the module docstring); ``where`` says which op and call site."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()
        self._patched: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.where[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def _patch(self, owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._patched.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def __enter__(self) -> SyncCounter:
        def tolist(original: Any) -> Any:
            def counted(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                self.where["Tensor.tolist"] += 1
                return original(t, *a, **k)

            return counted

        def to_device(original: Any) -> Any:
            def counted(*a: Any, **k: Any) -> Any:
                if k.get("device") is not None:
                    self.where["torch.tensor(..., device=)"] += 1
                return original(*a, **k)

            return counted

        self._patch(torch.Tensor, "tolist", tolist)
        self._patch(torch, "tensor", to_device)
        self._patch(torch, "as_tensor", to_device)
        try:  # the accelerator policy of the backward scaling (module docstring)
            from emdlm.ops import chunked

            if hasattr(chunked, "_grad_output_is_one"):
                self._patched.append((chunked, "_grad_output_is_one", chunked._grad_output_is_one))
                chunked._grad_output_is_one = lambda factor: False
        except ImportError:  # pragma: no cover
            pass
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def _labels() -> torch.Tensor:
    """[3, 12]: numbers (multi-digit, decimal, signed), prompt / padding / a whole ignored row."""
    tok = {t: i for i, t in enumerate(TOKENS)}
    rows = [
        ["a", "=", "1", "2", ".", "5", "Ġc", "Ġ123", "Ġ45", "b", "-", "7"],
        ["Ġ-", "34", "00", "a", "Ġ.", "9", "=", "Ġ1", "2", "3", "b", "a"],
        ["a"] * 12,
    ]
    labels = torch.tensor([[tok[t] for t in row] for row in rows])
    labels[0, :2] = -100  # prompt
    labels[1, -3:] = -100  # right padding
    labels[2] = -100  # an all-ignored row
    return labels


# objective -> options of its default (training) implementation here, with chunks small enough
# that every call runs several.
OPTIONS: dict[str, dict[str, Any]] = {
    "emd": {"chunk_elements": 4 * V},
    "ntil": {"chunk_elements": 4 * V},
    "emo": {"chunk_size": 5},
    "tailr": {"label_smoothing": 0.1},
    "emo_distill": {"chunk_size": 5},
    "kl_distill": {"temperature": 2.0},
}


def _build(name: str, reduction: str) -> nn.Module:
    """Objective ``name`` (tests/_objectives.py) with the class defaults and its OPTIONS, called
    as ``fn(logits, labels)`` (a distillation objective gets fixed teacher logits)."""
    spec = SPECS[name]
    options = dict(OPTIONS.get(name, {}))
    if spec.draws_noise:
        options["generator"] = torch.Generator().manual_seed(3)
    return spec.build(
        digits=VOCAB, cost_embedding=EMB, fixed_teacher=True, reduction=reduction, **options
    )


CASES = [
    pytest.param(name, path, reduction, id=f"{name}-{path}-{reduction}")
    for name in SPECS
    for path in ("logits", "hidden")
    for reduction in ("sum", "mean")
]


def test_every_registered_objective_is_counted() -> None:
    """Every entry of tests/_objectives.py (checked against the registry in
    test_objective_registry.py) is counted here."""
    assert {case.values[0] for case in CASES} == set(SPECS)


def _call(fn: nn.Module, path: str, labels: torch.Tensor) -> list[torch.Tensor]:
    """One forward + backward (grad_output 2, as under a loss divided by a token count); the
    inputs, whose gradients are checked by the caller (outside the counter)."""
    gen = torch.Generator().manual_seed(0)
    if path == "logits":
        # A sliced view, as a causal LM's logits[:, :-1]: chunks follow its rows.
        full = torch.randn(labels.shape[0], labels.shape[1] + 1, V, generator=gen)
        logits = full.requires_grad_(True)
        out = fn(logits[:, :-1], labels)
        grads = [logits]
    else:
        hidden = torch.randn(*labels.shape, H, generator=gen).requires_grad_(True)
        weight = torch.randn(V, H, generator=gen).requires_grad_(True)
        out = fn.from_hidden(hidden, weight, labels, chunk_size=4)
        grads = [hidden, weight]
    (2 * out.loss).backward()
    return grads


@pytest.mark.parametrize(("name", "path", "reduction"), CASES)
def test_one_host_sync_per_loss_call(name: str, path: str, reduction: str) -> None:
    fn = _build(name, reduction)
    if path == "hidden" and not hasattr(fn, "from_hidden"):
        pytest.skip(f"{name} has no from-hidden path")
    labels = _labels()
    _call(fn, path, labels)  # warm: lazily built tables and device copies are cached
    with SyncCounter() as counter:
        inputs = _call(fn, path, labels)
    for x in inputs:
        assert x.grad is not None and torch.isfinite(x.grad).all()
    print(f"{emdlm.__file__}: {name} {path} {reduction}: {counter.total} {dict(counter.where)}")
    assert counter.total <= 1, dict(counter.where)


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_bad_labels_raise_before_any_gradient(path: str) -> None:
    """The one sync still validates: the same clear error, and no gradient was produced."""
    labels = _labels()
    labels[1, 2] = V + 3
    fn = _build("ntil", "sum")
    gen = torch.Generator().manual_seed(0)
    if path == "logits":
        x = torch.randn(*labels.shape, V, generator=gen).requires_grad_(True)
        call = lambda: fn(x, labels)  # noqa: E731
    else:
        x = torch.randn(*labels.shape, H, generator=gen).requires_grad_(True)
        w = torch.randn(V, H, generator=gen)
        call = lambda: fn.from_hidden(x, w, labels)  # noqa: E731
    with pytest.raises(ValueError, match=rf"labels out of range .* logit rows: found \[{V + 3}\]"):
        call()
    assert x.grad is None


def test_backward_never_reads_device_factor() -> None:
    """Backward's skip of the [N, V] scaling reads grad_output only where that is free (CPU);
    a device value is never read (a meta tensor has none to read)."""
    from emdlm.ops.chunked import _grad_output_is_one

    assert _grad_output_is_one(torch.ones(())) is True
    assert _grad_output_is_one(torch.full((), 2.0)) is False
    assert _grad_output_is_one(torch.ones((), device="meta")) is False


def test_counts_before_even_and_uneven_bounds() -> None:
    from emdlm.ops.chunked import counts_before

    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    cum = [0, *torch.cumsum(mask.long(), 0).tolist()]
    for bounds in ([0, 4, 8, 11], [0, 5, 10, 11], [0, 3, 7, 8, 11], [0, 11], [0], [0, 0]):
        assert counts_before(mask, bounds).tolist() == [cum[b] for b in bounds], bounds


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_ntil_uneven_chunks_equal_reference(path: str) -> None:
    """Number tokens are cut per chunk from the one sync's counts: chunks of 5 rows over a
    sliced [3, 12, V] view (uneven bounds 0, 5, 10, 12, 17, ...) give the reference's loss and
    gradients."""
    labels = _labels()
    gen = torch.Generator().manual_seed(1)
    kw = {"value_mode": "argmax", "reduction": "sum"}
    if path == "logits":
        full = torch.randn(3, 13, V, generator=gen)
        fused = NTILLoss(VOCAB, chunk_elements=5 * V, **kw)
        reference = NTILLoss(VOCAB, implementation="reference", **kw)
        grads = []
        for fn in (fused, reference):
            x = full.clone().requires_grad_(True)
            out = fn(x[:, :-1], labels)
            (2 * out.loss).backward()
            grads.append((out.loss.detach(), x.grad))
    else:
        hidden = torch.randn(3, 12, H, generator=gen)
        weight = torch.randn(V, H, generator=gen)
        fn = NTILLoss(VOCAB, **kw)
        grads = []
        for chunked in (True, False):
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            out = fn.from_hidden(h, w, labels, chunk_size=5) if chunked else fn(h @ w.T, labels)
            (2 * out.loss).backward()
            grads.append((out.loss.detach(), h.grad, w.grad))
    for got, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
