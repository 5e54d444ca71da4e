"""The one registry of evaluation kinds (``eval.kind``): what each kind of answer is, as data.

A kind says how a test answer is produced and read: generated up to a stop string and parsed
(a number, a clock time, boxes), sampled as open-ended text, or chosen among candidates by
perplexity. This module holds only names and plain facts, so it sits at the bottom with the
config (:mod:`emdlm.config` validates ``eval.kind`` against it). The functions of each kind live
with the code that owns them, each in a table keyed by the kind and pinned by
tests/test_task_registry.py to hold exactly the registered kinds: the metrics
(:data:`emdlm.metrics.TASK_METRICS`), the per-row fields of predictions.jsonl
(:data:`emdlm.evaluation.ROW_FIELDS`) and the contact-sheet drawing
(:data:`emdlm.contact_sheet.SHEETS`, the kinds with ``picture``). Adding a kind is a
line here and an entry in each of those tables; the test fails until every table has it.

| kind   | answer                               | generates | stop  | numeric | open | picture |
|--------|--------------------------------------|-----------|-------|---------|------|---------|
| number | a number (value equality)            | yes       | "\\n" | yes     |      |         |
| clock  | a time "H_MM"                        | yes       | "\\n" |         |      | yes     |
| box    | one box                              | yes       | "\\n" |         |      | yes     |
| boxes  | several boxes, "; "-separated        | yes       | "\\n" |         |      | yes     |
| text   | open-ended continuations (sampled)   | yes       | none  |         | yes  |         |
| choice | a candidate chosen by perplexity     | no        | "\\n" |         |      |         |
| math   | a benchmark answer (option / number) | yes       | "\\n" |         |      | yes     |

``math`` reads each test row's metadata (``question_type``, ``answer_type``, ``choices``,
``precision``, ``unit``; :mod:`emdlm.math_answers`): its metrics and per-row fields are given
the rows as well as the strings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalKind:
    """One evaluation kind.

    name: the config name (``eval.kind``).
    summary: one line for listings and messages.
    generates: the model generates the answer (False: it picks one of the row's candidates by
        perplexity, :func:`emdlm.evaluation.evaluate_choice`).
    stop_at: where a generated answer ends; the reference completion is cut there too.
    numeric: exact match compares values (``"3.0" == "3"``), not strings.
    open_ended: sampled continuations scored by :func:`emdlm.evaluation.evaluate_text`
        (MAUVE, diversity, perplexities) rather than one parsed answer.
    picture: a contact sheet can draw the gold and predicted answers on the test images.
    """

    name: str
    summary: str
    generates: bool = True
    stop_at: tuple[str, ...] = ("\n",)
    numeric: bool = False
    open_ended: bool = False
    picture: bool = False

    @property
    def short_answer(self) -> bool:
        """A short generated answer, cut at a stop string and parsed (what a VLM is scored on)."""
        return self.generates and not self.open_ended


EVAL_KIND_SPECS: dict[str, EvalKind] = {
    spec.name: spec
    for spec in (
        EvalKind("number", "a number; exact match by value, absolute and relative error",
                 numeric=True),
        EvalKind("clock", "a clock time H_MM; exact match and the cyclic time gap", picture=True),
        EvalKind("box", "one box; Acc@IoU>=0.5 and mean IoU", picture=True),
        EvalKind("boxes", "several boxes; one-to-one matching at IoU>=0.5", picture=True),
        EvalKind("text", "open-ended continuations; MAUVE, ROUGE, diversity, perplexities",
                 stop_at=(), open_ended=True),
        EvalKind("choice", "a candidate chosen by perplexity; accuracy", generates=False),
        EvalKind("math", "a math benchmark answer (MathVista / MathVision): exact match by "
                 "option or number at the item's precision, per type", picture=True),
    )
}

#: Every kind's name, in registry order.
EVAL_KINDS: tuple[str, ...] = tuple(EVAL_KIND_SPECS)
#: The kinds whose answers the model generates.
GENERATION_KINDS: tuple[str, ...] = tuple(n for n, s in EVAL_KIND_SPECS.items() if s.generates)
#: The kinds a contact sheet draws.
PICTURE_KINDS: tuple[str, ...] = tuple(n for n, s in EVAL_KIND_SPECS.items() if s.picture)


def eval_kind(name: str) -> EvalKind:
    """The kind registered under ``name`` (ValueError naming the known kinds if absent)."""
    try:
        return EVAL_KIND_SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task kind {name!r}; expected one of {EVAL_KINDS}") from None


__all__ = [
    "EVAL_KINDS", "EVAL_KIND_SPECS", "GENERATION_KINDS", "PICTURE_KINDS", "EvalKind", "eval_kind",
]
