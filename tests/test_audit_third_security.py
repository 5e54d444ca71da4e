"""Third fault audit, security cases: emdlm never writes through a symbolic link inside a folder
it writes (run folders, evaluations, experiment cells, their lock files), never runs a
tokenizer or model folder's own code, bounds what one YAML file may expand to, reports a
checkpoint pickle it refuses in one line naming the file, and names a lock file that is not a
plain file. Each refusal is one line (CLI exit 2, no traceback) before anything is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from emdlm._files import FolderEntryError, atomic_write, check_lock_free, hold_lock_file
from emdlm.cli import app
from emdlm.config import ConfigError, load_config_dict, parse_override

runner = CliRunner()
LOCK = ".emdlm.lock"
TINY = [
    "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=16", "data.eval=null",
    "train.batch_size=8", "train.progress_bar=false", "train.tensorboard=false",
]
EVAL = ["--task", "arithmetic", "--n", "2", "eval.max_new_tokens=2"]


def _cli(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _one_error_line(code: int, text: str, *needles: str) -> str:
    """Exit 2, no traceback, and exactly one ``error:`` line holding every needle."""
    assert code == 2, text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step tiny run (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                      f"output_dir={out}")
    assert code == 0, text
    return out


def _outside_file(tmp_path: Path) -> Path:
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text("the user's own file\n")
    return victim


# --- S1-S6: symbolic links inside the folders emdlm writes ------------------------------------


@pytest.mark.slow
def test_eval_refuses_a_lock_file_linked_outside_and_leaves_its_target_whole(tmp_path, trained_run):
    """`.emdlm.lock` -> a file outside: before, `emdlm eval` truncated it to 0 bytes."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    victim = _outside_file(tmp_path)
    (run / LOCK).unlink()
    (run / LOCK).symlink_to(victim)
    before = _snapshot(run)
    code, text = _cli("eval", run, *EVAL)
    _one_error_line(code, text, str(run / LOCK), "symbolic link")
    assert victim.read_text() == "the user's own file\n"
    assert _snapshot(run) == before and not (run / "eval").exists()


def test_train_refuses_a_folder_holding_only_a_linked_lock(tmp_path):
    """`emdlm train -o` on a folder holding only the link: refused at once, target whole."""
    out = tmp_path / "run"
    out.mkdir()
    victim = _outside_file(tmp_path)
    (out / LOCK).symlink_to(victim)
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                      f"output_dir={out}")
    _one_error_line(code, text, str(out / LOCK), "symbolic link")
    assert victim.read_text() == "the user's own file\n"
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


