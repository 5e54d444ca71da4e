"""Vision-language models (emdlm.vlm): tiny Qwen2-VL / LLaVA built offline, the image+text
collator's labels, image rows checked before training, training and eval through the recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from emdlm.config import ConfigError, DataSourceConfig, ModelConfig, load_config
from emdlm.data import IGNORE_INDEX
from emdlm.datasets.image_rows import load_image_examples
from emdlm.models import load_tokenizer
from emdlm.vlm.collator import VLMCollator
from emdlm.vlm.generate import other_images
from emdlm.vlm.models import (
    QWEN_VL_TOKENS,
    build_vlm,
    is_vlm,
    mrope_section,
    named_family,
    prepare_vlm_tokenizer,
    vision_modules,
)

VLMS = ("tiny-qwen2-vl", "tiny-llava")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _png(path: Path, value: int | None = None, size: tuple[int, int] = (64, 64)) -> Path:
    rng = np.random.default_rng(len(str(path)))
    pixels = (
        np.full((*size, 3), value, dtype=np.uint8) if value is not None
        else rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def _built(name: str, tokenizer: str = "char", **params: Any) -> tuple[Any, Any]:
    tok = prepare_vlm_tokenizer(load_tokenizer(tokenizer), named_family(name))
    torch.manual_seed(0)
    return tok, build_vlm(ModelConfig(name=name, params=params), tok)


def _collator(tok: Any, built: Any, **kw: Any) -> VLMCollator:
    return VLMCollator(tok, built.image_processor, built.spec, built.model.config, **kw)


# ------------------------------------------------------------------------------- models
def test_mrope_section_sums_to_half_head_dim() -> None:
    assert mrope_section(128) == [16, 24, 24]  # Qwen2-VL's own split
    for head_dim in (8, 16, 32, 48):
        assert sum(mrope_section(head_dim)) == head_dim // 2


def test_tiny_qwen2_vl_with_char_tokenizer_has_vision_tokens_at_config_ids() -> None:
    tok, built = _built("tiny-qwen2-vl")
    cfg = built.model.config
    assert all(t in tok.get_vocab() for t in QWEN_VL_TOKENS)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert built.model.get_output_embeddings().weight.shape[0] == len(tok) < 200
    assert type(built.model).__name__ == "Qwen2VLForConditionalGeneration"


def test_qwen_tokenizer_keeps_qwen2_vl_real_ids(qwen_tokenizer: Any) -> None:
    before = len(qwen_tokenizer)
    tok = prepare_vlm_tokenizer(qwen_tokenizer, "qwen2_vl")
    assert len(tok) == before  # nothing added: the offline Qwen tokenizer has them
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert tok.convert_tokens_to_ids("<|vision_start|>") == 151652


def test_bad_image_size_param_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="image_size"):
        _built("tiny-qwen2-vl", image_size=10)
    with pytest.raises(ConfigError, match="multiple of the patch size"):
        _built("tiny-llava", image_size=60)


@pytest.mark.parametrize(
    ("name", "family"), [("tiny-qwen2-vl", "qwen2_vl"), ("tiny-llava", "llava")]
)
def test_local_folder_loads_as_vlm(tmp_path: Path, name: str, family: str) -> None:
    """A config-built Qwen2-VL and LLaVA saved as Hugging Face folders load back through the
    local-checkpoint path (AutoModelForImageTextToText + the saved image processor), equal."""
    tok, built = _built(name)
    folder = tmp_path / "ckpt"
    built.model.save_pretrained(folder)
    built.image_processor.save_pretrained(folder)
    assert is_vlm(str(folder)) and is_vlm("tiny-llava") and not is_vlm("tiny-gpt2")
    again = build_vlm(ModelConfig(name=str(folder)), tok)
    state = built.model.state_dict()
    for key, value in again.model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert again.spec.family == family
    with pytest.raises(ConfigError, match="only apply to named"):
        build_vlm(ModelConfig(name=str(folder), params={"hidden_size": 32}), tok)


def test_misspelt_vlm_name_suggests_the_right_one() -> None:
    from emdlm.models import build_model

    with pytest.raises(ConfigError, match="did you mean 'tiny-qwen2-vl'"):
        build_model(ModelConfig(name="tiny-qwen2vl"), load_tokenizer("char"))


# ------------------------------------------------------------------------------- collator
@pytest.mark.parametrize("name", VLMS)
def test_collator_scores_only_the_answer(tmp_path: Path, name: str) -> None:
    tok, built = _built(name)
    rows = [
        {"image": str(_png(tmp_path / "a.png", size=(64, 80))), "prompt": "What time?",
         "completion": "2_55"},
        {"image": str(_png(tmp_path / "b.png", size=(40, 40))), "prompt": "Time on it, 12h?",
         "completion": "11_05"},
    ]
    batch = _collator(tok, built, max_length=256)(rows)
    image_id = tok.convert_tokens_to_ids(built.spec.image_token)
    for i, row in enumerate(rows):
        labels, ids = batch["labels"][i], batch["input_ids"][i]
        answer = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert labels[labels != IGNORE_INDEX].tolist() == answer
        n_real = int(batch["attention_mask"][i].sum())
        # the scored tokens are the last real ones: everything before (prompt, images) is -100
        assert ids[n_real - len(answer) : n_real].tolist() == answer
        assert (labels[: n_real - len(answer)] == IGNORE_INDEX).all()
        assert (labels[ids == image_id] == IGNORE_INDEX).all()
        assert (labels[n_real:] == IGNORE_INDEX).all()
    if name == "tiny-qwen2-vl":
        grid = batch["image_grid_thw"]
        per_row = (batch["input_ids"] == image_id).sum(1)
        assert per_row.tolist() == (grid.prod(-1) // 4).tolist()
        assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == image_id).long())
        assert per_row[0] != per_row[1]  # the image size decides the token count
    # the model accepts it: the image token count matches the vision features
    out = built.model(**{k: v for k, v in batch.items() if k != "labels"})
    assert out.logits.shape[:2] == batch["input_ids"].shape


def test_collator_gives_each_rows_loss_weight_on_its_tokens(tmp_path: Path) -> None:
    """A row's ``loss_weight`` (absent: 1) on all of its tokens, 0 on padding; per-token
    weights cannot follow image rows (one-line ConfigError)."""
    tok, built = _built("tiny-llava")
    rows = [
        {"image": str(_png(tmp_path / "a.png")), "prompt": "What?", "completion": "2_55",
         "loss_weight": 2.5},
        {"image": str(_png(tmp_path / "b.png")), "prompt": "Time on it, 12h?",
         "completion": "11_05"},
    ]
    collate = _collator(tok, built, max_length=256)
    batch = collate(rows)
    w, mask = batch["loss_weights"], batch["attention_mask"].bool()
    assert w.shape == batch["labels"].shape
    assert torch.equal(w[0][mask[0]], torch.full((int(mask[0].sum()),), 2.5))
    assert torch.equal(w[1][mask[1]], torch.ones(int(mask[1].sum())))
    assert bool((w[~mask] == 0).all())
    assert "loss_weights" not in collate([rows[1]])
    with pytest.raises(ConfigError, match="per-token 'loss_weights' cannot follow image rows"):
        collate([{**rows[1], "loss_weights": [1.0]}])


def test_collator_uses_the_chat_template_when_the_tokenizer_has_one(tmp_path: Path) -> None:
    tok, built = _built("tiny-qwen2-vl")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    col = _collator(tok, built)
    assert col.prompt_text("Hi?") == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok.chat_template = "{{ messages[0]['content'][1]['text'] }}"  # drops the image
    row = {"image": str(_png(tmp_path / "a.png")), "prompt": "Hi?", "completion": "1"}
    with pytest.raises(ConfigError, match="0 image placeholders"):
        col([row])


def test_collator_generation_mode_left_pads_prompts(tmp_path: Path) -> None:
    tok, built = _built("tiny-qwen2-vl")
    rows = [{"image": str(_png(tmp_path / "a.png", size=(64, 64))), "prompt": "a?"},
            {"image": str(_png(tmp_path / "b.png", size=(64, 64))), "prompt": "longer one?"}]
    batch = _collator(tok, built, generation=True)(rows)
    assert "labels" not in batch
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].all()
    text = tok.decode(batch["input_ids"][1])
    assert text.endswith("<|im_start|>assistant\n")


def test_collator_refuses_a_tokenizer_without_pad_token() -> None:
    tok, built = _built("tiny-llava")
    tok.pad_token = None  # was silently padded with id 0 (a real token)
    assert tok.pad_token_id is None
    with pytest.raises(ValueError, match=r"VLMCollator: the tokenizer has no pad_token_id.*"
                                         r"tokenizer\.pad_token = tokenizer\.eos_token"):
        _collator(tok, built)


def test_prompt_too_long_for_max_length_is_an_error(tmp_path: Path) -> None:
    tok, built = _built("tiny-qwen2-vl")
    row = {"image": str(_png(tmp_path / "a.png")), "prompt": "x" * 50, "completion": "1"}
    with pytest.raises(ConfigError, match="max_length=40"):
        _collator(tok, built, max_length=40)([row])


def test_lengths_match_what_the_collator_builds(tmp_path: Path) -> None:
    tok, built = _built("tiny-qwen2-vl")
    rows = [
        {"image": str(_png(tmp_path / "a.png", size=(64, 64))), "prompt": "p", "completion": "12"},
        {"image": str(_png(tmp_path / "b.png", size=(112, 84))), "prompt": "pq",
         "completion": "1_30"},
    ]
    collate = _collator(tok, built, max_length=512)
    for row, (prompt, answer) in zip(rows, collate.lengths(rows), strict=True):
        batch = collate([row])
        assert int(batch["attention_mask"].sum()) == prompt + answer
        assert int((batch["labels"] != IGNORE_INDEX).sum()) == answer


def test_cut_rows_are_counted_before_training(tmp_path: Path, capsys: Any) -> None:
    """Image rows cut for length are counted and said before training (never a silent drop)."""
    from emdlm.datasets.image_rows import cut_image_rows

    tok, built = _built("tiny-qwen2-vl")
    image = str(_png(tmp_path / "a.png"))
    rows = [{"image": image, "prompt": "p", "completion": c} for c in ("1", "1" * 30, "1" * 3)]
    rows.append({"image": image, "prompt": "x" * 60, "completion": "1"})
    lengths = _collator(tok, built).lengths(rows)
    prompt = lengths[0][0]
    max_length = prompt + 5  # room for 4 answer characters and the EOS
    ds = cut_image_rows(rows, lengths, source="imgs.jsonl", max_length=max_length)
    assert (ds.cuts.truncated, ds.cuts.dropped, len(ds)) == (1, 1, 3)
    assert "imgs.jsonl: 1 of 4 examples truncated, 1 dropped" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"data\.on_truncate=error"):
        cut_image_rows(rows, lengths, source="s", max_length=max_length, on_truncate="error")
    with pytest.raises(ConfigError, match=r"data\.on_drop=error"):
        cut_image_rows(rows, lengths, source="s", max_length=max_length, on_drop="error")


def test_max_length_errors_say_the_measured_need(tmp_path: Path, capsys: Any) -> None:
    """The image max_length error says how many tokens image + prompt + answer need
    (measured on the rows, image tokens as the processor expands them)."""
    from emdlm.datasets.image_rows import cut_image_rows

    tok, built = _built("tiny-qwen2-vl")
    image = str(_png(tmp_path / "a.png"))
    rows = [{"image": image, "prompt": "p", "completion": "12"},
            {"image": image, "prompt": "pp", "completion": "1234567"}]
    lengths = _collator(tok, built).lengths(rows)
    (p0, a0), (p1, a1) = lengths
    assert p1 == p0 + 1 and a1 == a0 + 5  # one more prompt character, five more answer digits
    need = p1 + a1
    capsys.readouterr()
    with pytest.raises(ConfigError, match=rf"no example leaves room.*data\.max_length={need} "
                       rf"keeps every row whole.*{p1} prompt tokens, image tokens included, "
                       rf"\+ {a1} answer tokens") as info:
        cut_image_rows(rows, lengths, source="s", max_length=p0)
    # the measurement once: no warning and note before the error, no "longest prompt alone"
    # when the longest row has the longest prompt
    assert capsys.readouterr().err == ""
    assert "longest prompt alone" not in str(info.value)
    with pytest.raises(ConfigError, match=rf"data\.on_truncate=error.*max_length={need} keeps"):
        cut_image_rows(rows, lengths, source="s", max_length=p1 + 2, on_truncate="error")
    capsys.readouterr()
    cut_image_rows(rows, lengths, source="s", max_length=p1 + 2)
    assert f"note: data.max_length={need} keeps every row whole" in capsys.readouterr().err
    cut_image_rows(rows, lengths, source="s", max_length=need)  # nothing cut: no note
    assert "note:" not in capsys.readouterr().err


# ------------------------------------------------------------------------------- data
def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_image_rows_resolve_relative_paths_and_name_file_line(tmp_path: Path) -> None:
    _png(tmp_path / "img" / "0.png")
    (tmp_path / "img" / "bad.png").write_bytes(b"not a png")
    good = {"image": "img/0.png", "prompt": "p", "completion": "1_00"}
    data = _write_jsonl(tmp_path / "d.jsonl", [good, "", good])
    rows = load_image_examples(DataSourceConfig(path=str(data)), seed=0)
    assert rows[1]["image"] == str((tmp_path / "img" / "0.png").resolve())
    missing = _write_jsonl(tmp_path / "m.jsonl", [good, "", {**good, "image": "img/9.png"}])
    with pytest.raises(ConfigError, match=r"m\.jsonl:3: image file not found"):
        load_image_examples(DataSourceConfig(path=str(missing)), seed=0)
    bad = _write_jsonl(tmp_path / "b.jsonl", [{**good, "image": "img/bad.png"}])
    with pytest.raises(ConfigError, match=r"b\.jsonl:1: cannot read image"):
        load_image_examples(DataSourceConfig(path=str(bad)), seed=0)
    nokey = _write_jsonl(tmp_path / "n.jsonl", [good, {"prompt": "p", "completion": "1"}])
    with pytest.raises(ConfigError, match=r"n\.jsonl:2: field 'image'"):
        load_image_examples(DataSourceConfig(path=str(nokey)), seed=0)


def test_saved_dataset_with_an_image_column(tmp_path: Path) -> None:
    import datasets

    img = Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8))
    ds = datasets.Dataset.from_dict(
        {"image": [img, img], "prompt": ["p", "q"], "completion": ["1", "2"]},
        features=datasets.Features({"image": datasets.Image(), "prompt": datasets.Value("string"),
                                    "completion": datasets.Value("string")}),
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    rows = load_image_examples(DataSourceConfig(path=str(tmp_path / "ds")), seed=0)
    assert isinstance(rows[0]["image"], Image.Image) and rows[1]["completion"] == "2"


# ------------------------------------------------------------------------------- training
def _image_jsonl(tmp_path: Path, n: int = 8) -> Path:
    rows = []
    for i in range(n):
        _png(tmp_path / "img" / f"{i}.png")
        rows.append(
            {"image": f"img/{i}.png", "prompt": "What time?", "completion": f"{i + 1}_3{i}"}
        )
    return _write_jsonl(tmp_path / "train.jsonl", rows)


def _run_cfg(tmp_path: Path, data: Path, out: str, *extra: str) -> Any:
    return load_config(None, [
        "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
        f"data.eval.path={data}", "train.max_steps=3", "train.batch_size=4",
        f"output_dir={tmp_path / out}", "train.progress_bar=false", "train.tensorboard=false",
        "eval.kind=clock", "eval.max_new_tokens=6", *extra,
    ])


@pytest.mark.parametrize("objective", ["ce", "ntil"])
def test_train_vlm_frozen_vision_then_eval_clock(tmp_path: Path, objective: str) -> None:
    from emdlm.training.evaluate import evaluate_run
    from emdlm.training.train import prepare_run, train

    data = _image_jsonl(tmp_path)
    cfg = _run_cfg(tmp_path, data, objective, f"objective.name={objective}",
                   "model.freeze_vision=true")
    run = prepare_run(cfg)
    vision = {n: p.detach().clone() for m in vision_modules(run.model)
              for n, p in m.named_parameters()}
    head = run.model.get_output_embeddings().weight.detach().clone()
    summary = train(run)
    assert summary["global_step"] == 3 and np.isfinite(summary["train_loss"])
    for m in vision_modules(run.model):
        for n, p in m.named_parameters():
            assert torch.equal(p, vision[n]), f"vision parameter {n} changed"
    assert not torch.equal(run.model.get_output_embeddings().weight, head)
    out = tmp_path / objective
    assert (out / "preprocessor_config.json").is_file()
    result = evaluate_run(out, cfg)
    metrics = result["metrics"]
    for key in ("exact_match", "time_gap_mean_worst", "parse_failure_rate", "perplexity",
                "perplexity_other_images"):
        assert key in metrics, key
    assert metrics["n"] == 8 and np.isfinite(metrics["perplexity"])
    assert np.isfinite(metrics["perplexity_other_images"])
    preds = [json.loads(x) for x in (out / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 8 and preds[0]["image"].endswith("0.png")
    with Image.open(out / "eval" / "contact_sheet.png") as sheet:
        assert sheet.width > 64 and sheet.height > 64
    # the `written:` line of `emdlm eval` names every file, the picture included
    assert result["files"] == ["metrics.json", "predictions.jsonl", "contact_sheet.png"]
    # a checkpoint folder finds the image processor in its run folder
    ckpt = evaluate_run(out / "checkpoint-3", cfg, out_dir=tmp_path / "ck")
    assert ckpt["metrics"]["n"] == 8


@pytest.mark.parametrize("name", VLMS)
def test_lora_on_a_vlm_targets_the_language_model_only(tmp_path: Path, name: str) -> None:
    from emdlm.training.train import prepare_run, train

    data = _image_jsonl(tmp_path, n=4)
    run = prepare_run(_run_cfg(tmp_path, data, "lora", "lora.enabled=true", f"model.name={name}",
                               "train.max_steps=2"))
    lora = [n for n, _ in run.model.named_parameters() if "lora_" in n]
    assert lora and all("language_model" in n for n in lora)
    assert not any("visual" in n or "vision_tower" in n for n in lora)
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert set(trainable) == set(lora)
    assert train(run)["global_step"] == 2
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "lora" / "adapter" / "adapter_model.safetensors")
    b_mats = [v for k, v in saved.items() if "lora_B" in k]
    assert b_mats and any(v.abs().sum() > 0 for v in b_mats)  # lora_B starts at 0: it learned
    assert is_vlm(str(tmp_path / "lora"))  # the merged model saved as a VLM folder


def test_tiny_vlm_learns_an_answer_that_depends_on_the_image(tmp_path: Path) -> None:
    """Black image -> "1_00", white image -> "7_30": only the image tells them apart, so
    greedy answers right on both means pixels reach the loss through the vision tower."""
    from emdlm.vlm.generate import generate_vlm_answers, vlm_perplexity

    torch.manual_seed(0)
    tok, built = _built("tiny-qwen2-vl", image_size=56)
    rows = [{"image": str(_png(tmp_path / "k.png", 0)), "prompt": "t?", "completion": "1_00"},
            {"image": str(_png(tmp_path / "w.png", 255)), "prompt": "t?", "completion": "7_30"}]
    col = _collator(tok, built)
    batch = col(rows)
    labels = batch.pop("labels")
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-2)
    for _ in range(40):  # right from about step 20 (measured)
        logits = built.model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert generate_vlm_answers(built.model, col, rows, max_new_tokens=6) == ["1_00", "7_30"]
    # the answers come from the image: shown each other's image, the model is far less sure
    own = vlm_perplexity(built.model, col, rows)
    swapped = vlm_perplexity(built.model, col, other_images(rows, "image"))
    print(f"perplexity own images {own:.3f}, other images {swapped:.3f}")
    assert own < 1.5 and swapped > 3 * own


def test_other_images_shifts_images_by_one_row_and_keeps_the_text() -> None:
    rows = [{"image": f"{i}.png", "prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]
    swapped = other_images(rows, "image")
    assert [r["image"] for r in swapped] == ["1.png", "2.png", "0.png"]
    assert [(r["prompt"], r["completion"]) for r in swapped] == [(f"p{i}", f"c{i}")
                                                                for i in range(3)]
    assert rows[0]["image"] == "0.png"  # the input is not changed
    with pytest.raises(ValueError, match="at least 2 rows"):
        other_images(rows[:1], "image")


@pytest.mark.parametrize("task,metric,title", [
    ("clock", "time_gap_mean_worst", "analog clock"),
    ("visual_math", "abs_error_mean", "visual math"),
])
def test_vlm_demo_runs_ce_and_ntil_side_by_side(
    tmp_path: Path, task: str, metric: str, title: str
) -> None:
    """`emdlm demo --task clock|visual_math`: the tiny VLM with CE and NTIL, the table printed
    with the task's title, each run's contact sheet written."""
    from emdlm.training.demo import run_demo

    cache = tmp_path / "cache"
    lines: list[str] = []
    rows = run_demo(tmp_path / "demo", [
        "train.max_steps=2", "train.progress_bar=false", "train.tensorboard=false",
        "data.train.n=8", "data.eval.n=4", f"data.train.params.cache_dir={cache}",
        f"data.eval.params.cache_dir={cache}", "eval.max_new_tokens=3",
    ], echo=lines.append, task=task)
    assert set(rows) == {"ce", "ntil"}
    for row in rows.values():
        assert row["n"] == 4 and row["steps"] == 2 and metric in row
        if task == "clock":
            assert 0 <= row["hour_accuracy"] <= 1 and 0 <= row["minute_accuracy"] <= 1
    text = "\n".join(lines)
    assert title in text and "contact_sheet.png" in text
    assert (tmp_path / "demo" / "ntil" / "eval" / "contact_sheet.png").is_file()


def test_demo_refuses_an_unknown_task(tmp_path: Path) -> None:
    from emdlm.training.demo import run_demo

    with pytest.raises(ConfigError, match="--task"):
        run_demo(tmp_path / "x", task="clocks")
    assert not (tmp_path / "x").exists()


def test_clock_configs_differ_only_in_objective_and_output() -> None:
    """clock_ce / clock_ntil: the same model, data, optimiser and steps (a fair comparison),
    on the plain five-minute clocks that the tiny VLM learns to read (see clock_ce.yaml)."""
    from emdlm.config import load_config_dict

    ce, ntil = load_config_dict("clock_ce"), load_config_dict("clock_ntil")
    assert ce["objective"]["name"] == "ce" and ntil["objective"]["name"] == "ntil"
    rest = {k for k in ce if k not in ("objective", "output_dir")}
    assert rest == {k for k in ntil if k not in ("objective", "output_dir")}
    assert all(ce[k] == ntil[k] for k in rest)
    params = ce["data"]["train"]["params"]
    assert params == ce["data"]["eval"]["params"]
    assert params["minute_step"] == 5 and params["palette"] == "plain"
    load_config("clock_ce")  # both validate
    load_config("clock_ntil")
