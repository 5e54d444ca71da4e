"""Which numbers the numeric objectives score (ntloss issue #65): ``number_mask`` on NTIL /
digit EMD (logits and from-hidden paths), number scopes in the data (``data.number_scope`` and a
row's ``number_scope``: "all", "answer", "answer:<task>", "regex:<pattern>"), the collators'
``number_mask`` and the Trainer glue, end to end through a real Trainer step."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from emdlm.config import ConfigError, ModelConfig, load_config
from emdlm.data import DataCollator, build_dataset, tokenize_example
from emdlm.functional.ntil import mix_coefficient
from emdlm.integrations.transformers import (
    LossComponentsCallback,
    emdlm_trainer,
    make_compute_loss_func,
)
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.ntil import DigitEMDLoss, NTILLoss
from emdlm.number_scope import in_scope_tokens, scope_pattern
from emdlm.number_spans import find_number_spans
from emdlm.numbers import NumberVocab

ROW_TEXT = "answer: 3, box (12,40),(80,99)"
BOX_REGEX = r"regex:\(\d+,\d+\),\(\d+,\d+\)"
NUMERIC = ("emd", "relative", "magnitude", "ntil", "n_numbers", "n_digit_tokens")
LOSSES = {"ntil": NTILLoss, "emd": DigitEMDLoss}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _batch(tok: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, mask without the option label '3', labels with that '3' made a letter)."""
    a = _ids(tok, ROW_TEXT)
    b = _ids(tok, "x=7.5 and 42 ok" + "," * len(ROW_TEXT))[: len(a)]  # char: 1 token a char
    labels = torch.tensor([a, b])
    labels[1, -2:] = -100  # ignored tail
    three = ROW_TEXT.index("3")
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[0, three] = False
    replaced = labels.clone()
    replaced[0, three] = tok.convert_tokens_to_ids("x")
    return labels, mask, replaced


def _loss(name: str, tok: Any, **kw: Any) -> Any:
    return LOSSES[name](tok, mix="static", value_mode="expected", **kw)


def _run(fn: Any, logits: torch.Tensor, labels: torch.Tensor, **kw: Any) -> tuple[Any, Any]:
    z = logits.clone().requires_grad_(True)
    out = fn(z, labels, **kw)
    out.loss.backward()
    return out, z.grad


# ----------------------------------------------------------------------------- the loss mask
@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_masked_number_contributes_nothing(char_tokenizer: Any, name: str, impl: str) -> None:
    labels, mask, replaced = _batch(char_tokenizer)
    fn = _loss(name, char_tokenizer, implementation=impl)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    masked, g_masked = _run(fn, logits, labels, number_mask=mask)
    plain, _ = _run(fn, logits, labels)
    repl, g_repl = _run(fn, logits, replaced)
    c = masked.components
    # numeric terms: exactly those of the labels where the '3' is not a number
    for key in NUMERIC:
        torch.testing.assert_close(c[key], repl.components[key], msg=key)
    assert int(c["n_numbers"]) == int(plain.components["n_numbers"]) - 1
    # CE: on every label, the '3' included
    torch.testing.assert_close(c["ce"], plain.components["ce"])
    lam = fn.settings.lam
    expected_loss = plain.components["ce"] + lam * repl.components["ntil"].float()
    torch.testing.assert_close(masked.loss, expected_loss)
    # gradient: CE of the true labels + the numeric part of the replaced labels
    def ce_grad(lab: torch.Tensor) -> torch.Tensor:
        z = logits.clone().requires_grad_(True)
        F.cross_entropy(z.reshape(-1, z.shape[-1]), lab.reshape(-1)).backward()
        return z.grad

    expected = ce_grad(labels) + (g_repl - ce_grad(replaced))
    torch.testing.assert_close(g_masked, expected, atol=1e-6, rtol=1e-5)


def test_masked_number_dynamic_mix(char_tokenizer: Any) -> None:
    labels, mask, replaced = _batch(char_tokenizer)
    fn = NTILLoss(char_tokenizer, value_mode="expected")  # stable preset: dynamic, capped
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    masked = fn(logits, labels, number_mask=mask).components
    repl = fn(logits, replaced).components
    ce = fn(logits, labels).components["ce"]
    coef = mix_coefficient(ce, repl["ntil"], fn.settings)
    assert float(coef) < fn.settings.lam * fn.settings.max_ratio  # the ratio is not capped
    torch.testing.assert_close(masked["mix_coef"], coef)
    torch.testing.assert_close(masked["ntil"], repl["ntil"])


