"""English text tasks from the corpora that ship offline in gensim's ``gensim/test/test_data``.

Corpora (``corpora`` parameter; the files of gensim 4.4's ``gensim/test/test_data``):

* ``"wiki"``: the shortened English Wikipedia dump
  (``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``): the article pages
  (namespace 0, redirects skipped) with their wiki markup removed by gensim's ``filter_wiki``,
  bold/italic quotes and heading marks dropped, whitespace collapsed: 106 articles, about 480k
  words.
* ``"news"``: the Lee news corpora (``lee_background.cor`` + ``lee.cor``), one document a line,
  about 350 documents and 64k words.

``head500.noblanks.cor`` is NOT used: despite its Wikipedia origin it holds stemmed,
stop-word-free tokens ("anarch greek rule stem archon ..."), not prose; a model trained or
scored on it would learn a bag of stems.

Splits are BY DOCUMENT: a document belongs to "train", "dev" or "test" by a seed-independent
hash of its text (80 / 10 / 10 %), so no document (and no duplicate of it) is in two splits,
whatever seed or parameters are used. Lengths are counted in whitespace-separated words (the
task has no tokenizer); with the llama3-like or GPT-2 BPE an English word is about 1.3 tokens.

Tasks:

* ``english_text``: ``{"text": chunk}`` rows (pre-training / fine-tuning, every token trained):
  each document of the split cut into consecutive chunks of ``chunk_words`` words (the last,
  shorter chunk kept if it has at least ``min_words``).
* ``english_continuation``: ``{"prompt": prefix, "completion": " " + continuation}`` rows for
  open-ended evaluation as in the EMO paper's Table 4 (a prefix, then a generation length; 20
  and 80 tokens for Wikipedia-like text): non-overlapping windows of ``prefix_words`` +
  ``continuation_words`` words from the documents of the split. The defaults, 12 and 48 words,
  are about 20 and 80 tokens of the llama3-like BPE (1.7 tokens a word on the wiki text; GPT-2's
  BPE: 1.35).
* ``polarity_choice``: the Pang & Lee polarity sentences (``pang_lee_polarity.cor``, 200
  movie-review sentences, the data Rotten Tomatoes comes from) as choice examples, with the EMO
  repository's Rotten Tomatoes template (DRSY/EMO ``icl.py``: ``"Review: <X> It is positive"`` /
  ``"... negative"``) and ``shots`` fixed demonstrations from the train split (see
  :func:`polarity_choice`).

A corpus task yields at most what its split holds: ``n`` is a cap, and the rows are the first
``n`` of a ``seed``-shuffled order (pass a large ``n`` for "all").
"""

from __future__ import annotations

import bz2
import hashlib
import json
import random
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from emdlm._files import atomic_write
from emdlm.config.errors import check_one_of
from emdlm.domains import COUNT, NONNEGATIVE_COUNT
from emdlm.tasks import register_task

CORPORA = ("wiki", "news")
SPLITS = ("train", "dev", "test")
#: Share of documents per split (by text hash): train, dev, test.
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
#: The polarity sentences only score a model (their train split only supplies demonstrations),
#: so most of them go to test: 20 / 10 / 70 %.
POLARITY_SPLIT_FRACTIONS = (0.2, 0.1, 0.7)
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILES = ("lee_background.cor", "lee.cor")
POLARITY_FILE = "pang_lee_polarity.cor"
#: The EMO repository's Rotten Tomatoes PPL template (DRSY/EMO icl.py, ``rt_tp_dict``); its
#: in-context examples use the same template, one per line (OpenICL's default separator).
RT_TEMPLATE = "Review: {text} It is {label}"
RT_LABELS = ("negative", "positive")

# ''italic'', '''bold''' and == heading == markup that filter_wiki leaves in the text
_MARKUP_RE = re.compile(r"'{2,}|={2,}")
_WIKI_VERSION = "v1"  # bump when the cleaning changes: the cached articles are rebuilt


def gensim_data_dir() -> Path:
    """gensim's ``test/test_data`` folder (ImportError naming the package if absent)."""
    try:
        import gensim
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the offline English corpora need gensim: pip install gensim") from err
    folder = Path(gensim.__file__).parent / "test" / "test_data"
    if not folder.is_dir():  # pragma: no cover - a stripped gensim install
        raise FileNotFoundError(f"gensim's test data folder is missing: {folder}")
    return folder


def _clean(text: str) -> str:
    """Drop wiki quote / heading markup, collapse all whitespace (newlines too) to one space."""
    return " ".join(_MARKUP_RE.sub("", text).split())


