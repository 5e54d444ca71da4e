"""TRL SFTTrainer with an emdlm loss: equal to TRL's own loss for CE, and it trains (offline)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402

from _objectives import SPECS  # noqa: E402
from emdlm.integrations.trl import (  # noqa: E402
    EMDLMSFTTrainer,
    fp32_on_cpu,
    sft_compute_loss_func,
)
from emdlm.losses.ce import CrossEntropyLoss  # noqa: E402
from emdlm.tokenizers import load_tokenizer  # noqa: E402

CHARS = list("0123456789+=")


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_gpt2(vocab_size: int, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: comparable losses
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def addition_dataset(n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return datasets.Dataset.from_list(rows)


def sft_config(tmp_path, **overrides) -> trl.SFTConfig:
    kwargs = {
        "output_dir": str(tmp_path / "out"), "max_steps": 12, "per_device_train_batch_size": 16,
        "learning_rate": 3e-3, "logging_steps": 4, "report_to": [], "save_strategy": "no",
        "use_cpu": True, "seed": 0, "max_length": 32, "disable_tqdm": True,
        "bf16": False,  # SFTConfig defaults to bf16 autocast; fp32 keeps comparisons exact
    }  # fmt: skip
    kwargs.update(overrides)
    return trl.SFTConfig(**kwargs)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return addition_dataset()


def _first_batch(trainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.get_train_dataloader()))


def test_ce_loss_equals_trl_builtin_loss(tmp_path, tok, dataset) -> None:
    model = tiny_gpt2(len(tok))
    ours = EMDLMSFTTrainer(
        model=model, args=sft_config(tmp_path), train_dataset=dataset, processing_class=tok,
        loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    theirs = trl.SFTTrainer(
        model=model, args=sft_config(tmp_path), train_dataset=dataset, processing_class=tok
    )
    batch = _first_batch(ours)
    # prompt/completion data: only the completion (and its EOS) is scored
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    model.train()
    for n_items in (None, 100):  # the micro-batch's own count, or a whole accumulated batch's
        expected = theirs.compute_loss(model, dict(batch), num_items_in_batch=n_items)
        got = ours.compute_loss(model, dict(batch), num_items_in_batch=n_items)
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    # gradients agree too
    model.zero_grad()
    theirs.compute_loss(model, dict(batch)).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ours.compute_loss(model, dict(batch)).backward()
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_deprecated_compute_loss_func_route_agrees(tmp_path, tok, dataset) -> None:
    model = tiny_gpt2(len(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL deprecates compute_loss_func
        via_func = trl.SFTTrainer(
            model=model, args=sft_config(tmp_path), train_dataset=dataset, processing_class=tok,
            compute_loss_func=sft_compute_loss_func(CrossEntropyLoss(reduction="sum")),
        )  # fmt: skip
    ours = EMDLMSFTTrainer(
        model=model, args=sft_config(tmp_path), train_dataset=dataset, processing_class=tok,
        loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    batch = _first_batch(ours)
    model.train()
    a = via_func.compute_loss(model, dict(batch), num_items_in_batch=50)
    b = ours.compute_loss(model, dict(batch), num_items_in_batch=50)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_training_lowers_the_loss_and_logs_components(tmp_path, tok, dataset) -> None:
    trainer = EMDLMSFTTrainer(
        model=tiny_gpt2(len(tok)), args=sft_config(tmp_path), train_dataset=dataset,
        processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    batch = _first_batch(trainer)
    with torch.no_grad():
        before = trainer.compute_loss(trainer.model, dict(batch)).item()
    trainer.train()
    with torch.no_grad():
        after = trainer.compute_loss(trainer.model, dict(batch)).item()
    assert after < 0.9 * before  # 2.66 -> 2.17 on CPU with this seed
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    # the logged loss is the emdlm CE (mean over scored tokens) and its components are logged
    assert logs[0]["emdlm/ce"] == pytest.approx(logs[0]["loss"], rel=1e-4)
    assert 0.0 <= logs[-1]["mean_token_accuracy"] <= 1.0


def test_refuses_mean_reduction_and_compute_loss_func(tmp_path, tok, dataset) -> None:
    with pytest.raises(ValueError, match="reduction='sum'"):
        EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), args=sft_config(tmp_path), train_dataset=dataset,
            processing_class=tok, loss_fn=CrossEntropyLoss(reduction="mean"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="drop compute_loss_func"):
        EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), args=sft_config(tmp_path), train_dataset=dataset,
            processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
            compute_loss_func=lambda *a, **k: None,
        )  # fmt: skip


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tok, dataset) -> None:
    """One SGD step on 16 examples = two accumulated micro-batches of 8 (token-weighted)."""

    def one_step(batch_size: int, accumulation: int) -> list[torch.Tensor]:
        trainer = EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), train_dataset=dataset, processing_class=tok,
            args=sft_config(
                tmp_path, max_steps=1, per_device_train_batch_size=batch_size,
                gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
            ),
            loss_fn=CrossEntropyLoss(reduction="sum"),
        )  # fmt: skip
        trainer.train()
        return [p.detach().clone() for p in trainer.model.parameters()]

    start = [p.detach() for p in tiny_gpt2(len(tok)).parameters()]
    big = one_step(16, 1)
    accumulated = one_step(8, 2)
    moved = max(float((b - s).abs().max()) for b, s in zip(big, start, strict=True))
    assert moved > 1e-3  # the step did something
    for a, b in zip(accumulated, big, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_plain_text_rows_log_the_emdlm_loss(tmp_path, tok) -> None:
    """On plain-text rows TRL's collator leaves each row's first token labelled, and
    transformers counts every label for GPT-2 (its class name maps to no causal-LM loss): N
    was one token per row too big (logged loss 0.84 x emdlm/ce here). EMDLMSFTTrainer counts
    the scored positions, labels[..., 1:], so the logged loss is the emdlm CE, also with
    gradient accumulation."""
    rows = [{"text": f"{a}+{b}={a + b}"} for a in range(8) for b in range(8)]
    trainer = EMDLMSFTTrainer(
        model=tiny_gpt2(len(tok)), train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
        args=sft_config(tmp_path, max_steps=2, per_device_train_batch_size=8,
                        gradient_accumulation_steps=2, logging_steps=1),
    )  # fmt: skip
    batch = _first_batch(trainer)
    assert (batch["labels"][:, 0] != -100).all()  # TRL scores every row's first token
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for record in logs:
        assert record["loss"] == pytest.approx(record["emdlm/ce"], rel=1e-4)
        assert record["emdlm/n_scored"] == pytest.approx(record["emdlm/n_tokens"])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_refuses_mean_reduction_for_every_objective(name) -> None:
    """EMDLMSFTTrainer uses the same check as make_compute_loss_func, before TRL is set up."""
    from tests.test_trainer_reduction import build_loss  # the registry-wide loss builder

    char = load_tokenizer("char")
    with pytest.raises(ValueError, match=r"EMDLMSFTTrainer needs .*reduction='mean'"):
        EMDLMSFTTrainer(loss_fn=build_loss(name, "mean", char, len(char)))


def test_cpu_trains_in_fp32_unless_asked(tmp_path, tok, dataset, caplog) -> None:
    """SFTConfig's default bf16 is turned off on CPU (with a warning; the user's config object
    is unchanged); bf16_on_cpu=True keeps it."""
    default = trl.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[],
                            max_length=32, save_strategy="no")  # fmt: skip
    assert default.bf16 is True  # TRL's default (if this changes, the switch is moot)
    with caplog.at_level("WARNING", logger="emdlm"):
        trainer = EMDLMSFTTrainer(
            model=tiny_gpt2(len(tok)), args=default, train_dataset=dataset,
            processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
        )  # fmt: skip
    assert trainer.args.bf16 is False and trainer.args.mixed_precision == "no"
    assert trainer.accelerator.mixed_precision == "no"
    assert "fp32" in caplog.text and "bf16_on_cpu" in caplog.text
    assert default.bf16 is True  # the caller's object is not modified
    batch = _first_batch(trainer)
    trainer.model.train()
    with trainer.compute_loss_context_manager():
        out = trainer.model(input_ids=batch["input_ids"])
    assert out.logits.dtype == torch.float32

    # bf16_on_cpu=True leaves the config alone (a second Trainer with another precision cannot
    # be built in one process: accelerate's state is a singleton)
    assert fp32_on_cpu(default, bf16_on_cpu=True) is default
    assert fp32_on_cpu(sft_config(tmp_path)).bf16 is False  # already fp32: unchanged


def test_no_args_gets_trls_default_in_fp32_on_cpu(tmp_path, tok, dataset, monkeypatch) -> None:
    """args=None: TRL's own default SFTConfig ("<model>-SFT"), in fp32 on a CPU-only machine
    (TRL's default, bf16 without use_cpu, is refused there by transformers)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="bf16"):
        trl.SFTConfig("plain-default")  # what TRL alone would do here
    trainer = EMDLMSFTTrainer(
        model=tiny_gpt2(len(tok)), train_dataset=dataset, processing_class=tok,
        loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    assert trainer.args.output_dir.endswith("-SFT")
    assert trainer.args.bf16 is False and trainer.accelerator.mixed_precision == "no"
    # the config emdlm builds pins no memory on CPU: torch's "'pin_memory' argument is set as
    # true but no accelerator is found" (shown at `super().__init__(loader)`) is not triggered
    assert trainer.args.dataloader_pin_memory is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(trainer.get_train_dataloader()))
    assert not [w for w in caught if "pin_memory" in str(w.message)]


@pytest.fixture(scope="module")
def trained_state(tmp_path_factory, tok, dataset) -> dict[str, torch.Tensor]:
    """A tiny model trained 12 steps (a random one gets about 1 token of 56 right)."""
    trainer = EMDLMSFTTrainer(
        model=tiny_gpt2(len(tok)), args=sft_config(tmp_path_factory.mktemp("trained")),
        train_dataset=dataset, processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _trained(tok, state) -> GPT2LMHeadModel:
    model = tiny_gpt2(len(tok))
    model.load_state_dict(state)
    return model


def _token_accuracy(tmp_path, tok, state, dataset, loss_fn, from_hidden: bool) -> list[float]:
    """TRL's logged ``mean_token_accuracy`` of one training-mode ``compute_loss`` on the first
    batch (the same tiny model and batch on both routes); [] when it is absent."""
    trainer = EMDLMSFTTrainer(
        model=_trained(tok, state), args=sft_config(tmp_path), train_dataset=dataset,
        processing_class=tok, loss_fn=loss_fn, from_hidden=from_hidden,
    )  # fmt: skip
    batch = _first_batch(trainer)
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch))
    return list(trainer._metrics["train"].get("mean_token_accuracy", []))


