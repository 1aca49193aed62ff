"""Token trees, one-pass tree verification, cache compaction and greedy tree decoding.

Equality tests run the tiny random target in float64 (as tests/test_verify.py) so that
batched-vs-sequential numerics can never flip an argmax tie: a difference is a real bug.
"""

from __future__ import annotations

import pytest
import torch
from random_models import CTX, VOCAB, make_head, make_target
from transformers import DynamicCache

from specheads.target import Target
from specheads.verify.eagle3_proposers import (
    Eagle3DynamicTreeProposer,
    Eagle3Proposer,
    Eagle3StaticTreeProposer,
    select_top_nodes,
)
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.ngram_proposers import FixedTreeProposer
from specheads.verify.rules import greedy_tree_accept
from specheads.verify.steps import (
    DecodeError,
    causal_mask,
    compact_cache,
    target_step,
    tree_attention_mask,
    tree_forward,
)
from specheads.verify.trees import (
    TreeError,
    chain_tree,
    prune,
    subtree,
    tree_from_choices,
    tree_from_parents,
)

CHOICES = [(1, 0), (0,), (0, 0, 0), (1,), (0, 1), (0, 0)]  # unsorted on purpose
MEDUSA_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def random_prompts(n: int, seed: int, max_len: int = 20) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (length,), generator=g) for length in lengths]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def target(request) -> Target:
    return make_target(request.param)


# --- trees as data ------------------------------------------------------------------------------


def test_tree_from_choices_golden():
    tree = tree_from_choices(CHOICES)
    # sorted: (0,) (1,) (0,0) (0,1) (1,0) (0,0,0) -> nodes 1..6
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    rows = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, row in enumerate(rows):
        expected[i, row] = True
    assert torch.equal(tree.mask, expected)
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert tree.size == 7 and tree.max_depth == 3 and tree.children(1) == [3, 4]
    assert tree.path_to(6) == [0, 1, 3, 6]
    # cached per shape, whatever the order or container of the choices
    assert tree_from_choices([list(c) for c in reversed(CHOICES)]) is tree


def test_choice_errors():
    with pytest.raises(TreeError, match=r"prefix \[0, 1\]"):
        tree_from_choices([(0,), (0, 1, 0)])
    with pytest.raises(TreeError, match="more than once"):
        tree_from_choices([(0,), (0,)])
    with pytest.raises(TreeError, match="empty"):
        tree_from_choices([()])
    with pytest.raises(TreeError, match="negative"):
        tree_from_choices([(-1,)])


