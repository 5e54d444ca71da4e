"""``emdlm`` command line: ``train``, ``eval``, ``sample``, ``demo``, ``experiment``.

    emdlm train -c arithmetic_ntil train.max_steps=200 output_dir=runs/ntil
    emdlm eval runs/ntil --task arithmetic --n 500
    emdlm demo

Configs are YAML files (or the names of packaged ones, see ``src/emdlm/configs``) overridden by
dotted ``key=value`` arguments; a few common keys also have flags.

Exit codes: 2 for a problem with the input, reported in one line before anything is written
(this includes a run folder another emdlm process is using), or for a missing optional package
(one line naming the pip extra that installs it); 3 when ``train`` or ``eval`` stopped on a full
disk (one line naming what was being saved; for ``train`` the newest checkpoint, which is
intact: free space, then ``--resume``); 130 after Ctrl-C.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from emdlm.config import ConfigError
from emdlm.eval_kinds import EVAL_KINDS
from emdlm.objective_specs import OBJECTIVE_NAMES

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train and evaluate language models with Earth Mover's Distance objectives.",
)

Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted config overrides, e.g. objective.name=ntil train.max_steps=100"),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", "-c", help="YAML config file or packaged config name"),
]


#: The --objective and --kind help, from the registries (emdlm.objective_specs, emdlm.eval_kinds).
OBJECTIVE_HELP = f"{' | '.join(OBJECTIVE_NAMES)} | <module>:<Class> (a loss class of your own)"
KIND_HELP = " | ".join(EVAL_KINDS)

EXIT_DISK_FULL = 3  # train / eval stopped on a full disk (train: the last checkpoint is intact)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _eval_data_overrides(data: str | None, task: str | None, n: int | None,
                         split: str) -> list[str]:
    """data.eval overrides for the --data / --task / --n / --split flags of eval and sample.

    ``--n`` sets both ``data.eval.n`` (a generator's count) and ``data.eval.limit`` (the first
    N examples kept): N generated and the first N kept are the same N, and a file or folder,
    which has no generator, is cut to its first N, so one flag means N examples either way."""
    if data is not None and task is not None:
        _fail("give --data or --task, not both")
    items: list[str] = []
    if data is not None:
        items += ["data.eval.task=null", f"data.eval.path={data}", f"data.eval.split={split}"]
    if task is not None:
        items += ["data.eval.path=null", f"data.eval.task={task}", f"data.eval.split={split}"]
    if n is not None:
        items += [f"data.eval.n={n}", f"data.eval.limit={n}"]
    return items


@app.command()
def train(
    overrides: Overrides = None,
    config: ConfigOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Output folder")] = None,
    objective: Annotated[str | None, typer.Option(help=OBJECTIVE_HELP)] = None,
    max_steps: Annotated[
        int | None, typer.Option(help="Optimizer steps (overrides epochs)")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Run seed")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest checkpoint in the output")
    ] = False,
    resume_from: Annotated[
        str | None, typer.Option(help="Continue from this checkpoint folder")
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an emdlm run folder: deletes only what emdlm wrote there",
        ),
    ] = False,
    evaluate: Annotated[
        bool, typer.Option("--eval", help="Evaluate the final model on data.eval (eval.at_end)")
    ] = False,
) -> None:
    """Train a model (transformers.Trainer with an emdlm objective)."""
    from emdlm.config import load_config
    from emdlm.training import TrainingInterrupted, run_training
    from emdlm.training.launch import close_process_group
    from emdlm.training.saving import DiskFullError

    items = list(overrides or [])
    for key, value in (("output_dir", output), ("objective.name", objective),
                       ("train.max_steps", max_steps), ("train.seed", seed)):
        if value is not None:
            items.append(f"{key}={value}")
    if evaluate:
        items.append("eval.at_end=true")
    finished = False
    try:
        cfg = load_config(config, items)
        summary = run_training(
            cfg, resume=resume_from or resume, overwrite=overwrite, config_path=config
        )
        finished = True
    except ConfigError as err:
        _fail(str(err))
    except DiskFullError as err:
        _fail(str(err), code=EXIT_DISK_FULL)
    except TrainingInterrupted as err:
        typer.echo(f"\n{err}. Continue with: emdlm train ... --resume", err=True)
        raise typer.Exit(130) from None
    finally:
        if not finished:  # an error on this rank: end the group, let the error propagate
            close_process_group(finished=False)
    if int(os.environ.get("RANK", "0")) == 0:  # one line, not one per process
        tb = Path(summary["output_dir"]) / "tb"
        curves = f"; loss curves: tensorboard --logdir {tb}" if tb.is_dir() else ""
        typer.echo(
            f"saved: {summary['output_dir']} (train loss {summary['train_loss']:.4f} over "
            f"{summary['global_step']} steps{curves})"
        )
        if cfg.eval.at_end:  # rank 0 only; the other ranks wait at close_process_group
            from emdlm.training.evaluate import evaluate_run

            try:
                _print_eval(evaluate_run(summary["output_dir"], cfg))
            except ConfigError as err:
                _fail(f"training finished and was saved, but the evaluation failed: {err}")
            except DiskFullError as err:
                _fail(f"training finished and was saved, but the evaluation failed: {err}",
                      code=EXIT_DISK_FULL)
    close_process_group(finished=True)  # under a launcher: ends this process (exit code 0)


def _print_eval(result: dict[str, Any]) -> None:
    """The metrics table and the files an evaluation wrote (``emdlm eval``, ``--eval``)."""
    from emdlm.eval_outputs import format_metrics_table

    typer.echo(format_metrics_table({result["name"]: result["metrics"]}))
    typer.echo(f"written: {result['out_dir']}/{', '.join(result['files'])}")


@app.command("eval")
def eval_cmd(
    run_dir: Annotated[str, typer.Argument(help="Trained output folder or checkpoint folder")],
    overrides: Overrides = None,
    config: ConfigOpt = None,
    data: Annotated[
        str | None, typer.Option(help="Test set: JSONL file or save_to_disk folder")
    ] = None,
    task: Annotated[str | None, typer.Option(help="Test set: a registered task name")] = None,
    n: Annotated[
        int | None,
        typer.Option(help="Examples: --task generates N, a file / folder gives its first N"),
    ] = None,
    split: Annotated[str, typer.Option(help="Split for --task / dataset folders")] = "test",
    kind: Annotated[str | None, typer.Option(help=KIND_HELP)] = None,
    oracle: Annotated[
        str | None, typer.Option(help="kind text: model folder scoring the samples (PPL_oracle)")
    ] = None,
    sample: Annotated[
        bool, typer.Option("--sample", help="Sample instead of greedy decoding")
    ] = False,
    decode: Annotated[
        str | None,
        typer.Option(help="greedy | mbr (eval.mbr_samples samples, the one nearest the others)"),
    ] = None,
    out: Annotated[str | None, typer.Option(help="Where metrics.json goes")] = None,
) -> None:
    """Generate answers for a test set and compute metrics (metrics.json, predictions.jsonl)."""
    from emdlm.training.evaluate import evaluate_run, resolve_eval_config
    from emdlm.training.saving import DiskFullError

    items = _eval_data_overrides(data, task, n, split)
    if kind is not None:
        items.append(f"eval.kind={kind}")
    if sample:
        items.append("eval.do_sample=true")
    if decode is not None:
        items.append(f"eval.decode={decode}")
    if oracle is not None:
        items.append(f"eval.oracle={oracle}")
    items += list(overrides or [])
    try:
        cfg = resolve_eval_config(run_dir, config, items)
        result = evaluate_run(run_dir, cfg, out_dir=out)
    except ConfigError as err:
        _fail(str(err))
    except DiskFullError as err:
        _fail(str(err), code=EXIT_DISK_FULL)
    _print_eval(result)


@app.command()
def sample(
    run_dir: Annotated[str, typer.Argument(help="Model folder to sample from (e.g. an oracle)")],
    out: Annotated[str, typer.Option(help="JSONL file to write")],
    overrides: Overrides = None,
    data: Annotated[
        str | None, typer.Option(help="Prompts: JSONL file or save_to_disk folder")
    ] = None,
    task: Annotated[str | None, typer.Option(help="Prompts: a registered task name")] = None,
    n: Annotated[
        int | None,
        typer.Option(help="Prompts: --task generates N, a file / folder gives its first N"),
    ] = None,
    split: Annotated[str, typer.Option(help="Split for --task / dataset folders")] = "train",
    num_samples: Annotated[int, typer.Option(help="Continuations per prompt")] = 1,
    fmt: Annotated[
        str, typer.Option("--format", help="prompt_completion | text (prompt + sample)")
    ] = "prompt_completion",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out file")] = False,
) -> None:
    """Sample continuations of prompts by unbiased sampling (temperature 1, no top-k / top-p)
    and write them as a JSONL corpus: the oracle experiment's training and test sets.

    The same model, prompts, eval.seed, eval.batch_size and torch thread count give the same
    file; another thread count may change float sums and so, rarely, a sampled token."""
    from emdlm.training.evaluate import resolve_eval_config
    from emdlm.training.sample import sample_corpus

    items = [f"eval.num_samples={num_samples}"]
    items += _eval_data_overrides(data, task, n, split)
    items += list(overrides or [])
    try:
        cfg = resolve_eval_config(run_dir, None, items)
        summary = sample_corpus(run_dir, cfg, out, fmt=fmt, overwrite=overwrite)
    except ConfigError as err:
        _fail(str(err))
    typer.echo(f"written: {summary['out']}: {summary['rows']} rows from {summary['prompts']} "
               f"prompts x {summary['num_samples']} samples ({summary['empty_samples']} empty "
               "samples left out)")


@app.command()
def demo(
    overrides: Overrides = None,
    out: Annotated[str, typer.Option(help="Folder for both runs")] = "runs/demo",
    task: Annotated[
        str, typer.Option(help="arithmetic (tiny GPT-2) | clock (tiny VLM on clock images) | "
                               "visual_math (tiny VLM reading a bar chart)")
    ] = "arithmetic",
) -> None:
    """CE vs NTIL on a built-in task (train + eval, same seed and data), side by side."""
    from emdlm.training.demo import run_demo

    try:
        run_demo(out, list(overrides or []), echo=typer.echo, task=task)
    except ConfigError as err:
        _fail(str(err))


@app.command()
def experiment(
    config: Annotated[
        str, typer.Option("--config", "-c", help="Experiment YAML or packaged experiment name")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Dotted experiment overrides, e.g. seeds=2 base.train.max_steps=50"),
    ] = None,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Only rebuild the report from finished cells")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show the grid's progress display")] = True,
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Run only the cells whose task/variant/seed<k> matches this "
                     "shell pattern (repeatable, e.g. '*/ce/seed4'); the report covers all"),
    ] = None,
    rerun_refused: Annotated[
        bool, typer.Option("--rerun-refused", help="Move the folder of a cell trained under "
                           "another definition beside it (renamed, nothing deleted) and run "
                           "the cell again")
    ] = False,
    earlier_results: Annotated[
        Path | None,
        typer.Option("--earlier-results", help="An earlier run's results.csv of this grid: "
                     "its cells count as finished where they have no folder here (their rows "
                     "as written, not re-checked: the report says so)"),
    ] = None,
) -> None:
    """Run a grid of variants x seeds x tasks (train + eval per cell; finished cells are
    skipped) and write report.md, results.csv and plots/ with paired statistics."""
    from emdlm.experiments import run_experiment

    flags = [f"--only {pattern}" for pattern in only or []]
    if earlier_results is not None:
        flags.append(f"--earlier-results {earlier_results}")
    command = " ".join(["emdlm", "experiment", "-c", config, *flags, *(overrides or [])])
    try:
        result = run_experiment(config, list(overrides or []), progress=progress,
                                report_only=report_only, command=command, only=only,
                                rerun_refused=rerun_refused, echo=typer.echo,
                                earlier_results=earlier_results)
    except ConfigError as err:
        _fail(str(err))
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: run the same command again to resume the grid", err=True)
        raise typer.Exit(130) from None
    for key, why in result.left_out.items():  # marked done, outputs not whole: never counted
        typer.echo(f"warning: {key} left out of the report: {why}", err=True)
    for key, why in result.refused.items():  # another definition's work: never counted
        typer.echo(f"error: {key}: {why}", err=True)
    typer.echo(f"written: {result.report}, {result.results_csv}, {len(result.plots)} plot(s)")
    if result.refused:
        typer.echo(f"{len(result.refused)} cell(s) refused: their folders hold another "
                   "definition's work (see report.md)", err=True)
    if result.failed:
        typer.echo(f"{len(result.failed)} cell(s) failed:", err=True)
        for o in result.failed:  # the log: the cell's error.txt, or its batch job's log
            typer.echo(f"  {o.key}: {o.error}" + (f" (log: {o.log})" if o.log else ""), err=True)
    if result.failed or result.refused:
        raise typer.Exit(1)


@app.command("config-path")
def config_path(
    name: Annotated[str, typer.Argument(help="A packaged config, e.g. accelerate_ddp_cpu")],
) -> None:
    """Print the installed path of a packaged config (run, launcher or experiment), e.g.
    accelerate launch --config_file "$(emdlm config-path accelerate_ddp_cpu)" ..."""
    from emdlm.config import packaged_config_path

    try:
        typer.echo(str(packaged_config_path(name)))
    except ConfigError as err:
        _fail(str(err))


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``emdlm = emdlm.cli:main``); a missing optional package ends in
    one line naming the extra to install (exit 2), not a traceback."""
    from emdlm._extras import MissingExtraError

    try:
        app(args=argv if argv is not None else sys.argv[1:], prog_name="emdlm")
    except MissingExtraError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
