"""Run configs for experiment-grid tests: FAKE_BASE for cell folders the tests write by hand
(never trained), TINY_BASE for grids that really train."""

FAKE_BASE = {
    "model": {"name": "tiny-gpt2"},
    "tokenizer": "char",
    "data": {"train": {"task": "arithmetic", "n": 8},
             "eval": {"task": "arithmetic", "n": 4, "split": "test"}},
    "train": {"max_steps": 20, "save_steps": 10},
}

# a grid that really trains: 1-layer GPT-2, 2-digit add/sub, a few steps per cell
TINY_BASE = {
    "model": {"name": "tiny-gpt2", "params": {"n_layer": 1, "n_head": 2, "n_embd": 32,
                                              "n_positions": 32}},
    "tokenizer": "char",
    "data": {
        "train": {"task": "arithmetic", "n": 128, "params": {"max_digits": 2, "ops": "+-"}},
        "eval": {"task": "arithmetic", "n": 8, "split": "test",
                 "params": {"max_digits": 2, "ops": "+-"}},
        "max_length": 24,
    },
    "optim": {"lr": 1.0e-2},
    "train": {"batch_size": 16, "max_steps": 20, "save_steps": 10, "logging_steps": 10,
              "tensorboard": False},
    "eval": {"kind": "number", "max_new_tokens": 4, "batch_size": 16},
}
