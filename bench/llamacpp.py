"""llama.cpp benchmark: plain, each draftless --spec-type, our EAGLE-3 export, and EAGLE-3 mixed with
a draftless type, side by side on the same prompts, in `llama-server` on a CPU.

    python bench/llamacpp.py --target T --draft EXPORT_DIR --prompts FILE --out DIR \
        [--limit N] [--n-predict N] [--threads N] [--k N] [--mix auto|TYPE] [--passes N] [--with-cost]

The target and the export are converted to f32 GGUFs with llama.cpp's own converter
(specheads.engines.llamacpp). Each row is one `llama-server` process decoding every prompt (chat-
rendered ids, greedy, no prompt cache); tok/s is generated tokens over generation seconds summed over
prompts (llama.cpp's `predicted_n` / `predicted_ms`), accepted/drafted its `draft_n_accepted` /
`draft_n`; each server first answers two untimed warm-up requests; every row's outputs are compared
token for token with the plain row's, and plain runs again last to show how far the machine drifted. Threads, the
OMP_WAIT_POLICY and the load average before and after each row are recorded: on a shared machine the
speeds are only comparable within one run. Each row's speed-up is over the mean of plain's two runs.
The mix row takes the fastest draftless type of the run (`--mix auto`). `--with-cost` first measures
llama.cpp's cost curve in the same run (the `--cost` mode) and predicts every row from it: a curve
taken in another run, on another machine state, moved the drafter's prediction by 10% here. Writes
DIR/llamacpp.json and DIR/llamacpp.md, and every server's log (at -lv 4: llama.cpp's per-implementation
statistics, which the prediction reads).

    python bench/llamacpp.py --reprice RUNDIR [--out DIR]

prices a finished run's rows again from what it saved (its JSON, cost curve and server logs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.engines import llamacpp as lc
from specheads.engines import llamacpp_check, llamacpp_log
from specheads.eval.engine_costs import curve_costs
from specheads.eval.predict import MIN_GAIN, predict

DRAFTLESS_ROWS = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def rows_to_run(spec_type: str, draft: Path, k: int, mix: str) -> list[lc.SpecSettings]:
    """plain first and again last (the reference is their mean; how far apart they are is how far the
    machine drifted during the run); the mix row's draftless type is `mix`, or with "auto" the
    fastest draftless row of this run (`resolve_mix`, once those rows are measured)."""
    return [lc.SpecSettings(), *(lc.SpecSettings((t,)) for t in DRAFTLESS_ROWS),
            lc.SpecSettings((spec_type,), draft, n_max=k), lc.SpecSettings((spec_type, mix), draft, n_max=k),
            lc.SpecSettings()]


def resolve_mix(spec: lc.SpecSettings, rows: list[dict]) -> lc.SpecSettings:
    """A mix row asking for "auto" gets the draftless type whose row measured fastest so far."""
    if "auto" not in spec.types:
        return spec
    draftless = [r for r in rows if len(r["spec_types"]) == 1 and r["spec_types"][0] in DRAFTLESS_ROWS and r["tok_s"]]
    if not draftless:
        raise lc.LlamaCppError("--mix auto needs the draftless rows measured first")
    best = max(draftless, key=lambda r: r["tok_s"])["spec_types"][0]
    return replace(spec, types=tuple(best if t == "auto" else t for t in spec.types))


def interleaved_rows(specs: list[lc.SpecSettings], passes: int, decode, threads: int, omp: str | None) -> list[dict]:
    """Every row decodes the prompts once per pass (`decode(spec)`: a fresh server), the rows taken in
    turn within each pass, so a machine that drifts during the run moves every row alike; a mix row on
    "auto" is resolved once, from the first pass's draftless rows. -> the rows' summaries (the first
    plain row is the reference of greedy equality, the last is "plain (again)")."""
    specs, outs = list(specs), [[] for _ in specs]
    loads = [{"before": None, "after": None} for _ in specs]
    for _ in range(passes):
        for i, spec in enumerate(specs):
            if "auto" in spec.types:
                specs[i] = spec = resolve_mix(spec, [summarize(s.label, s, o, None, {}, threads)
                                                     for s, o in zip(specs[:i], outs[:i])])
            before = lc.load_average()
            outs[i] += decode(spec)
            loads[i]["before"] = loads[i]["before"] or before
            loads[i]["after"] = lc.load_average()
    last = len(specs) - 1
    return [summarize("plain (again)" if i == last and i and not spec.types else spec.label, spec, outs[i],
                      None if i == 0 else outs[0], loads[i], threads, omp) for i, spec in enumerate(specs)]


def reference_tok_s(rows: list[dict]) -> float | None:
    """Plain's tok/s: the mean of its first and last runs when both are there (a row measured in
    between is compared with the machine as it was on average over the run)."""
    plains = [r["tok_s"] for r in (rows[0], rows[-1]) if not r["spec_types"] and r["tok_s"]]
    return sum(plains) / len(plains) if plains else None


def summarize(label: str, spec: lc.SpecSettings, outs: list[lc.Completion], plain: list[lc.Completion] | None,
              load: dict, threads: int, omp: str | None = None) -> dict:
    n = sum(int(o.timings.get("predicted_n") or len(o.tokens)) for o in outs)
    ms = sum(float(o.timings.get("predicted_ms") or 0.0) for o in outs)
    drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
    equal = None if plain is None else [o.tokens == p.tokens for o, p in zip(outs, plain)]
    return {"row": label, "spec_types": list(spec.types), "draft": str(spec.draft) if spec.draft else None,
            "spec_draft_n_max": spec.n_max, "tokens": n, "seconds": ms / 1000, "tok_s": n / (ms / 1000) if ms else None,
            "drafted": drafted, "accepted": accepted, "accepted_per_drafted": accepted / drafted if drafted else None,
            "greedy_equal": None if equal is None else all(equal),
            "greedy_equal_prompts": None if equal is None else f"{sum(equal)}/{len(equal)}",
            "threads": threads, "omp_wait_policy": lc.omp_label(omp), "load_average": load,
            "per_prompt": [{**{k: o.timings.get(k) for k in PER_PROMPT_TIMINGS}, "server_log": request_log(o)}
                           for o in outs]}


PER_PROMPT_TIMINGS = ("predicted_n", "predicted_ms", "draft_n", "draft_n_accepted", "prompt_n", "prompt_ms")


def request_log(o: lc.Completion) -> dict | None:
    """What the pricing needs of the server's log of one request: graphs reused, implementations' statistics."""
    return None if o.server_log is None else {k: o.server_log.get(k) for k in ("graphs_reused", "stats")}


def markdown(result: dict) -> str:
    plain = reference_tok_s(result["rows"]) or 0
    passes = f" x {result['passes']} passes" if result.get("passes", 1) > 1 else ""
    lines = [f"llama.cpp {result['version']}: {result['prompts']} prompts{passes} x {result['n_predict']} tokens, greedy, "
             f"threads {result['threads']}, OMP_WAIT_POLICY {result['omp_wait_policy']}, target "
             f"{result.get('quantization', 'f32')}, draft f32. "
             "Speeds taken on a shared machine (load average per row): compare within this table only.", "",
             "| row | tok/s | vs plain (mean of its runs) | accepted/drafted | greedy-equal | load (1 min, before/after) |",
             "|---|---|---|---|---|---|"]
    predicted = "recommended" in result
    if predicted:
        lines[-2] = lines[-2].replace("| vs plain (mean of its runs) |", "| vs plain (mean of its runs) | predicted |")
        lines[-1] = lines[-1] + "---|"
    for r in result["rows"]:
        rate = f"{r['accepted']}/{r['drafted']} = {r['accepted_per_drafted']:.3f}" if r["drafted"] else "-"
        speed = f"{r['tok_s']:.1f}" if r["tok_s"] else "-"
        ratio = f"{r['tok_s'] / plain:.2f}x" if r["tok_s"] and plain else "-"
        eq = "reference" if r["greedy_equal"] is None else r["greedy_equal_prompts"]
        pred = ""
        if predicted:
            close = "within" if r["within_10pct"] else "NOT within"
            pred = (" - |" if r["predicted_speedup"] is None
                    else f" {r['predicted_speedup']:.2f}x ({close} 10%){disturbed_note(r)} |")
        lines.append(f"| {r['row']} | {speed} | {ratio} |{pred} {rate} | {eq} | "
                     f"{r['load_average']['before'][0]} / {r['load_average']['after'][0]} |")
    if predicted:
        lines += ["", f"Predicted from llama.cpp's own cost curve ({result['cost_curve_from']}): each row's steps as "
                  "llama-server ran them (its counters and log) priced at the cost run's costs: t(n) for each "
                  "verification batch, a speculative step's overhead, a graph built for every new batch size, "
                  "the draftless lookups' own time; the draft model's step at k as the cost run timed it, and in "
                  "a mixed row only on the steps where the draftless type found nothing (llama.cpp's statistics), "
                  "the others verifying the lookup's draft while the drafter catches up on it. "
                  f"{pricing_note(result)}"
                  f"**Recommended: {recommended_label(result['recommended'])}** (speculation only when predicted >= "
                  f"{1 + result['min_gain']:.2f}x); fastest measured: {result['fastest_measured']}; plain drifted "
                  f"{result['drift']:.1%} between its two runs; the recommendation is "
                  f"{'' if result['recommended_is_fastest'] else 'NOT '}the fastest measured within that noise."]
    return "\n".join(lines) + "\n"


def server_log_name(label: str, run: int) -> str:
    """server-LABEL.log for a row's first server, server-LABEL-runN.log for its later ones (passes, plain again)."""
    return f"server-{label}.log" if run == 1 else f"server-{label}-run{run}.log"


