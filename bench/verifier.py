"""Verifier benchmark: tau and wall-clock tokens/s of every draft shape on the same prompts.

    python bench/verifier.py --target T --draft EXPORT_DIR --prompts FILE --out DIR \
        [--limit N] [--max-new-tokens N] [--device auto] [--batch-size N]

Each prompt (its first turn, chat-rendered) is decoded plainly (the reference), with chains of
k = 1..8 drafts, a static tree, EAGLE-2 trees at a few budgets, and the n-gram baseline; every
speculative output is checked equal to plain greedy decoding. Counts and seconds are summed over
prompts before any ratio (docs/algorithms.md §9). Writes DIR/verifier.json and
DIR/verifier.md (a Markdown table).

On a GPU (`--device auto` picks one when present) the target and the head run in bfloat16, and
every timed decode is bracketed by `torch.cuda.synchronize`; on a CPU float32. `--batch-size N`
(default 1) decodes up to N prompts per target forward (`verify.loop.decode_batch`): each method
decodes all prompts as one timed batched run, so its tokens/s and speed-up compare with plain
decoding at the same batch size; at 1 the methods take turns prompt by prompt. In bf16 a batched
verification can flip an argmax tie that sequential decoding breaks the other way, so a rare
`greedy_equal: false` there is numerics, not necessarily a bug.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.cli_options import add_fingerprint_argument
from specheads.data.prompts import encode_chat, read_prompts, user_turn
from specheads.eval.waves import blocks, check_batch_size
from specheads.session import Session, eos_ids
from specheads.verify.loop import decode_batch, request
from specheads.verify.ngram_proposers import NO_DRAFT, NgramProposer
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec, check_tree_fits, make_tree_spec
from specheads.verify.steps import DecodeStats

# a Medusa-style static tree of 20 drafts (depth 5): wide near the root, a long top-1 spine
STATIC_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
               (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1),
               (0, 0, 1, 0), (0, 1, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))
EAGLE2_BUDGETS = ((4, 4, 16), (5, 8, 48))  # (depth, top_k, total_tokens)
CHAIN_KS = tuple(range(1, 9))


@dataclass
class Method:
    """One way of decoding: a name, its settings, `request(ids, max_new_tokens, eos)`: one prompt's
    `verify.loop.Request` (with a fresh proposer), and `after(request)`, called once it was decoded."""

    name: str
    settings: dict
    request: Callable
    after: Callable | None = None


@dataclass
class Tally:
    """A method's counts and synchronised seconds summed over prompts."""

    stats: DecodeStats = field(default_factory=DecodeStats)
    wall_s: float = 0.0
    mismatched: list[str] = field(default_factory=list)


# --- methods -------------------------------------------------------------------------------------


def spec_method(spec: TreeSpec, target, head) -> Method:
    """A draft shape (chain or tree) with the exported head; a fresh proposer per decode."""
    def make(ids, max_new_tokens, eos):
        return request(target, make_proposer(spec, head, target), ids, max_new_tokens, spec.k or 0, eos)

    return Method(spec.label(), spec.describe(), make)


def ngram_method(target, k: int) -> Method:
    def make(ids, max_new_tokens, eos):
        return request(target, NgramProposer(3, 1), ids, max_new_tokens, k, eos)

    return Method(f"ngram k={k}", {"kind": "ngram", "k": k, "max_ngram": 3, "min_ngram": 1,
                                   "nodes": k + 1}, make)


def plain_method(target) -> Method:
    def make(ids, max_new_tokens, eos):
        return request(target, NO_DRAFT, ids, max_new_tokens, 0, eos)

    return Method("plain", {"kind": "plain", "nodes": 1}, make)


def build_methods(target, head, ks, static: TreeSpec, budgets, ngram_k: int) -> list[Method]:
    """plain first (the reference), then chains, the static tree, EAGLE-2 trees, n-grams."""
    specs = [make_tree_spec("chain", k=k) for k in ks] + [static]
    specs += [make_tree_spec("eagle2", depth=d, top_k=t, total_tokens=n) for d, t, n in budgets]
    for spec in specs:
        check_tree_fits(spec, target)
    return [plain_method(target), *(spec_method(s, target, head) for s in specs),
            ngram_method(target, ngram_k)]


