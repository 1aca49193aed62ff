"""A/B of the drafter-quality options on the demo target: each option alone and combined, several
seeds, the same data and step budget; held-out teacher-forced tau (mean +- spread over seeds).

    nice -n 10 env OMP_NUM_THREADS=1 python bench/quality_ab.py --out runs/quality-ab \
        [--steps 80] [--seeds 0,1,2] [--configs baseline,muon,...] [--train 400] [--heldout 48]

The target is the embedded demo target (`builtin:tiny`, preset default). Its own greedy answers to
`--train` demo train prompts are the training data and its answers to `--heldout` held-out prompts
(other stdlib modules) the evaluation data, so tau measures agreement with what the target itself
generates. Every configuration trains an EAGLE-3 head from recipes/demo/eagle3.yaml with the
configuration's overrides for `--steps` steps; the final checkpoint (no selection on the held-out
set) is scored by `eval/offline.py` (teacher-forced chain tau, bonus included, k = ttt_steps).
Writes OUT/quality_ab.json (every run, the conditions) and OUT/quality_ab.md; the committed copy
is bench/results/quality_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"
# the A/B's baseline is the 2025 head: the demo recipe's EAGLE 3.1 norm_before_fc and init_lm_head
# (adopted from this A/B) are off, so each option is measured alone as in the committed results
BASE = ["train.batch_size=8", "data.max_length=192", "train.warmup_steps=10", "train.log_every=20",
        "train.val_samples=0", "train.keep_last=1", "train.progress=false", "export.formats=[vllm]",
        "head.norm_before_fc=false", "head.init_lm_head=false"]
CONFIGS = {  # name -> recipe overrides over BASE (each option alone, then combined)
    "baseline": [],
    "muon": ["train.optimizer=muon"],
    "tv": ["head.loss=tv"],
    "lk": ["head.loss=lk"],
    "noise": ["head.feature_noise=uniform", "head.feature_noise_scale=0.1"],
    "dropout": ["head.dropout=0.1"],
    "eagle31": ["head.fc_norm=true", "head.norm_output=true"],
    "norm_before_fc": ["head.norm_before_fc=true"],
    "qk_norm": ["head.qk_norm=true"],
    "init_lm_head": ["head.init_lm_head=true"],
    "nbf_init_lm_head": ["head.norm_before_fc=true", "head.init_lm_head=true"],
    "supervise_all": ["data.supervise=all"],  # distil on the user turns too: more labels from the same data
    "decay1": ["head.step_decay=1.0"],  # deeper TTT steps weigh as much as the first
    "combined": ["train.optimizer=muon", "head.loss=lk", "head.fc_norm=true", "head.norm_output=true",
                 "head.qk_norm=true"],
}


def answered(target_dir: Path, src: Path, dest: Path, count: int) -> Path:
    """`dest`: `count` conversations of `src` answered greedily by the target (reused when there)."""
    from specheads.builtin.stdlib import MAX_PROMPT_CHARS
    from specheads.data.conversations import read_conversations
    from specheads.data.regenerate_turns import regenerate_local
    from specheads.target import Target

    if dest.is_file():
        return dest
    convs, _ = read_conversations(src)
    convs = [c for c in convs if len(c.messages[0].content) <= MAX_PROMPT_CHARS]
    convs = convs[:: max(1, len(convs) // count)][:count]
    convs, _ = regenerate_local(Target.load(str(target_dir)), convs, max_new_tokens=96, batch_size=32,
                                progress=False)
    rows = [{"id": c.id, "messages": [{"role": m.role, "content": m.content} for m in c.messages]} for c in convs]
    dest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return dest


def prepare_data(out: Path, n_train: int, n_heldout: int) -> tuple[Path, Path, Path]:
    """(target folder, train file, held-out file) under OUT/data."""
    from specheads.builtin.stdlib import write_demo_data
    from specheads.builtin.tiny_target import cached_tiny_target

    target = cached_tiny_target("default", progress=False)
    data = out / "data"
    if not (data / "heldout.jsonl").is_file():
        write_demo_data(data)
    train = answered(target, data / "train.jsonl", data / f"train_answers_{n_train}.jsonl", n_train)
    held = answered(target, data / "heldout.jsonl", data / f"heldout_answers_{n_heldout}.jsonl", n_heldout)
    return target, train, held


def heldout_tau(recipe, ckpt: Path, held: Path) -> dict:
    """Teacher-forced acceptance of the checkpoint on the held-out answers."""
    from specheads.config import load_recipe
    from specheads.data.samples import prepare_samples
    from specheads.eval.offline import offline_acceptance
    from specheads.export.checkpoint import Checkpoint
    from specheads.target import Target

    target = Target.load(recipe.target.path, device="cpu")
    held_recipe = load_recipe(RECIPE, [f"target.path={recipe.target.path}", f"data.train=[{held}]",
                                       f"data.max_length={recipe.data.max_length}"])
    samples = prepare_samples(held_recipe, target.tokenizer, report=lambda *_: None)
    res = offline_acceptance(target, Checkpoint(ckpt).build_head(), samples)
    return {"tau": res["tau_est"], "acc": res["acc_uncond"], "rows": res["rows"]}


def run_one(name: str, seed: int, steps: int, target: Path, train_file: Path, held: Path, out: Path) -> dict:
    from specheads.config import load_recipe
    from specheads.train import train

    run = out / "runs" / f"{name}-s{seed}"
    overrides = [f"target.path={target}", f"data.train=[{train_file}]", f"train.output_dir={run}",
                 f"train.max_steps={steps}", f"train.save_every={steps}", f"train.seed={seed}",
                 *BASE, *CONFIGS[name]]
    recipe = load_recipe(RECIPE, overrides)
    t0 = time.time()
    ckpt = train(recipe)
    train_s = time.time() - t0
    loss = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    return {"config": name, "seed": seed, "train_s": round(train_s, 1), "final_loss": loss,
            **heldout_tau(recipe, ckpt, held)}


def summarise(runs: list[dict]) -> dict:
    """config -> tau mean, spread (max - min over seeds), std, per-seed values."""
    out = {}
    for name in dict.fromkeys(r["config"] for r in runs):
        taus = [r["tau"] for r in runs if r["config"] == name]
        out[name] = {"tau_mean": statistics.mean(taus), "tau_spread": max(taus) - min(taus),
                     "tau_std": statistics.stdev(taus) if len(taus) > 1 else 0.0, "taus": taus,
                     "train_s_mean": statistics.mean(r["train_s"] for r in runs if r["config"] == name)}
    return out


def conditions(steps: int, seeds: list[int], wall_s: float, n_train: int, n_heldout: int) -> dict:
    return {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "niceness": os.nice(0), "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "steps": steps, "seeds": seeds, "train_conversations": n_train, "heldout_conversations": n_heldout,
            "base_overrides": BASE, "wall_s": round(wall_s, 1)}


def markdown(summary: dict, cond: dict) -> str:
    base = summary.get("baseline", {}).get("tau_mean")
    lines = ["# Drafter-quality A/B (EAGLE-3 on the demo target)", "",
             f"`nice -n 10 env OMP_NUM_THREADS=1 python bench/quality_ab.py`: {cond['steps']} steps, seeds "
             f"{cond['seeds']}, {cond['train_conversations']} target-answered train conversations, "
             f"{cond['heldout_conversations']} held-out ones; torch {cond['torch']}, {cond['torch_threads']} "
             f"thread(s), nice {cond['niceness']}, {cond['cpu_count']} CPUs, load average at the end "
             f"{', '.join(f'{x:.2f}' for x in cond['loadavg_at_end'])}; {cond['wall_s']:.0f} s in all.",
             "", "Held-out teacher-forced tau (chain of ttt_steps = 3, bonus included) of the final checkpoint; "
             "spread = max - min over seeds.", "",
             "| config | tau mean | spread | std | vs baseline | per seed | train s |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for name, s in summary.items():
        delta = f"{s['tau_mean'] - base:+.3f}" if base is not None else ""
        lines.append(f"| {name} | {s['tau_mean']:.3f} | {s['tau_spread']:.3f} | {s['tau_std']:.3f} | {delta} | "
                     f"{' '.join(f'{t:.3f}' for t in s['taus'])} | {s['train_s_mean']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--train", type=int, default=400, help="train conversations answered by the target")
    p.add_argument("--heldout", type=int, default=48, help="held-out conversations answered by the target")
    a = p.parse_args(argv)
    names = a.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown '{unknown[0]}'; expected some of {', '.join(CONFIGS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    target, train_file, held = prepare_data(a.out, a.train, a.heldout)
    runs = []
    for name in names:
        for seed in seeds:
            runs.append(run_one(name, seed, a.steps, target, train_file, held, a.out))
            print(f"[quality-ab] {name} seed {seed}: tau {runs[-1]['tau']:.3f} ({runs[-1]['train_s']} s)", flush=True)
    cond = conditions(a.steps, seeds, time.time() - t0, a.train, a.heldout)
    summary = summarise(runs)
    (a.out / "quality_ab.json").write_text(json.dumps({"conditions": cond, "summary": summary, "runs": runs},
                                                       indent=2) + "\n")
    (a.out / "quality_ab.md").write_text(markdown(summary, cond))
    print(markdown(summary, cond))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
