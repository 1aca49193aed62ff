"""Adaptive-length and hybrid-choose rows in draft groups: their steps split around the model's
draft (`protocols.SplitProposer`), and the model drafts of the rows sharing an EAGLE-3 head run in
one group (`verify.draft_asks.draft_asks`).

Every grouped row must draft what it drafts alone: its tokens, its drafts step by step, its
choices and counts (free / model / none, lengths, levels), and when sampling the same q and the
same tokens from the same seed. A row that asks nothing costs no drafter forward, and a group
drafts only while one of its rows still does (the stopping rule ends a row's draft early).
"""

from __future__ import annotations

import pytest
import torch
from test_adaptive import CHEAP, PROHIBITIVE, SMALL_CAL, SMALL_COSTS
from test_batch_draft import Forwards, RecordingLeviathan, prompts
from test_hybrid import ContextFree
from test_sampling import V_SMALL, build_small

from specheads.serve.engine import Guarded
from specheads.verify.adaptive_proposers import adaptive_proposer
from specheads.verify.calibration import Calibration
from specheads.verify.eagle3_proposers import Eagle3Proposer, SampledEagle3Proposer
from specheads.verify.hybrid_proposers import hybrid_proposer
from specheads.verify.loop import Batch, decode, decode_batch, greedy_decode, request
from specheads.verify.ngram_proposers import NgramProposer

SURE = Calibration(bins=[0.95] * 10)  # every position likely accepted: the model drafts k_max


@pytest.fixture(scope="module")
def small():
    return build_small()


def counts_of(proposer) -> dict:
    """What a wrapper recorded (its choices, lengths, model levels), to compare with alone."""
    return {name: getattr(proposer, name) for name in ("counts", "lengths", "levels", "model_steps")
            if hasattr(proposer, name)}


# --- adaptive, greedy ----------------------------------------------------------------------------

# (free proposer, k_max, loop k, budget, calibration): free drafts win some steps, lengths 0..3
ADAPTIVE_ROWS = [(ContextFree, 3, 3, 18, SMALL_CAL), (None, 3, 4, 14, SMALL_CAL), (ContextFree, 2, 2, 9, SMALL_CAL),
                 (NgramProposer, 4, 4, 22, SMALL_CAL), (None, 3, 3, 16, SURE), (ContextFree, 3, 3, 20, SURE),
                 (None, 2, 3, 5, SMALL_CAL), (ContextFree, 4, 4, 17, SMALL_CAL)]


def adaptive_row(head, target, free, k_max, cal, vocab_size=None):
    model = SampledEagle3Proposer(head, target)  # confidences through its q, so the rule stops it early
    return adaptive_proposer(model, cal, SMALL_COSTS, k_max, free() if free else None, vocab_size)


@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_adaptive_rows_in_a_group_equal_plain_greedy_and_their_decode_alone(small, batch_size):
    """Ragged prompts, k_max, budgets, free drafts; with batch_size < 8 rows finish and join mid-flight."""
    target, head = small
    ps = prompts(len(ADAPTIVE_ROWS), seed=21)
    props = [adaptive_row(head, target, free, k_max, cal) for free, k_max, _, _, cal in ADAPTIVE_ROWS]
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, a, p, n, k) for a, p, (_, _, k, n, _) in zip(props, ps, ADAPTIVE_ROWS)],
                           batch_size)
        assert max(b for b, _ in count.take()) >= 2  # the rows drafted together
    finally:
        count.close()
    chosen, lengths = set(), set()
    for (free, k_max, k, n, cal), p, res, grouped in zip(ADAPTIVE_ROWS, ps, got, props):
        alone = adaptive_row(head, target, free, k_max, cal)
        one = decode(target, alone, p, n, k)
        assert res.tokens == one.tokens == greedy_decode(target, p, n).tokens
        assert res.step_proposed == one.step_proposed and res.step_tokens == one.step_tokens
        assert counts_of(grouped) == counts_of(alone)
        chosen |= set(grouped.counts)
        lengths |= set(grouped.lengths)
    assert chosen == {"model", "free", "none"} and len(lengths) >= 3, (chosen, lengths)


