"""Draft confidence vs acceptance: the records, the calibration map and its report numbers.

A record is one drafted position j whose earlier drafts were all accepted: the drafter's raw
confidence there (its top draft probability, or max q when sampling) and whether the target
accepted it. `Calibration` maps a raw confidence to P(accept j | drafts 1..j-1 accepted): a
non-decreasing step function over equal-width bins (pool adjacent violators, weighted by the
bins' counts), fitted on held-out records; drafters that report no confidence get the measured
conditional acceptance per position instead. The reliability table and the expected calibration
error (ECE) say how far raw (or calibrated) confidence is from the acceptance actually seen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from specheads.protocols import DraftAsk, GroupedProposer
from specheads.verify.draft_asks import split_step
from specheads.verify.sampling import warp

BINS = 10  # equal-width confidence bins of the map and the reliability table


@dataclass(frozen=True)
class Record:
    """One drafted position whose earlier drafts were accepted."""

    position: int  # 1-based draft position
    confidence: float  # raw top draft probability there
    accepted: bool
    fold: int = 0  # which held-out half it came from (cross-fitting)


def bin_of(p: float, bins: int = BINS) -> int:
    return min(max(int(p * bins), 0), bins - 1)


def pool_adjacent(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m1, w1, n1 = blocks.pop()
            m0, w0, n0 = blocks.pop()
            blocks.append([(m0 * w0 + m1 * w1) / (w0 + w1) if w0 + w1 else m1, w0 + w1, n0 + n1])
    return [m for m, _, n in blocks for _ in range(int(n))]


@dataclass
class Calibration:
    """Raw draft confidence -> P(accept | earlier drafts accepted), plus per-position rates."""

    bins: list[float] = field(default_factory=list)  # fitted acceptance per confidence bin ([] : none)
    counts: list[int] = field(default_factory=list)  # records behind each bin
    position_rates: list[float] = field(default_factory=list)  # measured conditional acceptance per position

    def __call__(self, confidence: float | None, position: int) -> float:
        """Calibrated acceptance of draft `position` (1-based) at a raw confidence (None: unknown)."""
        if confidence is not None and self.bins:
            return self.bins[bin_of(confidence, len(self.bins))]
        if self.position_rates:
            return self.position_rates[min(position, len(self.position_rates)) - 1]
        return 0.0

    @property
    def has_map(self) -> bool:
        return bool(self.bins)

    def ceiling(self) -> float:
        """The highest acceptance this calibration gives any position (what no draft can exceed)."""
        return max([*self.bins, *self.position_rates], default=0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> Calibration:
        unknown = set(d) - {"bins", "counts", "position_rates"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; expected bins, counts, position_rates")
        values = [float(v) for v in d.get("bins", [])] + [float(v) for v in d.get("position_rates", [])]
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"{where}: acceptance rates must lie in [0, 1]")
        return cls([float(v) for v in d.get("bins", [])], [int(c) for c in d.get("counts", [])],
                   [float(v) for v in d.get("position_rates", [])])


def fit_calibration(records: list[Record], position_rates: list[float] = (), bins: int = BINS,
                    prior: float = 1.0) -> Calibration:
    """A non-decreasing map over `bins` confidence bins from `records` (each filled bin shrunk towards
    the overall rate by `prior` pseudo-records, so a tiny bin is never 0 or 1 by chance)."""
    rates = [min(max(float(r), 0.0), 1.0) for r in position_rates]
    if not records:
        return Calibration([], [], rates)
    overall = sum(r.accepted for r in records) / len(records)
    hits, counts = [0] * bins, [0] * bins
    for r in records:
        b = bin_of(r.confidence, bins)
        counts[b] += 1
        hits[b] += int(r.accepted)
    seen = [b for b in range(bins) if counts[b]]
    fitted = pool_adjacent([(hits[b] + prior * overall) / (counts[b] + prior) for b in seen],
                           [counts[b] + prior for b in seen])
    by_bin = dict(zip(seen, fitted))
    # an empty bin takes its nearest filled neighbour below (above for the lowest): still non-decreasing
    values = [by_bin.get(b, by_bin[max((s for s in seen if s < b), default=seen[0])]) for b in range(bins)]
    return Calibration(values, counts, rates)


# --- report numbers ----------------------------------------------------------------------------


def reliability(records: list[Record], predict=None, bins: int = BINS) -> list[dict]:
    """Rows per non-empty bin of predicted probability (raw confidence, or `predict(record)`):
    mean predicted, observed acceptance rate, count."""
    sums = [[0.0, 0, 0] for _ in range(bins)]  # predicted sum, accepted, count
    for r in records:
        p = r.confidence if predict is None else predict(r)
        s = sums[bin_of(p, bins)]
        s[0] += p
        s[1] += int(r.accepted)
        s[2] += 1
    return [{"bin": [b / bins, (b + 1) / bins], "mean_predicted": s[0] / s[2], "observed": s[1] / s[2], "count": s[2]}
            for b, s in enumerate(sums) if s[2]]


def expected_calibration_error(table: list[dict]) -> float:
    """Count-weighted mean |mean predicted - observed| over the reliability table's bins."""
    n = sum(row["count"] for row in table)
    return sum(row["count"] * abs(row["mean_predicted"] - row["observed"]) for row in table) / n if n else math.nan


