"""Batched decoding (`verify.loop.decode_batch`): every row equals its own decode alone.

The tiny random float64 target cannot flip an argmax tie between a batched and a single-row
forward, so greedy rows must equal plain greedy decoding token for token and step for step, and a
seeded sampled row must reproduce its decode alone. Rows differ in prompt length, proposer (chain,
static tree, EAGLE-2 tree, n-gram, oracle, adaptive, none), budget and eos; with batch_size below
the number of requests, rows join while others are mid-flight. Sampling per row is checked with
the chi-square test of tests/test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch
from random_models import VOCAB, make_head, make_target
from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index
from test_verify import Oracle, random_prompts

from specheads.verify.adaptive_proposers import LengthCosts, adaptive_proposer
from specheads.verify.calibration import Calibration
from specheads.verify.eagle3_proposers import (
    Eagle3DynamicTreeProposer,
    Eagle3Proposer,
    Eagle3StaticTreeProposer,
    SampledEagle3Proposer,
)
from specheads.verify.loop import Batch, decode, decode_batch, greedy_decode, request
from specheads.verify.ngram_proposers import NO_DRAFT, NgramProposer
from specheads.verify.ragged import batch_mask, keep_paths, merge_rows, select_rows
from specheads.verify.steps import DecodeError, new_cache, target_step

STATIC = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]
ADAPTIVE_CAL = Calibration(bins=[(b + 0.5) / 10 for b in range(10)], position_rates=[0.6, 0.5, 0.4])
CHEAP = LengthCosts(verify=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5), draft=0.05)


@pytest.fixture(scope="module")
def big():
    target = make_target()
    return target, make_head(target)


def kinds(target, head, prompt, ref) -> dict:
    """name -> (a fresh proposer factory, k) for every draft shape the batch mixes."""
    return {
        "plain": (lambda: NO_DRAFT, 0),
        "chain": (lambda: Eagle3Proposer(head, target), 3),
        "static": (lambda: Eagle3StaticTreeProposer(head, target, STATIC), 0),
        "eagle2": (lambda: Eagle3DynamicTreeProposer(head, target, depth=3, top_k=2, total_tokens=6), 0),
        "ngram": (lambda: NgramProposer(), 2),
        "oracle": (lambda: Oracle(ref, prompt.numel()), 4),
        "adaptive": (lambda: adaptive_proposer(SampledEagle3Proposer(head, target), ADAPTIVE_CAL, CHEAP, 4,
                                               NgramProposer()), 4),
    }


def mixed_requests(target, head, n_new: int = 20, eos: int | None = None):
    """One request per (prompt, kind), ragged prompt lengths; -> (requests, what each one is)."""
    out, labels = [], []
    for i, prompt in enumerate(random_prompts(4, seed=11)):
        ref = greedy_decode(target, prompt, n_new + 8).tokens
        for name, (make, k) in kinds(target, head, prompt, ref).items():
            budget = n_new - (i + len(labels)) % 5  # ragged budgets too
            out.append(request(target, make(), prompt, budget, k, [] if eos is None else [eos]))
            labels.append((prompt, name, make, k, budget))
    return out, labels


def alone(target, label, eos=()):
    prompt, _, make, k, budget = label
    return decode(target, make(), prompt, budget, k, eos)


# --- greedy: every row equals its decode alone ------------------------------------------------


@pytest.mark.parametrize("batch_size", [3, 28])
def test_greedy_rows_equal_their_decode_alone(big, batch_size):
    target, head = big
    requests, labels = mixed_requests(target, head)
    results = decode_batch(target, requests, batch_size)
    for res, label in zip(results, labels):
        one = alone(target, label)
        plain = greedy_decode(target, label[0], label[4])
        assert res.tokens == one.tokens == plain.tokens, label[1]
        assert res.step_tokens == one.step_tokens and res.step_proposed == one.step_proposed, label[1]
        s = res.stats
        assert s.tokens == len(res.tokens) == 1 + s.decode_tokens and s.prefill_forwards == 1
    total = sum((r.stats.wall_s for r in results), 0.0)
    spent = sum((r.stats.target_decode_s + r.stats.target_prefill_s + r.stats.proposer_s
                 + r.stats.proposer_start_s for r in results), 0.0)
    assert total >= spent > 0  # shared seconds add up to at most the batch's wall time


def test_rows_accept_ragged_lengths_in_one_forward(big):
    """An oracle row accepts k + 1 per step while an always-wrong row accepts 1, side by side."""
    target, _ = big
    prompts = random_prompts(3, seed=7)
    refs = [greedy_decode(target, p, 30).tokens for p in prompts]
    reqs = [request(target, Oracle(refs[0], prompts[0].numel()), prompts[0], 21, 4),
            request(target, Oracle(refs[1], prompts[1].numel(), wrong=True), prompts[1], 21, 4),
            request(target, Oracle(refs[2], prompts[2].numel()), prompts[2], 21, 2)]
    right, wrong, short = decode_batch(target, reqs)
    assert right.step_tokens == [5] * 4 and short.step_tokens[:4] == [3] * 4
    assert set(wrong.step_tokens) == {1} and len(wrong.step_tokens) == 20
    assert [r.tokens for r in (right, wrong, short)] == [refs[0][:21], refs[1][:21], refs[2][:21]]


def test_a_row_finishing_early_leaves_the_others_decoding(big):
    target, head = big
    prompts = random_prompts(3, seed=3)
    plain = [greedy_decode(target, p, 24) for p in prompts]
    eos = plain[1].tokens[4]  # row 1 stops at its 5th token (maybe earlier); the others may not
    reqs = [request(target, Eagle3Proposer(head, target), prompts[0], 24, 3),
            request(target, Eagle3StaticTreeProposer(head, target, STATIC), prompts[1], 24, 0, [eos]),
            request(target, NgramProposer(), prompts[2], 6, 2)]
    batch = Batch(target)
    assert batch.admit(list(enumerate(reqs))) == []
    finished, step_of, n = {}, {}, 0
    while batch.rows:
        n += 1
        for i, res in batch.step():
            finished[i], step_of[i] = res, n
        assert all(not row.finished for row in batch.rows)
    assert step_of[1] < step_of[0] and step_of[2] < step_of[0]
    cut = plain[1].tokens[: plain[1].tokens.index(eos) + 1]
    assert finished[1].tokens == cut and finished[1].stop_reason == "eos"
    assert finished[0].tokens == plain[0].tokens and finished[2].tokens == plain[2].tokens[:6]
    assert batch.cache is None


def test_a_row_joining_mid_flight_decodes_as_alone(big):
    target, head = big
    p = random_prompts(4, seed=5)
    first = [request(target, Eagle3Proposer(head, target), p[0], 20, 3),
             request(target, Eagle3DynamicTreeProposer(head, target, 3, 2, 6), p[1], 20)]
    late = [request(target, Eagle3StaticTreeProposer(head, target, STATIC), p[2], 20),
            request(target, NgramProposer(), p[3], 20, 2)]
    batch = Batch(target)
    batch.admit(list(enumerate(first)))
    batch.step()
    batch.step()
    assert batch.admit([(2, late[0])]) == []  # joins a cache two steps longer than its prompt
    batch.step()
    batch.admit([(3, late[1])])
    got = {}
    while batch.rows:
        got.update(batch.step())
    for i, prompt in enumerate(p):
        assert got[i].tokens == greedy_decode(target, prompt, 20).tokens, i


class ClosingNgram(NgramProposer):
    """An n-gram proposer that records being closed (as suffix decoding closes its request)."""

    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_dropped_row_leaves_its_cache_and_the_others_decode_as_alone(big):
    target, head = big
    p = random_prompts(3, seed=13)
    gone = ClosingNgram()
    reqs = [request(target, Eagle3Proposer(head, target), p[0], 20, 3), request(target, gone, p[1], 20, 2),
            request(target, Eagle3StaticTreeProposer(head, target, STATIC), p[2], 20)]
    batch = Batch(target)
    batch.admit(list(enumerate(reqs)))
    batch.step()
    batch.step()
    assert batch.drop([7]) == []  # no such row: nothing changes
    [(index, partial)] = batch.drop([1])
    assert index == 1 and gone.closed == 1 and [row.index for row in batch.rows] == [0, 2]
    assert 2 < len(partial.tokens) < 20 and partial.tokens == greedy_decode(target, p[1], 20).tokens[: len(partial.tokens)]
    assert batch.cache.layers[0].keys.shape[0] == 2  # its cache row is released
    got = {}
    while batch.rows:
        got.update(batch.step())
    assert got[0].tokens == greedy_decode(target, p[0], 20).tokens
    assert got[2].tokens == greedy_decode(target, p[2], 20).tokens
    batch.admit([(3, request(target, NgramProposer(), p[1], 20, 2))])
    batch.drop([3])
    assert batch.rows == [] and batch.cache is None


def test_continuous_batching_keeps_request_order(big):
    target, head = big
    prompts = random_prompts(7, seed=9)
    reqs = [request(target, Eagle3Proposer(head, target), q, 5 + 3 * i, 3) for i, q in enumerate(prompts)]
    results = decode_batch(target, reqs, batch_size=2)
    assert [r.tokens for r in results] == [greedy_decode(target, q, 5 + 3 * i).tokens
                                           for i, q in enumerate(prompts)]


# --- sampling ------------------------------------------------------------------------------------


def test_a_sampled_row_reproduces_its_decode_alone(big):
    target, head = big
    prompts = random_prompts(3, seed=13)
    reqs = [request(target, SampledEagle3Proposer(head, target), prompts[0], 16, 3, rule="exact", seed=1),
            request(target, Eagle3StaticTreeProposer(head, target, STATIC), prompts[1], 16, rule="exact", seed=2),
            request(target, NO_DRAFT, prompts[2], 16, rule="exact", seed=3, top_p=0.9)]
    got = decode_batch(target, reqs)
    assert got[0].tokens == decode(target, SampledEagle3Proposer(head, target), prompts[0], 16, 3,
                                   rule="exact", seed=1).tokens
    assert got[1].tokens == decode(target, Eagle3StaticTreeProposer(head, target, STATIC), prompts[1], 16,
                                   rule="exact", seed=2).tokens
    assert got[2].tokens == decode(target, NO_DRAFT, prompts[2], 16, rule="exact", seed=3, top_p=0.9).tokens


@pytest.mark.parametrize("loop", ["chain", "tree"])
def test_sampled_rows_match_the_target_per_row(loop):
    """Each batch mixes the tested prompt with a longer filler prompt (its row ragged against the
    others); over 300 seeds the tested rows' first three tokens pass the chi-square test."""
    target, head = build_small()
    prompt, filler = torch.tensor([1, 3, 0, 2, 5, 4, 1]), torch.tensor([2, 2, 4, 1, 0, 3, 5, 1, 4, 0, 2])
    exact = exact_first_tokens(target, prompt, 3, temperature=1.0)

    def proposer():
        if loop == "chain":
            return SampledEagle3Proposer(head, target)
        return Eagle3StaticTreeProposer(head, target, [(0,), (1,), (0, 0), (1, 0), (0, 1)])

    reqs = []
    for seed in range(300):
        reqs.append(request(target, proposer(), prompt, 5 if loop == "chain" else 4, 3, rule="exact", seed=seed))
        reqs.append(request(target, proposer(), filler, 3 + seed % 4, 3, rule="exact", seed=10_000 + seed))
    results = decode_batch(target, reqs, batch_size=8)[::2]
    counts = torch.zeros(V_SMALL ** 3, dtype=torch.long)
    for res in results:
        counts[flat_index(torch.tensor([res.tokens[:3]]), V_SMALL)] += 1
    assert chi2_pvalue(counts, exact) > P_MIN
    accepted = sum(r.step_tokens[0] - 1 for r in results)
    assert accepted > 300 // 4  # drafts were accepted (not plain sampling in disguise)