def test_parents_chain_and_pruning():
    tree = tree_from_parents([-1, 0, 0, 1, 1, 2, 3])
    assert torch.equal(tree.mask, tree_from_choices(CHOICES).mask)
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    chain = chain_tree(3)
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.paths.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(chain.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert chain_tree(0).size == 1 and chain_tree(0).paths.tolist() == [[0]]
    for bad, msg in (([0, 0], "root"), ([-1, 1], "node 1"), ([-1, 0, 3, 0], "node 2")):
        with pytest.raises(TreeError, match=msg):
            tree_from_parents(bad)
    kept = prune(tree, max_depth=2)
    assert kept.tolist() == [0, 1, 2, 3, 4, 5]
    small = subtree(tree, prune(tree, max_depth=2, max_nodes=4))
    assert small.parents.tolist() == [-1, 0, 0, 1]
    with pytest.raises(TreeError, match="ancestor-closed"):
        subtree(tree, torch.tensor([0, 3]))


def test_masks_and_acceptance_walk():
    tree = tree_from_choices(CHOICES)
    m = tree_attention_mask(tree.mask, 2, torch.float32, "cpu")
    assert m.shape == (1, 1, 7, 9)
    assert ((m[0, 0] == 0) == torch.cat([torch.ones(7, 2, dtype=torch.bool), tree.mask], 1)).all()
    assert (m[0, 0][m[0, 0] != 0] == torch.finfo(torch.float32).min).all()
    tokens = torch.tensor([9, 5, 6, 7, 8, 7, 3])
    # root argmax 6 -> node 2; node 2's argmax 7 -> node 5; node 5's argmax anything -> stop
    assert greedy_tree_accept(tree, tokens, torch.tensor([6, 0, 7, 0, 0, 1, 0])) == [0, 2, 5]
    assert greedy_tree_accept(tree, tokens, torch.tensor([5, 7, 0, 3, 0, 0, 0])) == [0, 1, 3, 6]
    assert greedy_tree_accept(tree, tokens, torch.tensor([1, 7, 0, 3, 0, 0, 0])) == [0]
    scores = torch.tensor([-1.0, -0.5, -2.0, -0.5, -0.7])
    parents = torch.tensor([-1, -1, 0, 1, 1])
    assert select_top_nodes(scores, parents, 3).tolist() == [1, 3, 4]
    assert select_top_nodes(torch.zeros(3), torch.tensor([-1, 0, 1]), 2).tolist() == [0, 1]


# --- one-pass tree verification ------------------------------------------------------------------


def prefill(target: Target, prompt: torch.Tensor):
    cache = DynamicCache(config=target.config)
    target_step(target, prompt[None], 0, cache)
    return cache


def full_forward(target: Target, seq: torch.Tensor) -> torch.Tensor:
    """seq [1, T] without any cache -> logits [T, V]."""
    T = seq.shape[1]
    return target.forward(seq, attention_mask=causal_mask(0, T, target.dtype, "cpu"),
                          position_ids=torch.arange(T)[None]).logits[0]


def test_tree_logits_equal_each_path_run_alone(target):
    tree = tree_from_choices(MEDUSA_LIKE)
    g = torch.Generator().manual_seed(3)
    for prompt in random_prompts(3, seed=4):
        tokens = torch.randint(0, VOCAB, (tree.size,), generator=g)
        cache = prefill(target, prompt)
        P = prompt.numel()
        logits = tree_forward(target, tokens, tree, P, cache).logits[0]  # [N, V]
        assert cache.get_seq_length() == P + tree.size
        for row in tree.paths.tolist():
            path = [n for n in row if n >= 0]
            seq = torch.cat([prompt, tokens[path]])[None]
            alone = full_forward(target, seq)[P:]
            torch.testing.assert_close(logits[path], alone, atol=1e-6, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_float32(attn):
    target = make_target(attn, dtype=torch.float32)
    tree = tree_from_choices(MEDUSA_LIKE)
    prompt = random_prompts(1, seed=8)[0]
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(1))
    logits = tree_forward(target, tokens, tree, prompt.numel(), prefill(target, prompt)).logits[0]
    for row in tree.paths.tolist():
        path = [n for n in row if n >= 0]
        alone = full_forward(target, torch.cat([prompt, tokens[path]])[None])[prompt.numel():]
        torch.testing.assert_close(logits[path], alone, atol=1e-5, rtol=0)


def test_compacted_cache_continues_like_the_reference(target):
    tree = tree_from_choices(MEDUSA_LIKE)
    prompt = random_prompts(1, seed=6)[0]
    P = prompt.numel()
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(2))
    for path in ([0], [0, 2, 6], [0, 1, 5, 9], [0, 1, 4, 8, 10]):
        assert path == tree.path_to(path[-1])
        cache = prefill(target, prompt)
        tree_forward(target, tokens, tree, P, cache)
        compact_cache(cache, P, path)
        assert cache.get_seq_length() == P + len(path)
        nxt = torch.tensor([[7]])
        got = target_step(target, nxt, P + len(path), cache).logits[0, -1]
        seq = torch.cat([prompt, tokens[path], nxt[0]])[None]
        ref = full_forward(target, seq)[-1]
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


# --- greedy tree decoding == plain greedy -------------------------------------------------------


def check_counts(res, max_new: int) -> None:
    s = res.stats
    assert s.tokens == len(res.tokens) <= max_new
    assert s.prefill_forwards == 1 and s.tokens == 1 + s.decode_tokens
    assert s.decode_forwards == len(res.step_tokens) == len(res.step_proposed)
    assert sum(res.step_tokens) == s.decode_tokens and s.proposed_tokens == sum(res.step_proposed)
    acc = s.accepted_per_pos
    assert all(a >= b for a, b in zip([s.drafts] + acc, acc))
    if res.stop_reason == "length":
        assert s.decode_tokens == s.decode_forwards + sum(acc)
    assert s.summary()["tau"] == pytest.approx(s.decode_tokens / max(s.decode_forwards, 1))


def noisy_oracle(reference: list[int], prompt_len: int, tree, seed: int):
    """Fill: the reference continuation on rank-0 nodes, corrupted at random; others = +rank."""
    g = torch.Generator().manual_seed(seed)
    depths, ranks = tree.depths[1:].tolist(), tree.ranks[1:].tolist()

    def fill(context):
        at = len(context) - prompt_len  # tokens emitted so far
        ref = [reference[at - 1 + d] if at - 1 + d < len(reference) else 0 for d in depths]
        toks = [(r + rk) % VOCAB for r, rk in zip(ref, ranks)]
        bad = int(torch.randint(0, len(toks) + 2, (1,), generator=g))
        if bad < len(toks):
            toks[bad] = (toks[bad] + 1) % VOCAB
        return torch.tensor(toks)

    return fill


