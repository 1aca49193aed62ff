"""Hybrid proposers (a model drafter beside suffix decoding or prompt lookup): choose and union modes
greedy-equal to plain decoding, the union trie, the choice rule, sampling losslessness (chi-square,
as in test_sampling) and the unused proposer left exactly in step."""

from __future__ import annotations

import pytest
import torch
from random_models import make_head, make_target
from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

from specheads.verify.eagle3_proposers import Eagle3Proposer, SampledEagle3Proposer
from specheads.verify.hybrid_proposers import (
    AcceptanceMeter,
    HybridProposer,
    SampledHybridProposer,
    UnionProposer,
    hybrid_proposer,
    union_tree,
)
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.ngram_proposers import NgramProposer
from specheads.verify.suffix_proposers import SuffixProposer, SuffixTreeProposer
from specheads.verify.trees import SettingsError, chain_tree, tree_from_parents


def stream(n: int, seed: int, vocab: int = 60) -> list[int]:
    """Tokens with repeated spans (what suffix trees and prompt lookup feed on) and some noise."""
    g = torch.Generator().manual_seed(seed)
    spans = [torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
             for _ in range(5)]
    out: list[int] = []
    while len(out) < n:
        out += spans[int(torch.randint(0, len(spans), (1,), generator=g))]
        out += torch.randint(3, vocab, (int(torch.randint(0, 2, (1,), generator=g)),), generator=g).tolist()
    return out[:n]


class Stub:
    """A chain proposer stub: a fixed draft and (optionally) a suffix-style score."""

    layers: list[int] = []

    def __init__(self, draft: list[int], score: float | None = None):
        self.draft = draft
        if score is not None:
            self.score = score

    def start(self, prompt_ids, first_token, out=None) -> None:
        pass

    def propose(self, k: int) -> torch.Tensor:
        return torch.tensor(self.draft[:k], dtype=torch.long)

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        pass


class StubTree(Stub):
    def __init__(self, parents: list[int], tokens: list[int]):
        super().__init__(tokens)
        self.parents = parents

    def propose_tree(self):
        return tree_from_parents(self.parents), torch.tensor(self.draft)


@pytest.fixture(scope="module")
def big():
    target = make_target("sdpa")
    return target, make_head(target)


# --- greedy equality ------------------------------------------------------------------------------

FREE = {"suffix": SuffixProposer, "ngram": NgramProposer}
MODES = {  # name: (mode, rule, model_k, free_k under the loop's k)
    "choose_arctic": ("choose", "arctic", None, None),
    "choose_arctic_longer_free": ("choose", "arctic", 1, None),
    "choose_measured": ("choose", "measured", None, None),
    "union": ("union", "arctic", None, None),
}


@pytest.mark.parametrize("free", list(FREE))
@pytest.mark.parametrize("mode", list(MODES))
def test_hybrid_is_greedy_equal(big, free, mode):
    target, head = big
    kind, rule, model_k, free_k = MODES[mode]
    steps: dict = {}
    for seed, k in [(0, 2), (1, 3), (2, 4), (3, 3)]:
        hybrid = hybrid_proposer(Eagle3Proposer(head, target), FREE[free](), kind, k, rule, model_k, free_k)
        prompt = torch.tensor(stream(40, seed=seed))
        ref = greedy_decode(target, prompt, 40)
        res = decode(target, hybrid, prompt, 40, k)  # CTX 96: prompt 40 + 40
        assert res.tokens == ref.tokens, (mode, free, seed, k)
        for name, n in hybrid.summary()["steps"].items():
            steps[name] = steps.get(name, 0) + n
    assert res.stats.proposed_tokens > 0
    if model_k is not None or rule == "measured":
        assert steps.get("model", 0) > 0 and steps.get("free", 0) > 0, steps  # both drafts were verified
    if kind == "union":
        assert steps.get("free", 0) + steps.get("both", 0) > 0, steps  # the free branch was accepted


def test_union_with_a_suffix_tree_is_greedy_equal(big):
    target, head = big
    for seed in range(3):
        prompt = torch.tensor(stream(40, seed=seed))
        union = UnionProposer(Eagle3Proposer(head, target), SuffixTreeProposer(), k=3)
        assert decode(target, union, prompt, 40).tokens == greedy_decode(target, prompt, 40).tokens


# --- the union trie -------------------------------------------------------------------------------


