"""The drafter-quality A/B on SmolLM2: each option of bench/quality_ab.py trained on a finished `make real`
run's own data, feature cache and step budget, scored per epoch exactly as that run's table is.

    python bench/quality_ab_real.py --run runs/real900 --out DIR [--configs eagle31,lk,...] [--seeds 0,1]

RUN is a `bench/real_model.py --out RUN` folder past its `train_1` stage: its target, its regenerated
train conversations, its int8 feature cache (features_1, so the target does not run again), its
steps, batch size and seed (the SmolLM2 recipe's). The baseline is RUN's own checkpoints (not trained
again). Every configuration is quality_ab.py's overrides over the SmolLM2 recipe (which already sets
EAGLE 3.1's `norm_before_fc`: a configuration with `fc_norm` turns it off, the two exclude each other;
`no_norm_before_fc` is the 2025 head). Held-out teacher-forced tau of every epoch's checkpoint on
RUN's held-out regenerated conversations (real_model.py's `epochs_table`). A configuration costs a
training run (~15-30 min on 2 cores for 900 conversations x 4 epochs) per seed: `--seeds` beyond RUN's
own seed train the baseline too (DIR/baseline-seedS), and every configuration again (DIR/<name>-seedS),
and the report adds each configuration's mean and spread of final tau over the seeds. A finished configuration
(DIR/<name>/result.json) is read again, an unfinished one resumes from its last checkpoint.
Writes DIR/quality_ab_real.json and DIR/quality_ab_real.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings

import quality_ab  # noqa: E402
import real_model  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402

EXTRA = {  # SmolLM2-only rows: the 2025 head, the optimizer, step sizes (the recipe's was 1e-3 until lr2e3 won)
    "no_norm_before_fc": ["head.norm_before_fc=false"],
    "adamw": ["train.optimizer=adamw"],  # the recipe's optimizer before Muon
    "lr5e4": ["train.lr=5e-4"],
    "norm_output": ["head.norm_output=true"],  # EAGLE 3.1's fed-back post-norm state, with norm_before_fc
    "clip1": ["train.max_grad_norm=1.0"],
    "lr2e3": ["train.lr=2e-3"],
    "lr3e3": ["train.lr=3e-3"],
    "freeze_lm_head": ["head.freeze_lm_head=true"],  # the recipe's init_lm_head rows, kept (EAGLE-1's frozen head)
    "wd": ["train.weight_decay=0.1"],
    "muon_freeze": ["train.optimizer=muon", "head.freeze_lm_head=true"],
    "muon_wd": ["train.optimizer=muon", "train.weight_decay=0.1"],
    "muon_noise": ["train.optimizer=muon", "head.feature_noise=uniform", "head.feature_noise_scale=0.1"],
}


def configs() -> dict[str, list[str]]:
    """name -> overrides over the SmolLM2 recipe (quality_ab's, `norm_before_fc` being the baseline here)."""
    out = {}
    for name, overrides in {**quality_ab.CONFIGS, **EXTRA}.items():
        if name in ("baseline", "norm_before_fc"):
            continue
        off = ["head.norm_before_fc=false"] if "head.fc_norm=true" in overrides else []
        # SGLang 0.5.23 has no Qwen3-style EAGLE-3 loader: a qk_norm head is exported for vLLM only
        only_vllm = ["export.formats=[vllm]"] if "head.qk_norm=true" in overrides else []
        out[name] = [*off, *overrides, *only_vllm]
    return out


def overrides_of(name: str, known: dict[str, list[str]]) -> list[str]:
    """NAME's overrides; A+B: A's then B's (a later key wins), the configurations combined."""
    return [o for part in name.split("+") for o in known[part]]


class NotARealRun(ValueError):
    """--run is not a finished `make real` run (the message names the file and what is missing)."""


def real_setup(run: Path) -> dict:
    """What RUN holds: target, data, feature cache, the train stage's budget and the settings."""
    stages = run / "stages.json"
    # real_model.json once the run finished; settings.json (written at its start) for one stopped at --until export
    report = next((p for p in (run / "real_model.json", run / "settings.json") if p.is_file()), run / "real_model.json")
    try:
        budget = json.loads(stages.read_text())["train_1"]["result"]
        made = json.loads(report.read_text())
        settings = made["settings"]
    except (OSError, ValueError, KeyError) as e:
        raise NotARealRun(f"--run {run}: not a finished `make real` run ({stages} with a train_1 stage and "
                          f"{report} are needed; {type(e).__name__}: {e}); run bench/real_model.py --out {run} first") from None
    missing = [p for p in (run / "data" / "train.jsonl", run / "data" / "heldout.jsonl", run / "features_1",
                           run / "ckpt_1") if not p.exists()]
    if missing:
        raise NotARealRun(f"--run {run}: {missing[0]} is missing; run bench/real_model.py --out {run} again")
    target = Path(settings["target"]) if settings.get("target") else run / "target"  # --gguf: converted there
    from specheads.export.checkpoint import Checkpoint

    seed = Checkpoint(run / "ckpt_1").recipe["train"]["seed"]  # the seed RUN's own checkpoints were trained with
    return {"target": target, "train": run / "data" / "train.jsonl",
            "heldout": run / "data" / "heldout.jsonl", "features": run / "features_1", "baseline": run / "ckpt_1",
            "budget": budget, "epochs": settings["epochs"], "batch_size": settings["batch_size"],
            "overrides": [f"head.draft_vocab_size={settings['draft_vocab']}", f"data.max_length={settings['max_length']}",
                          *made.get("overrides", [])],  # the run's own recipe overrides, as its training had
            "max_length": settings["max_length"], "seed": seed}


def scored(setup: dict, ckpt_dir: Path) -> list[dict]:
    """Held-out tau of each epoch's checkpoint in CKPT_DIR (real_model's table rows)."""
    rows = real_model.epochs_table(setup["target"], setup["heldout"],
                                   {"1": {"dir": str(ckpt_dir), "info": setup["budget"]}}, setup["max_length"],
                                   setup.get("device", "cpu"))
    return [{"epoch": r["epoch"], "step": r["step"], "tau": r["tau"]} for r in rows]


def run_baseline(setup: dict, out: Path) -> dict:
    """RUN's own checkpoints scored once (OUT/baseline/result.json, read again while it names the
    same checkpoints): a later invocation with other configurations does not score them again."""
    done, ckpt = out / "baseline" / "result.json", str(setup["baseline"])
    cached = json.loads(done.read_text()) if done.is_file() else {}
    if cached.get("ckpt") == ckpt:
        return {k: v for k, v in cached.items() if k != "ckpt"}
    result = {"config": "baseline", "overrides": [], "train_s": None, "epochs": scored(setup, setup["baseline"])}
    write_json(done, {**result, "ckpt": ckpt})
    return result


def run_config(name: str, overrides: list[str], setup: dict, out: Path) -> dict:
    """Train one configuration from RUN's cache with RUN's budget (resumable) and score it."""
    done = out / name / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    t0 = time.time()
    args = argparse.Namespace(batch_size=setup["batch_size"], epochs=setup["epochs"])
    real_model.train_run(setup["target"], setup["train"], setup["features"], out / name / "ckpt",
                         setup["budget"]["samples"], args, [*setup["overrides"], *overrides])
    train_s = time.time() - t0
    result = {"config": name, "overrides": overrides, "train_s": round(train_s, 1),
              "epochs": scored(setup, out / name / "ckpt")}
    write_json(done, result)
    return result


def markdown(report: dict) -> str:
    c = report["conditions"]
    lines = ["# Drafter-quality A/B on SmolLM2-135M-Instruct (the `make real` data)", "",
             f"`{report['command']}`: {c['samples']} regenerated conversations, {c['steps']} steps "
             f"({c['epochs']} epochs, batch {c['batch_size']}), seeds {', '.join(map(str, c['seeds']))}, from the run's "
             "int8 feature cache; "
             f"held-out teacher-forced tau (chain of 3, bonus included) on its {c['heldout']} held-out regenerated "
             f"conversations after each epoch. torch {c['torch']}, {c['threads']} threads, {c['cpus']} CPUs"
             f"{'' if c.get('device', 'cpu') == 'cpu' else ', target and training on ' + c['device'] + ' (fp32)'}; "
             "train seconds count whatever else ran on the machine."]
    for group in [report, *report.get("other_seeds", [])]:
        base = group["baseline"]["epochs"]
        lines += ["", f"Seed {group.get('seed', c['seeds'][0])}:", "",
                  "| config | overrides over the SmolLM2 recipe | tau per epoch | final tau | vs baseline | train s |",
                  "|---|---|---|---:|---:|---:|"]
        for r in [group["baseline"], *group["configs"]]:
            taus = [e["tau"] for e in r["epochs"]]
            lines.append(f"| {r['config']} | {' '.join(r['overrides']) or '(the run itself)'} | "
                         f"{' / '.join(f'{t:.3f}' for t in taus)} | {taus[-1]:.3f} | {taus[-1] - base[-1]['tau']:+.3f} | "
                         f"{r['train_s'] if r['train_s'] is not None else '-'} |")
    if report.get("other_seeds"):
        lines += ["", "Over the seeds (final tau; spread = max - min):", "",
                  "| config | mean | spread | vs baseline mean | per seed |", "|---|---:|---:|---:|---|"]
        base_mean = report["summary"]["baseline"]["mean"]
        for name, row in report["summary"].items():
            lines.append(f"| {name} | {row['mean']:.3f} | {row['spread']:.3f} | {row['mean'] - base_mean:+.3f} | "
                         f"{' '.join(f'{t:.3f}' for t in row['taus'])} |")
    return "\n".join(lines) + "\n"


def summary(groups: list[dict]) -> dict:
    """config -> final tau per seed, their mean and spread (the baseline first)."""
    finals: dict[str, list[float]] = {}
    for g in groups:
        for r in [g["baseline"], *g["configs"]]:
            finals.setdefault(r["config"].split("-seed")[0], []).append(r["epochs"][-1]["tau"])
    return {name: {"taus": taus, "mean": sum(taus) / len(taus), "spread": max(taus) - min(taus)}
            for name, taus in finals.items()}


def main(argv: list[str] | None = None) -> int:
    known = configs()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, type=Path, help="a finished bench/real_model.py run folder")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--configs", default="eagle31", help=f"some of {', '.join(known)}")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds (default: RUN's own)")
    p.add_argument("--device", default="cpu", help="where the target scores the checkpoints (cpu; cuda on a GPU, "
                                                   "fp32 as on the CPU; training takes the GPU whenever there is one)")
    a = p.parse_args(argv)
    names = a.configs.split(",")
    unknown = [part for n in names for part in n.split("+") if part not in known]
    if unknown:
        p.error(f"--configs: unknown '{unknown[0]}'; expected some of {', '.join(known)} (A+B: both together)")
    try:
        setup = {**real_setup(a.run), "device": a.device}
    except NotARealRun as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in (a.seeds or str(setup["seed"])).split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds}: expected comma-separated integers, e.g. 0,1")
    if seeds[0] != setup["seed"]:
        p.error(f"--seeds: the first seed must be the run's own ({setup['seed']}), whose checkpoints are the baseline")
    a.out.mkdir(parents=True, exist_ok=True)
    groups = []
    for seed in seeds:
        own = seed == setup["seed"]
        tag, extra = ("", []) if own else (f"-seed{seed}", [f"train.seed={seed}"])
        baseline = run_baseline(setup, a.out) if own else run_config(f"baseline{tag}", extra, setup, a.out)
        results = []
        for name in names:
            results.append(run_config(f"{name}{tag}", [*overrides_of(name, known), *extra], setup, a.out))
            print(f"[quality-ab-real] {name}{tag}: final tau {results[-1]['epochs'][-1]['tau']:.3f} "
                  f"(baseline {baseline['epochs'][-1]['tau']:.3f})", flush=True)
        groups.append({"seed": seed, "baseline": baseline, "configs": results})
    cond = {"samples": setup["budget"]["samples"], "steps": setup["budget"]["steps"], "epochs": setup["epochs"],
            "batch_size": setup["batch_size"], "heldout": sum(1 for _ in setup["heldout"].open()),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "seeds": seeds,
            "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(torch.device(a.device))}
    report = {"command": " ".join(["python", "bench/quality_ab_real.py", *(argv if argv is not None else sys.argv[1:])]),
              "conditions": cond, "baseline": groups[0]["baseline"], "configs": groups[0]["configs"]}
    if len(groups) > 1:
        report.update(other_seeds=groups[1:], summary=summary(groups))
    write_json(a.out / "quality_ab_real.json", report)
    write_text(a.out / "quality_ab_real.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
