"""Speed-up by concurrency: plain and speculative throughput at batch 1 / 8 / 32 (continuous
batching in our verifier), measured side by side in one run, with the speed-up the measured
forward costs predict at each batch size and the best k per size (vLLM's
`num_speculative_tokens_per_batch_size`).

    python bench/concurrency.py --target RUN/target --draft RUN/export/vllm \
        --prompts RUN/data/heldout_prompts.jsonl --out DIR [--batch-sizes 1,8,32] [--limit 32]

Writes DIR/concurrency.json and DIR/concurrency.md (`specheads.eval.concurrency`: the model).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.data.prompts import read_prompts, user_turn
from specheads.eval.concurrency import BATCH_SIZES, concurrency_table, markdown
from specheads.eval.online import eval_prompt_ids
from specheads.session import Session
from specheads.verify.settings import TreeSpec


def bench(target_path: str, draft_dir: str, prompts_file: str, out_dir: str, k: int | None = None,
          limit: int | None = 32, max_new_tokens: int = 64, batch_sizes=BATCH_SIZES, device: str = "cpu",
          dtype: str | None = None, note: str = "") -> dict:
    """Measure and predict every batch size; write OUT/concurrency.json and OUT/concurrency.md."""
    session = Session.open(target_path, draft_dir, TreeSpec("chain"), k, device=device, dtype=dtype)
    prompts = [eval_prompt_ids(session.target.tokenizer, user_turn(r.turns[0])) for r in read_prompts(prompts_file, limit)]
    session.warm_up()
    t0 = time.perf_counter()
    table = concurrency_table(session, prompts, max_new_tokens, batch_sizes)
    target = session.target
    table["settings"] = {"target": str(target_path), "draft": str(draft_dir), "prompts": str(prompts_file),
                         "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": session.k,
                         "engine": "specheads verifier", "device": str(target.device),
                         "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                         "load": [round(x, 2) for x in os.getloadavg()], "note": note}
    table["bench_wall_s"] = time.perf_counter() - t0
    table["greedy_equal"] = all(r["greedy_equal"] == r["prompts"] for r in table["rows"])
    write_json(Path(out_dir) / "concurrency.json", table)
    write_text(Path(out_dir) / "concurrency.md", report_markdown(table))
    return table


def report_markdown(table: dict) -> str:
    st = table["settings"]
    head = (f"Speed-up by concurrency: {st['num_prompts']} prompts, {st['max_new_tokens']} new tokens, greedy, "
            f"our verifier ({st['device']}, {st['dtype']}, {st['threads']} threads; load average {st['load']}).\n\n")
    return head + markdown(table) + (f"\n{st['note']}\n" if st["note"] else "")


def batch_sizes_arg(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes takes integers separated by commas, got '{text}'") from None
    if not sizes or min(sizes) < 1 or 1 not in sizes:
        raise argparse.ArgumentTypeError(f"--batch-sizes needs sizes >= 1 including 1 (it prices per-row costs), got '{text}'")
    return tuple(sorted(set(sizes)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="an export folder")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=None, help="chain length (default: the export's)")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=batch_sizes_arg, default=BATCH_SIZES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--note", default="", help="how the run was made (written under the table)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    table = bench(a.target, a.draft, a.prompts, a.out, a.k, a.limit, a.max_new_tokens, a.batch_sizes,
                  a.device, a.dtype, a.note)
    print(report_markdown(table), end="")
    return 0 if table["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
