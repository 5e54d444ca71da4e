"""EMO's text protocol: offline English corpora split by document, unbiased sampling, and the
text metrics (MAUVE settings, PPL_test, PPL_oracle, ROUGE, distinct-n, repetition)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from emdlm.evaluation import evaluate_text
from emdlm.generation import generate_answers
from emdlm.metrics import (
    distinct_n,
    diversity_metrics,
    repeated_ngram_share,
    repetition_rate,
)
from emdlm.tasks import generate_task
from emdlm.tasks.text_corpora import CORPORA, corpus_documents, split_documents
from emdlm.tokenizers import load_tokenizer

# ------------------------------------------------------------------------------------ corpora


@pytest.mark.parametrize("corpus", CORPORA)
def test_documents_fall_in_exactly_one_split(corpus: str) -> None:
    docs = corpus_documents(corpus)
    ids = {s: {i for i, _ in split_documents(corpus, s)} for s in ("train", "dev", "test")}
    assert not ids["train"] & ids["dev"] and not ids["train"] & ids["test"]
    assert not ids["dev"] & ids["test"]
    assert len(ids["train"]) + len(ids["dev"]) + len(ids["test"]) == len(docs)
    # identical texts share a split, so no held-out document has a copy in train
    train_texts = {t for _, t in split_documents(corpus, "train")}
    for split in ("dev", "test"):
        assert all(t not in train_texts for _, t in split_documents(corpus, split))
    assert len(ids["dev"]) > 0 and len(ids["test"]) > 0


def test_wiki_text_is_prose_without_markup() -> None:
    docs = corpus_documents("wiki")
    assert len(docs) > 100 and sum(len(d.split()) for d in docs) > 400_000
    sample = " ".join(docs[:5])
    assert "'''" not in sample and "==" not in sample and "\n" not in sample
    assert " the " in sample and "." in sample  # stop words and punctuation kept (not stemmed)


def test_rows_come_only_from_their_split_and_ignore_the_seed() -> None:
    test_ids = {i for i, _ in split_documents(CORPORA, "test")}
    train_rows = generate_task("english_text", n=10**6, split="train", seed=0)
    assert {r["doc_id"] for r in train_rows}.isdisjoint(test_ids)
    again = generate_task("english_text", n=10**6, split="train", seed=7)
    assert sorted(r["text"] for r in again) == sorted(r["text"] for r in train_rows)
    cont = generate_task("english_continuation", n=10**6, split="test", seed=3)
    assert {r["doc_id"] for r in cont} <= test_ids
    first = generate_task("english_continuation", n=5, split="test", seed=3)
    assert first == generate_task("english_continuation", n=5, split="test", seed=3)


def test_continuation_windows_have_the_asked_word_lengths() -> None:
    rows = generate_task(
        "english_continuation", n=50, split="dev", corpora="news",
        prefix_words=5, continuation_words=25,
    )  # fmt: skip
    docs = dict(split_documents("news", "dev"))
    for r in rows:
        assert len(r["prompt"].split()) == 5
        assert r["completion"].startswith(" ") and len(r["completion"].split()) == 25
        assert (r["prompt"] + r["completion"]) in docs[r["doc_id"]]  # a contiguous window


def test_text_chunks_cover_their_documents_in_order() -> None:
    rows = generate_task("english_text", n=10**6, split="test", corpora="news", chunk_words=50,
                         min_words=1)
    docs = dict(split_documents("news", "test"))
    for doc_id, text in docs.items():
        chunks = [r["text"] for r in rows if r["doc_id"] == doc_id]
        assert sorted(" ".join(chunks).split()) == sorted(text.split())
        assert all(len(c.split()) <= 50 for c in chunks)


def test_dev_split_is_refused_by_tasks_without_one() -> None:
    with pytest.raises(ValueError, match="has splits train, test"):
        generate_task("math_arithmetic", n=3, split="dev")
    with pytest.raises(ValueError, match="needs dev_fraction > 0"):
        generate_task("arithmetic", n=3, split="dev")  # has a dev split, but only when asked
    with pytest.raises(ValueError, match="unknown corpus 'books'"):
        generate_task("english_text", n=3, corpora="books")
    with pytest.raises(ValueError, match="prefix_words must be an integer >= 1, got 0"):
        generate_task("english_continuation", n=3, prefix_words=0)


# ------------------------------------------------------------------------ diversity metrics


def test_distinct_n_and_repetition_hand_worked() -> None:
    texts = ["a b a b", "c"]
    assert distinct_n(texts, 1) == pytest.approx(3 / 5)  # a b c of a b a b c
    assert distinct_n(texts, 2) == pytest.approx(2 / 3)  # ab ba of ab ba ab ("c" has none)
    assert math.isnan(distinct_n(texts, 5))
    assert repetition_rate(["a b a b"], 1) == pytest.approx(0.5)
    assert repetition_rate(["a b a b"], 2) == pytest.approx(1 / 3)
    assert repetition_rate(["a b a b", "x y z"], 2) == pytest.approx((1 / 3 + 0) / 2)
    assert repeated_ngram_share(["a b c d a b c d", "a b c d e", "a"], 4) == pytest.approx(1 / 3)
    out = diversity_metrics(["the cat sat the cat sat"])
    assert out["distinct_1"] == pytest.approx(3 / 6)
    assert out["rep_3"] == pytest.approx(1 - 3 / 4)  # tcs cst stc tcs
    assert out["rep_4"] == pytest.approx(0.0) and out["repeated_4gram_share"] == 0.0
    with pytest.raises(ValueError, match="n-gram order"):
        distinct_n(texts, 0)


# ------------------------------------------------------------------------------- sampling


def _tiny_model(vocab_size: int, seed: int, init: float = 0.02) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("char")  # 89 tokens: more than transformers' default top_k of 50


class _Spy:
    """Wraps ``model.generate``: records the generation config and the returned ids."""

    def __init__(self, model: Any) -> None:
        self.inner = model.generate
        self.configs: list[Any] = []
        self.outputs: list[torch.Tensor] = []
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.configs.append(kwargs.get("generation_config"))
        out = self.inner(*args, **kwargs)
        self.outputs.append(out)
        return out


def test_first_sampled_token_follows_the_softmax(tok: Any) -> None:
    """Ancestral sampling: the first token's empirical frequencies match softmax(logits) in
    rank bins (top-1, 2-10, 11-50, 51+). Top-k 50 would empty the last bin; a temperature or
    top-p would move mass between bins."""
    model = _tiny_model(len(tok), seed=0, init=0.15)  # uneven, with a tail past rank 50
    prompt = "the cat"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0, -1].double(), -1)  # [V]
    spy = _Spy(model)
    n = 3000
    generate_answers(model, tok, [prompt] * n, max_new_tokens=1, batch_size=n,
                     do_sample=True, seed=1, stop_at=())  # fmt: skip
    first = spy.outputs[0][:, ids.shape[1]]  # [n]
    counts = torch.bincount(first, minlength=len(tok)).double() / n
    order = torch.argsort(probs, descending=True)
    for lo, hi in ((0, 1), (1, 10), (10, 50), (50, len(tok))):
        p = float(probs[order[lo:hi]].sum())
        f = float(counts[order[lo:hi]].sum())
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (lo, hi, p, f)
    assert float(probs[order[50:]].sum()) > 0.05  # the test can see a top-k of 50
    config = spy.configs[0]
    assert config.do_sample and config.temperature == 1.0 and config.top_p == 1.0
    assert config.top_k in (0, None)


# ------------------------------------------------------------------------- text evaluation


def _hash_featurizer(texts: list[str]) -> np.ndarray:
    """Deterministic stand-in for MiniLM: 8 features from a hash of each text."""
    rows = [np.frombuffer(hashlib.sha256(t.encode()).digest()[:8], np.uint8) for t in texts]
    return np.stack(rows).astype(np.float32) / 255.0


def _direct_ppl(model: Any, tok: Any, pairs: list[tuple[str, str]]) -> float:
    """exp(mean NLL) of completion tokens given prompts, one unpadded sequence at a time."""
    total, count = 0.0, 0
    for prompt, completion in pairs:
        p_ids = tok(prompt)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [L, V]
        for j in range(len(p_ids), len(p_ids) + len(c_ids)):
            total -= float(logp[j - 1, ids[0, j]])
            count += 1
    return math.exp(total / count)


def test_evaluate_text_metrics_and_ppl_oracle(tok: Any) -> None:
    model = _tiny_model(len(tok), seed=0, init=0.3)
    oracle = _tiny_model(len(tok), seed=1, init=0.3)
    examples = [
        {"prompt": "the cat", "completion": " sat on the mat"},
        {"prompt": "a dog", "completion": " ran in the park"},
        {"prompt": "one", "completion": " two three four"},
    ]
    metrics, rows = evaluate_text(
        model, tok, examples, num_samples=3, max_new_tokens=6, seed=0,
        oracle=(oracle, tok), featurizer=_hash_featurizer,
    )  # fmt: skip
    expected = {
        "mauve", "mauve_num_buckets", "mauve_seed", "mauve_scaling_factor",
        "mauve_kmeans_num_redo", "mauve_kmeans_max_iter", "mauve_features", "ppl_test",
        "ppl_oracle", "rouge1", "rougeL", "distinct_1", "distinct_2", "distinct_3", "rep_1",
        "rep_2", "rep_3", "rep_4", "repeated_4gram_share", "gen_words_mean", "empty_rate",
        "num_samples", "temperature", "top_p", "top_k", "max_new_tokens", "n_prompts",
        "n_samples", "mauve_mode", "mauve_runs", "mauve_run_std", "mauve_run_min",
        "mauve_run_max",
    }  # fmt: skip
    assert set(metrics) == expected
    assert 0.0 < metrics["mauve"] <= 1.0 and metrics["mauve_num_buckets"] == 2
    assert metrics["mauve_scaling_factor"] == 5.0 and metrics["top_k"] == 0
    assert metrics["n_samples"] == 9 and len(rows) == 3
    assert all(len(r["samples"]) == 3 for r in rows)
    pairs = [(r["prompt"], s) for r in rows for s in r["samples"]]
    assert metrics["ppl_oracle"] == pytest.approx(_direct_ppl(oracle, tok, pairs), rel=1e-5)
    refs = [(e["prompt"], e["completion"]) for e in examples]
    assert metrics["ppl_test"] == pytest.approx(_direct_ppl(model, tok, refs), rel=1e-5)
    samples = [s.strip() for r in rows for s in r["samples"]]
    assert metrics["distinct_2"] == pytest.approx(distinct_n(samples, 2), nan_ok=True)


def test_mauve_is_the_mean_over_sampling_runs_as_in_the_paper(tok: Any) -> None:
    """Default: run j is the j-th sample of every prompt, one MAUVE per run, and ``mauve`` is
    their mean (EMO paper Sec. 4.1); "pooled" is one MAUVE of all samples against the
    references. Both checked against mauve_score on the rows' own samples."""
    from emdlm.metrics import mauve_score

    model = _tiny_model(len(tok), seed=0, init=0.3)
    examples = [{"prompt": p, "completion": c} for p, c in (
        ("the cat", " sat on the mat"), ("a dog", " ran in the park"), ("one", " two three"),
        ("the sun", " rose over hills"), ("we went", " home late"),
    )]  # fmt: skip
    refs = [e["completion"].strip() for e in examples]
    kw = dict(num_samples=3, max_new_tokens=5, seed=0, featurizer=_hash_featurizer)
    mean, rows = evaluate_text(model, tok, examples, **kw)
    runs = [[r["samples"][j].strip() for r in rows] for j in range(3)]
    direct = [mauve_score(run, refs, featurizer=_hash_featurizer) for run in runs]
    assert mean["mauve_mode"] == "mean"
    assert mean["mauve_runs"] == pytest.approx(direct)
    assert mean["mauve"] == pytest.approx(float(np.mean(direct)))
    assert mean["mauve_run_std"] == pytest.approx(float(np.std(direct, ddof=1)))
    assert (mean["mauve_run_min"], mean["mauve_run_max"]) == (min(direct), max(direct))
    pooled, rows2 = evaluate_text(model, tok, examples, mauve_mode="pooled", **kw)
    assert rows2 == rows  # the same samples: only the scoring differs
    every = [s.strip() for r in rows for s in r["samples"]]
    assert pooled["mauve"] == pytest.approx(mauve_score(every, refs, featurizer=_hash_featurizer))
    assert pooled["mauve_mode"] == "pooled" and "mauve_runs" not in pooled
    with pytest.raises(ValueError, match="mauve_mode must be one of mean, pooled"):
        evaluate_text(model, tok, examples, mauve_mode="average", **kw)


