"""Data plumbing: JSONL / datasets folders / tasks, completion-only labels, collator."""

from __future__ import annotations

import json

import pytest
import torch

from emdlm.config import ConfigError, DataSourceConfig
from emdlm.data import (
    IGNORE_INDEX,
    DataCollator,
    build_dataset,
    load_examples,
    read_jsonl,
    tokenize_example,
)
from emdlm.tasks import available_tasks, generate_task, register_task
from emdlm.tasks.arithmetic import problem_is_test
from emdlm.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("char")


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_reads_prompt_completion_and_text(tmp_path):
    p = _write(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "1+1=", "completion": "2"}),
        "",
        json.dumps({"text": "hello"}),
    ])
    rows = read_jsonl(p)
    assert rows == [{"prompt": "1+1=", "completion": "2"}, {"text": "hello"}]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"prompt": "1+1="}', "field 'completion' is missing"),
        ('{"completion": "2"}', "field 'prompt' is missing"),
        ('{"prompt": null, "completion": "2"}', "'prompt' must be a string, got NoneType"),
        ('{"question": "x"}', "needs 'prompt' and 'completion'"),
        ('{"prompt": "1+1=", "completion": 2}', "'completion' must be a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "1+1=", "completion": "2"}), "",
                                        bad_line])
    with pytest.raises(ConfigError, match=message) as err:
        read_jsonl(p)
    assert f"{p}:3:" in str(err.value)  # blank line 2 still counts


def test_missing_paths(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_examples(DataSourceConfig(path=str(tmp_path / "nope.jsonl")), seed=0)


def test_datasets_folder(tmp_path):
    import datasets

    ds = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4"}] * 3),
        "test": datasets.Dataset.from_list([{"prompt": "3+3=", "completion": "6"}]),
    })
    ds.save_to_disk(str(tmp_path / "ds"))
    rows = load_examples(DataSourceConfig(path=str(tmp_path / "ds"), split="test"), seed=0)
    assert rows == [{"prompt": "3+3=", "completion": "6"}]
    with pytest.raises(ConfigError, match="row 0"):
        datasets.Dataset.from_list([{"q": "x"}]).save_to_disk(str(tmp_path / "bad"))
        load_examples(DataSourceConfig(path=str(tmp_path / "bad")), seed=0)


def test_completion_only_labels(tok):
    item = tokenize_example({"prompt": "12+345=", "completion": "357"}, tok, max_length=64)
    ids, labels = item["input_ids"], item["labels"]
    assert tok.decode(ids[:7]) == "12+345="
    assert labels[:7] == [IGNORE_INDEX] * 7  # prompt not trained
    assert labels[7:] == ids[7:]  # completion + eos trained
    assert tok.decode(ids[7:10]) == "357" and ids[-1] == tok.eos_token_id
    text = tokenize_example({"text": "ab"}, tok, max_length=64)
    assert text["labels"] == text["input_ids"] and text["input_ids"][-1] == tok.eos_token_id


def test_truncation_drops_examples_without_targets(tok):
    assert tokenize_example({"prompt": "1234567", "completion": "8"}, tok, max_length=5) is None
    with pytest.raises(ConfigError, match="max_length"):
        build_dataset([{"prompt": "1234567", "completion": "8"}], tok, max_length=5)


def test_collator_pads_masks_and_passes_extra_tensors(tok):
    a = tokenize_example({"prompt": "1+1=", "completion": "2"}, tok, max_length=32)
    b = tokenize_example({"prompt": "10+10=", "completion": "20"}, tok, max_length=32)
    a["pixel_values"], b["pixel_values"] = torch.zeros(3, 2, 2), torch.ones(3, 2, 2)
    batch = DataCollator(tok.pad_token_id, pad_to_multiple_of=8)([a, b])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"][0].sum() == len(a["input_ids"])
    assert (batch["input_ids"][0, len(a["input_ids"]):] == tok.pad_token_id).all()
    assert (batch["labels"][:, 0] == IGNORE_INDEX).all()
    assert (batch["labels"][0, len(a["input_ids"]):] == IGNORE_INDEX).all()
    # counting labels with or without the causal shift gives the same token count
    assert (batch["labels"] != IGNORE_INDEX).sum() == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert batch["pixel_values"].shape == (2, 3, 2, 2)


