"""Feature cache benchmark: bytes per token (bf16, int8) and the tau cost of training from 8-bit features.

    python bench/feature_cache.py --out runs/bench/feature_cache.json [--target builtin:tiny] [--steps 60]

Captures the demo data's EAGLE-3 features in bf16 and int8, then trains the same head from the
same initialisation on the same batches online (target forwards) and from the int8 cache, and
compares their offline (teacher-forced) tau on held-out conversations. CPU-sized.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specheads.atomic import write_json
from specheads.config import load_recipe
from specheads.data.features import OfflineFeatures, capture, read_manifest
from specheads.data.tokenize import collate
from specheads.eval.offline import offline_acceptance
from specheads.target import Target
from specheads.train import build_head, head_inputs, prepare_samples

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo" / "eagle3.yaml"


def train_short(recipe, target, samples, features, steps: int, batch_size: int, lr: float):
    """A fixed-seed head trained for `steps` batches; `features` None = online."""
    torch.manual_seed(0)
    head = build_head(recipe, target, samples)
    optim = torch.optim.AdamW(head.parameters(), lr=lr)
    source = features(head) if features else None
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(len(samples), (batch_size,), generator=gen).tolist()
        batch = collate([samples[i] for i in idx], target.tokenizer.pad_token_id or 0)
        head(**head_inputs(target, head, batch, source)).loss.backward()
        optim.step()
        optim.zero_grad()
    return head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/feature_cache.json")
    p.add_argument("--target", default="builtin:tiny")
    p.add_argument("--data", default=None, help="train.jsonl + heldout.jsonl folder (default: demo data, built)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    a = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="feature-cache-"))
    data = Path(a.data) if a.data else work / "data"
    if not a.data:
        from specheads.builtin.stdlib import write_demo_data

        write_demo_data(data, n_prompts=8, limit=60)
    over = [f"target.path={a.target}", f"data.train=[{data / 'train.jsonl'}]", f"data.max_length={a.max_length}",
            "head.draft_vocab_size=256"]
    recipe = load_recipe(RECIPE, over)
    held = load_recipe(RECIPE, over[:1] + [f"data.train=[{data / 'heldout.jsonl'}]"] + over[2:])
    target = Target.load(recipe.target.path, device="cpu")
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    held_samples = prepare_samples(held, target.tokenizer, report=lambda *_: None)[:64]
    result = {"target": a.target, "samples": len(samples), "steps": a.steps, "storage": {}}
    for dtype in ("bfloat16", "int8"):
        t0 = time.time()
        folder = capture(recipe, work / dtype, storage=dtype, shard_mb=64, report=lambda *x, **k: None)
        m = read_manifest(folder)
        shard_bytes = sum(s["bytes"] for s in m["shards"])
        result["storage"][dtype] = {
            "bytes_per_token": round(shard_bytes / m["num_tokens"], 2), "tokens": m["num_tokens"],
            "bytes_written": m["bytes"], "estimated_bytes": m["estimated_bytes"],
            "estimate_error": round(abs(m["estimated_bytes"] - m["bytes"]) / m["bytes"], 4),
            "capture_s": round(time.time() - t0, 2)}
    taus = {}
    for name, features in (("online", None),
                           ("int8_cache", lambda h: OfflineFeatures(work / "int8", target, h))):
        head = train_short(recipe, target, samples, features, a.steps, a.batch_size, 3e-3)
        taus[name] = offline_acceptance(target, head, held_samples)
    result["offline_tau"] = {k: v.get("tau", v.get("tau_est")) for k, v in taus.items()}
    result["offline_acceptance"] = taus
    result["tau_cost_int8"] = round(result["offline_tau"]["online"] - result["offline_tau"]["int8_cache"], 4)
    write_json(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "offline_acceptance"}, indent=2))


if __name__ == "__main__":
    main()
