"""Generation, perplexity and reports with tiny GPT-2 models built from a config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from emdlm.eval_outputs import format_metrics_table, write_eval_outputs
from emdlm.evaluation import evaluate_examples
from emdlm.generation import generate_answers, sequence_nll, sequence_perplexity

CHARS = list("0123456789+-=_ \nabcdefghijklmnopqrstuvwxyz?.")


def char_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; ids 0 pad, 1 eos (and 2 bos when ``bos``)."""
    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({c: i + len(specials) for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    if bos:
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def tiny_gpt2(vocab_size: int, seed: int = 0, tie: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=48, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=tie,
        initializer_range=0.5,  # large random weights: outputs depend on the prompt
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def constant_model(tokenizer: PreTrainedTokenizerFast, token: str | None) -> GPT2LMHeadModel:
    """A model whose next-token distribution is the same everywhere: all mass on ``token``
    (logit margin 32) or, with ``token=None``, uniform over the vocabulary."""
    model = tiny_gpt2(len(tokenizer), tie=False)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()  # final hidden state = ln_f.bias, a constant
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        if token is not None:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 1.0
    return model


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    return tiny_gpt2(len(tok))


PROMPTS = ["1+2=", "123+456=", "7-8=", "99-100=", "5="]


# ------------------------------------------------------------------ generation


def test_generate_bounded_and_deterministic(model, tok) -> None:
    first = generate_answers(model, tok, PROMPTS, max_new_tokens=6, batch_size=4)
    second = generate_answers(model, tok, PROMPTS, max_new_tokens=6, batch_size=4)
    assert first == second
    assert len(first) == len(PROMPTS)
    for text in first:
        assert isinstance(text, str)
        assert len(text) <= 6  # char-level: one character per new token
        assert "\n" not in text


def test_left_padded_batches_equal_one_by_one(model, tok) -> None:
    batched = generate_answers(model, tok, PROMPTS, max_new_tokens=8, batch_size=5, stop_at=())
    single = [generate_answers(model, tok, [p], max_new_tokens=8, stop_at=())[0] for p in PROMPTS]
    assert batched == single
    # a random model does not answer every prompt the same way (the test could fail)
    assert len(set(batched)) > 1


def test_sampling_is_seeded(model, tok) -> None:
    kwargs = {"max_new_tokens": 8, "do_sample": True, "temperature": 2.0, "stop_at": ()}
    a = generate_answers(model, tok, PROMPTS, seed=1, **kwargs)
    b = generate_answers(model, tok, PROMPTS, seed=1, **kwargs)
    c = generate_answers(model, tok, PROMPTS, seed=2, **kwargs)
    assert a == b
    assert a != c


def test_only_new_tokens_and_stop_strings(tok) -> None:
    sevens = constant_model(tok, "7")
    assert generate_answers(sevens, tok, ["1+2=", "x"], max_new_tokens=4) == ["7777", "7777"]
    assert generate_answers(sevens, tok, ["1+2="], max_new_tokens=4, stop_at=("77",)) == [""]
    newline = constant_model(tok, "\n")
    assert generate_answers(newline, tok, ["1+2="], max_new_tokens=4) == [""]
    assert generate_answers(newline, tok, ["1+2="], max_new_tokens=3, stop_at=()) == ["\n\n\n"]
    eos = constant_model(tok, "<eos>")
    assert generate_answers(eos, tok, ["1+2="], max_new_tokens=4) == [""]


def test_generate_rejects_overlong_prompt(model, tok) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context length 48"):
        generate_answers(model, tok, ["1" * 40], max_new_tokens=16)


# ------------------------------------------------------------------ perplexity


def _reference_nll(model, tok, prompt: str, completion: str) -> tuple[float, int]:
    """Token-by-token log-likelihood of the completion, no batching or padding."""
    p_ids = tok(prompt)["input_ids"]
    c_ids = tok(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + c_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), -1)
    nll = -sum(float(logprobs[len(p_ids) + j - 1, c]) for j, c in enumerate(c_ids))
    return nll, len(c_ids)


def test_completion_nll_matches_reference(model, tok) -> None:
    pairs = [("1+2=", "3\n"), ("123+456=", "579\n"), ("7-8=", "-1")]
    ref = [_reference_nll(model, tok, p, c) for p, c in pairs]
    total, count = sequence_nll(model, tok, pairs, batch_size=3)  # right padding in one batch
    assert count == sum(n for _, n in ref) == 2 + 4 + 2
    assert total == pytest.approx(sum(v for v, _ in ref), rel=1e-5)
    single = sum(sequence_nll(model, tok, [pair], batch_size=1)[0] for pair in pairs)
    assert total == pytest.approx(single, rel=1e-5)


def test_plain_text_perplexity(model, tok) -> None:
    # plain texts: every token after the first is scored
    total, count = sequence_nll(model, tok, ["hello world", "abc"])
    assert count == 10 + 2
    ref = (
        _reference_nll(model, tok, "h", "ello world")[0] + _reference_nll(model, tok, "a", "bc")[0]
    )
    assert total == pytest.approx(ref, rel=1e-5)


def test_uniform_model_perplexity_is_vocab_size(tok) -> None:
    uniform = constant_model(tok, None)
    ppl = sequence_perplexity(uniform, tok, [("1+2=", "3"), ("5=", "five")])
    assert ppl == pytest.approx(len(tok), rel=1e-5)


def test_bos_tokenizer_scores_only_the_completion() -> None:
    tok = char_tokenizer(bos=True)
    assert tok("12")["input_ids"][0] == 2  # the BOS is added to the prompt only
    model = tiny_gpt2(len(tok))
    assert sequence_nll(model, tok, [("1+2=", "3")])[1] == 1


# ------------------------------------------------------------------ whole evaluation and reports


def test_evaluate_examples_hand_worked(tok, tmp_path: Path) -> None:
    sevens = constant_model(tok, "7")
    examples = [
        {"prompt": "1+2=", "completion": "7777\n"},  # exact
        {"prompt": "3+4=", "completion": "7770"},  # off by 7
        {"prompt": "9-9=", "completion": "0\nignored"},  # reference cut at the newline
    ]
    metrics, rows = evaluate_examples(sevens, tok, examples, kind="number", max_new_tokens=4)
    assert [r["prediction"] for r in rows] == ["7777"] * 3
    assert [r["reference"] for r in rows] == ["7777", "7770", "0"]
    assert [r["correct"] for r in rows] == [True, False, False]
    assert [r["abs_error"] for r in rows] == [0.0, 7.0, 7777.0]
    assert metrics["exact_match"] == pytest.approx(1 / 3)
    assert metrics["abs_error_mean"] == pytest.approx((0 + 7 + 7777) / 3)
    assert metrics["parse_failure_rate"] == 0.0
    # perplexity of the full completions, "7" scored with probability ~1, others ~e^-32
    assert metrics["perplexity"] > 1.0

    paths = write_eval_outputs(tmp_path / "eval", {**metrics, "bad": math.nan}, rows)
    saved = json.loads(paths["metrics"].read_text())
    assert saved["exact_match"] == pytest.approx(1 / 3) and saved["bad"] is None
    lines = paths["predictions"].read_text().splitlines()
    assert [json.loads(line)["reference"] for line in lines] == ["7777", "7770", "0"]


def test_evaluate_examples_clock_kind(tok) -> None:
    sevens = constant_model(tok, "7")
    metrics, rows = evaluate_examples(
        sevens, tok, [{"prompt": "a", "completion": "7_20"}], kind="clock", max_new_tokens=2,
        with_perplexity=False,
    )  # fmt: skip
    assert rows[0]["prediction"] == "77" and rows[0]["time_gap"] is None
    assert metrics["parse_failure_rate"] == 1.0 and "perplexity" not in metrics


def test_evaluate_examples_needs_prompt_and_completion(model, tok) -> None:
    with pytest.raises(KeyError, match="example 0 needs keys 'prompt' and 'completion'"):
        evaluate_examples(model, tok, [{"prompt": "1"}])


def test_format_metrics_table() -> None:
    table = format_metrics_table(
        {
            "ce": {"exact_match": 0.5, "abs_error_mean": 12.3456, "n": 100},
            "ntil": {"exact_match": 0.625, "abs_error_mean": math.nan, "mauve": 0.91},
        }
    )
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["metric", "ce", "ntil"]
    assert set(lines[1]) <= {"|", "-", ":"}  # Markdown separator row
    assert len({len(line) for line in lines}) == 1  # aligned columns
    body = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]
    }
    assert body["exact_match"] == ["0.5", "0.625"]
    assert body["abs_error_mean"] == ["12.35", "nan"]
    assert body["n"] == ["100", "-"]
    assert body["mauve"] == ["-", "0.91"]
    assert list(body) == ["exact_match", "abs_error_mean", "n", "mauve"]


