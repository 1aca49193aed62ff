"""One definition of acceptance metrics for training logs, eval, the verifier and benchmarks.

tau counts the bonus token (plain decoding = 1.00). Per-position acceptance is unconditional
(share of drafts whose first p+1 tokens were all accepted) and conditional (given p accepted).
Counts are summed over batches and ranks before any ratio is taken.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def ttt_summary(rows: Sequence[float], reached: Sequence[float], cond_rows: Sequence[float]) -> dict:
    """Per-step top-1 agreement from TTT counts, and the chain tau they imply."""
    uncond = [_ratio(r, n) for r, n in zip(reached, rows)]
    cond = [_ratio(r, n) for r, n in zip(reached, cond_rows)]
    return {"acc_uncond": uncond, "acc_cond": cond, "tau_est": 1.0 + sum(uncond)}


def decode_walk(walk) -> dict:
    """Teacher-forced rows replayed in the order a greedy chain decoder (k = S) visits them.

    walk [S+1, B, T] bool (HeadOutput.walk): walk[0] the rows where a draft may start, walk[j+1]
    the rows whose drafts 0..j all match the target. From each sequence's first start the decoder
    accepts a drafts, emits the target's token and drafts next at row i + a + 1 (or the next start
    after it: a turn's end). Teacher-forced tau weighs every row alike; decoding visits the rows
    after a rejection more often, so this, not tau_est, is what the verifier measures on the same
    text. Returns summable counts {"starts", "reached" [S]} (see `walk_summary`).
    """
    starts, accepted = walk[0].cpu(), walk[1:].sum(0).cpu()  # [B, T] each: accepted drafts per row
    reached, n = [0] * (walk.shape[0] - 1), 0
    for b in range(starts.shape[0]):
        rows, acc = starts[b].nonzero().flatten().tolist(), accepted[b].tolist()
        k = 0
        while k < len(rows):
            i = rows[k]
            n += 1
            for p in range(acc[i]):
                reached[p] += 1
            k = bisect_left(rows, i + acc[i] + 1, lo=k + 1)
    return {"starts": n, "reached": reached}


def walk_summary(starts: int, reached: Sequence[int]) -> dict:
    """decode_walk counts -> tau in decode order (bonus included) and per-position acceptance."""
    per = [_ratio(r, starts) for r in reached]
    return {"tau": 1.0 + sum(per), "acceptance_per_position": per, "starts": starts}


def chain_summary(drafts: int, accepted_per_pos: Sequence[int], tokens: int, forwards: int) -> dict:
    """Verifier counts -> tau, per-position acceptance (vLLM's definition) and acceptance rate.

    drafts: verification steps that proposed at least one token; accepted_per_pos[p]: drafts
    whose accepted prefix reached position p; tokens: tokens emitted; forwards: target forwards.
    """
    accepted = sum(accepted_per_pos)
    cond, prev = [], drafts
    for count in accepted_per_pos:
        cond.append(_ratio(count, prev))
        prev = count
    return {
        "tau": _ratio(tokens, forwards),
        "mean_acceptance_length": 1.0 + _ratio(accepted, drafts),
        "acceptance_per_position": [_ratio(c, drafts) for c in accepted_per_pos],
        "acceptance_per_position_conditional": cond,
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "tokens": tokens,
        "target_forwards": forwards,
    }


def predicted_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Seed formula (1 - a^(k+1)) / ((1 - a)(k c + 1)) for i.i.d. per-token acceptance a."""
    expected = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * cost_ratio + 1)


BROKEN_ACCEPTANCE = 0.02  # accepted draft tokens per draft below this ...
BROKEN_MIN_DRAFTS = 20  # ... over at least this many drafts: the draft is broken, not merely weak


def broken_draft_warning(summary: dict) -> str | None:
    """A warning when a draft accepts (almost) nothing over a meaningful number of drafts (tau ~ 1.0),
    listing the likely causes; None otherwise. `summary`: a chain_summary."""
    drafts = summary.get("num_drafts", 0)
    if drafts < BROKEN_MIN_DRAFTS or _ratio(summary.get("num_accepted_tokens", 0), drafts) >= BROKEN_ACCEPTANCE:
        return None
    return (f"warning: the draft looks broken: {summary.get('num_accepted_tokens', 0)} token(s) accepted in "
            f"{drafts} drafts (tau {summary.get('tau', 0.0):.3f}). Likely causes: the draft was trained for another "
            "target; a wrong vocabulary map (d2t) in the export; a chat template that differs from training; "
            "untrained, diverged or NaN weights.")
