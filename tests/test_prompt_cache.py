"""Prefills kept across decode calls (`verify.prompt_cache`): a later method's requests of the same
prompts reuse them and decode exactly as if they had prefilled; hits are booked as the prefill they
replace; the kept tensors are never written; the byte budget holds."""

from __future__ import annotations

import pytest
import torch
from test_batch_draft import prompts
from test_sampling import build_small

from specheads.verify.eagle3_proposers import Eagle3Proposer
from specheads.verify.loop import decode_batch, greedy_decode, request
from specheads.verify.ngram_proposers import NO_DRAFT
from specheads.verify.prompt_cache import PromptCache


@pytest.fixture(scope="module")
def small():
    return build_small()


def snapshot(kept: PromptCache) -> list[torch.Tensor]:
    return [t.clone() for e in kept.entries.values() for t in (*e.keys, *e.values, *e.output.hidden.values())]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_later_method_reuses_the_prefills_and_decodes_as_if_it_had_prefilled(small, batch_size):
    target, head = small
    ps = prompts(5, seed=21)
    layers = Eagle3Proposer(head, target).layers
    kept = PromptCache(layers)
    plain = decode_batch(target, [request(target, NO_DRAFT, p, 12) for p in ps], batch_size, kept)
    assert (kept.hits, kept.misses, len(kept.entries)) == (0, 5, 5)
    before = snapshot(kept)
    drafted = decode_batch(target, [request(target, Eagle3Proposer(head, target), p, 12, 3) for p in ps],
                           batch_size, kept)
    assert (kept.hits, kept.misses) == (5, 5)
    fresh = decode_batch(target, [request(target, Eagle3Proposer(head, target), p, 12, 3) for p in ps], batch_size)
    for p, a, b, c in zip(ps, plain, drafted, fresh):
        assert a.tokens == b.tokens == c.tokens == greedy_decode(target, p, 12).tokens
        assert b.step_proposed == c.step_proposed and b.step_tokens == c.step_tokens
        assert b.stats.prefill_forwards == 1 and b.stats.target_prefill_s == a.stats.target_prefill_s > 0
        assert b.stats.wall_s >= b.stats.target_prefill_s
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(kept), strict=True))  # never written


def test_a_prefill_without_the_layers_a_request_reads_is_a_miss(small):
    target, head = small
    ps = prompts(2, seed=22)
    kept = PromptCache()  # keeps no hidden states
    decode_batch(target, [request(target, NO_DRAFT, p, 4) for p in ps], 2, kept)
    got = decode_batch(target, [request(target, Eagle3Proposer(head, target), p, 6, 2) for p in ps], 2, kept)
    assert (kept.hits, kept.misses) == (0, 4)
    assert [r.tokens for r in got] == [greedy_decode(target, p, 6).tokens for p in ps]


def test_the_byte_budget_keeps_the_first_prompts_and_nothing_after(small):
    target, _ = small
    ps = prompts(6, seed=23, max_len=12)
    probe = PromptCache()
    decode_batch(target, [request(target, NO_DRAFT, ps[0], 2)], 1, probe)
    one = probe.bytes  # one entry of the first prompt
    kept = PromptCache(max_bytes=one * 2 + 1)
    decode_batch(target, [request(target, NO_DRAFT, p, 2) for p in ps], 1, kept)
    assert kept.full and kept.bytes <= kept.max_bytes and 1 <= len(kept.entries) < 6
    assert list(kept.entries)[0] == tuple(ps[0].tolist())  # the first prompt stayed