@pytest.mark.parametrize("name", list(LOSSES))
def test_all_false_mask_is_a_batch_without_numbers(char_tokenizer: Any, name: str) -> None:
    labels, mask, _ = _batch(char_tokenizer)
    fn = _loss(name, char_tokenizer)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    out, grad = _run(fn, logits, labels, number_mask=torch.zeros_like(mask))
    assert torch.isfinite(out.loss) and bool(torch.isfinite(grad).all())
    assert int(out.components["n_numbers"]) == 0 and float(out.components["ntil"]) == 0.0
    ce = CrossEntropyLoss(reduction="mean")
    ref, ref_grad = _run(ce, logits, labels)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_all_true_mask_is_no_mask(char_tokenizer: Any, impl: str) -> None:
    labels, mask, _ = _batch(char_tokenizer)
    fn = NTILLoss(char_tokenizer, value_mode="argmax", implementation=impl)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    a, ga = _run(fn, logits, labels, number_mask=torch.ones_like(mask))
    b, gb = _run(fn, logits, labels)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    for key, value in b.components.items():
        assert torch.equal(a.components[key], value), key


@pytest.mark.parametrize("name", list(LOSSES))
def test_from_hidden_with_mask_equals_logits_path(char_tokenizer: Any, name: str) -> None:
    labels, mask, _ = _batch(char_tokenizer)
    fn = _loss(name, char_tokenizer)
    hidden = torch.randn(*labels.shape, 16, dtype=torch.float64)
    weight = torch.randn(len(char_tokenizer), 16, dtype=torch.float64)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = fn(h1 @ w1.T, labels, number_mask=mask)
    ref.loss.backward()
    out = fn.from_hidden(h2, w2, labels, number_mask=mask, chunk_size=7)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss)
    for key in ("ce", *NUMERIC):
        torch.testing.assert_close(out.components[key], ref.components[key], msg=key)
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)
    unmasked = fn(h1 @ w1.T, labels).components["n_numbers"]
    assert int(out.components["n_numbers"]) == int(unmasked) - 1


def test_mask_errors(char_tokenizer: Any) -> None:
    labels, mask, _ = _batch(char_tokenizer)
    fn = NTILLoss(char_tokenizer)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    with pytest.raises(ValueError, match="number_mask shape"):
        fn(logits, labels, number_mask=mask[:, 1:])
    with pytest.raises(TypeError, match="dtype"):
        fn(logits, labels, number_mask=mask.long())
    with pytest.raises(ValueError, match="number_mask shape"):
        fn.from_hidden(torch.randn(*labels.shape, 4), torch.randn(logits.shape[-1], 4), labels,
                       number_mask=mask[0])  # fmt: skip


