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


def finished_text_grid(output_dir, seeds, metrics_of):
    """A hand-built, finished text grid (variants ce and emo, checkpoints: final, step 20): each
    cell gets ``metrics_of(variant, seed)`` as its metrics.json, one predictions row and its
    cell_done.json. Returns (experiment, cells)."""
    import json

    from emdlm.experiments import expand_grid
    from emdlm.experiments.cell_folder import CELL_DONE, eval_dir
    from emdlm.experiments.grid import parse_experiment

    exp = parse_experiment({"name": "t", "base": FAKE_BASE, "seeds": list(seeds),
                            "variants": {"ce": [], "emo": ["objective.name=ce"]},
                            "eval": {"checkpoints": "final"}, "output_dir": str(output_dir)})
    cells = expand_grid(exp)
    for cell in cells:
        folder = eval_dir(cell.folder, 20)
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps(metrics_of(cell.variant, cell.seed)))
        (folder / "predictions.jsonl").write_text(json.dumps(
            {"prompt": "a", "reference": "b", "samples": [" c"]}) + "\n")
        (cell.folder / CELL_DONE).write_text(json.dumps({"wall_s": 1.0}))
    return exp, cells