@pytest.mark.slow
def test_eval_refuses_an_eval_folder_linked_to_another_folder(tmp_path, trained_run):
    """`runs/r/eval` -> another folder: before, eval replaced its predictions and metrics."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    other = tmp_path / "other_eval"
    other.mkdir()
    (other / "metrics.json").write_text('{"theirs": 1}\n')
    (other / "predictions.jsonl").write_text('{"theirs": 1}\n')
    (run / "eval").symlink_to(other, target_is_directory=True)
    before = _snapshot(other)
    code, text = _cli("eval", run, *EVAL)
    _one_error_line(code, text, str(run / "eval"), "symbolic link")
    assert _snapshot(other) == before
    assert (other / "metrics.json").read_text() == '{"theirs": 1}\n'


@pytest.mark.slow
def test_overwrite_refuses_a_run_folder_whose_entries_are_links_and_removes_nothing(
    tmp_path, trained_run
):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    victim = _outside_file(tmp_path)
    (run / "train_log.jsonl").unlink()
    (run / "train_log.jsonl").symlink_to(victim)
    before = _snapshot(run)
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                      f"output_dir={run}", "--overwrite")
    _one_error_line(code, text, str(run / "train_log.jsonl"), "symbolic link")
    assert _snapshot(run) == before and victim.read_text() == "the user's own file\n"


def test_an_eval_file_that_is_a_link_is_refused_before_writing(tmp_path):
    """`eval/predictions.jsonl` -> a file outside: write_eval_outputs writes nothing at all."""
    from emdlm.eval_outputs import write_eval_outputs

    out = tmp_path / "eval"
    out.mkdir()
    victim = _outside_file(tmp_path)
    (out / "predictions.jsonl").symlink_to(victim)
    (out / "metrics.json").write_text('{"n_predictions": 0}\n')
    with pytest.raises(FolderEntryError, match=r"predictions\.jsonl is a symbolic link"):
        write_eval_outputs(out, {"accuracy": 1.0}, [{"prediction": "1"}])
    assert (out / "metrics.json").read_text() == '{"n_predictions": 0}\n'  # not removed
    assert (out / "predictions.jsonl").is_symlink() and victim.read_text().startswith("the")


def test_atomic_write_and_the_manifest_never_write_through_a_link(tmp_path):
    """atomic_write refuses a target that is a link (it would be renamed over), and the run
    folder's manifest no longer goes through a fixed `emdlm_outputs.json.tmp` name that a link
    could redirect (before, the manifest was written into the link's target)."""
    from emdlm.training.run_folder import MANIFEST, read_manifest, record_outputs

    victim = _outside_file(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run_config.yaml").symlink_to(victim)
    with pytest.raises(FolderEntryError, match=r"run_config\.yaml is a symbolic link"), \
            atomic_write(folder / "run_config.yaml") as fh:
        fh.write("replaced")
    assert (folder / "run_config.yaml").is_symlink()
    (folder / f"{MANIFEST}.tmp").symlink_to(victim)
    record_outputs(folder, ["run_config.yaml"])
    assert victim.read_text() == "the user's own file\n"
    assert "run_config.yaml" in read_manifest(folder)
    (folder / MANIFEST).unlink()
    (folder / MANIFEST).symlink_to(victim)
    with pytest.raises(FolderEntryError, match=f"{MANIFEST} is a symbolic link"):
        record_outputs(folder, ["train_log.jsonl"])
    assert victim.read_text() == "the user's own file\n"


def test_an_output_folder_that_is_itself_a_link_is_the_users_choice(tmp_path):
    """Links at or above the folder the user named stay allowed (runs -> /big/disk/runs)."""
    from emdlm.eval_outputs import read_eval_outputs, write_eval_outputs

    real = tmp_path / "big_disk"
    real.mkdir()
    (tmp_path / "out").symlink_to(real, target_is_directory=True)
    write_eval_outputs(tmp_path / "out", {"accuracy": 1.0}, [{"prediction": "1"}])
    assert read_eval_outputs(real)[0]["n_predictions"] == 1
    with hold_lock_file(tmp_path / "out" / LOCK):
        assert (real / LOCK).is_file()


def test_an_experiment_refuses_a_cell_folder_that_is_a_link(tmp_path):
    """A cell folder (or a folder above it inside output_dir) linked elsewhere: the grid is
    refused before any cell trains, naming the link; the target is left as it was."""
    from _experiment import TINY_BASE
    from emdlm.experiments import run_experiment

    out = tmp_path / "exp"
    spec = {"name": "links", "base": TINY_BASE, "seeds": [0],
            "variants": {"ce": [], "ce2": []}, "eval": {"checkpoints": "final"},
            "output_dir": str(out)}
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(spec))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine\n")
    (out / "default").mkdir(parents=True)
    (out / "default" / "ce2").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(FolderEntryError, match="ce2 is a symbolic link"):
        run_experiment(config, progress=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in (out / "default").iterdir()) == ["ce2"]
    # a link inside a cell (its lock file) is refused the same way, on the CLI in one line
    (out / "default" / "ce2").unlink()
    cell = out / "default" / "ce" / "seed0"
    cell.mkdir(parents=True)
    victim = _outside_file(tmp_path)
    (cell / "cell.lock").symlink_to(victim)
    code, text = _cli("experiment", "-c", config, "--no-progress")
    _one_error_line(code, text, str(cell / "cell.lock"), "symbolic link")
    assert victim.read_text() == "the user's own file\n"


def test_demo_refuses_a_run_folder_that_is_a_link_before_training(tmp_path):
    """`emdlm demo --out d` with `d/ntil` a link elsewhere: the second run would have trained
    into the link's target; now refused before the first run trains."""
    out = tmp_path / "demo"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "ntil").symlink_to(elsewhere, target_is_directory=True)
    small = [item for item in TINY if item != "data.eval=null"]
    code, text = _cli("demo", "--out", out, *small, "train.max_steps=1", "data.eval.n=2",
                      "eval.max_new_tokens=2")
    _one_error_line(code, text, str(out / "ntil"), "symbolic link")
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["ntil"]