def test_union_merges_a_shared_prefix():
    """model 5 6 7, free 5 6 9 8: root -> 5 -> 6 -> {7, 9 -> 8}: 5 draft nodes, not 7."""
    trie = union_tree([("model", chain_tree(3), [5, 6, 7]), ("free", chain_tree(4), [5, 6, 9, 8])])
    tree, tokens = trie.tree()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 4] and tokens.tolist() == [5, 6, 7, 9, 8]
    assert trie.origin == [set(), {"model", "free"}, {"model", "free"}, {"model"}, {"free"}, {"free"}]
    assert trie.walk([5, 6, 9]) == 4 and trie.walk([]) == 0


def test_union_merges_a_free_tree_into_the_model_chain():
    """free tree root -> {5 -> {6, 4}, 3}; model chain 5 6 7."""
    union = UnionProposer(Stub([5, 6, 7]), StubTree([-1, 0, 1, 1, 0], [5, 6, 4, 3]), k=3)
    tree, tokens = union.propose_tree()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 0] and tokens.tolist() == [5, 6, 7, 4, 3]
    union.accept(torch.tensor([1, 5, 4]), torch.tensor([5, 4, 2]), None, 0)
    union.propose_tree()
    union.accept(torch.tensor([1, 5, 6]), torch.tensor([5, 6, 2]), None, 0)
    union.propose_tree()
    union.accept(torch.tensor([1]), torch.tensor([2]), None, 0)
    assert union.summary()["steps"] == {"free": 1, "both": 1, "none": 1}


# --- the choice rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("score,model_n,want", [
    (3.0, 3, "free"), (2.99, 3, "model"), (3.5, 3, "free"), (0.0, 0, "free"), (1.0, 2, "model"),
])
def test_choose_takes_the_free_draft_exactly_when_its_score_reaches_the_model_length(score, model_n, want):
    hybrid = HybridProposer(Stub([10, 11, 12][:model_n]), Stub([20, 21, 22, 23], score=score))
    got = hybrid.propose(4).tolist()
    assert hybrid.chosen == want and hybrid.counts == {want: 1}
    assert got == ([20, 21, 22, 23] if want == "free" else [10, 11, 12][:model_n])


def test_choose_with_empty_drafts_and_caps():
    assert HybridProposer(Stub([]), Stub([], score=0.0)).propose(3).tolist() == []
    assert HybridProposer(Stub([1, 2]), Stub([], score=5.0)).propose(3).tolist() == [1, 2]
    capped = HybridProposer(Stub([1, 2, 3]), Stub([4, 5, 6, 7, 8], score=2.0), model_k=2)
    assert capped.propose(5).tolist() == [4, 5, 6, 7, 8]  # score 2 >= the model's 2 (capped) drafts


def test_ngram_estimate_is_measured_online():
    meter = AcceptanceMeter()
    assert meter.rate == 0.5 and meter.expected(2) == pytest.approx(0.75)
    meter.record([1, 2, 3], [1, 2, 9, 4])  # 2 hits, then a miss
    meter.record([5, 6], [5])  # 1 hit; 6 was never settled (censored)
    assert (meter.tried, meter.hits) == (4, 3) and meter.rate == pytest.approx(4 / 6)
    hybrid = HybridProposer(Stub([1, 2]), Stub([7, 8, 9]))
    hybrid.meters["free"].hits = hybrid.meters["free"].tried = 1000  # a near-perfect n-gram record
    assert hybrid.propose(3).tolist() == [7, 8, 9] and hybrid.free_score > 2


def test_choose_refuses_trees_and_unknown_rules():
    with pytest.raises(SettingsError, match="union"):
        HybridProposer(Stub([1]), SuffixTreeProposer())
    with pytest.raises(SettingsError, match="rule"):
        HybridProposer(Stub([1]), Stub([2]), rule="best")
    with pytest.raises(SettingsError, match="does not sample"):
        SampledHybridProposer(Stub([1]), Stub([2]))


# --- the unused proposer stays in step ------------------------------------------------------------


class Spy:
    """Records what a proposer was fed and what it drafted, step by step."""

    def __init__(self, inner):
        self.inner, self.layers = inner, inner.layers
        self.fed: list[tuple] = []
        self.drafts: list[list[int]] = []

    def start(self, prompt_ids, first_token, out) -> None:
        self.fed.append(("start", prompt_ids, first_token, out))
        self.inner.start(prompt_ids, first_token, out)

    def propose(self, k: int) -> torch.Tensor:
        draft = self.inner.propose(k)
        self.drafts.append(draft.tolist())
        return draft

    def accept(self, inputs, following, out, start) -> None:
        self.fed.append(("accept", inputs, following, out, start))
        self.inner.accept(inputs, following, out, start)


