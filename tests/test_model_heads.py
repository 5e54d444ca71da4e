"""Every objective builds and trains on heads of models built from their configs.

A tied Qwen2 (or LLaMA) built from a config with a pad token has a ZERO row in its output
embedding: ``nn.Embedding(padding_idx=...)`` zeroes the pad row. EMO's cosine cost is undefined
there; emdlm gives that row cosine 0 (cost 1) to every token and warns once with the count.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from _objectives import SPECS
from emdlm.config import ObjectiveConfig
from emdlm.functional.emo import normalize_cost_embedding
from emdlm.losses.emo import EMOLoss, cost_embedding_from
from emdlm.objectives import build_objective

transformers = pytest.importorskip("transformers")


def _tiny_model(arch: str, vocab: int, pad_id: int) -> Any:
    common = dict(vocab_size=vocab, pad_token_id=pad_id, bos_token_id=0, eos_token_id=1)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True, **common,
        )  # fmt: skip
        return transformers.Qwen2ForCausalLM(cfg)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True, **common,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32, **common)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module", params=["qwen2", "llama", "gpt2"])
def head(request: pytest.FixtureRequest, char_tokenizer: Any) -> tuple[str, Any]:
    torch.manual_seed(0)
    pad_id = char_tokenizer.pad_token_id if char_tokenizer.pad_token_id is not None else 2
    return request.param, _tiny_model(request.param, len(char_tokenizer), pad_id)


def test_tied_qwen2_from_config_has_a_zero_row(char_tokenizer: Any) -> None:
    """The case of the audit: the pad row of a tied Qwen2's head is exactly zero."""
    model = _tiny_model("qwen2", len(char_tokenizer), pad_id=5)
    norms = cost_embedding_from(model).norm(dim=1)
    assert (norms == 0).nonzero().flatten().tolist() == [5]


def test_zero_rows_get_cost_one_and_one_warning() -> None:
    emb = torch.randn(6, 4, dtype=torch.float64)
    emb[[1, 4]] = 0.0
    with pytest.warns(UserWarning, match=r"2 zero row\(s\) \(indices \[1, 4\]") as record:
        emb_hat = normalize_cost_embedding(emb)
    assert len(record) == 1
    cost = 1.0 - emb_hat @ emb_hat.T  # C = 1 - cos
    assert torch.equal(cost[1], torch.ones(6, dtype=torch.float64))  # to every token, itself too
    assert torch.equal(cost[:, 4], torch.ones(6, dtype=torch.float64))
    others = [0, 2, 3, 5]
    torch.testing.assert_close(emb_hat[others].norm(dim=1), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("objective", sorted(SPECS))
def test_every_objective_on_heads_from_configs(
    objective: str, head: tuple[str, Any], char_tokenizer: Any
) -> None:
    arch, model = head
    vocab = len(char_tokenizer)
    cfg = ObjectiveConfig(name=objective, cost_embedding="model" if objective == "emo" else None)
    zero_rows = int((cost_embedding_from(model).norm(dim=1) == 0).sum())
    # the distillation objectives need a teacher: one more head of the same family (its cost
    # embedding, for emo_distill, is the teacher's head, with the same zero pad row)
    needs_teacher = SPECS[objective].needs_teacher
    teacher = _tiny_model(arch, vocab, model.config.pad_token_id) if needs_teacher else None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss_fn = build_objective(
            cfg, tokenizer=char_tokenizer, model=model, vocab_size=vocab, teacher=teacher
        )
    zero_warnings = [w for w in record if "zero row" in str(w.message)]
    assert len(zero_warnings) == (1 if objective in ("emo", "emo_distill") and zero_rows else 0)

    text = "12+34=46"
    ids = torch.tensor([char_tokenizer.convert_tokens_to_ids(list(text))])
    logits = model(input_ids=ids).logits[:, :-1]
    labels = ids[:, 1:].clone()
    labels[:, :4] = -100
    if teacher is None:
        out = loss_fn(logits, labels)
    else:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids).logits[:, :-1]
        out = loss_fn(logits, labels, teacher_logits=teacher_logits)
    assert torch.isfinite(out.loss) and float(out.loss.detach()) > 0
    model.zero_grad()
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if objective in ("emo", "emo_distill") and arch in ("qwen2", "llama"):
        assert zero_rows == 1  # the tied pad row: the case that used to be refused


def test_emo_from_model_on_a_gold_zero_row_is_finite(char_tokenizer: Any) -> None:
    """A gold token whose cost row is zero has DEMD = 1 (cost 1 to every token): finite loss."""
    model = _tiny_model("qwen2", len(char_tokenizer), pad_id=5)
    with pytest.warns(UserWarning, match="zero row"):
        loss_fn = EMOLoss.from_model(model)
    logits = torch.randn(1, 3, len(char_tokenizer), requires_grad=True)
    labels = torch.tensor([[5, 5, 7]])
    for impl in ("chunked", "reference"):
        loss_fn.implementation = impl
        out = loss_fn(logits, labels)
        assert torch.isfinite(out.loss)
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert torch.isfinite(grad).all()


def test_emdlm_tiny_llama_head_builds_emo(char_tokenizer: Any) -> None:
    """emdlm's own "tiny-llama" (tied, with a pad token) has the zero pad row too: the EMO
    objective with ``cost_embedding=model`` must build (it used to be refused)."""
    from emdlm.config import ModelConfig
    from emdlm.models import build_model

    model = build_model(ModelConfig(name="tiny-llama"), char_tokenizer)
    zero_rows = (cost_embedding_from(model).norm(dim=1) == 0).nonzero().flatten().tolist()
    assert zero_rows == [char_tokenizer.pad_token_id]
    cfg = ObjectiveConfig(name="emo", cost_embedding="model")
    with pytest.warns(UserWarning, match=r"1 zero row\(s\)"):
        loss_fn = build_objective(
            cfg, tokenizer=char_tokenizer, model=model, vocab_size=len(char_tokenizer)
        )
    ids = torch.tensor([char_tokenizer.convert_tokens_to_ids(list("7*8=56"))])
    out = loss_fn(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    assert torch.isfinite(out.loss)