def decode_logged(b: lc.LlamaCpp, model: Path, spec: lc.SpecSettings, prompts, a, log: Path,
                  warmup: int = 2) -> list[lc.Completion]:
    """`decode_all` with llama.cpp's per-implementation statistics in the log (-lv 4, printed between
    requests, outside the timed generation); each completion carries its request's log record."""
    spec = replace(spec, extra=(*spec.extra, *llamacpp_log.STATS_ARGS))
    outs, _ = lc.decode_all(b, model, spec, prompts, a.n_predict, a.threads, log, omp=a.omp_wait_policy,
                            warmup=warmup)
    attach_log(outs, llamacpp_log.read(log))
    return outs


def attach_log(outs: list[lc.Completion], records: list[dict]) -> None:
    """The log's last len(outs) requests are these completions (the warm-ups come first); attached only
    where the log's token counts agree with the completions'."""
    records = records[-len(outs):] if outs else []
    if len(records) == len(outs) and all(r["eval_n"] == o.timings.get("predicted_n") for r, o in zip(records, outs)):
        for o, r in zip(outs, records):
            o.server_log = r


def disturbed_note(r: dict) -> str:
    """The requests a shared machine slowed (mark_disturbed), and the row's speed-up without them."""
    if not r.get("disturbed"):
        return ""
    undisturbed = r.get("measured_speedup_undisturbed")
    return (f"; {len(r['disturbed'])} disturbed requests"
            + (f", {undisturbed:.2f}x measured without them" if undisturbed else ""))


def pricing_note(result: dict) -> str:
    """What the prediction had to do without (a cost run or row logs from before these were measured)."""
    missing = result.get("pricing_missing") or []
    return f"Not measured in this run (priced at 0 unless noted): {'; '.join(missing)}. " if missing else ""


# --- cost curve: llama.cpp's own draft and verification costs, and the speed-up they predict ---------
def recommended_label(row: str) -> str:
    return "no speculation (plain)" if row == "plain" else row


def cond_acceptance(mine: dict) -> list[float]:
    """Conditional acceptance per draft position from our verifier's counts (llamacpp_check.ours)."""
    out, prev = [], mine["drafts"]
    for n in mine["accepted_per_pos"]:
        out.append(n / prev if prev else 0.0)
        prev = n
    return out