def test_mauve_that_cannot_rank_models_is_flagged() -> None:
    from emdlm.config import ConfigError, load_config
    from emdlm.metrics import mauve_problem

    assert "saturated" in mauve_problem(0.99, 4) and "4 k-means buckets" in mauve_problem(0.99, 4)
    assert "floor" in mauve_problem(0.004, 4)
    assert mauve_problem(0.5, 4) is None
    with pytest.raises(ConfigError, match=r"eval\.mauve_mode='average' is not valid"):
        load_config("text_emo", ["eval.mauve_mode=average"])


def test_evaluate_text_rejects_a_single_prompt_for_mauve(tok: Any) -> None:
    model = _tiny_model(len(tok), seed=0)
    with pytest.raises(ValueError, match="MAUVE needs at least 2 prompts"):
        evaluate_text(model, tok, [{"prompt": "a", "completion": " b"}], max_new_tokens=2)
    metrics, _ = evaluate_text(
        model, tok, [{"prompt": "a", "completion": " b"}], max_new_tokens=2, mauve=False
    )
    assert "mauve" not in metrics and math.isfinite(metrics["ppl_test"])


# ------------------------------------------------------- the pre-training config, end to end


def test_pretrain_config_trains_and_evaluates(tmp_path: Path) -> None:
    """The packaged pre-training config for 2 steps on a slice, then `emdlm eval` with text
    sampling, PPL_oracle (the model itself as oracle) and no MAUVE (no MiniLM load)."""
    from emdlm.config import load_config
    from emdlm.training import run_training
    from emdlm.training.evaluate import evaluate_run, resolve_eval_config

    out = tmp_path / "pre"
    cfg = load_config("pretrain_gpt2_english", [
        "model.params.n_layer=1", "model.params.n_embd=32", "model.params.n_head=2",
        "data.train.limit=8", "data.eval.n=4", "data.eval.params.prefix_words=4",
        "data.eval.params.continuation_words=8", "data.max_length=64", "train.batch_size=4",
        "train.max_steps=2", "train.eval_steps=2", "train.progress_bar=false",
        "train.tensorboard=false", f"output_dir={out}",
    ])  # fmt: skip
    summary = run_training(cfg)
    assert summary["global_step"] == 2 and (out / "config.json").is_file()
    eval_cfg = resolve_eval_config(out, None, [
        "eval.num_samples=2", "eval.max_new_tokens=4", "eval.mauve=false", f"eval.oracle={out}",
    ])  # fmt: skip
    result = evaluate_run(out, eval_cfg)
    written = json.loads((Path(result["out_dir"]) / "metrics.json").read_text())
    assert written["n_prompts"] == 4 and written["n_samples"] == 8
    assert written["oracle"] == str(out) and written["ppl_oracle"] > 1.0
    assert written["ppl_test"] > 1.0 and "distinct_1" in written


