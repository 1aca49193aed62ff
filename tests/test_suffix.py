"""Suffix decoding: the library's drafts, fed as vLLM feeds it; lossless through the chain and tree
verifiers; a global cache that helps later requests and stays within its bound."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from arctic_inference.suffix_decoding import SuffixDecodingCache
from random_models import make_target

from specheads.verify.loop import decode, decode_batch, greedy_decode, request
from specheads.verify.suffix_proposers import SuffixProposer, SuffixSettings, SuffixTreeProposer
from specheads.verify.trees import SettingsError


def stream(n: int, seed: int = 0) -> list[int]:
    """A token stream with repeated spans (what suffix trees feed on) and some noise."""
    g = torch.Generator().manual_seed(seed)
    spans = [torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
             for _ in range(6)]
    out = []
    while len(out) < n:
        out += spans[int(torch.randint(0, len(spans), (1,), generator=g))]
        out += torch.randint(3, 60, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist()
    return out[:n]


def test_drafts_equal_the_librarys_fed_as_vllm_feeds_it():
    """vLLM 0.33 (v1/spec_decode/suffix_decoding.py): start_request(prompt), add_active_response(the
    step's new tokens), speculate(the last max_tree_depth tokens, max_spec_tokens=k)."""
    tokens, s = stream(400, seed=1), SuffixSettings()
    ours, ref = SuffixProposer(s), SuffixDecodingCache(s.max_tree_depth, s.max_cached_requests)
    prompt, pos, steps, drafted = tokens[:60], 60, 0, 0
    ours.start(torch.tensor(prompt), tokens[pos])
    ref.start_request("r", prompt)
    ref.add_active_response("r", [tokens[pos]])
    pos += 1
    g = torch.Generator().manual_seed(2)
    while pos < len(tokens) - 4:
        k = int(torch.randint(1, 6, (1,), generator=g))
        want = ref.speculate("r", tokens[max(0, pos - s.max_tree_depth):pos], max_spec_tokens=k,
                             max_spec_factor=s.max_spec_factor, min_token_prob=s.min_token_prob)
        got = ours.propose(k)
        assert got.tolist() == want.token_ids and ours.score == pytest.approx(want.score)
        drafted += len(want.token_ids)
        step = tokens[pos:pos + int(torch.randint(1, 4, (1,), generator=g))]
        ours.accept(None, torch.tensor(step))
        ref.add_active_response("r", step)
        pos, steps = pos + len(step), steps + 1
    assert steps > 100 and drafted > 50  # the stream's repeats were drafted


@pytest.fixture(scope="module")
def target():
    return make_target("sdpa")


@pytest.mark.parametrize("make", [SuffixProposer, SuffixTreeProposer])
def test_suffix_decoding_is_greedy_equal(target, make):
    proposer, drafted = make(), 0
    for seed in range(4):
        prompt = torch.tensor(stream(48, seed=seed))
        ref = greedy_decode(target, prompt, 40)
        res = decode(target, proposer, prompt, 40, 4)  # CTX 96: prompt 48 + 40
        assert res.tokens == ref.tokens, (make.__name__, seed)
        drafted += res.stats.proposed_tokens
    assert drafted > 0


def test_the_global_cache_serves_later_requests_and_stays_bounded():
    proposer = SuffixProposer(SuffixSettings(max_cached_requests=3))
    proposer.start(torch.tensor([1, 2, 3]), 40)
    proposer.accept(None, torch.tensor([41, 42, 43, 44, 45]))
    proposer.start(torch.tensor([9, 8, 41, 42]), 43)  # an unrelated prompt that meets the last output
    assert proposer.propose(2).tolist() == [44, 45]
    for i in range(20):
        proposer.start(torch.tensor([7, i + 100]), 5)
        proposer.accept(None, torch.tensor([6, 7, 8]))
        assert len(proposer.cache.cached_requests) <= 3
    assert len(proposer.cache.active_requests) == 1


@pytest.mark.parametrize("make", [SuffixProposer, SuffixTreeProposer])
def test_forks_decode_a_batch_over_one_cache_and_close_their_requests(target, make):
    """Batch rows get forks (one global cache, a request each); each row equals its plain greedy
    decode and, once finished, leaves the cache with no active request and <= max_cached_requests."""
    shared = make(SuffixSettings(max_cached_requests=3))
    prompts = [torch.tensor(stream(40 + 2 * i, seed=i)) for i in range(5)]
    forks = [shared.fork() for _ in prompts]
    assert all(f.cache is shared.cache for f in forks) and len({id(f) for f in forks}) == len(forks)
    results = decode_batch(target, [request(target, f, p, 30, 4) for f, p in zip(forks, prompts)], 3)
    for prompt, res in zip(prompts, results):
        assert res.tokens == greedy_decode(target, prompt, 30).tokens
    assert sum(r.stats.proposed_tokens for r in results) > 0
    assert len(shared.cache.active_requests) == 0
    assert len(shared.cache.cached_requests) == 3


def test_a_missing_library_names_the_make_target(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(SettingsError, match="make suffix"):
        SuffixProposer()


def test_path_reliability_golden():
    """Reported 0.5, 0.5, 0.5 (bin 10 of 20): the first kept, the second missed (the third lost with
    it) -> 1 of 3 kept; with a prior of 2 tokens at 0.5, (1 + 1) / (3 + 2) = 0.4. Tokens past what the
    target settled are not counted; survival is non-increasing and starts at the reported value."""
    from specheads.verify.suffix_proposers import PathReliability

    r = PathReliability(bins=20, prior=2.0)
    assert r.survival([0.9, 0.95, 0.3]) == [0.9, 0.9, 0.3]  # nothing seen yet: the reported values, monotone
    r.record([0.5, 0.5, 0.5], [7, 8, 9], [7, 1])
    assert (r.shown[10], r.kept[10]) == (3, 1) and r(0.5) == pytest.approx(0.4)
    r.record([0.5, 0.5], [7, 8], [7])  # censored after the first token: one more kept, nothing else
    assert (r.shown[10], r.kept[10]) == (4, 2) and r(0.5) == pytest.approx(3 / 6)
    assert r.survival([0.5, 0.9]) == [pytest.approx(0.5), pytest.approx(0.5)]  # 0.9: its bin says 0.9, capped


def test_the_proposer_learns_how_its_paths_hold(target):
    """Decoding records every settled path token in the shared reliability (forks included), a fixed
    set of counters however long it runs; `survival` reads it."""
    shared = SuffixProposer()
    for seed in range(3):
        decode(target, shared.fork(), torch.tensor(stream(48, seed=seed)), 40, 4)
    r = shared.reliability
    assert sum(r.shown) > 20 and 0 < sum(r.kept) < sum(r.shown) and len(r.shown) == r.bins
    fork = shared.fork()
    seen = stream(48, seed=0)  # a prompt the cache holds, up to its last token: its continuation is known
    fork.start(torch.tensor(seen[:-1]), seen[-1])
    draft = fork.propose(4).tolist()
    assert draft and fork.survival(len(draft)) == r.survival(fork.probs[:len(draft)])


def test_a_warm_cache_drafts_from_earlier_answers():
    """`warm` puts (prompt, answer) pairs in the global cache as finished requests: a new request that
    meets an answer's start drafts its continuation; the cache bound still holds."""
    proposer = SuffixProposer(SuffixSettings(max_cached_requests=4))
    proposer.warm([([1, 2, 3], [41, 42, 43, 44, 45])] + [([9, i], [50 + i, 51]) for i in range(6)])
    assert len(proposer.cache.cached_requests) == 4 and not proposer.cache.active_requests
    proposer.warm([([1, 2, 3], [41, 42, 43, 44, 45])])
    proposer.start(torch.tensor([7, 41, 42]), 43)
    assert proposer.propose(2).tolist() == [44, 45]


def test_history_pairs_reads_every_answer_and_refuses_none(tmp_path, tiny_target_dir):
    from specheads.data.conversations import DataError
    from specheads.data.prompts import encode_chat
    from specheads.data.suffix_history import history_pairs
    from specheads.target import Target

    tok = Target.load(str(tiny_target_dir), device="cpu").tokenizer
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure thing"}]
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps({"messages": conv}) + "\n")
    pairs = history_pairs(path, tok)
    assert [a for _, a in pairs] == [tok.encode("hello there", add_special_tokens=False),
                                     tok.encode("sure thing", add_special_tokens=False)]
    assert pairs[1][0] == encode_chat(tok, conv[:3])
    path.write_text(json.dumps({"messages": conv[:1]}) + "\n")
    with pytest.raises(DataError, match="no assistant"):
        history_pairs(path, tok)