def verify_costs(server: lc.Server, base: list[int], pool: list[int], ns: list[int], reps: int) -> list[dict]:
    """Milliseconds llama.cpp takes to evaluate n new tokens after a cached prefix (its `prompt_ms`),
    for each n, `reps` times, interleaved so that drift hits every n alike; each 1-token request is
    followed by a second one, which finds the graph of the first to reuse (the others find a graph of
    another size and build theirs). Each request's first new token differs from the last one's, so
    exactly n tokens are evaluated (recorded: `prompt_n`). -> the requests in order: n, again, ms, prompt_n."""
    server.complete(base, 1, cache_prompt=True)  # the prefix, cached from now on
    out = []
    for r in range(reps):
        for n in ns:
            start = (r * len(ns) + n) % max(1, len(pool) - n - 1)
            for again in ((False, True) if n == 1 else (False,)):
                at = (start + len(pool) // 2) % max(1, len(pool) - 1) if again else start
                extra = pool[at:at + n]
                t = server.complete(base + extra, 1, cache_prompt=True).timings
                out.append({"n": n, "again": again, "ms": float(t.get("prompt_ms") or 0.0),
                            "prompt_n": int(t.get("prompt_n") or 0)})
    return out


def split_verify(requests: list[dict], log: list[dict]) -> tuple[dict[int, list[float]], list[float]]:
    """(t(n) samples: requests that evaluated exactly n tokens in a graph built for them, 1-token samples
    that reused the previous request's graph). `log`: the verification server's requests (the prefix
    first); where it covers every request, llama.cpp's `graphs reused` decides which graph each used."""
    reused_of = ([r["graphs_reused"] for r in log[1:]] if len(log) == len(requests) + 1
                 and all(r["graphs_reused"] is not None for r in log) else [None] * len(requests))
    samples: dict[int, list[float]] = {}
    again: list[float] = []
    for q, reused in zip(requests, reused_of):
        if q["prompt_n"] != q["n"]:
            continue
        if q["again"]:
            if reused is None or reused > 0:
                again.append(q["ms"])
        elif reused is None or reused == 0:
            samples.setdefault(q["n"], []).append(q["ms"])
    return samples, again


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def draft_step_ms(outs: list[lc.Completion]) -> tuple[float, int]:
    """(median over requests of generation ms per decoding step, steps in all): each step emits 1 + its
    accepted drafts; the first generated token comes from the prompt's logits (no step). Plain
    decoding has no drafts: one token per step."""
    per, total = [], 0
    for o in outs:
        steps = int(o.timings.get("predicted_n") or 0) - 1 - o.accepted
        if steps > 0:
            per.append(float(o.timings.get("predicted_ms") or 0.0) / steps)
            total += steps
    return (statistics.median(per) if per else float("nan")), total


def process_per_token_ms(plain: list[tuple[int, float]], spec: list[list[tuple[int, float]]]) -> float | None:
    """The EAGLE-3 drafter's catch-up per token (it encodes and decodes every token the target evaluated):
    median over requests of (prompt ms with the drafter - prompt ms without) / prompt tokens, the same
    prompts in the same order; (prompt_n, prompt_ms) per request."""
    per = [(ms - p_ms) / n for run in spec if len(run) == len(plain)
           for (n, ms), (p_n, p_ms) in zip(run, plain) if n == p_n and n > 0]
    return median(per)


def drafter_call_ms(outs: list[lc.Completion]) -> float | None:
    """The draft model's own drafting time per call (k draft decodes), from llama.cpp's statistics."""
    calls = ms = 0.0
    for o in outs:
        for impl, s in ((o.server_log or {}).get("stats") or {}).items():
            if impl.startswith("draft") and s.get("calls_draft") and s.get("draft_ms") is not None:
                calls, ms = calls + s["calls_draft"], ms + s["draft_ms"]
    return ms / calls if calls else None


def prompt_timings(outs: list[lc.Completion]) -> list[tuple[int, float]]:
    return [(int(o.timings.get("prompt_n") or 0), float(o.timings.get("prompt_ms") or 0.0)) for o in outs]


def line_fit(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through {k: y}, both at least 0 (one point: through 0)."""
    ks, ys = list(points), list(points.values())
    if len(ks) == 1:
        return 0.0, max(0.0, ys[0] / ks[0])
    mk, my = statistics.mean(ks), statistics.mean(ys)
    slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    return max(0.0, my - slope * mk), max(0.0, slope)


def fit_draft_costs(step_ms: dict[int, float], verify_ms: dict[int, float]) -> tuple[float, float]:
    """(fixed ms, ms per draft token) of the drafter: least squares of step(k) - verify(k + 1) on k."""
    return line_fit({k: step_ms[k] - verify_ms[k + 1] for k in step_ms if k + 1 in verify_ms})


def fit_output_rows(curve: dict) -> float | None:
    """The ms a verification batch spends per token on its output (llama.cpp computes logits for every
    token of it; t(n), from prompts, for the last only): the slope over k of what the cost run's step at k
    leaves after the drafter's own drafting (llama.cpp's statistics), t(k + 1), its catch-up on k + 1
    tokens, the accepted tokens and the step overhead. None unless all of those were measured."""
    need = ("draft_call_ms", "process_per_token_ms", "accepted_token_ms", "spec_overhead_ms")
    if any(curve.get(key) is None for key in need):
        return None
    t, calls, acc = curve["t_ms"], curve["draft_call_ms"], curve["accepted_per_step"]
    rest = {k: ms - calls[k] - t[k + 1] - (k + 1) * curve["process_per_token_ms"]
            - acc.get(k, 0.0) * curve["accepted_token_ms"] - curve["spec_overhead_ms"]
            for k, ms in curve["step_ms"].items() if k in calls and k + 1 in t}
    return line_fit(rest)[1] if len(rest) >= 2 else None


# a speculative server that never drafts: ngram-simple gives up at once while the context is no longer
# than its n-gram (1024, the most llama.cpp allows) + m-gram + 1 tokens
NO_DRAFT = lc.SpecSettings(("ngram-simple",), extra=("--spec-ngram-simple-size-n", "1024"))
# verification batches beyond 1..K+1: the draftless types draft up to 48 (ngram-simple, ngram-map-k) and
# 64 (ngram-mod) tokens in one step
LARGE_BATCHES = (8, 16, 32, 64)


def synthetic(spec: lc.SpecSettings, length: int) -> lc.SpecSettings:
    """`spec` with llama.cpp's synthetic acceptance: every step emits `length` tokens (1: none of the
    drafts, k + 1: all of them), whatever the drafts were; the same work otherwise."""
    return replace(spec, extra=(*spec.extra, "--spec-synth-len", str(length)))


def accepted_token_ms(none: list[lc.Completion], every: list[lc.Completion], k: int) -> float | None:
    """Sampling and emitting one accepted token: a step accepting all k drafts less one accepting none
    (medians over requests), over k."""
    a, b = draft_step_ms(every)[0], draft_step_ms(none)[0]
    return None if math.isnan(a) or math.isnan(b) else max(0.0, (a - b) / k)


def cost_run(a, b: lc.LlamaCpp, target_gguf: Path, draft_gguf: Path, spec_type: str, prompts, out: Path) -> dict:
    """Plain decoding, t(n) for n = 1..K+1 and LARGE_BATCHES (and a graph build's cost), a speculative
    server's step that drafts nothing, the draft at each k = 1..K, and at K with llama.cpp's synthetic
    acceptance of none and of all drafts, each in llama-server."""
    ks = list(range(1, a.max_k + 1))
    ns = [*range(1, a.max_k + 2), *(n for n in LARGE_BATCHES if n > a.max_k + 1)]
    env = lc.omp_env(a.omp_wait_policy)
    load = {"before": lc.load_average()}
    repeated = prompts * a.spec_reps
    plain = decode_logged(b, target_gguf, lc.SpecSettings(), repeated, a, out / "cost-plain.log")
    pool = [t for _, ids in prompts[1:] for t in ids] + [t for o in plain for t in o.tokens]
    with lc.Server(b, target_gguf, threads=a.threads, log=out / "cost-verify.log", env=env) as server:
        requests = verify_costs(server, prompts[0][1], pool, ns, a.reps)
    samples, reused = split_verify(requests, llamacpp_log.read(out / "cost-verify.log"))
    idle = [o for o in decode_logged(b, target_gguf, NO_DRAFT, repeated, a, out / "cost-nodraft.log", warmup=1)
            if not o.drafted]
    spec_rows, spec_prompts = {}, []
    for k in ks:
        outs = decode_logged(b, target_gguf, lc.SpecSettings((spec_type,), draft_gguf, n_max=k), repeated, a,
                             out / f"cost-spec-k{k}.log", warmup=1)
        ms, steps = draft_step_ms(outs)
        accepted = sum(o.accepted for o in outs)
        spec_prompts.append(prompt_timings(outs))
        spec_rows[k] = {"k": k, "step_ms": ms, "steps": steps, "tok_s": llamacpp_check.tok_s(outs),
                        "tokens_per_step": (steps + accepted) / steps if steps else None,
                        "drafted": sum(o.drafted for o in outs), "accepted": sum(o.accepted for o in outs),
                        "draft_call_ms": drafter_call_ms(outs),
                        "greedy_equal": all(o.tokens == p.tokens for o, p in zip(outs, plain))}
    k, model = ks[-1], lc.SpecSettings((spec_type,), draft_gguf, n_max=ks[-1])
    none, every = (decode_logged(b, target_gguf, synthetic(model, n), prompts, a, out / f"cost-synth-len{n}.log",
                                 warmup=1) for n in (1, k + 1))
    load["after"] = lc.load_average()
    return {"plain_tok_s": llamacpp_check.tok_s(plain), "plain_step_ms": draft_step_ms(plain)[0],
            "verify_samples_ms": samples, "verify_reused_ms": reused,
            "nodraft_step_ms": draft_step_ms(idle)[0] if idle else None,
            "process_per_token_ms": process_per_token_ms(prompt_timings(plain), spec_prompts),
            "accepted_token_ms": accepted_token_ms(none, every, k), "spec": spec_rows, "load_average": load}


def cost_curve(run: dict) -> dict:
    """t(n) (batch of n, per request overhead removed), v(n) = t(n) / plain step, the drafter's c
    per draft token (and fixed part per step) relative to a plain step. A request's `prompt_ms` for one
    new token exceeds a plain decoding step by the request's own overhead (slot start, prompt-cache
    match, a graph built for it): that difference is taken off every t(n). Also, where the run measured
    them: one graph build (a 1-token request building its graph less one reusing it), a speculative
    server's step overhead (its step drafting nothing less plain's), the drafter's catch-up per token
    and its drafting per call at each k, one accepted token's sampling and emission, and the tokens
    accepted per step at each k."""
    raw = {n: median(xs) for n, xs in run["verify_samples_ms"].items() if xs}
    plain_ms = run["plain_step_ms"]
    overhead = max(0.0, raw[1] - plain_ms)
    t = {n: max(x - overhead, 1e-6) for n, x in raw.items()}
    step_ms = {k: r["step_ms"] for k, r in run["spec"].items() if r["steps"] > 0}
    fixed, per = fit_draft_costs(step_ms, t)
    reused, idle = median(run.get("verify_reused_ms") or []), run.get("nodraft_step_ms")
    calls = {k: r["draft_call_ms"] for k, r in run["spec"].items() if r.get("draft_call_ms") is not None}
    curve = {"t_raw_ms": raw, "request_overhead_ms": overhead, "t_ms": t, "v": {n: x / plain_ms for n, x in t.items()},
             "plain_step_ms": plain_ms, "c": per / plain_ms, "draft_fixed": fixed / plain_ms,
             "draft_per_token_ms": per, "draft_fixed_ms": fixed, "step_ms": step_ms,
             "c_per_k": {k: (ms - t[k + 1]) / k / plain_ms for k, ms in step_ms.items() if k + 1 in t},
             "graph_build_ms": None if reused is None else max(0.0, raw[1] - reused),
             "spec_overhead_ms": None if idle is None else max(0.0, idle - plain_ms),
             "process_per_token_ms": run.get("process_per_token_ms"), "draft_call_ms": calls or None,
             "accepted_token_ms": run.get("accepted_token_ms"),
             "accepted_per_step": {k: r["accepted"] / r["steps"] for k, r in run["spec"].items()
                                   if r["steps"] and r.get("accepted") is not None}}
    return {**curve, "output_row_ms": fit_output_rows(curve)}


def predicted(curve: dict, cond: list[float], ks: list[int]):
    """eval/predict.py's chain prediction from llama.cpp's measured costs."""
    return predict(cond, curve_costs(curve), ks=ks)


def cost_markdown(r: dict) -> str:
    c = r["curve"]
    lines = [f"llama.cpp {r['version']} cost curve: target `{r['target']}` ({r['quantization']}), draft `{r['draft']}` "
             f"({r['spec_type']}); threads {r['threads']}, OMP_WAIT_POLICY {r['omp_wait_policy']}, load average "
             f"{r['load_average']['before']} -> {r['load_average']['after']} (a shared machine: compare within this "
             "table only). Verification cost t(n): llama-server's `prompt_ms` for n new tokens after a cached "
             f"prefix, median of {r['reps']}, less the request's own overhead ({c['request_overhead_ms']:.2f} ms: "
             "prompt_ms of one token minus a plain step); v(n) = t(n) / plain step. The draft's cost: llama-server's "
             "generation time per speculative step at each k (median over requests) minus t(k+1), fitted as fixed + c "
             "per draft token.", "",
             f"plain: {r['plain_tok_s']:.1f} tok/s in total, {c['plain_step_ms']:.3f} ms per step (median). "
             f"Draft cost c = {c['c']:.3f} of a "
             f"plain step per draft token (+ {c['draft_fixed']:.3f} fixed per step; per k: "
             f"{ {k: round(x, 3) for k, x in c['c_per_k'].items()} }).", "", extra_prices_line(c), "",
             "| n | prompt_ms (raw) | t(n) ms | v(n) |", "|---|---|---|---|"]
    lines += [f"| {n} | {c['t_raw_ms'][n]:.3f} | {c['t_ms'][n]:.3f} | {c['v'][n]:.2f} |" for n in sorted(c["t_ms"])]
    lines += ["", "Measured: llama.cpp's tokens per step x plain step / speculative step (medians over requests, as "
              "the costs); tok/s: totals, which outlier requests on a shared machine move more.", "",
              "| k | E tokens/step (ours) | predicted | tokens/step (llama.cpp) | measured | tok/s | accepted/drafted "
              "| greedy-equal |", "|---|---|---|---|---|---|---|---|"]
    for row in r["prediction"]["chains"]:
        m = r["measured"].get(row["k"]) or r["measured"].get(str(row["k"])) or {}
        ratio = f"{measured_speedup(m, c):.2f}x" if m.get("tokens_per_step") else "-"
        rate = f"{m['accepted']}/{m['drafted']}" if m.get("drafted") else "-"
        tps = f"{m['tokens_per_step']:.2f}" if m.get("tokens_per_step") else "-"
        speed = f"{m['tok_s']:.0f}" if m.get("tok_s") else "-"
        lines.append(f"| {row['k']} | {row['expected_tokens']:.2f} | {row['speedup']:.2f}x | {tps} | {ratio} | {speed} | "
                     f"{rate} | {m.get('greedy_equal', '-')} |")
    lines += ["", f"Acceptance profile (conditional, per position): {[round(x, 3) for x in r['cond_acceptance']]} "
              f"({r['acceptance_source']}).", "", f"**Recommendation: {r['recommendation']}**"]
    return "\n".join(lines) + "\n"


# --- pricing a side-by-side row: what llama-server did on its steps, at the cost run's prices ------------
# One step of llama-server by --spec-type (llama.cpp 0c1e570: common/speculative.cpp,
# tools/server/server-context.cpp): a speculative server hands the draft and the drafter's catch-up to its
# task queue and copies the context on every step (the step overhead); the draftless types look up their
# draft first, the draft model drafts only when none of them found one; the target verifies 1 + d tokens in
# one batch, whose graph llama.cpp builds anew whenever the batch size changes, then samples and emits
# each accepted token; the EAGLE-3 drafter encodes and decodes every token of that batch (+ one it skipped
# when it did not draft) to catch up.
def steps_of(p: dict) -> int:
    """Decoding steps of one request: its tokens after the first, less those accepted from drafts."""
    return int(p.get("predicted_n") or 0) - 1 - int(p.get("draft_n_accepted") or 0)


def builds_of(p: dict) -> int | None:
    """Graphs llama.cpp built during one request's steps (steps less `graphs reused`)."""
    log = p.get("server_log") or {}
    return None if log.get("graphs_reused") is None else steps_of(p) - int(log["graphs_reused"])


