"""The SmolLM2 recipe's drafter trained on this machine from another run's regenerated conversations:
a result found elsewhere (bench/gpu_quality.py on a GPU) checked on the CPU with the same data and steps.

    python bench/retrain_real.py --data RUN/data --target SMOLLM2 --out DIR [--epochs 4] [--batch-size 8] \
        [--results FILE.json] [key=value recipe overrides ...]

DATA is a `bench/real_model.py` run's data folder (train.jsonl, heldout.jsonl). Stages, each skipped
when DIR already holds it (a cut run goes on): capture (int8 features), train (E epochs, one checkpoint
per epoch, resumable), table (held-out teacher-forced tau of every epoch, as real_model.py's).
Writes DIR/retrain.json and DIR/retrain.md (and FILE.json / FILE.md with --results).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings

import real_model  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402


def markdown(r: dict) -> str:
    lines = ["# The SmolLM2 recipe retrained from a run's data", "", f"`{r['command']}`", "",
             f"{r['samples']} conversations, {r['info']['steps']} steps ({r['epochs']} epochs, batch {r['batch_size']}), "
             f"overrides {r['overrides'] or 'none'}; torch {r['torch']}, {r['threads']} threads. Capture "
             f"{r['capture_s']:.0f} s, training {r['train_s']:.0f} s (this call's: a stage DIR already held costs only "
             "its reload).", "",
             "| epoch | step | held-out tau | conditional acceptance |", "|---:|---:|---:|---|"]
    lines += [f"| {t['epoch']} | {t['step']} | {t['tau']:.3f} | {' / '.join(f'{a:.2f}' for a in t['acc_cond'])} |"
              for t in r["table"]]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path, help="a real_model.py run's data folder")
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--results", type=Path, default=None, help="also write the JSON here (and its .md beside)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=512)
    a, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    train, heldout = a.data / "train.jsonl", a.data / "heldout.jsonl"
    missing = [f for f in (train, heldout, a.target / "config.json") if not f.is_file()]
    if missing:
        p.error(f"{missing[0]}: no such file (--data needs a real_model.py run's data folder, --target a HF folder)")
    common = [f"head.draft_vocab_size={a.draft_vocab}", f"data.max_length={a.max_length}", *overrides]
    features, ckpt = a.out / "features", a.out / "ckpt"
    t0 = time.time()
    if not (features / "manifest.json").is_file():
        real_model.capture(a.target, train, features, common, "int8")
    t1 = time.time()
    samples = sum(1 for _ in train.open())
    info = real_model.train_run(a.target, train, features, ckpt, samples, a, common)
    t2 = time.time()
    table = real_model.epochs_table(a.target, heldout, {"1": {"dir": str(ckpt), "info": info}}, a.max_length)
    report = {"command": " ".join(["python", "bench/retrain_real.py", *(argv if argv is not None else sys.argv[1:])]),
              "samples": samples, "epochs": a.epochs, "batch_size": a.batch_size, "overrides": overrides,
              "info": info, "capture_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "table": [{k: t[k] for k in ("epoch", "step", "tau", "acc_cond")} for t in table]}
    for target in [a.out / "retrain.json"] + ([a.results] if a.results else []):
        write_json(target, report)
        write_text(target.with_suffix(".md"), markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
