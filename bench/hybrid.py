"""Hybrid benchmark: plain, EAGLE-3, prompt lookup, suffix decoding and the hybrids of EAGLE-3 with
them (choose and union modes) on the same prompts, greedy, side by side in one run.

    python bench/hybrid.py --target RUN/target --draft RUN/export/vllm \
        --prompts RUN/data/heldout_prompts.jsonl --out DIR [--k 3] [--limit N] [--max-new-tokens N]

Every output is checked equal to plain greedy decoding; counts and seconds are summed over prompts
before any ratio (bench/verifier.py's tallies). The suffix proposers keep one global cache per
method across the prompts, as a server's (and the eval's) would; warm-up decodes use throwaway
proposers so no prompt's output is cached before it is timed. Writes DIR/hybrid.json, DIR/hybrid.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package

from verifier import Method, encode_rows, method_row, plain_method, run_bench  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402
from specheads.data.prompts import read_prompts  # noqa: E402
from specheads.session import Session, eos_ids  # noqa: E402
from specheads.verify.hybrid_proposers import hybrid_proposer  # noqa: E402
from specheads.verify.loop import decode  # noqa: E402
from specheads.verify.ngram_proposers import NgramProposer  # noqa: E402
from specheads.verify.registry import make_proposer  # noqa: E402
from specheads.verify.settings import make_tree_spec  # noqa: E402
from specheads.verify.suffix_proposers import SuffixProposer  # noqa: E402

HYBRIDS = (  # name, mode, free proposer, choose rule
    ("hybrid-choose eagle3+suffix (arctic)", "choose", "suffix", "arctic"),
    ("hybrid-choose eagle3+suffix (measured)", "choose", "suffix", "measured"),
    ("hybrid-choose eagle3+ngram (measured)", "choose", "ngram", "measured"),
    ("hybrid-union eagle3+suffix", "union", "suffix", "arctic"),
    ("hybrid-union eagle3+ngram", "union", "ngram", "arctic"),
)


def free_factory(name: str):
    """A maker of the free proposer: one suffix cache per method (kept across prompts), a fresh
    prompt-lookup proposer per decode (it has no cross-request state)."""
    if name == "suffix":
        shared = SuffixProposer()
        return lambda: shared
    return lambda: NgramProposer(3, 1)


def chain_method(name: str, target, make, k: int, settings: dict) -> Method:
    """A chain of <= k drafts from `make()` (a proposer per decode)."""
    def run(ids, max_new_tokens, eos):
        return decode(target, make(), ids, max_new_tokens, k, eos)

    return Method(name, {"k": k, "nodes": k + 1, **settings}, run)


def hybrid_method(name: str, mode: str, free: str, rule: str, target, head, k: int,
                  chosen: Counter) -> Method:
    """EAGLE-3 + a free proposer; `chosen` sums the hybrids' per-step counts over the decodes."""
    spec, make_free = make_tree_spec("chain", k=k), free_factory(free)

    def run(ids, max_new_tokens, eos):
        hybrid = hybrid_proposer(make_proposer(spec, head, target), make_free(), mode, k, rule)
        result = decode(target, hybrid, ids, max_new_tokens, k, eos)
        chosen.update(hybrid.summary()["steps"])
        return result

    nodes = k + 1 if mode == "choose" else 2 * k + 1
    return Method(name, {"kind": "hybrid", "mode": mode, "free": free, "rule": rule, "k": k,
                         "nodes": nodes}, run)


def build_methods(target, head, k: int) -> tuple[list[Method], dict[str, Counter]]:
    """plain first (the reference), then EAGLE-3, n-gram, suffix and the hybrids."""
    spec = make_tree_spec("chain", k=k)
    suffix = free_factory("suffix")
    methods = [plain_method(target),
               chain_method(f"eagle3 k={k}", target, lambda: make_proposer(spec, head, target), k,
                            {"kind": "eagle3"}),
               chain_method(f"ngram k={k}", target, free_factory("ngram"), k, {"kind": "ngram"}),
               chain_method(f"suffix k={k}", target, suffix, k, {"kind": "suffix"})]
    counts = {name: Counter() for name, *_ in HYBRIDS}
    methods += [hybrid_method(name, mode, free, rule, target, head, k, counts[name])
                for name, mode, free, rule in HYBRIDS]
    return methods, counts


def warm_up(target, head, k: int, ids: list[int], max_new_tokens: int) -> None:
    """Untimed decodes with throwaway methods: kernels and allocator settle, no cache is fed."""
    eos = eos_ids(target)
    for method in build_methods(target, head, k)[0]:
        method.run(ids, min(16, max_new_tokens), eos)


def markdown(report: dict) -> str:
    st = report["settings"]
    lines = ["# Hybrid benchmark", "",
             f"target `{st['target']}`, draft `{st['draft']}`, {st['num_prompts']} prompts, max "
             f"{st['max_new_tokens']} new tokens, k={st['k']}, {st['device']} {st['dtype']}, "
             f"{st['threads']} threads, batch 1, greedy.", "",
             "| method | tau | tok/s | speed-up | greedy equal | steps per draft |",
             "|---|---:|---:|---:|:---:|---|"]
    for r in report["methods"]:
        chosen = ", ".join(f"{n} {c}" for n, c in sorted(r.get("chosen", {}).items()))
        lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['greedy_equal'] else 'NO'} | {chosen} |")
    return "\n".join(lines) + "\n"


def bench(target_path: str, draft_dir: str, prompts_file: str, out_dir: str, k: int = 3,
          limit: int | None = 16, max_new_tokens: int = 64, device: str = "cpu",
          dtype: str | None = None) -> dict:
    """Run every method on the prompts; write OUT/hybrid.json and OUT/hybrid.md."""
    session = Session.open(target_path, draft_dir, device=device, dtype=dtype)
    target, head = session.target, session.head
    prompts = encode_rows(target, read_prompts(prompts_file, limit))
    warm_up(target, head, k, prompts[0][1], max_new_tokens)
    methods, counts = build_methods(target, head, k)
    t0 = time.perf_counter()
    tallies = run_bench(target, methods, prompts, max_new_tokens, warmup=0)
    rows = [method_row(m, t, tallies[0]) for m, t in zip(methods, tallies)]
    for row in rows:
        if row["method"] in counts:
            row["chosen"] = dict(counts[row["method"]])
    report = {"settings": {"target": str(target_path), "draft": str(draft_dir), "prompts": str(prompts_file),
                           "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k,
                           "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
                           "threads": torch.get_num_threads(), "batch_size": 1},
              "methods": rows, "bench_wall_s": time.perf_counter() - t0}
    report["greedy_equal"] = all(r["greedy_equal"] for r in rows)
    write_json(Path(out_dir) / "hybrid.json", report)
    write_text(Path(out_dir) / "hybrid.md", markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="an EAGLE-3 export folder")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    report = bench(a.target, a.draft, a.prompts, a.out, a.k, a.limit, a.max_new_tokens, a.device, a.dtype)
    print(markdown(report), end="")
    return 0 if report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