def log_counters(row: dict, plain: dict | None = None) -> dict | None:
    """The row's llama-server log, summed over the requests it covers and scaled to all of the row's steps
    (an older run kept only its last pass's log): graph builds beyond plain's on the same prompts (plain's
    own, one per request and one where the context outgrows a cache block, are in t(1)), the draftless
    lookups' own milliseconds, drafts, drafted and accepted tokens, the draft model's drafting calls."""
    covered = [i for i, p in enumerate(row["per_prompt"]) if builds_of(p) is not None]
    steps_cov = sum(steps_of(row["per_prompt"][i]) for i in covered)
    if not covered or steps_cov <= 0:
        return None
    base = plain["per_prompt"] if plain and len(plain["per_prompt"]) == len(row["per_prompt"]) else None
    out = dict.fromkeys(("builds", "lookup_ms", "lookup_drafts", "lookup_tokens", "lookup_accepted",
                         "drafter_calls"), 0.0)
    stats = False
    for i in covered:
        p = row["per_prompt"][i]
        ref = builds_of(base[i]) if base else None
        out["builds"] += builds_of(p) - (ref if ref is not None else 1)
        for impl, s in (p["server_log"].get("stats") or {}).items():
            stats = True
            if impl.startswith("draft"):
                out["drafter_calls"] += s.get("calls_draft") or 0
                continue
            out["lookup_ms"] += s.get("draft_ms") or 0.0
            out["lookup_drafts"] += s.get("gen_drafts") or 0
            out["lookup_tokens"] += s.get("gen_tokens") or 0
            out["lookup_accepted"] += s.get("acc_tokens") or 0
    scale = sum(steps_of(p) for p in row["per_prompt"]) / steps_cov
    out = {k: v * scale for k, v in out.items()}
    out["builds"] = max(0.0, out["builds"])
    return {**out, "statistics": stats, "coverage": len(covered) / len(row["per_prompt"])}


