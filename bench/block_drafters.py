"""DFlash and DSpark side by side on one run's data and step budget: full-block acceptance, tau and
greedy equality from every exported folder, and DSpark's confidence-head calibration.

    python bench/block_drafters.py --run runs/real900 --out runs/block-real [--kinds dflash,dspark] \
        [--epochs E] [--limit 16] [--max-new-tokens 96]
    python -m specheads.engines.matrix --out runs/block-real/engine-check --runs-only \
        --run runs/block-real/dspark:TARGET --run runs/block-real/dflash:TARGET --engines vllm,sglang

RUN is a `make real` run (bench/real_model.py --out RUN): each kind trains its SmolLM2 recipe
(recipes/<kind>/smollm2-135m-cpu.yaml, its taps set to the capture's) on RUN's regenerated conversations
from RUN's own int8 feature capture (the target does not run again), with RUN's batch size and seed
and RUN's steps per epoch x `--epochs` (default: RUN's epochs). Or a `make demo` run (RUN/target):
recipes/<kind>/demo.yaml on its regenerated answers, the recipe's steps.

Every format the recipe exports (OUT/<kind>/export/<format>, the layout `engines.matrix --run` reads)
is loaded back as users serve it and decodes the first `--limit` held-out prompts (MT-bench first
turns for a real run) greedily with a chain of the whole block (k = G drafted tokens): tau, the
unconditional acceptance at every slot (full-block acceptance = all G drafts accepted), the wall-clock
speed-up over plain decoding on the same prompts, and whether every output equals plain greedy.
DSpark's confidence head is then probed on the same decodes (`verify.calibration.ConfidenceProbe`:
its P(slot accepted | earlier accepted) against what the target settled): ECE raw and cross-fitted.
A finished kind (OUT/<kind>/trained.json) is not trained again; training resumes from its last
checkpoint. Writes OUT/block_drafters.json and OUT/block_drafters.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings

import quality_ab_real  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402
from specheads.cli import main as cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("dflash", "dspark")


class BenchError(ValueError):
    """A run folder or option this bench cannot use (the message says which and what to do)."""


def run_setup(run: Path, epochs: int | None, steps: int | None = None) -> dict:
    """What the kinds train on and are measured with: target, data, cache, budget, prompts, recipe name."""
    if (run / "real_model.json").is_file():
        try:
            real = quality_ab_real.real_setup(run)
        except quality_ab_real.NotARealRun as e:
            raise BenchError(str(e)) from None
        budget = real["budget"]
        steps = steps or budget["steps_per_epoch"] * (epochs or real["epochs"])
        taps = json.loads((real["features"] / "manifest.json").read_text())["layers"]  # hidden-state indices
        return {"target": real["target"], "train": real["train"], "features": real["features"],
                "recipe": "smollm2-135m-cpu", "prompts": run / "data" / "mt_bench_first.jsonl",
                "overrides": [f"train.batch_size={real['batch_size']}", f"train.max_steps={steps}",
                              f"train.warmup_steps={max(1, steps // 20)}", f"data.max_length={real['max_length']}",
                              f"head.target_layer_ids=[{','.join(str(t - 1) for t in taps)}]"],  # the capture's taps
                "budget": f"{steps} steps x batch {real['batch_size']} on the run's {budget['samples']} regenerated "
                          "conversations, from its int8 feature capture"}
    if (run / "target").exists():
        data = run / "data" / "train_regen.jsonl"
        return {"target": run / "target", "train": data if data.is_file() else run / "data" / "train.jsonl",
                "features": None, "recipe": "demo", "prompts": run / "data" / "heldout_prompts.jsonl",
                "overrides": [f"train.max_steps={steps}"] if steps else [],
                "budget": f"{steps or 'the demo recipes'} steps on the demo's regenerated answers"}
    raise BenchError(f"--run {run}: neither a `make real` run (no real_model.json) nor a `make demo` run "
                     f"(no target); run bench/real_model.py --out {run} or make demo RUN={run} first")


def train_kind(kind: str, setup: dict, out: Path) -> dict:
    """Train `kind` (resumable); {"checkpoint", "train_s", "steps"} (read again once finished)."""
    done = out / kind / "trained.json"
    if done.is_file():
        return json.loads(done.read_text())
    recipe = ROOT / "recipes" / kind / f"{setup['recipe']}.yaml"
    ckpt_dir = out / kind / "ckpt"
    args = ["train", str(recipe), f"target.path={setup['target']}", f"data.train=[{setup['train']}]",
            f"train.output_dir={ckpt_dir}", "train.keep_last=1", "train.progress=false", *setup["overrides"]]
    if setup["features"] is not None:
        args.append(f"data.features={setup['features']}")
    t0 = time.time()
    if cli(args) != 0:
        raise BenchError(f"training {kind} failed ({' '.join(args)}); its log is above")
    from specheads.export.checkpoint import Checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(ckpt_dir)
    result = {"checkpoint": str(ckpt), "train_s": round(time.time() - t0, 1),
              "steps": Checkpoint(ckpt).trainer_state["step"]}
    write_json(done, result)
    return result


def exports(kind: str, ckpt: Path, out: Path) -> dict[str, Path]:
    """format -> export folder, every format the kind's checkpoint recipe names (written once)."""
    from specheads.export import export
    from specheads.export.checkpoint import Checkpoint

    folders = {}
    for fmt in Checkpoint(ckpt).recipe["export"]["formats"]:
        folder = out / kind / "export" / fmt
        if not (folder / "config.json").is_file():
            export(ckpt, fmt, folder)
        folders[fmt] = folder
    return folders


