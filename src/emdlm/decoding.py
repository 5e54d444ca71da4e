"""Minimum-Bayes-risk (MBR) decoding of short answers: sample k answers per prompt and keep the
one with the least expected distance to the others, by the eval kind's own distance.

For k sampled candidates c_1..c_k of one prompt and a distance d, the MBR answer is

    c* = argmin_i  sum_j d(c_i, c_j)        (i, j over the candidates that parse)

(Kumar & Byrne 2004, "Minimum Bayes-Risk Decoding for Statistical Machine Translation",
https://aclanthology.org/N04-1022/; the samples stand in for the model's distribution as in
Eikema & Aziz 2020, https://aclanthology.org/2020.coling-main.398/). With d = |a - b| on
numbers the minimiser among the candidates is a sample median: the answer minimising the
expected absolute error under the model's own distribution, which greedy decoding (the most
probable token at each step) does not minimise.

The distance of each kind (:data:`MBR_DISTANCES`, exactly the kinds with a generated short
answer, :attr:`emdlm.eval_kinds.EvalKind.short_answer`):

| kind   | candidate value                       | d(a, b)                                      |
|--------|---------------------------------------|----------------------------------------------|
| number | exact rational (``parse_fraction``)   | abs(a - b): the pick is a sample median      |
| clock  | minutes on the dial (``parse_clock``) | min(e, 720 - e), e = abs(a - b) mod 720      |
| box    | one box (``parse_box``)               | 1 - IoU(a, b)                                |
| boxes  | a set of boxes (``parse_boxes``)      | 1 - F1 of one-to-one matching at IoU >= 0.5  |
| math   | the normalized answer text            | 0 if equal else 1 (a majority vote)          |

"text" (open-ended) and "choice" (no generation) have no short answer: ``eval.decode=mbr`` is
refused for them when the config is read.

Rules, all deterministic given the samples:

* duplicates count: a value sampled three times weighs three times in every risk;
* ties in risk go to the value sampled most often, then to the earliest sample (lowest index);
  the answer returned is that earliest sample's text (so "3.0" and "3" of one value give the
  first spelling drawn);
* candidates that do not parse are left out of every risk and are never chosen while one
  candidate parses;
* when none parses, the answer is the most frequent candidate text (stripped; ties to the
  earliest): the 0-1-loss MBR answer, scored as the unparsed answer it is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from emdlm.config import DECODE_MODES
from emdlm.eval_kinds import EVAL_KIND_SPECS, eval_kind
from emdlm.generation import generate_answers
from emdlm.metrics import normalize_answer, parse_clock, parse_fraction
from emdlm.metrics.boxes import Box, box_iou, match_boxes, parse_box, parse_boxes

_HALF_DAY_MIN = 12 * 60


def _clock_gap_minutes(a: int, b: int) -> int:
    """Cyclic gap in minutes on a 12-hour dial (the clock kind's time gap, in minutes)."""
    e = abs(a - b) % _HALF_DAY_MIN
    return min(e, _HALF_DAY_MIN - e)


def _iou_distance(a: Box, b: Box) -> float:
    return 1.0 - box_iou(a, b)


def _boxes_key(text: str) -> tuple[Box, ...] | None:
    boxes = parse_boxes(text)
    return None if boxes is None else tuple(boxes)


def _boxes_distance(a: tuple[Box, ...], b: tuple[Box, ...]) -> float:
    """1 - F1 of the one-to-one matching at IoU >= 0.5 (:func:`emdlm.metrics.boxes.match_boxes`,
    the boxes kind's metric); two empty answers agree (distance 0)."""
    if not a and not b:
        return 0.0
    matched = len(match_boxes(list(a), list(b), 0.5))
    return 1.0 - 2.0 * matched / (len(a) + len(b))


def _text_key(text: str) -> str | None:
    t = normalize_answer(text)
    return t or None


def _zero_one(a: Hashable, b: Hashable) -> int:
    return 0 if a == b else 1


@dataclass(frozen=True)
class AnswerDistance:
    """How one kind's candidates are read and compared.

    parse: candidate text -> a hashable value, or None when it does not parse.
    distance: d(a, b) >= 0 between two parsed values, d(a, a) = 0.
    summary: the distance in words (recorded in metrics.json as ``mbr_distance``).
    """

    parse: Callable[[str], Hashable | None]
    distance: Callable[[Any, Any], float | int | Fraction]
    summary: str


#: The MBR distance of each kind with a generated short answer (tests/test_decoding.py pins
#: the keys to the registry's short-answer kinds).
MBR_DISTANCES: dict[str, AnswerDistance] = {
    "number": AnswerDistance(parse_fraction, lambda a, b: abs(a - b), "absolute difference"),
    "clock": AnswerDistance(parse_clock, _clock_gap_minutes, "cyclic gap in minutes"),
    "box": AnswerDistance(parse_box, _iou_distance, "1 - IoU"),
    "boxes": AnswerDistance(_boxes_key, _boxes_distance, "1 - F1 of matching at IoU>=0.5"),
    "math": AnswerDistance(_text_key, _zero_one, "0-1 on the normalized answer (majority)"),
}


def mbr_distance(kind: str) -> AnswerDistance:
    """The kind's :class:`AnswerDistance`; ValueError for an unknown kind or one without a
    generated short answer (text, choice)."""
    spec = eval_kind(kind)
    if not spec.short_answer:
        short = [n for n, s in EVAL_KIND_SPECS.items() if s.short_answer]
        raise ValueError(f"MBR decoding needs a generated short answer; kind {kind!r} has none "
                         f"(kinds with one: {', '.join(short)})")
    return MBR_DISTANCES[kind]


@dataclass(frozen=True)
class MbrChoice:
    """The pick among one prompt's candidates: ``index`` of the chosen sample, ``n_parsed``
    candidates that parsed, ``risk`` = sum_j d(chosen, c_j) over them (None when none parsed
    and the most frequent text was taken)."""

    index: int
    n_parsed: int
    risk: float | None


def mbr_select(candidates: Sequence[str], kind: str) -> MbrChoice:
    """The minimum-Bayes-risk candidate of ``candidates`` under ``kind``'s distance (rules in
    the module docstring). O(m^2) distances for m distinct parsed values."""
    if not candidates:
        raise ValueError("MBR selection needs at least one candidate")
    rule = mbr_distance(kind)
    values = [rule.parse(c) for c in candidates]
    first: dict[Hashable, int] = {}  # value -> index of its earliest sample
    count: Counter[Hashable] = Counter()
    for i, v in enumerate(values):
        if v is not None:
            first.setdefault(v, i)
            count[v] += 1
    if not first:  # nothing parses: the most frequent text, ties to the earliest
        texts = Counter(c.strip() for c in candidates)
        best = min(range(len(candidates)), key=lambda i: (-texts[candidates[i].strip()], i))
        return MbrChoice(best, 0, None)
    risk = {v: sum(n * rule.distance(v, u) for u, n in count.items()) for v in first}
    best_value = min(first, key=lambda v: (risk[v], -count[v], first[v]))
    return MbrChoice(first[best_value], sum(count.values()), _as_float(risk[best_value]))


def _as_float(risk: float | int | Fraction) -> float:
    """``risk`` as a float, ``inf`` where it is beyond a float's range (a sampled answer such
    as ``9e999`` parses to an exact rational whose distances no float holds; the pick, made on
    the exact values, stands)."""
    try:
        return float(risk)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class MbrDecoded:
    """MBR answers of a list of prompts: ``answers[i]`` chosen among ``samples[i]`` (the k
    candidates as generated), and the settings and parse counts for metrics.json."""

    answers: list[str]
    samples: list[list[str]]
    metrics: dict[str, Any]


def mbr_decode(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    kind: str,
    samples: int = 16,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at: Sequence[str] = ("\n",),
) -> MbrDecoded:
    """Sample ``samples`` answers per prompt (one ``generate`` call per batch of
    max(1, batch_size // samples) prompts, ``num_return_sequences=samples``, seeded once with
    ``seed``; top-k off) and keep each prompt's :func:`mbr_select` pick.

    metrics: ``decode`` ("mbr"), ``mbr_samples``, ``mbr_temperature``, ``mbr_top_p``,
    ``mbr_distance`` (the kind's, in words), ``mbr_parsed_share`` (share of all samples that
    parsed) and ``mbr_none_parsed_rate`` (share of prompts whose samples all failed to parse,
    answered by the most frequent text).
    """
    rule = mbr_distance(kind)  # before any generation
    if samples < 1:
        raise ValueError(f"MBR decoding needs samples >= 1, got {samples}")
    flat = generate_answers(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens,
        batch_size=max(1, batch_size // samples), do_sample=True, temperature=temperature,
        top_p=top_p, seed=seed, stop_at=stop_at, num_return_sequences=samples,
    )  # prompt-major: the k samples of prompt 0, then of prompt 1, ...
    grouped = [flat[i * samples : (i + 1) * samples] for i in range(len(prompts))]
    answers: list[str] = []
    parsed = none_parsed = 0
    for group in grouped:
        choice = mbr_select([c.strip() for c in group], kind)
        answers.append(group[choice.index])
        parsed += choice.n_parsed
        none_parsed += choice.n_parsed == 0
    n = len(prompts)
    metrics: dict[str, Any] = {
        "decode": "mbr", "mbr_samples": samples, "mbr_temperature": temperature,
        "mbr_top_p": top_p, "mbr_distance": rule.summary,
        "mbr_parsed_share": parsed / (n * samples) if n else float("nan"),
        "mbr_none_parsed_rate": none_parsed / n if n else float("nan"),
    }
    return MbrDecoded(answers, grouped, metrics)


def check_decode(decode: str) -> None:
    """ValueError unless ``decode`` is one of :data:`emdlm.config.DECODE_MODES`."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")


__all__ = [
    "MBR_DISTANCES", "AnswerDistance", "MbrChoice", "MbrDecoded", "check_decode", "mbr_decode",
    "mbr_distance", "mbr_select",
]
