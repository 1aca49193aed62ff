"""Adaptive draft length: the length choice (golden rates), k = 0 as exactly a plain decode,
greedy-equal with every drafter kind and with a free draft beside it, sampling losslessness
(chi-square, as in test_sampling) with a drafter that stops early and one cut afterwards, and the
calibration map and its report numbers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from random_models import make_target
from test_hybrid import ContextFree, stream
from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

from specheads.kinds import KINDS
from specheads.protocols import SampledProposer, StoppingProposer
from specheads.verify.adaptive_proposers import (
    AdaptiveProposer,
    LengthCosts,
    LengthRule,
    SampledAdaptiveProposer,
    adaptive_proposer,
    best_length,
    loop_k,
)
from specheads.verify.calibration import (
    Calibration,
    Record,
    calibration_report,
    expected_calibration_error,
    fit_calibration,
    records_of_step,
    reliability,
)
from specheads.verify.eagle3_proposers import SampledEagle3Proposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.ngram_proposers import NgramProposer
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec
from specheads.verify.suffix_proposers import SuffixProposer
from specheads.verify.trees import SettingsError

IDENTITY = Calibration(bins=[(b + 0.5) / 10 for b in range(10)], position_rates=[0.6, 0.5, 0.4])
CHEAP = LengthCosts(verify=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5), draft=0.05)
PROHIBITIVE = LengthCosts(verify=(1.0, 50.0, 60.0, 70.0, 80.0), draft=1.0)


# --- the length choice ---------------------------------------------------------------------------


def test_best_length_golden():
    """S = 0.9, 0.72, 0.25; v = 1, 1.1, 1.2, 1.3; c = 0.1: k=1 1.9/1.2 = 1.583, k=2 2.62/1.4 = 1.871,
    k=3 2.87/1.6 = 1.794 -> 2; a free draft (no levels): k=2 2.62/1.2 = 2.183 < k=3 2.87/1.3 = 2.208 -> 3."""
    costs = LengthCosts((1.0, 1.1, 1.2, 1.3), draft=0.1)
    k, rate = best_length([0.9, 0.72, 0.25], costs, drafted=True)
    assert k == 2 and rate == pytest.approx(2.62 / 1.4)
    assert best_length([0.9, 0.72, 0.25], costs, drafted=False) == (3, pytest.approx(2.87 / 1.3))
    assert best_length([0.01], costs, drafted=True) == (0, 1.0)  # a plain step
    assert best_length([], costs, drafted=True) == (0, 1.0)
    assert LengthCosts((1.0, 1.5)).v(4) == pytest.approx(2.5)  # linear past the table


def test_the_stopping_rule_reads_calibrated_confidences():
    """CHEAP: step(k) = v(k+1) + 0.05 k. Confidences 0.95 0.95 0.05 (identity map): at j = 3 the known
    S = 0.95 0.9025 0.045 give k=2 2.8525/1.3 = 2.194 > k=3 2.8975/1.45 = 1.998 -> 2 drafts."""
    seen = [0.95, 0.95, 0.05]
    assert LengthRule(IDENTITY, CHEAP, 3, baseline=1.0, seen=seen).cut(3) == 2
    assert LengthRule(IDENTITY, CHEAP, 3, baseline=5.0, seen=seen).cut(3) == 0  # the free draft is better
    assert LengthRule(IDENTITY, PROHIBITIVE, 3, baseline=1.0, seen=seen).cut(3) == 0
    # no confidences: position rates 0.6 0.5 0.4; j=3: S = 0.6 0.3 0.12, k=2 1.9/1.3 = 1.462 > k=3 2.02/1.45
    assert LengthRule(IDENTITY, CHEAP, 3, baseline=1.0, seen=None).cut(3) == 2


def test_bad_costs_and_lengths_are_refused():
    with pytest.raises(SettingsError, match="positive costs"):
        LengthCosts(())
    with pytest.raises(SettingsError, match="must be >= 0"):
        LengthCosts((1.0,), draft=-1.0)
    with pytest.raises(SettingsError, match="expected fields verify"):
        LengthCosts.from_dict({"verify": [1.0], "speed": 2})
    with pytest.raises(SettingsError, match="k_max >= 1"):
        AdaptiveProposer(NgramProposer(), IDENTITY, CHEAP, 0)


# --- greedy: lossless, and k = 0 is a plain decode ------------------------------------------------


@pytest.fixture(scope="module")
def big():
    return make_target("sdpa")


def kind_proposer(kind: str, target):
    """Every kind's first example head on the random target; its sampled chain proposer when it has one
    (the adaptive proposer reads confidences through it), else its greedy one."""
    example = KINDS[kind].example
    head = example.build(target, example.seed).to(target.dtype).eval()
    return make_proposer(TreeSpec("chain", k=4), head, target, sampled=True)


GREEDY_KINDS = [k for k in KINDS if k != "medusa2"]  # medusa2 drafts through its merged target (test_medusa2)
FREE = {"none": lambda: None, "suffix": SuffixProposer, "ngram": NgramProposer}


@pytest.mark.parametrize("free", list(FREE))
def test_choosing_k_zero_is_exactly_a_plain_decode(big, free):
    """Verification costs no plain step would pay: every step is plain; tokens and step count equal."""
    for seed in range(3):
        prompt = torch.tensor(stream(40, seed=seed))
        model = kind_proposer("eagle3", big)
        adaptive = adaptive_proposer(model, IDENTITY, PROHIBITIVE, 4, FREE[free]())
        ref, res = greedy_decode(big, prompt, 30), decode(big, adaptive, prompt, 30, 4)
        assert res.tokens == ref.tokens
        assert res.stats.decode_forwards == ref.stats.decode_forwards and res.stats.drafts == 0
        assert adaptive.counts == {"none": ref.stats.decode_forwards - 1}  # the last step has no room to draft


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_adaptive_is_greedy_equal_with_every_kind(big, kind):
    lengths: Counter = Counter()
    for seed, free in [(0, SuffixProposer()), (1, None), (2, NgramProposer())]:
        prompt = torch.tensor(stream(40, seed=seed))
        adaptive = adaptive_proposer(kind_proposer(kind, big), IDENTITY, CHEAP, 4, free)
        res = decode(big, adaptive, prompt, 40, 4)
        assert res.tokens == greedy_decode(big, prompt, 40).tokens, (kind, seed)
        lengths.update(adaptive.lengths)
        assert sum(adaptive.counts.values()) in (res.stats.decode_forwards - 1, res.stats.decode_forwards)
    assert sum(c >= 3 for c in lengths.values()) > 1, (kind, lengths)  # the length really varies (not only at the end)


def test_a_drafter_without_confidences_uses_the_position_rates(big):
    model = kind_proposer("medusa", big)
    assert not isinstance(model, SampledProposer)
    adaptive = adaptive_proposer(model, Calibration(position_rates=[0.9, 0.9, 0.9, 0.9]), CHEAP, 4)
    prompt = torch.tensor(stream(40, seed=4))
    assert decode(big, adaptive, prompt, 20, 4).tokens == greedy_decode(big, prompt, 20).tokens
    n = model.head.config.num_heads  # the most it drafts: the best length at a 0.9 rate
    assert adaptive.lengths[n] >= sum(adaptive.lengths.values()) - 2, adaptive.lengths  # but where the budget cuts


# --- sampling: the target's distribution -----------------------------------------------------------


class CutAfterwards:
    """The sampled EAGLE-3 proposer without `propose_until`: drafts k, the rule cuts afterwards."""

    def __init__(self, inner):
        self.inner, self.layers = inner, inner.layers

    def start(self, *args) -> None:
        self.inner.start(*args)

    def propose(self, k):
        return self.inner.propose(k)

    def propose_sampled(self, k, warper, gen):
        return self.inner.propose_sampled(k, warper, gen)

    def accept(self, *args) -> None:
        self.inner.accept(*args)


@pytest.fixture(scope="module")
def small():
    return build_small()


# a calibration and costs under which the random small head's confidences give lengths 0..2 and the
# free draft wins some steps (checked below)
SMALL_CAL = Calibration(bins=[0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.85, 0.95])
SMALL_COSTS = LengthCosts((1.0, 1.3, 1.4, 1.5), draft=0.1)


@pytest.mark.parametrize("stops", ["early", "afterwards"])
def test_sampled_adaptive_output_matches_the_target(small, stops):
    target, head = small
    prompt, n, warping = torch.tensor([1, 3, 0, 2, 5, 4, 1]), 3, {"temperature": 1.0}
    exact = exact_first_tokens(target, prompt, n, **warping)
    counts = torch.zeros(V_SMALL ** n, dtype=torch.long)
    chosen, lengths = {}, set()
    for seed in range(400):
        model = SampledEagle3Proposer(head, target)
        model = model if stops == "early" else CutAfterwards(model)
        assert isinstance(model, StoppingProposer) == (stops == "early")
        adaptive = adaptive_proposer(model, SMALL_CAL, SMALL_COSTS, 3, ContextFree(), vocab_size=V_SMALL)
        assert isinstance(adaptive, SampledAdaptiveProposer)
        res = decode(target, adaptive, prompt, 5, k=3, seed=seed, rule="exact", **warping)
        counts[flat_index(torch.tensor([res.tokens[:n]]), V_SMALL)] += 1
        for name, c in adaptive.counts.items():
            chosen[name] = chosen.get(name, 0) + c
        lengths |= set(adaptive.lengths)
    pvalue = chi2_pvalue(counts, exact)
    assert pvalue > P_MIN, (stops, pvalue)
    assert chosen.get("model", 0) > 50 and chosen.get("free", 0) > 50, chosen
    assert len(lengths) >= 3, lengths


# --- calibration ---------------------------------------------------------------------------------


def test_calibration_fit_is_monotone_and_shrunk():
    """Bin 2 (0.2-0.3): 1 of 4 accepted; bin 8 (0.8-0.9): 3 of 4; bin 5: 2 of 2 then bin 6: 0 of 2 (a
    violation, pooled). Overall 6/12 = 0.5, prior 1 pseudo-record at 0.5 per bin."""
    recs = ([Record(1, 0.25, a) for a in (True, False, False, False)] + [Record(1, 0.85, a) for a in (True, True, True, False)]
            + [Record(2, 0.55, True)] * 2 + [Record(2, 0.65, False)] * 2)
    cal = fit_calibration(recs, [0.7, 0.4])
    assert cal.bins == sorted(cal.bins) and cal.counts[2] == 4 and sum(cal.counts) == 12
    assert cal(0.25, 1) == pytest.approx((1 + 0.5) / 5)
    assert cal(0.85, 1) == pytest.approx((3 + 0.5) / 5)
    assert cal(0.55, 1) == cal(0.65, 1) == pytest.approx(0.5)  # (2.5/3 + 0.5/3) / 2 pooled
    assert cal(None, 2) == 0.4 and cal(None, 9) == 0.4  # no confidence: the position's rate, the last beyond
    assert Calibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ValueError, match="unknown field"):
        Calibration.from_dict({"bins": [], "bogus": 1})


def test_reliability_and_ece_golden():
    recs = [Record(1, 0.95, True)] * 9 + [Record(1, 0.95, False)] + [Record(1, 0.15, True)] * 2 + [Record(1, 0.15, False)] * 8
    table = reliability(recs)
    assert [(r["count"], r["observed"]) for r in table] == [(10, 0.2), (10, 0.9)]
    assert expected_calibration_error(table) == pytest.approx((10 * 0.05 + 10 * 0.05) / 20)
    report = calibration_report([Record(r.position, r.confidence, r.accepted, i % 2) for i, r in enumerate(recs)], [0.5])
    assert report["records"] == 20 and report["accepted"] == 11 and report["ece_raw"] == pytest.approx(0.05)
    assert report["reliability_calibrated"] and report["map"]["bins"]


def test_records_stop_at_the_first_rejection():
    assert records_of_step([4, 5, 6], [0.9, 0.8, 0.7], [4, 9, 1], fold=1) == [Record(1, 0.9, True, 1), Record(2, 0.8, False, 1)]
    assert records_of_step([4, 5], [0.9, 0.8], [4], 0) == [Record(1, 0.9, True, 0)]  # censored: 5 was never settled


# --- skipping the model ----------------------------------------------------------------------------


def test_steps_the_model_skipped_are_fed_as_one(big):
    """Two verified steps fed merged leave EAGLE-3 drafting what it drafts fed step by step."""
    from test_hybrid import Spy

    from specheads.verify.adaptive_proposers import merged_step
    from specheads.verify.eagle3_proposers import Eagle3Proposer
    from specheads.verify.loop import decode as run

    model = kind_proposer("eagle3", big)
    spy = Spy(Eagle3Proposer(model.head, big))
    prompt = torch.tensor(stream(30, seed=7))
    run(big, spy, prompt, 12, 3)
    steps = [f[1:] for f in spy.fed[1:]]
    one_by_one, merged = Eagle3Proposer(model.head, big), Eagle3Proposer(model.head, big)
    for p in (one_by_one, merged):
        p.start(*spy.fed[0][1:])
    for inputs, following, out, start in steps[:3]:
        one_by_one.accept(inputs, following, out, start)
    inputs, following, out, start = merged_step(steps[:3])
    assert start == steps[0][3] and inputs.tolist() == sum((s[0].tolist() for s in steps[:3]), [])
    assert out.hidden[model.layers[0]].shape[1] == inputs.numel() == following.numel()
    merged.accept(inputs, following, out, start)
    assert merged.rows == one_by_one.rows and merged.propose(3).tolist() == one_by_one.propose(3).tolist()


def test_a_free_draft_better_than_the_models_average_skips_the_model(big):
    """Measured per-position acceptance 0.3: free drafts that beat that are verified without asking the
    model (fed later in one step), and the output stays plain greedy's."""
    low = Calibration(bins=[0.05] * 9 + [0.9], position_rates=[0.3])
    prompt = torch.tensor(stream(40, seed=1))
    adaptive = adaptive_proposer(kind_proposer("eagle3", big), low, CHEAP, 4, SuffixProposer())
    res = decode(big, adaptive, prompt, 40, 4)
    assert res.tokens == greedy_decode(big, prompt, 40).tokens
    assert adaptive.counts["free"] > 0 and adaptive.model_steps < res.stats.decode_forwards


def test_free_drafts_may_run_past_k_max_while_the_model_stops_at_it(big):
    """free_k_max 8 over k_max 2: suffix drafts of up to 8 tokens are verified where their path
    probability pays, the model never drafts more than 2 a step, and the output is plain greedy's;
    without free_k_max no step verifies more than k_max."""
    longest = Counter()
    for seed in range(3):
        prompt = torch.tensor(stream(60, seed=seed))
        ref = greedy_decode(big, prompt, 48).tokens
        adaptive = adaptive_proposer(kind_proposer("eagle3", big), IDENTITY, CHEAP, 2, SuffixProposer(), free_k_max=8)
        assert decode(big, adaptive, prompt, 48, loop_k(2, 8)).tokens == ref
        assert adaptive.levels <= 2 * adaptive.model_steps and adaptive.summary()["free_k_max"] == 8
        longest.update(adaptive.lengths)
        capped = adaptive_proposer(kind_proposer("eagle3", big), IDENTITY, CHEAP, 2, SuffixProposer())
        assert decode(big, capped, prompt, 48, loop_k(2, 8)).tokens == ref
        assert max(capped.lengths) <= 2
    assert max(longest) > 2, longest