def test_format_metrics_table_summarizes_lists_of_numbers() -> None:
    """mauve_runs (one MAUVE per sampling run) made the console table ~130 columns wide: the
    table shows mean ± std (min–max, n); the metrics dict keeps the list."""
    runs = [0.8512345678, 0.8612345678, 0.8712345678, 0.8812345678, 0.8943210987]
    metrics = {"mauve": 0.8718, "mauve_runs": runs, "mauve_mode": "mean"}
    table = format_metrics_table({"ce": metrics})
    row = next(line for line in table.splitlines() if line.startswith("| mauve_runs"))
    assert row.split("|")[2].strip() == "0.8719 ± 0.01682 (0.8512–0.8943, n=5)"
    assert max(len(line) for line in table.splitlines()) < 60
    assert metrics["mauve_runs"] == runs  # untouched
    one = format_metrics_table({"a": {"r": [2]}}).splitlines()[2]
    assert one.split("|")[2].strip() == "2 ± nan (2–2, n=1)"
    assert "[]" in format_metrics_table({"a": {"r": []}})  # not numbers: as before


# ------------------------------------------------------------------ LLaMA with a BPE tokenizer


def tiny_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in milliseconds on a few sentences (multi-character tokens)."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"what is {a} plus {b}? the answer is {a + b}.\n" for a in range(30) for b in range(9)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def test_llama_with_bpe_batches_equal_one_by_one() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_bpe_tokenizer()
    assert len(tok("what is 12 plus 3?")["input_ids"]) < len("what is 12 plus 3?")  # merges
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.5, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = ["what is 1 plus 2?", "what is 29 plus 8? the answer is", "what", "1"]
    batched = generate_answers(model, tok, prompts, max_new_tokens=5, stop_at=())
    single = [generate_answers(model, tok, [p], max_new_tokens=5, stop_at=())[0] for p in prompts]
    assert batched == single
    assert len(set(batched)) > 1
    pairs = [(p, " 3.") for p in prompts]
    total, count = sequence_nll(model, tok, pairs, batch_size=4)
    assert total == pytest.approx(sum(sequence_nll(model, tok, [q])[0] for q in pairs), rel=1e-5)
    assert count == len(prompts) * len(tok(" 3.", add_special_tokens=False)["input_ids"])


