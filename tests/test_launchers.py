"""Launchers of `emdlm experiment`: a real local Ray cluster and submitit's LocalExecutor give
the local launcher's results.csv on a tiny grid, also after a worker / job process is killed
mid-cell (the cell resumes from its checkpoint, nothing is counted twice); the SLURM
submission (sbatch options, array layout) through a stand-in ``sbatch``; the options."""

from __future__ import annotations

import csv
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from _experiment import TINY_BASE
from emdlm.cli import app
from emdlm.config import ConfigError
from emdlm.experiments import expand_grid, load_experiment, run_experiment
from emdlm.experiments.cell_folder import CELL_DONE, ERROR_FILE
from emdlm.experiments.cell_lock import HOLDER_FILE, read_holder
from emdlm.experiments.launchers import CLUSTER_EXTRA, LAUNCHERS, make_launcher
from emdlm.experiments.launchers.slurm import SlurmLauncher, time_minutes
from emdlm.training.checkpoints import checkpoint_folders

# two cells that really train: 60 steps, a checkpoint every 20 (evaluated: 20, 40, 60)
GRID = {
    "name": "tiny", "base": TINY_BASE,
    "base_overrides": ["train.max_steps=60", "train.save_steps=20", "train.logging_steps=10"],
    "variants": {"ce": ["objective.name=ce"],
                 "ntil": ["objective.name=ntil", "objective.params.value_mode=expected"]},
    "seeds": [0], "eval": {"checkpoints": "all"},
}
KILLED = "default/ce/seed0"  # the cell whose worker the fault tests kill


def _experiment_file(tmp: Path, name: str, launcher: dict, **extra) -> Path:
    path = tmp / f"{name}.yaml"
    data = {**GRID, "output_dir": str(tmp / name), "launcher": launcher, **extra}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _csv_rows(path: Path) -> list[tuple[str, ...]]:
    """results.csv's rows (task, variant, seed, step, metric, value): metrics only, no times."""
    with path.open() as fh:
        return sorted(tuple(row.values()) for row in csv.DictReader(fh))


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory) -> list[tuple[str, ...]]:
    """The local launcher's results.csv of the grid (in this process: workers=1)."""
    tmp = tmp_path_factory.mktemp("local")
    result = run_experiment(_experiment_file(tmp, "grid", {"name": "local"}, workers=1),
                            progress=False)
    assert [o.status for o in result.outcomes] == ["done", "done"]
    rows = _csv_rows(result.results_csv)
    assert len(rows) == 2 * 3 * len({r[4] for r in rows})  # 2 cells x 3 steps x the metrics
    return rows


class KillMidCell(threading.Thread):
    """SIGKILL the process working on ``cell`` once it has saved a checkpoint of step
    ``at_step`` or later and not yet finished training (its pid from the cell's holder record);
    ``killed`` then holds what was seen at the kill. Any checkpoint at or past the step counts:
    the checkpoint rotation (train.save_total_limit) may delete checkpoint-20 before a poll
    sees it, and waiting for that one folder then never killed anything."""

    def __init__(self, cell: Path, at_step: int = 20) -> None:
        super().__init__(daemon=True)
        self.cell, self.at_step, self.killed, self.stop = cell, at_step, {}, threading.Event()

    def _saved_step(self) -> int | None:
        """The newest checkpoint's step, if it is at least ``at_step``."""
        newest = checkpoint_folders(self.cell / "train")[:1]
        step = int(newest[0].name.split("-")[1]) if newest else None
        return step if step is not None and step >= self.at_step else None

    def run(self) -> None:
        train = self.cell / "train"
        while not self.stop.is_set():
            record = read_holder(self.cell)
            step = self._saved_step() if record is not None else None
            if record is not None and step is not None:
                os.kill(record["pid"], signal.SIGSTOP)  # still, while we look
                trained = (train / "train_summary.json").exists()
                os.kill(record["pid"], signal.SIGKILL)
                self.killed = {"pid": record["pid"], "training_finished": trained,
                               "checkpoint_step": step}
                return
            time.sleep(0.02)

    def __enter__(self) -> KillMidCell:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()


