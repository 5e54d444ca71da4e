"""A run config for experiment grids whose cell folders the tests write by hand (never trained)."""

FAKE_BASE = {
    "model": {"name": "tiny-gpt2"},
    "tokenizer": "char",
    "data": {"train": {"task": "arithmetic", "n": 8},
             "eval": {"task": "arithmetic", "n": 4, "split": "test"}},
    "train": {"max_steps": 20, "save_steps": 10},
}