PRICES = {  # what the cost run measures beyond t(n) and the drafter's step; 0 where it did not
    "overhead": "spec_overhead_ms",  # a speculative server's step that drafts nothing, less plain's
    "build": "graph_build_ms",  # a graph built for a new batch size, less one reused
    "sigma": "accepted_token_ms",  # sampling and emitting one more accepted token
    "process": "process_per_token_ms",  # the drafter's catch-up on one verified token
    "output": "output_row_ms",  # the logits of one more token of a verification batch
}


def step_prices(curve: dict) -> dict:
    """The cost run's prices in ms: t(n) (eval/predict's StepCosts: linear between measured sizes and
    beyond), its slope over the measured sizes, and PRICES (0 where an older cost run did not measure them)."""
    costs = curve_costs(curve)
    t = {int(n): float(ms) for n, ms in curve["t_ms"].items()}
    slope = (t[max(t)] - t[1]) / (max(t) - 1) if max(t) > 1 else 0.0
    prices = {key: float(curve.get(field) or 0.0) for key, field in PRICES.items()}
    return {"t": lambda n: costs.target(n) * 1000, "t1": t[1], "slope": slope, **prices,
            "measured": {key: curve.get(field) is not None for key, field in PRICES.items()}}


def model_step(curve: dict, prices: dict, k: int) -> dict:
    """The draft model's step at k: `ms` as the cost run timed it, `accepted` per step there, `drafts` the
    part that is its k draft decodes (llama.cpp's statistics in the cost run, else the step less
    verification, the overhead, the drafter's catch-up on k + 1 tokens and the accepted tokens)."""
    measured = {int(kk): float(ms) for kk, ms in (curve.get("step_ms") or {}).items()}
    step = measured.get(k, prices["t"](k + 1) + curve["draft_fixed_ms"] + k * curve["draft_per_token_ms"])
    accepted = float((curve.get("accepted_per_step") or {}).get(str(k), (curve.get("accepted_per_step") or {}).get(k))
                     or 0.0)
    calls = {int(kk): float(ms) for kk, ms in (curve.get("draft_call_ms") or {}).items()}
    drafts = calls.get(k, step - prices["t"](k + 1) - k * prices["output"] - prices["overhead"]
                       - (k + 1) * prices["process"] - accepted * prices["sigma"])
    return {"ms": step, "accepted": accepted, "drafts": max(0.0, drafts), "timed": k in measured}


def row_price(row: dict, curve: dict, model_k: int | None, plain: dict | None = None) -> dict | None:
    """Milliseconds of a side-by-side row's steps at a `--cost` run's prices (same target, draft, threads),
    from llama.cpp's counters of the row, and how: {"ms", "tokens", "basis"}. None without steps."""
    steps = sum(steps_of(p) for p in row["per_prompt"])
    tokens = sum(int(p.get("predicted_n") or 0) - 1 for p in row["per_prompt"])
    if steps <= 0:
        return None
    prices, log = step_prices(curve), log_counters(row, plain)
    accepted, drafted = float(row["accepted"]), float(row["drafted"])
    extra = (log["builds"] * prices["build"] + log["lookup_ms"]) if log else 0.0
    if not row["draft"]:
        # every step: t(1) and the overhead; every draft: t(1 + its tokens) - t(1); every accepted token
        # emitted; + graph builds and the lookups' own time
        lookups = log["lookup_drafts"] if log and log["statistics"] else 0
        verify = drafted * prices["output"] + (lookups * (prices["t"](1 + log["lookup_tokens"] / lookups) - prices["t1"])
                                               if lookups else drafted * prices["slope"])
        ms = steps * (prices["t1"] + prices["overhead"]) + verify + accepted * prices["sigma"] + extra
        return {"ms": ms, "tokens": tokens, "basis": "draftless" + ("" if log else " (no server log)")}
    if not model_k:
        return None
    m = model_step(curve, prices, model_k)
    mixed, full = len(row["spec_types"]) > 1, drafted >= 0.95 * steps * model_k
    if m["timed"] and ((not mixed and full) or (mixed and log and log["statistics"])):
        # the model's steps as the cost run timed them (overhead, k draft decodes, verification of k + 1,
        # the drafter's catch-up), its accepted tokens as the row's; in a mixed row the lookup drafted
        # first on `lookups` steps (llama.cpp's statistics): those verify its m tokens and the drafter
        # catches up on m + 1 instead of drafting
        lookups = min(log["lookup_drafts"], steps) if mixed else 0.0
        size = log["lookup_tokens"] / lookups if lookups else 0.0
        lookup_step = (prices["t"](1 + size) - prices["t"](1 + model_k) + (size - model_k) * prices["output"]
                       + (size + 1 - model_k) * prices["process"] - m["drafts"])
        ms = (steps * m["ms"] + (accepted - steps * m["accepted"]) * prices["sigma"] + lookups * lookup_step
              + (extra if mixed else 0.0))
        basis = (f"mixed: {lookups:.0f} lookup steps of {size:.1f} tokens, {steps - lookups:.0f} model steps"
                 if mixed else f"the cost run's step at k={model_k}")
        return {"ms": ms, "tokens": tokens, "basis": basis}
    # the parts, the drafter's cost on every step (an upper bound for a mixed row)
    ms = (steps * prices["t1"] + drafted * prices["slope"]
          + steps * (curve["draft_fixed_ms"] + model_k * curve["draft_per_token_ms"]))
    basis = "drafter on every step" + (" (no per-implementation statistics: an upper bound)" if mixed else "")
    return {"ms": ms, "tokens": tokens, "basis": basis}


