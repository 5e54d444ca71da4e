"""Task metrics during training: at each evaluation of a ``transformers.Trainer`` (every
``eval_steps``), generate answers for a fixed set of test rows and log the metrics that
``emdlm eval`` computes for the kind (:func:`emdlm.evaluation.evaluate_examples`: exact match,
absolute / log error, IoU, ...) beside ``eval_loss``, through the trainer's own ``log`` (so every
tracker in ``report_to`` and ``trainer.state.log_history`` get them).

Only kinds that generate a short answer qualify (:mod:`emdlm.eval_kinds`: not "text", whose
MAUVE needs a feature model, nor "choice"). Generation runs on the main process only; a model
sharded across processes (FSDP) cannot generate there alone, so :func:`generation_eval` is not
meant for such runs.

Callback hooks: https://huggingface.co/docs/transformers/main_classes/callback
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from emdlm.eval_kinds import eval_kind

#: rows of the test set generated at each evaluation when no number is given
DEFAULT_ROWS = 64


def check_generation_eval_kind(kind: str) -> None:
    """ValueError unless ``kind`` generates a short answer (the kinds this callback scores)."""
    spec = eval_kind(kind)  # ValueError on an unknown kind
    if not spec.generates or spec.open_ended:
        raise ValueError(
            f"eval.kind={kind!r} has no generated short answer to score during training "
            "(only eval_loss is logged at train.eval_steps); set eval.rows_during_training=0"
        )


def numeric_log(metrics: Mapping[str, Any], prefix: str = "eval_") -> dict[str, float]:
    """The numeric entries of ``metrics`` (booleans and strings left out), keys prefixed."""
    return {f"{prefix}{key}": float(value) for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def generation_eval(
    trainer: Any,
    examples: Sequence[Mapping[str, str]],
    *,
    tokenizer: Any = None,
    kind: str = "number",
    rows: int = DEFAULT_ROWS,
    max_new_tokens: int = 16,
    batch_size: int = 32,
    prefix: str = "eval_",
) -> Any:
    """A ``TrainerCallback`` that, at each evaluation of ``trainer``, greedily generates answers
    for the first ``rows`` of ``examples`` (prompt/completion dicts), scores them with
    :func:`emdlm.evaluation.evaluate_examples` (``kind``; no perplexity, ``eval_loss`` is the
    trainer's) and logs each numeric metric as ``<prefix><metric>`` with ``trainer.log``.

    ``tokenizer``: default ``trainer.processing_class``.
    Add it after building the trainer: ``trainer.add_callback(generation_eval(trainer, rows))``.
    ValueError for a kind without a short answer, ``rows`` < 1 or no examples."""
    from transformers import TrainerCallback

    from emdlm.generation import check_counts

    check_generation_eval_kind(kind)
    check_counts(rows=rows)
    chosen = list(examples[:rows])
    tok = tokenizer if tokenizer is not None else trainer.processing_class
    if not chosen:
        raise ValueError("no test rows to generate answers for")

    class GenerationEval(TrainerCallback):
        """At each evaluation: generate on the test rows, log the task's metrics."""

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not state.is_world_process_zero:
                return
            from emdlm.evaluation import evaluate_examples

            model = kwargs.get("model", trainer.model)
            metrics, _ = evaluate_examples(
                model, tok, chosen, kind=kind, max_new_tokens=max_new_tokens, batch_size=batch_size,
                with_perplexity=False,
            )
            trainer.log(numeric_log(metrics, prefix))

    return GenerationEval()