# --- the ragged cache and masks -----------------------------------------------------------------


def test_batch_mask_golden():
    """Row 0: 2 cached of 3 slots, a 2-node chain; row 1: 3 cached, one node (plus a padding query)."""
    chain = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    mask = batch_mask([chain, torch.ones(1, 1, dtype=torch.bool)], [2, 3], 3, torch.float32, "cpu")
    allowed = (mask[:, 0] == 0).int().tolist()  # [B, N, L + N]
    assert allowed == [[[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                       [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]]
    assert batch_mask([torch.ones(1, 1, dtype=torch.bool)] * 2, [3, 3], 3, torch.float32, "cpu") is None


def test_keep_select_merge_give_each_row_its_own_cache(big):
    """After moving accepted slots, dropping and stacking rows, each row's valid slots equal the
    cache a single-row prefill of its tokens builds."""
    target, _ = big
    seqs = [torch.arange(5) + 3, torch.arange(8) + 20, torch.arange(3) + 40]
    caches = []
    for s in seqs[:2]:
        cache = new_cache(target)
        target_step(target, s[None], 0, cache)
        caches.append(cache)
    refs = [[layer.keys.clone() for layer in c.layers] for c in caches]
    both = merge_rows(merge_rows(None, caches[0]), caches[1])  # [2, heads, 8, d]: row 0 has 3 stale slots
    assert both.get_seq_length() == 8
    # pretend a step appended 3 slots per row and row 0 accepted nodes 0 and 2, row 1 node 0
    for layer in both.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)
            setattr(layer, name, torch.cat([x, torch.randn(2, x.shape[1], 3, x.shape[3], dtype=x.dtype)], -2))
    appended = [layer.keys[:, :, 8:].clone() for layer in both.layers]
    lengths = keep_paths(both, [5, 8], 8, [[0, 2], [0]])
    assert lengths == [7, 9] and both.get_seq_length() == 9
    for layer, new in zip(both.layers, appended):
        assert torch.equal(layer.keys[0, :, 5], new[0, :, 0]) and torch.equal(layer.keys[0, :, 6], new[0, :, 2])
        assert torch.equal(layer.keys[1, :, 8], new[1, :, 0])
    for layer, ref0, ref1 in zip(both.layers, *refs):
        assert torch.equal(layer.keys[0, :, :5], ref0[0]) and torch.equal(layer.keys[1, :, :8], ref1[0])
    select_rows(both, [1], [9])
    assert both.get_seq_length() == 9 and both.layers[0].keys.shape[0] == 1
    with pytest.raises(DecodeError, match="sliding-window"):
        both.layers[0].is_sliding = True
        select_rows(both, [0], [9])


# --- refusals ------------------------------------------------------------------------------------


def test_refusals():
    target = make_target()
    shared = NgramProposer()
    reqs = [request(target, shared, [1, 2, 3], 4, 2), request(target, shared, [4, 5], 4, 2)]
    with pytest.raises(DecodeError, match="share one proposer"):
        decode_batch(target, reqs)
    with pytest.raises(DecodeError, match="batch_size must be >= 1"):
        decode_batch(target, [request(target, NO_DRAFT, [1], 2)], 0)
    flash = make_target()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DecodeError, match="batched decoding needs per-row 4-D masks"):
        decode_batch(flash, [request(flash, NO_DRAFT, [1], 2), request(flash, NO_DRAFT, [2], 2)], 2)
    both = decode_batch(target, [request(target, NO_DRAFT, [1, 2], 0), request(target, NO_DRAFT, [3], 3)])
    assert both[0].tokens == [] and both[0].stats.prefill_forwards == 0
    assert both[1].tokens == greedy_decode(target, [3], 3).tokens and VOCAB > max(both[1].tokens)