def decode_all(target, proposer_of, prompts, k: int, max_new_tokens: int):
    """(summed DecodeStats, outputs) over the prompts; proposer_of() None = plain greedy."""
    from specheads.session import eos_ids
    from specheads.verify.loop import decode, greedy_decode
    from specheads.verify.steps import DecodeStats

    eos, total, outputs = eos_ids(target), DecodeStats(), []
    for _, ids in prompts:
        proposer = proposer_of()
        res = (greedy_decode(target, ids, max_new_tokens, eos) if proposer is None
               else decode(target, proposer, ids, max_new_tokens, k, eos))
        total = total.add(res.stats)
        outputs.append(res.tokens)
    return total, outputs


def measure_format(target, folder: Path, prompts, plain: dict, max_new_tokens: int) -> dict:
    """A chain of the whole block from the export at `folder`: tau, per-slot acceptance, speed, equality."""
    from specheads.session import load_draft
    from specheads.verify.registry import make_proposer
    from specheads.verify.settings import make_tree_spec

    head = load_draft(folder, target).head
    k = block_drafts(head)
    spec = make_tree_spec("chain", k=k)
    decode_all(target, lambda: make_proposer(spec, head, target), prompts[:1], k, 8)  # warm-up, not timed
    stats, outputs = decode_all(target, lambda: make_proposer(spec, head, target), prompts, k, max_new_tokens)
    s = stats.summary()
    rate = stats.tokens / stats.wall_s
    return {"k": k, "tau": s["tau"], "acceptance_per_position": s["acceptance_per_position"],
            "acceptance_per_position_conditional": s["acceptance_per_position_conditional"],
            "full_block_acceptance": s["acceptance_per_position"][k - 1],
            "tokens_per_s": rate, "measured_speedup": rate / plain["tokens_per_s"],
            "greedy_equal": sum(o == r for o, r in zip(outputs, plain["outputs"])), "prompts": len(prompts)}


def block_drafts(head) -> int:
    """G: tokens a block drafts (DSpark's block_size; DFlash's block is the anchor + G)."""
    cfg = head.config
    return cfg.block_size if head.kind == "dspark" else cfg.block_size - 1


def confidence_report(target, folder: Path, prompts, max_new_tokens: int, position_rates: list[float]) -> dict | None:
    """DSpark's confidence head against what the target settled on the same decodes (None: no head)."""
    from specheads.session import load_draft
    from specheads.verify.calibration import ConfidenceProbe, calibration_report
    from specheads.verify.dspark_proposers import SampledDSparkProposer

    head = load_draft(folder, target).head
    if getattr(head, "confidence_head", None) is None:
        return None
    probes = []

    def probe():
        probes.append(ConfidenceProbe(SampledDSparkProposer(head, target), fold=len(probes) % 2))
        return probes[-1]

    decode_all(target, probe, prompts, block_drafts(head), max_new_tokens)
    report = calibration_report([r for p in probes for r in p.records], position_rates)
    return {k: report[k] for k in ("records", "accepted", "ece_raw", "ece_calibrated", "reliability_raw")}


