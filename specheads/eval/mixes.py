"""The drafter combined with a free proposer in eval: rows "hybrid" (choose per step), "union" (both
drafts in one tree) and "adaptive" (adaptive draft length over the drafter and the free draft),
their predicted speed-ups, and the best setting per engine in the engine's own words.

The free proposer is suffix decoding (vLLM's `method: suffix`) when arctic-inference is installed,
else prompt lookup (the row says so). The rows are decoded in a second pass over the turns, after
the first pass measured the calibration records and the step costs the adaptive rule needs; each
turn is decoded plainly again beside them, so a measured speed-up compares decodes run side by
side. The adaptive rule of a turn uses the calibration fitted on the other fold of turns. A sampled
eval decodes the rows (and their plain pass) with its sampling settings and seed; a tree eval runs
the rows the combined proposers build over a tree (`mix_rows`: the union) and names why not the others.

Prediction of a row (`row_speedup`): its measured mix of steps (steps per verified-token count)
priced by the measured step costs: the target's seconds per verified-token count as the first
pass's decodes of the row's own family met them (`RowCosts`: a row that runs the drafter by the
drafter's decodes, whose target forwards follow a drafter forward and run slower than plain or free
ones at the same count; a free row by the free proposers'; micro-timed, scaled, where they met none)
and the loop's overhead per step, plus the row's own proposer seconds (drafter forwards, free
lookups and the adaptive rule's decisions, as the row spent them: pricing its model levels at the
drafter-only row's rates left out the adaptive rule's own work and over-predicted that row), against
plain steps for the same tokens. No cost is assumed flat. Every second of one prediction is in one
time base (`time_base`): the row's seconds come from the pass that decoded it, the costs from the
first pass, so the row's are first put in plain target forwards of their own pass (its plain decodes,
interleaved with the row's) and then in the costs' seconds. A transient that slows one pass as a
whole (the first pass of a demo run ran 20% slower than its timed pass and the model rows were
predicted up to 20% too fast) moves no prediction; what it cannot undo is a pass slowed unevenly,
which bends the cost curve's shape.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace

from specheads.engine_facts import DRAFTLESS, LLAMA_CPP, LLAMA_CPP_DRAFTLESS, LLAMA_CPP_MIXED, LLAMA_CPP_SPEC, SGLANG, VLLM
from specheads.eval.predict import StepCosts, monotone
from specheads.eval.report import FREE_NAMES
from specheads.eval.waves import Turn, blocks, turn_tally
from specheads.mixing import SETTINGS, Mixing, check_setting, mix_free, warm_free
from specheads.progress import Progress
from specheads.session import GREEDY, Session, run_request
from specheads.verify.adaptive_proposers import LengthCosts, loop_k
from specheads.verify.calibration import Calibration, Record, cross_fitted
from specheads.verify.loop import Request, decode_batch
from specheads.verify.settings import Sampling, TreeSpec
from specheads.verify.steps import DecodeStats
from specheads.verify.trees import SettingsError

log = logging.getLogger(__name__)

MIXES = ("hybrid", "union", "adaptive")
MIN_STEPS = 20  # steps of a verified-token count before its measured seconds replace the micro-timed


# --- costs and predictions -------------------------------------------------------------------------


def met_curve(costs: StepCosts, *decodes: DecodeStats) -> dict[int, float] | None:
    """Target seconds per verified-token count as `decodes` met them: the mean where >= MIN_STEPS steps
    met a count, elsewhere the micro-timed `costs` scaled by the ratio at the nearest met count (made
    monotone); None when they met no count that often."""
    steps, seconds = Counter(), Counter()
    for s in decodes:
        steps.update(s.steps_by_nodes)
        seconds.update(s.target_s_by_nodes)
    seen = {n: seconds[n] / steps[n] for n in steps if steps[n] >= MIN_STEPS and seconds[n] > 0}
    if not seen:
        return None
    counts = sorted(set(costs.target_s) | set(seen))
    near = [min(seen, key=lambda m, n=n: abs(m - n)) for n in counts]
    curve = [seen.get(n) or costs.target(n) * seen[m] / costs.target(m) for n, m in zip(counts, near)]
    return dict(zip(counts, monotone(curve)))


def in_situ_costs(costs: StepCosts, plain: DecodeStats, draft: DecodeStats, *others: DecodeStats) -> StepCosts:
    """The micro-timed `costs` corrected by the first pass's decodes: target seconds per verified-token
    count met by all of them (`met_curve`), the drafter's per-step part and the loop overhead of the
    draft's decodes, the plain step of the plain decodes."""
    curve = met_curve(costs, plain, draft, *others)
    if curve is None or not draft.decode_forwards or not plain.decode_forwards:
        return costs
    per_level = costs.draft_per_level_s
    fixed = max((draft.proposer_s - per_level * draft.proposed_tokens) / draft.decode_forwards, 0.0)
    rest = draft.wall_s - draft.target_prefill_s - draft.proposer_start_s - draft.target_decode_s - draft.proposer_s
    return StepCosts(curve, fixed, per_level, max(rest, 0.0) / draft.decode_forwards,
                     (plain.wall_s - plain.target_prefill_s) / plain.decode_forwards, spread=costs.spread)


