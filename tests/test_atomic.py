"""Atomic writes: a failure half-way leaves neither a partial destination nor temp files; a user's
folder is never replaced; modes follow the umask; what a killed writer left is removed next time."""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specheads.atomic import OutputRefused, atomic_dir, remove_stale, save_safetensors, write_json, write_text

ROOT = Path(__file__).resolve().parent.parent


def test_failed_dir_write_leaves_nothing(tmp_path):
    dest = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "head.safetensors").write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_dir_replace_keeps_old_until_new_is_complete(tmp_path):
    dest = tmp_path / "export"
    ours = lambda d: (d / "a").is_file()  # noqa: E731  (what marks the folder as this writer's)
    with atomic_dir(dest, owned=ours) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(ValueError):
        with atomic_dir(dest, owned=ours) as tmp:
            (tmp / "a").write_text("new, unfinished")
            raise ValueError("validation failed")
    assert (dest / "a").read_text() == "old"
    with atomic_dir(dest, owned=ours) as tmp:
        (tmp / "a").write_text("new")
    assert (dest / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_write_text_is_atomic(tmp_path):
    path = tmp_path / "latest"
    write_text(path, "checkpoint-000001\n")
    assert path.read_text() == "checkpoint-000001\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under root: (mode, bytes) for files, (mode, link target) for links, mode for folders."""
    out = {}
    for p in sorted([root, *root.rglob("*")]):
        st = p.lstat()
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = (st.st_mode, os.readlink(p))
        elif p.is_dir():
            out[key] = (st.st_mode,)
        else:
            out[key] = (st.st_mode, p.read_bytes())
    return out


def user_tree(root: Path) -> Path:
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("mine")
    (root / "data.bin").write_bytes(os.urandom(1000))
    (root / "data.bin").chmod(0o640)
    (root / "link").symlink_to("data.bin")
    return root


def test_a_folder_that_is_not_ours_is_refused_and_untouched(tmp_path):
    dest = user_tree(tmp_path / "mine")
    before = tree_state(tmp_path)
    with pytest.raises(OutputRefused, match=r"mine is not a training checkpoint.*3 file\(s\).*data\.bin.*Nothing was"):
        with atomic_dir(dest, owned=lambda d: (d / "trainer_state.json").is_file(), what="a training checkpoint"):
            raise AssertionError("the body must not run")
    assert tree_state(tmp_path) == before
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputRefused, match="not a folder"):
        with atomic_dir(tmp_path / "file"):
            pass
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty) as tmp:  # nothing to lose: an empty folder is replaced
        (tmp / "a").write_text("1")
    assert (empty / "a").read_text() == "1"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_modes_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "x.json").write_text("{}")
            save_safetensors({"w": torch.zeros(2)}, tmp / "w.safetensors")  # safetensors alone makes 0600
        write_text(tmp_path / "latest", "x\n")
        write_json(tmp_path / "m.json", {})
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "c.safetensors")
    finally:
        os.umask(old)
    files = [tmp_path / "out" / "sub" / "x.json", tmp_path / "out" / "w.safetensors", tmp_path / "latest",
             tmp_path / "m.json", tmp_path / "c.safetensors"]
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    for d in (tmp_path / "out", tmp_path / "out" / "sub"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, d


def test_hard_linked_files_keep_their_mode(tmp_path):
    src = tmp_path / "target.safetensors"
    src.write_bytes(b"x")
    src.chmod(0o444)
    with atomic_dir(tmp_path / "out") as tmp:
        os.link(src, tmp / "shard.safetensors")
    assert stat.S_IMODE(src.stat().st_mode) == 0o444


KILLED_WRITER = """
import sys, time, torch
from specheads.atomic import atomic_dir, save_safetensors
dest, what = sys.argv[1], sys.argv[2]
if what == "dir":
    with atomic_dir(dest) as tmp:
        (tmp / "part").write_text("half")
        print("inside", flush=True)
        time.sleep(60)
else:
    import safetensors.torch as st
    real = st.save_file
    def slow(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        print("inside", flush=True)
        time.sleep(60)
    st.save_file = slow
    save_safetensors({"w": torch.zeros(1000)}, dest)
"""


@pytest.mark.parametrize("what", ["dir", "file"])
def test_a_killed_writer_leaves_a_temporary_that_the_next_write_removes(tmp_path, what):
    dest = tmp_path / ("export" if what == "dir" else "shard.safetensors")
    (tmp_path / ".export.tmp-keep").mkdir()  # a user's hidden folder of a similar name: not ours
    (tmp_path / ".tmp-notes").write_text("mine")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(dest), what], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "inside"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{dest.name}.tmp-{proc.pid}-")]
    assert len(left) == 1 and not dest.exists()  # what a kill leaves
    if what == "dir":
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("1")
    else:
        save_safetensors({"w": torch.ones(3)}, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dest.name, ".export.tmp-keep", ".tmp-notes"])


def test_a_live_writers_temporary_is_kept(tmp_path):
    live = tmp_path / f".out.tmp-{os.getppid()}-abcdefgh"  # the parent process is alive
    live.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f".out.tmp-{dead.pid}-abcdefgh"
    gone.mkdir()
    time.sleep(0.01)
    assert remove_stale(tmp_path, "out") == [gone]
    assert live.is_dir()
