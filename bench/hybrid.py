"""Hybrid benchmark: plain, EAGLE-3, prompt lookup, suffix decoding, the hybrids of EAGLE-3 with them
(choose and union modes) and adaptive draft length, greedy, side by side in one run, each with its
measured and its predicted speed-up.

    python bench/hybrid.py --target RUN/target --draft RUN/export/vllm \
        --prompts RUN/data/heldout_prompts.jsonl --out DIR [--k 3] [--limit N] [--max-new-tokens N]

First an untimed pass over the prompts, the eval's own first pass (`eval.online.evaluate_rows`): the
calibration records of the drafter's confidence and the decodes that correct the micro-timed step
costs (`eval.mixes.in_situ_costs`). Then the timed pass, methods interleaved per prompt; the adaptive
rows of a prompt use the calibration fitted on the other fold of prompts. Every output is checked equal
to plain greedy decoding; counts and seconds are summed over prompts before any ratio (bench/verifier.py's
tallies). A row's prediction is its measured step mix priced by the first pass's costs, the target's
steps by the curve the first pass's decodes of the row's family met (`eval.mixes.RowCosts`: drafter rows
by the drafter's decodes, free rows by the free proposers', plain by plain's), its proposer seconds put
in the first pass's time base by the timed pass's plain decodes (`eval.mixes.row_speedup`);
every row keeps its summed decode stats, so `--reprice` recomputes the predictions offline. The suffix
proposers keep one global cache per method across the prompts, as a server's (and the eval's) would;
warm-up decodes use throwaway proposers so no prompt's output is cached before it is timed. Writes
DIR/hybrid.json, DIR/hybrid.md (with `--note`: how the run was made).

    python bench/hybrid.py --reprice DIR/hybrid.json [--out DIR2]

prices a saved run's rows again with today's `row_speedup` and the per-family costs rebuilt from the
saved first pass's micro-timed costs and decodes (no model, no timing): old and new predicted / measured
per row; with `--out`, DIR2/hybrid_repriced.json and .md as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package

from verifier import Method, encode_rows, method_row, plain_method, run_bench, timed  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402
from specheads.data.prompts import read_prompts  # noqa: E402
from specheads.eval.mixes import RowCosts, free_step_seconds, in_situ_costs, row_costs, time_base  # noqa: E402
from specheads.eval.online import COST_K, evaluate_rows  # noqa: E402
from specheads.eval.predict import PredictError, StepCosts, prediction_metrics  # noqa: E402
from specheads.session import Session, eos_ids  # noqa: E402
from specheads.verify.adaptive_proposers import LengthCosts, adaptive_proposer, loop_k  # noqa: E402
from specheads.verify.calibration import Calibration, cross_fitted  # noqa: E402
from specheads.verify.hybrid_proposers import hybrid_proposer  # noqa: E402
from specheads.verify.loop import request  # noqa: E402
from specheads.verify.ngram_proposers import NgramProposer  # noqa: E402
from specheads.verify.registry import make_proposer  # noqa: E402
from specheads.verify.settings import TreeSpec, make_tree_spec  # noqa: E402
from specheads.verify.steps import DecodeStats  # noqa: E402
from specheads.verify.suffix_proposers import SuffixProposer  # noqa: E402

HYBRIDS = (  # name, mode, free proposer, choose rule
    ("hybrid-choose eagle3+suffix (arctic)", "choose", "suffix", "arctic"),
    ("hybrid-choose eagle3+suffix (measured)", "choose", "suffix", "measured"),
    ("hybrid-choose eagle3+ngram (measured)", "choose", "ngram", "measured"),
    ("hybrid-union eagle3+suffix", "union", "suffix", "arctic"),
    ("hybrid-union eagle3+ngram", "union", "ngram", "arctic"),
)
ADAPTIVE = (  # name, free proposer (None: the drafter's length only)
    ("adaptive eagle3+suffix", "suffix"),
    ("adaptive eagle3", None),
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
    def make_request(ids, max_new_tokens, eos):
        return request(target, make(), ids, max_new_tokens, k, eos)

    return Method(name, {"k": k, "nodes": k + 1, **settings}, make_request)


@dataclass
class Mix:
    """A hybrid method's per-step mix, summed over its decodes (what its prediction prices)."""

    chosen: Counter = field(default_factory=Counter)
    levels: int = 0
    model_steps: int = 0

    def add(self, proposer) -> None:
        summary = proposer.summary()
        self.chosen.update(summary["steps"])
        self.levels += summary["levels"]
        self.model_steps += summary["model_steps"]


