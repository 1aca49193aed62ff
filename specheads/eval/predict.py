"""Speed-up prediction and serving advice from measured acceptance and measured step costs.

The seed formula (1 - a^(k+1)) / ((1 - a)(k c + 1)) assumes one i.i.d. acceptance rate and a
target forward whose cost does not depend on how many tokens it verifies. Here both are measured:

* acceptance per draft position, conditional (`cond[p]` = P(draft p+1 accepted | drafts 1..p
  accepted)); positions past the measured ones repeat the last measured value;
* the seconds of one target forward verifying n tokens (`StepCosts.target_s[n]`), the drafter's
  per-step cost (a fixed part plus a part per draft level) and the loop's own per-step overhead.

Expected tokens per step (bonus included) of a chain of k: 1 + sum_p prod_{j<=p} cond[j]. For a
tree, node (r_1..r_d) (sibling ranks along its path) is accepted with prob. prod_i q[i][r_i];
expected tokens = 1 + sum over nodes. q[d][r] is measured, teacher-forced, by the offline
acceptance pass (`rank_acceptance`: how often the target's token is the draft's rank-r candidate
at step d, over rows whose drafts 0..d-1 matched); a node under a rank>0 parent is assumed to
behave like one under the top-1 parent. Without a measurement no tree is predicted (there is no
assumed sibling acceptance). Speed-up = E * plain_step_s / step_s.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field

from specheads.engine_facts import sglang_tree_flags
from specheads.eval.timing import largest_spread, medians, round_robin
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec
from specheads.verify.steps import DecodeStats, new_cache, target_step, trim_cache

CHAIN_KS = tuple(range(1, 9))
TREE_BUDGETS = (8, 16, 32, 48, 64)  # verified tokens per step, root included (SGLang draft tokens)
# timing noise moves the arg-max between two evals of the same export: chains within NEAR_TIE of
# the top predicted speed-up count as tied and the shortest of them is recommended
NEAR_TIE = 0.03
# below 1 + MIN_GAIN (inside the timing noise, or slower) plain decoding is recommended
MIN_GAIN = 0.05


class PredictError(ValueError):
    """Prediction inputs that cannot give a number (the message says which and why)."""


@dataclass
class StepCosts:
    """Measured seconds of one decode step's parts (medians or totals / counts)."""

    target_s: dict[int, float]  # tokens verified by one target forward -> its seconds
    draft_fixed_s: float = 0.0  # drafter seconds per step not growing with depth (accept, setup)
    draft_per_level_s: float = 0.0  # drafter seconds per draft level (one head forward)
    overhead_s: float = 0.0  # loop bookkeeping per speculative step (masks, cache trimming)
    plain_step_s: float | None = None  # one plain decode step; default target(1)
    spread: float = 0.0  # the largest interquartile range / median of its micro-timed parts (eval/timing.py)

    def __post_init__(self):
        self.target_s = {int(n): float(s) for n, s in self.target_s.items()}
        if not self.target_s or min(self.target_s) < 1 or any(s <= 0 for s in self.target_s.values()):
            raise PredictError("StepCosts.target_s needs positive seconds for token counts >= 1")

    def target(self, n: int) -> float:
        """Seconds of a target forward over n tokens: linear between measured counts, linear beyond."""
        pts = sorted(self.target_s.items())
        if len(pts) == 1:
            return pts[0][1]
        if n <= pts[0][0]:
            (n0, s0), (n1, s1) = pts[0], pts[1]
        elif n >= pts[-1][0]:
            (n0, s0), (n1, s1) = pts[-2], pts[-1]
        else:
            i = next(i for i, (m, _) in enumerate(pts) if m >= n)
            (n0, s0), (n1, s1) = pts[i - 1], pts[i]
        return max(s0 + (s1 - s0) * (n - n0) / (n1 - n0), min(s0, s1) * 0.5)

    def plain(self) -> float:
        return self.plain_step_s if self.plain_step_s else self.target(1)

    def step(self, nodes: int, levels: int) -> float:
        """One speculative step verifying `nodes` tokens drafted in `levels` head forwards."""
        return self.target(nodes) + self.draft_fixed_s + self.draft_per_level_s * levels + self.overhead_s

    def to_dict(self) -> dict:
        return {**asdict(self), "target_s": {str(n): s for n, s in sorted(self.target_s.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        return cls(**{**d, "target_s": {int(n): s for n, s in d["target_s"].items()}})


# --- acceptance models -----------------------------------------------------------------------------


def extend(cond: list[float], depth: int) -> list[float]:
    """Conditional acceptance for positions 1..depth; unmeasured ones repeat the last measured."""
    cond = [min(max(float(c), 0.0), 1.0) for c in cond]
    if not cond:
        raise PredictError("no per-position acceptance measured: evaluate the head first")
    return (cond + [cond[-1]] * depth)[:depth]


def unconditional(cond: list[float]) -> list[float]:
    """P(drafts 1..p all accepted) per p from conditional acceptance."""
    return [math.prod(cond[: p + 1]) for p in range(len(cond))]


def expected_tokens_chain(cond: list[float], k: int) -> float:
    """Tokens per step of a chain of k drafts (bonus included): 1 + sum_p prod_{j<=p} cond[j]."""
    return 1.0 + sum(unconditional(extend(cond, k))) if k > 0 else 1.0


def rank_acceptance(measured: list[list[float]], depth: int) -> list[list[float]]:
    """q[d][r]: P(the draft's rank-r candidate at depth d+1 is accepted | its parent accepted),
    from measured per-rank rows (offline `rank_acceptance`); deeper rows repeat the last one.
    Ranks are kept in decreasing order (a measured inversion is sampling noise)."""
    if not measured or not measured[0]:
        raise PredictError("no per-rank acceptance measured: run the offline acceptance pass first")
    rows = [monotone_down([min(max(float(v), 0.0), 1.0) for v in row]) for row in measured]
    return (rows + [rows[-1]] * depth)[:depth]


def monotone_down(values: list[float]) -> list[float]:
    """The closest non-increasing sequence (pool adjacent violators on the reversed list)."""
    return monotone(values[::-1])[::-1]


def expected_tokens_tree(choices, q: list[list[float]]) -> float:
    """1 + sum over the tree's nodes (rank paths) of prod_i q[i][r_i]; missing entries count 0."""
    total = 1.0
    for path in choices:
        p = 1.0
        for d, r in enumerate(path):
            p *= q[d][r] if d < len(q) and r < len(q[d]) else 0.0
        total += p
    return total


def best_tree(q: list[list[float]], budget: int) -> tuple[list[tuple[int, ...]], float]:
    """The `budget`-token tree (root included) with most expected tokens under q, and that number.

    Path probabilities only shrink along a path and across ranks, so taking the most probable
    frontier node budget-1 times (what EAGLE-2 does with draft confidence) is optimal here.
    """
    frontier = [(-q[0][0], (0,))] if q and q[0] else []
    chosen: list[tuple[int, ...]] = []
    total = 1.0
    while frontier and len(chosen) < budget - 1:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        total -= neg_p
        d, r = len(path) - 1, path[-1]
        if r + 1 < len(q[d]):  # next sibling
            heapq.heappush(frontier, (neg_p / q[d][r] * q[d][r + 1] if q[d][r] else 0.0,
                                      path[:-1] + (r + 1,)))
        if d + 1 < len(q):  # first child
            heapq.heappush(frontier, (neg_p * q[d + 1][0], path + (0,)))
    return chosen, total


# --- prediction and advice -------------------------------------------------------------------------


@dataclass
class Prediction:
    """Expected tokens per step and predicted speed-up per chain length and tree budget."""

    chains: list[dict] = field(default_factory=list)  # {k, expected_tokens, step_s, speedup}
    trees: list[dict] = field(default_factory=list)  # {budget, depth, top_k, expected_tokens, ...}
    cond_acceptance: list[float] = field(default_factory=list)
    costs: dict = field(default_factory=dict)
    rank_acceptance: list[list[float]] | None = None  # measured q[d][r]; None: no tree predicted

    def best_chain(self) -> dict:
        """The recommended chain: the shortest k predicted within NEAR_TIE of the top speed-up
        (stable across evals where near-equal lengths swap places by timing noise)."""
        top = max(r["speedup"] for r in self.chains)
        return min((r for r in self.chains if r["speedup"] >= top * (1 - NEAR_TIE)), key=lambda r: r["k"])

    def verdict(self) -> str:
        """`verdict` of the recommended chain: "on", "uncertain" or "off"."""
        best = self.best_chain()
        return verdict(best["speedup"], best.get("speedup_low", best["speedup"]), best.get("speedup_high", best["speedup"]))

    def speculate(self) -> bool:
        """Whether speculation is advised: the recommended chain is predicted to beat plain decoding by
        MIN_GAIN, or the spread of its timings reaches that far (uncertain: not a hard off)."""
        return self.verdict() != "off"

    def chain(self, k: int) -> dict | None:
        return next((r for r in self.chains if r["k"] == k), None)

    def best_tree(self) -> dict | None:
        return max(self.trees, key=lambda r: r["speedup"]) if self.trees else None

    def to_dict(self) -> dict:
        return {**asdict(self), "best_chain_k": self.best_chain()["k"], "speculate": self.speculate(),
                "verdict": self.verdict(),
                "near_tie": NEAR_TIE, "min_gain": MIN_GAIN,
                "best_tree_budget": (self.best_tree() or {}).get("budget")}


def speedup_range(speedup: float, spread: float) -> dict:
    """A predicted speed-up and the band its cost timings' spread allows: x / (1 + spread) .. x * (1 + spread)."""
    return {"speedup": speedup, "speedup_low": speedup / (1 + spread), "speedup_high": speedup * (1 + spread)}


def verdict(speedup: float, low: float, high: float) -> str:
    """"on": predicted to gain MIN_GAIN and at least plain's speed across the spread; "uncertain": the
    spread reaches across (predicted to gain but maybe slower than plain, or predicted not to gain but
    maybe gaining): say so, never a hard off; "off": no gain anywhere in the spread."""
    gain = 1 + MIN_GAIN
    if speedup >= gain:
        return "on" if low >= 1.0 else "uncertain"
    return "uncertain" if high >= gain else "off"


def uncertain_note(row: dict, where: str = "") -> str:
    """Why a prediction is uncertain, in words (the report and the terminal print it)."""
    return (f"uncertain{where}: predicted {row['speedup']:.2f}x, {row['speedup_low']:.2f}x to "
            f"{row['speedup_high']:.2f}x within the spread of the timed costs; measure it on your machine")


def predict(cond: list[float], costs: StepCosts, ks=CHAIN_KS, budgets=TREE_BUDGETS,
            max_depth: int = 8, rank_q: list[list[float]] | None = None) -> Prediction:
    """Predicted tokens per step and speed-up for chains of each k, and for the best tree per
    budget when the per-rank acceptance `rank_q` was measured."""
    if not ks:
        raise PredictError("predict needs at least one chain length k")
    plain = costs.plain()
    pred = Prediction(cond_acceptance=extend(cond, max(max(ks), max_depth)), costs=costs.to_dict(),
                      rank_acceptance=rank_q)
    for k in ks:
        e, step = expected_tokens_chain(cond, k), costs.step(k + 1, k)
        pred.chains.append({"k": k, "nodes": k + 1, "expected_tokens": e, "step_s": step,
                            **speedup_range(e * plain / step, costs.spread)})
    if not rank_q:
        return pred
    q = rank_acceptance(rank_q, max_depth)
    for n in budgets:
        paths, e = best_tree(q, n)
        depth = max(len(p) for p in paths) if paths else 0
        top_k = max(p[-1] for p in paths) + 1 if paths else 1
        step = costs.step(len(paths) + 1, depth)
        pred.trees.append({"budget": n, "depth": depth, "top_k": top_k, "expected_tokens": e,
                           "step_s": step, "speedup": e * plain / step,
                           "choices": [list(p) for p in paths]})
    return pred


def advice(pred: Prediction) -> dict:
    """Recommended vLLM / SGLang settings (the best chain), plus SGLang's best tree to try; or,
    when no chain is predicted to beat plain decoding by MIN_GAIN, no speculation (`speculate`).

    Tree predictions rest on teacher-forced per-rank acceptance and the chain's drafter cost per
    level, so a tree is offered to measure (bench/verifier.py), not recommended.
    """
    chain = pred.best_chain()
    if pred.verdict() == "off":
        return {"speculate": False,
                "best_chain": {"k": chain["k"], "predicted_speedup": chain["speedup"]},
                "reason": (f"no draft length is predicted to beat plain decoding by {MIN_GAIN:.0%} "
                           f"(best: k={chain['k']} at {chain['speedup']:.2f}x): serve the target "
                           "without speculation on this hardware")}
    out = chain_advice(chain)
    if pred.verdict() == "uncertain":
        out["uncertain"] = uncertain_note(chain)
    tree = pred.best_tree()
    if tree is not None and tree["speedup"] > max(chain["speedup"], 1 + MIN_GAIN):
        out["sglang_tree_to_try"] = {
            "speculative_num_steps": tree["depth"], "speculative_eagle_topk": tree["top_k"],
            "speculative_num_draft_tokens": tree["budget"], "predicted_speedup": tree["speedup"],
            "shape": "tree"}
    return out


def chain_advice(chain: dict) -> dict:
    """The vLLM and SGLang settings of speculating with a chain row of a `Prediction`."""
    return {
        "speculate": True,
        "vllm": {"num_speculative_tokens": chain["k"], "predicted_speedup": chain["speedup"],
                 "expected_tokens": chain["expected_tokens"]},
        "sglang": {"speculative_num_steps": chain["k"], "speculative_eagle_topk": 1,
                   "speculative_num_draft_tokens": chain["k"] + 1,
                   "predicted_speedup": chain["speedup"], "shape": "chain"},
    }


def advice_summary(adv: dict) -> str:
    """One line of what `advice` recommends (the terminal, the demo and the model card use it)."""
    if not adv.get("speculate", True):
        return f"no speculation: {adv['reason']}"
    v = adv["vllm"]
    line = (f"vLLM num_speculative_tokens={v['num_speculative_tokens']} (predicted "
            f"{v['predicted_speedup']:.2f}x); SGLang {sglang_flags(adv['sglang'])}")
    notes = [adv[key] for key in ("kept_on", "uncertain") if adv.get(key)]
    return line + "".join(f" [{n}]" for n in notes)


def sglang_flags(s: dict) -> str:
    """The SGLang command-line flags of an advice entry (`advice(...)["sglang"]`)."""
    return sglang_tree_flags(s["speculative_num_steps"], s["speculative_eagle_topk"], s["speculative_num_draft_tokens"])


# --- measuring the costs ---------------------------------------------------------------------------

TARGET_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64)


def monotone(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): timing noise never makes
    verifying more tokens look cheaper."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def target_forward_timings(target, prompt_ids: list[int], counts=TARGET_COUNTS, reps: int = 7) -> dict:
    """`Timing` of one cached target forward over n tokens after the prompt, per n (the counts
    interleaved, eval/timing.py)."""
    import torch

    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)[None]  # [1, P]
    ctx = target.context or 1 << 30
    past = ids.shape[1]
    counts = [n for n in counts if past + n <= ctx]
    if not counts:
        raise PredictError(f"the prompt ({past} tokens) leaves no room in the target's context")
    cache = new_cache(target)

    def call(n):
        def run():
            target_step(target, ids[:, -1:].repeat(1, n), past, cache)  # values do not change the cost
            trim_cache(cache, past)
        return run

    with torch.no_grad():
        target_step(target, ids, 0, cache)
        return round_robin({n: call(n) for n in counts}, reps, target.device)


def monotone_medians(timings: dict) -> dict[int, float]:
    """Median seconds per count, made non-decreasing in the count."""
    counts = sorted(timings)
    return dict(zip(counts, monotone([timings[n].median for n in counts])))


def time_target_forwards(target, prompt_ids: list[int], counts=TARGET_COUNTS, reps: int = 7) -> dict[int, float]:
    """Median seconds of one cached target forward over n tokens after the prompt, per n (made
    non-decreasing in n)."""
    return monotone_medians(target_forward_timings(target, prompt_ids, counts, reps))


def proposal_timings(target, head, prompt_ids: list[int], ks, reps: int = 7) -> dict:
    """`Timing` of the chain proposer's `propose(k)` per k (repeatable: it drops its speculative rows)."""
    import torch

    proposer = make_proposer(TreeSpec("chain", k=max(ks)), head, target)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)
    with torch.no_grad():
        out = target_step(target, ids[None], 0, new_cache(target), proposer.layers)
        proposer.start(ids, int(out.logits[0, -1].argmax()), out)
        return round_robin({k: (lambda k=k: proposer.propose(k)) for k in ks}, reps, target.device)