def test_adaptive_rows_share_drafter_forwards(small):
    """Four adaptive rows that always draft k_max = 3: the first step drafts with 2 forwards, every
    later step with 3 (the catch-up of the steps fed, then positions 2 and 3), each over all four
    rows; drafting row by row would run every forward over one row."""
    target, head = small
    count = Forwards(head)
    try:
        ps = prompts(4, seed=5)
        props = [adaptive_proposer(SampledEagle3Proposer(head, target), SURE, CHEAP, 3) for _ in ps]
        batch = Batch(target)
        batch.admit(list(enumerate(request(target, a, p, 30, 3) for a, p in zip(props, ps))))
        count.take()
        batch.step()
        assert [b for b, _ in count.take()] == [4, 4]
        for _ in range(3):
            batch.step()
            assert [b for b, _ in count.take()] == [4, 4, 4]
        assert all(set(a.lengths) == {3} for a in props)
    finally:
        count.close()


def test_a_row_choosing_a_plain_step_adds_no_drafter_forward(small):
    """Beside two drafting rows, an adaptive row whose costs make every step plain (k = 0) is never
    part of a drafter forward; a batch of such rows runs none past their starts. All equal greedy."""
    target, head = small
    ps = prompts(3, seed=7)

    def adaptive(costs):
        return adaptive_proposer(SampledEagle3Proposer(head, target), SURE, costs, 3)

    count = Forwards(head)
    try:
        plain = adaptive(PROHIBITIVE)
        got = decode_batch(target, [request(target, a, p, 16, 3) for a, p in zip([adaptive(CHEAP), adaptive(CHEAP), plain], ps)])
        shapes = count.take()[3:]  # after the three prompts' own starts
        assert shapes and {b for b, _ in shapes} == {2}, shapes
        assert plain.counts == {"none": got[2].stats.decode_forwards - 1} and plain.levels == 0
        ones = decode_batch(target, [request(target, adaptive(PROHIBITIVE), p, 16, 3) for p in ps])
        assert count.take() == [(1, p.numel()) for p in ps]  # nobody asks: only the starts
    finally:
        count.close()
    for p, res, one in zip(ps, got, ones):
        assert res.tokens == one.tokens == greedy_decode(target, p, 16).tokens


def test_a_group_drafts_only_while_a_row_still_drafts(small):
    """Rows whose stopping rule ends their drafts at different positions: each step runs the catch-up
    forward, then one forward per position the longest-drafting row still needs (its levels), never
    k_max - 1 when every row stopped earlier."""
    target, head = small
    ps = prompts(3, seed=11)
    props = [adaptive_proposer(SampledEagle3Proposer(head, target), SMALL_CAL, CHEAP, 4) for _ in ps]
    batch = Batch(target)
    batch.admit(list(enumerate(request(target, a, p, 40, 4) for a, p in zip(props, ps))))
    count = Forwards(head)
    needed = []
    try:
        for step in range(8):
            before = [a.levels for a in props]
            batch.step()
            seen = max(a.levels - b for a, b in zip(props, before))  # positions computed by the longest
            shapes = count.take()
            assert len(shapes) == (step > 0) + seen - 1 and all(b == 3 for b, _ in shapes), (step, shapes, seen)
            needed.append(seen)
    finally:
        count.close()
    assert min(needed) < 4, needed  # some step stopped every row before k_max


def test_adaptive_rows_join_and_leave_a_running_group(small):
    """A row admitted into a running group, one dropped from it, a plain EAGLE-3 row in its own group
    beside them: every row equals plain greedy."""
    target, head = small
    ps = prompts(6, seed=13)

    def adaptive(free=ContextFree):
        return adaptive_row(head, target, free, 3, SMALL_CAL)

    batch = Batch(target)
    batch.admit(list(enumerate(request(target, adaptive(), p, 20, 3) for p in ps[:3])))
    batch.step()
    batch.step()
    batch.admit([(3, request(target, adaptive(None), ps[3], 20, 2)),
                 (4, request(target, Eagle3Proposer(head, target), ps[4], 20, 2))])
    batch.step()
    [(index, partial)] = batch.drop([1])
    assert index == 1 and partial.tokens == greedy_decode(target, ps[1], 20).tokens[: len(partial.tokens)]
    batch.admit([(5, request(target, adaptive(), ps[5], 20, 3))])
    got = {}
    while batch.rows:
        got.update(batch.step())
    for i in (0, 2, 3, 4, 5):
        assert got[i].tokens == greedy_decode(target, ps[i], 20).tokens, i