def hybrid_method(name: str, mode: str, free: str, rule: str, target, head, k: int, mix: Mix) -> Method:
    """EAGLE-3 + a free proposer; `mix` sums the hybrids' per-step counts over the decodes."""
    spec, make_free = make_tree_spec("chain", k=k), free_factory(free)

    def make_request(ids, max_new_tokens, eos):
        hybrid = hybrid_proposer(make_proposer(spec, head, target), make_free(), mode, k, rule)
        return request(target, hybrid, ids, max_new_tokens, k, eos)

    nodes = k + 1 if mode == "choose" else 2 * k + 1
    return Method(name, {"kind": "hybrid", "mode": mode, "free": free, "rule": rule, "k": k,
                         "nodes": nodes}, make_request, lambda req: mix.add(req.proposer))


@dataclass
class Adaptive:
    """What the adaptive rows need: the calibration per fold of prompts, the step costs, k_max."""

    calibrations: dict[int, Calibration]
    costs: LengthCosts
    k_max: int
    folds: dict[tuple[int, ...], int]  # prompt ids -> its fold
    free_k_max: int | None = None  # the free draft's longest (eval's COST_K)


def adaptive_method(name: str, free: str | None, target, head, adaptive: Adaptive, mix: Mix) -> Method:
    """EAGLE-3 (sampled variant: its confidences) with adaptive draft length, beside a free draft or not."""
    spec, make_free = make_tree_spec("chain", k=adaptive.k_max), free_factory(free) if free else (lambda: None)
    free_k_max = adaptive.free_k_max if free else None
    longest = loop_k(adaptive.k_max, free_k_max)

    def make_request(ids, max_new_tokens, eos):
        calibration = adaptive.calibrations[adaptive.folds.get(tuple(ids), 0)]
        proposer = adaptive_proposer(make_proposer(spec, head, target, sampled=True), calibration, adaptive.costs,
                                     adaptive.k_max, make_free(), free_k_max=free_k_max)
        return request(target, proposer, ids, max_new_tokens, longest, eos)

    return Method(name, {"kind": "adaptive", "free": free, "k_max": adaptive.k_max, "free_k_max": free_k_max,
                         "nodes": longest + 1}, make_request, lambda req: mix.add(req.proposer))


def build_methods(target, head, k: int, adaptive: Adaptive) -> tuple[list[Method], dict[str, Mix]]:
    """plain first (the reference), then EAGLE-3, n-gram, suffix, the hybrids and the adaptive rows."""
    spec = make_tree_spec("chain", k=k)
    suffix = free_factory("suffix")
    methods = [plain_method(target),
               chain_method(f"eagle3 k={k}", target, lambda: make_proposer(spec, head, target), k,
                            {"kind": "eagle3"}),
               chain_method(f"ngram k={k}", target, free_factory("ngram"), k, {"kind": "ngram"}),
               chain_method(f"suffix k={k}", target, suffix, k, {"kind": "suffix"})]
    mixes = {name: Mix() for name in [*(h[0] for h in HYBRIDS), *(a[0] for a in ADAPTIVE)]}
    methods += [hybrid_method(name, mode, free, rule, target, head, k, mixes[name])
                for name, mode, free, rule in HYBRIDS]
    methods += [adaptive_method(name, free, target, head, adaptive, mixes[name]) for name, free in ADAPTIVE]
    return methods, mixes


