"""A training process killed with SIGKILL mid-epoch resumes from its last checkpoint and logs
exactly the losses of an uninterrupted run (data order, RNG, optimizer and scheduler restored)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specheads.config import load_recipe
from specheads.train import train

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"
STEPS, SAVE = 40, 4


def _overrides(target, data, out) -> list[str]:
    over = {"target.path": str(target), "data.train": f"[{data / 'train.jsonl'}]", "data.max_length": 96,
            "head.draft_vocab_size": 256, "head.ttt_steps": 2, "train.output_dir": str(out),
            "train.batch_size": 4, "train.max_steps": STEPS, "train.log_every": 1, "train.save_every": SAVE,
            "train.warmup_steps": 3, "train.lr": 3e-3, "train.schedule": "wsd", "train.keep_last": 2,
            "train.progress": "false"}
    return [f"{k}={v}" for k, v in over.items()]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _kill_after_first_checkpoint(cmd, out: Path) -> int:
    """Start training, SIGKILL it as soon as a checkpoint exists; return the step it was killed after."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    deadline = time.monotonic() + 900  # generous: a loaded machine trains slowly; the condition decides
    try:
        while not (out / "latest").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)  # nothing happens if it already ended
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (out / "latest").is_file(), f"no checkpoint before the run ended or 900 s passed: {err[-2000:]!r}"
    assert proc.returncode == -signal.SIGKILL, f"not killed mid-run (rc {proc.returncode}): {err[-2000:]!r}"
    return int((out / "latest").read_text().strip().split("-")[1])


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tiny_target_dir, demo_data_dir, tmp_path, capsys):
    reference = tmp_path / "reference"
    train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, reference)))
    expected = [r["loss"] for r in _records(reference)]
    assert len(expected) == STEPS

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "specheads.train", str(RECIPE), *_overrides(tiny_target_dir, demo_data_dir, out)]
    killed_at = _kill_after_first_checkpoint(cmd, out)
    assert SAVE <= killed_at < STEPS  # mid-run, and the epoch has 63 steps: mid-epoch too

    capsys.readouterr()
    train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out)))
    assert f"resumed from {out / f'checkpoint-{killed_at:06d}'}" in capsys.readouterr().out
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one run's log, no duplicates
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in _records(reference)], rel=1e-9)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{STEPS - SAVE:06d}",
                                                                 f"checkpoint-{STEPS:06d}"]