@pytest.mark.parametrize("kind", ["static", "chain", "eagle2", "oracle"])
def test_tree_decoding_equals_greedy(target, kind):
    """25 prompts per tree shape: 100 prompts per attention implementation in all."""
    head = make_head(target, target.config._attn_implementation)
    for i, prompt in enumerate(random_prompts(25, seed=11)):
        ref = greedy_decode(target, prompt, 24)
        if kind == "static":
            proposer = Eagle3StaticTreeProposer(head, target, MEDUSA_LIKE)
        elif kind == "chain":
            proposer = Eagle3StaticTreeProposer(head, target, chain_tree(3))
        elif kind == "eagle2":
            proposer = Eagle3DynamicTreeProposer(head, target, depth=3, top_k=3, total_tokens=10)
        else:
            tree = tree_from_choices(MEDUSA_LIKE)
            proposer = FixedTreeProposer(tree, noisy_oracle(ref.tokens, prompt.numel(), tree, i))
        res = decode(target, proposer, prompt, 24)
        assert res.tokens == ref.tokens, (kind, prompt.tolist())
        check_counts(res, 24)
        assert res.stats.drafts > 0
        if kind == "oracle":
            assert any(t > 2 for t in res.step_tokens)  # deep, partial acceptance happened


def test_eos_and_plain_tree_loop(target):
    prompt = random_prompts(1, seed=3)[0]
    ref = greedy_decode(target, prompt, 30)
    root_only = FixedTreeProposer(chain_tree(0), lambda ctx: torch.zeros(0, dtype=torch.long))
    assert decode(target, root_only, prompt, 30).tokens == ref.tokens  # plain, through the tree path
    eos = ref.tokens[9]
    plain = greedy_decode(target, prompt, 30, eos_token_ids=[eos])
    tree = tree_from_choices(MEDUSA_LIKE)
    proposer = FixedTreeProposer(tree, noisy_oracle(ref.tokens, prompt.numel(), tree, 0))
    res = decode(target, proposer, prompt, 30, eos_token_ids=[eos])
    assert res.tokens == plain.tokens and res.stop_reason == "eos"


# --- EAGLE-3 tree drafting matches sequential drafting -------------------------------------------


@torch.no_grad()
def forced_children(chain: Eagle3Proposer, path_tokens: list[int], k: int) -> list[int]:
    """Top-k target ids after feeding path_tokens one by one to the draft (no tree mask)."""
    out, head = chain.last_out, chain.head
    for j, tok in enumerate(path_tokens, start=1):
        emb = chain.target.embed(torch.tensor([[tok]]))
        out = head.step(out, emb, torch.tensor([[chain.rows - 1 + j]]), None, chain.cache)
    top = head.logits(out)[0, -1].topk(k).indices
    if path_tokens:
        chain.cache.crop(chain.rows - chain.cache.get_seq_length())
    return head.to_target_ids(top).tolist()


@torch.no_grad()
def forced_logprob(chain: Eagle3Proposer, path_tokens: list[int], token: int) -> float:
    """Draft log-prob of target id `token` after feeding path_tokens sequentially, then crop."""
    out, head = chain.last_out, chain.head
    for j, tok in enumerate(path_tokens, start=1):
        emb = chain.target.embed(torch.tensor([[tok]]))
        out = head.step(out, emb, torch.tensor([[chain.rows - 1 + j]]), None, chain.cache)
    logp = torch.log_softmax(head.logits(out)[0, -1], -1)
    if path_tokens:
        chain.cache.crop(chain.rows - chain.cache.get_seq_length())
    return float(logp[int(head.t2d[:token].sum())])  # draft id = rank of the id among used ones


class CheckedStatic(Eagle3StaticTreeProposer):
    """Checks every proposed node against sequential drafting along its own path."""

    checked = 0

    def propose_tree(self):
        tree, nodes = super().propose_tree()
        tokens = [None] + nodes.tolist()
        for v in range(1, tree.size):
            p = int(tree.parents[v])
            path = [tokens[u] for u in tree.path_to(p)[1:]]
            want = forced_children(self.chain, path, int(tree.ranks[v]) + 1)[int(tree.ranks[v])]
            assert tokens[v] == want, (v, path)
        assert self.chain.cache.get_seq_length() == self.chain.rows
        CheckedStatic.checked += 1
        return tree, nodes


def test_eagle3_static_tree_equals_sequential_drafts(target):
    head = make_head(target, target.config._attn_implementation)
    prompt = random_prompts(2, seed=9)[1]
    ref = greedy_decode(target, prompt, 20)
    CheckedStatic.checked = 0
    res = decode(target, CheckedStatic(head, target, MEDUSA_LIKE), prompt, 20)
    assert res.tokens == ref.tokens and CheckedStatic.checked == res.stats.drafts > 5
    # a chain tree proposes exactly what the chain proposer does
    chain_prop = Eagle3StaticTreeProposer(head, target, chain_tree(4))
    plain = Eagle3Proposer(head, target)
    out = target.forward(prompt[None], layers=plain.layers)
    chain_prop.start(prompt, ref.tokens[0], out)
    plain.start(prompt, ref.tokens[0], out)
    assert chain_prop.propose_tree()[1].tolist() == plain.propose(4).tolist()