def test_guarded_adaptive_rows_group_and_a_failed_one_drafts_nothing(small):
    """Serve's wrapper: Guarded adaptive rows group through it; a row whose free proposer fails keeps
    its error and from then on drafts nothing, the others draft on."""
    target, head = small
    ps = prompts(3, seed=4)

    class Failing(ContextFree):
        def propose(self, k):
            raise RuntimeError("free proposer failed")

    guarded = [Guarded(adaptive_row(head, target, free, 3, SURE)) for free in (Failing, ContextFree, None)]
    assert guarded[1].group_drafter() is guarded[1].inner.model
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, g, p, 16, 3) for g, p in zip(guarded, ps)])
        assert max(b for b, _ in count.take()) == 2
    finally:
        count.close()
    assert isinstance(guarded[0].error, RuntimeError) and guarded[1].error is None
    for p, res in zip(ps, got):
        assert res.tokens == greedy_decode(target, p, 16).tokens
    assert sum(got[0].step_proposed) == 0 and sum(got[1].step_proposed) > 0


# --- adaptive, sampled ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [3, 8])
def test_sampled_adaptive_rows_draw_the_q_and_tokens_of_their_decode_alone(small, batch_size):
    target, head = small
    rows = ADAPTIVE_ROWS[:6]
    ps = prompts(len(rows), seed=19)
    temps = [1.0, 0.7, 1.3, 1.0, 0.9, 1.1]
    rules = [RecordingLeviathan(60 + i, t) for i, t in enumerate(temps)]
    props = [adaptive_row(head, target, free, k_max, cal, V_SMALL) for free, k_max, _, _, cal in rows]
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, a, p, n, k, rule=rule)
                                    for a, p, (_, _, k, n, _), rule in zip(props, ps, rows, rules)], batch_size)
        assert max(b for b, _ in count.take()) >= 2
    finally:
        count.close()
    chosen = set()
    for i, ((free, k_max, k, n, cal), p) in enumerate(zip(rows, ps)):
        alone, rule = adaptive_row(head, target, free, k_max, cal, V_SMALL), RecordingLeviathan(60 + i, temps[i])
        one = decode(target, alone, p, n, k, rule=rule)
        assert got[i].tokens == one.tokens and got[i].step_proposed == one.step_proposed, i
        assert counts_of(props[i]) == counts_of(alone), i
        assert len(rules[i].qs) == len(rule.qs)
        for grouped, single in zip(rules[i].qs, rule.qs):
            assert grouped.shape == single.shape
            torch.testing.assert_close(grouped, single, rtol=1e-9, atol=1e-12)
        chosen |= set(props[i].counts)
    assert {"model", "free"} <= chosen, chosen


# --- hybrid choose -------------------------------------------------------------------------------

HYBRID_ROWS = [(ContextFree, "arctic", None, 3, 18), (NgramProposer, "measured", 2, 4, 14),
               (ContextFree, "measured", None, 2, 11), (ContextFree, "arctic", 2, 4, 20)]


def hybrid_row(head, target, free, rule, model_k, sampled=False):
    model = SampledEagle3Proposer(head, target) if sampled else Eagle3Proposer(head, target)
    return hybrid_proposer(model, free(), "choose", rule=rule, model_k=model_k)


