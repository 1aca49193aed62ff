"""Speed-up by concurrency: the cost of verifying B rows x n tokens, measured, the speed-up it
predicts per batch size and draft length, and measured batched decodes beside it.

At batch B a plain step verifies B x 1 tokens and a speculative step B x (k + 1) in one target
forward; the drafter and the loop's bookkeeping run once per row (our verifier drafts row by
row). So, with T_B(n) the measured seconds of one forward over B rows of n new tokens and the
per-row costs measured at batch 1 (`StepCosts`):

    plain_step(B)   = T_B(1) + B * o_plain
    spec_step(B, k) = T_B(k + 1) + B * (draft_fixed + k * draft_per_level + o_spec)
    speed-up(B, k)  = E_k * plain_step(B) / spec_step(B, k)

with E_k the expected tokens per row and step (acceptance is per row: it does not depend on B).
The best k per batch size becomes vLLM's `num_speculative_tokens_per_batch_size` schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specheads.eval.mixes import in_situ_costs
from specheads.eval.predict import (
    MIN_GAIN,
    NEAR_TIE,
    PredictError,
    StepCosts,
    expected_tokens_chain,
    measure_costs,
    median_round_robin,
)
from specheads.verify.ragged import batch_forward
from specheads.verify.steps import DecodeStats, new_cache, trim_cache

BATCH_SIZES = (1, 8, 32)
WITHIN = 0.10  # predicted and measured speed-ups agree when within 10% of the measured one


def chain_inputs(n: int, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Depths [n] and causal masks [n, n] of a chain of n tokens, for each of `rows` rows."""
    return [torch.arange(n)] * rows, [torch.ones(n, n, dtype=torch.bool).tril()] * rows


