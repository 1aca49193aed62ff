"""Online acceptance evaluation: decode prompts with the exported draft and prove it lossless.

For every prompt (and every turn of multi-turn rows) the target decodes greedily three ways with
the same budget: plain, speculative with the exported EAGLE-3 draft, and speculative with the
n-gram (prompt lookup) baseline. The speculative outputs must equal plain decoding token for
token. Counts are summed over all prompts and turns before any ratio (research/algorithms.md §10).

`specheads eval --target T --draft EXPORT_DIR --prompts FILE --out DIR` writes
DIR/metrics.json and DIR/outputs.jsonl. The draft proposes a chain by default; `--tree eagle2`
or `--tree FILE.json` verifies EAGLE-2 or static trees instead (metrics.json "tree" records
which; the n-gram baseline stays a chain of k).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specheads.atomic import write_text
from specheads.verify.settings import (
    Sampling, TreeSpec, add_sampling_arguments, add_tree_arguments, check_acceptance,
    check_tree_fits, make_proposer, sampled_decode, sampling_from_args, spec_from_args,
    speculative_decode,
)
from specheads.metrics import broken_draft_warning, predicted_speedup
from specheads.verify.decode import DecodeStats, generate
from specheads.verify.proposers import NgramProposer

log = logging.getLogger(__name__)


class PromptsError(ValueError):
    """The prompts file is missing or a row is not a usable prompt (the message names the line)."""


@dataclass
class PromptRow:
    id: str
    turns: list[str]
    category: str | None = None


@dataclass
class Totals:
    """Stats summed over every prompt and turn, per method."""

    plain: DecodeStats = field(default_factory=DecodeStats)
    draft: DecodeStats = field(default_factory=DecodeStats)
    ngram: DecodeStats = field(default_factory=DecodeStats)
    mismatches: list[str] = field(default_factory=list)
    ngram_mismatches: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # turns whose prompt fills the context


# --- inputs ------------------------------------------------------------------------------------


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """jsonl rows with `prompt` (one user message) or `turns` (MT-bench / Spec-Bench style)."""
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"prompts file '{path}' does not exist")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptsError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        turns = [obj["prompt"]] if isinstance(obj, dict) and "prompt" in obj else (
            obj.get("turns") if isinstance(obj, dict) else None)
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise PromptsError(f"{path}:{n}: expected a non-empty string 'prompt' or a non-empty "
                               "list of strings 'turns'")
        rows.append(PromptRow(id=str(obj.get("id", obj.get("question_id", n))), turns=turns,
                              category=obj.get("category")))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise PromptsError(f"prompts file '{path}' holds no prompts")
    return rows


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Render the conversation with the tokenizer's chat template, ready for the assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptsError("the target's tokenizer has no chat template; specheads eval renders "
                           "prompts as chat turns and needs one")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def eos_ids(target) -> list[int]:
    """The tokenizer's eos id plus any the target's generation config names."""
    ids = set()
    if getattr(target.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    gen = getattr(target.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(int(i) for i in (extra if isinstance(extra, (list, tuple)) else [extra]) if i is not None)
    return sorted(ids)


def _meta_value(meta, key: str):
    return meta.get(key) if isinstance(meta, dict) else getattr(meta, key, None)


def load_draft(draft_dir: str | Path, target):
    """The exported head (moved to the target's device and dtype), its meta, fingerprint checked."""
    from specheads.export import load_with_meta
    from specheads.target import check_fingerprint

    head, meta = load_with_meta(draft_dir)
    expected = _meta_value(meta, "target")
    if expected:
        check_fingerprint(expected, target, f"draft '{draft_dir}'")
    else:
        log.warning("draft '%s' records no target fingerprint; cannot check it matches", draft_dir)
    return head.to(device=target.device, dtype=target.dtype).eval(), meta, bool(expected)


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


def run_turn(target, head, ngram_sizes, ids, max_new_tokens, k, eos, tree: TreeSpec | None = None,
             sampling: Sampling | None = None):
    """One prompt turn decoded plain, with the draft (a chain of k, or `tree`) and with n-grams."""
    if sampling is not None and not sampling.greedy:
        return sampled_turn(target, head, ngram_sizes, ids, max_new_tokens, k, eos, tree, sampling)
    plain = generate(target, None, ids, max_new_tokens, k=0, eos_token_ids=eos)
    if tree is None or tree.kind == "chain":
        draft = generate(target, make_proposer(TreeSpec("chain", k=k), head, target), ids, max_new_tokens, k, eos)
    else:
        draft = speculative_decode(tree, target, make_proposer(tree, head, target), ids,
                                   max_new_tokens, eos)
    ngram = generate(target, NgramProposer(*ngram_sizes), ids, max_new_tokens, k, eos)
    return plain, draft, ngram


def sampled_turn(target, head, ngram_sizes, ids, max_new_tokens, k, eos, tree, sampling: Sampling):
    """The same three runs with lossless speculative sampling (same seed for each run)."""
    tree = tree or TreeSpec("chain", k=k)
    plain = sampled_decode(None, target, None, ids, max_new_tokens, eos, sampling)
    draft = sampled_decode(tree, target, make_proposer(tree, head, target, sampled=True), ids,
                           max_new_tokens, eos, sampling)
    ngram = sampled_decode(TreeSpec("chain", k=k), target, NgramProposer(*ngram_sizes), ids,
                           max_new_tokens, eos, sampling)
    return plain, draft, ngram


def evaluate_rows(target, head, rows: list[PromptRow], max_new_tokens: int, k: int,
                  ngram_sizes=(3, 1), tree: TreeSpec | None = None,
                  sampling: Sampling | None = None) -> tuple[Totals, list[dict]]:
    """Decode every turn of every row; multi-turn rows continue with the model's own answers."""
    eos = eos_ids(target)
    totals, outputs = Totals(), []
    for row in rows:
        messages = []
        for turn, text in enumerate(row.turns):
            messages.append({"role": "user", "content": text})
            ids = encode_chat(target.tokenizer, messages)
            ctx = getattr(target.config, "max_position_embeddings", None)
            if ctx is not None and len(ids) >= ctx:  # later turns only grow: skip the rest
                log.warning("prompt %s turn %d has %d tokens, the context is %d: skipped",
                            row.id, turn, len(ids), ctx)
                totals.skipped.append({"id": row.id, "turn": turn, "prompt_tokens": len(ids),
                                       "context": ctx})
                break
            plain, draft, ngram = run_turn(target, head, ngram_sizes, ids, max_new_tokens, k, eos,
                                           tree, sampling)
            totals.plain = totals.plain.add(plain.stats)
            totals.draft = totals.draft.add(draft.stats)
            totals.ngram = totals.ngram.add(ngram.stats)
            sampled = sampling is not None and not sampling.greedy
            equal = None if sampled else draft.tokens == plain.tokens  # samples need not agree
            if equal is False and row.id not in totals.mismatches:
                totals.mismatches.append(row.id)
            if not sampled and ngram.tokens != plain.tokens and row.id not in totals.ngram_mismatches:
                totals.ngram_mismatches.append(row.id)
            answer = target.tokenizer.decode(
                [t for t in plain.tokens if t not in eos], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            outputs.append({
                "id": row.id, "category": row.category, "turn": turn, "prompt": text,
                "prompt_tokens": len(ids), "plain_ids": plain.tokens, "speculative_ids": draft.tokens,
                "speculative_text": target.tokenizer.decode(draft.tokens, skip_special_tokens=True),
                "greedy_equal": equal, "tau": draft.stats.summary()["tau"],
                "ngram_tau": ngram.stats.summary()["tau"], "stop_reason": plain.stop_reason,
                "decode_tokens": draft.stats.decode_tokens, "decode_forwards": draft.stats.decode_forwards,
            })
    return totals, outputs


def warm_up(target, head, k: int, tree: TreeSpec | None = None) -> None:
    """A short untimed generation so first-call overheads do not land in the first prompt."""
    ids = [0, 1, 2, 3]
    generate(target, None, ids, 4, k=0)
    generate(target, make_proposer(TreeSpec("chain", k=k), head, target), ids, 4, k)
    if tree is not None and tree.kind != "chain":
        speculative_decode(tree, target, make_proposer(tree, head, target), ids, 4, [])


def evaluate(target_path: str, draft_dir: str, prompts_file: str, out_dir: str,
             max_new_tokens: int = 128, k: int | None = None, limit: int | None = None,
             tree: TreeSpec | None = None, sampling: Sampling | None = None,
             predict: bool = True, verifier_json: str | None = None, bench_json: str | None = None,
             attach: bool = False) -> dict:
    """Decode the prompts plain / with the draft / with n-grams; write metrics.json + outputs.jsonl.

    Greedy chains also get the predicted speed-up per k and serving advice (`predict`), and a
    report (report.md + plots; `verifier_json` / `bench_json` add measured curves); `attach`
    copies them into the export folder and its README.

    `tree` None (or a chain) drafts a chain of k; an EAGLE-2 or static `tree` goes through the
    tree verifier. Alpha, c and the predicted speed-up use the chain model with k = the tree's
    depth, so for trees they are rough; the measured speed-up is exact.
    """
    from specheads.provenance import provenance
    from specheads.target import Target

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_acceptance(sampling or Sampling())
    from specheads.eval.report import check_report_folder

    check_report_folder(out_dir)
    rows = read_prompts(prompts_file, limit)
    target = Target.load(target_path)
    head, meta, checked = load_draft(draft_dir, target)
    if k is None:
        k = _meta_value(meta, "num_speculative_tokens") or head.config.ttt_steps
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    tree = TreeSpec("chain", k=k) if tree is None or tree.kind == "chain" else tree
    check_tree_fits(tree, target)
    warm_up(target, head, k, tree)
    t0 = time.perf_counter()
    totals, outputs = evaluate_rows(target, head, rows, max_new_tokens, k, tree=tree, sampling=sampling)
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
        "draft_warning": broken_draft_warning(spec),  # None unless the draft accepts (almost) nothing
        "ngram": {**method_metrics(totals.ngram, totals.plain, k), "max_ngram": 3, "min_ngram": 1,
                  "greedy_equal": None if sampled else not totals.ngram_mismatches,
                  "mismatched_ids": totals.ngram_mismatches},
        "plain": {"tokens": totals.plain.tokens, "target_forwards": totals.plain.decode_forwards,
                  "prefill_forwards": totals.plain.prefill_forwards, "wall_s": totals.plain.wall_s,
                  "target_decode_s": totals.plain.target_decode_s},
        "eval_wall_s": time.perf_counter() - t0,
        "provenance": provenance(
            target=target.fingerprint(), target_path=str(target.path), draft=str(draft_dir),
            draft_format=_meta_value(meta, "format"), fingerprint_checked=checked,
            prompts_file=str(prompts_file), limit=limit, device=str(target.device),
            dtype=str(target.dtype).replace("torch.", ""),
        ),
    }
    if predict and tree.kind == "chain" and not sampled:
        from specheads.eval.predict import prediction_metrics

        prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": r.turns[0]}]) for r in rows]
        prediction = prediction_metrics(target, head, prompts, spec["acceptance_per_position_conditional"])
        if not prediction:
            log.warning("no prompt leaves room for the timed forwards: no speed-up prediction")
        metrics.update(prediction)
    out = Path(out_dir)
    write_text(out / "outputs.jsonl", "".join(json.dumps(o) + "\n" for o in outputs))
    from specheads.eval.report import attach_to_export, read_json, write_report

    write_report(out, metrics, outputs, read_json(verifier_json), read_json(bench_json))
    if attach:
        attach_to_export(draft_dir, out)
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specheads eval", description=(
        "Decode prompts with the target alone and with an exported draft; check the outputs are "
        "identical and report tau, per-position acceptance, cost ratio and speed-up."))
    p.add_argument("--target", required=True, help="local HF model folder or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`")
    p.add_argument("--prompts", help="jsonl with 'prompt' or 'turns' per row (online mode)")
    p.add_argument("--offline", action="store_true", help="teacher-forced acceptance on --data, no generation")
    p.add_argument("--data", help="held-out conversations (any training data format) for --offline")
    p.add_argument("--no-predict", action="store_true", help="skip the step-cost measurement and prediction")
    p.add_argument("--verifier-json", help="bench/verifier.py's verifier.json: plot measured speed-ups")
    p.add_argument("--bench-json", help="server load test JSON: plot throughput over concurrency")
    p.add_argument("--attach", action="store_true",
                   help="also copy metrics, report and plots into the export and its README (for push)")
    p.add_argument("--out", required=True, help="folder for metrics.json and outputs.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    a = p.parse_args(argv)
    if a.offline:
        from specheads.eval.offline import main_offline

        return main_offline(a)
    if not a.prompts:
        p.error("--prompts is required (or --offline --data FILE)")
    tree = spec_from_args(a)
    m = evaluate(a.target, a.draft, a.prompts, a.out, a.max_new_tokens, a.k, a.limit,
                 tree=None if tree.kind == "chain" else tree,
                 sampling=sampling_from_args(a), predict=not a.no_predict,
                 verifier_json=a.verifier_json, bench_json=a.bench_json, attach=a.attach)
    d, n = m["speculative"], m["ngram"]
    label = f"k={m['k']}" if m["tree"]["kind"] == "chain" else f"tree={m['tree']['kind']} k={m['k']}"
    print(f"{label} tau={d['tau']:.3f} (n-gram {n['tau']:.3f}) c={d['cost_ratio_c']:.3f} "
          f"predicted speed-up {d['predicted_speedup']:.2f}x measured {d['measured_speedup']:.2f}x "
          f"greedy_equal={m['greedy_equal']}{'' if m['lossless'] else ' LOSSY (typical acceptance)'}"
          f" -> {Path(a.out) / 'metrics.json'}")
    if m.get("draft_warning"):
        print(m["draft_warning"], file=sys.stderr)
    if m.get("advice"):
        from specheads.eval.predict import sglang_flags

        adv = m["advice"]
        print(f"recommended: vLLM num_speculative_tokens={adv['vllm']['num_speculative_tokens']} "
              f"(predicted {adv['vllm']['predicted_speedup']:.2f}x); SGLang {sglang_flags(adv['sglang'])} "
              f"-> {Path(a.out) / 'report.md'}")
    return 1 if m["greedy_equal"] is False else 0
