"""Speed-up by concurrency: the cost of one decode step over B rows, measured part by part, the
speed-up it predicts per batch size and draft length, and measured batched decodes beside it.

At batch B a plain step verifies B x 1 tokens and a speculative step B x (k + 1) in one target
forward. EAGLE-3 / EAGLE-1 chain rows over one head draft as one group (docs/algorithms.md §8.7):
one catch-up forward over every row's accepted tokens, then one forward per further draft
position, each over all B rows. So, per step,

    plain_step(B)   = T_B(1) + p_step + B * p_row
    spec_step(B, k) = T_B(k + 1) + D_B(k) + o_step + B * o_row
    speed-up(B, k)  = E_k * plain_step(B) / spec_step(B, k)

* T_B(n): one target forward over B rows of n new tokens (`time_batch_forwards`);
* D_B(k): the drafter's part of a step over B rows (`time_batch_drafts`: every row's accept, then
  the group's drafting through `draft_group`, a lone row's through `propose`), timed on real
  prefilled rows; heads that do not group (and n-gram or tree rows) keep B * (draft_fixed +
  k * draft_per_level), per row;
* o_step + B * o_row (p_* for plain steps): the loop's own seconds per step outside the target's
  section and the drafter (`Batch.step` bookkeeping), batch 1's measured in its decodes and its
  growth per row measured in situ on short batches of 1 and of the largest B (`time_loop_overhead`);
* E_k: the expected tokens per row and step (acceptance is per row: it does not depend on B).

Batch 1 is priced by its own decodes (`StepCosts` corrected by `mixes.in_situ_costs`); above it, T_B
and D_B are micro-timed and scaled by one factor each, how batch 1's forwards and drafting inside
real decodes compared with their micro-timing (a median over n, so one badly drawn micro-timing
cannot reprice its n alone): every larger batch is a prediction, nothing is fitted to the batched
decodes it is compared with. The prediction prices decode steps, so it is compared with the
measured speed-up of the decode steps (each run's wall seconds less its prefill phase, which both
runs pay alike); the wall speed-up is reported beside it. The best k per batch size becomes vLLM's
`num_speculative_tokens_per_batch_size` schedule.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

from specheads.eval.mixes import in_situ_costs
from specheads.eval.predict import (
    NEAR_TIE,
    PredictError,
    StepCosts,
    expected_tokens_chain,
    measure_costs,
    speedup_range,
    verdict,
)
from specheads.eval.recommend import vllm_schedule
from specheads.eval.report import band_mark, band_notes
from specheads.eval.timing import largest_spread, round_robin
from specheads.protocols import GroupedProposer
from specheads.target import TargetOutput
from specheads.verify.loop import Batch
from specheads.verify.ragged import batch_forward
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec
from specheads.verify.steps import Clock, DecodeStats, new_cache, target_step, trim_cache

BATCH_SIZES = (1, 8, 32)
WITHIN = 0.10  # predicted and measured speed-ups agree when within 10% of the measured one


def chain_inputs(n: int, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Depths [n] and causal masks [n, n] of a chain of n tokens, for each of `rows` rows."""
    return [torch.arange(n)] * rows, [torch.ones(n, n, dtype=torch.bool).tril()] * rows


def by_size(timings: dict) -> dict[int, dict]:
    """{(B, x): value} -> {B: {x: value}} (x in timing order)."""
    out: dict[int, dict] = {}
    for (rows, x), value in timings.items():
        out.setdefault(rows, {})[x] = value
    return out


def table_medians(timings: dict[int, dict]) -> dict[int, dict[int, float]]:
    return {rows: {x: t.median for x, t in row.items()} for rows, row in timings.items()}