def cross_fitted(records: list[Record], position_rates: list[float]) -> dict[int, Calibration]:
    """fold -> the calibration fitted on the other folds' records (never on its own)."""
    folds = sorted({r.fold for r in records}) or [0, 1]
    return {f: fit_calibration([r for r in records if r.fold != f], position_rates) for f in folds}


def calibration_report(records: list[Record], position_rates: list[float]) -> dict:
    """metrics.json's "calibration": the raw confidence's reliability and ECE, the same for the
    cross-fitted map (each fold predicted by the map of the other), and the map fitted on all."""
    raw = reliability(records)
    maps = cross_fitted(records, position_rates)
    fitted = reliability(records, lambda r: maps[r.fold](r.confidence, r.position))
    return {"records": len(records), "accepted": sum(r.accepted for r in records),
            "ece_raw": expected_calibration_error(raw), "reliability_raw": raw,
            "ece_calibrated": expected_calibration_error(fitted), "reliability_calibrated": fitted,
            "map": fit_calibration(records, position_rates).to_dict(),
            "fit": "equal-width bins, pool adjacent violators, cross-fitted over 2 folds of turns"}


# --- collecting records --------------------------------------------------------------------------


class ConfidenceWarper:
    """A warper for a `SampledProposer` that also records each drafted position's confidence.

    `warper` None (greedy): the confidence is the top probability of the draft's softmax and the
    returned distribution is one-hot at its argmax (so the sampled draft is the greedy one);
    else the rule's warper, confidence = max q."""

    def __init__(self, warper=None):
        self.warper = warper
        self.seen: list[float] = []
        self.reported: float | None = None  # the drafter's own confidence for the next position

    def report(self, confidence: float) -> None:
        """A drafter with its own acceptance estimate (DSpark's confidence head) hands it in before the
        position is drawn; that position then records it instead of the top probability."""
        self.reported = float(confidence)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:  # logits [..., V] -> probs [..., V]
        if self.warper is None:
            top = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).amax(-1)
            probs = warp(logits, temperature=0.0)
        else:
            probs = self.warper(logits)
            top = probs.amax(-1)
        if self.reported is not None:
            self.seen.append(self.reported)
            self.reported = None
        else:
            self.seen.extend(float(t) for t in top.reshape(-1).tolist())
        return probs


def records_of_step(draft: list[int], confidences: list[float], emitted: list[int], fold: int) -> list[Record]:
    """Records of one verified chain: positions up to the first rejection, censored at the tokens
    the target settled (greedy: accepted iff equal to the settled token)."""
    out = []
    for j, (d, c, e) in enumerate(zip(draft, confidences, emitted), start=1):
        out.append(Record(j, c, d == e, fold))
        if d != e:
            break
    return out


class ConfidenceProbe:
    """A greedy chain proposer over a `SampledProposer` that keeps a `Record` of every settled draft
    position: it drafts the argmax chain through a one-hot `ConfidenceWarper` (the drafts are the
    greedy ones) and compares them with the tokens the target settled."""

    def __init__(self, inner, fold: int = 0):
        self.inner, self.layers, self.fold = inner, list(inner.layers), fold
        self.gen = torch.Generator().manual_seed(0)  # one-hot draws never depend on it
        self.records: list[Record] = []
        self.step: tuple[list[int], list[float]] = ([], [])
        self.conf: ConfidenceWarper | None = None  # this step's, from `begin_step`

    def start(self, prompt_ids, first_token, out) -> None:
        self.inner.start(prompt_ids, first_token, out)

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        return split_step(self, self.inner, k, None)[0]

    def begin_step(self, k: int, sampler) -> DraftAsk:
        """Ask the drafter for its chain through a one-hot `ConfidenceWarper` (`protocols.SplitProposer`):
        the greedy drafts, their confidences recorded as they are drawn, alone or in a draft group."""
        self.conf = ConfidenceWarper()
        return DraftAsk(k, (self.conf, self.gen))

    def end_step(self, tokens: torch.Tensor, q) -> tuple[torch.Tensor, None]:
        """The drafted chain [n] as a greedy draft; keeps it and its confidences for `accept`."""
        tokens = tokens.reshape(-1)
        self.step = ([int(t) for t in tokens.tolist()], self.conf.seen[: tokens.numel()])
        return tokens, None

    def group_drafter(self):
        """The inner drafter's group drafter (`protocols.GroupedProposer`), None if it has none."""
        return self.inner.group_drafter() if isinstance(self.inner, GroupedProposer) else None

    def accept(self, inputs, following, out, start: int) -> None:
        draft, confidences = self.step
        self.records += records_of_step(draft, confidences, [int(t) for t in following.reshape(-1).tolist()], self.fold)
        self.step = ([], [])
        self.inner.accept(inputs, following, out, start)