def family(row: str) -> str:
    """Whose first-pass decodes price a row's target steps: "plain" plain's, "free" the free proposers'
    (a row of prompt lookup or suffix decoding alone), "model" the drafter's (any other row runs the
    drafter, whose forward between target forwards slows them: eagle3, hybrid, union, adaptive)."""
    if row == "plain":
        return "plain"
    return "free" if row in FREE_NAMES else "model"


@dataclass(frozen=True)
class RowCosts:
    """The first pass's step costs for each `family` of rows: `in_situ_costs` with the target curve of
    that family's own decodes (the blend where they met no count MIN_STEPS times); `plain` also sets
    every row's time base (`time_base`: a one-token forward of plain decoding in each pass)."""

    plain: StepCosts
    model: StepCosts
    free: StepCosts

    @classmethod
    def same(cls, costs: StepCosts) -> RowCosts:
        """One set of costs for every row (micro-timed only, or batched decodes: nothing per family)."""
        return cls(costs, costs, costs)

    def of(self, row: str) -> StepCosts:
        return getattr(self, family(row))

    def speedup(self, row: str, stats: DecodeStats, plain: DecodeStats | None, levels: int = 0,
                model_steps: int = 0, free_step_s: float = 0.0) -> float:
        """`row_speedup` of the row named `row` (a method kind or an eval row) by its family's costs."""
        return row_speedup(self.of(row), stats, plain, levels, model_steps, free_step_s, base=self.plain)

    def to_dict(self) -> dict:
        return {name: getattr(self, name).to_dict() for name in ("plain", "model", "free")}


def row_costs(costs: StepCosts, plain: DecodeStats, draft: DecodeStats, *free: DecodeStats) -> RowCosts:
    """`RowCosts` from the micro-timed `costs` and the first pass's plain, drafter and free decodes."""
    blended = in_situ_costs(costs, plain, draft, *free)
    if blended is costs:
        return RowCosts.same(costs)

    def own(*decodes: DecodeStats) -> StepCosts:
        curve = met_curve(costs, *decodes) if decodes else None
        return replace(blended, target_s=curve) if curve else blended

    return RowCosts(own(plain), own(draft), own(*free))


def time_base(costs: StepCosts, plain: DecodeStats | None) -> float:
    """Seconds in `costs`' time base per second of the pass whose plain decodes are `plain`: the ratio of
    one target forward over one token in each (the same operation, timed by the same clock); 1.0 when
    `plain` is None (the caller's seconds are the costs' own pass's, or batched: no batch-1 forward) or
    timed no forward."""
    if plain is None or not plain.decode_forwards or plain.target_decode_s <= 0:
        return 1.0
    return costs.target(1) * plain.decode_forwards / plain.target_decode_s