def extra_prices_line(c: dict) -> str:
    """The prices the side-by-side rows need beyond t(n) and the drafter's step, as measured (or not)."""
    names = {"spec_overhead_ms": "speculative step overhead (a step drafting nothing less plain's)",
             "graph_build_ms": "graph build (a 1-token request building its graph less one reusing it)",
             "accepted_token_ms": "accepted token (synthetic acceptance of all k drafts less none, per draft)",
             "process_per_token_ms": "drafter catch-up per verified token (prompt time with the drafter less without)",
             "output_row_ms": "logits of one more verified token (fitted over k on what the step at k leaves)"}
    parts = [f"{name}: {'not measured' if c.get(key) is None else f'{c[key]:.3f} ms'}" for key, name in names.items()]
    calls = c.get("draft_call_ms") or {}
    parts.append("drafter's k draft decodes per call (llama.cpp's statistics): "
                 + (", ".join(f"k={k} {ms:.3f} ms" for k, ms in sorted(calls.items(), key=lambda x: int(x[0])))
                    or "not measured"))
    return "Prices for the side-by-side rows: " + "; ".join(parts) + "."


def price_speedup(price: dict | None, curve: dict) -> float | None:
    """A `row_price` as a speed-up over plain: its tokens at plain's step over its milliseconds."""
    return None if price is None else price["tokens"] * curve["plain_step_ms"] / price["ms"]


def row_prediction(row: dict, curve: dict, model_k: int | None, plain: dict | None = None) -> float | None:
    """A side-by-side row's speed-up over plain predicted from a `--cost` run's curve (`row_price`)."""
    return price_speedup(row_price(row, curve, model_k, plain), curve)


def add_row_predictions(result: dict, cost: dict) -> None:
    """Every side-by-side row's predicted speed-up over plain beside its measured one, and the setting
    the prediction recommends (plain when nothing is predicted faster) against the fastest measured."""
    plain, rows = reference_tok_s(result["rows"]), result["rows"]
    # graph builds are counted beyond plain's on the same prompts: a plain row with its server log
    base = next((r for r in (rows[0], rows[-1]) if not r["spec_types"] and any(p.get("server_log")
                                                                              for p in r["per_prompt"])), rows[0])
    for row in result["rows"]:
        row["measured_speedup"] = row["tok_s"] / plain if row["tok_s"] and plain else None
        price = None if not row["spec_types"] else row_price(row, cost["curve"], row["spec_draft_n_max"], base)
        row["predicted_speedup"] = 1.0 if not row["spec_types"] else price_speedup(price, cost["curve"])
        row["prediction_basis"] = "plain" if not row["spec_types"] else price and price["basis"]
        row["within_10pct"] = (abs(row["predicted_speedup"] / row["measured_speedup"] - 1) <= 0.10
                               if row["predicted_speedup"] and row["measured_speedup"] else None)
    rows = result["rows"][:-1]  # the last is plain again (drift)
    best = max(rows, key=lambda r: r["predicted_speedup"] or 0)
    # speculation only where it is predicted to beat plain by MIN_GAIN (eval's rule): smaller gains are noise
    recommended = best if (best["predicted_speedup"] or 0) >= 1 + MIN_GAIN else rows[0]
    fastest = max(rows, key=lambda r: r["measured_speedup"] or 0)
    # plain measured twice: how far the machine drifted is how far apart two rows can be by chance
    first, again = result["rows"][0]["tok_s"], result["rows"][-1]["tok_s"]
    noise = abs(again / first - 1.0) if first and again else 0.0
    result["recommended"], result["fastest_measured"] = recommended["row"], fastest["row"]
    result["min_gain"], result["drift"] = MIN_GAIN, noise
    result["recommended_is_fastest"] = ((recommended["measured_speedup"] or 0)
                                        >= (fastest["measured_speedup"] or 0) * (1 - max(noise, MIN_GAIN)))
    result["cost_curve_from"] = Path(cost["source"]).name if cost.get("source") else None
    result["pricing_missing"] = pricing_missing(result["rows"], cost["curve"])
    mark_disturbed(result["rows"], cost["curve"], base)


# a request whose steps took this much longer, against their price, than the row's typical request did
# was slowed by something outside llama.cpp (a shared machine): its row's total misleads
DISTURBED = 1.5


def request_ratios(row: dict, curve: dict, plain: dict | None) -> list[float | None]:
    """Each request's measured generation ms over its own steps' price (`row_price` of that request alone)."""
    out = []
    for i, p in enumerate(row["per_prompt"]):
        one = {**row, "per_prompt": [p], "drafted": int(p.get("draft_n") or 0),
               "accepted": int(p.get("draft_n_accepted") or 0)}
        ref = {**plain, "per_prompt": [plain["per_prompt"][i]]} if plain and len(plain["per_prompt"]) == len(
            row["per_prompt"]) else None
        ms = (steps_of(p) * float(curve["t_ms"].get(1, curve["t_ms"].get("1"))) if not row["spec_types"]
              else (row_price(one, curve, row["spec_draft_n_max"], ref) or {}).get("ms"))
        out.append(float(p["predicted_ms"]) / ms if ms and p.get("predicted_ms") else None)
    return out


def mark_disturbed(rows: list[dict], curve: dict, plain: dict | None) -> None:
    """row["disturbed"]: the requests that took DISTURBED times longer against their price than the row's
    median request; row["measured_speedup_undisturbed"]: the row's speed-up over plain on the other
    prompts (plain's own disturbed requests left out too)."""
    for row in rows:
        ratios = request_ratios(row, curve, plain)
        typical = median([r for r in ratios if r])
        row["disturbed"] = [i for i, r in enumerate(ratios) if r and typical and r > DISTURBED * typical]
    plains = [r for r in (rows[0], rows[-1]) if not r["spec_types"]]
    for row in rows:
        keep = [i for i in range(len(row["per_prompt"])) if i not in row["disturbed"]
                and all(i not in p["disturbed"] for p in plains if len(p["per_prompt"]) == len(row["per_prompt"]))]
        refs = [tok_s_of(p, keep) for p in plains if len(p["per_prompt"]) == len(row["per_prompt"])]
        mine, refs = tok_s_of(row, keep), [x for x in refs if x]
        row["measured_speedup_undisturbed"] = mine / statistics.mean(refs) if mine and refs else None