def test_eagle2_tree_shape(target):
    head = make_head(target, target.config._attn_implementation)
    proposer = Eagle3DynamicTreeProposer(head, target, depth=3, top_k=4, total_tokens=12)
    prompt = random_prompts(1, seed=2)[0]
    out = target.forward(prompt[None], layers=proposer.layers)
    proposer.start(prompt, 5, out)
    tree, nodes = proposer.propose_tree()
    assert tree.size == 12 and nodes.shape == (11,) and tree.max_depth <= 4
    assert proposer.chain.cache.get_seq_length() == proposer.chain.rows == prompt.numel()
    tokens = [None] + nodes.tolist()
    for v in range(1, tree.size):  # every node is among its parent's top-k sequential drafts
        path = [tokens[u] for u in tree.path_to(int(tree.parents[v]))[1:]]
        assert tokens[v] in forced_children(proposer.chain, path, 4)
        # and its score is the sum of sequential draft log-probs along its path
        full = path + [tokens[v]]
        want = sum(forced_logprob(proposer.chain, full[:j], full[j]) for j in range(len(full)))
        # (1e-6: eager attention takes its softmax in fp32 even for a float64 model)
        assert float(proposer.last_scores[v - 1]) == pytest.approx(want, abs=1e-6)
    for p in range(tree.size):  # siblings are distinct tokens
        kids = [tokens[c] for c in tree.children(p)]
        assert len(kids) == len(set(kids))


# --- stub proposers: exact tau ------------------------------------------------------------------


@pytest.mark.parametrize("agree", [True, False])
def test_stub_tau_exact(target, agree):
    tree = tree_from_choices(MEDUSA_LIKE)  # depth 4
    prompt = random_prompts(2, seed=7)[1]
    steps = 5
    max_new = 1 + steps * (tree.max_depth + 1)
    ref = greedy_decode(target, prompt, max_new + 8)
    depths, ranks = tree.depths[1:].tolist(), tree.ranks[1:].tolist()

    def fill(context):
        at = len(context) - prompt.numel()
        return torch.tensor([(ref.tokens[at - 1 + d] + rk + (0 if agree else 1)) % VOCAB
                             for d, rk in zip(depths, ranks)])

    res = decode(target, FixedTreeProposer(tree, fill), prompt, max_new)
    assert res.tokens == ref.tokens[:max_new]
    summary = res.stats.summary()
    if agree:
        assert summary["tau"] == tree.max_depth + 1 and res.stats.decode_forwards == steps
        assert summary["acceptance_per_position"] == [1.0] * tree.max_depth
        # a budget that is not a multiple: the last tree is cut to depth 1, never past max_new
        res2 = decode(target, FixedTreeProposer(tree, fill), prompt, max_new + 2)
        assert res2.tokens == ref.tokens[: max_new + 2]
        assert res2.step_tokens == [tree.max_depth + 1] * steps + [2]
        assert res2.step_proposed[-1] == 3  # the three depth-1 nodes
    else:
        assert summary["tau"] == 1.0 and res.stats.accepted_per_pos == [0] * tree.max_depth
    check_counts(res, max_new)


# --- errors -------------------------------------------------------------------------------------


def test_errors():
    target = make_target()
    big = chain_tree(CTX)  # CTX + 1 nodes
    stub = FixedTreeProposer(big, lambda ctx: torch.zeros(CTX, dtype=torch.long))
    with pytest.raises(DecodeError, match="context"):
        decode(target, stub, [1, 2, 3], 10)
    flash = make_target()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DecodeError, match="flash attention ignores custom 4-D masks"):
        decode(flash, FixedTreeProposer(chain_tree(0), lambda ctx: torch.zeros(0, dtype=torch.long)), [1, 2, 3], 4)
    head = make_head(target)
    head.layers[0].self_attn.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DecodeError, match="EAGLE-3 head"):
        Eagle3DynamicTreeProposer(head, target)
    with pytest.raises(TreeError, match="draft vocabulary"):
        Eagle3StaticTreeProposer(make_head(target), target, [(64,)])


def test_output_is_clamped_near_the_context():
    target = make_target()
    prompt = list(range(CTX - 6))
    tree = tree_from_choices(MEDUSA_LIKE)
    ref = greedy_decode(target, prompt, 50)
    proposer = FixedTreeProposer(tree, noisy_oracle(ref.tokens, len(prompt), tree, 1))
    res = decode(target, proposer, prompt, 50)
    assert res.tokens == ref.tokens and len(res.tokens) == 6
