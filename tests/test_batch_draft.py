"""Draft groups in the batched loop: EAGLE-3 chain rows over one head draft together, one drafter
forward per draft position for the whole group (`eagle3_proposers.draft_group`).

Every grouped row must draft what it drafts alone: greedy rows equal plain greedy decoding and
their decode alone step for step (same drafts proposed, same tokens accepted), sampled rows get
the same q (allclose) and the same tokens from the same seed. The small 6-token target of
tests/test_sampling.py accepts ragged draft lengths, so the group's catch-up forward moves rows
of different lengths; the drafter's forwards are counted to prove the group ran.
"""

from __future__ import annotations

import pytest
import torch
from random_models import make_head, make_target
from test_sampling import V_SMALL, build_small

from specheads.serve.engine import Guarded
from specheads.verify.calibration import ConfidenceProbe
from specheads.verify.eagle1_proposers import Eagle1Proposer
from specheads.verify.eagle3_proposers import Eagle3Proposer, SampledEagle3Proposer
from specheads.verify.loop import Batch, decode, decode_batch, greedy_decode, request
from specheads.verify.ngram_proposers import NgramProposer
from specheads.verify.rules import LeviathanRule
from specheads.verify.sampling import make_generator, warp


@pytest.fixture(scope="module")
def small():
    return build_small()