def line_fit(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope >= 0) of the least-squares line through {x: y}."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, max(slope, 0.0)


def time_proposals(target, head, prompt_ids: list[int], ks, reps: int = 7) -> tuple[float, float]:
    """(intercept, seconds per level) of a least-squares line through the chain proposer's
    median `propose(k)` seconds."""
    return line_fit(medians(proposal_timings(target, head, prompt_ids, ks, reps)))


def _per_step(stats, what: str) -> float:
    return getattr(stats, what) / stats.decode_forwards if stats.decode_forwards else 0.0


def _loop_overhead(stats) -> float:
    """Per-step seconds of a decode loop outside the target's and the proposer's timed calls."""
    rest = stats.wall_s - stats.target_prefill_s - stats.proposer_start_s - stats.target_decode_s - stats.proposer_s
    return max(rest, 0.0) / stats.decode_forwards if stats.decode_forwards else 0.0


def measure_costs(target, head, prompts: list[list[int]], k_max: int = 8, k_cal: int = 3,
                  max_new_tokens: int = 48, max_nodes: int = 64, reps: int = 7) -> StepCosts:
    """Target seconds per verified-token count and drafter seconds per level (micro-timed, medians,
    interleaved; `spread`: the largest interquartile range / median among them); the drafter's
    per-step remainder (accept) and the loop overhead from real decodes of `prompts` plainly and with
    a chain of k_cal, the two interleaved prompt by prompt."""
    if not prompts or k_max < 2:
        raise PredictError("measure_costs needs at least one prompt and k_max >= 2")
    forwards = target_forward_timings(target, prompts[0], [n for n in TARGET_COUNTS if n <= max_nodes], reps)
    proposals = proposal_timings(target, head, prompts[0], range(1, k_max + 1), reps)
    target_s, (_, per_level) = monotone_medians(forwards), line_fit(medians(proposals))
    plain, chain = DecodeStats(), DecodeStats()
    for ids in prompts:
        plain = plain.add(greedy_decode(target, ids, max_new_tokens).stats)
        proposer = make_proposer(TreeSpec("chain", k=k_cal), head, target)
        chain = chain.add(decode(target, proposer, ids, max_new_tokens, k_cal).stats)
    fixed = max(_per_step(chain, "proposer_s") - per_level * k_cal, 0.0)
    return StepCosts(target_s=target_s, draft_fixed_s=fixed, draft_per_level_s=per_level,
                     overhead_s=_loop_overhead(chain), plain_step_s=target_s[1] + _loop_overhead(plain),
                     spread=largest_spread(forwards, proposals))