def markdown(report: dict) -> str:
    c = report["conditions"]
    lines = ["# DFlash and DSpark side by side", "",
             f"`{report['command']}`. Target `{c['target_name']}`; {c['budget']}; {c['prompts']} prompts of "
             f"`{c['prompts_file']}`, {c['max_new_tokens']} new tokens, greedy, a chain of the whole block, batch 1, "
             f"our verifier, fp32, {c['threads']} threads, {c['machine']['cpus']} CPUs ({c['machine']['cpu']}, load "
             f"{c['machine']['load_1min']} at the start). Full-block acceptance: the share of "
             "blocks whose every drafted token the target accepted. Plain decoding: "
             f"{report['plain']['tokens_per_s']:.1f} tok/s.", "",
             "| kind | format | G | tau | full-block acceptance | acceptance at slots 1..G | speed-up | greedy equal | train s |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for row in report["rows"]:
        acc = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
        lines.append(f"| {row['kind']} | {row['format']} | {row['k']} | {row['tau']:.3f} | "
                     f"{row['full_block_acceptance']:.3f} | {acc} | {row['measured_speedup']:.2f}x | "
                     f"{row['greedy_equal']}/{row['prompts']} | {row['train_s']} |")
    for kind, conf in report["confidence"].items():
        lines += ["", f"{kind}'s confidence head on the same decodes ({conf['records']} settled slots, "
                  f"{conf['accepted']} accepted): ECE {conf['ece_raw']:.3f} as trained, {conf['ece_calibrated']:.3f} "
                  "after eval's cross-fitted calibration map.", "",
                  "| confidence bin | slots | mean confidence | accepted |", "|---|---:|---:|---:|"]
        for b in conf["reliability_raw"]:
            lines.append(f"| {b['bin'][0]:.2f}-{b['bin'][1]:.2f} | {b['count']} | {b['mean_predicted']:.3f} | "
                         f"{b['observed']:.3f} |")
    return "\n".join(lines) + "\n"


def bench(run: Path, out: Path, kinds: list[str], epochs: int | None, steps: int | None, limit: int,
          max_new_tokens: int, argv: list[str]) -> dict:
    from heads import _verifier_module

    from specheads.data.prompts import read_prompts
    from specheads.provenance import machine
    from specheads.target import Target

    setup = run_setup(run, epochs, steps)
    trained = {kind: train_kind(kind, setup, out) for kind in kinds}
    target = Target.load(str(setup["target"]), device="cpu")
    prompts = _verifier_module().encode_rows(target, read_prompts(setup["prompts"], limit))
    decode_all(target, lambda: None, prompts[:1], 0, 8)  # warm-up, not timed
    stats, outputs = decode_all(target, lambda: None, prompts, 0, max_new_tokens)
    plain = {"tokens_per_s": stats.tokens / stats.wall_s, "outputs": outputs}
    rows, confidence = [], {}
    for kind in kinds:
        folders = exports(kind, Path(trained[kind]["checkpoint"]), out)
        for fmt, folder in folders.items():
            rows.append({"kind": kind, "format": fmt, "train_s": trained[kind]["train_s"],
                         **measure_format(target, folder, prompts, plain, max_new_tokens)})
            print(f"[block-drafters] {kind} {fmt}: tau {rows[-1]['tau']:.3f}, full block "
                  f"{rows[-1]['full_block_acceptance']:.3f}, greedy equal {rows[-1]['greedy_equal']}/{len(prompts)}", flush=True)
        conf = confidence_report(target, next(iter(folders.values())), prompts, max_new_tokens,
                                 rows[-1]["acceptance_per_position_conditional"])
        if conf is not None:
            confidence[kind] = conf
    cond = {"target_name": target.fingerprint()["name"], "prompts_file": str(setup["prompts"]), "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(), "machine": machine(),
            "budget": setup["budget"]}
    report = {"command": " ".join(["python", "bench/block_drafters.py", *argv]), "conditions": cond,
              "plain": {"tokens_per_s": plain["tokens_per_s"]}, "rows": rows, "confidence": confidence,
              "trained": trained}
    write_json(out / "block_drafters.json", report)
    write_text(out / "block_drafters.md", markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, type=Path, help="a `make real` or `make demo` run folder")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"some of {', '.join(KINDS)}")
    p.add_argument("--epochs", type=int, default=None, help="a real run: epochs of its steps (default: the run's)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the run's budget)")
    p.add_argument("--limit", type=int, default=16, help="prompts decoded")
    p.add_argument("--max-new-tokens", type=int, default=96)
    a = p.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds {a.kinds}: expected some of {', '.join(KINDS)}")
    if any(v is not None and v < 1 for v in (a.epochs, a.steps)):
        p.error("--epochs and --steps must be >= 1")
    try:
        report = bench(a.run, a.out, kinds, a.epochs, a.steps, a.limit, a.max_new_tokens, argv)
    except BenchError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    print(markdown(report), end="")
    return 0 if all(r["greedy_equal"] == r["prompts"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
