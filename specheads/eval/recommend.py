"""One recommendation per eval: the draft length k to serve with, vLLM's per-batch-size schedule and
the notes behind them, settled once (`settle`) and stored in metrics.json as advice["recommended"].
The terminal line (`predict.advice_summary`), report.md and the export's README (`report.advice_lines`,
the serve commands rewritten to that k: `with_recommended_k`) and the pushed card all read it, so one
run never prints two draft lengths.

Two rules settle it, whatever the predictions say: a batch size where this run measured speculative
decoding faster than plain keeps speculation on at the measured k (the prediction's "off" is
overruled and the advice says so), and batch 1's band of the schedule is the headline k.
"""

from __future__ import annotations

import re

from specheads.engine_facts import SGLANG_TREE, sglang_chain_flags
from specheads.eval.predict import chain_advice

VLLM_K = re.compile(r'"num_speculative_tokens":\s*\d+')
SGLANG_CHAIN = re.compile(re.escape(SGLANG_TREE.format(steps="STEPS", topk=1, tokens="TOKENS"))
                          .replace("STEPS", r"\d+").replace("TOKENS", r"\d+"))
SERVE_LINES = ("vllm serve", "python -m sglang")


def vllm_schedule(rows: list[dict]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` ([[lo, hi, k], ...]) from the best k per
    measured batch size: each measured size's k holds from just past the previous size up to it."""
    schedule, lo = [], 1
    for row in sorted(rows, key=lambda r: r["batch_size"]):
        schedule.append([lo, row["batch_size"], row["best_k"]])
        lo = row["batch_size"] + 1
    return schedule


def measured_at_batch_one(metrics: dict) -> list[tuple[int, float]]:
    """(k, measured speed-up) pairs this run measured at batch 1: eval's own decodes (when it ran at
    batch 1) and a concurrency table's batch-1 row handed to it (advice["by_concurrency"]["measured"])."""
    out = []
    if metrics.get("batch_size", 1) == 1 and (metrics.get("speculative") or {}).get("measured_speedup"):
        out.append((int(metrics["k"]), float(metrics["speculative"]["measured_speedup"])))
    by = (metrics.get("advice") or {}).get("by_concurrency") or {}
    if by.get("measured", {}).get("1") is not None:
        out.append((int(by["k_measured"]), float(by["measured"]["1"])))
    return out


def keep_measured_headline(metrics: dict) -> None:
    """Advice that turns speculation off while this run measured a k faster than plain at batch 1:
    speculation kept on at that k (the fastest measured), saying why ("kept_on")."""
    adv, pred = metrics["advice"], metrics.get("prediction") or {}
    faster = sorted((m, k) for k, m in measured_at_batch_one(metrics) if m > 1.0)
    if adv.get("speculate", True) or not faster:
        return
    measured, k = faster[-1]
    chain = next((r for r in pred.get("chains", []) if r["k"] == k), None)
    if chain is None:
        return
    best = adv.get("best_chain", {}).get("predicted_speedup", chain["speedup"])
    adv.update(chain_advice(chain))
    adv["kept_on"] = (f"measured {measured:.2f}x at k={k} in this run against a predicted {best:.2f}x at best: "
                      "speculation kept on")
    adv.pop("reason", None)


def align_batch_one(by: dict, k: int, speedup: float) -> None:
    """The schedule's batch-1 band set to the headline's k (0: off) and vLLM's schedule rebuilt."""
    for row in by.get("rows", []):
        if row["batch_size"] == 1:
            row["best_k"], row["best_speedup"] = k, speedup if k else 1.0
    by["vllm_num_speculative_tokens_per_batch_size"] = vllm_schedule(by.get("rows", []))


def settle(metrics: dict) -> dict | None:
    """metrics["advice"]["recommended"]: the one k (0: no speculation), its predicted speed-up, the note
    behind it and vLLM's schedule, after `keep_measured_headline` and `align_batch_one`; None (and
    nothing written) when the eval gave no advice."""
    adv = metrics.get("advice")
    if not adv:
        return None
    keep_measured_headline(metrics)
    on = adv.get("speculate", True)
    k = adv["vllm"]["num_speculative_tokens"] if on else 0
    speedup = adv["vllm"]["predicted_speedup"] if on else None
    by = adv.get("by_concurrency")
    if by:
        align_batch_one(by, k, speedup or 1.0)
    adv["recommended"] = {
        "speculate": on, "k": k, "predicted_speedup": speedup,
        "note": adv.get("kept_on") or adv.get("uncertain") or (None if on else adv.get("reason")),
        "vllm_num_speculative_tokens_per_batch_size": by["vllm_num_speculative_tokens_per_batch_size"] if by else None,
    }
    return adv["recommended"]


def recommended_k(adv: dict | None) -> int | None:
    """The settled k of an advice (None: no settled recommendation, or no speculation)."""
    rec = (adv or {}).get("recommended") or {}
    return rec.get("k") or None


def with_recommended_k(readme: str, k: int) -> str:
    """README text whose serve command lines draft k tokens: vLLM's `num_speculative_tokens` and
    SGLang's chain flags rewritten, every other line as it was."""
    lines = []
    for line in readme.split("\n"):
        if line.strip().startswith(SERVE_LINES):
            line = VLLM_K.sub(f'"num_speculative_tokens":{k}', line)
            line = SGLANG_CHAIN.sub(sglang_chain_flags(k), line)
        lines.append(line)
    return "\n".join(lines)


def by_concurrency_from_table(table: dict) -> dict:
    """eval's advice by concurrency from a measured concurrency table (`concurrency.concurrency_table`,
    which the demo runs before its eval): its bands (predicted, kept on where it measured a speed-up),
    vLLM's schedule of them, and what it measured (the headline's rule reads batch 1's)."""
    rows = [{k: v for k, v in r.items() if k != "speedup_by_k"} for r in table["best_k"]]
    return {"rows": rows, "vllm_num_speculative_tokens_per_batch_size": vllm_schedule(rows),
            "drafter": table.get("costs", {}).get("drafter"), "k_measured": table["k"],
            "measured": {str(r["batch_size"]): r["measured_speedup"] for r in table["rows"]},
            "from": "the concurrency table measured in this run"}