@pytest.mark.slow  # starts a process
def test_kill_mid_cell_kills_at_any_checkpoint_past_its_step(tmp_path):
    """The helper kills at the first checkpoint at or past its step, also when checkpoint-20
    has already rotated away (only checkpoint-40 left), and not before (checkpoint-10, or a
    save still in progress)."""
    cell = tmp_path / "cell"
    (cell / "train" / "checkpoint-10").mkdir(parents=True)
    (cell / "train" / "tmp-checkpoint-60").mkdir()  # a save in progress: not a checkpoint
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (cell / HOLDER_FILE).write_text(json.dumps({"host": "h", "pid": worker.pid}))
        assert read_holder(cell)["pid"] == worker.pid
        with KillMidCell(cell) as killer:
            time.sleep(0.5)
            assert worker.poll() is None and not killer.killed  # no checkpoint >= 20 yet
            (cell / "train" / "checkpoint-40").mkdir()  # checkpoint-20 rotated away
            assert worker.wait(timeout=20) == -signal.SIGKILL
        assert killer.killed == {"pid": worker.pid, "training_finished": False,
                                 "checkpoint_step": 40}
    finally:
        worker.kill()
        worker.wait()


def _assert_resumed_once(cell: Path) -> None:
    """The killed cell finished after a resume from a checkpoint, each step trained once."""
    done = json.loads((cell / CELL_DONE).read_text())
    assert done["resumed"] is True
    assert done["train_summary"]["resumed_from_step"] in (20, 40)
    assert done["evaluated_steps"] == [20, 40, 60]
    steps = [json.loads(line).get("step") for line in
             (cell / "train" / "train_log.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s is not None]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    assert not (cell / ERROR_FILE).exists()


# ---------------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_gives_the_local_results(ray_cluster, local_rows, tmp_path):
    result = run_experiment(_experiment_file(tmp_path, "grid", {"name": "ray", "num_cpus": 1}),
                            progress=False)
    assert [o.status for o in result.outcomes] == ["done", "done"]
    assert _csv_rows(result.results_csv) == local_rows


@pytest.mark.slow
def test_ray_retries_a_killed_worker_from_its_checkpoint(ray_cluster, local_rows, tmp_path):
    path = _experiment_file(tmp_path, "grid", {"name": "ray", "num_cpus": 1, "max_retries": 2})
    with KillMidCell(tmp_path / "grid" / KILLED) as killer:
        result = run_experiment(path, progress=False)
    assert killer.killed and not killer.killed["training_finished"]
    assert [(o.key, o.status) for o in result.outcomes] == [
        ("default/ce/seed0", "done"), ("default/ntil/seed0", "done")]
    _assert_resumed_once(tmp_path / "grid" / KILLED)
    assert _csv_rows(result.results_csv) == local_rows


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "known flake: in the full suite under pytest-xdist the Ray grid sometimes ignored SIGTERM "
    "and finished its cell (exit 0); it passes alone. A grid started with SIGINT ignored showed "
    "exactly this and no longer does (the runner's SIGTERM handler no longer re-sends SIGINT); "
    "that this was the full suite's cause is not yet shown, so the mark stays until it is"))