class Recording(HybridProposer):
    """Keeps every step's choice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history: list[str] = []

    def record(self, model: list[int], free: list[int]) -> str:
        self.history.append(super().record(model, free))
        return self.history[-1]


def test_an_unused_model_proposer_drafts_as_a_fresh_one_fed_the_same_tokens(big):
    """Steps after a free draft was verified: the EAGLE-3 proposer (whose draft forwards were
    discarded) drafts what a fresh proposer fed only start + the same accepts drafts."""
    target, head = big
    k, checked = 4, 0
    for seed in range(3):
        spy = Spy(Eagle3Proposer(head, target))
        hybrid = Recording(spy, SuffixProposer(), model_k=2)
        chosen = hybrid.history
        prompt = torch.tensor(stream(40, seed=seed))
        assert decode(target, hybrid, prompt, 40, k).tokens == greedy_decode(target, prompt, 40).tokens
        fresh = Eagle3Proposer(head, target)
        fresh.start(*spy.fed[0][1:])
        for step, (_, inputs, following, out, start) in enumerate(spy.fed[1:], start=1):
            fresh.accept(inputs, following, out, start)
            if chosen[step - 1] == "free" and step < len(spy.drafts):
                assert fresh.propose(len(spy.drafts[step])).tolist() == spy.drafts[step], (seed, step)
                checked += 1
    assert checked > 0


def test_an_unused_free_proposer_stays_in_step(big):
    """Prompt lookup / suffix trees fed every accepted step keep the whole context."""
    target, head = big
    prompt = torch.tensor(stream(40, seed=5))
    for free in (NgramProposer(), SuffixProposer()):
        hybrid = HybridProposer(Eagle3Proposer(head, target), free)
        res = decode(target, hybrid, prompt, 30, 3)
        seen, want = [int(t) for t in free.context], prompt.tolist() + res.tokens
        assert seen == want[:len(seen)] and len(seen) >= len(want) - 4  # all but the last step


# --- sampling -------------------------------------------------------------------------------------


class ContextFree:
    """A deterministic free draft from the verified context: last + 1, + 2, ... (mod V), scored
    high after an even token and low after an odd one, so both drafts get verified."""

    layers: list[int] = []

    def start(self, prompt_ids, first_token, out=None) -> None:
        self.context = prompt_ids.reshape(-1).tolist() + [int(first_token)]

    def propose(self, k: int) -> torch.Tensor:
        last = self.context[-1]
        self.score = float(k) if last % 2 == 0 else 0.0
        return torch.tensor([(last + i) % V_SMALL for i in range(1, k + 1)])

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        self.context += following.reshape(-1).tolist()


@pytest.fixture(scope="module")
def small():
    return build_small()


@pytest.mark.parametrize("mode", ["choose", "union"])
def test_sampled_hybrid_output_matches_the_target(small, mode):
    target, head = small
    prompt, n, warping = torch.tensor([1, 3, 0, 2, 5, 4, 1]), 3, {"temperature": 1.0}
    exact = exact_first_tokens(target, prompt, n, **warping)
    counts = torch.zeros(V_SMALL ** n, dtype=torch.long)
    steps: dict = {}
    # choose: a choice that reads the model's sampled first token (even -> free draft) passed at 300
    # seeds (p 0.04) and failed at 800 (p 1e-11); 600 sits between (not measured)
    for seed in range(600 if mode == "choose" else 300):
        hybrid = hybrid_proposer(SampledEagle3Proposer(head, target), ContextFree(), mode, k=3)
        if mode == "choose":
            assert isinstance(hybrid, SampledHybridProposer)
        res = decode(target, hybrid, prompt, 5, k=3, seed=seed, rule="exact", **warping)
        counts[flat_index(torch.tensor([res.tokens[:n]]), V_SMALL)] += 1
        for name, c in hybrid.summary()["steps"].items():
            steps[name] = steps.get(name, 0) + c
    pvalue = chi2_pvalue(counts, exact)
    assert pvalue > P_MIN, (mode, pvalue)
    if mode == "choose":
        assert steps.get("model", 0) > 50 and steps.get("free", 0) > 50, steps