def warm_up(target, head, k: int, adaptive: Adaptive, ids: list[int], max_new_tokens: int) -> None:
    """Untimed decodes with throwaway methods: kernels and allocator settle, no cache is fed."""
    eos = eos_ids(target)
    for method in build_methods(target, head, k, adaptive)[0]:
        timed(method, target, [ids], min(16, max_new_tokens), eos)


def first_pass(session: Session, rows, max_new_tokens: int, prompts) -> tuple[RowCosts, Adaptive, dict]:
    """The eval's first pass (untimed here): calibration records, step costs corrected in situ (blended:
    what the adaptive rule decides by; per family: what prices the rows), the free proposers' measured
    seconds per step."""
    totals, _ = evaluate_rows(session, rows, max_new_tokens)
    cond = totals.draft.summary()["acceptance_per_position_conditional"]
    observed = (totals.plain, totals.draft, *totals.free.values())
    pred = prediction_metrics(session.target, session.head, [ids for _, ids in prompts], cond, k_max=COST_K,
                              correct=lambda costs: in_situ_costs(costs, *observed))["prediction"]
    costs = StepCosts.from_dict(pred["costs"])
    k_max = max(session.k, pred["best_chain_k"])
    calibrations = cross_fitted(totals.records, cond) if totals.records else {0: Calibration(position_rates=cond)}
    folds = {tuple(t.ids): t.fold for t in totals.turns}
    calibrations = {f: calibrations.get(f, Calibration(position_rates=cond)) for f in (0, 1)}
    free_k_max = max(k_max, COST_K)
    adaptive = Adaptive(calibrations, LengthCosts.from_step_costs(costs, free_k_max), k_max, folds, free_k_max)
    free_s = {name: free_step_seconds(stats) for name, stats in totals.free.items()}
    decodes = {"plain": totals.plain, "draft": totals.draft, **totals.free}  # what corrected the costs
    by_family = row_costs(StepCosts.from_dict(pred["costs_micro"]), *observed)
    return by_family, adaptive, {"free_step_s": free_s, "records": len(totals.records), "k_max": k_max,
                                 "costs": pred["costs"], "costs_micro": pred["costs_micro"],
                                 "costs_by_family": by_family.to_dict(),
                                 "decodes": {name: asdict(stats) for name, stats in decodes.items()}}


def predicted(row: dict, stats: DecodeStats, costs: RowCosts, plain: DecodeStats, free_s: dict) -> float:
    """A row's predicted speed-up: its measured step mix (`stats`, and the model levels and steps its row
    counted) priced by the first pass's costs of its kind's family; `plain`: the timed pass's plain
    decodes (the time base)."""
    kind = row["settings"].get("kind")
    if kind == "eagle3":
        return costs.speedup(kind, stats, plain, stats.proposed_tokens, stats.drafts)
    if kind in ("ngram", "suffix"):
        return costs.speedup(kind, stats, plain, free_step_s=free_s.get(kind, 0.0))
    free = row["settings"].get("free")
    return costs.speedup(kind, stats, plain, row.get("model_levels", 0), row.get("model_steps", 0),
                         free_s.get(free, 0.0) if free else 0.0)