def prompts(n: int, seed: int, vocab: int = V_SMALL, max_len: int = 14) -> list[torch.Tensor]:
    """n prompts of ragged lengths 1 .. max_len - 1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g)
            for _ in range(n)]


class Forwards:
    """Counts the drafter's forwards (its decoder layer's calls) and their input shapes [B, T]."""

    def __init__(self, head):
        self.shapes: list[tuple[int, int]] = []
        self.handle = head.layers[0].register_forward_hook(
            lambda _m, args, _out: self.shapes.append(tuple(args[0].shape[:2])))

    def take(self) -> list[tuple[int, int]]:
        shapes, self.shapes = self.shapes, []
        return shapes

    def close(self) -> None:
        self.handle.remove()


# --- greedy: grouped rows equal plain greedy and their decode alone ------------------------------


@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_grouped_greedy_rows_equal_plain_greedy_and_their_decode_alone(small, batch_size):
    """Ragged prompts, k and budgets, an eos for some rows; with batch_size < 8 rows finish and
    join mid-flight (a new member has no pending rows while the others do)."""
    target, head = small
    ps = prompts(8, seed=2)
    ks, budgets = [3, 2, 4, 3, 1, 3, 2, 4], [18, 9, 22, 5, 14, 20, 1, 16]
    eos = [[], [], [4], [], [], [2], [], []]
    reqs = [request(target, Eagle3Proposer(head, target), p, n, k, e)
            for p, n, k, e in zip(ps, budgets, ks, eos)]
    got = decode_batch(target, reqs, batch_size)
    accepted = set()
    for p, n, k, e, res in zip(ps, budgets, ks, eos, got):
        one = decode(target, Eagle3Proposer(head, target), p, n, k, e)
        assert res.tokens == one.tokens == greedy_decode(target, p, n, e).tokens
        assert res.step_proposed == one.step_proposed and res.step_tokens == one.step_tokens
        assert res.stats.proposer_s > 0 or n <= 1
        accepted |= set(res.step_tokens)
    assert len(accepted) >= 3  # ragged acceptance: the catch-up forward moved rows of several lengths


def test_a_group_runs_one_drafter_forward_per_draft_position(small):
    """Four rows with k = 3: the first step drafts with 2 forwards (positions 2 and 3), every later
    step with 3 (the deferred catch-up, then positions 2 and 3), each over all four rows; per-row
    drafting would run 3 forwards per row per step. A lone row drafts alone (accepting at once)."""
    target, head = small
    count = Forwards(head)
    try:
        ps = prompts(4, seed=5)
        batch = Batch(target)
        batch.admit(list(enumerate(request(target, Eagle3Proposer(head, target), p, 30, 3) for p in ps)))
        assert count.take() == [(1, p.numel()) for p in ps]  # each prompt's own start
        batch.step()
        assert [b for b, _ in count.take()] == [4, 4]
        for _ in range(3):
            batch.step()
            shapes = count.take()
            assert len(shapes) == 3 and all(b == 4 for b, _ in shapes), shapes
        alone = Batch(target)
        alone.admit([(0, request(target, Eagle3Proposer(head, target), ps[0], 30, 3))])
        count.take()
        alone.step()
        alone.step()
        assert [b for b, _ in count.take()] == [1] * 6  # per step: 2 drafts, then its accept
    finally:
        count.close()


def test_group_step_masks_are_their_own_aligned_tensors(small, monkeypatch):
    """Each draft position's mask reaches the head as its own contiguous tensor from offset 0, not
    a view into the group's mask: CUDA's memory-efficient sdpa reads a mask from its data pointer
    in 16-byte loads, and a view at an odd offset failed there ("misaligned address", batch 8)."""
    target, head = small
    masks = []
    step = type(head).step

    def recording(self, hidden, embeds, position_ids, attention_mask, cache=None):
        if attention_mask is not None and hidden.shape[0] > 1:
            masks.append(attention_mask)
        return step(self, hidden, embeds, position_ids, attention_mask, cache)

    monkeypatch.setattr(type(head), "step", recording)
    reqs = [request(target, Eagle3Proposer(head, target), p, 20, 4) for p in prompts(4, seed=7)]
    decode_batch(target, reqs, 4)
    one_query = [m for m in masks if m.shape[2] == 1]  # a draft position's query, keys L + j
    assert len(one_query) >= 4
    assert all(m.is_contiguous() and m.storage_offset() == 0 for m in one_query)


def test_rows_join_a_group_mid_flight_and_leave_it(small):
    """A row admitted into a running group (no pending rows of its own), a row dropped from it,
    and rows of another kind beside it: every row still equals plain greedy."""
    target, head = small
    ps = prompts(6, seed=8)
    first = [request(target, Eagle3Proposer(head, target), p, 20, 3) for p in ps[:3]]
    batch = Batch(target)
    batch.admit(list(enumerate(first)))
    batch.step()
    batch.step()
    batch.admit([(3, request(target, Eagle3Proposer(head, target), ps[3], 20, 2)),
                 (4, request(target, NgramProposer(), ps[4], 20, 2))])
    batch.step()
    [(index, partial)] = batch.drop([1])
    assert index == 1 and partial.tokens == greedy_decode(target, ps[1], 20).tokens[: len(partial.tokens)]
    batch.admit([(5, request(target, Eagle3Proposer(head, target), ps[5], 20, 4))])
    got = {}
    while batch.rows:
        got.update(batch.step())
    for i in (0, 2, 3, 4, 5):
        assert got[i].tokens == greedy_decode(target, ps[i], 20).tokens, i


def test_a_failed_guarded_row_leaves_the_group_and_the_others_draft_on(small):
    """A Guarded proposer groups through its wrapper; once it has failed it drafts nothing, alone."""
    target, head = small
    ps = prompts(3, seed=4)
    guarded = [Guarded(Eagle3Proposer(head, target)) for _ in ps]
    assert guarded[0].group_drafter() is guarded[0].inner
    guarded[0].error = RuntimeError("its stream failed")
    assert guarded[0].group_drafter() is None
    got = decode_batch(target, [request(target, g, p, 16, 3) for g, p in zip(guarded, ps)])
    for p, res in zip(ps, got):
        assert res.tokens == greedy_decode(target, p, 16).tokens
    assert sum(got[0].step_proposed) == 0 and sum(got[1].step_proposed) > 0


def test_eagle1_chain_rows_group_too():
    """EAGLE-1 (final-normed features) groups through the same path: rows equal their decode alone."""
    from test_eagle1 import random_head

    target = make_target()
    head = random_head(target)
    count = Forwards(head)
    try:
        ps = prompts(3, seed=6, vocab=96)
        got = decode_batch(target, [request(target, Eagle1Proposer(head, target), p, 12, 3) for p in ps])
        assert any(b == 3 for b, _ in count.take())
    finally:
        count.close()
    for p, res in zip(ps, got):
        one = decode(target, Eagle1Proposer(head, target), p, 12, 3)
        assert res.tokens == one.tokens == greedy_decode(target, p, 12).tokens
        assert res.step_proposed == one.step_proposed


def test_random_head_groups_at_float64_equal_alone():
    """The 96-token target of the other batch tests: a group of five, batch 3 (joins mid-flight)."""
    target = make_target()
    head = make_head(target)
    ps = prompts(5, seed=12, vocab=96, max_len=24)
    got = decode_batch(target, [request(target, Eagle3Proposer(head, target), p, 15, 3) for p in ps], 3)
    for p, res in zip(ps, got):
        one = decode(target, Eagle3Proposer(head, target), p, 15, 3)
        assert res.tokens == one.tokens == greedy_decode(target, p, 15).tokens
        assert res.step_proposed == one.step_proposed


# --- sampled: the same q and tokens as the per-row path ------------------------------------------


class RecordingLeviathan(LeviathanRule):
    """Leviathan's rule that keeps the draft distributions q [n, V] it verifies, step by step."""

    def __init__(self, seed: int, temperature: float, top_p: float = 1.0):
        super().__init__(lambda x: warp(x, temperature=temperature, top_p=top_p),
                         make_generator(seed, "cpu"), seed)
        self.qs: list[torch.Tensor] = []

    def decide(self, tree, tokens, logits, q):
        self.qs.append(torch.empty(0) if q is None else q[0].clone())
        return super().decide(tree, tokens, logits, q)


