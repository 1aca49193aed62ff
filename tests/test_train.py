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
import torch

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
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 5, "loss": 9.0}\n')
    train(recipe)
    resumed = _losses(out)  # records after the resumed-from step were dropped, then rewritten
    assert len(resumed) == 6
    assert resumed == pytest.approx(reference, rel=1e-6)
    assert Checkpoint(out).trainer_state["step"] == 6


def test_sglang_export_refuses_norm_before_residual(tiny_target_dir, demo_data_dir, tmp_path):
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, tmp_path / "r",
                                            **{"head.norm_before_residual": "true"}))
    with pytest.raises(TrainError, match="norm_before_residual"):
        train(recipe)
    assert not (tmp_path / "r").exists()


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--standalone"],  # a free port: concurrent sessions on one machine never collide
    # `accelerate launch --cpu --num_processes 2` silently runs one process; the CPU launch config
    # (MULTI_GPU on a CPU-only machine) gives a real 2-process gloo group (Accelerator(cpu=True))
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "recipes" / "accelerate" / "cpu.yaml"), "--main_process_port", "0"],  # 0: a free port
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
    # a pipe gets the main process's log lines (step, loss, tokens/s), not a \r progress bar, and only once
    logged = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ") and "tok/s" in ln]
    assert logged and "\r" not in proc.stdout + proc.stderr and len(logged) == len(set(logged))
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


def test_keep_last_plus_best_by_validation_tau(tmp_path):
    from specheads.export.checkpoint import save_checkpoint
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
    from tests.random_models import make_target

    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=2, draft_vocab_size=64), make_target().config)
    for step, tau in ((1, 1.5), (2, 2.0), (3, 1.7), (4, 1.6)):
        save_checkpoint(tmp_path, step, head, {}, {}, {"val_tau": tau}, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-000002", "checkpoint-000004"]
    assert (tmp_path / "best").read_text().strip() == "checkpoint-000002"
    assert latest_checkpoint(tmp_path).name == "checkpoint-000004"


def test_validation_trackers_schedule_and_peak_memory(tiny_target_dir, demo_data_dir, tmp_path, monkeypatch):
    """Held-out offline tau every 2 steps (equal to eval.offline on the best checkpoint), wandb
    offline files and tensorboard events carrying the logged losses, the wsd schedule."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from specheads.data.samples import prepare_samples
    from specheads.eval.offline import offline_acceptance
    from specheads.schedule import lr_factor, validation_split
    from specheads.target import Target

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 8, "train.save_every": 4, "train.val_every": 2, "train.val_samples": 12,
        "train.schedule": "wsd", "train.decay_fraction": 0.5, "train.report_to": "[wandb, tensorboard]"}))
    train(recipe)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_tau" in r] == [2, 4, 6, 8]
    assert all(r["peak_mem_gib"] > 0 for r in records)
    lrs = [r["lr"] for r in records]
    assert lrs == pytest.approx([3e-3 * lr_factor(s, 8, 2, "wsd", 0.5) for s in range(1, 9)])
    assert lrs[1] == lrs[2] == 3e-3 > lrs[5] > lrs[7] == 0.0  # warmup, stable, decay

    best = out / (out / "best").read_text().strip()
    target = Target.load(str(tiny_target_dir), device="cpu")
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    held = [samples[i] for i in validation_split(len(samples), 12, 0)[1]]
    tau = offline_acceptance(target, Checkpoint(best).build_head(), held)["decode_order"]["tau"]  # EAGLE-3
    assert Checkpoint(best).trainer_state["val_tau"] == pytest.approx(tau, rel=1e-5)
    assert tau == max(r["val_tau"] for r in records if "val_tau" in r)  # every validation competes for best

    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    events = EventAccumulator(str(next(out.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    logged = [e.value for e in events.Scalars("loss")]
    assert logged == pytest.approx([r["loss"] for r in records], rel=1e-5)


def test_bf16_autocast_trains_the_head_with_fp32_master_weights(tiny_target_dir, demo_data_dir, tmp_path):
    runs = {}
    for precision in ("no", "bf16"):
        out = tmp_path / precision
        train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
            "train.max_steps": 2, "train.mixed_precision": precision})))
        runs[precision] = (_losses(out), Checkpoint(out).weights)
    (fp32, _), (bf16, w16) = runs["no"], runs["bf16"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=3e-2)  # autocast ran, and agrees
    assert w16["fc.weight"].dtype == torch.float32  # master weights stay fp32


def test_resume_refuses_a_corrupted_checkpoint_and_cleans_a_killed_save(tiny_target_dir, demo_data_dir, tmp_path):
    """Flipped bits in the latest checkpoint: resume is refused by name (nothing carried forward);
    with that checkpoint set aside, a killed save's temporary folder is removed by the next save."""
    out = tmp_path / "run"
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{"train.schedule": "constant"}))
    train(recipe)
    head = out / "checkpoint-000006" / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-3] ^= 0x01
    head.write_bytes(bytes(data))
    longer = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 9, "train.schedule": "constant"}))  # constant: a longer run is the same schedule
    with pytest.raises(ValueError, match=r"checkpoint-000006/head\.safetensors: checksum mismatch.*latest"):
        train(longer)
    shutil.move(out / "checkpoint-000006", tmp_path / "set-aside")
    (out / "latest").write_text("checkpoint-000003\n")
    killed = out / ".checkpoint-000009.tmp-999999999-abcdefgh"  # a save cut short (no such process)
    killed.mkdir()
    (killed / "head.safetensors").write_bytes(b"half")
    train(longer)
    assert Checkpoint(out).trainer_state["step"] == 9 and not list(out.glob(".*"))
