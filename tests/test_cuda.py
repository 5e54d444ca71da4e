"""Every objective on the test device against the float64 CPU reference.

The tests marked ``cuda`` run on the device of the ``device`` fixture: ``cuda`` where a GPU is
visible, else ``cpu`` (CI), or whatever ``EMDLM_TEST_DEVICE`` names (tests/conftest.py). The code
is the same on both, so the CPU run in CI keeps them alive and a GPU session runs them unchanged
(``pytest -m cuda tests/test_cuda.py``, or ``benchmarks/gpu_suite.py``, docs/gpu.md).

What is checked:
- every registered objective (tests/_objectives.py) x {logits, from hidden} x {fp32,
  bf16, fp16 under autocast}: loss value and gradients (logits; hidden and head weight) of the
  default fast path on the device against the functional reference in float64 on the CPU, fed
  the same (rounded) inputs; the distillation objectives have no from-hidden path (their target
  is the teacher's [N, V] logits) and say so;
- NTIL's Gumbel noise drawn by a generator on the device: both paths agree;
- ``emdlm train`` (the CLI) of a tiny GPT-2 (fp32 logits, bf16 from hidden) and a tiny Qwen2-VL:
  the model trains on the device the Trainer picked, which is the test device;
- a tiny Llama trained through ``torch.compile`` equals eager on the device, and the from-hidden
  losses inside a compiled step give the eager gradients;
- ``benchmarks/gpu_suite.py --quick`` (not marked ``cuda``: the suite itself runs the ``cuda``
  tests) writes its Markdown report with every row.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _objectives import SPECS, random_cost_embedding
from emdlm.integrations.loss_contract import declared_needs
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo import EMOLoss
from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
from emdlm.objectives import DISTILL

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.cuda

B, T, H = 4, 16, 32  # small: the CPU run of this file stays well under a minute
EXTRA_ROWS = 7  # logit rows past the tokenizer's (padded vocabularies, as Qwen's 151936)
WIDTH = 12  # EMO cost-embedding width (!= H)

# Tolerances per precision, relative to the float64 reference on the same rounded inputs:
# (rtol, atol as a fraction of the reference tensor's largest entry). Observed on the CPU
# (torch 2.13): fp32 <= 5e-7, bf16 <= 8.5e-3, fp16 autocast <= 4.5e-4 of the largest entry.
# - fp32: softmax and sums in float32 over V < 100 and N = 64 rows; chunked sums change the
#   summation order, so errors are a few ulp of float32 (~1e-7) times the row count; 1e-4 leaves
#   a wide margin (a GPU reduces in another order) and still catches any real formula or
#   masking error (those are O(1e-2) and up).
# - bf16: the logits / hidden states / weights are bf16 inputs (the reference sees the same
#   rounded values), but a bf16 gradient is itself rounded to 8 bits of mantissa (relative
#   2^-8 = 3.9e-3) and from hidden the logits h·Wᵀ are formed in bf16 (H = 32 products, each
#   rounded), which moves softmax probabilities by ~|z|·2^-8: 3e-2 relative, 2e-2 of the
#   largest entry absolute (entries far below the largest lose relative precision when summed).
# - fp16 autocast: fp16 has 11 bits of mantissa (2^-11 = 4.9e-4): 8x tighter than bf16, then
#   doubled for the fp16 logits feeding a float32 softmax: 1e-2 / 4e-3.
TOLERANCES = {"fp32": (1e-4, 1e-5), "bf16": (3e-2, 2e-2), "fp16_autocast": (1e-2, 4e-3)}
PRECISIONS = tuple(TOLERANCES)


@pytest.fixture(scope="module")
def device() -> torch.device:
    """``EMDLM_TEST_DEVICE`` when set (conftest skips a forced device that is absent), else
    ``cuda`` when a GPU is visible, else ``cpu``."""
    forced = os.environ.get("EMDLM_TEST_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Tiny shapes on the CPU: one thread. Two OpenMP threads on CI's two shared, busy cores
    spin-wait for each other (a 1-layer training step took 800 ms instead of 15 ms)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok() -> Any:
    from emdlm.tokenizers import load_tokenizer

    return load_tokenizer("char")  # one token per character: digits '0'..'9' are tokens


# ----------------------------------------------------------------- objectives and inputs
def _cost_embedding(vocab: int) -> torch.Tensor:
    return random_cost_embedding(vocab, WIDTH, seed=1)


# Every registered objective (tests/_objectives.py), built by _build with these options.
# NTIL predicts number values with value_mode="expected" here: Gumbel and argmax values take a
# hard argmax over digits, which bf16 rounding may flip (a different number, not an error);
# the Gumbel path on the device has its own test below.
OPTIONS: dict[str, dict[str, Any]] = {
    "ntil": {"value_mode": "expected"},
    "tailr": {"label_smoothing": 0.1},
    "mixce": {"eta": 0.3},
    "emo_distill": {"chunk_size": 16},
    "kl_distill": {"temperature": 2.0},
}
OBJECTIVES = list(SPECS)
FROM_HIDDEN = [name for name, spec in SPECS.items() if spec.from_hidden]


def _build(name: str, tok: Any, vocab: int, reference: bool) -> nn.Module:
    """Objective ``name`` for ``vocab`` logit rows: the default fast path (reference=False) or
    the functional / plain-autograd implementation (reference=True, where it has one)."""
    spec = SPECS[name]
    emb = _cost_embedding(vocab) if spec.needs_cost_embedding else None
    path = spec.reference if reference else None
    return spec.build(path, digits=tok, cost_embedding=emb, **OPTIONS.get(name, {}))


def _labels(tok: Any) -> torch.Tensor:
    """[B, T] char-token labels with numbers (multi-digit, negative, decimal), a prompt that is
    not scored, right padding and an all-ignored row."""
    rows = ["12+34=46.5", "7*8=-56 ok", "x=1234567,0", "9"]
    labels = torch.full((B, T), -100, dtype=torch.long)
    for r, text in enumerate(rows):
        ids = tok.convert_tokens_to_ids(list(text))
        labels[r, : len(ids)] = torch.tensor(ids)
    labels[0, :5] = -100  # prompt
    labels[3] = -100  # nothing scored in this row
    return labels


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    """float32 logits [B, T, V], teacher logits, hidden [B, T, H] and head weight [V, H]."""
    gen = torch.Generator().manual_seed(0)
    return {
        "logits": 2 * torch.randn(B, T, vocab, generator=gen),
        "teacher": 2 * torch.randn(B, T, vocab, generator=gen),
        "hidden": torch.randn(B, T, H, generator=gen),
        "weight": torch.randn(vocab, H, generator=gen) / H**0.25,
    }


def _call(fn: nn.Module, name: str, logits: torch.Tensor, labels: torch.Tensor,
          teacher: torch.Tensor) -> torch.Tensor:
    extra = {"teacher_logits": teacher} if SPECS[name].needs_teacher else {}
    out = fn(logits, labels, **extra)
    return out.loss


def _reference(
    name: str, path: str, tok: Any, x: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients (logits, or hidden and weight) in float64 on the CPU."""
    vocab = x["weight"].shape[0]
    fn = _build(name, tok, vocab, True)
    if path == "logits":
        leaves = [x["logits"].double().requires_grad_()]
        logits = leaves[0]
    else:
        leaves = [x["hidden"].double().requires_grad_(), x["weight"].double().requires_grad_()]
        logits = leaves[0] @ leaves[1].T
    loss = _call(fn, name, logits, labels, x["teacher"].double())
    (2 * loss).backward()  # grad_output != 1
    return loss.detach(), [leaf.grad for leaf in leaves]