def test_checkpoint_generation_defaults_do_not_leak(tok) -> None:
    model = tiny_gpt2(len(tok))
    expected = generate_answers(model, tok, PROMPTS, max_new_tokens=8, stop_at=())
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.do_sample = True
    model.generation_config.max_new_tokens = 2
    assert generate_answers(model, tok, PROMPTS, max_new_tokens=8, stop_at=()) == expected
    assert model.generation_config.repetition_penalty == 50.0  # restored


def test_text_kind_keeps_multiline_references(tok) -> None:
    sevens = constant_model(tok, "7")
    examples = [{"prompt": "a", "completion": "77\n77"}]
    metrics, rows = evaluate_examples(
        sevens, tok, examples, kind="text", max_new_tokens=5, with_perplexity=False
    )
    assert rows[0]["reference"] == "77\n77" and rows[0]["prediction"] == "77777"
    assert set(metrics) == {"exact_match", "rouge1", "rougeL", "n", "decode"}


def test_add_eos_scores_the_end_of_the_completion(model, tok) -> None:
    _, n0 = sequence_nll(model, tok, [("1+2=", "3")])
    with_eos, n1 = sequence_nll(model, tok, [("1+2=", "3")], add_eos=True)
    assert n1 == n0 + 1
    ref = _reference_nll(model, tok, "1+2=", "3<eos>")
    assert ref[1] == 2 and with_eos == pytest.approx(ref[0], rel=1e-5)


def test_evaluate_examples_rejects_unknown_kind_before_generating(model, tok) -> None:
    with pytest.raises(ValueError, match="unknown task kind 'speech'"):
        evaluate_examples(model, tok, [{"prompt": "1", "completion": "2"}], kind="speech")