def test_sigterm_cancels_a_ray_grid_that_resumes_where_it_stopped(tmp_path):
    """`emdlm experiment launcher=ray` starting its own local Ray (address=local): SIGTERM to
    it mid-cell cancels the task, whose training saves a checkpoint at its stop, and the
    command exits 130; the same command resumes the cell from that checkpoint. The signal goes
    at the first checkpoint of any step (a save every 20 steps keeps one: waiting for
    checkpoint-20 itself missed it once it had rotated away, and the signal then came after
    the grid had finished); 1000 steps leave the cancel time to reach the worker."""
    pytest.importorskip("ray")
    path = _experiment_file(
        tmp_path, "grid", {"name": "ray", "address": "local", "num_cpus": 1},
        variants={"ce": GRID["variants"]["ce"]}, eval={"checkpoints": "final"},
        base_overrides=["train.max_steps=1000", "train.save_steps=20",
                        "train.logging_steps=50"])
    command = [sys.executable, "-m", "emdlm.cli", "experiment", "-c", str(path),
               "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    train = tmp_path / "grid" / KILLED / "train"
    grid = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        while grid.poll() is None and not any(train.glob("checkpoint-*")):
            time.sleep(0.05)
        assert grid.poll() is None, "the grid finished before its first checkpoint was seen"
        grid.send_signal(signal.SIGTERM)
        out, _ = grid.communicate(timeout=180)
    finally:
        grid.kill()
    assert grid.returncode == 130, out[-3000:]
    assert "run the same command again to resume" in out
    assert not (train / "train_summary.json").exists()
    stop_step = max(int(p.name.split("-")[1]) for p in train.glob("checkpoint-*"))
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = json.loads((train.parent / CELL_DONE).read_text())
    assert done["train_summary"]["resumed_from_step"] == stop_step >= 20


# ---------------------------------------------------------------------- submitit LocalExecutor

SUBMITIT_LOCAL = {"name": "slurm", "executor": "local", "array_parallelism": 2, "time": 10}


@pytest.mark.slow
def test_submitit_local_gives_the_local_results(local_rows, tmp_path):
    pytest.importorskip("submitit")
    result = run_experiment(_experiment_file(tmp_path, "grid", SUBMITIT_LOCAL), progress=False)
    assert [o.status for o in result.outcomes] == ["done", "done"]
    assert _csv_rows(result.results_csv) == local_rows
    assert list((tmp_path / "grid" / ".submitit").glob("*_0_log.out"))  # one log per job


@pytest.mark.slow
def test_a_killed_submitit_job_is_resumed_by_the_next_submission(local_rows, tmp_path):
    pytest.importorskip("submitit")
    path = _experiment_file(tmp_path, "grid", SUBMITIT_LOCAL)
    cell = tmp_path / "grid" / KILLED
    with KillMidCell(cell) as killer:
        first = run_experiment(path, progress=False)
    assert killer.killed and not killer.killed["training_finished"]
    failed = {o.key: o for o in first.failed}
    assert list(failed) == [KILLED]
    log = Path(failed[KILLED].log)
    assert log.is_file() and log.name.endswith("_log.err")  # the job's own log
    assert str(log) in (cell / ERROR_FILE).read_text()
    assert not (cell / CELL_DONE).exists()

    second = run_experiment(path, progress=False)  # the next submission
    assert [(o.key, o.status) for o in second.outcomes] == [
        ("default/ce/seed0", "done"), ("default/ntil/seed0", "skipped")]
    _assert_resumed_once(cell)
    assert _csv_rows(second.results_csv) == local_rows


# ---------------------------------------------------------- the SLURM submission, no cluster


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch) -> Path:
    """A stand-in ``sbatch`` first on PATH: keeps a copy of the script it is given and
    answers as sbatch does; returns the folder the copies go to."""
    seen = tmp_path / "sbatch_seen"
    seen.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(f'#!/bin/sh\ncp "$1" "{seen}/script_$$.sh"\n'
                      'echo "Submitted batch job 4242"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it
    for tool in bin_dir.iterdir():
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return seen


def test_the_slurm_submission_is_one_array_of_the_cells(tmp_path, fake_sbatch):
    """What sbatch receives: one array job, task i running cell i, with the launcher's
    partition, time, GPUs, CPUs, memory, parallelism, setup lines and extra options."""
    pytest.importorskip("submitit")
    data = {**GRID, "seeds": [0, 1], "output_dir": str(tmp_path / "grid"), "launcher": {
        "name": "slurm", "partition": "gpu", "time": "1-02:30:00", "gpus_per_node": 1,
        "cpus_per_task": 4, "mem_gb": 32, "array_parallelism": 3,
        "setup": ["module load cuda/12.4"], "sbatch": {"account": "proj7", "qos": "high"},
        "python": "/shared/venv/bin/python"}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    exp = load_experiment(path)
    cells = expand_grid(exp)
    launcher = make_launcher(exp.launcher)
    launcher.check_installed()
    jobs = launcher.submit(exp, launcher.make_executor(exp), cells)

    (script,) = fake_sbatch.iterdir()
    lines = script.read_text().splitlines()
    options = {line.split()[1] for line in lines if line.startswith("#SBATCH ")}
    assert {
        "--array=0-3%3", "--partition=gpu", f"--time={(24 + 2) * 60 + 30}", "--gpus-per-node=1",
        "--cpus-per-task=4", "--mem=32GB", "--nodes=1", "--ntasks-per-node=1",
        "--account=proj7", "--qos=high", "--job-name=emdlm-tiny", "--signal=USR2@90",
        f"--output={tmp_path / 'grid' / '.submitit'}/%A_%a_0_log.out",
    } <= options, sorted(options)
    assert "module load cuda/12.4" in lines
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert "/shared/venv/bin/python -u -m submitit.core._submit" in srun

    assert [job.job_id for job in jobs] == [f"4242_{i}" for i in range(4)]
    submitted = [job.submission() for job in jobs]  # the pickle each array task loads
    assert [s.args[0].key for s in submitted] == [c.key for c in cells]
    assert {s.function.threads for s in submitted} == {exp.threads_per_worker}
    assert hasattr(submitted[0].function, "checkpoint")  # requeued on time-out / preemption


def test_slurm_time_forms():
    assert [time_minutes(v, "t") for v in (90, "90", "90:30", "2:00:00", "1-0", "1-2:3",
                                           "0-0:0:1")] == [90, 90, 91, 120, 1440, 1563, 1]
    for bad in ("1h", "0", 0, True, "1-", ""):
        with pytest.raises(ConfigError, match=r"SLURM time|is zero"):
            time_minutes(bad, "experiment.launcher.time")


# ------------------------------------------------------------------------- options, errors


def test_the_registry_names_every_launcher():
    assert list(LAUNCHERS) == ["local", "ray", "slurm"]
    assert {name: cls.name for name, cls in LAUNCHERS.items()} == {n: n for n in LAUNCHERS}


def test_launcher_from_the_file_and_the_command_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g"),
                                    "launcher": {"name": "slurm", "partition": "gpu"}}))
    assert load_experiment(path).launcher == {"name": "slurm", "partition": "gpu"}
    assert make_launcher(load_experiment(path).launcher) == SlurmLauncher(partition="gpu")
    # launcher=ray replaces the launcher (the file's SLURM options do not follow it)
    exp = load_experiment(path, ["launcher=ray", "launcher.num_gpus=1", "launcher.num_cpus=4"])
    assert exp.launcher == {"name": "ray", "num_gpus": 1, "num_cpus": 4}
    assert load_experiment(path, ["launcher.time=30"]).launcher["time"] == 30
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g"),
                                    "launcher": "ray"}))
    assert load_experiment(path, ["launcher.address=auto"]).launcher == {
        "name": "ray", "address": "auto"}
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g")}))
    assert load_experiment(path).launcher == {"name": "local"}


