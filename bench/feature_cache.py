"""Feature cache benchmark: bytes per token (bf16, int8) and the tau cost of training from 8-bit features.

    OMP_NUM_THREADS=1 python bench/feature_cache.py --out runs/bench/feature_cache.json \
        --batch-size 8 --max-length 256 --seed-spread        # CPU-sized: ~15 min on 2 cores

Captures the demo data's EAGLE-3 features (recipes/demo/eagle3.yaml) in bf16 and int8, then trains
the same head with the recipe's own trainer (`specheads.train.train`: same seed, same batches, same
schedule, `train.max_steps` steps) three times: online (a target forward per batch), from the bf16
cache and from the int8 cache. Each final checkpoint's offline (teacher-forced) tau is measured on
held-out conversations (modules the training data never saw). `--seed-spread` adds an online run
with another seed, so the storage effects can be read against the seed-to-seed spread.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from specheads.atomic import write_json
from specheads.config import load_recipe
from specheads.data.features import capture, read_manifest
from specheads.data.samples import prepare_samples
from specheads.eval.offline import offline_acceptance
from specheads.export.checkpoint import Checkpoint
from specheads.target import Target
from specheads.train import train

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo" / "eagle3.yaml"


def storage_stats(folder: Path, seconds: float) -> dict:
    """Bytes per token of a capture (shard tensors only, and everything written) and its estimate."""
    m = read_manifest(folder)
    shard_bytes = sum(s["bytes"] for s in m["shards"])
    return {"bytes_per_token": round(shard_bytes / m["num_tokens"], 2),
            "bytes_per_token_all_files": round(m["bytes"] / m["num_tokens"], 2), "tokens": m["num_tokens"],
            "bytes_written": m["bytes"], "estimated_bytes": m["estimated_bytes"],
            "estimate_error": round(abs(m["estimated_bytes"] - m["bytes"]) / m["bytes"], 4),
            "capture_s": round(seconds, 1)}


def last_loss(run_dir: Path) -> float | None:
    """The final logged training loss of a run (metrics.jsonl)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    return losses[-1] if losses else None


def train_and_score(overrides: list[str], run_dir: Path, target, held_samples, log) -> dict:
    """Train with the recipe's trainer, then the final checkpoint's offline acceptance on held-out data."""
    recipe = load_recipe(RECIPE, [*overrides, f"train.output_dir={run_dir}"])
    t0 = time.time()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        ckpt = train(recipe)
    seconds = time.time() - t0
    head = Checkpoint(ckpt).build_head()
    acc = offline_acceptance(target, head, held_samples)
    return {"offline_tau": round(acc["tau_est"], 6), "acc_uncond": [round(a, 6) for a in acc["acc_uncond"]],
            "held_rows": acc["rows"], "final_train_loss": last_loss(run_dir), "train_s": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/feature_cache.json")
    p.add_argument("--target", default="builtin:tiny")
    p.add_argument("--data", default=None, help="folder with train.jsonl + heldout.jsonl (default: demo data, built)")
    p.add_argument("--modules", type=int, default=200, help="stdlib modules for the built demo data")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's train.max_steps)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's train.batch_size")
    p.add_argument("--max-length", type=int, default=None, help="default: the recipe's data.max_length")
    p.add_argument("--held", type=int, default=96, help="held-out samples for offline tau")
    p.add_argument("--seed-spread", action="store_true", help="also train online with seed 1")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="feature-cache-") as tmp:  # captures and runs: hundreds of MB
        result = run(a, Path(tmp))
    write_json(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


def run(a, work: Path) -> dict:
    """Build data, capture bf16 + int8, train online / from each cache, score held-out tau."""
    data = Path(a.data) if a.data else work / "data"
    if not a.data:
        from specheads.builtin.stdlib import write_demo_data

        write_demo_data(data, limit=a.modules)
    base = load_recipe(RECIPE, [f"target.path={a.target}"])
    steps = a.steps or base.train.max_steps
    over = [f"target.path={a.target}", f"data.train=[{data / 'train.jsonl'}]", f"train.max_steps={steps}",
            f"train.save_every={steps}", "train.keep_last=1", f"train.log_every={max(1, steps // 10)}",
            f"train.batch_size={a.batch_size or base.train.batch_size}",
            f"data.max_length={a.max_length or base.data.max_length}"]
    recipe = load_recipe(RECIPE, over)
    held = load_recipe(RECIPE, [*over[:1], f"data.train=[{data / 'heldout.jsonl'}]", over[-1]])
    target = Target.load(recipe.target.path, dtype=recipe.target.dtype, device="cpu",
                         attn_implementation=recipe.target.attn_implementation)
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    held_samples = prepare_samples(held, target.tokenizer, report=lambda *_: None)[:a.held]
    r = recipe.train
    result = {"target": a.target, "recipe": "recipes/demo/eagle3.yaml", "train_samples": len(samples),
              "train_tokens": sum(len(s.input_ids) for s in samples), "held_samples": len(held_samples),
              "steps": steps, "batch_size": r.batch_size, "lr": r.lr, "seed": r.seed,
              "max_length": recipe.data.max_length, "storage": {}, "runs": {}}
    log = io.StringIO()
    for dtype in ("bfloat16", "int8"):
        t0 = time.time()
        capture(recipe, work / dtype, storage=dtype, shard_mb=64, report=lambda *x, **k: None)
        result["storage"][dtype] = storage_stats(work / dtype, time.time() - t0)
        print(f"capture {dtype}: {result['storage'][dtype]}", flush=True)
    runs = {"online": [], "bf16_cache": [f"data.features={work / 'bfloat16'}"],
            "int8_cache": [f"data.features={work / 'int8'}"]}
    if a.seed_spread:
        runs["online_seed1"] = ["train.seed=1"]
    for name, extra in runs.items():
        result["runs"][name] = train_and_score([*over, *extra], work / "runs" / name, target, held_samples, log)
        print(f"{name}: {result['runs'][name]}", flush=True)
    tau = {k: v["offline_tau"] for k, v in result["runs"].items()}
    result["offline_tau"] = tau
    result["tau_cost_bf16"] = round(tau["online"] - tau["bf16_cache"], 6)
    result["tau_cost_int8"] = round(tau["online"] - tau["int8_cache"], 6)
    result["tau_cost_int8_vs_bf16"] = round(tau["bf16_cache"] - tau["int8_cache"], 6)
    if "online_seed1" in tau:
        result["seed_spread"] = round(abs(tau["online"] - tau["online_seed1"]), 6)
    return result


if __name__ == "__main__":
    main()
