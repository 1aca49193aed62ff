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
DIR/llamacpp.json and DIR/llamacpp.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.engines import llamacpp as lc
from specheads.engines import llamacpp_check
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
            "per_prompt": [{k: o.timings.get(k) for k in ("predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")}
                           for o in outs]}


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
            pred = " - |" if r["predicted_speedup"] is None else f" {r['predicted_speedup']:.2f}x ({close} 10%) |"
        lines.append(f"| {r['row']} | {speed} | {ratio} |{pred} {rate} | {eq} | "
                     f"{r['load_average']['before'][0]} / {r['load_average']['after'][0]} |")
    if predicted:
        lines += ["", f"Predicted from llama.cpp's own cost curve ({result['cost_curve_from']}): each row's step mix "
                  "priced at t(n) (+ the drafter's cost on every step of a row with the draft model). "
                  f"**Recommended: {recommended_label(result['recommended'])}** (speculation only when predicted >= "
                  f"{1 + result['min_gain']:.2f}x); fastest measured: {result['fastest_measured']}; plain drifted "
                  f"{result['drift']:.1%} between its two runs; the recommendation is "
                  f"{'' if result['recommended_is_fastest'] else 'NOT '}the fastest measured within that noise."]
    return "\n".join(lines) + "\n"


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


def verify_costs(server: lc.Server, base: list[int], pool: list[int], ns: list[int], reps: int) -> dict[int, list[float]]:
    """Milliseconds llama.cpp takes to evaluate n new tokens after a cached prefix (its `prompt_ms`),
    for each n, `reps` times, interleaved so that drift hits every n alike. Each request's first new
    token differs from the last one's, so exactly n tokens are evaluated (recorded: `prompt_n`)."""
    server.complete(base, 1, cache_prompt=True)  # the prefix, cached from now on
    out: dict[int, list[float]] = {n: [] for n in ns}
    for r in range(reps):
        for n in ns:
            start = (r * len(ns) + n) % max(1, len(pool) - n)
            extra = pool[start:start + n]
            t = server.complete(base + extra, 1, cache_prompt=True).timings
            if int(t.get("prompt_n") or 0) == n:
                out[n].append(float(t["prompt_ms"]))
    return out


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


def fit_draft_costs(step_ms: dict[int, float], verify_ms: dict[int, float]) -> tuple[float, float]:
    """(fixed ms, ms per draft token) of the drafter: least squares of step(k) - verify(k + 1) on k."""
    ks = [k for k in step_ms if k + 1 in verify_ms]
    ys = [step_ms[k] - verify_ms[k + 1] for k in ks]
    if len(ks) == 1:
        return 0.0, ys[0] / ks[0]
    mk, my = statistics.mean(ks), statistics.mean(ys)
    slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    return max(0.0, my - slope * mk), max(0.0, slope)


def cost_run(a, b: lc.LlamaCpp, target_gguf: Path, draft_gguf: Path, spec_type: str, prompts, out: Path) -> dict:
    """Plain decoding, v(n) for n = 1..K+1, and the draft at each k = 1..K, each in llama-server."""
    ks, ns = list(range(1, a.max_k + 1)), list(range(1, a.max_k + 2))
    env = lc.omp_env(a.omp_wait_policy)
    load = {"before": lc.load_average()}
    plain, _ = lc.decode_all(b, target_gguf, lc.SpecSettings(), prompts * a.spec_reps, a.n_predict, a.threads,
                             out / "cost-plain.log", omp=a.omp_wait_policy, warmup=2)
    pool = [t for _, ids in prompts[1:] for t in ids] + [t for o in plain for t in o.tokens]
    with lc.Server(b, target_gguf, threads=a.threads, log=out / "cost-verify.log", env=env) as server:
        samples = verify_costs(server, prompts[0][1], pool, ns, a.reps)
    spec_rows = {}
    for k in ks:
        outs, _ = lc.decode_all(b, target_gguf, lc.SpecSettings((spec_type,), draft_gguf, n_max=k), prompts * a.spec_reps,
                                a.n_predict, a.threads, out / f"cost-spec-k{k}.log", omp=a.omp_wait_policy, warmup=1)
        ms, steps = draft_step_ms(outs)
        accepted = sum(o.accepted for o in outs)
        spec_rows[k] = {"k": k, "step_ms": ms, "steps": steps, "tok_s": llamacpp_check.tok_s(outs),
                        "tokens_per_step": (steps + accepted) / steps if steps else None,
                        "drafted": sum(o.drafted for o in outs), "accepted": sum(o.accepted for o in outs),
                        "greedy_equal": all(o.tokens == p.tokens for o, p in zip(outs, plain))}
    load["after"] = lc.load_average()
    return {"plain_tok_s": llamacpp_check.tok_s(plain), "plain_step_ms": draft_step_ms(plain)[0],
            "verify_samples_ms": samples, "spec": spec_rows, "load_average": load}


