"""Minimum-Bayes-risk decoding (emdlm.decoding): the pick of hand-made sample sets by each kind's
distance, its tie and parse rules, one vectorised generate call per batch, and `emdlm eval
--decode mbr` writing the decoding settings to metrics.json."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from emdlm.config import ConfigError, build_config
from emdlm.decoding import MBR_DISTANCES, mbr_decode, mbr_distance, mbr_select
from emdlm.eval_kinds import EVAL_KIND_SPECS
from emdlm.evaluation import evaluate_examples
from emdlm.generation import generate_answers


def test_the_distances_cover_exactly_the_short_answer_kinds() -> None:
    assert set(MBR_DISTANCES) == {n for n, s in EVAL_KIND_SPECS.items() if s.short_answer}
    for name, spec in EVAL_KIND_SPECS.items():
        if not spec.short_answer:
            with pytest.raises(ValueError, match=f"kind '{name}' has none"):
                mbr_distance(name)
    with pytest.raises(ValueError, match="unknown task kind"):
        mbr_distance("numbers")


# ----------------------------------------------------------------------------- hand-made sets
def test_number_pick_is_the_sample_median_not_the_greedy_or_majority_answer() -> None:
    # greedy (say) and the majority vote both answer 100; the median of the samples is 10.
    # risks sum_j |c_i - c_j|: 100 -> 273, 8 -> 187, 9 -> 184, 10 -> 183
    samples = ["100", "8", "9", "10", "100"]
    choice = mbr_select(samples, "number")
    assert samples[choice.index] == "10"
    assert choice.risk == 183.0 and choice.n_parsed == 5


def test_number_values_compare_exactly_and_keep_the_first_spelling() -> None:
    big = "123456789012345678901234567890"  # beyond float precision: +1 must still count
    samples = [big[:-1] + "1", big, big, big[:-1] + "5"]
    assert mbr_select(samples, "number").index == 1
    # "3.0" and "3" are one value sampled twice: its first spelling is returned
    choice = mbr_select(["7", "3.0", "3", "1"], "number")
    assert choice.index == 1 and choice.risk == 6.0


def test_ties_go_to_the_most_sampled_value_then_the_earliest_sample() -> None:
    # even count: 2 and 3 both have risk 4 and one sample each -> the earlier one
    assert mbr_select(["1", "2", "3", "4"], "number").index == 1
    assert mbr_select(["1", "3", "2", "4"], "number").index == 1  # now 3 comes first
    # clock minutes [180, 0, 360, 360]: risk(360) = 360+0+0+180... = 540 = risk(180) = 3*180;
    # 6_00 was sampled twice, 3_00 once -> 6_00 although 3_00 came first
    samples = ["3_00", "12_00", "6_00", "6_00"]
    choice = mbr_select(samples, "clock")
    assert choice.index == 2 and choice.risk == 540.0


def test_a_sample_beyond_float_range_keeps_an_exact_pick_and_an_infinite_risk() -> None:
    # "9e999" is a legal sample (six characters); its distances to the others overflow a float.
    choice = mbr_select(["9e999", "3", "4", "9e999", "5"], "number")
    assert choice.index == 4  # "5": the median of 3, 4, 5, 9e999, 9e999, found on exact values
    assert choice.risk == float("inf")
    assert choice.n_parsed == 5


def test_clock_distance_is_cyclic_on_the_dial() -> None:
    # 11_50 and 0_10 are 20 minutes apart across 12, not 700: risk(11_50) = 20 + 350 = 370 =
    # risk(0_10), risk(6_00) = 350 + 350 = 700. A linear median would answer 6_00.
    samples = ["6_00", "11_50", "0_10"]
    choice = mbr_select(samples, "clock")
    assert samples[choice.index] == "11_50" and choice.risk == 370.0


def test_box_distance_is_one_minus_iou() -> None:
    a, b, far = "[0, 0, 10, 10]", "[1, 1, 11, 11]", "[50, 50, 60, 60]"
    # IoU(a, b) = 81 / 119. risk(a) = 1 + 38/119 + 0 = 1.319; risk(b) = 1 + 2*38/119 = 1.639;
    # risk(far) = 3
    choice = mbr_select([far, a, b, a], "box")
    assert choice.index == 1
    assert choice.risk == pytest.approx(1 + 38 / 119)


def test_boxes_distance_is_one_minus_matching_f1() -> None:
    two, one = "[0,0,10,10]; [20,20,30,30]", "[0,0,10,10]"
    # d(two, one) = 1 - 2*1/3 = 1/3, d(x, none) = 1 unless both are empty.
    # risk(none) = 3, risk(two) = 1 + 1/3 = 4/3, risk(one) = 1 + 2/3 = 5/3
    choice = mbr_select(["none", two, one, two], "boxes")
    assert choice.index == 1 and choice.risk == pytest.approx(4 / 3)
    assert mbr_select(["none", "none", one], "boxes").index == 0  # two empty answers agree


def test_math_takes_the_majority_of_the_normalized_answers() -> None:
    assert mbr_select(["A", "B.", "b", "A ", "B"], "math").index == 1  # "B." "b" "B": 3 votes


def test_unparsable_candidates_are_left_out_and_never_chosen() -> None:
    samples = ["abc", "5", "x", "7", "6"]  # median of 5, 7, 6 is 6
    choice = mbr_select(samples, "number")
    assert choice.index == 4 and choice.n_parsed == 3 and choice.risk == 2.0
    assert mbr_select(["x", "x", "x", "5"], "number").index == 3  # the only one that parses


def test_when_none_parses_the_most_frequent_text_is_answered() -> None:
    choice = mbr_select(["x", "y ", "y", "z", "z"], "number")
    assert choice.index == 1 and choice.n_parsed == 0 and choice.risk is None
    assert mbr_select(["q", "r"], "clock").index == 0  # a tie: the earliest


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one candidate"):
        mbr_select([], "number")


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("eval_cfg", "message"),
    [
        ({"decode": "beam"}, "eval.decode"),
        ({"decode": "mbr", "kind": "text"}, "eval.kind=text has none"),
        ({"decode": "mbr", "kind": "choice"}, "eval.kind=choice has none"),
        ({"decode": "mbr", "mbr_samples": 0}, "eval.mbr_samples must be an integer >= 1"),
        ({"decode": "mbr", "temperature": 0.0}, "eval.temperature must be > 0"),
    ],
)
def test_bad_decode_settings_are_refused_with_the_config(
    eval_cfg: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config({"eval": eval_cfg})


def test_decode_defaults() -> None:
    e = build_config({}).eval
    assert (e.decode, e.mbr_samples, e.temperature) == ("greedy", 16, 1.0)


# ----------------------------------------------------------------------------- with a model
CHARS = list("0123456789+-=_ \n")


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1}
    vocab.update({c: i + 2 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model(vocab_size: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                        eos_token_id=1, pad_token_id=0, initializer_range=0.5)
    return GPT2LMHeadModel(config).eval()


def test_samples_come_from_one_generate_call_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _tokenizer()
    model = _model(len(tok))
    calls: list[tuple[int, int]] = []
    real = model.generate

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs["input_ids"].shape[0],
                      kwargs["generation_config"].num_return_sequences))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", counting)
    prompts = [f"{i}+1=" for i in range(5)]
    out = mbr_decode(model, tok, prompts, kind="number", samples=4, max_new_tokens=3,
                     batch_size=8, seed=3)
    assert calls == [(2, 4), (2, 4), (1, 4)]  # batch_size 8 sequences = 2 prompts x 4 samples
    assert [len(g) for g in out.samples] == [4] * 5
    for answer, group in zip(out.answers, out.samples, strict=True):
        assert group[mbr_select([g.strip() for g in group], "number").index] == answer
    with pytest.raises(ValueError, match="num_return_sequences must be 1 for greedy"):
        generate_answers(model, tok, prompts, do_sample=False, num_return_sequences=2)


def test_evaluate_examples_records_the_decoding() -> None:
    tok = _tokenizer()
    model = _model(len(tok))
    examples = [{"prompt": f"{i}+1=", "completion": f"{i + 1}\n"} for i in range(3)]
    metrics, rows = evaluate_examples(model, tok, examples, kind="number", max_new_tokens=3,
                                      decode="mbr", mbr_samples=5, temperature=0.7, seed=1)
    assert metrics["decode"] == "mbr" and metrics["mbr_samples"] == 5
    assert metrics["mbr_temperature"] == 0.7 and metrics["mbr_top_p"] == 1.0
    assert metrics["mbr_distance"] == "absolute difference"
    assert 0.0 <= metrics["mbr_parsed_share"] <= 1.0
    assert all(len(r["samples"]) == 5 for r in rows)
    greedy, _ = evaluate_examples(model, tok, examples, kind="number", max_new_tokens=3)
    assert greedy["decode"] == "greedy" and "mbr_samples" not in greedy
    with pytest.raises(ValueError, match="kind 'text' has none"):
        evaluate_examples(model, tok, examples, kind="text", decode="mbr")


@pytest.mark.slow
def test_emdlm_eval_decode_mbr_end_to_end(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from emdlm.cli import app

    runner = CliRunner()
    out = tmp_path / "run"
    tiny = ["model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32",
            "data.eval.n=8", "train.max_steps=2", "train.batch_size=8",
            "train.progress_bar=false", "train.tensorboard=false"]
    result = runner.invoke(app, ["train", "-c", "arithmetic_ce", *tiny, "--output", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["eval", str(out), "--n", "6", "--decode", "mbr",
                                 "eval.mbr_samples=4", "eval.max_new_tokens=4",
                                 "eval.temperature=0.8"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert (metrics["decode"], metrics["mbr_samples"], metrics["mbr_temperature"]) == (
        "mbr", 4, 0.8)
    rows = [json.loads(x) for x in (out / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["samples"]) == 4 for r in rows)
    result = runner.invoke(app, ["eval", str(out), "--n", "6", "--decode", "mbr",
                                 "--kind", "text", "--out", str(tmp_path / "t")])
    assert result.exit_code == 2 and "eval.decode=mbr needs a generated short answer" in (
        result.output)
    assert not (tmp_path / "t").exists()


def test_image_text_models_refuse_mbr_before_loading_anything(tmp_path: Any) -> None:
    from emdlm.training.image_text import evaluate_vlm

    cfg = build_config({"eval": {"decode": "mbr", "kind": "clock"},
                        "data": {"eval": {"task": "clock", "n": 2}}})
    with pytest.raises(ConfigError, match=r"eval\.decode=mbr is not implemented for image-text"):
        evaluate_vlm(tmp_path / "no_model_here", "qwen2_vl", cfg)
