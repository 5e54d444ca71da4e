"""The from-hidden switch of the Trainer adapter
(``make_compute_loss_func(..., from_hidden=True)``) and ``emdlm.patch``: a few real
``transformers.Trainer`` steps with gradient accumulation 2 give the same per-step losses and the
same final weights as the logits path, for tiny GPT-2 and LLaMA models and CE / NTIL / EMO."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import emdlm
from _torchrun import failure_text
from emdlm.integrations.patch import output_head
from emdlm.integrations.transformers import make_compute_loss_func
from emdlm.losses.ce import CrossEntropyLoss
from emdlm.losses.emo import EMOLoss
from emdlm.losses.ntil import NTILLoss
from emdlm.numbers import NumberVocab
from emdlm.tokenizers import load_tokenizer

SEQ = 12


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("char")


def _vocab(tok) -> int:
    return len(tok)


def _model(arch: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":  # tied head
        cfg = GPT2Config(vocab_size=vocab, n_layer=1, n_embd=32, n_head=2, n_positions=SEQ)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(  # untied head
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _loss(name: str, tok) -> torch.nn.Module:
    vocab = _vocab(tok)
    if name == "ce":
        return CrossEntropyLoss(reduction="sum")
    if name == "ntil":  # "expected" values: deterministic, no Gumbel noise
        return NTILLoss(NumberVocab.from_tokenizer(tok, vocab), value_mode="expected",
                        reduction="sum")
    emb = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(1))
    return EMOLoss(emb, reduction="sum")


def _dataset(tok, n: int = 8) -> list[dict[str, torch.Tensor]]:
    """Fixed-length rows of digits and letters; a varying prefix of each row is not scored, so
    micro-batches have different token counts (what makes the accumulation exactness real)."""
    gen = torch.Generator().manual_seed(3)
    ids = tok.convert_tokens_to_ids(list("0123456789abc+="))
    pool = torch.tensor(ids)
    rows = []
    for i in range(n):
        input_ids = pool[torch.randint(len(pool), (SEQ,), generator=gen)]
        labels = input_ids.clone()
        labels[: 1 + (i * 3) % 7] = -100
        rows.append({"input_ids": input_ids, "attention_mask": torch.ones(SEQ, dtype=torch.long),
                     "labels": labels})
    return rows


def _train(model, data, tmp_path, **trainer_kwargs) -> list[float]:
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, learning_rate=0.5, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, lr_scheduler_type="constant",
        optim="sgd",  # not Adam: it blows float noise in zero gradients (key bias) up to lr
    )
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=default_data_collator, **trainer_kwargs)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _assert_same(losses_a, model_a, losses_b, model_b) -> None:
    assert len(losses_a) == 2 and len(losses_b) == 2
    assert losses_a == pytest.approx(losses_b, rel=1e-5, abs=1e-6)
    params_b = dict(model_b.named_parameters())
    for name, p in model_a.named_parameters():
        torch.testing.assert_close(p, params_b[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["ce", "ntil", "emo"])
def test_from_hidden_trainer_matches_logits_path(tok, tmp_path, arch, name):
    data = _dataset(tok)
    ref_model = _model(arch, _vocab(tok))
    ref = _train(ref_model, data, tmp_path / "a",
                 compute_loss_func=make_compute_loss_func(_loss(name, tok)))
    model = _model(arch, _vocab(tok))
    calls = []
    orig = model.lm_head.forward
    model.lm_head.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    cl = make_compute_loss_func(_loss(name, tok), from_hidden=True, model=model)
    got = _train(model, data, tmp_path / "b", compute_loss_func=cl)
    assert calls == []  # the head module never ran: no [B, T, V] logits
    _assert_same(got, model, ref, ref_model)
    assert cl.pop_components()["n_scored"] > 0  # components recorded on this path too


@pytest.mark.parametrize("from_hidden", [False, True])
@pytest.mark.parametrize("name", ["ce", "ntil"])
def test_patch_under_plain_trainer_matches_compute_loss_func(tok, tmp_path, from_hidden, name):
    data = _dataset(tok)
    ref_model = _model("llama", _vocab(tok))
    ref = _train(ref_model, data, tmp_path / "a",
                 compute_loss_func=make_compute_loss_func(_loss(name, tok)))
    model = _model("llama", _vocab(tok))
    handle = emdlm.patch(model, _loss(name, tok), from_hidden=from_hidden)
    calls = []
    orig = model.lm_head.forward
    model.lm_head.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    got = _train(model, data, tmp_path / "b")  # no compute_loss_func: the model's own loss
    _assert_same(got, model, ref, ref_model)
    assert (calls == []) == from_hidden  # from hidden: the head never ran
    handle.undo()
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__


def test_patch_forward_returns_the_mean_and_undo_restores(tok):
    model = _model("gpt2", _vocab(tok)).eval()  # no dropout: calls compared one by one
    batch = default_data_collator(_dataset(tok, 2))
    hf_loss = model(**batch).loss
    ce = CrossEntropyLoss(reduction="sum")
    for from_hidden in (False, True):
        handle = emdlm.patch(model, ce, from_hidden=from_hidden)
        out = model(**batch)
        # CE's mean over the scored tokens equals transformers' own CE
        torch.testing.assert_close(out.loss, hf_loss, rtol=1e-5, atol=1e-6)
        assert (out.logits is None) == from_hidden
        assert model(input_ids=batch["input_ids"]).logits.shape[-1] == _vocab(tok)
        # num_items_in_batch divides the sum instead of the call's count
        scored = int((batch["labels"][:, 1:] != -100).sum())
        out2 = model(**batch, num_items_in_batch=torch.tensor(2 * scored))
        torch.testing.assert_close(out2.loss, hf_loss / 2, rtol=1e-5, atol=1e-6)
        # pre-shifted labels (context parallelism) are scored without a second shift and win
        # over ``labels`` (here all ignored), as in transformers' ForCausalLMLoss
        shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        masked = {**batch, "labels": torch.full_like(batch["labels"], -100)}
        out3 = model(**masked, shift_labels=shifted)
        torch.testing.assert_close(out3.loss, hf_loss, rtol=1e-5, atol=1e-6)
        handle.undo()
    torch.testing.assert_close(model(**batch).loss, hf_loss)


def test_patch_refusals(tok):
    model = _model("gpt2", _vocab(tok))
    with pytest.raises(ValueError, match="reduction='sum'"):
        emdlm.patch(model, CrossEntropyLoss(reduction="mean"))
    handle = emdlm.patch(model, CrossEntropyLoss(reduction="sum"), from_hidden=True)
    with pytest.raises(RuntimeError, match="already has an emdlm from-hidden forward"):
        emdlm.patch(model, CrossEntropyLoss(reduction="sum"), from_hidden=True)
    handle.undo()
    with pytest.raises(ValueError, match="needs model="):
        make_compute_loss_func(CrossEntropyLoss(reduction="sum"), from_hidden=True)


def test_output_head_reads_softcap_and_scale(tok):
    model = _model("llama", _vocab(tok))
    head = output_head(model)
    assert head.weight is model.lm_head.weight and head.softcap is None
    model.config.final_logit_softcapping = 30.0
    model.config.logit_scale = 0.5
    head = output_head(model)
    assert head.softcap == 30.0 and head.logit_scale == 0.5
    del model.config.logit_scale
    model.config.logits_scaling = 4.0  # Granite divides by it
    assert output_head(model).logit_scale == 0.25
    model.config.lm_head_multiplier = 2.0
    with pytest.raises(ValueError, match="several logit scales"):
        output_head(model)


def test_patch_from_hidden_applies_gemma2_softcap(tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=_vocab(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
    )
    model = Gemma2ForCausalLM(cfg).eval()
    batch = default_data_collator(_dataset(tok, 2))
    ref = model(**batch).loss  # transformers' CE on the soft-capped logits
    handle = emdlm.patch(model, CrossEntropyLoss(reduction="sum"), from_hidden=True)
    torch.testing.assert_close(model(**batch).loss, ref, rtol=1e-5, atol=1e-6)
    handle.undo()
    model.config.final_logit_softcapping = None  # a different loss without the cap
    assert not torch.allclose(model(**batch).loss, ref)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     init_lora_weights=False)  # non-zero B: the adapters change the loss
    return get_peft_model(model, cfg)


@pytest.mark.parametrize("use_patch", [False, True])
def test_from_hidden_under_lora_matches_logits_path(tok, tmp_path, use_patch):
    data = _dataset(tok)
    ref_model = _lora(_model("llama", _vocab(tok)))
    ref = _train(ref_model, data, tmp_path / "a",
                 compute_loss_func=make_compute_loss_func(_loss("ntil", tok)))
    model = _lora(_model("llama", _vocab(tok)))
    if use_patch:
        emdlm.patch(model, _loss("ntil", tok), from_hidden=True)
        got = _train(model, data, tmp_path / "b")
    else:
        cl = make_compute_loss_func(_loss("ntil", tok), from_hidden=True, model=model)
        got = _train(model, data, tmp_path / "b", compute_loss_func=cl)
    _assert_same(got, model, ref, ref_model)
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert lora_a and all(p.requires_grad for p in lora_a)


def test_lora_on_the_head_is_refused(tok):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("llama", _vocab(tok)),
                           LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(NotImplementedError, match="lm_head"):
        output_head(model)


def _run_cfg(out, *extra):
    from emdlm.config import load_config

    return load_config("arithmetic_ntil", [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=32",
        "data.eval=null", "train.batch_size=4", "train.grad_accum=2", "train.max_steps=3",
        "train.save_steps=100", "train.save_total_limit=null", "train.progress_bar=false",
        "train.tensorboard=false", "objective.params.value_mode=expected", "optim.optim=sgd",
        f"output_dir={out}", *extra,
    ])


def test_emdlm_train_fused_linear_matches_logits_path(tmp_path, monkeypatch, capsys):
    import json

    from safetensors.torch import load_file

    import emdlm.integrations.transformers as tf_mod
    from emdlm.training import run_training

    used = []
    real = tf_mod.aligned_hidden_loss
    monkeypatch.setattr(tf_mod, "aligned_hidden_loss",
                        lambda *a, **k: used.append(1) or real(*a, **k))
    outs = {}
    for fused in (False, True):
        out = tmp_path / f"fused_{fused}"
        run_training(_run_cfg(out, f"train.fused_linear={str(fused).lower()}"))
        # the from-hidden path says so once, right after the world-size line (issue F8d)
        err = capsys.readouterr().err.splitlines()
        said = [i for i, ln in enumerate(err) if "loss from hidden states" in ln]
        if fused:
            world = next(i for i, ln in enumerate(err) if ln.startswith("emdlm: world size"))
            assert said == [world + 1]
            assert err[said[0]] == (
                "emdlm: loss from hidden states (train.fused_linear): ntil (NTILLoss.from_hidden) "
                "applies the 89-token output embedding in chunks of up to 754032 rows; the "
                "[batch, length, 89] logits are not built while training "
                "(evaluation keeps the logits path)")
        else:
            assert said == []
        log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        outs[fused] = ([r["loss"] for r in log], [r["ntil"] for r in log],
                       load_file(str(out / "model.safetensors")))
    assert len(used) == 3 * 2  # only the fused run, once per micro-batch
    assert len(outs[True][0]) == 3
    assert outs[True][0] == pytest.approx(outs[False][0], rel=1e-5)
    assert outs[True][1] == pytest.approx(outs[False][1], rel=1e-5)
    for name, w in outs[False][2].items():
        torch.testing.assert_close(outs[True][2][name], w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fused_linear_two_processes_match_one_process_logits(tmp_path):
    """torchrun, 2 CPU processes (DDP, gloo) x batch 4 on the from-hidden path == 1 process x
    batch 8 on the logits path: the wrapped forward still goes through DDP's forward, so the
    gradients (output embedding included) are all-reduced."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file

    from emdlm.config import load_config
    from emdlm.training import run_training

    common = [
        "model.params.n_layer=1", "model.params.n_embd=32", "data.train.n=64", "data.eval=null",
        "train.max_steps=3", "train.grad_accum=1", "train.save_steps=100",
        "train.progress_bar=false", "train.tensorboard=false", "objective.name=mixce",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    run_training(load_config("arithmetic_ce", [*common, "train.batch_size=8", f"output_dir={one}"]))
    cfg = load_config("arithmetic_ce", [*common, "train.batch_size=4", "train.fused_linear=true",
                                        f"output_dir={two}"])
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "emdlm.cli", "train",
         "-c", str(path)], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, failure_text(proc.stderr)
    log_one = [json.loads(x) for x in (one / "train_log.jsonl").read_text().splitlines()]
    log_two = [json.loads(x) for x in (two / "train_log.jsonl").read_text().splitlines()]
    assert len(log_two) == len(log_one) == 3
    for a, b in zip(log_two, log_one, strict=True):
        assert a["n_scored"] == b["n_scored"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    w_one = load_file(str(one / "model.safetensors"))
    w_two = load_file(str(two / "model.safetensors"))
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_emdlm_train_fused_linear_on_a_tiny_vlm_matches_logits_path(tmp_path, monkeypatch):
    """Qwen2-VL (vision tower + language model): the backbone (``base_model``) takes the
    images, the loss applies ``lm_head`` from the hidden states; same as the logits path."""
    import json

    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from emdlm.config import load_config
    from emdlm.training import run_training

    rows = []
    rng = np.random.default_rng(0)
    for i in range(8):
        (tmp_path / "img").mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "img" / f"{i}.png")
        rows.append({"image": f"img/{i}.png", "prompt": "What time?",
                     "completion": f"{i + 1}_3{i}"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import emdlm.integrations.transformers as tf_mod

    used = []
    real = tf_mod.aligned_hidden_loss
    monkeypatch.setattr(tf_mod, "aligned_hidden_loss",
                        lambda *a, **k: used.append(1) or real(*a, **k))
    result = {}
    for fused in (False, True):
        out = tmp_path / f"run_{fused}"
        run_training(load_config(None, [
            "model.name=tiny-qwen2-vl", "tokenizer=char", f"data.train.path={data}",
            "data.eval=null", "train.max_steps=2", "train.batch_size=2", "train.grad_accum=2",
            "train.progress_bar=false", "train.tensorboard=false", "objective.name=ntil",
            "objective.params.value_mode=expected", "optim.optim=sgd", f"output_dir={out}",
            f"train.fused_linear={str(fused).lower()}",
        ]))
        log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        result[fused] = ([r["loss"] for r in log], load_file(str(out / "model.safetensors")))
    assert len(used) == 2 * 2  # the fused run only, once per micro-batch
    assert len(result[True][0]) == 2
    assert result[True][0] == pytest.approx(result[False][0], rel=1e-5)
    for name, w in result[False][1].items():
        torch.testing.assert_close(result[True][1][name], w, rtol=1e-4, atol=1e-5)