def time_batch_forwards(target, prompt_ids: list[int], batch_sizes=BATCH_SIZES, counts=(1, 2, 3, 4, 5, 6, 9),
                        reps: int = 5) -> dict[int, dict[int, float]]:
    """Median seconds of one cached forward over B rows x n new tokens after the prompt -> {B: {n: s}}."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)  # [P]
    past = ids.numel()
    ctx = target.context or 1 << 30
    counts = [n for n in counts if past + n <= ctx]
    if not counts:
        raise PredictError(f"the prompt ({past} tokens) leaves no room in the target's context")
    out = {}
    with torch.no_grad():
        for rows in batch_sizes:
            cache = new_cache(target)
            depths, masks = chain_inputs(past, rows)
            batch_forward(target, [ids] * rows, depths, masks, [0] * rows, cache)  # prefill [B, P]
            out[rows] = median_round_robin({n: _forward(target, ids, n, rows, past, cache) for n in counts},
                                            reps, target.device)
    return out


def ragged_pasts(past: int, rows: int) -> list[int]:
    """Row lengths as a batched decode has them: unequal (every other row one shorter), so the forward
    takes the 4-D masked path a real batch takes; one row stays unmasked, as a sequential decode."""
    return [past - (b % 2) for b in range(rows)]


def _forward(target, ids: torch.Tensor, n: int, rows: int, past: int, cache):
    """A repeatable forward of n tokens per row (the values do not change its cost)."""
    tokens = [ids[-1:].repeat(n)] * rows
    depths, masks = chain_inputs(n, rows)
    pasts = ragged_pasts(past, rows)

    def run():
        batch_forward(target, tokens, depths, masks, pasts, cache)
        trim_cache(cache, past)
    return run


@dataclass(frozen=True)
class BatchCosts:
    """Forward seconds per batch size and token count, and the per-row costs measured at batch 1."""

    forwards: dict[int, dict[int, float]]  # B -> n -> seconds (micro-timed; B = 1 included)
    per_row: StepCosts  # batch-1 costs corrected by real decodes (mixes.in_situ_costs)

    def target(self, rows: int, n: int) -> float:
        """T_B(n): the micro-timed forward (linear between measured counts, StepCosts' way, and between
        measured batch sizes), scaled by how batch-1 forwards inside real decodes (`per_row.target`)
        compared with their micro-timing."""
        sizes = sorted(self.forwards)
        lo = max([b for b in sizes if b <= rows], default=sizes[0])
        hi = min([b for b in sizes if b >= rows], default=sizes[-1])
        at = {b: StepCosts(target_s=self.forwards[b]).target(n) for b in {lo, hi}}
        micro = at[lo] if hi == lo else at[lo] + (at[hi] - at[lo]) * (rows - lo) / (hi - lo)
        return micro * self.per_row.target(n) / StepCosts(target_s=self.forwards[1]).target(n)

    def plain_step(self, rows: int) -> float:
        overhead = max(self.per_row.plain() - self.per_row.target(1), 0.0)
        return self.target(rows, 1) + rows * overhead

    def spec_step(self, rows: int, k: int) -> float:
        c = self.per_row
        return self.target(rows, k + 1) + rows * (c.draft_fixed_s + k * c.draft_per_level_s + c.overhead_s)

    def speedup(self, rows: int, k: int, tokens_per_step: float) -> float:
        """Full batches in steady state (every row decoding every step)."""
        return tokens_per_step * self.plain_step(rows) / self.spec_step(rows, k)

    def workload_speedup(self, rows: int, k: int, plain_steps: list[int], spec_steps: list[int]) -> float:
        """Requests that need plain_steps[i] / spec_steps[i] decode forwards each (their batch-1 decodes),
        continuously batched into `rows` slots: the batch thins out as requests run out."""
        plain = continuous_seconds(plain_steps, rows, self.plain_step)
        return plain / continuous_seconds(spec_steps, rows, lambda b: self.spec_step(b, k))


    def to_dict(self) -> dict:
        return {"forwards_s": {str(b): {str(n): s for n, s in f.items()} for b, f in self.forwards.items()},
                "per_row": self.per_row.to_dict()}


def continuous_seconds(steps: list[int], rows: int, step_s) -> float:
    """Seconds to decode requests needing steps[i] forwards each, admitted in order into `rows` slots
    as earlier ones finish, a step of b active rows costing step_s(b)."""
    waiting, active, seconds = list(reversed(steps)), [], 0.0
    while waiting or active:
        while waiting and len(active) < rows:
            active.append(waiting.pop())
        seconds += step_s(len(active))
        active = [n - 1 for n in active if n > 1]
    return seconds


def predict_by_batch(costs: BatchCosts, cond: list[float], ks=range(1, 9)) -> list[dict]:
    """Per batch size: the predicted speed-up of each chain length k and the best k (0: plain
    decoding, when no k gains MIN_GAIN; near ties go to the shorter k, as `predict.advice`)."""
    rows = []
    for b in sorted(costs.forwards):
        by_k = {k: costs.speedup(b, k, expected_tokens_chain(cond, k)) for k in ks}
        top = max(by_k.values())
        best = min(k for k, s in by_k.items() if s >= top - NEAR_TIE)
        if top < 1 + MIN_GAIN:
            best = 0
        rows.append({"batch_size": b, "speedup_by_k": {str(k): s for k, s in by_k.items()},
                     "best_k": best, "best_speedup": by_k[best] if best else 1.0})
    return rows


def vllm_schedule(rows: list[dict]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` ([[lo, hi, k], ...]) from the best k per
    measured batch size: each measured size's k holds from just past the previous size up to it."""
    schedule, lo = [], 1
    for row in sorted(rows, key=lambda r: r["batch_size"]):
        schedule.append([lo, row["batch_size"], row["best_k"]])
        lo = row["batch_size"] + 1
    return schedule


def concurrency_advice(target, prompt_ids: list[int], per_row: StepCosts, cond: list[float],
                       batch_sizes=BATCH_SIZES, reps: int = 3) -> dict:
    """eval's advice by concurrency: the best k at each batch size, predicted from forwards timed
    over B rows here and eval's per-row costs, and vLLM's per-batch-size schedule of it."""
    rows = predict_by_batch(BatchCosts(time_batch_forwards(target, prompt_ids, batch_sizes, reps=reps), per_row), cond)
    return {"rows": [{k: v for k, v in r.items() if k != "speedup_by_k"} for r in rows],
            "vllm_num_speculative_tokens_per_batch_size": vllm_schedule(rows)}


def timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure_by_batch(session, prompts: list[list[int]], max_new_tokens: int,
                     batch_sizes=BATCH_SIZES) -> tuple[list[dict], dict, dict]:
    """Plain and speculative throughput of `prompts` decoded at each batch size (continuous
    batching over all of them), whether every speculative output equals the plain one -> (rows,
    {B: (plain stats, speculative stats)}, {B: (each request's plain / speculative decode forwards)})."""
    rows, stats, steps = [], {}, {}
    for b in batch_sizes:
        plain, plain_s = timed(lambda b=b: session.decode_many(prompts, max_new_tokens, batch_size=b, drafted=False))
        spec, spec_s = timed(lambda b=b: session.decode_many(prompts, max_new_tokens, batch_size=b))
        stats[b] = (DecodeStats.total(plain), DecodeStats.total(spec))
        steps[b] = ([r.stats.decode_forwards for r in plain], [r.stats.decode_forwards for r in spec])
        tokens = stats[b][0].tokens
        rows.append({"batch_size": b, "prompts": len(prompts), "tokens": tokens,
                     "plain_tok_s": tokens / plain_s, "spec_tok_s": stats[b][1].tokens / spec_s,
                     "plain_s": plain_s, "spec_s": spec_s, "measured_speedup": plain_s / spec_s,
                     "tau": stats[b][1].summary()["tau"],
                     "greedy_equal": sum(s.tokens == p.tokens for s, p in zip(spec, plain))})
    return rows, stats, steps


def concurrency_table(session, prompts: list[list[int]], max_new_tokens: int, batch_sizes=BATCH_SIZES,
                      reps: int = 5) -> dict:
    """Measured rows at each batch size beside the prediction for the session's k, and the predicted
    best k per size. Per-row costs: micro-timed, corrected by the batch-1 decodes of this run
    (`mixes.in_situ_costs`, as eval does); each request's forwards at batch 1 give the workload that
    `continuous_seconds` schedules at every size, so the batch-1 row checks the cost model on its
    own decodes and every larger batch is a prediction from T_B(n) and batch-1 counts alone."""
    if 1 not in batch_sizes:
        raise PredictError("the concurrency table needs batch size 1 (it prices the per-row costs)")
    measured, stats, steps = measure_by_batch(session, prompts, max_new_tokens, batch_sizes)
    plain1, spec1 = stats[1]
    per_row = in_situ_costs(measure_costs(session.target, session.head, prompts[:4], k_max=max(session.k, 2)),
                            plain1, spec1)
    costs = BatchCosts(time_batch_forwards(session.target, prompts[0], batch_sizes, reps=reps), per_row)
    for row in measured:
        row["predicted_speedup"] = costs.workload_speedup(row["batch_size"], session.k, *steps[1])
        row["predicted_speedup_full_batches"] = costs.speedup(row["batch_size"], session.k, row["tau"])
        row["within_10pct"] = abs(row["predicted_speedup"] / row["measured_speedup"] - 1) <= WITHIN
    best = predict_by_batch(costs, spec1.summary()["acceptance_per_position_conditional"])
    return {"k": session.k, "max_new_tokens": max_new_tokens, "rows": measured, "best_k": best,
            "vllm_num_speculative_tokens_per_batch_size": vllm_schedule(best), "costs": costs.to_dict()}


def markdown(table: dict) -> str:
    """The speed-up-by-concurrency table: plain vs speculative tokens/s, measured and predicted."""
    lines = [f"| batch | plain tok/s | speculative tok/s (k = {table['k']}) | measured | predicted | within 10% "
             "| greedy-equal | best k (predicted) |", "|---:|---:|---:|---:|---:|:-:|---:|---:|"]
    best = {r["batch_size"]: r for r in table["best_k"]}
    for r in table["rows"]:
        b = best.get(r["batch_size"], {})
        lines.append(f"| {r['batch_size']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['measured_speedup']:.2f}x "
                     f"| {r['predicted_speedup']:.2f}x | {'yes' if r['within_10pct'] else 'no'} "
                     f"| {r['greedy_equal']}/{r['prompts']} | {b.get('best_k', '-')} ({b.get('best_speedup', 0):.2f}x) |")
    lines.append("")
    lines.append(f"vLLM: `\"num_speculative_tokens_per_batch_size\": {table['vllm_num_speculative_tokens_per_batch_size']}`"
                 " in `--speculative-config` (k 0: speculation off at that size).")
    return "\n".join(lines) + "\n"
