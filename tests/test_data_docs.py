"""docs/data.md ("Your own data") runs as written: every ```bash block whole, from an empty
folder (it writes its data, trains a few steps, evaluates), and the ```python reader block on a
tiny ICDAR2015 folder laid out as the page's table says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme_snippets import SNIPPET_TIMEOUT_S, _blocks, _env, _failure

PAGE = Path(__file__).resolve().parents[1] / "docs" / "data.md"
BASH = _blocks(PAGE, "bash")
# what each bash block must leave behind (run folder -> files), in page order
EXPECTED = [
    ("runs/qa", ("model.safetensors", "train_summary.json", "eval/metrics.json")),
    ("runs/lm", ("model.safetensors", "train_log.jsonl")),
    ("runs/saved", ("model.safetensors", "train_summary.json")),
    ("runs/vlm", ("model.safetensors", "eval/metrics.json", "eval/contact_sheet.png")),
]


def test_the_page_has_the_documented_blocks():
    assert len(BASH) == len(EXPECTED)
    assert len(_blocks(PAGE, "python")) == 1


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_every_bash_block_runs(tmp_path, index):
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", BASH[index]], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, _failure(proc)
    folder, files = EXPECTED[index]
    for name in files:
        assert (tmp_path / folder / name).is_file(), f"{folder}/{name}\n{_failure(proc)}"
    if index == 2:  # the saved folder's validation split was the evaluation data
        summary = json.loads((tmp_path / folder / "train_summary.json").read_text())
        assert summary["global_step"] == 3


@pytest.mark.slow
def test_the_reader_block_runs_on_the_documented_layout(tmp_path):
    from PIL import Image

    images = tmp_path / "icdar2015" / "ch4_training_images"
    gts = tmp_path / "icdar2015" / "ch4_training_localization_transcription_gt"
    images.mkdir(parents=True)
    gts.mkdir()
    Image.new("RGB", (200, 100), "white").save(images / "img_1.jpg")
    (gts / "gt_img_1.txt").write_text(
        "\ufeff10,10,60,10,60,40,10,40,HELLO\n100,50,150,50,150,80,100,80,###\n",
        encoding="utf-8",
    )
    (block,) = _blocks(PAGE, "python")
    script = tmp_path / "reader.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, _failure(proc)
    rows = [json.loads(x) for x in (tmp_path / "icdar_train.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and Path(rows[0]["image"]).is_absolute()
    assert rows[0]["completion"] != "none"  # the one cared-for word's box; ### left out
    assert "1 rows; first answer:" in proc.stdout


def test_a_dataset_folder_split_is_its_own_name_a_task_split_is_checked(tmp_path):
    """docs/data.md: `split: validation` reads a DatasetDict's split of that name; a generator
    has train / dev / test only; a folder without the split names the ones it has."""
    import datasets

    from emdlm.config import ConfigError, DataSourceConfig, build_config
    from emdlm.data import load_examples

    rows = [{"prompt": "1+1=", "completion": "2"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "validation": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "ds"))
    folder = DataSourceConfig(path=str(tmp_path / "ds"), split="validation")
    cfg = build_config({"data": {"train": {"path": str(tmp_path / "ds")},
                                        "eval": {"path": str(tmp_path / "ds"),
                                                 "split": "validation"}}})
    cfg.validate()
    assert load_examples(folder, seed=0) == rows
    with pytest.raises(ConfigError, match=r"has splits \['train', 'validation'\], not 'dev'"):
        load_examples(DataSourceConfig(path=str(tmp_path / "ds"), split="dev"), seed=0)
    with pytest.raises(ConfigError, match=r"data\.train\.split='validation' is not valid"):
        build_config({"data": {"train": {"task": "arithmetic", "split": "validation"}}}).validate()