def _weighted_dataset():
    """The addition rows with loss weights, two of them 0 (scored as ignored labels)."""
    rows = [{**row, "loss_weight": [0.0, 2.0, 0.5, 1.0][i % 4]}
            for i, row in enumerate(addition_dataset(16, seed=1))]
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("option", ["predicted_tokens", "token_accuracy"])
def test_from_hidden_logs_the_logits_routes_mean_token_accuracy(
    tmp_path, tok, trained_state, option, weighted
) -> None:
    """From hidden states (no logits) ``mean_token_accuracy`` is the loss's own argmax count
    (hits and positions, as the logits route counts them; a weight-0 token is an ignored label
    on both), equal to the logits route's on the same batch; ``token_accuracy=True`` gives it
    only without loss weights (its weighted share is not a count), and a loss with neither
    option gives none."""
    data = _weighted_dataset() if weighted else addition_dataset(16, seed=1)

    def loss_fn(**options):
        return CrossEntropyLoss(reduction="sum", **options)

    state = trained_state
    by_logits = _token_accuracy(tmp_path, tok, state, data, loss_fn(**{option: True}), False)
    by_hidden = _token_accuracy(tmp_path, tok, state, data, loss_fn(**{option: True}), True)
    assert len(by_logits) == 1 and 0.0 < by_logits[0] < 1.0  # some hits, some misses
    if option == "token_accuracy" and weighted:
        assert by_hidden == []
    else:
        assert by_hidden == pytest.approx(by_logits, abs=1e-6)
    assert _token_accuracy(tmp_path, tok, state, data, loss_fn(), True) == []


def test_logits_route_mean_token_accuracy_skips_weight_zero_tokens(
    tmp_path, tok, trained_state
) -> None:
    """The logits route's count by hand: argmax == label over labels != -100 of weight > 0."""
    data = _weighted_dataset()
    trainer = EMDLMSFTTrainer(
        model=_trained(tok, trained_state), args=sft_config(tmp_path), train_dataset=data,
        processing_class=tok, loss_fn=CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    batch = _first_batch(trainer)
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch))
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"],
                               attention_mask=batch["attention_mask"]).logits
    labels, w = batch["labels"][:, 1:], batch["loss_weights"][:, 1:]
    mask = (labels != -100) & (w > 0)
    hits = (logits[:, :-1].argmax(-1) == labels) & (labels != -100)
    assert bool((hits & (w == 0)).any())  # weight-0 tokens the model gets right: not counted
    expected = float(((logits[:, :-1].argmax(-1) == labels) & mask).sum() / mask.sum())
    assert trainer._metrics["train"]["mean_token_accuracy"] == pytest.approx([expected], abs=1e-6)