def eval_costs(target, head, prompts: list[list[int]], k_max: int = 8,
               correct=None) -> tuple[StepCosts, StepCosts] | None:
    """(costs, micro-timed costs): `measure_costs` on up to 4 prompts that leave room in the context
    for the timed forwards (max(TARGET_COUNTS) tokens), then `correct(costs)` (eval: by its own
    decodes, `mixes.in_situ_costs`); None when no prompt leaves room. Greedy decodes time the steps
    of sampled evals too: a target forward's seconds do not depend on how its tokens are chosen."""
    ctx = target.context or 1 << 30
    prompts = [p for p in prompts if len(p) + max(TARGET_COUNTS) < ctx]
    if not prompts:
        return None
    micro = measure_costs(target, head, prompts[:4], k_max=k_max)
    return (correct(micro) if correct is not None else micro), micro


def prediction_metrics(target, head, prompts: list[list[int]], cond: list[float], k_max: int = 8,
                       rank_q: list[list[float]] | None = None, correct=None) -> dict:
    """metrics.json's `prediction` and `advice` from `eval_costs`' step costs; {} when no prompt
    leaves room for the timed forwards."""
    measured = eval_costs(target, head, prompts, k_max, correct)
    if measured is None:
        return {}
    costs, micro = measured
    pred = predict(cond, costs, ks=range(1, k_max + 1), rank_q=rank_q)
    return {"prediction": {**pred.to_dict(), "costs_micro": micro.to_dict()}, "advice": advice(pred)}


def simulated_tau(cond: list[float], ks=CHAIN_KS, budgets=TREE_BUDGETS,
                  rank_q: list[list[float]] | None = None) -> dict:
    """tau of a chain of each k from conditional acceptance, and of the best tree per budget from
    the measured per-rank acceptance (no trees without it)."""
    q = rank_acceptance(rank_q, max(ks)) if rank_q else None
    return {"chain": {str(k): expected_tokens_chain(cond, k) for k in ks},
            "tree": {str(n): best_tree(q, n)[1] for n in budgets} if q else {},
            "rank_acceptance": rank_q}
