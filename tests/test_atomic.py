"""Atomic writes: a failure half-way leaves neither a partial destination nor temp files."""

import pytest

from specheads.atomic import atomic_dir, write_text


def test_failed_dir_write_leaves_nothing(tmp_path):
    dest = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "head.safetensors").write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_dir_replace_keeps_old_until_new_is_complete(tmp_path):
    dest = tmp_path / "export"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(ValueError):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("new, unfinished")
            raise ValueError("validation failed")
    assert (dest / "a").read_text() == "old"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("new")
    assert (dest / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_write_text_is_atomic(tmp_path):
    path = tmp_path / "latest"
    write_text(path, "checkpoint-000001\n")
    assert path.read_text() == "checkpoint-000001\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