def test_collator_refuses_a_tokenizer_without_pad_token_naming_the_fix():
    gpt2 = load_tokenizer("gpt2")  # GPT-2 has no pad token (the README's Trainer snippet)
    assert gpt2.pad_token_id is None
    with pytest.raises(ValueError, match=r"no pad_token_id.*tokenizer\.pad_token = tokenizer\."
                                         r"eos_token"):
        DataCollator(gpt2.pad_token_id)
    with pytest.raises(ValueError, match="integer token id"):
        DataCollator("0")
    gpt2.pad_token = gpt2.eos_token  # the fix the message names: now it pads
    item = tokenize_example({"prompt": "1+1=", "completion": "2"}, gpt2, max_length=32)
    short = tokenize_example({"prompt": "1=", "completion": "1"}, gpt2, max_length=32)
    batch = DataCollator(gpt2.pad_token_id)([item, short])
    assert batch["input_ids"][1, -1] == gpt2.eos_token_id


def test_arithmetic_task_is_seeded_correct_and_disjoint():
    train = generate_task("arithmetic", n=3000, seed=1, max_digits=3)
    again = generate_task("arithmetic", n=3000, seed=1, max_digits=3)
    other = generate_task("arithmetic", n=3000, seed=2, max_digits=3)
    test = generate_task("arithmetic", n=500, split="test", seed=1, max_digits=3)
    assert train == again and train != other
    for ex in train[:200] + test[:200]:
        assert ex["completion"] == str(eval(ex["prompt"][:-1]))  # only digits and +/-
    seen = {ex["prompt"] for ex in train + other}
    assert not any(ex["prompt"] in seen for ex in test)
    lengths = {len(p) for ex in train for p in ex["prompt"][:-1].replace("-", "+").split("+")}
    assert lengths == {1, 2, 3}
    no_neg = generate_task("arithmetic", n=500, seed=0, allow_negative=False)
    assert all(not ex["completion"].startswith("-") for ex in no_neg)


def test_arithmetic_dev_split_is_disjoint_and_leaves_old_splits_unchanged():
    kw = {"max_digits": 2, "dev_fraction": 0.2}
    train = generate_task("arithmetic", n=3000, seed=1, **kw)
    dev = generate_task("arithmetic", n=400, split="dev", seed=1, **kw)
    test = generate_task("arithmetic", n=400, split="test", seed=1, **kw)
    prompts = [{ex["prompt"] for ex in rows} for rows in (train, dev, test)]
    assert len(prompts[1]) > 100  # 2-digit space: the dev set has many distinct problems
    assert not prompts[0] & prompts[1] and not prompts[1] & prompts[2]
    assert not prompts[0] & prompts[2]
    assert all(ex["completion"] == str(eval(ex["prompt"][:-1])) for ex in dev)
    # the test split does not depend on dev_fraction; without it the train split is as before
    assert test == generate_task("arithmetic", n=400, split="test", seed=1, max_digits=2)
    plain = generate_task("arithmetic", n=3000, seed=1, max_digits=2)
    assert prompts[1] & {ex["prompt"] for ex in plain}  # dev problems are train problems then
    with pytest.raises(ValueError, match="dev_fraction > 0"):
        generate_task("arithmetic", n=5, split="dev")
    with pytest.raises(ValueError, match="dev_fraction must be in"):
        generate_task("arithmetic", n=5, dev_fraction=0.95)
    with pytest.raises(ValueError, match="has splits train, dev, test"):
        generate_task("arithmetic", n=5, split="valid")


def test_test_split_hash_is_seed_independent():
    import numpy as np

    a = np.arange(1000)
    flags = problem_is_test(a, np.zeros(1000, dtype=np.int64), a[::-1].copy(), 0.1)
    assert 50 < flags.sum() < 150  # about the asked fraction


