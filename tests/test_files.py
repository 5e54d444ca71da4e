"""emdlm._files.atomic_write: whole-or-nothing writes for shared caches."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from emdlm._files import atomic_write


def test_writes_text_and_bytes_readable_by_all(tmp_path: Path) -> None:
    with atomic_write(tmp_path / "a.json") as f:
        f.write('{"x": 1}')
    with atomic_write(tmp_path / "b.bin", binary=True) as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == '{"x": 1}'
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    for name in ("a.json", "b.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]


def test_target_appears_only_when_the_block_ends(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old", encoding="utf-8")
    with atomic_write(target) as f:
        f.write("new")
        f.flush()
        assert target.read_text(encoding="utf-8") == "old"  # a reader meanwhile sees the old file
    assert target.read_text(encoding="utf-8") == "new"


def test_error_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old", encoding="utf-8")
    with pytest.raises(RuntimeError, match="boom"), atomic_write(target) as f:
        f.write("half")
        raise RuntimeError("boom")
    assert target.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