def test_finetune_config_starts_from_the_pretrained_folder(tmp_path: Path) -> None:
    """finetune_news_emo for 2 steps from a (tiny, random) pre-trained folder: EMO's cost
    embedding is the folder's LM head."""
    from emdlm.config import load_config
    from emdlm.training import run_training

    quick = ["train.progress_bar=false", "train.tensorboard=false", "train.max_steps=2",
             "train.batch_size=2", "data.train.limit=4", "data.max_length=64"]
    base = tmp_path / "base"
    run_training(load_config("pretrain_gpt2_english", [
        *quick, "model.params.n_layer=1", "model.params.n_embd=32", "model.params.n_head=2",
        "data.eval=null", f"output_dir={base}",
    ]))  # fmt: skip
    out = tmp_path / "news_emo"
    summary = run_training(load_config("finetune_news_emo", [
        *quick, f"model.name={base}", f"tokenizer={base}", "data.eval=null",
        f"output_dir={out}",
    ]))  # fmt: skip
    assert summary["global_step"] == 2 and summary["objective"] == "emo"
    assert math.isfinite(summary["train_loss"])


def test_a_run_whose_eval_cannot_generate_is_warned_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval prompt + eval.max_new_tokens beyond the model's positions (they follow
    data.max_length): said before the first step, not found after training by `emdlm eval`."""
    from emdlm.config import load_config
    from emdlm.training import run_training

    quick = ["model.params.n_layer=1", "model.params.n_embd=32", "model.params.n_head=2",
             "data.train.limit=4", "data.eval.n=4", "data.max_length=64", "train.max_steps=1",
             "train.progress_bar=false", "train.tensorboard=false"]
    run_training(load_config("pretrain_gpt2_english", [
        *quick, "eval.max_new_tokens=80", f"output_dir={tmp_path / 'a'}"]))
    err = capsys.readouterr().err
    assert "+ eval.max_new_tokens=80 exceeds the model's context length 64" in err
    assert err.index("exceeds the model's context") < err.index("world size")  # before training
    run_training(load_config("pretrain_gpt2_english", [
        *quick, "eval.max_new_tokens=40", f"output_dir={tmp_path / 'b'}"]))
    assert "exceeds the model's context" not in capsys.readouterr().err