def batch_forward_timings(target, prompt_ids: list[int], batch_sizes=BATCH_SIZES, counts=(1, 2, 3, 4, 5, 6, 9),
                          reps: int = 5) -> dict[int, dict]:
    """`Timing` of one cached forward over B rows x n new tokens after the prompt -> {B: {n: Timing}}:
    every batch size prefilled first, then every (B, n) interleaved (eval/timing.py), so a burst of
    load cannot land on one batch size's block alone."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)  # [P]
    past = ids.numel()
    ctx = target.context or 1 << 30
    counts = [n for n in counts if past + n <= ctx]
    if not counts:
        raise PredictError(f"the prompt ({past} tokens) leaves no room in the target's context")
    calls = {}
    with torch.no_grad():
        for rows in batch_sizes:
            cache = new_cache(target)
            depths, masks = chain_inputs(past, rows)
            batch_forward(target, [ids] * rows, depths, masks, [0] * rows, cache)  # prefill [B, P]
            calls.update({(rows, n): _forward(target, ids, n, rows, past, cache) for n in counts})
        return by_size(round_robin(calls, reps, target.device))


def time_batch_forwards(target, prompt_ids: list[int], batch_sizes=BATCH_SIZES, counts=(1, 2, 3, 4, 5, 6, 9),
                        reps: int = 5) -> dict[int, dict[int, float]]:
    """Median seconds of one cached forward over B rows x n new tokens after the prompt -> {B: {n: s}}."""
    return table_medians(batch_forward_timings(target, prompt_ids, batch_sizes, counts, reps))


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


# --- the drafter over B rows -----------------------------------------------------------------------


def group_drafter_of(proposer):
    """The object a chain proposer drafts a group with, or None (it drafts row by row)."""
    return proposer.group_drafter() if isinstance(proposer, GroupedProposer) else None


def time_batch_drafts(target, head, prompt_ids: list[int], batch_sizes=BATCH_SIZES, ks=range(1, 5),
                      reps: int = 5) -> dict[int, dict[int, float]] | None:
    """Median seconds of the drafter's part of one decode step over B rows drafting chains of k ->
    {B: {k: s}} (`batch_draft_timings`); None when the head's chain proposer does not group."""
    timings = batch_draft_timings(target, head, prompt_ids, batch_sizes, ks, reps)
    return None if timings is None else table_medians(timings)


def batch_draft_timings(target, head, prompt_ids: list[int], batch_sizes=BATCH_SIZES, ks=range(1, 5),
                        reps: int = 5) -> dict[int, dict] | None:
    """`Timing` of the drafter's part of one decode step over B rows drafting chains of k ->
    {B: {k: Timing}}: every row accepts the tokens it accepted last step, then B >= 2 rows draft as one
    group (`draft_group`: the catch-up forward, then k - 1 forwards), a lone row alone (`propose`),
    as `loop.propose_all` does; every (B, k) interleaved. None when the head's chain proposer does
    not group."""
    ks = sorted(ks)
    lead = group_drafter_of(make_proposer(TreeSpec("chain", k=ks[-1]), head, target))
    if lead is None:
        return None
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)  # [P]
    if ids.numel() < ks[-1] + 4:
        raise PredictError(f"the prompt ({ids.numel()} tokens) is too short to time drafts of "
                           f"{ks[-1]}: it needs {ks[-1] + 4}")
    calls = {}
    with torch.no_grad():
        prefill = target_step(target, ids[None], 0, new_cache(target), lead.layers)  # [1, P, ...]
        for rows in batch_sizes:
            members, points = draft_rows(target, head, ids, prefill, rows, ks[-1])
            calls.update({(rows, k): _draft_step(members, points, ids, prefill, k) for k in ks})
        return by_size(round_robin(calls, reps, target.device))


def draft_rows(target, head, ids: torch.Tensor, prefill, rows: int, k_max: int) -> tuple[list, list]:
    """`rows` drafters started on prefixes of ids [P] (every other row one shorter, as ragged as a
    real batch), leaving room for k_max + 1 accepted tokens after each; two or more rows run one
    group step first (from then on they defer `accept` to the group, as in the loop)."""
    members = [group_drafter_of(make_proposer(TreeSpec("chain", k=k_max), head, target)) for _ in range(rows)]
    for b, m in enumerate(members):
        start = ids.numel() - k_max - 2 - b % 2
        m.start(ids[:start], int(ids[start]), prefill)
    if rows > 1:
        members[0].draft_group(members, [1] * rows, [None] * rows)
    return members, [m.checkpoint() for m in members]