def pass_plain(plain: DecodeStats, batch_size: int) -> DecodeStats | None:
    """The plain decodes that put a pass's seconds in the costs' time base (`time_base`); None above
    batch 1, where a forward's seconds are shared among its rows and no batch-1 forward was timed."""
    return plain if batch_size == 1 else None


def row_speedup(costs: StepCosts, stats: DecodeStats, plain: DecodeStats | None, levels: int = 0,
                model_steps: int = 0, free_step_s: float = 0.0, base: StepCosts | None = None) -> float:
    """Predicted speed-up of a decode's measured step mix (module docstring): the target's verified
    tokens priced by the cost curve plus the loop's overhead per step, and the proposer's own measured
    seconds when the decode has them (they hold what pricing levels would miss: a merged catch-up,
    the adaptive rule's decisions) put in the costs' time base by `plain`, the plain decodes of the
    pass that decoded `stats` (`time_base` of `base`, default `costs`), else its model levels, drafted
    steps and free lookups priced by the costs."""
    seconds = sum(c * costs.target(n) for n, c in stats.steps_by_nodes.items())
    seconds += stats.decode_forwards * costs.overhead_s
    if stats.proposer_s > 0:
        seconds += stats.proposer_s * time_base(base or costs, plain)
    else:
        seconds += levels * costs.draft_per_level_s + model_steps * costs.draft_fixed_s + stats.decode_forwards * free_step_s
    return stats.decode_tokens * costs.plain() / seconds if seconds else 0.0


def free_step_seconds(stats: DecodeStats) -> float:
    """A free proposer's measured seconds per decode step (propose + accept)."""
    return stats.proposer_s / stats.decode_forwards if stats.decode_forwards else 0.0


# --- the rows ------------------------------------------------------------------------------------


@dataclass
class MixTally:
    """One row's decodes summed over turns, and the proposers' step mix."""

    stats: DecodeStats = field(default_factory=DecodeStats)
    steps: Counter = field(default_factory=Counter)
    levels: int = 0
    model_steps: int = 0
    mismatches: list[str] = field(default_factory=list)
    per_turn: list[dict] = field(default_factory=list)  # turn_tally of each turn, in order (per-category tables)

    def count(self, stats: DecodeStats) -> None:
        """One turn's decode into the sums and the per-turn list."""
        self.stats = self.stats.add(stats)
        self.per_turn.append(turn_tally(stats))

    def add(self, proposer, result, plain_tokens: list[int] | None, row_id: str) -> None:
        """One turn's decode by the row's proposer; `plain_tokens` None: sampled, no equality to check."""
        self.count(result.stats)
        summary = proposer.summary()
        self.steps.update(summary["steps"])
        self.levels += summary.get("levels", 0)
        self.model_steps += summary.get("model_steps", 0)
        if plain_tokens is not None and result.tokens != plain_tokens and row_id not in self.mismatches:
            self.mismatches.append(row_id)