# --- S7: a lock file that is not a plain file ---------------------------------------------------


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_that_is_not_a_plain_file_is_named_with_what_it_is(tmp_path, kind):
    """Before, the folder was blamed ("cannot write in <folder>: Is a directory")."""
    out = tmp_path / "run"
    out.mkdir()
    if kind == "folder":
        (out / LOCK).mkdir()
        what = "is a folder"
    else:
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(out / LOCK)
        what = "is a named pipe (FIFO)"
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                      f"output_dir={out}")
    _one_error_line(code, text, f"the lock file {out / LOCK} {what}")
    with pytest.raises(FolderEntryError, match=re.escape(what)), hold_lock_file(out / LOCK):
        pass
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_an_unreadable_lock_is_named(tmp_path, monkeypatch):
    lock = tmp_path / LOCK
    lock.write_text("")
    lock.chmod(0)
    if os.geteuid() == 0:  # root opens it anyway: let the open fail as for any other user
        real_open = os.open

        def denied(path, flags, *args, **kwargs):
            if Path(path) == lock:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", denied)
    try:
        for call in (lambda: check_lock_free(lock), lambda: hold_lock_file(lock).__enter__()):
            with pytest.raises(FolderEntryError,
                               match=f"the lock file {lock} cannot be opened .*Permission denied"):
                call()
    finally:
        lock.chmod(stat.S_IRUSR | stat.S_IWUSR)


# --- S8: a tokenizer or model folder's own code -----------------------------------------------


def _tokenizer_folder_with_code(tmp_path: Path) -> Path:
    from emdlm.tokenizers import load_tokenizer

    folder = tmp_path / "tok"
    load_tokenizer("char").save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "EvilTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    config_path.write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        f"open({str(tmp_path / 'RAN')!r}, 'w').write('code ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


def test_a_tokenizer_folder_with_its_own_code_is_refused_without_a_prompt(tmp_path):
    """Before: transformers asked "[y/N]" on stdin and `echo y | emdlm train` ran evil.py."""
    folder = _tokenizer_folder_with_code(tmp_path)
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                                 f"tokenizer={folder}", f"output_dir={out}"], input="y\ny\n")
    _one_error_line(result.exit_code, result.output, str(folder / "tokenizer_config.json"),
                    "auto_map")
    assert "[y/N]" not in result.output
    assert not (tmp_path / "RAN").exists() and not out.exists()


def test_every_tokenizer_loader_refuses_a_folder_with_code(tmp_path, monkeypatch):
    from emdlm.models import load_tokenizer
    from emdlm.tokenizers import load_tokenizer as load_named_or_folder

    folder = _tokenizer_folder_with_code(tmp_path)
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("y\ny\n"))
    with pytest.raises(ConfigError, match="auto_map"):
        load_tokenizer(str(folder))
    with pytest.raises(ConfigError, match="auto_map"):
        load_named_or_folder(str(folder))
    assert not (tmp_path / "RAN").exists()