def _draft_step(members: list, points: list, ids: torch.Tensor, prefill, k: int):
    """A repeatable drafter step: back to the checkpoints, row b accepts k + 1 - b % (k + 1) tokens
    (ragged; the longest accepted every draft), then drafts of k."""
    rows = len(members)

    def run():
        for b, (m, point) in enumerate(zip(members, points)):
            m.rewind(point)
            lo, n = point[0], k + 1 - b % (k + 1)
            m.accept(ids[lo: lo + n], ids[lo + 1: lo + n + 1], positions_of(prefill, lo, n), lo)
        if rows == 1:
            members[0].propose(k)
        else:
            members[0].draft_group(members, [k] * rows, [None] * rows)
    return run


def positions_of(out: TargetOutput, lo: int, n: int) -> TargetOutput:
    """Positions lo .. lo + n - 1 of a one-row forward (views): what the target's verification of
    those tokens hands the drafter."""
    return TargetOutput(logits=out.logits[:, lo: lo + n], hidden={i: h[:, lo: lo + n] for i, h in out.hidden.items()},
                        final=None if out.final is None else out.final[:, lo: lo + n])


# --- the loop's own seconds --------------------------------------------------------------------------


def time_loop_overhead(session, prompts: list[list[int]], rows: int, steps: int = 6) -> tuple[float, float] | None:
    """Growth per row of the loop's own seconds per step (`Batch.step` outside the target's section
    and the drafter's clocks), speculative and plain: batches of 1 and of `rows` rows stepped in
    situ, interleaved -> (speculative, plain) seconds per extra row; None when no prompt leaves room."""
    budget = (steps + 2) * (session.k + 1)
    ctx = session.target.context or 1 << 30
    fit = [p for p in prompts if len(p) + budget <= ctx]
    if not fit or rows < 2:
        return None
    batches = {(drafted, size): _admitted(session, fit, size, drafted, budget)
               for drafted in (True, False) for size in (1, rows)}
    samples: dict = {key: [] for key in batches}
    with torch.no_grad():
        for rep in range(steps + 1):  # step 0 warms up, untimed
            for key, batch in batches.items():
                sample = _bookkeeping(batch)
                if rep and sample is not None:
                    samples[key].append(sample)
    for batch in batches.values():  # their requests end here (proposers closed as a finished row's)
        batch.drop([row.index for row in batch.rows])
    return tuple(_per_row(samples[(drafted, 1)], samples[(drafted, rows)]) for drafted in (True, False))


def _admitted(session, prompts: list[list[int]], rows: int, drafted: bool, budget: int) -> Batch:
    """A batch of `rows` requests (prompts cycled), prefilled."""
    batch = Batch(session.target)
    reqs = [session.request(prompts[b % len(prompts)], budget, drafted=drafted) for b in range(rows)]
    with torch.no_grad():
        batch.admit(list(enumerate(reqs)))
    return batch


def _bookkeeping(batch: Batch) -> tuple[int, float] | None:
    """One step of the batch -> (its rows, its seconds outside the target's section and the drafter)."""
    rows = list(batch.rows)
    if not rows:
        return None
    target_s, draft_s = batch.clock.seconds, sum(row.prop_clock.seconds for row in rows)
    clock = Clock(batch.target.device)
    with clock:
        batch.step()
    target_s, draft_s = batch.clock.seconds - target_s, sum(row.prop_clock.seconds for row in rows) - draft_s
    return len(rows), max(clock.seconds - target_s - draft_s, 0.0)


def _per_row(small: list[tuple[int, float]], large: list[tuple[int, float]]) -> float:
    """Seconds per extra row between two batches' median (rows, seconds) steps (never negative)."""
    if not small or not large:
        return 0.0
    (b1, s1), (b2, s2) = ((statistics.median(r for r, _ in x), statistics.median(s for _, s in x)) for x in (small, large))
    return max((s2 - s1) / (b2 - b1), 0.0) if b2 > b1 else 0.0


