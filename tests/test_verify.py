"""Speculative chain decoding equals plain greedy decoding; counts, proposers and errors.

Equality tests run the tiny random target in float64 so that batched-vs-sequential numerics can
never flip an argmax tie: any difference is then a real bookkeeping bug.
"""

from __future__ import annotations

import pytest
import torch
from random_models import CTX, VOCAB, make_head, make_target
from transformers import DynamicCache, LlamaConfig

from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.target import Target, TargetError
from specheads.verify.eagle3_proposers import Eagle3Proposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.ngram_proposers import NgramProposer, lookup_continuation
from specheads.verify.rules import accepted_prefix
from specheads.verify.steps import DecodeError, causal_mask, trim_cache


def random_prompts(n: int, seed: int, max_len: int = 24) -> list[torch.Tensor]:
    """Random prompts, half of them with a repeated chunk (so prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = int(torch.randint(1, max_len, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        prompts.append(torch.cat([ids, ids[: length // 2]]) if i % 2 else ids)
    return prompts


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def target(request) -> Target:
    return make_target(request.param)


def naive_greedy(target: Target, prompt: torch.Tensor, n: int) -> list[int]:
    """Reference without any cache: re-run the whole sequence for every token."""
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(target.forward(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[prompt.numel():]


def check_counts(res, max_new: int) -> None:
    s = res.stats
    assert s.tokens == len(res.tokens) <= max_new
    assert s.prefill_forwards == 1 and s.tokens == 1 + s.decode_tokens
    assert s.decode_forwards == len(res.step_tokens) == len(res.step_proposed)
    assert sum(res.step_tokens) == s.decode_tokens
    assert s.proposed_tokens == sum(res.step_proposed)
    assert s.drafts == sum(1 for p in res.step_proposed if p > 0)
    acc = s.accepted_per_pos
    assert all(a >= b for a, b in zip([s.drafts] + acc, acc))  # cumulative: non-increasing
    if res.stop_reason == "length":  # every decode forward emits accepted + 1
        assert s.decode_tokens == s.decode_forwards + sum(acc)
    assert s.summary()["tau"] == pytest.approx(s.decode_tokens / max(s.decode_forwards, 1))
    assert s.wall_s >= s.target_decode_s + s.proposer_s > 0


# --- equality with plain greedy decoding --------------------------------------------------------


def test_greedy_decode_matches_uncached_reference(target):
    for prompt in random_prompts(3, seed=5):
        res = greedy_decode(target, prompt, 12)
        assert res.tokens == naive_greedy(target, prompt, 12)
        assert res.stats.decode_forwards == 11 and res.stats.drafts == 0
        assert res.stats.summary()["tau"] == 1.0


# proposer -> (its factory, whether it must get drafts accepted on these prompts)
PROPOSERS = {"eagle3": (lambda head, target: Eagle3Proposer(head, target), False),
             "ngram": (lambda head, target: NgramProposer(), True)}  # partial acceptance and cache trimming


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_speculative_equals_greedy(target, name):
    head, (make, must_accept) = make_head(target, target.config._attn_implementation), PROPOSERS[name]
    accepted = 0
    for prompt in random_prompts(4, seed=11):
        ref = greedy_decode(target, prompt, 30)
        for k in (1, 2, 4):
            res = decode(target, make(head, target), prompt, 30, k)
            assert res.tokens == ref.tokens, (name, k, prompt.tolist())
            check_counts(res, 30)
            assert res.stats.drafts > 0
            accepted += sum(res.stats.accepted_per_pos)
    assert accepted > 0 or not must_accept


def test_eos_stops_both_loops_at_the_same_token(target):
    prompt = random_prompts(1, seed=3)[0]
    ref = greedy_decode(target, prompt, 30)
    eos = ref.tokens[7]
    plain = greedy_decode(target, prompt, 30, eos_token_ids=[eos])
    cut = ref.tokens.index(eos) + 1
    assert plain.tokens == ref.tokens[:cut] and plain.stop_reason == "eos"
    for k in (1, 2, 4):
        for proposer in (NgramProposer(), Oracle(ref.tokens, prompt.numel())):
            res = decode(target, proposer, prompt, 30, k, eos_token_ids=[eos])
            assert res.tokens == plain.tokens and res.stop_reason == "eos"
            check_counts(res, 30)


# --- stub proposers: exact tau ---------------------------------------------------------------


class Oracle:
    """Proposes the target's own greedy continuation (`wrong`: every token shifted by one)."""

    layers: list[int] = []

    def __init__(self, reference: list[int], prompt_len: int, wrong: bool = False):
        self.reference, self.prompt_len, self.wrong = reference, prompt_len, wrong

    def start(self, prompt_ids, first_token, out):
        self.emitted = 1

    def propose(self, k):
        ids = torch.tensor(self.reference[self.emitted: self.emitted + k], dtype=torch.long)
        return (ids + 1) % VOCAB if self.wrong else ids

    def accept(self, inputs, following, out, start):
        assert start == self.prompt_len + self.emitted - 1 and inputs.numel() == following.numel()
        self.emitted += following.numel()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_oracle_proposer_gives_tau_k_plus_one(target, k):
    prompt = random_prompts(2, seed=7)[1]
    steps = 6
    max_new = 1 + steps * (k + 1)  # the prefill's token + `steps` full chains
    ref = greedy_decode(target, prompt, max_new + 5)
    res = decode(target, Oracle(ref.tokens, prompt.numel()), prompt, max_new, k)
    assert res.tokens == ref.tokens[:max_new]
    summary = res.stats.summary()
    assert summary["tau"] == k + 1 and res.stats.decode_forwards == steps
    assert summary["acceptance_per_position"] == [1.0] * k
    check_counts(res, max_new)
    # a budget that is not a multiple: only the last step is shorter, never past max_new
    res = decode(target, Oracle(ref.tokens, prompt.numel()), prompt, max_new + 2, k)
    assert res.tokens == ref.tokens[: max_new + 2]
    assert res.step_tokens == [k + 1] * steps + [2]  # remaining 2 -> propose 1