def mix_rows(chain: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """The rows of MIXES the combined proposers build for the draft shape (`chain` or a tree), and
    for each other row why not (the refusal `--hybrid` / `--adaptive` give for the same setting)."""
    rows, skipped = [], {}
    for name in MIXES:
        try:
            check_setting(*SETTINGS[name], chain)
            rows.append(name)
        except SettingsError as err:
            skipped[name] = f"not run with a tree draft: {err}"
    return tuple(rows), skipped


def check_asked_rows(asked: tuple[str, ...], predict: bool, chain: bool) -> None:
    """Rows narrowed with --mix-rows that will not run are said before decoding: refused when none of
    them can (--no-predict decodes no hybrid row; a tree draft builds no chain row), else a warning
    on the terminal for each one skipped (report.md says why too)."""
    unknown = [r for r in asked if r not in MIXES]
    if unknown:
        raise ValueError(f"--mix-rows {','.join(unknown)}: expected rows from {', '.join(MIXES)}")
    if set(asked) == set(MIXES):
        return  # the default: every row the draft shape allows
    if not predict:
        raise ValueError(f"--mix-rows {','.join(asked)} asks for hybrid rows, but --no-predict decodes none: "
                         "drop --no-predict to decode them, or --mix-rows")
    _, skipped = mix_rows(chain)
    dropped = [r for r in asked if r in skipped]
    if dropped and len(dropped) == len(asked):
        raise ValueError(f"--mix-rows {','.join(asked)}: {skipped[dropped[0]]}")
    for row in dropped:
        log.warning("--mix-rows %s: %s (the other rows asked run)", row, skipped[row])


def mix_proposer(name: str, session: Session, free, calibration: Calibration, costs: LengthCosts, k_max: int,
                 sampled: bool = False, free_k_max: int | None = None):
    """A fresh proposer of a row over the session's drafter (the free proposer is the row's, kept across
    turns), built as `Session.proposer` builds a mixed one (`sampled`: drafts for sampled decoding)."""
    mode, adaptive = SETTINGS[name]
    mixing = Mixing(mode, adaptive, calibration, costs, k_max, free_k_max=free_k_max)
    model = session.proposer(sampled=sampled or adaptive)
    return mixing.proposer(model, free, session.k, session.target.vocab_size if sampled else None)


def mix_requests(name: str, session: Session, free, turns: list[Turn], calibrations: dict[int, Calibration],
                 cond: list[float], lengths: LengthCosts, k_max: int, max_new_tokens: int,
                 sampling: Sampling = GREEDY, free_k_max: int | None = None) -> tuple[list, list[Request]]:
    """A row's proposer and request per turn (the adaptive rule with its turn's other-fold calibration;
    the free proposer forked per request: one global cache per row, a request per turn), decoded with
    `sampling` (its seed for every request, as the first pass's rows)."""
    adaptive = SETTINGS[name][1]  # eval's adaptive row always has the free draft beside the drafter
    loop = TreeSpec("chain", k=loop_k(k_max, free_k_max) if adaptive else session.k)  # trees: the proposer decides
    proposers = [mix_proposer(name, session, free.fork(), calibrations.get(turn.fold, Calibration(position_rates=list(cond))),
                              lengths, k_max, not sampling.greedy, free_k_max) for turn in turns]
    return proposers, [run_request(loop, session.target, p, turn.ids, max_new_tokens, session.eos, sampling)
                       for p, turn in zip(proposers, turns)]


def evaluate_mixes(session: Session, turns: list[Turn], max_new_tokens: int, costs: StepCosts, records: list[Record],
                   cond: list[float], k_max: int, quiet: bool = True, batch_size: int = 1,
                   sampling: Sampling = GREEDY, names: tuple[str, ...] = MIXES, free_k_max: int | None = None,
                   history: list | None = None) -> tuple[MixTally, dict[str, MixTally], str, str | None]:
    """Decode every turn plainly and with each row of `names`, `batch_size` sequences per target forward
    (at batch size 1 a turn at a time, else each method over all turns at once), greedily or sampled
    with `sampling` -> (the plain decodes, the rows' tallies, the free proposer's name, why it is not
    suffix decoding). `free_k_max`: the adaptive row's longest free draft (None: k_max); `history`:
    (prompt, answer) ids put in each row's suffix cache first."""
    free_name, make_free, note = mix_free()
    frees = {name: make_free() for name in names}  # one global cache per row, across its turns
    for free in frees.values():
        warm_free(free, history or [])
    calibrations = cross_fitted(records, cond) if records else {}
    lengths = LengthCosts.from_step_costs(costs, loop_k(k_max, free_k_max))
    plain, tallies = MixTally(), {name: MixTally() for name in names}  # plain: this pass's own baseline
    with Progress(len(turns) * (1 + len(names)), f"eval: hybrid rows ({len(turns)} prompt turns x {1 + len(names)} "
                  "methods)", "decodes", quiet=quiet) as bar:
        for block in blocks(turns, batch_size):
            for result in session.decode_many([t.ids for t in block], max_new_tokens, sampling, batch_size,
                                              drafted=False):
                plain.count(result.stats)
            bar.update(len(block))
            for name in names:
                proposers, reqs = mix_requests(name, session, frees[name], block, calibrations, cond, lengths, k_max,
                                               max_new_tokens, sampling, free_k_max)
                for turn, proposer, result in zip(block, proposers, decode_batch(session.target, reqs, batch_size)):
                    tallies[name].add(proposer, result, turn.plain_tokens if sampling.greedy else None, turn.id)
                bar.update(len(block))
    return plain, tallies, free_name, note


def mix_metrics(tallies: dict[str, MixTally], plain: DecodeStats, costs: RowCosts, free_name: str,
                note: str | None, free_stats: DecodeStats | None, greedy: bool = True, batch_size: int = 1) -> dict:
    """metrics.json's rows "hybrid", "union", "adaptive": tau, measured and predicted speed-up, the
    step mix (steps per verified draft, model draft levels) and whether the output is plain's (None
    when sampled: samples need not agree); `plain`: the decodes beside the rows, at `batch_size`;
    `costs`: the first pass's, per row family."""
    free_s = free_step_seconds(free_stats) if free_stats is not None else 0.0
    unit = pass_plain(plain, batch_size)
    rows = {}
    for name, t in tallies.items():
        rows[name] = {
            **t.stats.summary(), "free": free_name, "free_note": note,
            "measured_speedup": plain.wall_s / t.stats.wall_s if t.stats.wall_s else 0.0,
            "predicted_speedup": costs.speedup(name, t.stats, unit, t.levels, t.model_steps, free_s),
            "predicted_speedup_model": "measured step mix priced by measured step costs",
            "steps_per_draft": dict(t.steps), "model_levels": t.levels, "model_steps": t.model_steps,
            "greedy_equal": not t.mismatches if greedy else None, "mismatched_ids": t.mismatches,
            "new_tokens": t.stats.tokens, "wall_s": t.stats.wall_s, "plain_wall_s": plain.wall_s,
        }
    return rows


def engine_advice(metrics: dict, kind: str, fmt: str) -> dict:
    """The best setting per engine, in the engine's words: vLLM's `method: suffix` or the drafter,
    SGLang's NGRAM or the drafter (whichever predicts faster), llama.cpp's mixing of a draftless
    type with the draft, and specheads' own verifier: the fastest predicted of the drafter alone,
    hybrid, union and adaptive (what `specheads serve` / `generate` pick by default)."""
    drafter = float(metrics.get("predicted_speedup") or 0.0)
    out = {}
    for engine, (row, flags) in DRAFTLESS.items():
        free = (metrics.get(row) or {}).get("predicted_speedup")
        use_free = free is not None and free > drafter
        out[engine] = {"engine": VLLM if engine == "vllm" else SGLANG, "use": row if use_free else "drafter",
                       "flags": flags if use_free else None, "predicted_speedup": free if use_free else drafter,
                       "drafter_predicted": drafter, f"{row}_predicted": free}
    draft_type, draftless = LLAMA_CPP_SPEC.get((kind, fmt)), "{" + "|".join(LLAMA_CPP_DRAFTLESS) + "}"
    out["llama.cpp"] = {"engine": LLAMA_CPP.name, "use": "draftless + draft" if draft_type else "draftless",
                        "flags": LLAMA_CPP_MIXED.format(draftless=draftless, draft=draft_type) if draft_type
                        else f"--spec-type {draftless}",
                        "note": "llama.cpp mixes a draftless type with the draft model in one `--spec-type` comma "
                                "list (the draftless one first); not predicted here"}
    ours = {"drafter": drafter, **{m: metrics[m]["predicted_speedup"] for m in MIXES
                                   if (metrics.get(m) or {}).get("predicted_speedup") is not None}}
    best = max(ours, key=ours.get)
    out["specheads"] = {"use": best, "predicted_speedup": ours[best], "predicted": ours}
    return out