SAMPLED_ROWS = [  # (proposer class, temperature, top_p, k, budget): two groups (sampled q, point mass)
    (SampledEagle3Proposer, 1.0, 1.0, 3, 16), (SampledEagle3Proposer, 0.7, 0.9, 2, 12),
    (SampledEagle3Proposer, 1.3, 1.0, 4, 18), (Eagle3Proposer, 1.0, 1.0, 3, 14),
    (Eagle3Proposer, 0.8, 1.0, 2, 10),
]


def test_sampled_grouped_rows_draw_the_q_and_tokens_of_their_decode_alone(small):
    target, head = small
    ps = prompts(len(SAMPLED_ROWS), seed=9)
    count = Forwards(head)
    try:
        rules = [RecordingLeviathan(40 + i, t, top_p) for i, (_, t, top_p, _, _) in enumerate(SAMPLED_ROWS)]
        reqs = [request(target, cls(head, target), p, n, k, rule=rule)
                for (cls, _, _, k, n), p, rule in zip(SAMPLED_ROWS, ps, rules)]
        got = decode_batch(target, reqs)
        assert max(b for b, _ in count.take()) == 3  # the three sampled rows drafted as one group
    finally:
        count.close()
    for i, ((cls, t, top_p, k, n), p) in enumerate(zip(SAMPLED_ROWS, ps)):
        rule = RecordingLeviathan(40 + i, t, top_p)
        one = decode(target, cls(head, target), p, n, k, rule=rule)
        assert got[i].tokens == one.tokens and got[i].step_proposed == one.step_proposed, i
        assert len(rules[i].qs) == len(rule.qs)
        for grouped, alone in zip(rules[i].qs, rule.qs):
            assert grouped.shape == alone.shape
            torch.testing.assert_close(grouped, alone, rtol=1e-9, atol=1e-12)
    point_mass = torch.cat(rules[3].qs)  # the top-1 group's q: one-hot rows
    assert point_mass.numel() and bool(((point_mass == 0) | (point_mass == 1)).all())
    assert not bool(((torch.cat(rules[0].qs) == 0) | (torch.cat(rules[0].qs) == 1)).all())


def test_calibration_probes_draft_in_a_group_and_record_what_they_record_alone(small):
    """eval's `ConfidenceProbe` (greedy chains drawn through a one-hot warper, confidences recorded)
    over EAGLE-3 rows drafts in one group (4 rows per forward), with the tokens, steps and records
    (position, accepted) of each row's decode alone, confidences equal to float noise."""
    target, head = small
    ps = prompts(4, seed=11)
    count = Forwards(head)
    try:
        probes = [ConfidenceProbe(SampledEagle3Proposer(head, target)) for _ in ps]
        got = decode_batch(target, [request(target, pr, p, 16, 3) for pr, p in zip(probes, ps)], 4)
        assert max(b for b, _ in count.take()) == 4  # the drafts ran as a group
    finally:
        count.close()
    for p, probe, res in zip(ps, probes, got):
        alone = ConfidenceProbe(SampledEagle3Proposer(head, target))
        one = decode(target, alone, p, 16, 3)
        assert res.tokens == one.tokens == greedy_decode(target, p, 16).tokens
        assert res.step_proposed == one.step_proposed
        assert [(r.position, r.accepted) for r in probe.records] == [(r.position, r.accepted) for r in alone.records]
        assert probe.records and torch.allclose(torch.tensor([r.confidence for r in probe.records]),
                                                torch.tensor([r.confidence for r in alone.records]), atol=1e-5)