@pytest.mark.parametrize("k", [1, 2, 4])
def test_always_wrong_proposer_gives_tau_one(target, k):
    prompt = random_prompts(1, seed=8)[0]
    ref = greedy_decode(target, prompt, 25)
    res = decode(target, Oracle(ref.tokens, prompt.numel(), wrong=True), prompt, 25, k)
    assert res.tokens == ref.tokens
    assert res.stats.summary()["tau"] == 1.0 and res.stats.accepted_per_pos == [0] * k
    assert res.stats.drafts == res.stats.decode_forwards - 1  # the last step has no room to draft
    check_counts(res, 25)


# --- the EAGLE-3 proposer's incremental state --------------------------------------------------


def reference_draft(head, target, seq: list[int], k: int) -> list[int]:
    """Draft tokens recomputed from scratch: a fresh target forward and a fresh draft cache."""
    ids = torch.tensor([seq])
    out = target.forward(ids[:, :-1], layers=head.required_layers())
    n = ids.shape[1] - 1
    hidden = head.fuse([out.hidden[i] for i in head.required_layers()])
    cache = DynamicCache()
    o = head.step(hidden, target.embed(ids[:, 1:]), torch.arange(n)[None],
                  causal_mask(0, n, hidden.dtype, "cpu"), cache)[:, -1:]
    tokens = []
    for j in range(k):
        if j:
            o = head.step(o, target.embed(torch.tensor([[tokens[-1]]])), torch.tensor([[n - 1 + j]]),
                          None, cache)
        tokens.append(int(head.to_target_ids(head.logits(o)[0, -1].argmax())))
    return tokens


class CheckedEagle(Oracle):
    """Checks Eagle3Proposer against `reference_draft`, but proposes the oracle's tokens with one
    corrupted position, so that accept() sees multi-row, partially accepted steps."""

    def __init__(self, inner, reference, prompt, seed=0):
        super().__init__(reference, prompt.numel())
        self.inner, self.layers, self.prompt = inner, inner.layers, prompt
        self.gen = torch.Generator().manual_seed(seed)
        self.checked = 0

    def start(self, prompt_ids, first_token, out):
        super().start(prompt_ids, first_token, out)
        self.inner.start(prompt_ids, first_token, out)

    def propose(self, k):
        seq = self.prompt.tolist() + self.reference[: self.emitted]
        got = self.inner.propose(k).tolist()
        assert got == reference_draft(self.inner.head, self.inner.target, seq, k)
        self.checked += 1
        ids = super().propose(k)
        bad = int(torch.randint(0, k + 1, (1,), generator=self.gen))
        if bad < ids.numel():
            ids[bad] = (ids[bad] + 1) % VOCAB
        return ids

    def accept(self, inputs, following, out, start):
        super().accept(inputs, following, out, start)
        self.inner.accept(inputs, following, out, start)


