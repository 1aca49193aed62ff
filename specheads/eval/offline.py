"""Offline acceptance and the offline/online parity check.

Offline: teacher-forced per-position acceptance of a head on tokenised data, from the same TTT
counts training logs (no generation, fast). Parity: the offline tau of the trained checkpoint on
the target's own greedy answers against the online tau the verifier measured with the EXPORTED
folder on the same prompts. A gap means the export or the serving setup differs from training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.data.conversations import read_conversations
from specheads.data.prompts import encode_chat, user_turn
from specheads.data.tokenize import TokenizedSample, collate, tokenize_all
from specheads.eval.predict import simulated_tau
from specheads.eval.report import check_report_folder, write_report
from specheads.eval_identity import KEY as WEIGHTS_KEY
from specheads.eval_identity import draft_weights
from specheads.heads.losses import COUNT_KEYS
from specheads.metrics import decode_walk, ttt_summary, walk_summary
from specheads.provenance import provenance
from specheads.session import load_draft
from specheads.target import Target

LIKELY_CAUSES = [
    "vocabulary map: d2t/t2d in the export differ from training (draft ids land on wrong target ids)",
    "aux layers: the engine taps other target layers than the head was trained on",
    "chat template: prompts rendered differently at eval than in the training data",
    "context length: eval prompts longer than anything seen in training",
]


@torch.no_grad()
def offline_acceptance(target, head, samples: list[TokenizedSample], batch_size: int = 8) -> dict:
    """Teacher-forced acceptance per draft step, counts summed over batches before any ratio; for
    heads that draft at every position, also the rows replayed in decode order (`decode_order`,
    its tau is what a greedy chain decoder of k = ttt_steps measures on the same text)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    head = head.to(target.device, target.dtype).eval()
    totals, ranks, walked = None, None, []
    for b in range(0, len(samples), batch_size):
        batch = {k: v.to(target.device) for k, v in collate(samples[b:b + batch_size], pad).items()}
        res = head.train_forward(**head.expand(target, head.collect(target, batch), batch))
        counts = torch.stack([res.counts[k] for k in COUNT_KEYS])
        totals = counts if totals is None else totals + counts
        if "rank_hits" in res.counts:  # [S, W]: heads that measure sibling ranks
            ranks = res.counts["rank_hits"] if ranks is None else ranks + res.counts["rank_hits"]
        if res.walk is not None:
            walked.append(decode_walk(res.walk))
    if totals is None:
        raise ValueError("offline acceptance needs at least one sample")
    rows, reached, cond_rows = totals.tolist()
    out = {**ttt_summary(rows, reached, cond_rows), "rows": rows, "samples": len(samples)}
    if ranks is not None:
        out["rank_acceptance"] = [[h / c if c else 0.0 for h in hits] for hits, c in zip(ranks.tolist(), cond_rows)]
    if walked:
        out["decode_order"] = walk_summary(sum(w["starts"] for w in walked),
                                           [sum(col) for col in zip(*(w["reached"] for w in walked))])
    return out


def samples_from_outputs(tokenizer, outputs_path: str | Path) -> list[TokenizedSample]:
    """First turns of an eval's outputs.jsonl: chat-rendered prompt + the target's greedy answer."""
    rows = [json.loads(line) for line in Path(outputs_path).read_text().splitlines()]
    return samples_from_rows(tokenizer, rows)


def samples_from_rows(tokenizer, rows: list[dict]) -> list[TokenizedSample]:
    """First turns of eval output rows: chat-rendered prompt + the target's greedy answer."""
    samples = []
    for row in rows:
        if row.get("turn", 0) != 0 or not row.get("plain_ids"):
            continue
        ids = encode_chat(tokenizer, user_turn(row["prompt"]))  # exactly the online prompt's ids
        answer = list(row["plain_ids"])
        samples.append(TokenizedSample(str(row["id"]), ids + answer, [0] * len(ids) + [1] * len(answer)))
    return samples


def parity(offline_tau: float, online_tau: float, tolerance: float = 0.15) -> dict:
    """Compare taus; a relative gap beyond `tolerance` is flagged with the usual causes."""
    gap = (online_tau - offline_tau) / offline_tau if offline_tau else 0.0
    ok = abs(gap) <= tolerance
    return {"offline_tau": offline_tau, "online_tau": online_tau, "relative_gap": gap,
            "tolerance": tolerance, "ok": ok, "likely_causes": [] if ok else LIKELY_CAUSES}


DECODE_ORDER_TOLERANCE = 0.05  # the replay is the decoder's own walk: only the budget's last steps differ


def check_parity(target, head, eval_dir: str | Path, tolerance: float | None = None) -> dict:
    """Offline tau of `head` (e.g. the training checkpoint) vs the online tau in eval_dir. Heads that
    draft at every position compare the teacher-forced rows replayed in decode order with the
    verifier's mean acceptance length (default tolerance 5%); others the teacher-forced tau with
    the verifier's tau (15%), which decoding's visits to hard rows pull below it."""
    eval_dir = Path(eval_dir)
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    k = metrics.get("k")
    if k is not None and k != head.config.ttt_steps:
        raise ValueError(f"{eval_dir}/metrics.json was measured with k={k}; the head unrolls "
                         f"{head.config.ttt_steps} steps. Evaluate with --k {head.config.ttt_steps}.")
    samples = samples_from_outputs(target.tokenizer, eval_dir / "outputs.jsonl")
    offline = offline_acceptance(target, head, samples)
    online = metrics["speculative"]
    if "decode_order" in offline and "mean_acceptance_length" in online:
        result = parity(offline["decode_order"]["tau"], online["mean_acceptance_length"],
                        DECODE_ORDER_TOLERANCE if tolerance is None else tolerance)
        return {**result, "compared": "decode order", "offline": offline}
    result = parity(offline["tau_est"], online["tau"], 0.15 if tolerance is None else tolerance)
    return {**result, "compared": "teacher-forced", "offline": offline}


def evaluate_offline(target_path: str, draft_dir: str, data_file: str, out_dir: str,
                     limit: int | None = None, max_length: int = 2048, dtype: str | None = None,
                     device: str = "auto", allow_missing_fingerprint: bool = False) -> dict:
    """`specheads eval --offline`: teacher-forced acceptance of an export on held-out
    conversations, the simulated tau of chains and trees, metrics.json + report + plots."""
    check_report_folder(out_dir)
    convs, _ = read_conversations(data_file, format_option=None, source_option="--data")  # fails before the target loads
    target = Target.load(target_path, dtype=dtype, device=device)
    draft = load_draft(draft_dir, target, allow_missing_fingerprint)
    head, checked = draft.head, draft.fingerprint_checked
    samples = tokenize_all(target.tokenizer, convs[:limit], max_length)
    acc = offline_acceptance(target, head, samples)
    metrics = {"mode": "offline", "tau_est": acc["tau_est"], "offline": acc,
               "simulated_tau": simulated_tau(acc["acc_cond"], rank_q=acc.get("rank_acceptance")),
               WEIGHTS_KEY: draft_weights(draft.meta.folder),  # the weights measured (eval_identity.py)
               "provenance": provenance(target=target.fingerprint(), draft=str(draft_dir), data=str(data_file),
                                        limit=limit, fingerprint_checked=checked)}
    return write_report(out_dir, metrics)