@pytest.mark.parametrize("batch_size", [2, 4])
def test_hybrid_choose_rows_in_a_group_equal_plain_greedy_and_their_decode_alone(small, batch_size):
    target, head = small
    ps = prompts(len(HYBRID_ROWS), seed=23)
    props = [hybrid_row(head, target, free, rule, mk) for free, rule, mk, _, _ in HYBRID_ROWS]
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, h, p, n, k) for h, p, (*_, k, n) in zip(props, ps, HYBRID_ROWS)],
                           batch_size)
        assert max(b for b, _ in count.take()) == batch_size
    finally:
        count.close()
    chosen = set()
    for (free, rule, mk, k, n), p, res, grouped in zip(HYBRID_ROWS, ps, got, props):
        alone = hybrid_row(head, target, free, rule, mk)
        one = decode(target, alone, p, n, k)
        assert res.tokens == one.tokens == greedy_decode(target, p, n).tokens
        assert res.step_proposed == one.step_proposed and res.step_tokens == one.step_tokens
        assert counts_of(grouped) == counts_of(alone) and grouped.accepted == alone.accepted
        chosen |= set(grouped.counts)
    assert {"model", "free"} <= chosen, chosen


def test_sampled_hybrid_choose_rows_draw_the_q_and_tokens_of_their_decode_alone(small):
    target, head = small
    ps = prompts(len(HYBRID_ROWS), seed=29)
    temps = [1.0, 0.8, 1.2, 1.0]
    rules = [RecordingLeviathan(80 + i, t) for i, t in enumerate(temps)]
    props = [hybrid_row(head, target, free, rule, mk, sampled=True) for free, rule, mk, _, _ in HYBRID_ROWS]
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, h, p, n, k, rule=rule)
                                    for h, p, (*_, k, n), rule in zip(props, ps, HYBRID_ROWS, rules)])
        assert max(b for b, _ in count.take()) == len(HYBRID_ROWS)
    finally:
        count.close()
    for i, ((free, rule_name, mk, k, n), p) in enumerate(zip(HYBRID_ROWS, ps)):
        alone, rule = hybrid_row(head, target, free, rule_name, mk, sampled=True), RecordingLeviathan(80 + i, temps[i])
        one = decode(target, alone, p, n, k, rule=rule)
        assert got[i].tokens == one.tokens and got[i].step_proposed == one.step_proposed, i
        assert counts_of(props[i]) == counts_of(alone), i
        for grouped, single in zip(rules[i].qs, rule.qs):
            assert grouped.shape == single.shape
            torch.testing.assert_close(grouped, single, rtol=1e-9, atol=1e-12)


# --- hybrid union --------------------------------------------------------------------------------

UNION_ROWS = [(ContextFree, 3, None, 18), (NgramProposer, 2, 3, 14), (ContextFree, 4, 2, 11), (ContextFree, 2, None, 20)]


def union_row(head, target, free, k, free_k):
    return hybrid_proposer(Eagle3Proposer(head, target), free(), "union", k=k, free_k=free_k)


@pytest.mark.parametrize("rule", ["greedy", "exact"])
def test_union_rows_in_a_group_equal_their_decode_alone(small, rule):
    """Union trees over a grouped model chain: the same trees and tokens as alone (greedy: plain
    greedy's; the exact point-mass rule: the same tokens from the same seed), batch 3 with a join."""
    target, head = small
    ps = prompts(len(UNION_ROWS), seed=31)
    props = [union_row(head, target, free, k, fk) for free, k, fk, _ in UNION_ROWS]
    count = Forwards(head)
    try:
        got = decode_batch(target, [request(target, u, p, n, rule=rule, seed=90 + i)
                                    for i, (u, p, (*_, n)) in enumerate(zip(props, ps, UNION_ROWS))], 3)
        assert max(b for b, _ in count.take()) == 3
    finally:
        count.close()
    for i, ((free, k, fk, n), p, res, grouped) in enumerate(zip(UNION_ROWS, ps, got, props)):
        alone = union_row(head, target, free, k, fk)
        one = decode(target, alone, p, n, rule=rule, seed=90 + i)
        assert res.tokens == one.tokens and res.step_proposed == one.step_proposed, i
        assert res.step_tokens == one.step_tokens
        assert counts_of(grouped) == counts_of(alone) and grouped.accepted == alone.accepted
        if rule == "greedy":
            assert res.tokens == greedy_decode(target, p, n).tokens
        assert grouped.model_steps > 0, i  # the model drafted (in the group) every step it had room
    assert sum(u.accepted for u in props) > 0