# --- timing and the run --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(method: Method, target, prompts: list[list[int]], max_new_tokens, eos, batch_size: int = 1):
    """(results, seconds) of decoding `prompts` together (up to batch_size per target forward),
    the device synchronised before and after."""
    reqs = [method.request(ids, max_new_tokens, eos) for ids in prompts]
    sync(target.device)
    t0 = time.perf_counter()
    results = decode_batch(target, reqs, batch_size)
    sync(target.device)
    seconds = time.perf_counter() - t0
    for req in reqs if method.after is not None else ():
        method.after(req)
    return results, seconds


def encode_rows(target, rows) -> list[tuple[str, list[int]]]:
    """(id, chat-rendered first turn) per row, skipping prompts that fill the context."""
    ctx = target.context
    out = []
    for row in rows:
        ids = encode_chat(target.tokenizer, user_turn(row.turns[0]))
        if ctx is None or len(ids) < ctx - 1:
            out.append((row.id, ids))
    if not out:
        raise ValueError("every prompt fills the target's context: nothing to benchmark")
    return out


def run_bench(target, methods: list[Method], prompts, max_new_tokens: int,
              warmup: int = 1, batch_size: int = 1) -> list[Tally]:
    """Decode every prompt with every method; plain is methods[0]. At batch size 1 the methods take
    turns prompt by prompt, above it each method decodes every prompt in one batched run."""
    eos = eos_ids(target)
    first = [ids for _, ids in prompts[:batch_size]]
    for method in methods:  # untimed: kernels, allocator and caches settle
        for _ in range(warmup):
            timed(method, target, first, min(16, max_new_tokens), eos, batch_size)
    tallies = [Tally() for _ in methods]
    for block in blocks(prompts, batch_size):
        reference = None
        for method, tally in zip(methods, tallies):
            results, seconds = timed(method, target, [ids for _, ids in block], max_new_tokens, eos, batch_size)
            reference = [r.tokens for r in results] if reference is None else reference
            tally.wall_s += seconds
            for (pid, _), result, plain in zip(block, results, reference):
                tally.stats = tally.stats.add(result.stats)
                if result.tokens != plain:
                    tally.mismatched.append(pid)
    return tallies


def method_row(method: Method, tally: Tally, plain: Tally) -> dict:
    """One method's line of verifier.json."""
    s = tally.stats.summary()
    rate = tally.stats.tokens / tally.wall_s if tally.wall_s else 0.0
    plain_rate = plain.stats.tokens / plain.wall_s if plain.wall_s else 0.0
    return {
        "method": method.name, "settings": method.settings,
        "tau": s["tau"], "mean_acceptance_length": s["mean_acceptance_length"],
        "acceptance_per_position": s["acceptance_per_position"],
        "acceptance_per_position_conditional": s["acceptance_per_position_conditional"],
        "tokens": tally.stats.tokens, "target_forwards": s["target_forwards"],
        "wall_s": tally.wall_s, "tokens_per_s": rate,
        "speedup": rate / plain_rate if plain_rate else 0.0,
        "target_decode_s": tally.stats.target_decode_s, "proposer_s": tally.stats.proposer_s,
        "greedy_equal": not tally.mismatched, "mismatched_ids": tally.mismatched,
    }


