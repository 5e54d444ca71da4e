"""The files of one evaluation: ``predictions.jsonl`` then ``metrics.json`` (the completion
record), checked whole when read back, and the metrics table ``emdlm eval`` prints.

metrics.json is written last and records how many rows predictions.jsonl holds
(:data:`N_PREDICTIONS`), so a folder whose files disagree (a kill mid-write, a cut-off file) is
never read as an evaluation: :func:`read_eval_outputs` raises :class:`EvalOutputError` naming
the file.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from emdlm._files import atomic_write, refuse_links

# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """Non-finite floats become None so the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


#: The files of one evaluation folder (``emdlm eval``'s ``--out``, an experiment's step folder).
METRICS_FILE = "metrics.json"
PREDICTIONS_FILE = "predictions.jsonl"
#: Key of metrics.json recording how many rows predictions.jsonl holds. metrics.json is written
#: last, so it is the evaluation's completion record and this count is checked against the rows.
N_PREDICTIONS = "n_predictions"
#: Counts that metrics.json held before ``n_predictions`` existed, one per predictions row
#: (``n_prompts`` of eval.kind text, ``n`` of every other kind): the check for older folders.
LEGACY_ROW_COUNTS = ("n_prompts", "n")
#: Every file an evaluation may write into its folder (a VLM's evaluation draws a contact sheet).
WRITTEN_FILES = (METRICS_FILE, PREDICTIONS_FILE, "contact_sheet.png")


class EvalOutputError(ValueError):
    """An evaluation folder that does not hold one whole evaluation (files missing, cut off,
    or disagreeing on the number of rows). The message is one line naming the file."""


def refuse_eval_links(out_dir: str | Path, *, within: str | Path | None = None) -> None:
    """:class:`emdlm._files.FolderEntryError` naming the link when the evaluation folder
    ``out_dir``, a folder between ``within`` (the folder the user named; default ``out_dir``
    itself) and it, or one of the files an evaluation writes there (:data:`WRITTEN_FILES`) is
    a symbolic link. Reads only: called before the evaluation starts, and again by
    :func:`write_eval_outputs`."""
    out = Path(out_dir)
    refuse_links(out, within=out if within is None else Path(within))
    for name in WRITTEN_FILES:
        refuse_links(out / name)


def write_eval_outputs(
    out_dir: str | Path,
    metrics: Mapping[str, Any],
    predictions: Iterable[Mapping[str, Any]],
    *,
    within: str | Path | None = None,
) -> dict[str, Path]:
    """Write ``predictions.jsonl`` (one JSON object per line), then ``metrics.json`` with
    ``n_predictions`` (the number of rows) added, to out_dir.

    Each file is written to a temporary name in out_dir and renamed into place
    (:func:`emdlm._files.atomic_write`), and an earlier ``metrics.json`` is removed first, so
    that a ``metrics.json`` is only ever beside the complete predictions it counts: a write cut
    short (an error, a killed process) leaves no folder that reads as a finished evaluation
    (:func:`eval_outputs_problem`). NaN/inf values are written as null. Returns
    ``{"metrics": path, "predictions": path}``. Nothing is written when ``out_dir`` or one of
    its files is a symbolic link (:func:`refuse_eval_links`, ``within`` as there).
    """
    out = Path(out_dir)
    refuse_eval_links(out, within=within)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    preds_path = out / PREDICTIONS_FILE
    metrics_path.unlink(missing_ok=True)  # the old completion record must not outlive its rows
    count = 0
    with atomic_write(preds_path) as fh:
        for row in predictions:
            fh.write(json.dumps(_json_safe(dict(row)), ensure_ascii=False, allow_nan=False))
            fh.write("\n")
            count += 1
    record = {**_json_safe(dict(metrics)), N_PREDICTIONS: count}
    with atomic_write(metrics_path) as fh:
        fh.write(json.dumps(record, indent=2, allow_nan=False) + "\n")
    return {"metrics": metrics_path, "predictions": preds_path}


def _expected_rows(metrics: Mapping[str, Any]) -> int | None:
    """The row count metrics.json records: ``n_predictions``, else (a folder written before it
    existed) ``n_prompts`` or ``n``; None when it records none."""
    for key in (N_PREDICTIONS, *LEGACY_ROW_COUNTS):
        value = metrics.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _read_metrics_record(out_dir: Path) -> dict[str, Any]:
    """metrics.json of ``out_dir`` as a dict; EvalOutputError when it is missing or torn."""
    path = out_dir / METRICS_FILE
    if not path.is_file():
        raise EvalOutputError(f"{path} is missing: the evaluation did not finish")
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EvalOutputError(f"{path} is not valid JSON ({err}): a cut-off write?") from None
    if not isinstance(metrics, dict):
        raise EvalOutputError(f"{path} holds a {type(metrics).__name__}, not a JSON object")
    return metrics