@dataclass(frozen=True)
class LoopOverhead:
    """The loop's own seconds per step at B rows: batch 1's plus (B - 1) per extra row, i.e. a
    per-step part (one_s - row_s) and B * row_s; speculative and plain steps apart."""

    spec_one_s: float
    spec_row_s: float
    plain_one_s: float
    plain_row_s: float

    def spec(self, rows: int) -> float:
        return self.spec_one_s + (rows - 1) * self.spec_row_s

    def plain(self, rows: int) -> float:
        return self.plain_one_s + (rows - 1) * self.plain_row_s

    @classmethod
    def per_row(cls, costs: StepCosts) -> LoopOverhead:
        """Batch 1's overheads charged per row at every size (nothing shared by the step)."""
        return cls(costs.overhead_s, costs.overhead_s, plain_overhead(costs), plain_overhead(costs))

    @classmethod
    def growing(cls, costs: StepCosts, spec_row_s: float, plain_row_s: float) -> LoopOverhead:
        """Batch 1's overheads (`costs`, from its decodes) growing by the measured seconds per row."""
        return cls(costs.overhead_s, spec_row_s, plain_overhead(costs), plain_row_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "spec_step_s": self.spec_one_s - self.spec_row_s,
                "plain_step_s": self.plain_one_s - self.plain_row_s}


def plain_overhead(costs: StepCosts) -> float:
    """A plain step's seconds outside the target's section, at batch 1."""
    return max(costs.plain() - costs.target(1), 0.0)


# --- the cost model ---------------------------------------------------------------------------------


def curve(points: dict[int, float], x: int) -> float:
    """A measured curve at x (linear between measured points and beyond them, `StepCosts`' way)."""
    return StepCosts(target_s=points).target(x)


def between_sizes(table: dict[int, dict[int, float]], rows: int, x: int) -> float:
    """{B: curve} at `rows` rows: linear between the measured batch sizes around it."""
    sizes = sorted(table)
    lo = max([b for b in sizes if b <= rows], default=sizes[0])
    hi = min([b for b in sizes if b >= rows], default=sizes[-1])
    at = {b: curve(table[b], x) for b in {lo, hi}}
    return at[lo] if hi == lo else at[lo] + (at[hi] - at[lo]) * (rows - lo) / (hi - lo)


@dataclass(frozen=True)
class BatchCosts:
    """A decode step's parts over B rows (module docstring): target forwards and grouped drafter
    steps micro-timed per batch size, batch 1's costs from its decodes, the loop's overhead."""

    forwards: dict[int, dict[int, float]]  # B -> n -> seconds (micro-timed; B = 1 included)
    per_row: StepCosts  # batch-1 costs corrected by real decodes (mixes.in_situ_costs)
    drafts: dict[int, dict[int, float]] | None = None  # B -> k -> seconds of D_B(k); None: per row
    overhead: LoopOverhead | None = None  # None: batch 1's, per row (LoopOverhead.per_row)
    spreads: dict[int, float] | None = None  # B -> the largest interquartile range / median of its timings

    def spread(self, rows: int) -> float:
        """The spread of the timings that price a step over `rows` rows: batch 1's costs' own, and above
        it also the largest among the measured batch sizes around `rows` (eval/timing.py)."""
        if rows == 1 or not self.spreads:
            return self.per_row.spread
        sizes = sorted(self.spreads)
        lo = max([b for b in sizes if b <= rows], default=sizes[0])
        hi = min([b for b in sizes if b >= rows], default=sizes[-1])
        return max(self.spreads[lo], self.spreads[hi], self.per_row.spread)

    def target(self, rows: int, n: int) -> float:
        """T_B(n): batch 1's forward as real decodes met it; above, the micro-timed forward (linear
        between measured counts and batch sizes) scaled by `target_scale`."""
        if rows == 1:
            return self.per_row.target(n)
        return between_sizes(self.forwards, rows, n) * self.target_scale

    @cached_property
    def target_scale(self) -> float:
        """How batch-1 forwards inside real decodes compare with their micro-timing: one factor, the
        median over the timed counts. Not one per count: a count whose micro-timing drew badly must
        not reprice that count alone at every batch size (it once made k = 2 look 2.4x at batch 8)."""
        return median_ratio({n: self.per_row.target(n) for n in self.forwards[1]}, self.forwards[1])

    def draft(self, rows: int, k: int) -> float:
        """D_B(k): batch 1's drafting in real decodes; above, the grouped drafter step micro-timed and
        scaled by one factor as `target` (or B times batch 1's drafting per row for a head that does
        not group)."""
        if rows == 1 or self.drafts is None:
            return rows * self._own_draft(k)
        return between_sizes(self.drafts, rows, k) * self.draft_scale

    @cached_property
    def draft_scale(self) -> float:
        """As `target_scale`, for the grouped drafter step (median over the timed k)."""
        return median_ratio({j: self._own_draft(j) for j in self.drafts[1]}, self.drafts[1])

    def _own_draft(self, k: int) -> float:
        return self.per_row.draft_fixed_s + k * self.per_row.draft_per_level_s

    @property
    def loop(self) -> LoopOverhead:
        return self.overhead or LoopOverhead.per_row(self.per_row)

    def plain_step(self, rows: int) -> float:
        return self.target(rows, 1) + self.loop.plain(rows)

    def spec_step(self, rows: int, k: int) -> float:
        return self.target(rows, k + 1) + self.draft(rows, k) + self.loop.spec(rows)

    def speedup(self, rows: int, k: int, tokens_per_step: float) -> float:
        """Full batches in steady state (every row decoding every step)."""
        return tokens_per_step * self.plain_step(rows) / self.spec_step(rows, k)

    def workload_speedup(self, rows: int, k: int, plain_steps: list[int], spec_steps: list[int]) -> float:
        """Requests that need plain_steps[i] / spec_steps[i] decode forwards each (their batch-1 decodes),
        continuously batched into `rows` slots: the batch thins out as requests run out."""
        plain = continuous_seconds(plain_steps, rows, self.plain_step)
        return plain / continuous_seconds(spec_steps, rows, lambda b: self.spec_step(b, k))

    def to_dict(self) -> dict:
        return {"forwards_s": as_json(self.forwards), "drafts_s": as_json(self.drafts) if self.drafts else None,
                "drafter": "grouped" if self.drafts else "per row", "loop_overhead": self.loop.to_dict(),
                "per_row": self.per_row.to_dict(),
                "spreads": {str(b): x for b, x in sorted((self.spreads or {}).items())}}


