"""bench/gpu_train.py runs in its tiny CPU configuration (so the GPU script cannot rot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_train_bench_tiny_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--out", str(tmp_path),
                           "--preset", "tiny", "--batch-sizes", "1,3"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_train.json").read_text())
    train = report["training"]
    assert train["train_tokens_per_s"] > 0 and train["target_forward_tokens_per_s"] > 0
    verifier = report["verifier"]
    assert verifier["oracle_k3"]["tau"] > 3.0  # the ceiling: every draft accepted but the last step
    assert verifier["random_head_k3"]["tau"] < verifier["oracle_k3"]["tau"]  # random drafts lose
    assert all(row["greedy_equal"] for row in verifier.values() if isinstance(row, dict))  # fp32: exact
    rows = report["concurrency"]
    assert set(rows) == {"batch_1", "batch_3"}
    for name, row in rows.items():  # every row of a batch equals its plain decode
        assert row["greedy_equal_rows"] == row["rows"], name
        assert row["plain_tokens_per_s"] > 0 and row["oracle_k3_tokens_per_s"] > 0
    assert rows["batch_1"]["plain_vs_batch_1"] == 1.0