def cost_curve(run: dict) -> dict:
    """t(n) (batch of n, per request overhead removed), v(n) = t(n) / plain step, the drafter's c
    per draft token (and fixed part per step) relative to a plain step. A request's `prompt_ms` for one
    new token exceeds a plain decoding step by the request's own overhead (slot start, prompt-cache
    match): that difference is taken off every t(n)."""
    raw = {n: median(xs) for n, xs in run["verify_samples_ms"].items() if xs}
    plain_ms = run["plain_step_ms"]
    overhead = max(0.0, raw[1] - plain_ms)
    t = {n: max(x - overhead, 1e-6) for n, x in raw.items()}
    step_ms = {k: r["step_ms"] for k, r in run["spec"].items() if r["steps"] > 0}
    fixed, per = fit_draft_costs(step_ms, t)
    return {"t_raw_ms": raw, "request_overhead_ms": overhead, "t_ms": t, "v": {n: x / plain_ms for n, x in t.items()},
            "plain_step_ms": plain_ms, "c": per / plain_ms, "draft_fixed": fixed / plain_ms,
            "draft_per_token_ms": per, "draft_fixed_ms": fixed, "step_ms": step_ms,
            "c_per_k": {k: (ms - t[k + 1]) / k / plain_ms for k, ms in step_ms.items() if k + 1 in t}}


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
             f"{ {k: round(x, 3) for k, x in c['c_per_k'].items()} }).", "",
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


def row_prediction(row: dict, curve: dict, model_k: int | None) -> float | None:
    """A side-by-side row's speed-up predicted from a `--cost` run's curve (same target, draft, threads).
    A model row that drafted k on (nearly) every step is priced at the cost run's own median step at that k.
    Otherwise its own step mix (llama.cpp's counters: steps, drafted tokens) priced at t(n), which llama.cpp makes
    close to linear in n, so a step verifying 1 + d tokens costs t(1) + d * slope whatever the split of d
    across steps; rows with the model drafter add its fixed cost and c per drafted token on every step
    (the mix row too: an upper bound, llama.cpp does not say which steps its draftless type drafted)."""
    steps = sum(int(p.get("predicted_n") or 0) - 1 - int(p.get("draft_n_accepted") or 0) for p in row["per_prompt"])
    tokens = sum(int(p.get("predicted_n") or 0) - 1 for p in row["per_prompt"])
    if steps <= 0:
        return None
    t = {int(n): float(ms) for n, ms in curve["t_ms"].items()}
    slope = (t[max(t)] - t[1]) / (max(t) - 1) if max(t) > 1 else 0.0
    measured_step = {int(k): float(ms) for k, ms in (curve.get("step_ms") or {}).items()}
    if row["draft"] and model_k in measured_step and len(row["spec_types"]) == 1 \
            and row["drafted"] >= 0.95 * steps * model_k:
        # the model drafts k on (nearly) every step, fewer only near the token budget: the cost run timed
        # exactly that step (draft + verification of k + 1)
        return tokens * curve["plain_step_ms"] / (steps * measured_step[model_k])
    ms = steps * t[1] + row["drafted"] * slope
    if row["draft"] and model_k:
        ms += steps * (curve["draft_fixed_ms"] + model_k * curve["draft_per_token_ms"])
    return tokens * curve["plain_step_ms"] / ms


def add_row_predictions(result: dict, cost: dict) -> None:
    """Every side-by-side row's predicted speed-up over plain beside its measured one, and the setting
    the prediction recommends (plain when nothing is predicted faster) against the fastest measured."""
    plain = reference_tok_s(result["rows"])
    for row in result["rows"]:
        row["measured_speedup"] = row["tok_s"] / plain if row["tok_s"] and plain else None
        row["predicted_speedup"] = 1.0 if not row["spec_types"] else row_prediction(row, cost["curve"],
                                                                                   row["spec_draft_n_max"])
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="a specheads EAGLE-3 export (--format vllm or gguf)")
    p.add_argument("--prompts", default=None)
    p.add_argument("--out", required=True)
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
    a = p.parse_args(argv)
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
        def decode(spec: lc.SpecSettings) -> list[lc.Completion]:
            print(f"[bench] {spec.label} ... (load {lc.load_average()})", flush=True)
            return lc.decode_all(b, target_gguf, spec, prompts, a.n_predict, a.threads,
                                 out / f"server-{spec.label}.log", omp=a.omp_wait_policy, warmup=2)[0]

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