# --- reports -------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    """verifier.md: the settings, then one table row per method."""
    st = report["settings"]
    lines = [
        "# Verifier benchmark", "",
        f"target `{st['target']}`, draft `{st['draft']}`, {st['num_prompts']} prompts, "
        f"max {st['max_new_tokens']} new tokens, {st['device']} {st['dtype']}, batch {st['batch_size']}, greedy.",
        "tau counts the bonus token (plain = 1.00); tokens/s = all new tokens / all synchronised "
        f"wall seconds; speed-up against plain at batch {st['batch_size']}.", "",
        "| method | nodes/step | tau | acc@1 | acc@2 | acc@3 | tok/s | speed-up | greedy equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in report["methods"]:
        acc = (r["acceptance_per_position"] + [None] * 3)[:3]
        cells = ["" if a is None else f"{a:.2f}" for a in acc]
        lines.append(f"| {r['method']} | {r['settings']['nodes']} | {r['tau']:.2f} | "
                     f"{' | '.join(cells)} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['greedy_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def bench(target_path: str, draft_dir: str, prompts_file: str, out_dir: str,
          limit: int | None = 16, max_new_tokens: int = 64, device: str = "auto",
          dtype: str | None = None, ks=CHAIN_KS, static_tree: str | None = None,
          budgets=EAGLE2_BUDGETS,
          ngram_k: int | None = None, warmup: int = 1, allow_missing_fingerprint: bool = False,
          batch_size: int = 1) -> dict:
    """Run every method on the prompts; write OUT/verifier.json and OUT/verifier.md.

    `static_tree` is a JSON file of rank paths (default: STATIC_TREE); `budgets` EAGLE-2
    (depth, top_k, total_tokens) triples; `ngram_k` defaults to the export's draft length;
    `batch_size` sequences per target forward (module docstring).
    """
    from specheads.provenance import provenance

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_batch_size(batch_size)
    rows = read_prompts(prompts_file, limit)
    session = Session.open(target_path, draft_dir, device=device, dtype=dtype,
                           allow_missing_fingerprint=allow_missing_fingerprint)
    target, head, meta = session.target, session.head, session.draft.meta
    ngram_k = ngram_k or session.k
    static = (make_tree_spec(static_tree) if static_tree
              else TreeSpec("static", choices=STATIC_TREE, source="built-in"))
    methods = build_methods(target, head, ks, static, budgets, ngram_k)
    prompts = encode_rows(target, rows)
    t0 = time.perf_counter()
    tallies = run_bench(target, methods, prompts, max_new_tokens, warmup, batch_size)
    report = {
        "settings": {"target": str(target_path), "draft": str(draft_dir),
                     "prompts": str(prompts_file), "num_prompts": len(prompts),
                     "skipped_prompts": len(rows) - len(prompts), "max_new_tokens": max_new_tokens,
                     "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
                     "batch_size": batch_size, "warmup": warmup},
        "methods": [method_row(m, t, tallies[0]) for m, t in zip(methods, tallies)],
        "bench_wall_s": time.perf_counter() - t0,
        "provenance": provenance(target=target.fingerprint(), draft_format=meta.format),
    }
    report["greedy_equal"] = all(r["greedy_equal"] for r in report["methods"])
    out = Path(out_dir)
    write_json(out / "verifier.json", report)
    write_text(out / "verifier.md", markdown(report))
    return report


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_budgets(text: str) -> tuple[tuple[int, int, int], ...]:
    """'4:4:16,5:8:48' -> ((depth, top_k, total_tokens), ...)."""
    out = []
    for item in text.split(","):
        parts = parse_ints(item.replace(":", ","))
        if len(parts) != 3:
            raise ValueError(f"--eagle2 '{item}': expected DEPTH:TOP_K:TOTAL_TOKENS")
        out.append(parts)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="local HF model folder or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`")
    p.add_argument("--prompts", required=True, help="prompts file: JSON lines or a JSON array (specheads.data.prompts)")
    p.add_argument("--out", required=True, help="folder for verifier.json and verifier.md")
    p.add_argument("--limit", type=int, default=16, help="first N prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--chain-ks", default="1,2,3,4,5,6,7,8", help="chain lengths to measure")
    p.add_argument("--static-tree", default=None, help="JSON list of rank paths (default: built in)")
    p.add_argument("--eagle2", default="4:4:16,5:8:48", help="DEPTH:TOP_K:TOTAL_TOKENS,...")
    p.add_argument("--ngram-k", type=int, default=None, help="n-gram draft length (default: the export's k)")
    p.add_argument("--warmup", type=int, default=1, help="untimed decodes per method first")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per target forward (default 1); speed-ups against plain at the same batch size")
    add_fingerprint_argument(p)
    a = p.parse_args(argv)
    try:
        report = bench(a.target, a.draft, a.prompts, a.out, a.limit, a.max_new_tokens, a.device,
                       a.dtype, parse_ints(a.chain_ks),
                       a.static_tree,
                       parse_budgets(a.eagle2), a.ngram_k, a.warmup, a.allow_missing_fingerprint, a.batch_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"bench/verifier.py: error: {err}", file=sys.stderr)
        return 1
    print(markdown(report), end="")
    print(f"-> {Path(a.out) / 'verifier.json'}")
    return 0 if report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