def test_a_model_folder_with_its_own_code_is_refused_without_a_prompt(tmp_path):
    """A model folder whose config.json maps its classes to a .py file in it: before, the
    AutoConfig prompt took "y" from stdin and ran the file."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from emdlm.tokenizers import load_tokenizer

    vocab = len(load_tokenizer("char"))
    folder = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=32,
                               vocab_size=vocab)).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evilgpt"
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig",
                          "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        f"open({str(tmp_path / 'RAN')!r}, 'w').write('code ran')\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class EvilConfig(GPT2Config):\n    model_type = 'evilgpt'\n"
        "class EvilModel(GPT2LMHeadModel):\n    config_class = EvilConfig\n"
    )
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                                 f"model.name={folder}", "model.params={}",
                                 f"output_dir={out}"], input="y\ny\n")
    _one_error_line(result.exit_code, result.output, str(folder / "config.json"), "auto_map")
    assert "[y/N]" not in result.output
    assert not (tmp_path / "RAN").exists() and not out.exists()


# --- S9-S10: YAML that expands without bound ------------------------------------------------


def _billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


def test_nested_aliases_are_refused_at_once_in_one_line(tmp_path):
    """A ~700-byte "billion laughs" in model.params: before, 128 s, 2.5 GB and a 422 MB run
    folder. Now refused while reading, naming the file and the limit."""
    text = "model:\n  name: tiny-gpt2\n  params:\n" + "".join(
        f"    {line}\n" for line in _billion_laughs().splitlines())
    assert len(text.encode()) < 1000
    config = tmp_path / "bomb.yaml"
    config.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: .*expands to more than"):
        load_config_dict(config)
    assert time.perf_counter() - start < 2
    out = tmp_path / "run"
    code, output = _cli("train", "-c", config, f"output_dir={out}")
    _one_error_line(code, output, str(config), "aliases")
    assert not out.exists()
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_override("model.params=" + "{" + _billion_laughs().replace("\n", ", ")[:-2] + "}")


def test_deep_nesting_and_recursive_aliases_are_refused_in_one_line(tmp_path):
    """5000 nested levels: before, a RecursionError traceback."""
    config = tmp_path / "deep.yaml"
    config.write_text("model:\n  params: " + "[" * 5000 + "]" * 5000 + "\n")
    code, output = _cli("train", "-c", config, f"output_dir={tmp_path / 'run'}")
    _one_error_line(code, output, str(config), "nested deeper than")
    block = tmp_path / "deep_block.yaml"
    block.write_text("".join(" " * i + "k:\n" for i in range(3000)))
    with pytest.raises(ConfigError, match="nested deeper than"):
        load_config_dict(block)
    loop = tmp_path / "loop.yaml"
    loop.write_text("model: &m\n  params: [*m]\n")
    with pytest.raises(ConfigError, match="contains an alias to itself"):
        load_config_dict(loop)


def test_ordinary_aliases_and_configs_still_load():
    from emdlm.config import packaged_configs
    from emdlm.yaml_io import safe_load_unique

    text = "base: &b {lr: 0.1, seed: 1}\nrun:\n  <<: *b\n  lr: 0.2\nboth: [*b, *b]\n"
    assert safe_load_unique(text) == yaml.safe_load(text)
    for path in packaged_configs():
        assert load_config_dict(path) == yaml.safe_load(path.read_text())


# --- S11: a checkpoint pickle that would run code, on --resume ------------------------------


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pickle-ran",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_resume_refuses_a_code_running_checkpoint_pickle_in_one_line(tmp_path, name):
    """Before: a 138-line UnpicklingError traceback (no code ran). Now one line naming the file,
    before run_config.yaml or the log is rewritten."""
    import torch

    out = tmp_path / "run"
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=1",
                      "train.save_steps=1", f"output_dir={out}")
    assert code == 0, text
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / name).is_file()
    torch.save(_RunsCode(), checkpoint / name)  # a torch zip archive, as the Trainer writes
    before = _snapshot(out)
    code, text = _cli("train", "-c", "arithmetic_ce", *TINY, "train.max_steps=2",
                      "train.save_steps=1", f"output_dir={out}", "--resume")
    _one_error_line(code, text, str(checkpoint / name), "refused to unpickle")
    assert "pickle-ran" not in text
    assert _snapshot(out) == before