def test_task_registry():
    assert {"arithmetic", "arithmetic__mixed"} <= set(available_tasks())
    with pytest.raises(ValueError, match="unknown task"):
        generate_task("nope", n=1)
    with pytest.raises(ValueError, match="bad parameters"):
        generate_task("arithmetic", n=1, digits=3)

    @register_task("_unit_test_task")
    def _task(n, *, split, seed):
        return [{"prompt": f"{split}{i}", "completion": str(seed)} for i in range(n)]

    rows = load_examples(DataSourceConfig(task="_unit_test_task", n=2, split="test"), seed=7)
    assert rows == [{"prompt": "test0", "completion": "7"}, {"prompt": "test1", "completion": "7"}]


def test_mathematics_dataset_seed_beyond_numpys_range_is_named():
    """Seeds 2**31 .. 2**32 - 1 pass the run-config check but 2·seed + 1 overflows numpy's seed:
    a clear ValueError naming the range instead of numpy's."""
    with pytest.raises(ValueError, match=r"arithmetic__mixed takes seeds 0 \.\. 2147483647"):
        generate_task("arithmetic__mixed", n=1, seed=2**31)
    assert len(generate_task("arithmetic__mixed", n=1, seed=2**31 - 1)) == 1


def test_mathematics_dataset_mixed_task():
    rows = generate_task("arithmetic__mixed", n=5, seed=0)
    assert len(rows) == 5 and all(r["prompt"].endswith("Answer: ") for r in rows)
    assert rows == generate_task("arithmetic__mixed", n=5, seed=0)
    test = generate_task("arithmetic__mixed", n=5, split="test", seed=0)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test}


def test_batched_dataset_equals_per_example(tok):
    rows = [*generate_task("arithmetic", n=20, seed=0), {"text": "7+7=14"},
            {"prompt": "9999999999", "completion": "1"}]
    ds = build_dataset(rows, tok, max_length=10)
    singles = [tokenize_example(r, tok, max_length=10) for r in rows]
    assert [ds[i] for i in range(len(ds))] == [s for s in singles if s is not None]
    assert len(ds) == len(rows) - 1  # the truncated one is dropped


def test_non_utf8_line_is_named(tmp_path):
    p = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "1+1=", "completion": "2"}).encode()
    p.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good + b"\n"
                  + '{"prompt": "caf\u00e9", "completion": "1"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.jsonl:3: not UTF-8 \(byte 0xe9") as err:
        read_jsonl(p)
    assert err.value.__cause__ is None  # no 50-line UnicodeDecodeError chained behind it
    p.write_bytes(b"\xef\xbb\xbf" + good + b"\n")  # a UTF-8 byte-order mark is fine
    assert read_jsonl(p) == [{"prompt": "1+1=", "completion": "2"}]


def _cut_rows():
    # char tokenizer: one id per character, no BOS; completion gets an EOS
    return [
        {"prompt": "1+1=", "completion": "22222"},  # 4 + 5 + eos = 10: fits exactly
        {"prompt": "1+1=", "completion": "222222"},  # 11: cut, loses its EOS
        {"text": "abcdefghijk"},  # 12: cut
        {"prompt": "1234567890", "completion": "1"},  # the prompt fills max_length: dropped
    ]


