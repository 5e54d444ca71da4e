"""emdlm.training.launch: launcher detection, the world-size line, the launcher-mismatch warning
and the tidy console (no raw Trainer dicts), also in the demo."""

from __future__ import annotations

import importlib.util
import logging
import re
from types import SimpleNamespace

import pytest
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

from emdlm.training.launch import (
    LaunchInfo,
    LinePrinterCallback,
    TidyProgressCallback,
    accelerate_requested_processes,
    detect_launch,
    launch_messages,
    log_line,
    start_run_console,
    tidy_console,
)

ACCEL = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no"}


def _args(world=1, bf16=False):
    return SimpleNamespace(world_size=world, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, bf16=bf16, fp16=False,
                           device=SimpleNamespace(type="cpu"))  # fmt: skip


def test_detect_torchrun_and_single_process():
    info = detect_launch({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1"}, [])
    assert info == LaunchInfo(2, "torchrun", requested=2) and not info.mismatch
    assert detect_launch({}, []) == LaunchInfo(1, "single process")
    assert detect_launch({"OMPI_COMM_WORLD_SIZE": "4", "WORLD_SIZE": "4"}, []).launcher == "mpirun"
    # garbage in WORLD_SIZE is not a crash: 1 process
    assert detect_launch({"WORLD_SIZE": "two", "RANK": "0"}, []).world_size == 1


def test_detect_accelerate_torchrun_handover():
    env = {**ACCEL, "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    info = detect_launch(env, [])
    assert info.launcher == "accelerate launch (torchrun)" and not info.mismatch


def test_accelerate_single_process_launcher_asked_for_two(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    argv = ["python", "accelerate", "launch", "--config_file", str(cfg), "-m", "emdlm.cli"]
    env = {**ACCEL, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    info = detect_launch(env, argv)
    assert info == LaunchInfo(1, "accelerate launch", requested=2, asked_for_more=True)
    assert info.mismatch
    line, warning = launch_messages(info, _args(world=1))
    assert line.startswith("emdlm: world size 1 (accelerate launch)")
    assert warning is not None and "asked for 2 processes, but this run has 1" in warning
    assert "torchrun --nproc_per_node 2" in warning
    # number unreadable (no argv) but accelerate set MASTER_ADDR: still warned
    info = detect_launch(env, [])
    assert info.requested is None and info.mismatch
    assert "asked for more than 1 processes" in launch_messages(info, _args())[1]
    # accelerate asked for 1 (no MASTER_ADDR): no warning
    assert not detect_launch(dict(ACCEL), ["accelerate", "launch"]).mismatch


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["accelerate", "launch", "--num_processes", "3", "x.py"], 3),
        (["accelerate", "launch", "--num-processes=4", "x.py"], 4),
        (["accelerate", "launch", "--config_file", "/no/such/file.yaml"], None),
        (["accelerate", "launch", "x.py"], None),
        (["python", "x.py", "--num_processes", "3"], None),  # not an accelerate launch
    ],
)
def test_accelerate_requested_processes(argv, expected):
    assert accelerate_requested_processes(argv) == expected


def test_config_file_without_num_processes_or_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: [unclosed\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("- a list\n")
    for path in (bad, plain):
        argv = ["accelerate", "launch", "--config_file", str(path)]
        assert accelerate_requested_processes(argv) is None


def test_world_size_line_uses_the_trainers_world_size():
    # the Trainer's own count wins over the environment's
    line, warning = launch_messages(LaunchInfo(1, "torchrun", requested=2), _args(world=2))
    assert line == ("emdlm: world size 2 (torchrun), 4 per process x 2 accumulation x 2 "
                    "processes = 16 examples per optimizer step; fp32 on cpu")
    assert warning is None
    bf16_line = launch_messages(LaunchInfo(1, "single process"), _args(bf16=True))[0]
    assert "; bf16 on cpu (as asked; bf16 ran ~5x slower" in bf16_line


def test_log_line_has_no_raw_dict():
    logs = {"loss": 1.23456, "grad_norm": 0.5, "learning_rate": 1e-3, "epoch": 0.1}
    train = log_line(logs, 5, 10)
    assert train == "step 5/10: loss 1.235, grad_norm 0.5, learning_rate 0.001"
    ev = log_line({"eval_loss": 2.0, "eval_runtime": 0.1, "eval_samples_per_second": 9.0}, 5, 10)
    assert ev == "eval step 5/10: eval_loss 2"
    end = log_line({"train_runtime": 12.34, "train_loss": 1.5, "epoch": 1.0}, 10, 10)
    assert end == (
        "done: 10 steps in 12.3 s, mean train loss 1.5 over the steps run since (re)start"
    )  # a normal end does not read like an interruption
    cut = log_line({"train_runtime": 3.0, "epoch": 0.4}, 4, 10)
    assert cut == "stopped at step 4 of 10 after 3.0 s"  # Ctrl-C: it says what was left


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_tidy_console_replaces_the_raw_printers(tmp_path, disable_tqdm, caplog, capsys):
    import torch

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             disable_tqdm=disable_tqdm)  # fmt: skip
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    raw = PrinterCallback if disable_tqdm else ProgressCallback
    tidy = LinePrinterCallback if disable_tqdm else TidyProgressCallback
    assert sum(type(cb) is raw for cb in trainer.callback_handler.callbacks) == 1
    with caplog.at_level(logging.WARNING, logger="emdlm"):
        info = start_run_console(trainer)
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert raw not in kinds and tidy in kinds
    assert info.launcher == "single process"
    assert "emdlm: world size 1 (single process)" in capsys.readouterr().err
    assert caplog.text == ""  # no mismatch, no warning
    tidy_console(trainer)  # idempotent
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == kinds


@pytest.mark.slow
def test_demo_console_is_clean_and_says_what_reproduces(tmp_path, capsys):
    from emdlm.training.demo import run_demo

    run_demo(tmp_path / "demo", [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval.n=8",
        "train.max_steps=4", "train.logging_steps=1", "train.tensorboard=false",
    ])  # fmt: skip
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "{'loss'" not in text and "'grad_norm'" not in text  # no raw Trainer dicts
    assert "train_runtime" not in text
    assert text.count("done: 4 steps in") == 2  # one summary line per run
    assert "stopped at step" not in text
    assert "Writing model shards" not in text  # one bar per phase: no per-save bars
    assert re.search(r"\| metric +\| +ce \| +ntil \|", text)  # the final table
    saved = (tmp_path / "demo" / "demo_results.md").read_text()
    assert re.search(r"\d+ torch threads?,", saved) and "same thread count" in saved


def test_reproducibility_note_says_thread_or_threads(monkeypatch):
    import torch

    from emdlm.training.demo import reproducibility_note

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert reproducibility_note().startswith("Made with 1 torch thread, torch ")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert reproducibility_note().startswith("Made with 2 torch threads, torch ")


_CLOSE_SCRIPT = """
import sys, torch.distributed as dist
from emdlm.training.launch import close_process_group
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
print("written before the end", flush=False)
close_process_group(finished=sys.argv[2] == "1")
print("still running after close_process_group")
"""


@pytest.mark.slow
@pytest.mark.parametrize("finished", [True, False])
def test_close_process_group_ends_a_finished_process_and_lets_an_error_propagate(
    tmp_path, finished
):
    """finished: barrier, destroy, flush, exit 0 (nothing after it runs; buffered output kept);
    after an error: the group is destroyed and the caller goes on (to raise its error)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _CLOSE_SCRIPT, str(tmp_path / "store"), "1" if finished else "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "written before the end" in proc.stdout
    assert ("still running after close_process_group" in proc.stdout) is not finished


def test_close_process_group_without_a_process_group_does_nothing():
    from emdlm.training.launch import close_process_group

    close_process_group(finished=True)  # no torch.distributed group: returns, no exit
    close_process_group(finished=False)


def test_report_to_passes_through_to_the_trainer(tmp_path):
    """train.report_to reaches TrainingArguments (a name or a list; 'none' or left
    out: no integration, emdlm's own train_log.jsonl and tb/ stay); an integration transformers
    does not know (or whose package is missing) is refused; DDP does not search a causal LM for
    unused parameters."""
    from emdlm.config import ConfigError, apply_overrides, build_config
    from emdlm.training.arguments import training_arguments

    def config(*overrides):
        cfg = build_config(apply_overrides({}, list(overrides)))
        cfg.validate()
        return cfg

    def args_for(*overrides):
        return training_arguments(config(*overrides), tmp_path, has_eval=False, use_cpu=True)

    assert args_for().report_to == []
    assert args_for("train.report_to=tensorboard").report_to == ["tensorboard"]
    assert args_for("train.report_to=[tensorboard]").report_to == ["tensorboard"]
    assert args_for("train.report_to=none").report_to == []
    assert args_for().ddp_find_unused_parameters is False
    with pytest.raises(ConfigError, match=r"train\.report_to must be a name or a list"):
        config("train.report_to=[1]")
    with pytest.raises(ValueError, match=r"'no_such_tool' is not a transformers logging"):
        args_for("train.report_to=no_such_tool")
    installed = importlib.util.find_spec("wandb") is not None
    if not installed:  # not in this project's pinned set: refused before anything is written
        with pytest.raises(ValueError, match=r"'wandb' needs its package.*pip install wandb"):
            args_for("train.report_to=wandb")


def test_done_line_follows_the_closed_progress_bar(capsys):
    """The final "done: N steps in T s" line is printed after the bar is closed, on the bar's
    stream: it used to go through tqdm.write to stdout while the bar (stderr) was still open,
    and landed inside the bar's line on a console."""
    cb = TidyProgressCallback()
    state = SimpleNamespace(is_world_process_zero=True, max_steps=4, global_step=0)
    cb.on_train_begin(None, state, None)
    for step in range(1, 5):
        state.global_step = step
        cb.on_step_end(None, state, None)
        cb.on_log(None, state, None, logs={"loss": 1.0, "learning_rate": 1e-3})
        if step == 2:
            cb.on_log(None, state, None, logs={"eval_loss": 2.0})
    cb.on_log(None, state, None, logs={"train_runtime": 1.0, "train_loss": 1.0})
    cb.on_train_end(None, state, None)  # the bar is closed already: nothing more
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.replace("\r", "\n").splitlines()
    assert lines[-1] == ("done: 4 steps in 1.0 s, mean train loss 1 over the steps run since "
                         "(re)start")
    assert "4/4" in lines[-2] and captured.err.count("done:") == 1
    assert "eval step 2/4: eval_loss 2" in lines
    assert cb.training_bar is None
