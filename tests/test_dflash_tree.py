"""DFlash static trees: node (r_1, .., r_d) holds rank r_d of block slot d; greedy tree decoding equals
plain greedy decoding, sampled tree decoding keeps the target's distribution (chi-square), and the
trees a block cannot make are refused."""

from __future__ import annotations

import pytest
import torch
from test_dflash import random_head, target  # noqa: F401 - the module's target fixture

from specheads.heads.dflash import DFlashHead, DFlashOptions
from specheads.verify.dflash_proposers import DFlashProposer, DFlashStaticTreeProposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec
from specheads.verify.trees import SettingsError, TreeError

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


def test_nodes_hold_the_slot_ranks(target):  # noqa: F811
    head = random_head(target)
    prompt = torch.randint(0, 95, (9,), generator=torch.Generator().manual_seed(3))
    out = target.forward(prompt[None], layers=head.required_layers())
    first = int(out.logits[0, -1].argmax())
    chain, tree = DFlashProposer(head, target), DFlashStaticTreeProposer(head, target, TREE)
    chain.start(prompt, first, out)
    tree.start(prompt, first, out)
    shape, tokens = tree.propose_tree()
    ranked = chain.block_logits(3).sort(-1, descending=True).indices  # [3, V]: slot d's tokens by rank
    want = [int(ranked[len(path) - 1, path[-1]]) for path in TREE]
    assert shape.size == len(TREE) + 1 and tokens.tolist() == want
    assert [want[0], want[3], want[6]] == chain.propose(3).tolist()  # the rank-0 path is the chain


def test_greedy_tree_decoding_equals_plain(target):  # noqa: F811
    head = random_head(target)
    for seed in range(3):
        prompt = torch.randint(0, 95, (6,), generator=torch.Generator().manual_seed(seed))
        res = decode(target, DFlashStaticTreeProposer(head, target, TREE), prompt, 24)
        assert res.tokens == greedy_decode(target, prompt, 24).tokens
        assert res.step_proposed[0] == len(TREE)  # whole trees were verified


def test_sampled_tree_decoding_keeps_the_target_distribution():
    """The first 3 sampled tokens over many seeds (a static tree verified with the point-mass rule)
    pass a chi-square test against the target's exact warped joint distribution."""
    from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

    from specheads.verify.loop import decode

    small = build_small()[0]
    torch.manual_seed(2)
    head = DFlashHead.for_target(DFlashOptions(num_layers=1, block_size=4, target_layer_ids=[0, 2]),
                                 small.config).double().eval()
    prompt = torch.tensor([1, 3, 0, 2, 5, 4, 1])
    warping = {"temperature": 1.0}
    exact = exact_first_tokens(small, prompt, 3, **warping)
    counts = torch.zeros(V_SMALL ** 3, dtype=torch.long)
    accepted = rejected = 0
    seeds = 300
    for seed in range(seeds):
        proposer = DFlashStaticTreeProposer(head, small, [(0,), (1,), (0, 0), (1, 0), (0, 1)])
        res = decode(small, proposer, prompt, 4, seed=seed, **warping, rule="exact")
        assert res.lossy is False
        counts[flat_index(torch.tensor([res.tokens[:3]]), V_SMALL)] += 1
        first = res.step_tokens[0] - 1
        accepted += first
        rejected += first < res.step_proposed[0]
    assert chi2_pvalue(counts, exact) > P_MIN
    assert accepted > seeds // 10 and rejected > seeds // 10  # both branches were exercised


def test_trees_a_block_cannot_make_are_refused(target):  # noqa: F811
    head = random_head(target)  # block 4: 3 slots
    for sampled in (False, True):
        assert isinstance(make_proposer(TreeSpec("static", choices=tuple(TREE)), head, target, sampled),
                          DFlashStaticTreeProposer)
    with pytest.raises(SettingsError, match="static tree file"):
        make_proposer(TreeSpec("eagle2"), head, target)
    with pytest.raises(TreeError, match="4 levels deep but a block of 4 drafts 3 tokens"):
        DFlashStaticTreeProposer(head, target, [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
