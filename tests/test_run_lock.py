"""Two `train` processes into one train.output_dir: the second is refused at once, naming the
folder and the live process; a killed run leaves no stuck lock (the next run trains)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import RECIPE, ROOT, _overrides

from specheads.atomic import OutputRefused
from specheads.config import load_recipe
from specheads.export.checkpoint import run_dir_refusal
from specheads.run_lock import LOCK_FILE, RunBusy, acquire, release
from specheads.train import train


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specheads", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=ROOT)


def _wait_for_holder(lock: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            info = json.loads(lock.read_text())
            if info.get("pid") == proc.pid:
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"run A never held {lock} (rc {proc.poll()})")


def test_a_second_train_into_the_same_folder_is_refused_and_a_killed_run_leaves_no_lock(
        tiny_target_dir, demo_data_dir, tmp_path):
    out = tmp_path / "run"
    long_run = _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 100000, "train.save_every": 100000, "train.schedule": "constant",
        "train.progress": "false"})
    a = _start(["train", str(RECIPE), *long_run])
    try:
        holder = _wait_for_holder(out / LOCK_FILE, a)
        other = _overrides(tiny_target_dir, demo_data_dir, out, **{"train.max_steps": 3, "train.lr": 0.01})
        t0 = time.monotonic()
        b = subprocess.run([sys.executable, "-m", "specheads", "train", str(RECIPE), *other], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
        refused_in = time.monotonic() - t0
        assert b.returncode == 1 and "Traceback" not in b.stderr, b.stderr
        assert f"train.output_dir {out} is in use by another training run: pid {a.pid} on host " \
               f"{holder['host']}, started " in b.stderr, b.stderr
        assert "train.output_dir to another folder" in b.stderr
        assert a.poll() is None  # A still trains, untouched
        assert refused_in < 60  # refused before any target or data loads (generous for a loaded machine)
    finally:
        a.send_signal(signal.SIGKILL)
        a.communicate(timeout=60)
    assert (out / LOCK_FILE).is_file()  # SIGKILL: the file stays, the kernel dropped the lock
    # the next run takes it over: trains and exits 0, and removes the lock file when done
    ckpt = train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 1, "train.schedule": "constant"})))
    assert ckpt.name == "checkpoint-000001"
    assert not (out / LOCK_FILE).exists()


def test_the_lock_in_one_process(tmp_path):
    folder = tmp_path / "new" / "run"
    lock = acquire(folder)
    assert folder.is_dir() and json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert run_dir_refusal(folder) is None  # a run still starting: ours, not a user's folder
    with pytest.raises(RunBusy, match=rf"{folder} is in use by another training run: pid {os.getpid()}"):
        acquire(folder)  # a second open file description: flock refuses it, even in one process
    assert isinstance(RunBusy("x"), OutputRefused)
    release(lock)
    assert not folder.exists()  # made by the lock, left empty: removed
    (tmp_path / "kept").mkdir()
    release(acquire(tmp_path / "kept"))
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())
