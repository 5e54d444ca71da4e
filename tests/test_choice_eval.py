"""The `choice` eval kind: candidates scored by perplexity (OpenICL's PPL inferencer), k-shot
prompts for the Pang & Lee polarity task, accuracy beside the chance rate."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from emdlm.evaluation import evaluate_choice, score_choices
from emdlm.generation import sequence_nll
from emdlm.metrics import choice_metrics, compute_task_metrics
from emdlm.tasks import generate_task
from emdlm.tasks.text_corpora import RT_LABELS, document_split, polarity_sentences
from emdlm.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("char")


def _model_preferring(tok: Any, char: str) -> GPT2LMHeadModel:
    """A model whose next-token distribution puts most mass on ``char`` everywhere."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=1024, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()  # final hidden state = ln_f.bias, a constant
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids(char)] = 0.5  # logit margin 8
    return model


def test_the_lower_perplexity_candidate_is_picked(tok: Any) -> None:
    model = _model_preferring(tok, "x")
    examples = [
        {"prompt": "ab ", "choices": ["yy", "xx"], "label": 1},
        {"prompt": "ab ", "choices": ["xx", "yy", "zz"], "label": 1},
    ]
    metrics, rows = evaluate_choice(model, tok, examples)
    assert [r["prediction"] for r in rows] == [1, 0]
    assert [r["correct"] for r in rows] == [True, False]
    assert metrics["accuracy"] == 0.5
    assert metrics["chance_rate"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert metrics["scoring"] == "text"
    # scores are the mean NLL of the whole filled text (OpenICL convention)
    total, count = sequence_nll(model, tok, ["ab yy"])
    assert rows[0]["mean_nll"][0] == pytest.approx(total / count, rel=1e-6)
    # completion scoring: only the candidate's tokens, given the prompt
    only = score_choices(model, tok, examples[:1], scoring="completion")[0]
    total, count = sequence_nll(model, tok, [("ab ", "xx")])
    assert count == 2 and only[1] == pytest.approx(total / count, rel=1e-6)


def test_choice_examples_are_checked(tok: Any) -> None:
    model = _model_preferring(tok, "x")
    with pytest.raises(ValueError, match="label 2 not among 2 choices"):
        evaluate_choice(model, tok, [{"prompt": "a", "choices": ["b", "c"], "label": 2}])
    with pytest.raises(KeyError, match="lacks"):
        evaluate_choice(model, tok, [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match="scoring must be one of"):
        score_choices(model, tok, [], scoring="sum")


def test_choice_metrics_hand_worked() -> None:
    out = choice_metrics([0, 1, 1, 0], [0, 1, 0, 0], [2, 2, 2, 4])
    assert out == {"accuracy": 0.75, "chance_rate": pytest.approx((3 / 2 + 1 / 4) / 4),
                   "majority_rate": 0.75, "n": 4}
    assert math.isnan(choice_metrics([], [], [])["accuracy"])
    with pytest.raises(ValueError, match="gold index 3"):
        choice_metrics([0], [3], [2])
    assert compute_task_metrics([" a", " b"], [" a", " a"], "choice")["accuracy"] == 0.5


# --------------------------------------------------------------------------- polarity task


def test_k_shot_prompt_is_built_from_fixed_train_demonstrations() -> None:
    rows = generate_task("polarity_choice", n=1000, split="test", seed=0, shots=4)
    label_of = dict(polarity_sentences())
    context = rows[0]["prompt"].rsplit("\n", 1)[0] + "\n"
    demos = context.splitlines()
    assert len(demos) == 4
    demo_labels = []
    for line in demos:
        assert line.startswith("Review: ") and line.rsplit(" It is ", 1)[1] in RT_LABELS
        text, said = line[len("Review: ") :].rsplit(" It is ", 1)
        assert document_split(text, (0.2, 0.1, 0.7)) == "train"  # from the train split
        assert RT_LABELS[label_of[text]] == said  # each with its gold label
        demo_labels.append(said)
    assert sorted(demo_labels) == ["negative", "negative", "positive", "positive"]
    test_texts = set()
    for r in rows:
        assert r["prompt"].startswith(context)  # the same demonstrations for every row
        query = r["prompt"][len(context) :]
        assert query.startswith("Review: ") and query.endswith(" It is")
        text = query[len("Review: ") : -len(" It is")]
        assert r["choices"] == [" negative", " positive"] and r["label"] == label_of[text]
        assert r["completion"] == r["choices"][r["label"]]
        test_texts.add(text)
    assert not test_texts & {line[len("Review: ") :].rsplit(" It is ", 1)[0] for line in demos}
    other = generate_task("polarity_choice", n=1, split="test", seed=1, shots=4)[0]["prompt"]
    assert other.rsplit("\n", 1)[0] + "\n" != context  # a new seed draws new demonstrations
    zero = generate_task("polarity_choice", n=1000, split="test", seed=0, shots=0)
    assert all(r["prompt"].startswith("Review: ") and "\n" not in r["prompt"] for r in zero)
    assert len(zero) == len(rows) > 100


def test_too_many_shots_is_an_error() -> None:
    with pytest.raises(ValueError, match="shots=500"):
        generate_task("polarity_choice", n=5, shots=500)


def test_emdlm_eval_choice_end_to_end(tmp_path: Path, tok: Any) -> None:
    from emdlm.training.evaluate import evaluate_run, resolve_eval_config

    folder = tmp_path / "model"
    _model_preferring(tok, "p").save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = resolve_eval_config(folder, None, [
        "data.eval.task=polarity_choice", "data.eval.n=12", "data.eval.split=dev",
        "data.eval.params={shots: 1}", "eval.kind=choice",
    ])  # fmt: skip
    result = evaluate_run(folder, cfg)
    written = json.loads((Path(result["out_dir"]) / "metrics.json").read_text())
    # a model that prefers "p" everywhere says " positive" to every review
    rows = [json.loads(x) for x in (Path(result["out_dir"]) / "predictions.jsonl").open()]
    assert all(r["prediction"] == 1 for r in rows) and len(rows) == 12
    positives = sum(r["label"] for r in rows)
    assert written["accuracy"] == pytest.approx(positives / 12)
    assert written["chance_rate"] == 0.5 and written["n"] == 12