def markdown(report: dict) -> str:
    st = report["settings"]
    lines = ["# Hybrid benchmark", "",
             f"target `{st['target']}`, draft `{st['draft']}`, {st['num_prompts']} prompts, max "
             f"{st['max_new_tokens']} new tokens, k={st['k']} (adaptive k_max={st.get('k_max')}), {st['device']} "
             f"{st['dtype']}, {st['threads']} threads, batch 1, greedy; load average {st.get('load')}.", "",
             "| method | tau | tok/s | measured speed-up | predicted | predicted / measured | greedy equal | steps per draft |",
             "|---|---:|---:|---:|---:|---:|:---:|---|"]
    for r in report["methods"]:
        chosen = ", ".join(f"{n} {c}" for n, c in sorted(r.get("chosen", {}).items()))
        ratio = r["predicted_speedup"] / r["speedup"] if r["speedup"] else float("nan")
        lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['predicted_speedup']:.2f}x | {ratio:.2f} | {'yes' if r['greedy_equal'] else 'NO'} | {chosen} |")
    summary = report.get("summary")
    if summary:
        lines += ["", f"Best hybrid (measured) {summary['best_hybrid']} at {summary['best_hybrid_speedup']:.2f}x = "
                      f"{summary['vs_best_single']:.2f}x the better of EAGLE-3 and n-gram alone "
                      f"({summary['best_single']} {summary['best_single_speedup']:.2f}x); suffix alone "
                      f"{summary['suffix_speedup']:.2f}x. Largest |predicted / measured - 1|: "
                      f"{summary['worst_prediction_error']:.0%} ({summary['worst_prediction']})."]
    if st.get("note"):
        lines += ["", st["note"]]
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> dict:
    """The issue's two checks: the best hybrid vs the better of EAGLE-3 and n-gram, prediction errors."""
    by_kind = {r["settings"].get("kind"): r for r in rows if r["settings"].get("kind") in ("eagle3", "ngram", "suffix")}
    single = max((by_kind[k] for k in ("eagle3", "ngram") if k in by_kind), key=lambda r: r["speedup"])
    hybrids = [r for r in rows if r["settings"].get("kind") in ("hybrid", "adaptive")]
    best = max(hybrids, key=lambda r: r["speedup"])
    errors = {r["method"]: abs(r["predicted_speedup"] / r["speedup"] - 1) for r in rows if r["speedup"]}
    worst = max(errors, key=errors.get)
    return {"best_hybrid": best["method"], "best_hybrid_speedup": best["speedup"], "best_single": single["method"],
            "best_single_speedup": single["speedup"], "vs_best_single": best["speedup"] / single["speedup"],
            "suffix_speedup": by_kind["suffix"]["speedup"] if "suffix" in by_kind else float("nan"),
            "prediction_errors": errors, "worst_prediction": worst, "worst_prediction_error": errors[worst]}