def median_ratio(real: dict[int, float], micro: dict[int, float]) -> float:
    """Median of real[x] / micro[x] over the points both have (1.0 when none)."""
    ratios = [real[x] / s for x, s in micro.items() if s > 0 and x in real]
    return statistics.median(ratios) if ratios else 1.0


def as_json(table: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
    return {str(b): {str(n): s for n, s in f.items()} for b, f in table.items()}


def batch_costs(session, prompts: list[list[int]], per_row: StepCosts, batch_sizes=BATCH_SIZES,
                reps: int = 5) -> BatchCosts:
    """Every part of `BatchCosts` measured for the session's target and drafter (drafts of 1 ..
    max(4, k) timed; the loop's growth per row between 1 and the largest batch size)."""
    target, k_max = session.target, max(4, session.k)
    forwards = batch_forward_timings(target, prompts[0], batch_sizes, reps=reps)
    ctx = target.context or 1 << 30
    long_enough = [p for p in prompts if k_max + 4 <= len(p) <= ctx]
    drafts = batch_draft_timings(target, session.head, long_enough[0], batch_sizes, range(1, k_max + 1),
                                 reps) if long_enough else None
    growth = time_loop_overhead(session, prompts, max(batch_sizes))
    spreads = {b: largest_spread(forwards[b], (drafts or {}).get(b, {})) for b in forwards}
    return BatchCosts(table_medians(forwards), per_row, table_medians(drafts) if drafts else None,
                      LoopOverhead.growing(per_row, *growth) if growth else None, spreads)


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
    """Per batch size: the predicted speed-up of each chain length k, the top k (near ties go to the
    shorter k, as `predict.advice`), the band the timings' spread allows around the top speed-up and
    its `predict.verdict`; the best k is the top k, or 0 (plain decoding) only when the verdict is
    "off" (no gain of MIN_GAIN anywhere in the band)."""
    rows = []
    for b in sorted(costs.forwards):
        by_k = {k: costs.speedup(b, k, expected_tokens_chain(cond, k)) for k in ks}
        top = max(by_k.values())
        on = min(k for k, s in by_k.items() if s >= top - NEAR_TIE)
        band = speedup_range(top, costs.spread(b))
        call = verdict(top, band["speedup_low"], band["speedup_high"])
        best = on if call != "off" else 0
        rows.append({"batch_size": b, "speedup_by_k": {str(k): s for k, s in by_k.items()},
                     "best_k": best, "best_speedup": by_k[best] if best else 1.0, "top_k": on,
                     "top_speedup": top, "speedup_low": band["speedup_low"], "speedup_high": band["speedup_high"],
                     "verdict": call})
    return rows


def trust_confirmed(rows: list[dict], confirmed: set[int]) -> list[dict]:
    """Uncertain bands at batch sizes whose prediction this run's measurement confirmed (within 10% at
    the measured k) decided again without the micro-timings' spread: the model held there, so a wide
    band from noisy micro-timings does not keep speculation on against it."""
    out = []
    for row in rows:
        if row.get("verdict") == "uncertain" and row["batch_size"] in confirmed:
            call = verdict(row["top_speedup"], row["top_speedup"], row["top_speedup"])
            row = {**row, "verdict": call, "confirmed": True,
                   **({"best_k": 0, "best_speedup": 1.0} if call == "off" else {})}
        out.append(row)
    return out


def keep_measured(rows: list[dict], measured: dict[int, tuple[int, float]]) -> list[dict]:
    """`predict_by_batch` rows where this run also measured speculation: a band the prediction turns
    off while this run measured speculative decoding faster than plain there (measured[B] = (k,
    speed-up)) keeps that k, saying so ("kept_on"): never advise turning speculation off where the
    same run just measured a speed-up."""
    out = []
    for row in rows:
        k, speedup = measured.get(row["batch_size"], (0, 0.0))
        if row["best_k"] == 0 and k and speedup > 1.0:
            row = {**row, "best_k": k, "best_speedup": speedup, "verdict": "uncertain",
                   "kept_on": f"measured {speedup:.2f}x at k={k} in this run against a predicted "
                              f"{row['top_speedup']:.2f}x at best: speculation kept on"}
        out.append(row)
    return out


def concurrency_advice(session, prompts: list[list[int]], per_row: StepCosts, cond: list[float],
                       batch_sizes=BATCH_SIZES, reps: int = 3) -> dict:
    """eval's advice by concurrency: the best k at each batch size, predicted from the step's parts
    timed over B rows here (`batch_costs`) and eval's batch-1 costs, and vLLM's schedule of it."""
    costs = batch_costs(session, prompts, per_row, batch_sizes, reps)
    rows = predict_by_batch(costs, cond)
    return {"rows": [{k: v for k, v in r.items() if k != "speedup_by_k"} for r in rows],
            "vllm_num_speculative_tokens_per_batch_size": vllm_schedule(rows), "drafter": costs.to_dict()["drafter"]}


def timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def decode_pair(session, prompts: list[list[int]], max_new_tokens: int, rows: int, drafter_first: bool) -> dict:
    """The prompts decoded plainly and with the drafter at batch size `rows`, in the order asked ->
    {"plain": results, "plain_s": wall seconds, "spec": results, "spec_s": wall seconds}."""
    out = {}
    for drafted in ((True, False) if drafter_first else (False, True)):
        results, seconds = timed(lambda d=drafted: session.decode_many(prompts, max_new_tokens, batch_size=rows,
                                                                       drafted=d))
        key = "spec" if drafted else "plain"
        out[key], out[f"{key}_s"] = results, seconds
    return out


def decode_speedup(pair: dict) -> float:
    """A `decode_pair`'s decode-step speed-up (each wall less its prefill phase)."""
    plain = pair["plain_s"] - prefill_seconds(DecodeStats.total(pair["plain"]))
    return plain / (pair["spec_s"] - prefill_seconds(DecodeStats.total(pair["spec"])))


def measured_row(rows: int, pairs: list[dict]) -> dict:
    """One batch size's measured row from its rounds of `decode_pair`: seconds added up over the rounds,
    each round's decode-step speed-up kept (`rounds`) and their spread (max / min - 1)."""
    plain, spec = (DecodeStats.total([r for p in pairs for r in p[key]]) for key in ("plain", "spec"))
    plain_s, spec_s = sum(p["plain_s"] for p in pairs), sum(p["spec_s"] for p in pairs)
    plain_decode_s, spec_decode_s = plain_s - prefill_seconds(plain), spec_s - prefill_seconds(spec)
    each = [decode_speedup(p) for p in pairs]
    first = pairs[0]
    return {"batch_size": rows, "prompts": len(first["plain"]), "tokens": plain.tokens // len(pairs),
            "plain_tok_s": plain.tokens / plain_s, "spec_tok_s": spec.tokens / spec_s,
            "plain_s": plain_s, "spec_s": spec_s, "plain_decode_s": plain_decode_s,
            "spec_decode_s": spec_decode_s, "measured_speedup": plain_decode_s / spec_decode_s,
            "measured_speedup_wall": plain_s / spec_s, "measured_rounds": each,
            "measured_spread": max(each) / min(each) - 1, "tau": spec.summary()["tau"],
            "greedy_equal": min(sum(s.tokens == q.tokens for s, q in zip(p["spec"], p["plain"])) for p in pairs)}


def measure_by_batch(session, prompts: list[list[int]], max_new_tokens: int,
                     batch_sizes=BATCH_SIZES, rounds: int = 2) -> tuple[list[dict], dict, dict]:
    """Plain and speculative throughput of `prompts` decoded at each batch size (continuous
    batching over all of them), whether every speculative output equals the plain one -> (rows,
    {B: (plain stats, speculative stats)}, {B: (each request's plain / speculative decode forwards)}).

    Interleaved over `rounds` rounds (eval/timing.py's reason): every batch size in each round, in
    reverse order and the drafter first every other round, so a burst of load on a shared machine
    lands on both methods and on more than one size; the seconds are added up over the rounds."""
    if rounds < 1:
        raise PredictError(f"measure_by_batch needs rounds >= 1, got {rounds}")
    pairs: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    for r in range(rounds):
        for b in (batch_sizes if r % 2 == 0 else batch_sizes[::-1]):
            pairs[b].append(decode_pair(session, prompts, max_new_tokens, b, drafter_first=r % 2 == 1))
    rows = [measured_row(b, pairs[b]) for b in batch_sizes]
    stats = {b: (DecodeStats.total([x for p in pairs[b] for x in p["plain"]]),
                 DecodeStats.total([x for p in pairs[b] for x in p["spec"]])) for b in batch_sizes}
    steps = {b: ([x.stats.decode_forwards for x in pairs[b][0]["plain"]],
                 [x.stats.decode_forwards for x in pairs[b][0]["spec"]]) for b in batch_sizes}
    return rows, stats, steps


def prefill_seconds(stats: DecodeStats) -> float:
    """The prefill phase of decodes: the target's prompt forwards and the proposers' starts. Both
    passes pay the target's alike, and a batch of 32 long prompts spends most of its wall time
    there, which pulls the wall speed-up towards 1 whatever speculation does; the decode steps are
    what the model prices (and what vLLM's per-batch-size k acts on)."""
    return stats.target_prefill_s + stats.proposer_start_s


def concurrency_table(session, prompts: list[list[int]], max_new_tokens: int, batch_sizes=BATCH_SIZES,
                      reps: int = 5, rounds: int = 2) -> dict:
    """Measured rows at each batch size beside the prediction for the session's k, and the predicted
    best k per size. Per-row costs: micro-timed, corrected by the batch-1 decodes of this run
    (`mixes.in_situ_costs`, as eval does); each request's forwards at batch 1 give the workload that
    `continuous_seconds` schedules at every size, so the batch-1 row checks the cost model on its
    own decodes and every larger batch is a prediction from the parts timed over B rows
    (`batch_costs`) and batch-1 counts alone. The best k per size never turns speculation off at a size
    where these decodes measured it faster (`keep_measured`), and a size whose prediction they confirmed
    is decided without the micro-timings' spread (`trust_confirmed`); `rounds`: `measure_by_batch`'s."""
    if 1 not in batch_sizes:
        raise PredictError("the concurrency table needs batch size 1 (it prices the per-row costs)")
    measured, stats, steps = measure_by_batch(session, prompts, max_new_tokens, batch_sizes, rounds)
    plain1, spec1 = stats[1]
    per_row = in_situ_costs(measure_costs(session.target, session.head, prompts[:4], k_max=max(session.k, 2)),
                            plain1, spec1)
    costs = batch_costs(session, prompts, per_row, batch_sizes, reps)
    for row in measured:
        row["predicted_speedup"] = costs.workload_speedup(row["batch_size"], session.k, *steps[1])
        row["predicted_speedup_full_batches"] = costs.speedup(row["batch_size"], session.k, row["tau"])
        row["within_10pct"] = abs(row["predicted_speedup"] / row["measured_speedup"] - 1) <= WITHIN
    best = trust_confirmed(predict_by_batch(costs, spec1.summary()["acceptance_per_position_conditional"]),
                           {r["batch_size"] for r in measured if r["within_10pct"]})
    best = keep_measured(best, {r["batch_size"]: (session.k, r["measured_speedup"]) for r in measured})
    return {"k": session.k, "max_new_tokens": max_new_tokens, "rounds": rounds, "rows": measured, "best_k": best,
            "vllm_num_speculative_tokens_per_batch_size": vllm_schedule(best), "costs": costs.to_dict()}


def measured_text(r: dict) -> str:
    """A row's measured decode-step speed-up, with its rounds' range when there were several."""
    rounds = r.get("measured_rounds") or []
    each = f" ({min(rounds):.2f}-{max(rounds):.2f}x)" if len(rounds) > 1 else ""
    return f"{r['measured_speedup']:.2f}x{each}"


def best_text(b: dict) -> str:
    """A band's best k and its speed-up, marked as `report.band_mark` marks it."""
    return f"{b['best_k']} ({b['best_speedup']:.2f}x{band_mark(b)})" if b else "-"


def markdown(table: dict, schedule: bool = True) -> str:
    """The speed-up-by-concurrency table: plain vs speculative tokens/s, measured and predicted
    (`schedule`: with vLLM's per-batch-size line; the demo prints its one recommendation instead)."""
    rounds = table.get("rounds", 1)
    lines = [f"| batch | plain tok/s | speculative tok/s (k = {table['k']}) | measured, wall | measured, decode steps "
             "| predicted, decode steps | within 10% | greedy-equal | best k (predicted) |",
             "|---:|---:|---:|---:|---:|---:|:-:|---:|---:|"]
    best = {r["batch_size"]: r for r in table["best_k"]}
    for r in table["rows"]:
        wall = r.get("measured_speedup_wall")
        lines.append(f"| {r['batch_size']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
                     f"| {'-' if wall is None else f'{wall:.2f}x'} | {measured_text(r)} "
                     f"| {r['predicted_speedup']:.2f}x | {'yes' if r['within_10pct'] else 'no'} "
                     f"| {r['greedy_equal']}/{r['prompts']} | {best_text(best.get(r['batch_size'], {}))} |")
    lines.append("")
    lines.append("tok/s and the wall speed-up count the whole run (prefill included); the decode-step speed-up "
                 "leaves out the prefill phase (the target's prompt forwards and the proposers' starts), which "
                 "the prediction prices and speculation does not change."
                 + (f" Measured over {rounds} interleaved rounds (in brackets: the rounds' range)." if rounds > 1 else ""))
    lines += band_notes(table["best_k"])
    if schedule:
        lines.append(f"vLLM: `\"num_speculative_tokens_per_batch_size\": {table['vllm_num_speculative_tokens_per_batch_size']}`"
                     " in `--speculative-config` (k 0: speculation off at that size).")
    drafter = table.get("costs", {}).get("drafter")
    if drafter:
        how = ("one draft group over B rows, timed per batch size" if drafter == "grouped"
               else "per row, batch 1's cost times B")
        lines.append(f"Predicted: spec_step(B, k) = T_B(k + 1) + D_B(k) + o_step + B * o_row; the drafter D_B: {how}.")
    return "\n".join(lines) + "\n"