@lru_cache(maxsize=1)
def _wiki_documents() -> tuple[str, ...]:
    """The cleaned articles, cached as JSON under ``$EMDLM_CACHE/corpora`` (parsing the dump
    takes 5-15 s on a shared 2-core machine; reading the cache well under 1 s)."""
    from emdlm.tokenizers import cache_dir

    cached = cache_dir() / "corpora" / f"wiki-{_WIKI_VERSION}.json"
    if cached.is_file():
        return tuple(json.loads(cached.read_text(encoding="utf-8")))
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    docs = []
    with bz2.open(gensim_data_dir() / WIKI_FILE) as fh:
        for _title, text, _page_id in extract_pages(fh, filter_namespaces=("0",)):
            if text.lstrip().lower().startswith("#redirect"):
                continue
            doc = _clean(filter_wiki(text))
            if doc:
                docs.append(doc)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(cached) as f:  # concurrent test processes never read a partial file
        json.dump(docs, f)
    return tuple(docs)


@lru_cache(maxsize=1)
def _news_documents() -> tuple[str, ...]:
    docs = []
    for name in NEWS_FILES:
        lines = (gensim_data_dir() / name).read_text(encoding="utf-8", errors="replace")
        docs.extend(d for d in (_clean(line) for line in lines.splitlines()) if d)
    return tuple(docs)


def corpus_documents(corpus: str) -> tuple[str, ...]:
    """All documents of one corpus ("wiki" or "news"), cleaned, in file order."""
    if corpus == "wiki":
        return _wiki_documents()
    if corpus == "news":
        return _news_documents()
    raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")


def document_split(text: str, fractions: tuple[float, float, float] = SPLIT_FRACTIONS) -> str:
    """The split of a document: "train", "dev" or "test" by the SHA-256 of its text, with
    ``fractions`` the expected share of each.

    Seed-independent, so identical documents share a split and no seed can leak one across.
    """
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    if u < fractions[0]:
        return "train"
    return "dev" if u < fractions[0] + fractions[1] else "test"


def split_documents(corpora: Sequence[str] | str, split: str) -> list[tuple[str, str]]:
    """``(doc_id, text)`` of the documents of ``split`` in ``corpora``; doc_id is
    ``"<corpus>:<index in the corpus>"``."""
    check_one_of("split", split, SPLITS)
    names = [corpora] if isinstance(corpora, str) else list(corpora)
    if not names:
        raise ValueError(f"corpora is empty; choose from {', '.join(CORPORA)}")
    out = []
    for name in names:
        for i, doc in enumerate(corpus_documents(name)):
            if document_split(doc) == split:
                out.append((f"{name}:{i}", doc))
    return out


