"""Online acceptance evaluation: decode prompts with the exported draft and prove it lossless.

For every prompt (and every turn of multi-turn rows) the target decodes greedily three ways with
the same budget: plain, speculative with the exported EAGLE-3 draft, and speculative with the
n-gram (prompt lookup) baseline. The speculative outputs must equal plain decoding token for
token. Counts are summed over all prompts and turns before any ratio (docs/algorithms.md §9).

`specheads eval --target T --draft EXPORT_DIR --prompts FILE --out DIR` writes
DIR/metrics.json and DIR/outputs.jsonl. The draft proposes a chain by default; `--tree eagle2`
or `--tree FILE.json` verifies EAGLE-2 or static trees instead (metrics.json "tree" records
which; the n-gram baseline stays a chain of k). `--batch-size N` decodes up to N sequences per
target forward (eval/waves.py: the same counts and outputs, batched seconds).

The hybrid rows (eval/mixes.py) run in every eval, greedy or sampled (`--temperature`: seeded as
the other rows), chain or tree: a chain eval predicts the speed-up per k from the acceptance it
measured and the timed step costs and advises; a tree eval runs the rows the mixing code builds
over a tree (union) and records why the others (hybrid choose, adaptive: chains) are skipped.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specheads.atomic import write_text
from specheads.data.prompts import read_prompts, user_turn
from specheads.data.suffix_history import History, history_overlap, overlap_warning, read_history
from specheads.engine_facts import VLLM_SUFFIX_DEFAULTS
from specheads.eval.concurrency import concurrency_advice
from specheads.eval.engine_costs import add_llamacpp_prediction, read_llamacpp_cost
from specheads.eval.mixes import (
    MIXES,
    RowCosts,
    check_asked_rows,
    engine_advice,
    evaluate_mixes,
    free_step_seconds,
    in_situ_costs,
    mix_metrics,
    mix_rows,
    pass_plain,
    row_costs,
)
from specheads.eval.offline import offline_acceptance, samples_from_rows
from specheads.eval.predict import StepCosts, eval_costs, prediction_metrics
from specheads.eval.recommend import by_concurrency_from_table, settle
from specheads.eval.report import attach_to_export, check_report_folder, read_json, write_report
from specheads.eval.waves import Totals, check_batch_size, eval_prompt_ids, evaluate_rows
from specheads.eval_identity import KEY as WEIGHTS_KEY
from specheads.eval_identity import draft_weights
from specheads.metrics import broken_draft_warning, predicted_speedup
from specheads.model_ref import resolve_draft
from specheads.provenance import machine, provenance
from specheads.session import Session
from specheads.verify.adaptive_proposers import LengthCosts
from specheads.verify.calibration import calibration_report
from specheads.verify.ragged import check_batch_attention
from specheads.verify.settings import Sampling, TreeSpec, check_acceptance
from specheads.verify.steps import DecodeStats

log = logging.getLogger(__name__)

# the longest draft whose verification eval times (the cost curve runs to COST_K + 1 tokens): the
# adaptive row's free drafts may run this long, since drawing them costs nothing
COST_K = 8


# --- metrics -----------------------------------------------------------------------------------

def alpha_from_tau(mean_len: float, k: int) -> float:
    """i.i.d. per-token acceptance a with (1 - a^(k+1)) / (1 - a) = mean_len (bisection)."""
    if k < 1 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2

def cost_ratio(stats: DecodeStats) -> float:
    """c = mean proposer seconds per draft token / mean target decode-forward seconds."""
    if not stats.proposed_tokens or not stats.decode_forwards or not stats.target_decode_s:
        return 0.0
    per_token = stats.proposer_s / stats.proposed_tokens
    return per_token / (stats.target_decode_s / stats.decode_forwards)

def method_metrics(stats: DecodeStats, plain: DecodeStats, k: int) -> dict:
    """chain_summary + alpha, c, predicted and measured speed-up, timings for one method."""
    summary = stats.summary()
    alpha = alpha_from_tau(summary["mean_acceptance_length"], k)
    c = cost_ratio(stats)
    return {
        **summary,
        "proposed_tokens": stats.proposed_tokens,
        "alpha_estimate": alpha,
        "cost_ratio_c": c,
        "predicted_speedup": predicted_speedup(alpha, k, c),
        "measured_speedup": plain.wall_s / stats.wall_s if stats.wall_s else 0.0,
        "new_tokens": stats.tokens,
        "prefill_forwards": stats.prefill_forwards,
        "wall_s": stats.wall_s,
        "target_decode_s": stats.target_decode_s,
        "target_prefill_s": stats.target_prefill_s,
        "proposer_s": stats.proposer_s,
        "proposer_start_s": stats.proposer_start_s,
    }

# --- the run -----------------------------------------------------------------------------------

def measured_rank_acceptance(target, head, outputs: list[dict]) -> list[list[float]] | None:
    """Per-rank acceptance of the head on the target's own greedy answers (teacher-forced, one
    target forward per prompt): what tree predictions use; None for heads that do not count ranks."""
    if not getattr(head, "counts_ranks", False):
        return None
    samples = samples_from_rows(target.tokenizer, outputs)
    return offline_acceptance(target, head, samples).get("rank_acceptance") if samples else None

def evaluate(target_path: str, draft_dir: str, prompts_file: str, out_dir: str,
             max_new_tokens: int = 128, k: int | None = None, limit: int | None = None,
             tree: TreeSpec | None = None, sampling: Sampling | None = None,
             predict: bool = True, verifier_json: str | None = None, bench_json: str | None = None,
             attach: bool = False, quiet: bool = False, dtype: str | None = None,
             device: str = "auto", allow_missing_fingerprint: bool = False, batch_size: int = 1,
             llamacpp_cost: str | None = None, suffix_history: str | None = None,
             mix_rows: tuple[str, ...] = MIXES, concurrency: dict | None = None) -> dict:
    """Decode the prompts plain / with the draft / with n-grams; write metrics.json + outputs.jsonl.

    `predict` adds the hybrid rows, and for chains (greedy or sampled) the predicted speed-up per k
    and serving advice; every eval writes a report (report.md + plots; `verifier_json` / `bench_json`
    add measured curves); `attach` copies them into the export folder and its README.

    `tree` None (or a chain) drafts a chain of k; an EAGLE-2 or static `tree` goes through the
    tree verifier. Alpha, c and the predicted speed-up use the chain model with k = the tree's
    depth, so for trees they are rough; the measured speed-up is exact.

    `batch_size` sequences share each target forward (eval/waves.py): tau, acceptance and outputs
    are batch 1's (suffix decoding's drafts aside), a measured speed-up compares speculative and
    plain decoding both at that batch size, and the prediction stays batch 1's.

    `llamacpp_cost` (a `bench/llamacpp.py --cost` JSON) prices the drafter's acceptance at llama.cpp's
    own measured costs: the advice for llama.cpp then says which k, or no speculation.

    `suffix_history` (conversations) fills every suffix decoding cache before the first prompt
    (`data.suffix_history`); `mix_rows`: the hybrid rows to decode (the others are skipped, saying so).

    `concurrency`: a concurrency table this run measured (`concurrency.concurrency_table`, the demo's):
    the advice by batch size comes from it instead of timing the batch costs again. The advice is
    settled once (`recommend.settle`: one k, one schedule) and every reader takes it from metrics.json.
    """
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if k is not None and k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    check_batch_size(batch_size)
    check_acceptance(sampling or Sampling())
    check_report_folder(out_dir)
    check_asked_rows(tuple(mix_rows), predict, tree is None or tree.kind == "chain")
    rows = read_prompts(prompts_file, limit)
    # broken inputs fail before decoding
    verifier, bench = read_json(verifier_json, "--verifier-json"), read_json(bench_json, "--bench-json")
    llamacpp = read_llamacpp_cost(llamacpp_cost) if llamacpp_cost else None
    resolve_draft(draft_dir)  # a missing folder or an uncached hub id fails before the target loads
    session = Session.open(target_path, draft_dir, tree or TreeSpec("chain"), k, device, dtype,
                           allow_missing_fingerprint)
    target, k, tree = session.target, session.k, session.spec
    if batch_size > 1:  # before any decoding: ragged rows need an attention that honours 4-D masks
        check_batch_attention(target.config)
    session.warm_up()
    history = read_history(suffix_history, target.tokenizer, target.context, quiet) if suffix_history else History()
    t0, machine_at_start = time.perf_counter(), machine()  # the load before this eval adds its own
    totals, outputs = evaluate_rows(session, rows, max_new_tokens, sampling=sampling or Sampling(), quiet=quiet,
                                    batch_size=batch_size, history=history.pairs)
    sampled = sampling is not None and not sampling.greedy
    equal = None if sampled else not totals.mismatches
    spec = method_metrics(totals.draft, totals.plain, tree.levels())
    metrics = {
        "k": k,
        "tree": tree.describe(),
        "sampling": sampling.describe() if sampled else None,
        # typical acceptance (draft and n-gram runs alike) does not keep the target's distribution
        "acceptance": sampling.acceptance if sampled else "exact",
        "lossless": not sampled or sampling.lossless,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        # what every measured_speedup divides: plain decoding's seconds at the same batch size
        "measured_speedup_baseline": f"plain decoding at batch size {batch_size}",
        "num_prompts": len(rows),
        "num_turns": len(outputs),
        "greedy_equal": equal,
        "mismatched_ids": totals.mismatches,
        "skipped": totals.skipped,
        # headline numbers of the exported draft (details under "speculative")
        "tau": spec["tau"],
        "alpha": spec["alpha_estimate"],
        "cost_ratio": spec["cost_ratio_c"],
        "predicted_speedup": spec["predicted_speedup"],
        "speculative": {**spec, "greedy_equal": equal},
        # the drafter's top draft probability vs acceptance (greedy chains of kinds that report it)
        "calibration": calibration_report(totals.records, spec["acceptance_per_position_conditional"])
        if totals.records else None,
        "draft_warning": broken_draft_warning(spec),  # None unless the draft accepts (almost) nothing
        **free_metrics(totals, k, sampled),
        "plain": {"tokens": totals.plain.tokens, "target_forwards": totals.plain.decode_forwards,
                  "prefill_forwards": totals.plain.prefill_forwards, "wall_s": totals.plain.wall_s,
                  "target_decode_s": totals.plain.target_decode_s},
        "eval_wall_s": time.perf_counter() - t0,
        WEIGHTS_KEY: draft_weights(session.draft.meta.folder),  # the weights measured (eval_identity.py)
        "provenance": provenance(
            target=target.fingerprint(), target_path=str(target.path), draft=str(draft_dir),
            draft_format=session.draft.meta.format, fingerprint_checked=session.draft.fingerprint_checked,
            prompts_file=str(prompts_file), limit=limit, device=str(target.device),
            dtype=str(target.dtype).replace("torch.", ""), machine=machine_at_start,
        ),
    }
    if suffix_history:  # what suffix decoding knew before the first prompt
        metrics["suffix_history"] = history_metrics(history, Path(suffix_history).name, outputs, target.tokenizer)
    if predict:
        prompts = [eval_prompt_ids(target.tokenizer, user_turn(r.turns[0])) for r in rows]
        mix = Mix(max_new_tokens, sampling or Sampling(), batch_size, quiet, tuple(mix_rows), history.pairs, concurrency)
        (predict_chain if tree.kind == "chain" else predict_tree)(metrics, session, totals, outputs, prompts, mix)
    if llamacpp is not None:
        add_llamacpp_prediction(metrics, llamacpp, session.draft.meta.kind, session.draft.meta.format)
    out = Path(out_dir)
    write_text(out / "outputs.jsonl", "".join(json.dumps(o) + "\n" for o in outputs))
    write_report(out, metrics, outputs, verifier, bench)
    if attach:
        attach_to_export(draft_dir, out)
    return metrics

def history_metrics(history: History, file: str, outputs: list[dict], tokenizer) -> dict:
    """metrics.json "suffix_history": the file, what was kept, and how much of the evaluated prompts and
    their (plain) answers it already held, with a warning (also on the terminal) when any."""
    answers = [tokenizer.decode(o["plain_ids"], skip_special_tokens=True) for o in outputs]
    overlap = history_overlap(history, [o["prompt"] for o in outputs if isinstance(o["prompt"], str)], answers)
    warning = overlap_warning(overlap, file)
    if warning:
        log.warning("%s", warning)
    return {"file": file, "answers": len(history.pairs), "skipped_too_long": history.skipped,
            "cut_to_context": history.cut, "overlap": overlap, "warning": warning}


@dataclass(frozen=True)
class Mix:
    """How the hybrid rows decode: the eval's budget, sampling settings and batch size."""

    max_new_tokens: int
    sampling: Sampling
    batch_size: int = 1
    quiet: bool = True
    rows: tuple[str, ...] = MIXES  # the hybrid rows asked for
    history: list = field(default_factory=list)  # (prompt ids, answer ids) for suffix decoding's caches
    concurrency: dict | None = None  # a concurrency table measured in this run (the advice by batch size)


def say(quiet: bool, what: str) -> None:
    if not quiet:
        print(f"[specheads] eval: {what}", file=sys.stderr, flush=True)


def predict_chain(metrics: dict, session: Session, totals: Totals, outputs: list[dict], prompts: list[list[int]],
                  mix: Mix) -> None:
    """A chain eval (greedy or sampled): the speed-up prediction per k from the measured acceptance
    (at the eval's temperature) and step costs, the hybrid rows, and the advice."""
    target, head, spec = session.target, session.head, metrics["speculative"]
    cond = spec["acceptance_per_position_conditional"]
    say(mix.quiet, "timing target and draft steps for the speed-up prediction")
    observed = (totals.plain, totals.draft, *totals.free.values())
    # batched decodes' seconds are shares of batch forwards, not batch-1 step costs: micro-timed costs only
    correct = (lambda costs: in_situ_costs(costs, *observed)) if mix.batch_size == 1 else None
    prediction = prediction_metrics(target, head, prompts, cond, k_max=max(COST_K, session.k),
                                    rank_q=measured_rank_acceptance(target, head, outputs), correct=correct)
    if not prediction:
        log.warning("no prompt leaves room for the timed forwards: no speed-up prediction")
    metrics.update(prediction)
    use_prediction(metrics)
    if not prediction:
        return
    if not mix.sampling.greedy:  # the advice holds at the temperature its acceptance was measured at
        metrics["advice"]["sampling"] = mix.sampling.describe()
    costs = StepCosts.from_dict(metrics["prediction"]["costs"])
    micro = StepCosts.from_dict(metrics["prediction"]["costs_micro"])
    rows = row_costs(micro, *observed) if correct is not None else RowCosts.same(costs)
    metrics["prediction"]["costs_by_family"] = rows.to_dict()
    add_mixes(metrics, session, totals, outputs, costs, rows, max(session.k, metrics["prediction"]["best_chain_k"]), mix)
    metrics["advice"]["by_concurrency"] = (by_concurrency_from_table(mix.concurrency) if mix.concurrency
                                           else concurrency_advice(session, prompts, costs, cond))
    settle(metrics)


def predict_tree(metrics: dict, session: Session, totals: Totals, outputs: list[dict], prompts: list[list[int]],
                 mix: Mix) -> None:
    """A tree eval: the hybrid rows the mixing code builds over a tree (the others skipped with the
    reason), priced by micro-timed step costs (metrics.json "step_costs"); no chain advice."""
    say(mix.quiet, "timing target and draft steps to price the hybrid rows")
    measured = eval_costs(session.target, session.head, prompts, k_max=max(COST_K, session.k))
    if measured is None:
        log.warning("no prompt leaves room for the timed forwards: no hybrid rows")
        return
    metrics["step_costs"] = measured[0].to_dict()
    add_mixes(metrics, session, totals, outputs, measured[0], RowCosts.same(measured[0]), session.k, mix)


def add_mixes(metrics: dict, session: Session, totals: Totals, outputs: list[dict], costs: StepCosts, rows: RowCosts,
              k_max: int, mix: Mix) -> None:
    """The hybrid rows (eval/mixes.py) the draft shape allows (the others: {"skipped": why}), the free
    rows' step-mix predictions and, where the eval advises (chains), the advice per engine; each output
    row gets its turn's decodes of the hybrid rows as methods["mix_<row>"]. `costs`: what the adaptive
    rule decides by; `rows`: what prices each row (its family's costs, `mixes.RowCosts`)."""
    cond = metrics["speculative"]["acceptance_per_position_conditional"]
    names, skipped = mix_rows(session.spec.kind == "chain")
    skipped.update({name: "not asked (--mix-rows)" for name in names if name not in mix.rows})
    names = tuple(name for name in names if name in mix.rows)
    say(mix.quiet, "decoding the hybrid rows (drafter + free proposer)")
    free_k_max = max(k_max, COST_K)
    plain, tallies, free_name, note = evaluate_mixes(session, totals.turns, mix.max_new_tokens, costs, totals.records,
                                                     cond, k_max, mix.quiet, mix.batch_size, mix.sampling, names,
                                                     free_k_max, mix.history)
    if note:
        log.warning("hybrid rows: %s", note)
    for name, tally in {"plain": plain, **tallies}.items():  # outputs and turns: one entry per decoded turn
        for row, turn in zip(outputs, tally.per_turn, strict=True):
            row["methods"][f"mix_{name}"] = turn
    metrics.update({name: {"skipped": why} for name, why in skipped.items()})
    metrics.update(mix_metrics(tallies, plain.stats, rows, free_name, note, totals.free.get(free_name),
                               mix.sampling.greedy, mix.batch_size))
    if "adaptive" in tallies:  # the adaptive rule's inputs as `specheads serve --adaptive` reads them back (mixing.py)
        metrics["adaptive"].update(k_max=k_max, free_k_max=free_k_max,
                                   length_costs=LengthCosts.from_step_costs(costs, free_k_max).to_dict())
    for name, stats in totals.free.items():
        metrics[name]["predicted_speedup"] = rows.speedup(name, stats, pass_plain(totals.plain, mix.batch_size),
                                                          free_step_s=free_step_seconds(stats))
        metrics[name]["predicted_speedup_model"] = "measured step mix priced by measured step costs"
    if "advice" in metrics:
        meta = session.draft.meta
        metrics["advice"]["engines"] = engine_advice(metrics, meta.kind, meta.format)


FREE_SETTINGS = {"ngram": {"max_ngram": 3, "min_ngram": 1}, "suffix": dict(VLLM_SUFFIX_DEFAULTS)}


def free_metrics(totals: Totals, k: int, sampled: bool) -> dict:
    """metrics.json's row of each training-free proposer: "ngram" (prompt lookup), "suffix"."""
    return {name: {**method_metrics(stats, totals.plain, k), **FREE_SETTINGS[name],
                   "greedy_equal": None if sampled else not totals.free_mismatches[name],
                   "mismatched_ids": totals.free_mismatches[name]}
            for name, stats in totals.free.items()}


def use_prediction(metrics: dict) -> None:
    """One predicted speed-up per setting: with a step-cost prediction, the evaluated k's number
    is that prediction's (the i.i.d. seed formula stays only where nothing better exists)."""
    pred = metrics.get("prediction")
    row = next((r for r in pred["chains"] if r["k"] == metrics["k"]), None) if pred else None
    spec = metrics["speculative"]
    if row is None:
        spec["predicted_speedup_model"] = "i.i.d. acceptance and cost ratio c (seed formula)"
        return
    metrics["predicted_speedup"] = spec["predicted_speedup"] = row["speedup"]
    spec["predicted_speedup_model"] = "measured acceptance per position and step costs (prediction)"