# ----------------------------------------------------------------------------- data scopes
def _numbers(tok: Any, rows: list[dict[str, Any]], **kw: Any) -> list[list[float]]:
    """Per row: the numbers NTILLoss would score, after build_dataset + DataCollator."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ds = build_dataset(rows, tok, max_length=128, **kw)
    batch = DataCollator(pad)(list(ds))
    vocab = NumberVocab.from_tokenizer(tok)
    spans = find_number_spans(
        batch["labels"], vocab, NTILLoss(vocab).span_options, number_mask=batch.get("number_mask")
    )
    out: list[list[float]] = [[] for _ in rows]
    for row, value in zip(spans.number_row.tolist(), spans.gold_value.tolist(), strict=True):
        out[row].append(value)
    return out


@pytest.mark.parametrize("tok_name", ["char", "gpt2", "qwen", "llama3-like"])
def test_regex_scope_scores_only_box_numbers(tok_name: str, request: Any) -> None:
    prefix = {"char": "char", "gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}[tok_name]
    tok = request.getfixturevalue(f"{prefix}_tokenizer")
    row = {"prompt": "Which box? 7 ", "completion": ROW_TEXT}
    assert _numbers(tok, [row]) == [[3.0, 12.0, 40.0, 80.0, 99.0]]
    assert _numbers(tok, [{**row, "number_scope": BOX_REGEX}]) == [[12.0, 40.0, 80.0, 99.0]]
    assert _numbers(tok, [row], number_scope=BOX_REGEX) == [[12.0, 40.0, 80.0, 99.0]]
    # the row's own field overrides the data default
    assert _numbers(tok, [{**row, "number_scope": "all"}], number_scope=BOX_REGEX) == [
        [3.0, 12.0, 40.0, 80.0, 99.0]
    ]


@pytest.mark.parametrize("tok_name", ["char", "gpt2", "qwen", "llama3-like"])
def test_answer_scope_per_task(tok_name: str, request: Any) -> None:
    prefix = {"char": "char", "gpt2": "gpt2", "qwen": "qwen", "llama3-like": "llama3"}[tok_name]
    tok = request.getfixturevalue(f"{prefix}_tokenizer")
    rows = [
        {"prompt": "p", "completion": "obj 2 at (12,40),(80,99)", "task": "grounding"},
        {"prompt": "p", "completion": "option 2: [0.125, 0.500, 0.875, 1.000]",
         "task": "grounding"},
        {"prompt": "p", "completion": "day 3 at 2_55 x", "task": "clock"},
        {"prompt": "p", "completion": "2 words: (1,2),(3,4); (5,6),(7,8)"},  # source task
    ]  # fmt: skip
    got = _numbers(tok, rows, number_scope="answer", task="text_detection")
    assert got == [
        [12.0, 40.0, 80.0, 99.0], [0.125, 0.5, 0.875, 1.0], [2.0, 55.0],
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    ]  # fmt: skip
    explicit = [{"prompt": "p", "completion": "day 3 at 2_55 x", "number_scope": "answer:clock"}]
    assert _numbers(tok, explicit) == [[2.0, 55.0]]


def test_real_task_rows_answer_scope_keeps_every_answer_number(
    char_tokenizer: Any, tmp_path: Path
) -> None:
    from emdlm.tasks import generate_task

    for task, params in (("clock", {"image_size": 32}), ("grounding", {"image_size": 48}),
                         ("text_detection", {})):  # fmt: skip
        rows = generate_task(task, n=4, seed=1, cache_dir=str(tmp_path), **params)
        assert _numbers(char_tokenizer, rows, number_scope="answer", task=task) == _numbers(
            char_tokenizer, rows
        )


def test_scope_errors(char_tokenizer: Any) -> None:
    row = {"prompt": "p", "completion": "1"}
    with pytest.raises(ConfigError, match="number_scope must be 'all', 'answer'"):
        build_dataset([row], char_tokenizer, max_length=16, number_scope="boxes")
    with pytest.raises(ConfigError, match=r"example 1: number_scope 'regex:\(' is not a valid"):
        build_dataset([row, {**row, "number_scope": "regex:("}], char_tokenizer, max_length=16)
    with pytest.raises(ConfigError, match="needs the task"):
        build_dataset([row], char_tokenizer, max_length=16, number_scope="answer")
    with pytest.raises(ConfigError, match="task 'arithmetic' has no answer pattern"):
        build_dataset([row], char_tokenizer, max_length=16, number_scope="answer",
                      task="arithmetic")  # fmt: skip
    with pytest.raises(ConfigError, match="must be a string"):
        build_dataset([{**row, "number_scope": 3}], char_tokenizer, max_length=16)
    assert scope_pattern("all", None, "x") is None


def test_in_scope_tokens_spaces_are_neutral() -> None:
    # 'Ġ12' covers " 12": the space does not put it out of scope; "ab" is out.
    offsets = [(0, 2), (2, 5), (5, 7), (7, 7)]
    pattern = scope_pattern(r"regex:\d+", None, "x")
    assert in_scope_tokens("ab 12cd", offsets, pattern) == [False, True, False, False]
    assert in_scope_tokens("", [], pattern) == []


def test_mask_items_collator_and_truncation(char_tokenizer: Any) -> None:
    tok = char_tokenizer
    rows = [{"prompt": "pp", "completion": "7 (1,2),(3,4)"}, {"prompt": "p", "completion": "5"}]
    plain = build_dataset(rows, tok, max_length=64)
    assert all("number_mask" not in item for item in plain)
    assert "number_mask" not in DataCollator(tok.pad_token_id)(list(plain))
    ds = build_dataset(rows, tok, max_length=9, number_scope=BOX_REGEX, on_truncate="warn")
    first = ds[0]
    assert len(first["number_mask"]) == len(first["labels"]) == 9
    assert first["number_mask"][:2] == [False, False]  # the prompt
    assert first["number_mask"][2:4] == [False, True]  # "7" is outside; a space is neutral
    assert all(first["number_mask"][4:])  # "(1,2),("
    single = tokenize_example(rows[0], tok, max_length=9, number_scope=BOX_REGEX)
    assert single is not None and single["number_mask"] == first["number_mask"]
    batch = DataCollator(tok.pad_token_id, pad_to_multiple_of=8)(list(ds))
    mask = batch["number_mask"]
    assert mask.dtype == torch.bool and mask.shape == batch["labels"].shape == (2, 16)
    assert not mask[:, 9:].any() and not mask[1].any()  # padding; "5" is no box
    with pytest.raises(ConfigError, match="has no number_mask"):
        DataCollator(tok.pad_token_id)([ds[0], plain[1]])


# ----------------------------------------------------------------------------- Trainer glue
def test_compute_loss_shifts_the_mask_and_warns_for_ce(char_tokenizer: Any) -> None:
    labels, mask, _ = _batch(char_tokenizer)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    # static mix: the value depends on the NTIL terms (dynamic: CE + λ·CE whatever they are)
    fn = NTILLoss(char_tokenizer, reduction="sum", value_mode="argmax", mix="static")
    cl = make_compute_loss_func(fn)
    got = cl({"logits": logits}, labels, number_mask=mask)
    ref = fn(logits[:, :-1], labels[:, 1:], number_mask=mask[:, 1:])
    n = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(got, ref.loss / n)
    assert not torch.allclose(got, fn(logits[:, :-1], labels[:, 1:]).loss / n)
    ce = make_compute_loss_func(CrossEntropyLoss(reduction="sum"))
    with pytest.warns(UserWarning, match="scores no numbers: the mask is ignored"):
        a = ce({"logits": logits}, labels, number_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once per ComputeLoss
        b = ce({"logits": logits}, labels, number_mask=mask)
    torch.testing.assert_close(a, ce({"logits": logits}, labels))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("from_hidden", [False, True])
def test_trainer_step_scores_only_box_numbers(
    char_tokenizer: Any, tmp_path: Path, from_hidden: bool
) -> None:
    """The issue's example through a real Trainer step: with the regex scope only the 4 box
    numbers of each row are scored (n_numbers from the loss components), CE on every token."""
    from transformers import Trainer, TrainingArguments

    from emdlm.models import build_model

    tok = char_tokenizer
    rows = [{"prompt": "Q: ", "completion": ROW_TEXT}] * 2

    def step(scope: str) -> dict[str, float]:
        torch.manual_seed(0)
        model = build_model(ModelConfig("tiny-gpt2", {"n_layer": 1, "n_embd": 32}), tok)
        cl = make_compute_loss_func(
            NTILLoss(tok, reduction="sum"), from_hidden=from_hidden,
            model=model if from_hidden else None,
        )  # fmt: skip
        args = TrainingArguments(
            output_dir=str(tmp_path / scope[:5]), per_device_train_batch_size=2, max_steps=1,
            logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
            disable_tqdm=True, remove_unused_columns=False,
        )  # fmt: skip
        trainer = emdlm_trainer(Trainer)(
            model=model, args=args, data_collator=DataCollator(tok.pad_token_id),
            train_dataset=build_dataset(rows, tok, max_length=64, number_scope=scope),
            compute_loss_func=cl, callbacks=[LossComponentsCallback(cl)],
        )  # fmt: skip
        trainer.train()
        return next(r for r in trainer.state.log_history if "emdlm/n_numbers" in r)

    boxed, everything = step(BOX_REGEX), step("all")
    assert boxed["emdlm/n_numbers"] == 8 and everything["emdlm/n_numbers"] == 10
    assert boxed["emdlm/n_digit_tokens"] == 16 and everything["emdlm/n_digit_tokens"] == 18
    assert boxed["emdlm/ce"] == pytest.approx(everything["emdlm/ce"], rel=1e-6)


def test_emdlm_train_vlm_with_answer_scope(tmp_path: Path) -> None:
    """``emdlm train`` on a tiny Qwen2-VL with data.number_scope=regex: the VLM collator's
    mask reaches NTIL (train_log.jsonl counts only the scoped numbers)."""
    import numpy as np
    from PIL import Image

    from emdlm.training.train import prepare_run, train

    (tmp_path / "img").mkdir()
    rows = []
    for i in range(4):
        pixels = np.full((32, 32, 3), 40 * i, dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"img/{i}.png")
        rows.append({"image": f"img/{i}.png", "prompt": "Where?", "completion": ROW_TEXT})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def n_numbers(scope: str) -> float:
        out = tmp_path / scope[:5]
        cfg = load_config(None, [
            "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
            "train.max_steps=1", "train.batch_size=4", f"output_dir={out}",
            "train.progress_bar=false", "train.tensorboard=false", "objective.name=ntil",
            f"data.number_scope={scope}",
        ])  # fmt: skip
        train(prepare_run(cfg))
        record = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
        return record["n_numbers"]

    assert n_numbers(BOX_REGEX) == 16  # 4 rows x 4 box numbers
    assert n_numbers("all") == 20
