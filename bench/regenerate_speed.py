"""Regeneration speed: plain batched regeneration (transformers `generate`, `generate_batch`) against
`regenerate --draft` (the speculation session's batched decode loop, `SessionDecoder`) at several
batch sizes, on the same prompts in one run, greedy.

    python bench/regenerate_speed.py --target RUN/target --draft RUN/export/vllm \
        --prompts RUN/data/heldout_prompts.jsonl --out DIR [--batch-sizes 1,16] [--plain-batch-size 16]

Every method answers each prompt's first turn through the command's own backend (`LocalBackend`:
prompts sorted by length, a batch at a time through `answer_batch`), after an untimed warm-up of
each. Tokens are the new tokens each answer generated (its eos included); tokens/s is their sum over
the method's wall seconds. tau is the drafted runs' tokens per target forward (`DecodeStats`), and
every drafted answer is checked equal to the plain one. Writes DIR/regenerate_speed.json and
DIR/regenerate_speed.md (with `--note`: how the run was made). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.data.prompts import encode_chat, read_prompts, user_turn
from specheads.data.regenerate_turns import LocalBackend, RegenOptions, Row, generate_batch
from specheads.regenerate_command import SessionDecoder
from specheads.session import Session, load_draft
from specheads.target import Target
from specheads.verify.settings import TreeSpec


@dataclass
class Counted:
    """A batch decoder that counts the tokens its answers generated (up to and with the first eos)."""

    decoder: object
    eos: int
    tokens: int = 0

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = self.decoder(prompts, max_new_tokens)
        self.tokens += sum(new.index(self.eos) + 1 if self.eos in new else len(new) for new in out)
        return out


def prompt_rows(target, prompts_file: str, limit: int | None) -> list[Row]:
    """Each prompt's first turn as a one-turn conversation to regenerate (prompts that fill the
    target's context left out)."""
    rows = []
    for p in read_prompts(prompts_file, limit):
        ids = encode_chat(target.tokenizer, user_turn(p.turns[0]))
        if target.context is None or len(ids) < target.context - 1:
            rows.append(Row(p.id, [*user_turn(p.turns[0]), {"role": "assistant", "content": ""}]))
    if not rows:
        raise SystemExit("every prompt fills the target's context: nothing to benchmark")
    return rows


def timed(session: Session, rows: list[Row], opts: RegenOptions, batch_size: int, drafted: bool) -> dict:
    """One method over every row: its answers, wall seconds, tokens (and tau when drafted)."""
    target = session.target
    inner = SessionDecoder(session, opts, batch_size) if drafted else generate_batch(target, opts)
    decoder = Counted(inner, target.tokenizer.eos_token_id)
    t0 = time.perf_counter()
    out = LocalBackend(target, opts, batch_size, decoder).run(rows)
    wall = time.perf_counter() - t0
    row = {"method": f"{'draft' if drafted else 'plain'} batch {batch_size}", "drafted": drafted,
           "batch_size": batch_size, "wall_s": round(wall, 3), "tokens": decoder.tokens,
           "tokens_per_s": round(decoder.tokens / wall, 2) if wall > 0 else None,
           "tau": round(inner.stats.summary()["tau"], 3) if drafted else None}
    return {**row, "answers": [r["messages"][-1]["content"] for r in out]}