def _rows_problem(path: Path, data: bytes, expected: int | None) -> str | None:
    """Why the bytes of predictions.jsonl are not ``expected`` whole rows (None when they are)."""
    lines = data.count(b"\n")
    if data and not data.endswith(b"\n"):
        return (f"{path}:{lines + 1}: the last line is cut off mid-row (no newline at the end "
                "of the file): a write that did not finish")
    if expected is not None and lines != expected:
        return (f"{path} has {lines} rows but {path.parent / METRICS_FILE} records {expected}: "
                "a write that did not finish")
    return None


def eval_outputs_problem(out_dir: str | Path) -> str | None:
    """Why ``out_dir`` does not hold one finished evaluation, in one line; None when it does.

    Finished means: ``metrics.json`` parses as an object, and ``predictions.jsonl`` ends with a
    newline and has as many lines as metrics.json records (``n_predictions``; for folders
    written before that key, ``n_prompts`` or ``n``; with no count at all, the ending newline is
    the only check). Cheap: the rows themselves are not parsed (:func:`read_eval_outputs` does).
    """
    out = Path(out_dir)
    try:
        metrics = _read_metrics_record(out)
    except EvalOutputError as err:
        return str(err)
    path = out / PREDICTIONS_FILE
    if not path.is_file():
        return f"{path} is missing beside {out / METRICS_FILE}"
    return _rows_problem(path, path.read_bytes(), _expected_rows(metrics))


def read_predictions(path: str | Path, expected: int | None = None) -> list[dict[str, Any]]:
    """The rows of a predictions.jsonl, checked: every line a JSON object, the file ending with
    a newline, and ``expected`` rows when given. EvalOutputError naming ``file:line`` otherwise
    (never a row count silently short, never a JSONDecodeError traceback)."""
    path = Path(path)
    data = path.read_bytes()
    problem = _rows_problem(path, data, expected)
    if problem is not None:
        raise EvalOutputError(problem)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        at = data[: err.start].count(b"\n") + 1
        raise EvalOutputError(f"{path}:{at}: not UTF-8 text ({err.reason})") from None
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.split("\n")[:-1], 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalOutputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise EvalOutputError(f"{path}:{number}: a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return rows


def read_eval_outputs(out_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics, prediction rows) of a finished evaluation folder, both checked (see
    :func:`eval_outputs_problem` and :func:`read_predictions`); EvalOutputError otherwise."""
    out = Path(out_dir)
    metrics = _read_metrics_record(out)
    path = out / PREDICTIONS_FILE
    if not path.is_file():
        raise EvalOutputError(f"{path} is missing beside {out / METRICS_FILE}")
    return metrics, read_predictions(path, _expected_rows(metrics))


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if _is_number_list(value):  # e.g. mauve_runs: a summary here, the list in metrics.json
        v = [float(x) for x in value]
        std = statistics.stdev(v) if len(v) > 1 else math.nan
        return (f"{_format_value(statistics.fmean(v))} ± {_format_value(std)} "
                f"({_format_value(min(v))}–{_format_value(max(v))}, n={len(v)})")
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value.is_integer() and abs(value) < 1e6:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def _is_number_list(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))


def format_metrics_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table with one column per run and one row per metric (side by side).

    ``rows`` maps a run name (e.g. "ce", "ntil") to its metrics dict; metrics appear in order of
    first appearance; a metric missing from a run shows "-". Floats get 4 significant digits; a
    list of numbers (``mauve_runs``, one score per sampling run) is summarized as
    "mean ± std (min–max, n=k)" (metrics.json keeps the list).
    """
    names = list(rows)
    keys: list[str] = []
    for metrics in rows.values():
        keys.extend(k for k in metrics if k not in keys)
    header = ["metric", *names]
    body = [[k, *(_format_value(rows[n].get(k)) for n in names)] for k in keys]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "| " + " | ".join([first, *rest]) + " |"

    sep = "|" + "|".join(["-" * (widths[0] + 2)] + [("-" * (w + 1)) + ":" for w in widths[1:]])
    return "\n".join([line(header), sep + "|", *(line(r) for r in body)])
