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

`--rounds R` cuts the prompts into R consecutive parts and runs every size's eval on part 1, then
on part 2 (sizes in reverse order), and so on, adding up the seconds and the counts: a machine
whose speed drifts during the run (a shared host: the same forward 30% slower an hour later, seen
here) then slows every size alike, where one size after the other would charge the drift to the
later one. Tau per method is then the parts' tokens over their target forwards.
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


def run_one(size: int, args: argparse.Namespace, prompts: str, out: Path, limit: int | None) -> dict:
    """One eval at batch `size` of `prompts` into `out`: its seconds, each method's tau, counts and
    greedy equality, its outputs."""
    t0 = time.perf_counter()
    m = evaluate(args.target, args.draft, prompts, str(out), args.max_new_tokens, args.k, limit,
                 predict=not args.no_predict, quiet=True, dtype=args.dtype, device=args.device,
                 allow_missing_fingerprint=args.allow_missing_fingerprint, batch_size=size)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return {
        "batch_size": size, "device": m["provenance"]["device"], "wall_s": wall, "first_pass_s": m["eval_wall_s"],
        "num_turns": m["num_turns"],
        "greedy_equal_turns": sum(bool(r["greedy_equal"]) for r in rows),
        "methods": {name: {"tau": m[name]["tau"], "greedy_equal": m[name]["greedy_equal"],
                           "tokens": m[name]["tokens"], "target_forwards": m[name]["target_forwards"],
                           "mismatched_ids": m[name].get("mismatched_ids", m["mismatched_ids"]),
                           "measured_speedup": m[name].get("measured_speedup")}
                    for name in METHODS if m.get(name)},
        "tokens": [(r["plain_ids"], r["speculative_ids"]) for r in rows],
    }


def prompt_parts(args: argparse.Namespace) -> list[str]:
    """The prompt file (its first --limit rows) cut into --rounds consecutive parts, each written
    under OUT/parts; one round: the file itself."""
    if args.rounds == 1:
        return [args.prompts]
    rows = [line for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[: args.limit]
    if args.rounds > len(rows):
        raise ValueError(f"--rounds {args.rounds}: more rounds than the {len(rows)} prompts")
    size = -(-len(rows) // args.rounds)
    parts = []
    for i in range(args.rounds):
        path = Path(args.out) / "parts" / f"part{i}.jsonl"
        write_text(path, "".join(line + "\n" for line in rows[i * size: (i + 1) * size]))
        parts.append(str(path))
    return parts


def merged(parts: list[dict]) -> dict:
    """One size's runs over the parts -> one run: seconds, turns and counts added up, tau per
    method the parts' tokens over their target forwards, outputs in prompt order."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    methods = {}
    for name in first["methods"]:
        rows = [p["methods"][name] for p in parts]
        tokens, forwards = sum(r["tokens"] for r in rows), sum(r["target_forwards"] for r in rows)
        methods[name] = {"tau": tokens / forwards if forwards else 0.0,
                         "greedy_equal": all(r["greedy_equal"] for r in rows),
                         "tokens": tokens, "target_forwards": forwards,
                         "mismatched_ids": [i for r in rows for i in r["mismatched_ids"]],
                         "measured_speedup": None}  # a ratio of walls per part: see each part's eval
    return {"batch_size": first["batch_size"], "device": first["device"],
            "wall_s": sum(p["wall_s"] for p in parts), "first_pass_s": sum(p["first_pass_s"] for p in parts),
            "num_turns": sum(p["num_turns"] for p in parts),
            "greedy_equal_turns": sum(p["greedy_equal_turns"] for p in parts),
            "methods": methods, "tokens": [t for p in parts for t in p["tokens"]],
            "parts_wall_s": [p["wall_s"] for p in parts]}


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
            "dtype": args.dtype, "predict": not args.no_predict, "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__}


def markdown(report: dict) -> str:
    """batched_eval.md: one line per batch size, then each method's tau per batch size."""
    runs, c = report["runs"], report["conditions"]
    lines = ["# Eval at several batch sizes", "",
             f"`{c['target']}` with `{c['draft']}`, {runs[0]['num_turns']} turns of `{c['prompts']}`, "
             f"{c['max_new_tokens']} new tokens, {runs[0]['device']}, {c['torch_threads']} thread(s); the time ratio and "
             f"the comparisons are against batch {runs[0]['batch_size']}."
             + (f" In {c['rounds']} rounds over consecutive parts of the prompts, the sizes taking turns "
                "(seconds and counts added up)." if c.get("rounds", 1) > 1 else ""), "",
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
    parts = prompt_parts(args)
    done: dict[int, list[dict]] = {size: [] for size in sizes}
    for i, part in enumerate(parts):
        for size in (sizes if i % 2 == 0 else sizes[::-1]):  # alternate which size goes first
            folder = Path(args.out) / f"b{size}" / ("" if len(parts) == 1 else f"part{i}")
            done[size].append(run_one(size, args, part, folder, args.limit if len(parts) == 1 else None))
    runs = [merged(done[size]) for size in sizes]
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
    p.add_argument("--prompts", required=True, help="prompts file: JSON lines or a JSON array (specheads.data.prompts)")
    p.add_argument("--out", required=True, help="folder for batched_eval.json/.md and one eval folder per size")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated; the first is the reference (default 1,8)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=None, help="chain length (default: the export's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-predict", action="store_true", help="skip the prediction and the hybrid rows")
    p.add_argument("--rounds", type=int, default=1,
                   help="cut the prompts into this many parts and run every size on each part in turn")
    add_fingerprint_argument(p)
    a = p.parse_args(argv)
    try:
        if a.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
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