def tok_s_of(row: dict, keep: list[int]) -> float | None:
    """Generated tokens per second of the row's requests `keep`."""
    n = sum(int(row["per_prompt"][i].get("predicted_n") or 0) for i in keep)
    ms = sum(float(row["per_prompt"][i].get("predicted_ms") or 0.0) for i in keep)
    return n / (ms / 1000) if ms else None


def pricing_missing(rows: list[dict], curve: dict) -> list[str]:
    """What the rows' prediction lacked (an older cost run or rows without server logs), priced at 0."""
    measured = step_prices(curve)["measured"]
    names = {"overhead": "a speculative step's overhead", "build": "a graph build", "sigma": "an accepted "
             "token's sampling and emission", "process": "the drafter's catch-up per token",
             "output": "the logits of each verified token beyond the last"}
    out = [name for key, name in names.items() if not measured[key]]
    if any(r["spec_types"] and not any(p.get("server_log") for p in r["per_prompt"]) for r in rows):
        out.append("some rows' server logs (graph builds, lookup time)")
    if any("upper bound" in (r.get("prediction_basis") or "") for r in rows):
        out.append("which steps the mixed row's lookup drafted (the drafter priced on every step: an upper bound)")
    return out


def measured_speedup(m: dict, curve: dict) -> float:
    """llama.cpp's own speed-up at one k, from the same medians the costs come from."""
    return m["tokens_per_step"] * curve["plain_step_ms"] / m["step_ms"]


def recommendation(pred) -> str:
    best = pred.best_chain()
    if not pred.speculate():
        return (f"no speculation (best predicted: k={best['k']} at {best['speedup']:.2f}x of plain llama.cpp)")
    return f"--spec-draft-n-max {best['k']} (predicted {best['speedup']:.2f}x of plain llama.cpp)"


def cost_main(a, b: lc.LlamaCpp, out: Path) -> dict:
    """The --cost mode: GGUFs (converted unless given), prompts, the run, the curve and the prediction."""
    g = llamacpp_check.prepare(Path(a.draft), Path(a.target), out / "gguf", b, print,
                               Path(a.target_gguf) if a.target_gguf else None)
    target_gguf = g.target
    draft_gguf = Path(a.draft_gguf) if a.draft_gguf else g.draft
    prompts = lc.prompt_ids(Path(a.target), Path(a.prompts) if a.prompts else None, a.limit)
    run = cost_run(a, b, target_gguf, draft_gguf, g.spec_type, prompts, out)
    curve = cost_curve(run)
    if a.acceptance:
        cond, source = [float(x) for x in a.acceptance.split(",")], "given with --acceptance"
    else:
        mine = llamacpp_check.ours(Path(a.target), g.source, prompts, a.n_predict, a.max_k)
        cond, source = cond_acceptance(mine), f"our verifier, chain k={a.max_k}, the same prompt ids"
    pred = predicted(curve, cond, list(range(1, a.max_k + 1)))
    return {"version": b.version(), "target": a.target, "target_gguf": str(target_gguf),
            "draft": a.draft, "spec_type": g.spec_type, "quantization": a.quantization, "threads": a.threads,
            "omp_wait_policy": lc.omp_label(a.omp_wait_policy), "prompts": len(prompts), "n_predict": a.n_predict,
            "reps": a.reps, "load_average": run["load_average"], "plain_tok_s": run["plain_tok_s"],
            "curve": curve, "verify_samples_ms": run["verify_samples_ms"], "measured": run["spec"],
            "cond_acceptance": cond, "acceptance_source": source, "prediction": pred.to_dict(),
            "recommendation": recommendation(pred)}


# --- re-pricing a finished run from what it saved (--reprice RUNDIR) -------------------------------------
def attach_saved_logs(result: dict, run_dir: Path) -> None:
    """Rows saved without their requests' log records get them from the run's server logs: a row's last
    log holds its last pass (older runs overwrote a row's log on every pass, and plain's with plain again's),
    matched to the row's last `prompts` requests where the token counts agree."""
    n, seen = result["prompts"], {}
    labels = ["+".join(r["spec_types"]) or "plain" for r in result["rows"]]
    for i, (row, label) in enumerate(zip(result["rows"], labels)):
        seen[label] = seen.get(label, 0) + 1
        if any(p.get("server_log") for p in row["per_prompt"]) or label in labels[i + 1:]:
            continue  # has its logs, or a later row of the same label wrote the last log under that name
        runs = sorted(run_dir.glob(f"server-{label}-run*.log"), key=lambda p: int(p.stem.rsplit("run", 1)[1]))
        path = runs[-1] if runs else run_dir / server_log_name(label, 1)
        records = llamacpp_log.read(path, last=n)
        tail = row["per_prompt"][-n:]
        if len(records) == len(tail) and all(r["eval_n"] == p.get("predicted_n") for r, p in zip(records, tail)):
            for p, r in zip(tail, records):
                p["server_log"] = {"graphs_reused": r["graphs_reused"], "stats": r["stats"]}
                p.setdefault("prompt_n", r["prompt_n"])
                p.setdefault("prompt_ms", r["prompt_ms"])


def saved_process_per_token(run_dir: Path) -> float | None:
    """The drafter's catch-up per token from a cost run's logs: its plain and per-k servers' prompt times
    (the timed requests follow 2 and 1 warm-ups)."""
    plain = [(r["prompt_n"], r["prompt_ms"]) for r in llamacpp_log.read(run_dir / "cost-plain.log")[2:]]
    spec = [[(r["prompt_n"], r["prompt_ms"]) for r in llamacpp_log.read(p)[1:]]
            for p in sorted(run_dir.glob("cost-spec-k*.log"))]
    return process_per_token_ms(plain, spec) if plain else None


def reprice(run_dir: Path) -> dict:
    """A finished side-by-side run (llamacpp.json, its cost curve and logs) priced again as this module
    prices rows now; each row keeps its earlier prediction as `predicted_before`."""
    result = json.loads((run_dir / "llamacpp.json").read_text())
    cost_path = run_dir / (result.get("cost_curve_from") or "llamacpp_cost.json")
    cost = {**json.loads(cost_path.read_text()), "source": str(cost_path)}
    if cost["curve"].get("process_per_token_ms") is None:
        cost["curve"]["process_per_token_ms"] = saved_process_per_token(run_dir)
    before = {i: r.get("predicted_speedup") for i, r in enumerate(result["rows"])}
    attach_saved_logs(result, run_dir)
    add_row_predictions(result, cost)
    for i, r in enumerate(result["rows"]):
        r["predicted_before"] = before[i]
    result["repriced_from"] = str(run_dir)
    return result