def warm_up(session: Session, rows: list[Row], opts: RegenOptions, sizes: list[int], plain_size: int) -> None:
    """Untimed short runs of every method, so first-call overheads stay out of the timings."""
    short = RegenOptions(max_new_tokens=min(4, opts.max_new_tokens))
    few = rows[:max([plain_size, *sizes])]
    timed(session, few, short, plain_size, drafted=False)
    for size in sizes:
        timed(session, few, short, size, drafted=True)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# Regeneration speed: plain batched vs --draft batched", "",
             f"{s['num_prompts']} prompts, {s['max_new_tokens']} new tokens max, greedy, k = {s['k']}, "
             f"{s['device']} {s['dtype']}, {s['threads']} threads, load {s['load']}", "",
             "| method | batch | wall s | tokens | tokens/s | x plain | tau | answers equal to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["methods"]:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {'--draft' if r['drafted'] else 'plain'} | {r['batch_size']} | {r['wall_s']:.2f} | "
                     f"{r['tokens']} | {r['tokens_per_s']} | {r['speedup_vs_plain']:.2f} | {tau} | "
                     f"{r['answers_equal']} |")
    if s.get("note"):
        lines += ["", s["note"]]
    return "\n".join(lines) + "\n"


def bench(target_path: str, draft_dir: str, prompts_file: str, out_dir: str, sizes: list[int],
          plain_size: int = 16, limit: int | None = 64, max_new_tokens: int = 128, k: int | None = None,
          device: str = "cpu", dtype: str | None = None, note: str = "") -> dict:
    """Plain at `plain_size`, then --draft at each of `sizes`; write OUT/regenerate_speed.{json,md}."""
    target = Target.load(target_path, dtype=dtype, device=device)
    # a turn ends at the tokenizer's eos, as in `specheads regenerate --draft`
    session = Session(target, load_draft(draft_dir, target), TreeSpec("chain"), k, eos=[target.tokenizer.eos_token_id])
    rows = prompt_rows(session.target, prompts_file, limit)
    opts = RegenOptions(max_new_tokens=max_new_tokens)
    warm_up(session, rows, opts, sizes, plain_size)
    t0 = time.perf_counter()
    runs = [timed(session, rows, opts, plain_size, drafted=False)]
    runs += [timed(session, rows, opts, size, drafted=True) for size in sizes]
    plain = runs[0]
    for r in runs:
        r["answers_equal"] = sum(a == b for a, b in zip(r["answers"], plain["answers"]))
        r["speedup_vs_plain"] = round(plain["wall_s"] / r["wall_s"], 3) if r["wall_s"] > 0 else None
    report = {"settings": {"target": str(target_path), "draft": str(draft_dir), "prompts": str(prompts_file),
                           "num_prompts": len(rows), "max_new_tokens": max_new_tokens, "k": session.k,
                           "plain_batch_size": plain_size, "draft_batch_sizes": sizes, "device": str(target.device),
                           "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                           "load": [round(x, 2) for x in os.getloadavg()], "note": note},
              "methods": [{n: v for n, v in r.items() if n != "answers"} for r in runs],
              "bench_wall_s": round(time.perf_counter() - t0, 3)}
    report["answers_equal"] = all(r["answers_equal"] == len(rows) for r in runs)
    write_json(Path(out_dir) / "regenerate_speed.json", report)
    write_text(Path(out_dir) / "regenerate_speed.md", markdown(report))
    return report


def batch_sizes(text: str) -> list[int]:
    """--batch-sizes '1,16' -> [1, 16] (each >= 1)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes '{text}': give comma-separated integers >= 1, e.g. 1,16")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="an export folder of the target's drafter")
    p.add_argument("--prompts", required=True, help="a prompts file (jsonl: prompt or turns; first turns used)")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-sizes", type=batch_sizes, default=[1, 16], help="--draft batch sizes (default 1,16)")
    p.add_argument("--plain-batch-size", type=int, default=16, help="plain generate's batch size (regenerate's default)")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=None, help="draft length (default: the export's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--note", default="", help="how the run was made (written under the table)")
    a = p.parse_args(argv)
    if a.plain_batch_size < 1:
        p.error(f"--plain-batch-size {a.plain_batch_size}: must be >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    report = bench(a.target, a.draft, a.prompts, a.out, a.batch_sizes, a.plain_batch_size, a.limit,
                   a.max_new_tokens, a.k, a.device, a.dtype, a.note)
    print(markdown(report), end="")
    return 0 if report["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