def bench(target_path: str, draft_dir: str, prompts_file: str, out_dir: str, k: int = 3,
          limit: int | None = 16, max_new_tokens: int = 64, device: str = "cpu",
          dtype: str | None = None, note: str = "") -> dict:
    """The first pass, then every method on the prompts; write OUT/hybrid.json and OUT/hybrid.md."""
    session = Session.open(target_path, draft_dir, TreeSpec("chain"), k, device=device, dtype=dtype)
    target, head = session.target, session.head
    rows = read_prompts(prompts_file, limit)
    prompts = encode_rows(target, rows)
    session.warm_up()
    t0 = time.perf_counter()
    costs, adaptive, first = first_pass(session, rows, max_new_tokens, prompts)
    warm_up(target, head, k, adaptive, prompts[0][1], max_new_tokens)
    methods, mixes = build_methods(target, head, k, adaptive)
    tallies = run_bench(target, methods, prompts, max_new_tokens, warmup=0)
    out = []
    for method, tally in zip(methods, tallies):
        row = method_row(method, tally, tallies[0])
        mix = mixes.get(method.name)
        if mix is not None:
            row.update(chosen=dict(mix.chosen), model_levels=mix.levels, model_steps=mix.model_steps)
        row["predicted_speedup"] = predicted(row, tally.stats, costs, tallies[0].stats, first["free_step_s"])
        row["decode_stats"] = asdict(tally.stats)  # what --reprice prices again
        out.append(row)
    report = {"settings": {"target": str(target_path), "draft": str(draft_dir), "prompts": str(prompts_file),
                           "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k,
                           "k_max": adaptive.k_max, "device": str(target.device),
                           "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                           "batch_size": 1, "load": [round(x, 2) for x in os.getloadavg()], "note": note},
              "first_pass": first, "methods": out, "summary": summarize(out), "bench_wall_s": time.perf_counter() - t0}
    report["greedy_equal"] = all(r["greedy_equal"] for r in out)
    write_json(Path(out_dir) / "hybrid.json", report)
    write_text(Path(out_dir) / "hybrid.md", markdown(report))
    return report


# --- re-pricing a saved run ---------------------------------------------------------------------


class RepriceError(ValueError):
    """A saved hybrid.json that cannot be priced again (the message names the file and the field)."""


def stats_from_json(d: dict) -> DecodeStats:
    """DecodeStats from its JSON (keys of the per-count dicts are strings there)."""
    return DecodeStats(**{**d, "steps_by_nodes": {int(n): c for n, c in d["steps_by_nodes"].items()},
                          "target_s_by_nodes": {int(n): s for n, s in d["target_s_by_nodes"].items()}})


def saved_stats(row: dict) -> DecodeStats:
    """A saved row's decode stats: whole in today's runs; in older ones only what `time_base` reads."""
    if "decode_stats" in row:
        return stats_from_json(row["decode_stats"])
    return DecodeStats(decode_forwards=row["target_forwards"], target_decode_s=row["target_decode_s"])


def legacy_prediction(row: dict, costs: StepCosts, plain: DecodeStats) -> float:
    """A row saved before rows kept their decode stats: its old prediction (decode tokens x plain step /
    (seconds priced by the costs + the proposer seconds as measured, no time base)) solved for the
    priced seconds, then the proposer seconds put in the costs' time base."""
    if not row["predicted_speedup"]:
        return 0.0
    tokens = round(row["tau"] * row["target_forwards"])  # decode tokens (tau: per decode forward)
    proposer = row["proposer_s"]
    priced = tokens * costs.plain() / row["predicted_speedup"] - proposer
    return tokens * costs.plain() / (priced + proposer * time_base(costs, plain))


def saved_row_costs(first: dict) -> tuple[RowCosts, str]:
    """The costs per row family of a saved first pass, rebuilt from its micro-timed costs and decodes
    (`eval.mixes.row_costs`, as the run priced them), and how; a run that kept no decodes: its blended
    costs for every row."""
    if "costs_micro" not in first or "decodes" not in first:
        return RowCosts.same(StepCosts.from_dict(first["costs"])), "blended (the run kept no first-pass decodes)"
    decodes = {name: stats_from_json(d) for name, d in first["decodes"].items()}
    plain, draft = decodes.pop("plain"), decodes.pop("draft")
    return row_costs(StepCosts.from_dict(first["costs_micro"]), plain, draft, *decodes.values()), "by family"


def reprice(report: dict, source: str) -> dict:
    """Each saved row's measured, saved predicted and newly predicted speed-up."""
    try:
        costs = StepCosts.from_dict(report["first_pass"]["costs"])
        by_family, how = saved_row_costs(report["first_pass"])
        free_s, rows = report["first_pass"]["free_step_s"], report["methods"]
        if not rows or rows[0]["method"] != "plain":
            raise RepriceError(f"{source}: 'methods' does not start with the plain row: pass a hybrid.json "
                               "written by bench/hybrid.py")
        plain = saved_stats(rows[0])
        out = [{"method": row["method"], "measured": row["speedup"], "saved": row["predicted_speedup"],
                "now": predicted(row, stats_from_json(row["decode_stats"]), by_family, plain, free_s)
                if "decode_stats" in row else legacy_prediction(row, costs, plain)} for row in rows]
    except (KeyError, TypeError, AttributeError, PredictError) as err:
        raise RepriceError(f"{source}: missing or malformed field {err}: pass a hybrid.json written by "
                           "bench/hybrid.py") from None
    return {"source": source, "time_base": time_base(by_family.plain, plain), "target_curves": how,
            "costs_by_family": by_family.to_dict(), "methods": out}


def worst(rows: list[dict], key: str) -> tuple[str, float]:
    """The row whose `key` prediction is furthest from its measured speed-up, and |predicted / measured - 1|."""
    errors = {r["method"]: abs(r[key] / r["measured"] - 1) for r in rows if r["measured"]}
    name = max(errors, key=errors.get)
    return name, errors[name]


def curve_lines(repriced: dict, counts=range(1, 8)) -> list[str]:
    """The target curve of each row family in ms at the counts rows verify (a repriced run's)."""
    families = repriced.get("costs_by_family") or {}
    lines = [f"target steps priced {repriced.get('target_curves', 'blended')}: ms per forward at 1..{counts[-1]} tokens"]
    for name, costs in families.items():
        curve = StepCosts.from_dict(costs)
        lines.append(f"- {name}: " + ", ".join(f"{curve.target(n) * 1e3:.2f}" for n in counts))
    return lines


def reprice_markdown(repriced: dict) -> str:
    rows = repriced["methods"]
    lines = ["# Hybrid benchmark, re-priced", "",
             f"`{repriced['source']}`, priced again offline: each row's proposer seconds in the first pass's time base "
             f"(x{repriced['time_base']:.3f}: the first pass's one-token target forward over the timed pass's plain one); "
             "each row's target steps by its family's curve (`eval.mixes.RowCosts`: plain, model: rows that run the "
             "drafter, free: prompt lookup and suffix decoding alone).", "", *curve_lines(repriced),
             "", "| method | measured | predicted (saved) | saved / measured | predicted (now) | now / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["measured"] or float("nan")
        lines.append(f"| {r['method']} | {r['measured']:.2f}x | {r['saved']:.2f}x | {r['saved'] / m:.2f} | "
                     f"{r['now']:.2f}x | {r['now'] / m:.2f} |")
    (saved, e_saved), (now, e_now) = worst(rows, "saved"), worst(rows, "now")
    lines += ["", f"Largest |predicted / measured - 1|: saved {e_saved:.0%} ({saved}), now {e_now:.0%} ({now})."]
    return "\n".join(lines) + "\n"


def reprice_file(path: str, out_dir: str | None) -> str:
    """--reprice: PATH (a hybrid.json or its folder) priced again; with `out_dir` also written there."""
    file = Path(path) / "hybrid.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise RepriceError(f"--reprice '{path}': no such file: pass a hybrid.json written by bench/hybrid.py "
                           "or its folder")
    try:
        report = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RepriceError(f"--reprice '{file}': not JSON ({err})") from None
    repriced = reprice(report, str(path))
    text = reprice_markdown(repriced)
    if out_dir:
        write_json(Path(out_dir) / "hybrid_repriced.json", repriced)
        write_text(Path(out_dir) / "hybrid_repriced.md", text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target")
    p.add_argument("--draft", help="an EAGLE-3 export folder")
    p.add_argument("--prompts")
    p.add_argument("--out")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--note", default="", help="how the run was made (written under the table)")
    p.add_argument("--reprice", metavar="PATH", help="price a saved hybrid.json (or its folder) again, offline")
    a = p.parse_args(argv)
    if a.reprice:
        try:
            print(reprice_file(a.reprice, a.out), end="")
        except RepriceError as err:
            print(f"bench/hybrid.py: error: {err}", file=sys.stderr)
            return 1
        return 0
    missing = [f"--{n}" for n in ("target", "draft", "prompts", "out") if not getattr(a, n)]
    if missing:
        p.error(f"{', '.join(missing)} required (or --reprice PATH)")
    if a.threads:
        torch.set_num_threads(a.threads)
    report = bench(a.target, a.draft, a.prompts, a.out, a.k, a.limit, a.max_new_tokens, a.device, a.dtype, a.note)
    print(markdown(report), end="")
    return 0 if report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