def _on_device(
    name: str, path: str, precision: str, tok: Any, x: dict[str, torch.Tensor],
    labels: torch.Tensor, device: torch.device,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of the fast path on ``device`` in ``precision``.

    fp32 / bf16: the inputs in that dtype. fp16_autocast: as mixed-precision training has it,
    fp16 logits (what an autocast matmul returns) on the logits path, float32 hidden states and
    master weights from hidden; the loss runs under ``torch.autocast(dtype=float16)``.
    """
    vocab = x["weight"].shape[0]
    fn = _build(name, tok, vocab, False).to(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float16)
    autocast = precision == "fp16_autocast"
    if path == "hidden" and autocast:
        dtype = torch.float32  # master weights; autocast casts the matmuls
    teacher = x["teacher"].to(device, dtype if not autocast else torch.float16)
    names = ["logits"] if path == "logits" else ["hidden", "weight"]
    leaves = [x[n].to(device, dtype).requires_grad_() for n in names]
    with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
        if path == "logits":
            loss = _call(fn, name, leaves[0], labels.to(device), teacher)
        else:
            loss = fn.from_hidden(leaves[0], leaves[1], labels.to(device)).loss
        (2 * loss).backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def _rounded(x: dict[str, torch.Tensor], path: str, precision: str) -> dict[str, torch.Tensor]:
    """The inputs as the device run sees them (rounded to its dtype), for the reference."""
    if precision == "fp32" or (path == "hidden" and precision == "fp16_autocast"):
        return x
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return {k: v.to(dtype).float() for k, v in x.items()}


def test_every_registered_objective_is_covered(tok: Any) -> None:
    """A new objective in the registry gets its device cases here (every entry of
    tests/_objectives.py, checked against the registry in test_objective_registry.py); every
    objective but the distillation ones has a from-hidden path."""
    assert {name for name, _ in CASES} == set(SPECS)
    for name in OBJECTIVES:
        module = _build(name, tok, len(tok) + EXTRA_ROWS, False)
        assert declared_needs(module).has_from_hidden == (name not in DISTILL), name


CASES = [(name, "logits") for name in OBJECTIVES] + [(name, "hidden") for name in FROM_HIDDEN]


@cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("name", "path"), CASES)
def test_loss_and_gradients_match_float64_reference(
    name: str, path: str, precision: str, tok: Any, device: torch.device
) -> None:
    x = _inputs(len(tok) + EXTRA_ROWS)
    labels = _labels(tok)
    ref_loss, ref_grads = _reference(name, path, tok, _rounded(x, path, precision), labels)
    loss, grads = _on_device(name, path, precision, tok, x, labels, device)
    rtol, scale = TOLERANCES[precision]
    assert loss.device.type == device.type and torch.isfinite(loss)
    torch.testing.assert_close(
        loss.cpu().double(), ref_loss, rtol=rtol, atol=scale * max(float(ref_loss.abs()), 1.0)
    )
    for label, got, want in zip(["logits"] if path == "logits" else ["hidden", "weight"],
                                grads, ref_grads, strict=True):
        assert got is not None and got.device.type == device.type, label
        assert torch.isfinite(got).all(), f"{label}: non-finite gradient"
        atol = scale * max(float(want.abs().max()), 1e-6)
        torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=atol,
                                   msg=lambda m, k=label: f"{name}/{path}/{precision} {k}: {m}")


@cuda
@pytest.mark.parametrize("name", ["ntil", "emd"])
def test_gumbel_noise_drawn_on_the_device(name: str, tok: Any, device: torch.device) -> None:
    """The default NTIL (Gumbel values) draws its noise with a generator on the device: the
    logits path and the from-hidden path, seeded alike, give the same loss and gradients."""
    vocab = len(tok) + EXTRA_ROWS
    x = _inputs(vocab)
    labels = _labels(tok).to(device)
    hidden, weight = x["hidden"].to(device), x["weight"].to(device)
    results = []
    for path in ("logits", "hidden"):
        gen = torch.Generator(device=device).manual_seed(7)
        cls = NTILLoss if name == "ntil" else DigitEMDLoss
        fn = cls(tok, value_mode="gumbel", generator=gen)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h @ w.T, labels) if path == "logits" else fn.from_hidden(h, w, labels)
        (2 * out.loss).backward()
        assert torch.isfinite(out.loss) and out.loss.device.type == device.type
        results.append((out.loss.detach(), h.grad, w.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ emdlm train
@pytest.fixture
def trained_on(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> Iterator[list[str]]:
    """Devices of the model's parameters at each ``Trainer.training_step`` of the runs in the
    test; with the device forced to the CPU on a machine with a GPU, the Trainer is told to
    use the CPU (as ``emdlm train`` does on a CPU-only machine)."""
    import importlib

    from transformers import Trainer

    # the module (emdlm.training re-exports a function of the same name)
    train_module = importlib.import_module("emdlm.training.train")

    seen: list[str] = []
    original = Trainer.training_step

    def spy(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append(next(model.parameters()).device.type)
        return original(self, model, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", spy)
    if device.type == "cpu":
        monkeypatch.setattr(train_module, "_has_accelerator", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield seen


def _emdlm_train(*args: Any) -> str:
    from typer.testing import CliRunner

    from emdlm.cli import app

    result = CliRunner().invoke(app, ["train", *(str(a) for a in args)])
    assert result.exit_code == 0, result.output
    return result.output


def _check_trained_on(device: torch.device, seen: list[str], text: str, out: Path,
                      steps: int) -> None:
    assert seen and set(seen) == {device.type}, seen
    assert re.search(rf"on {device.type}\b", text), text  # the start-of-run console line
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == steps
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)


TINY_GPT2 = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32", "data.eval.n=8",
    "train.max_steps=2", "train.batch_size=8", "train.progress_bar=false",
    "train.tensorboard=false", "train.save_steps=1000",
]


@cuda
@pytest.mark.parametrize(
    "precision", ["fp32-logits", "bf16-from_hidden"],
)
def test_emdlm_train_tiny_gpt2_on_device(
    precision: str, tmp_path: Path, device: torch.device, trained_on: list[str]
) -> None:
    out = tmp_path / "run"
    extra = ["train.bf16=true", "train.fused_linear=true"] if precision.startswith("bf16") else []
    text = _emdlm_train("-c", "arithmetic_ntil", *TINY_GPT2, *extra, "--output", out)
    _check_trained_on(device, trained_on, text, out, steps=2)
    if precision.startswith("bf16"):
        assert "bf16 on" in text


def _image_jsonl(folder: Path, n: int = 4) -> Path:
    import numpy as np
    from PIL import Image

    rows = []
    for i in range(n):
        pixels = np.random.default_rng(i).integers(0, 256, (56, 56, 3), dtype=np.uint8)
        (folder / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / "img" / f"{i}.png")
        rows.append({"image": f"img/{i}.png", "prompt": "What time?",
                     "completion": f"{i + 1}_3{i}"})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@cuda
def test_emdlm_train_tiny_qwen2_vl_on_device(
    tmp_path: Path, device: torch.device, trained_on: list[str]
) -> None:
    data = _image_jsonl(tmp_path)
    out = tmp_path / "vlm"
    text = _emdlm_train(
        "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
        "data.eval=null", "objective.name=ntil", "train.fused_linear=true",
        "train.max_steps=2", "train.batch_size=2", "train.progress_bar=false",
        "train.tensorboard=false", "train.save_steps=1000", "--output", out,
    )
    _check_trained_on(device, trained_on, text, out, steps=2)


# ---------------------------------------------------------------------- torch.compile
def _compile_backend(device: torch.device) -> str:
    """inductor (Triton kernels) on a GPU; on the CPU "aot_eager": the same Dynamo graph
    capture and AOTAutograd split with no C++ code generation, which takes minutes on CI's two
    cores (tests/test_torch_compile.py runs inductor on the CPU)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def _no_dynamo() -> str | None:
    import torch._dynamo

    return None if torch._dynamo.is_dynamo_supported() else "Dynamo unsupported here"


needs_dynamo = pytest.mark.skipif(_no_dynamo() is not None, reason="Dynamo unsupported here")
COMPILE_TOKENS = [str(d) for d in range(10)] + [f"Ġ{d}" for d in range(10)] + list("ab.=x")
COMPILE_V = len(COMPILE_TOKENS) + 3


def _tiny_llama(device: torch.device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=COMPILE_V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval().to(device)


def _compile_batches(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        digits = torch.randint(0, 20, (2, 12), generator=gen)
        other = torch.randint(20, len(COMPILE_TOKENS), (2, 12), generator=gen)
        out.append(torch.where(torch.rand(2, 12, generator=gen) < 0.5, digits, other).to(device))
    return out


def _compile_loss(name: str, model: nn.Module) -> nn.Module:
    from emdlm.numbers import NumberVocab

    if name == "ce":
        return CrossEntropyLoss()
    if name == "ntil":  # argmax values: eager and compiled score the same predictions
        return NTILLoss(NumberVocab.from_token_strings(COMPILE_TOKENS, COMPILE_V),
                        value_mode="argmax")
    return EMOLoss.from_model(model)


def _step(m: nn.Module, loss_fn: nn.Module, ids: torch.Tensor, path: str) -> torch.Tensor:
    if path == "logits":
        return loss_fn(m(input_ids=ids).logits[:, :-1], ids[:, 1:]).loss
    hidden = m.model(input_ids=ids)[0][:, :-1]
    return loss_fn.from_hidden(hidden, m.lm_head.weight, ids[:, 1:]).loss


@cuda
@needs_dynamo
@pytest.mark.slow
@pytest.mark.parametrize(("name", "path"), [("ce", "logits"), ("ntil", "logits"),
                                            ("ce", "hidden"), ("emo", "hidden")])
def test_compiled_training_matches_eager_on_device(
    name: str, path: str, device: torch.device
) -> None:
    """Two SGD steps of a tiny Llama, its forward (logits path) or the whole step with the
    loss inside (from hidden: the chunked kernels run as graph breaks) compiled, against
    eager on the same device. SGD, not Adam: Adam's first step is lr·sign(g), which turns a
    last-ulp difference of a near-zero gradient into a full step."""
    import torch._dynamo

    torch._dynamo.reset()
    eager = _tiny_llama(device)
    model = copy.deepcopy(eager)
    start = {k: p.detach().clone() for k, p in eager.named_parameters()}
    backend = _compile_backend(device)
    if path == "logits":
        compiled_model = torch.compile(model, backend=backend)

        def run_compiled(ids: torch.Tensor, loss_fn: nn.Module) -> torch.Tensor:
            return _step(compiled_model, loss_fn, ids, path)  # the loss stays eager
    else:
        compiled_step = torch.compile(_step, backend=backend)

        def run_compiled(ids: torch.Tensor, loss_fn: nn.Module) -> torch.Tensor:
            return compiled_step(model, loss_fn, ids, path)

    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    for key, params, run in (
        ("eager", eager, lambda ids, fn: _step(eager, fn, ids, path)),
        ("compiled", model, run_compiled),
    ):
        loss_fn = _compile_loss(name, params).to(device)
        opt = torch.optim.SGD(params.parameters(), lr=0.5)
        for ids in _compile_batches(device):
            opt.zero_grad(set_to_none=True)
            loss = run(ids, loss_fn)
            loss.backward()
            opt.step()
            losses[key].append(float(loss.detach()))
    # inductor fuses and reorders float32 reductions: a few ulp per op, through two steps
    tol = 1e-4 if _compile_backend(device) == "inductor" else 1e-5
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=tol, atol=tol)
    moved = 0.0
    for (key, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert q.device.type == device.type
        torch.testing.assert_close(q, p, rtol=10 * tol, atol=tol, msg=lambda m, k=key: f"{k}: {m}")
        moved = max(moved, float((p.detach() - start[key]).abs().max()))
    assert moved > 1e-3  # the comparison is not between two untouched models


# ------------------------------------------------------------------- the suite's dry run
@pytest.mark.slow
def test_gpu_suite_quick_writes_its_table(tmp_path: Path) -> None:
    """``gpu_suite.py --quick`` (tiny shapes, CPU) runs every section and writes one Markdown
    file with a row for each measurement (a failure is a row too, never a crash)."""
    out = tmp_path / "suite.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["EMDLM_TEST_DEVICE"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=240, check=False, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in proc.stdout  # printed as well as written
    for heading in ("## 1. CUDA tests", "## 2. Loss alone", "## 3. Training step", "## Goals"):
        assert heading in text, heading
    loss_rows = re.findall(r"^\| (\d+) \| (\d+) \| ([^|]+?) \| (eager|compiled) \|", text,
                           flags=re.M)
    methods = {"torch CE (full logits)", "emdlm CE", "emdlm CE + NTIL", "emdlm CE + digit EMD",
               "emdlm EMO"}
    for n in ("64",):
        for v in ("256", "512"):
            for mode in ("eager", "compiled"):
                got = {m for (rn, rv, m, md) in loss_rows if (rn, rv, md) == (n, v, mode)}
                assert methods <= got, (n, v, mode, got)
    for method in ("transformers loss", "emdlm CE (from hidden)", "emdlm CE + NTIL (from hidden)",
                   "emdlm EMO (from hidden)"):
        assert re.search(rf"^\| {re.escape(method)} \|", text, flags=re.M), method
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_peers import GPU_ONLY, PEERS
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    notes = [line for line in text.splitlines() if line.startswith("- ")]
    for peer in PEERS:  # every peer: a row on each eager shape, or a note saying why not
        rows = {(rn, rv) for (rn, rv, m, md) in loss_rows if m == peer and md == "eager"}
        noted = [line for line in notes if line.startswith(f"- {peer}: ")]
        assert rows == {("64", "256"), ("64", "512")} or noted, peer
        if peer in GPU_ONLY:  # the dry run is on the CPU
            assert noted and "skipped on cpu" in noted[0], (peer, noted)
    # the floor (one matmul per shape) and the roofline column, and the goals in its terms
    assert len(re.findall(r"^\| 64 \| (256|512) \| matmul N x H x V [^|]*\| floor \| [0-9.]+ \|",
                          text, flags=re.M)) == 2
    header = next(line for line in text.splitlines() if line.startswith("| N | V | method"))
    assert "roofline" in header and "TFLOP/s" in header
    assert "| from-hidden CE time <= 1.5x the three-GEMM floor |" in text
    ce_row = re.search(r"^\| 64 \| 256 \| emdlm CE \| eager \| ([0-9.]+) \| [0-9.e+-]+ \| "
                       r"([0-9.]+) \|", text, flags=re.M)
    floor_row = re.search(r"^\| 64 \| 256 \| matmul[^|]*\| floor \| ([0-9.]+) \|", text,
                          flags=re.M)
    assert ce_row and floor_row
    ms, roofline, floor_ms = float(ce_row[1]), float(ce_row[2]), float(floor_row[1])
    # roofline = 3 x floor / time (times printed to 4 significant digits, the ratio to 0.01)
    assert roofline == pytest.approx(3 * floor_ms / ms, rel=0.01, abs=0.006)
    assert "error" not in "".join(
        line for line in text.splitlines() if line.startswith("| ") and "emdlm" in line
    ).lower()