def test_truncated_and_dropped_examples_are_counted_and_reported(tok, capsys):
    ds = build_dataset(_cut_rows(), tok, max_length=10, source="d.jsonl")
    assert len(ds) == 3
    assert (ds.cuts.examples, ds.cuts.truncated, ds.cuts.dropped) == (4, 2, 1)
    assert ds[0]["input_ids"][-1] == tok.eos_token_id  # the exact fit keeps its EOS
    assert tok.eos_token_id not in ds[1]["input_ids"]
    assert capsys.readouterr().err.splitlines() == [
        "warning: d.jsonl: 2 of 4 examples truncated, 1 dropped (data.max_length=10)"
    ]
    assert ds.cuts.to_dict()["truncated"] == 2  # what train_summary.json stores

    quiet = build_dataset(_cut_rows()[:1], tok, max_length=10, source="d.jsonl")
    assert (quiet.cuts.truncated, quiet.cuts.dropped) == (0, 0)
    assert capsys.readouterr().err == ""  # nothing cut: nothing printed


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"on_truncate": "error"}, r"2 of 4 examples truncated.*data\.on_truncate=error"),
        ({"on_drop": "error"}, r"1 dropped.*data\.on_drop=error"),
        ({"on_drop": "fail"}, r"data\.on_drop must be one of warn, error"),
    ],
)
def test_cut_policies_make_it_an_error(tok, policy, message):
    with pytest.raises(ConfigError, match=message):
        build_dataset(_cut_rows(), tok, max_length=10, source="d.jsonl", **policy)
    ok = build_dataset(_cut_rows()[:1], tok, max_length=10, on_truncate="error", on_drop="error")
    assert len(ok) == 1  # nothing cut: the strict policies pass


def test_cut_policy_config_values_are_checked():
    from emdlm.config import load_config

    cfg = load_config("arithmetic_ce", ["data.on_truncate=error"])
    assert (cfg.data.on_truncate, cfg.data.on_drop) == ("error", "warn")
    with pytest.raises(ConfigError, match=r"data\.on_drop='ignore' is not valid"):
        load_config("arithmetic_ce", ["data.on_drop=ignore"])


def test_mathematics_dataset_difficulty_levels():
    from emdlm.tasks.mathematics import _entropy_level

    assert _entropy_level(0)((3.0, 9.0)) == (3.0, 5.0)  # the lowest third (train-easy)
    assert _entropy_level(2)((3.0, 9.0)) == (7.0, 9.0)
    easy = generate_task("arithmetic__mixed", n=30, seed=0, difficulty="easy")
    easy_test = generate_task("arithmetic__mixed", n=30, split="test", seed=0, difficulty="easy")
    full = generate_task("arithmetic__mixed", n=30, seed=0)
    assert not {r["prompt"] for r in easy} & {r["prompt"] for r in easy_test}  # hash rule
    # easy problems are shorter on average than problems over the whole range
    mean_len = lambda rows: sum(len(r["prompt"]) for r in rows) / len(rows)  # noqa: E731
    assert mean_len(easy) < mean_len(full)
    with pytest.raises(ValueError, match="difficulty must be 'all' or one of easy"):
        generate_task("arithmetic__mixed", n=1, difficulty="trivial")


def test_split_left_out_is_the_roles_split():
    """data.eval without `split` scores the test split (not the training problems), data.train
    without one trains on "train"; an explicit split is kept, and the saved config says which."""
    import yaml

    from emdlm.config import load_config

    cfg = load_config(None, ["data.train.task=arithmetic", "data.eval.task=arithmetic"])
    assert (cfg.data.train.split, cfg.data.eval.split) == ("train", "test")
    assert cfg.data.eval.describe() == "task arithmetic (test)"
    cfg = load_config(None, ["data.eval.task=arithmetic", "data.eval.split=dev"])
    assert cfg.data.eval.split == "dev"
    saved = yaml.safe_load(yaml.safe_dump(cfg.to_dict()))
    assert saved["data"]["eval"]["split"] == "dev"
    with pytest.raises(ConfigError, match=r"data\.eval\.split"):
        load_config(None, ["data.eval.task=arithmetic", "data.eval.split=validation"])
    # the rows are the test split's, and a source built on its own outside a DataConfig keeps
    # the old meaning ("train")
    cfg = load_config(None, ["data.eval.task=arithmetic", "data.eval.n=40"])
    rows = load_examples(cfg.data.eval, seed=0)
    assert rows == load_examples(DataSourceConfig(task="arithmetic", n=40, split="test"), seed=0)
    lone = DataSourceConfig(task="arithmetic", n=40)
    assert lone.resolved_split == "train"
    train_rows = load_examples(lone, seed=0)
    assert train_rows == load_examples(
        DataSourceConfig(task="arithmetic", n=40, split="train"), seed=0)
    assert {r["prompt"] for r in rows}.isdisjoint(r["prompt"] for r in train_rows)
