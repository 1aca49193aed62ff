"""`specheads demo` end to end as a real process, on the seconds-sized 'test' target preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_pipeline_smoke(tmp_path):
    run = tmp_path / "demo"
    env = {**os.environ, "SPECHEADS_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "specheads", "demo", "--run", str(run), "--preset", "test"]  # the preset alone
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rel in ("target/config.json", "data/train_regen.jsonl", "checkpoint/latest", "export/vllm/config.json",
                "export/sglang/config.json", "eval/metrics.json", "eval/outputs.jsonl",
                "demo_summary.json"):
        assert (run / rel).is_file(), rel
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert metrics["greedy_equal"] is True
    assert "n-gram" in proc.stdout and "vllm serve" in proc.stdout and "sglang" in proc.stdout
    shown = {"hybrid": "hybrid choose", "union": "union (drafter", "adaptive": "adaptive draft length"}
    for key, label in shown.items():  # the hybrid rows of the table, with measured and predicted speed-up
        assert label in proc.stdout and metrics[key]["greedy_equal"] is True and metrics[key]["predicted_speedup"] > 0
    assert "best per engine:" in proc.stdout
    assert len((run / "eval" / "outputs.jsonl").read_text().splitlines()) >= 3
    conc = json.loads((run / "concurrency" / "concurrency.json").read_text())  # the speed-up by concurrency table
    assert [r["batch_size"] for r in conc["rows"]] == [1, 8, 32] and all(r["greedy_equal"] == 3 for r in conc["rows"])
    assert "speed-up by concurrency" in proc.stdout and "num_speculative_tokens_per_batch_size" in proc.stdout


def test_demo_refuses_a_max_length_beyond_the_context_before_regenerating(tmp_path):
    """The recipe is checked before the slow step: no prompt is answered, the message names the fix."""
    env = {**os.environ, "SPECHEADS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "specheads", "demo", "--run", str(tmp_path / "demo"), "--preset", "test",
           "data.max_length=512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "data.max_length = 512 exceeds the target's context of 256" in proc.stderr, proc.stderr[-3000:]
    assert "answers" not in proc.stderr and not (tmp_path / "demo" / "data" / "train_regen.jsonl").exists()
