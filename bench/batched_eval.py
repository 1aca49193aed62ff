"""Batched eval: `specheads eval` at several batch sizes on the same prompts, in one run.

    python bench/batched_eval.py --target T --draft EXPORT --prompts FILE --out DIR \
        [--batch-sizes 1,8] [--limit N] [--max-new-tokens 128] [--k K] [--device auto] [--no-predict]

Each batch size runs the whole `eval.online.evaluate` (into DIR/b<N>/: metrics.json, outputs.jsonl,
report.md) after the same warm-up, one after another in this process. Writes DIR/batched_eval.json
and DIR/batched_eval.md: per batch size the wall seconds of the whole eval and of its first pass
(the decodes eval/waves.py batches), tau and greedy equality of each method, and against the first
batch size: the time ratio, whether each method's tau is the same, and whether the outputs are
(every turn's plain and speculative tokens). The drafter's and prompt lookup's tau must not move
with the batch size; suffix decoding's rows (and the hybrids over it) may, a little: rows decoding
side by side do not see each other's answers in its global cache. Measured speed-ups inside each
eval compare speculative and plain decoding at that eval's batch size. The speed-up prediction's
timed forwards are batch 1's at every size (a fixed part of each eval's seconds; `--no-predict`
leaves them and the hybrid rows out). Each eval loads the target and warms up on its own; the
first one also pays the process's first-call costs, so put the reference size first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.cli_options import add_fingerprint_argument
from specheads.eval.online import evaluate
from specheads.eval.waves import check_batch_size

METHODS = ("speculative", "ngram", "suffix", "hybrid", "union", "adaptive")  # metrics.json rows, when present
EXACT = ("speculative", "ngram")  # drafts independent of the batch: tau must be the first size's exactly


def run_one(size: int, args: argparse.Namespace) -> dict:
    """One eval at batch `size`: its seconds, each method's tau and greedy equality, its outputs."""
    out = Path(args.out) / f"b{size}"
    t0 = time.perf_counter()
    m = evaluate(args.target, args.draft, args.prompts, str(out), args.max_new_tokens, args.k, args.limit,
                 predict=not args.no_predict, quiet=True, dtype=args.dtype, device=args.device,
                 allow_missing_fingerprint=args.allow_missing_fingerprint, batch_size=size)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return {
        "batch_size": size, "device": m["provenance"]["device"], "wall_s": wall, "first_pass_s": m["eval_wall_s"],
        "num_turns": m["num_turns"],
        "greedy_equal_turns": sum(bool(r["greedy_equal"]) for r in rows),
        "methods": {name: {"tau": m[name]["tau"], "greedy_equal": m[name]["greedy_equal"],
                           "mismatched_ids": m[name].get("mismatched_ids", m["mismatched_ids"]),
                           "measured_speedup": m[name].get("measured_speedup")}
                    for name in METHODS if m.get(name)},
        "tokens": [(r["plain_ids"], r["speculative_ids"]) for r in rows],
    }


def compare(base: dict, run: dict) -> dict:
    """A run against the first batch size's: seconds ratio, same tau per method, same outputs."""
    same_tau = {name: row["tau"] == base["methods"][name]["tau"]
                for name, row in run["methods"].items() if name in base["methods"]}
    return {"time_ratio": run["wall_s"] / base["wall_s"] if base["wall_s"] else 0.0,
            "first_pass_ratio": run["first_pass_s"] / base["first_pass_s"] if base["first_pass_s"] else 0.0,
            "same_tau": same_tau, "same_tau_exact_methods": all(same_tau.get(n, True) for n in EXACT),
            "same_outputs": run["tokens"] == base["tokens"]}


def conditions(args: argparse.Namespace, sizes: list[int]) -> dict:
    return {"target": args.target, "draft": args.draft, "prompts": args.prompts, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "k": args.k, "batch_sizes": sizes, "device": args.device,
            "dtype": args.dtype, "predict": not args.no_predict, "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__}


def markdown(report: dict) -> str:
    """batched_eval.md: one line per batch size, then each method's tau per batch size."""
    runs, c = report["runs"], report["conditions"]
    lines = ["# Eval at several batch sizes", "",
             f"`{c['target']}` with `{c['draft']}`, {runs[0]['num_turns']} turns of `{c['prompts']}`, "
             f"{c['max_new_tokens']} new tokens, {runs[0]['device']}, {c['torch_threads']} thread(s); the time ratio and "
             f"the comparisons are against batch {runs[0]['batch_size']}.", "",
             "| batch | eval s | first pass s | time ratio | greedy equal turns | same tau (drafter, ngram) | same outputs |",
             "|---:|---:|---:|---:|---:|:---:|:---:|"]
    for r in runs:
        v = r["vs_first"]
        lines.append(f"| {r['batch_size']} | {r['wall_s']:.1f} | {r['first_pass_s']:.1f} | {v['time_ratio']:.2f} | "
                     f"{r['greedy_equal_turns']}/{r['num_turns']} | {'yes' if v['same_tau_exact_methods'] else 'NO'} | "
                     f"{'yes' if v['same_outputs'] else 'NO'} |")
    names = [n for n in METHODS if n in runs[0]["methods"]]
    lines += ["", "| method | " + " | ".join(f"tau @ {r['batch_size']}" for r in runs) + " | greedy equal |",
              "|---|" + "---:|" * len(runs) + ":---:|"]
    for n in names:
        taus = " | ".join(f"{r['methods'][n]['tau']:.4f}" for r in runs)
        equal = all(r["methods"][n]["greedy_equal"] for r in runs)
        lines.append(f"| {n} | {taus} | {'yes' if equal else 'NO'} |")
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, sizes: list[int]) -> dict:
    """Every batch size's eval, compared with the first; writes the JSON and the Markdown."""
    runs = [run_one(size, args) for size in sizes]
    for r in runs:
        r["vs_first"] = compare(runs[0], r)
    for r in runs:
        del r["tokens"]  # compared above; the eval folders keep them
    report = {"conditions": conditions(args, sizes), "runs": runs}
    out = Path(args.out)
    write_json(out / "batched_eval.json", report)
    write_text(out / "batched_eval.md", markdown(report))
    return report


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes '{text}': expected comma-separated integers such as 1,8") from None
    if not sizes:
        raise ValueError("--batch-sizes is empty: give at least one batch size, e.g. 1,8")
    for size in sizes:
        check_batch_size(size)
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="local HF model folder or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`")
    p.add_argument("--prompts", required=True, help="jsonl with 'prompt' or 'turns' per row")
    p.add_argument("--out", required=True, help="folder for batched_eval.json/.md and one eval folder per size")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated; the first is the reference (default 1,8)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=None, help="chain length (default: the export's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-predict", action="store_true", help="skip the prediction and the hybrid rows")
    add_fingerprint_argument(p)
    a = p.parse_args(argv)
    try:
        report = bench(a, parse_sizes(a.batch_sizes))
    except (ValueError, FileNotFoundError) as err:
        print(f"bench/batched_eval.py: error: {err}", file=sys.stderr)
        return 1
    print(markdown(report), end="")
    print(f"-> {Path(a.out) / 'batched_eval.json'}")
    ok = all(r["vs_first"]["same_tau_exact_methods"] and r["vs_first"]["same_outputs"]
             and r["greedy_equal_turns"] == r["num_turns"] for r in report["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