def _take(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of a ``seed``-shuffled copy (all of them when n is larger)."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:n]


@register_task("english_text", splits=SPLITS,
               domains={"chunk_words": COUNT, "min_words": COUNT})
def english_text(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    corpora: Sequence[str] | str = CORPORA,
    chunk_words: int = 192,
    min_words: int = 16,
) -> list[dict[str, Any]]:
    """``{"text": chunk, "doc_id": ...}`` rows: the split's documents in ``chunk_words``-word
    chunks (a last chunk shorter than ``min_words`` is dropped); at most ``n``, seed-shuffled.

    Example: ``generate_task("english_text", n=10**6, split="train")`` is every training chunk
    of both corpora (2348 chunks of up to 192 words).
    """
    rows = []
    for doc_id, text in split_documents(corpora, split):
        words = text.split()
        for start in range(0, len(words), chunk_words):
            chunk = words[start : start + chunk_words]
            if len(chunk) >= min_words:
                rows.append({"text": " ".join(chunk), "doc_id": doc_id})
    if not rows:
        raise ValueError(f"no {split} chunk of at least {min_words} words in {corpora}")
    return _take(rows, n, seed)


@register_task("english_continuation", splits=SPLITS, eval_kind="text",
               domains={"prefix_words": COUNT, "continuation_words": COUNT,
                        "max_per_document": COUNT.or_(None)})
def english_continuation(
    n: int,
    *,
    split: str = "test",
    seed: int = 0,
    corpora: Sequence[str] | str = CORPORA,
    prefix_words: int = 12,
    continuation_words: int = 48,
    max_per_document: int | None = None,
) -> list[dict[str, Any]]:
    """Prefix / reference-continuation rows for open-ended generation (EMO Table 4 style).

    Each document of the split gives non-overlapping windows of ``prefix_words`` +
    ``continuation_words`` words (at most ``max_per_document`` of them, from its start): the
    prompt is the prefix, the completion a space plus the continuation (so BPE tokenizers see
    the word boundary as in running text). Lengths are in whitespace words. At most ``n`` rows,
    seed-shuffled; each keeps its ``doc_id``.
    """
    width = prefix_words + continuation_words
    rows = []
    for doc_id, text in split_documents(corpora, split):
        words = text.split()
        starts = range(0, len(words) - width + 1, width)
        for k, start in enumerate(starts):
            if max_per_document is not None and k >= max_per_document:
                break
            rows.append(
                {
                    "prompt": " ".join(words[start : start + prefix_words]),
                    "completion": " " + " ".join(words[start + prefix_words : start + width]),
                    "doc_id": doc_id,
                }
            )
    if not rows:
        raise ValueError(f"no {split} document in {corpora} has {width} words")
    return _take(rows, n, seed)


# ------------------------------------------------------------------------------ choice: polarity
@lru_cache(maxsize=1)
def polarity_sentences() -> tuple[tuple[str, int], ...]:
    """(sentence, label) pairs of ``pang_lee_polarity.cor``; label 1 = positive, 0 = negative."""
    out = []
    path = gensim_data_dir() / POLARITY_FILE
    # the file is Windows-1252 (0x97 is an em dash), not UTF-8
    for i, line in enumerate(path.read_text(encoding="cp1252", errors="replace").splitlines()):
        tag, _, sentence = line.strip().partition(" ")
        if tag not in ("__label__pos", "__label__neg") or not sentence.strip():
            raise ValueError(f"{path}:{i + 1}: expected '__label__pos|neg <sentence>'")
        out.append((" ".join(sentence.split()), int(tag == "__label__pos")))
    return tuple(out)


def format_demonstrations(demos: Sequence[tuple[str, int]], labels: Sequence[str]) -> str:
    """In-context examples, each the filled template with its gold label, one per line."""
    return "".join(RT_TEMPLATE.format(text=t, label=labels[y]) + "\n" for t, y in demos)


@register_task("polarity_choice", splits=SPLITS, eval_kind="choice",
               domains={"shots": NONNEGATIVE_COUNT})
def polarity_choice(
    n: int,
    *,
    split: str = "test",
    seed: int = 0,
    shots: int = 0,
) -> list[dict[str, Any]]:
    """Pang & Lee polarity sentences as 2-way choice examples (``emdlm eval --kind choice``).

    Each row: ``prompt`` = the k-shot demonstrations followed by ``"Review: <sentence> It is"``,
    ``choices`` = ``[" negative", " positive"]``, ``label`` = index of the gold choice,
    ``completion`` = the gold choice (so the rows also train). The ``shots`` demonstrations are
    one fixed set for all rows, drawn from the train split with ``seed`` (OpenICL-style fixed
    retrieval; the EMO repository used 8 TopK-retrieved examples), balanced between the labels
    where ``shots`` is even (the extra one of an odd ``shots`` goes to a seeded label). Sentences
    are split by text hash, 20 / 10 / 70 % (the train split only supplies demonstrations).
    """
    by_split: dict[str, list[tuple[str, int]]] = {s: [] for s in SPLITS}
    for sentence, label in polarity_sentences():
        by_split[document_split(sentence, POLARITY_SPLIT_FRACTIONS)].append((sentence, label))
    rng = random.Random(seed)
    pools = [[ex for ex in by_split["train"] if ex[1] == y] for y in (0, 1)]
    if shots > len(by_split["train"]):
        raise ValueError(f"shots={shots} exceeds the {len(by_split['train'])} train sentences")
    odd_label = rng.randrange(2)  # the label that gets the extra demonstration when k is odd
    per_label = [shots // 2 + (shots % 2 if y == odd_label else 0) for y in (0, 1)]
    for y in (0, 1):
        if per_label[y] > len(pools[y]):
            raise ValueError(f"shots={shots} needs {per_label[y]} train sentences of label {y}")
    demos = [ex for y in (0, 1) for ex in rng.sample(pools[y], per_label[y])]
    rng.shuffle(demos)
    context = format_demonstrations(demos, RT_LABELS)
    stem = RT_TEMPLATE.split(" {label}")[0]
    rows = [
        {
            "prompt": context + stem.format(text=sentence),
            "completion": " " + RT_LABELS[label],
            "choices": [" " + name for name in RT_LABELS],
            "label": label,
        }
        for sentence, label in by_split[split]
        if split != "train" or (sentence, label) not in demos
    ]
    return _take(rows, n, seed)