@pytest.mark.parametrize("k", [1, 3])
def test_eagle3_proposer_state_equals_recompute(target, k):
    head = make_head(target, target.config._attn_implementation)
    prompt = random_prompts(2, seed=9)[1]
    ref = greedy_decode(target, prompt, 30)
    checked = CheckedEagle(Eagle3Proposer(head, target), ref.tokens, prompt)
    res = decode(target, checked, prompt, 30, k)
    assert res.tokens == ref.tokens and checked.checked == res.stats.drafts > 5
    assert any(1 < t for t in res.step_tokens)  # multi-row accepts happened


def test_eagle3_proposer_refuses_a_head_for_another_target():
    target = make_target()
    other = LlamaConfig(vocab_size=VOCAB + 8, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=8, num_attention_heads=4, max_position_embeddings=CTX)
    head = Eagle3Head.for_target(Eagle3Options(draft_vocab_size=64), other)
    with pytest.raises(TargetError, match="vocab_size"):
        Eagle3Proposer(head, target)


# --- bad input ---------------------------------------------------------------------------------


def test_errors_for_bad_prompts():
    target = make_target()
    with pytest.raises(DecodeError, match="empty"):
        greedy_decode(target, [], 4)
    with pytest.raises(DecodeError, match="max_position_embeddings"):
        decode(target, NgramProposer(), list(range(CTX)), 4, k=2)
    with pytest.raises(DecodeError, match="0..95"):
        greedy_decode(target, [VOCAB], 4)
    with pytest.raises(DecodeError, match="k"):
        decode(target, NgramProposer(), [1, 2], 4, k=-1)


def test_output_is_clamped_to_the_context():
    target = make_target()
    prompt = list(range(CTX - 5))
    res = decode(target, NgramProposer(), prompt, 50, k=4)
    assert len(res.tokens) == 5 and res.tokens == greedy_decode(target, prompt, 50).tokens
    assert greedy_decode(target, prompt, 0).tokens == []


# --- pure helpers ------------------------------------------------------------------------------


def test_lookup_continuation():
    t = torch.tensor
    assert lookup_continuation(t([1, 2, 3, 9, 8, 1, 2, 3, 7, 7, 1, 2, 3]), 3).tolist() == [7, 7, 1]
    assert lookup_continuation(t([1, 2, 3, 4]), 3).tolist() == []  # no earlier n-gram
    assert lookup_continuation(t([4, 2, 9, 4]), 3).tolist() == [2, 9, 4]  # falls back to n = 1
    assert lookup_continuation(t([5] * 10), 4).tolist() == [5] * 4  # overlapping match, full k
    assert lookup_continuation(t([7]), 3).tolist() == []
    assert lookup_continuation(t([4, 2, 9, 4]), 3, min_ngram=2).tolist() == []


def test_accepted_prefix_and_mask_and_trim():
    t = torch.tensor
    assert accepted_prefix(t([3, 4, 5]), t([3, 4, 6, 1])) == 2
    assert accepted_prefix(t([3, 4, 5]), t([0, 4, 5, 1])) == 0
    assert accepted_prefix(t([], dtype=torch.long), t([7])) == 0
    assert causal_mask(4, 1, torch.float32, "cpu") is None
    m = causal_mask(2, 3, torch.float32, "cpu")[0, 0]  # [3, 5]
    assert (m == 0).tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False],
                                 [True] * 5]
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), 0)
    trim_cache(cache, 7)
    trim_cache(cache, 4)
    assert cache.get_seq_length() == 4
    with pytest.raises(DecodeError):
        trim_cache(cache, 5)