def reprice_markdown(result: dict) -> str:
    lines = [f"Re-priced {result['repriced_from']} ({result.get('quantization', 'f32')} target, "
             f"{result['prompts']} prompts x {result.get('passes', 1)} passes): measured speed-up over plain "
             "beside the prediction before and now.", "",
             "| row | measured | predicted before | predicted now | within 10% (now) | disturbed requests (measured "
             "without them) | how priced |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def x(v):
            return f"{v:.2f}x" if v else "-"
        dist = f"{len(r['disturbed'])} ({x(r['measured_speedup_undisturbed'])})" if r.get("disturbed") else "0"
        lines.append(f"| {r['row']} | {x(r['measured_speedup'])} | {x(r['predicted_before'])} | "
                     f"{x(r['predicted_speedup'])} | {r['within_10pct']} | {dist} | {r.get('prediction_basis') or '-'} |")
    lines += ["", pricing_note(result).strip()]
    return "\n".join(lines).rstrip() + "\n"


def reprice_main(run_dir: Path, out: Path | None) -> int:
    try:
        result = reprice(run_dir)
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"bench/llamacpp: cannot re-price {run_dir}: {e} (it needs the llamacpp.json and llamacpp_cost.json "
              "of a `--with-cost` or `--cost-json` run)", file=sys.stderr)
        return 2
    out = out or run_dir
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "llamacpp_repriced.json", result)
    write_text(out / "llamacpp_repriced.md", reprice_markdown(result))
    print(reprice_markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target")
    p.add_argument("--draft", help="a specheads EAGLE-3 export (--format vllm or gguf)")
    p.add_argument("--prompts", default=None)
    p.add_argument("--out")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--n-predict", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=1, help="each row decodes the prompts this many times, each time "
                   "in a fresh server, the rows in turn within a pass (a fast target's rows last seconds: more "
                   "passes, less noise, drift shared by every row)")
    p.add_argument("--k", type=int, default=None, help="--spec-draft-n-max for the draft rows (default: the export's)")
    p.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
                   help="the servers' OMP_WAIT_POLICY (default: inherited; recorded per row)")
    p.add_argument("--mix", default="auto", help="the draftless type mixed with the draft in the last row (default "
                   "auto: the fastest draftless row of this run)")
    p.add_argument("--cost", action="store_true", help="measure llama.cpp's cost curve (t(n), the draft's c) and "
                   "predict the speed-up per k instead of the side-by-side rows")
    p.add_argument("--max-k", type=int, default=4, help="--cost: draft lengths 1..K (verification of 1..K+1 tokens)")
    p.add_argument("--reps", type=int, default=15, help="--cost: repetitions of each verification size")
    p.add_argument("--spec-reps", type=int, default=3, help="--cost: each prompt decoded this many times per k "
                   "(and plain); step costs are medians over requests")
    p.add_argument("--target-gguf", default=None, help="an existing target GGUF (e.g. Q4_1) instead of converting to f32")
    p.add_argument("--draft-gguf", default=None, help="--cost: an existing sidecar instead of the export's")
    p.add_argument("--quantization", default="f32", help="what --target-gguf holds, for the record")
    p.add_argument("--acceptance", default=None, help="--cost: conditional acceptance per position, comma-separated "
                   "(default: our verifier's on the same prompts)")
    p.add_argument("--name", default="llamacpp_cost", help="--cost: file stem of the JSON and markdown")
    p.add_argument("--cost-json", default=None, help="a `--cost` run's JSON (same target GGUF, draft and threads): "
                   "predict every side-by-side row from its curve and say which setting it recommends")
    p.add_argument("--with-cost", action="store_true", help="measure the cost curve first, in this run (as --cost, "
                   "on the first --cost-limit prompts, into OUT/llamacpp_cost.json), and predict the rows from it")
    p.add_argument("--cost-limit", type=int, default=4, help="--with-cost: prompts of the cost run")
    p.add_argument("--reprice", default=None, metavar="RUNDIR", help="price the rows of a finished run again "
                   "(RUNDIR/llamacpp.json, its cost curve and server logs; nothing is run) into "
                   "OUT/llamacpp_repriced.{json,md} (OUT defaults to RUNDIR)")
    a = p.parse_args(argv)
    if a.reprice:
        return reprice_main(Path(a.reprice), Path(a.out) if a.out else None)
    if not (a.target and a.draft and a.out):
        p.error("--target, --draft and --out are required (except with --reprice)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.cost:
        try:
            result = cost_main(a, lc.ensure(), out)
        except lc.LlamaCppError as e:
            print(f"bench/llamacpp: {e}", file=sys.stderr)
            return 2
        write_json(out / f"{a.name}.json", result)
        write_text(out / f"{a.name}.md", cost_markdown(result))
        print(cost_markdown(result))
        return 0
    try:
        spec_type, _ = lc.draft_spec(Path(a.draft))
        b = lc.ensure()
        if a.with_cost:  # the curve from this run: the machine as the rows meet it
            cost = cost_main(argparse.Namespace(**{**vars(a), "limit": a.cost_limit}), b, out)
            write_json(out / "llamacpp_cost.json", cost)
            write_text(out / "llamacpp_cost.md", cost_markdown(cost))
            a.cost_json = str(out / "llamacpp_cost.json")
        draft_gguf = out / "draft-f32.gguf"
        if a.target_gguf:  # e.g. the Q4_1 file users serve (prompts go in as ids)
            target_gguf, conv = Path(a.target_gguf), {"target": {"given": a.target_gguf}}
        else:
            target_gguf = out / "target-f32.gguf"
            conv = {"target": lc.convert(Path(a.target), target_gguf)}
        conv["draft"] = lc.convert_draft(Path(a.draft), Path(a.target), draft_gguf)
        prompts = lc.prompt_ids(Path(a.target), Path(a.prompts) if a.prompts else None, a.limit)
        k = a.k or json.loads((Path(a.draft) / "specheads.json").read_text()).get("num_speculative_tokens")
        runs: dict[str, int] = {}

        def decode(spec: lc.SpecSettings) -> list[lc.Completion]:
            print(f"[bench] {spec.label} ... (load {lc.load_average()})", flush=True)
            runs[spec.label] = runs.get(spec.label, 0) + 1
            return decode_logged(b, target_gguf, spec, prompts, a, out / server_log_name(spec.label, runs[spec.label]))

        rows = interleaved_rows(rows_to_run(spec_type, draft_gguf, k, a.mix), a.passes, decode, a.threads,
                                a.omp_wait_policy)
        for row in rows:
            print(f"  {row['row']}: {row['tok_s']:.1f} tok/s, accepted {row['accepted']}/{row['drafted']}, "
                  f"equal {row['greedy_equal_prompts']}", flush=True)
    except lc.LlamaCppError as e:
        print(f"bench/llamacpp: {e}", file=sys.stderr)
        return 2
    result = {"version": b.version(), "target": a.target, "target_gguf": str(target_gguf),
              "quantization": a.quantization if a.target_gguf else "f32", "draft": a.draft, "prompts_file": a.prompts,
              "prompts": len(prompts), "passes": a.passes, "n_predict": a.n_predict, "threads": a.threads,
              "omp_wait_policy": lc.omp_label(a.omp_wait_policy), "spec_draft_n_max": k,
              "mix": a.mix, "mixed_with": rows[-2]["spec_types"][1:], "conversions": conv, "rows": rows}
    if a.cost_json:
        add_row_predictions(result, {**json.loads(Path(a.cost_json).read_text()), "source": a.cost_json})
    write_json(out / "llamacpp.json", result)
    write_text(out / "llamacpp.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
