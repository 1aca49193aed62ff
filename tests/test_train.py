"""Training end to end on the tiny target: single process, resume, 2-process DDP, refusals."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.config import load_recipe
from specheads.export.checkpoint import Checkpoint, latest_checkpoint
from specheads.train import TrainError, train

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"


def _overrides(target, data, out, **extra):
    base = {
        "target.path": str(target), "data.train": f"[{data / 'train.jsonl'}]",
        "data.max_length": 96, "head.draft_vocab_size": 256, "head.ttt_steps": 2,
        "train.output_dir": str(out), "train.batch_size": 4, "train.max_steps": 6,
        "train.log_every": 1, "train.save_every": 3, "train.warmup_steps": 2, "train.lr": 3e-3,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_checkpoints_and_learns(tiny_target_dir, demo_data_dir, tmp_path):
    out = tmp_path / "run"
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out,
                                            **{"train.max_steps": 30, "train.save_every": 10}))
    ckpt = train(recipe)
    assert ckpt == latest_checkpoint(out) and ckpt.name == "checkpoint-000030"
    assert len(list(out.glob("checkpoint-*"))) == 2  # keep_last
    loaded = Checkpoint(out)
    assert loaded.trainer_state["step"] == 30
    assert loaded.provenance["target"]["vocab_size"] == loaded.head_config["vocab_size"]
    assert loaded.recipe["train"]["max_steps"] == 30
    losses = _losses(out)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    d2t = loaded.weights["d2t"]
    assert d2t.dtype.is_floating_point is False and len(d2t) == 256


def test_resume_continues_with_identical_losses(tiny_target_dir, demo_data_dir, tmp_path):
    """Lose everything after the step-3 checkpoint (as a kill would), resume: same later losses."""
    out = tmp_path / "run"
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out))
    train(recipe)
    reference = _losses(out)
    shutil.rmtree(out / "checkpoint-000006")
    (out / "latest").write_text("checkpoint-000003\n")
    train(recipe)
    resumed = _losses(out)[len(reference):]
    assert len(resumed) == 3
    assert resumed == pytest.approx(reference[3:], rel=1e-6)
    assert Checkpoint(out).trainer_state["step"] == 6


def test_sglang_export_refuses_norm_before_residual(tiny_target_dir, demo_data_dir, tmp_path):
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, tmp_path / "r",
                                            **{"head.norm_before_residual": "true"}))
    with pytest.raises(TrainError, match="norm_before_residual"):
        train(recipe)
    assert not (tmp_path / "r").exists()


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", "29517"],
    # `accelerate launch --cpu --num_processes 2` silently runs one process; --multi_gpu on a
    # CPU-only machine gives a real 2-process gloo group (the Accelerator is built with cpu=True)
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port", "29518"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_process_ddp(launcher, tiny_target_dir, demo_data_dir, tmp_path):
    """A real 2-process gloo DDP run, launched the two ways users launch it."""
    out = tmp_path / "ddp"
    cmd = [*LAUNCHERS[launcher], "-m", "specheads.train", str(RECIPE),
           *_overrides(tiny_target_dir, demo_data_dir, out, **{"train.max_steps": 4})]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout
    ckpt = Checkpoint(out)
    assert ckpt.provenance["num_processes"] == 2 and ckpt.trainer_state["step"] == 4
    losses = _losses(out)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)  # logged once, by rank 0


def test_malformed_rows_fail_or_are_skipped_and_reported(tiny_target_dir, demo_data_dir, tmp_path, capsys):
    from specheads.data.conversations import DataError

    bad = tmp_path / "bad.jsonl"
    good = (demo_data_dir / "train.jsonl").read_text().splitlines()[:40]
    bad.write_text("\n".join(good[:20] + ['{"messages": [{"role": "bot", "content": "hi"}]}'] + good[20:]) + "\n")
    over = _overrides(tiny_target_dir, demo_data_dir, tmp_path / "r", **{"train.max_steps": 1})
    over = [o for o in over if not o.startswith("data.train=")] + [f"data.train=[{bad}]"]
    with pytest.raises(DataError, match=r"bad\.jsonl: row 20 .*'messages\[0\]\.role'"):
        train(load_recipe(RECIPE, over))
    assert not (tmp_path / "r").exists()
    train(load_recipe(RECIPE, over + ["data.skip_malformed=true"]))
    out = capsys.readouterr().out
    assert "40 of 41 rows" in out and "skipped 1 malformed" in out