@pytest.mark.parametrize(("overrides", "message"), [
    (["launcher=pbs"], "'pbs' is not a launcher; known: local, ray, slurm"),
    (["launcher=ray", "launcher.num_cpu=2"], "launcher=ray has no option(s) ['num_cpu']"),
    (["launcher=slurm", "launcher.gpus_per_node=-1"], "launcher.gpus_per_node must be"),
    (["launcher=slurm", "launcher.executor=pbs"], "executor must be one of slurm, local"),
    (["launcher=[1]"], "experiment.launcher must be a launcher name or a mapping"),
])
def test_a_bad_launcher_stops_before_anything_is_written(tmp_path, overrides, message):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g")}))
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress", *overrides])
    assert res.exit_code == 2 and message in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()


def test_slurm_off_a_cluster_says_so_before_anything_is_written(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g")}))
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress",
                                   "launcher=slurm"])
    assert res.exit_code == 2
    assert "sbatch and srun not found" in res.output and "executor=local" in res.output
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize(("name", "package"), [("ray", "ray"), ("slurm", "submitit")])
def test_a_missing_cluster_package_says_how_to_install_it(tmp_path, monkeypatch, name,
                                                          package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**GRID, "output_dir": str(tmp_path / "g")}))
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress",
                                   f"launcher={name}"])
    assert res.exit_code == 2
    assert res.output.strip() == (f"error: launcher={name} needs the {package} package, which "
                                  f"is not installed: {CLUSTER_EXTRA}")
    assert not (tmp_path / "g").exists()
    report = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress",
                                      "--report-only", f"launcher={name}"])
    assert report.exit_code == 0, report.output  # the report needs no cluster package


def test_a_failed_cell_is_reported_with_its_log(tmp_path):
    """The command lists each failed cell with its error and where it is told in full (here
    the local launcher's error.txt; a batch job's log under SLURM, tested above)."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({
        **GRID, "workers": 1, "output_dir": str(tmp_path / "g"),
        "variants": {"broken": ["objective.name=ntil", "objective.params.no_such_param=1"]}}))
    res = CliRunner().invoke(app, ["experiment", "-c", str(path), "--no-progress"])
    assert res.exit_code == 1
    error_file = tmp_path / "g" / "default" / "broken" / "seed0" / ERROR_FILE
    assert "no_such_param" in error_file.read_text()
    assert f"(log: {error_file})" in res.output
