"""The ``emdlm eval`` recipe: load a trained folder, generate answers for a test set, score them
with :func:`emdlm.evaluation.evaluate_examples`, write metrics.json + predictions.jsonl. What
differs between a text model and an image-text model is the folder's model adapter's
(:func:`emdlm.training.adapters.adapter_for_folder`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from emdlm.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    build_config,
    load_config_dict,
    read_yaml_file,
)
from emdlm.training.text_eval import load_trained as load_trained  # re-exported (sample, training)

RUN_CONFIG = "run_config.yaml"
EVAL_DISK_FULL_ADVICE = ("the folder holds no finished evaluation (metrics.json is written "
                         "last, beside whole predictions): free some space and run it again")


def resolve_eval_config(
    run_dir: str | Path, config: str | Path | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """The run's saved config (when the folder has one), then ``config``, then overrides."""
    folder = Path(run_dir)
    base: dict[str, Any] = {}
    for candidate in (folder / RUN_CONFIG, folder.parent / RUN_CONFIG):
        if candidate.is_file():  # a run folder, or a checkpoint-N inside one
            base = read_yaml_file(candidate) or {}
            break
    extra = load_config_dict(config)
    merged = _deep_merge(base, extra)
    return build_config(apply_overrides(merged, overrides or []))


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def evaluate_run(
    run_dir: str | Path,
    cfg: RunConfig,
    *,
    out_dir: str | Path | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Evaluate the model in ``run_dir`` on ``cfg.data.eval`` with ``cfg.eval`` settings.

    ``eval.kind`` "text" samples ``eval.num_samples`` continuations per prompt and scores them
    (:func:`emdlm.evaluation.evaluate_text`; PPL_oracle with ``eval.oracle``); "choice" picks
    the lowest-perplexity candidate (:func:`emdlm.evaluation.evaluate_choice`); the other kinds
    generate and parse answers (:func:`emdlm.evaluation.evaluate_examples`).
    Writes ``metrics.json`` and ``predictions.jsonl`` to ``out_dir`` (default
    ``<run_dir>/eval``) and returns the metrics. Everything is loaded and checked first.

    When the output folder lies inside a run folder (the default ``<run_dir>/eval``), the run
    folder's lock is held from the start to the last write, so an ``emdlm train`` working there
    (or another ``emdlm eval``) is reported at once (RunFolderBusy, naming the holder) instead
    of after the evaluation.
    """
    from emdlm.eval_outputs import refuse_eval_links, write_eval_outputs
    from emdlm.training.checkpoints import check_holds_model
    from emdlm.training.run_folder import (
        enclosing_run_folder,
        hold_run_folder,
        is_run_folder,
        record_outputs,
    )
    from emdlm.training.saving import full_disk_in_one_line

    check_holds_model(Path(run_dir))  # before the test set: a folder without a model says so
    if cfg.data.eval is None:
        raise ConfigError("no test set: set data.eval.path or data.eval.task (e.g. --task)")
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "eval"
    run_folder = enclosing_run_folder(target)
    # links below the folder the user named are refused (the default eval/ is inside run_dir)
    within = Path(run_dir) if out_dir is None else (run_folder or target)
    refuse_eval_links(target, within=within)
    with (contextlib.nullcontext() if run_folder is None else hold_run_folder(
            run_folder, "emdlm eval", hint="wait for it to finish, or write the evaluation "
            "elsewhere with --out")), full_disk_in_one_line(  # one line, as training's saves
                target, f"the evaluation into {target}", advice=EVAL_DISK_FULL_ADVICE):
        metrics, predictions, pictures = _evaluate(Path(run_dir), cfg, target)
        write_eval_outputs(target, metrics, predictions, within=within)
        if out_dir is None and is_run_folder(Path(run_dir)):  # --overwrite may remove it later
            record_outputs(Path(run_dir), ["eval"])
    return {
        "name": name or Path(run_dir).name, "metrics": metrics, "out_dir": str(target),
        "files": ["metrics.json", "predictions.jsonl", *(p.name for p in pictures)],
    }


def _evaluate(
    run_dir: Path, cfg: RunConfig, target: Path
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]:
    """Metrics, prediction rows and the pictures drawn (a VLM's ``target/contact_sheet.png``)
    of the model in ``run_dir`` (see :func:`evaluate_run`), by the folder's model adapter
    (:func:`emdlm.training.adapters.adapter_for_folder`: a causal LM, or an image-text-to-text
    model evaluated on images, :func:`emdlm.training.image_text.evaluate_vlm`)."""
    from emdlm.training.adapters import adapter_for_folder

    assert cfg.data.eval is not None  # checked by evaluate_run
    return adapter_for_folder(run_dir).evaluate(run_dir, cfg, target)
