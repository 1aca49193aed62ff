"""Speculative sampling: warping, acceptance rules against exact distributions, decode loops.

Statistical checks use fixed seeds (deterministic) and state their tolerance:

* acceptance functions: batched or looped draws from toy conditional tables over a 4-token
  vocabulary; the joint distribution of the emitted tokens (completed by direct target sampling
  to a fixed length) must pass a chi-square test (p-value > 1e-3, cells with expected count < 5
  pooled) and the first tokens' total-variation distance must be < 0.02;
* decode loops: a tiny random float64 target with a 6-token vocabulary; the joint of the first
  three generated tokens over many seeds must pass the same chi-square test against the exact
  warped target distribution (enumerated with one batched forward), with zero counts wherever
  that distribution is zero (top-p);
* temperature 0 must equal greedy decoding token for token (float64: no tie can flip).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from random_models import VOCAB, make_head, make_target
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.target import Target
from specheads.verify.eagle3_proposers import (
    Eagle3DynamicTreeProposer,
    Eagle3Proposer,
    Eagle3StaticTreeProposer,
    SampledEagle3Proposer,
)
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.ngram_proposers import NO_DRAFT, NgramProposer
from specheads.verify.rules import accepted_prefix, greedy_tree_accept
from specheads.verify.sampling import (
    accept_chain,
    accept_chain_batch,
    accept_tree_pointmass,
    expand_draft_logits,
    inverse_cdf,
    make_generator,
    sample,
    typical_accept,
    warp,
)
from specheads.verify.steps import causal_mask
from specheads.verify.trees import tree_from_choices, tree_from_parents

MEDUSA_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
P_MIN = 1e-3  # chi-square p-value every distribution check must exceed


# --- statistics helpers --------------------------------------------------------------------------


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expected < min_expected pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome was produced"
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts = counts.double().flatten()
    return 0.5 * float((counts / counts.sum() - probs.double().flatten()).abs().sum())


def tables(V: int, depth: int, seed: int, scale: float = 1.5) -> list[torch.Tensor]:
    """Toy autoregressive model: tables[j] has shape (V,)*(j+1), p(x_{j+1} | x_1..x_j)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn((V,) * (j + 1), generator=g, dtype=torch.float64) * scale, -1)
            for j in range(depth)]


def rows(table: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """table (V,)*(j+1), prefix [B, j] -> the next-token distributions [B, V]."""
    if prefix.shape[1] == 0:
        return table.expand(prefix.shape[0], -1)
    return table[tuple(prefix.T)]


def joint(P: list[torch.Tensor]) -> torch.Tensor:
    """Exact joint of the first len(P) tokens: (V,)*len(P)."""
    out = P[0]
    for table in P[1:]:
        out = out[..., None] * table
    return out


def complete(known: torch.Tensor, have: torch.Tensor, P: list[torch.Tensor], gen) -> torch.Tensor:
    """known [B, >= len(P)] whose first have[b] entries were emitted -> [B, len(P)], the rest
    sampled directly from the tables (what the next decode steps are supposed to do)."""
    n = len(P)
    y = known[:, :n].clone()
    for j in range(n):
        fresh = sample(rows(P[j], y[:, :j]), gen)
        y[:, j] = torch.where(have > j, y[:, j], fresh)
    return y


def chain_emitted(draft: torch.Tensor, m: torch.Tensor, nxt: torch.Tensor):
    """(draft [B, k], accepted [B], next [B]) -> emitted tokens padded [B, k+1] and counts [B]."""
    y = torch.cat([draft, torch.zeros_like(draft[:, :1])], 1)
    y[torch.arange(draft.shape[0]), m] = nxt
    return y, m + 1


def list_emitted(emitted: list[list[int]], width: int):
    """Token lists -> padded [B, width] and counts [B]."""
    y = torch.zeros(len(emitted), width, dtype=torch.long)
    for i, t in enumerate(emitted):
        y[i, : len(t)] = torch.tensor(t)
    return y, torch.tensor([len(t) for t in emitted])


def flat_index(y: torch.Tensor, V: int) -> torch.Tensor:
    idx = torch.zeros(y.shape[0], dtype=torch.long)
    for j in range(y.shape[1]):
        idx = idx * V + y[:, j]
    return idx


# --- warping and sampling ------------------------------------------------------------------------


def test_warp():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04], dtype=torch.float64)
    logits = probs.log()[None]
    assert warp(logits, 0).tolist() == [[1.0, 0, 0, 0, 0]]
    torch.testing.assert_close(warp(logits, 1.0)[0], probs)
    torch.testing.assert_close(warp(logits + 3.0, 0.7), torch.softmax(logits / 0.7, -1))
    top2 = warp(logits, 1.0, top_k=2)[0]
    torch.testing.assert_close(top2, torch.tensor([0.625, 0.375, 0, 0, 0], dtype=torch.float64))
    for top_p, keep in ((0.45, 1), (0.75, 2), (0.85, 3), (1.0, 5)):
        kept = warp(logits, 1.0, top_p=top_p)[0]
        assert (kept > 0).sum() == keep, top_p
        torch.testing.assert_close(kept[:keep], probs[:keep] / probs[:keep].sum())
    # top-k first, then top-p on the renormalised top-k (0.5 / 0.9 = 0.56 >= 0.53: one token;
    # top-p alone would keep two)
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.53, top_k=3)[0],
                               torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64))
    assert (warp(logits, 1.0, top_p=0.53) > 0).sum() == 2
    # a reduced draft vocabulary: zero mass outside it, same warping inside
    full = expand_draft_logits(logits[0, :3], torch.tensor([4, 0, 2]), 6)
    assert full[[1, 3, 5]].isinf().all() and full[4] == logits[0, 0]
    q = warp(full, 1.0, top_k=2)
    assert q[[1, 2, 3, 5]].sum() == 0 and float(q.sum()) == pytest.approx(1.0)
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            warp(logits, **{"temperature": 1.0, **bad})


def test_warp_tiny_temperatures_are_argmax_not_nan():
    """1e-40 overflowed float32 (x / T = inf, softmax NaN) and sampled garbage; now any tiny
    positive temperature gives the one-hot argmax row, in float32 or float64, -inf entries kept."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = (torch.randn(4, 50) * 20).to(dtype)
        logits[0, 7] = float("-inf")
        for t in (1e-3, 1e-20, 1e-40, 1e-300, 5e-324):
            p = warp(logits, t)
            assert not p.isnan().any() and p.sum(-1).tolist() == pytest.approx([1.0] * 4), (dtype, t)
            if t < 1e-3:  # tiny: exactly greedy
                assert p.max(-1).values.tolist() == [1.0] * 4, (dtype, t)
            assert p.argmax(-1).tolist() == logits.argmax(-1).tolist(), (dtype, t)
    tie = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    assert warp(tie, 1e-300).tolist() == [[0.0, 0.5, 0.5, 0.0]]  # an exact tie splits evenly
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            warp(tie, bad)


def test_sample_is_exact_and_seeded():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.8, 0.0], dtype=torch.float64)
    assert int(inverse_cdf(probs, torch.tensor(0.0))) == 1  # never a zero-mass id, even at u = 0
    assert int(inverse_cdf(probs, torch.tensor(0.2))) == 3
    assert int(inverse_cdf(probs, torch.tensor(1 - 2.0 ** -53))) == 3
    assert int(inverse_cdf(probs * 3, torch.tensor(0.1))) == 1  # unnormalised rows are fine
    p = tables(6, 1, seed=0)[0]
    draws = sample(p.expand(200_000, -1), make_generator(1, "cpu"))
    assert tv(torch.bincount(draws, minlength=6), p) < 0.01
    again = sample(p.expand(200_000, -1), make_generator(1, "cpu"))
    assert torch.equal(draws, again)


# --- Leviathan chain acceptance -----------------------------------------------------------------


def run_chain(P, Q, k: int, B: int, gen, q_kind: str):
    """Draft B chains from Q (sampled or argmax point mass), verify them against P."""
    V = P[0].shape[-1]
    draft = torch.zeros(B, k, dtype=torch.long)
    qs = []
    for j in range(k):
        qj = rows(Q[j], draft[:, :j])  # [B, V]
        if q_kind == "pointmass":
            draft[:, j] = qj.argmax(-1)
            qj = torch.nn.functional.one_hot(draft[:, j], V).double()
        else:
            draft[:, j] = sample(qj, gen)
        qs.append(qj)
    q = torch.stack(qs, 1)  # [B, k, V]
    p = torch.stack([rows(P[j], draft[:, :j]) for j in range(k + 1)], 1)  # [B, k+1, V]
    return draft, q, p


@pytest.mark.parametrize("q_kind", ["sampled", "pointmass"])
def test_accept_chain_preserves_the_target_distribution(q_kind):
    V, k, B = 4, 3, 100_000
    P, Q = tables(V, k + 1, seed=1), tables(V, k, seed=2)
    gen = make_generator(3, "cpu")
    draft, q, p = run_chain(P, Q, k, B, gen, q_kind)
    m, nxt = accept_chain_batch(draft, q, p, gen)
    y = complete(*chain_emitted(draft, m, nxt), P, gen)  # [B, k+1]
    exact = joint(P)
    counts = torch.bincount(flat_index(y, V), minlength=V ** (k + 1))
    assert chi2_pvalue(counts, exact) > P_MIN
    assert tv(torch.bincount(flat_index(y[:, :2], V), minlength=V * V), exact.sum((2, 3))) < 0.02
    # first-position acceptance rate = sum_x min(p, q) (Leviathan's beta)
    beta = torch.minimum(P[0], Q[0] if q_kind == "sampled" else q[0, 0]).sum()
    assert float((m >= 1).double().mean()) == pytest.approx(float(beta), abs=0.01)
    assert 0 < float((m == k).double().mean()) < 1  # full and partial acceptance both happen


def test_accept_chain_statistics_have_power():
    """Negative controls: the same check rejects two classic bugs (so passing means something)."""
    V, k, B = 4, 3, 100_000
    P, Q = tables(V, k + 1, seed=1), tables(V, k, seed=2)
    gen = make_generator(3, "cpu")
    draft, q, p = run_chain(P, Q, k, B, gen, "sampled")
    exact = joint(P)
    # 1. claiming the wrong q (uniform) for drafts that were sampled from Q
    m, nxt = accept_chain_batch(draft, torch.full((B, k, V), 1 / V, dtype=torch.float64), p, gen)
    counts = torch.bincount(flat_index(complete(*chain_emitted(draft, m, nxt), P, gen), V),
                            minlength=V ** (k + 1))
    assert chi2_pvalue(counts, exact) < 1e-6
    # 2. sampling the replacement from p instead of the residual norm(max(0, p - q))
    m, _ = accept_chain_batch(draft, q, p, gen)
    nxt = sample(p[torch.arange(B), m], gen)
    counts = torch.bincount(flat_index(complete(*chain_emitted(draft, m, nxt), P, gen), V),
                            minlength=V ** (k + 1))
    assert chi2_pvalue(counts, exact) < 1e-6


def test_accept_chain_one_hot_is_greedy():
    g = torch.Generator().manual_seed(0)
    gen = make_generator(0, "cpu")
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=g))
        draft = torch.randint(0, 3, (k,), generator=g)
        p_logits = torch.randn(k + 1, 3, generator=g, dtype=torch.float64)
        q = torch.nn.functional.one_hot(draft, 3).double()  # a greedy draft's q: [k, 3]
        m, nxt = accept_chain(draft, q, warp(p_logits, 0), gen)
        argmax = p_logits.argmax(-1)
        assert m == accepted_prefix(draft, argmax) and nxt == int(argmax[m])


# --- EAGLE-2/3 point-mass tree acceptance --------------------------------------------------------


TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 1, 2, 4]  # depth 3
TREE_TOKENS = [0, 2, 1, 2, 3, 0, 3, 2, 1]  # node 3 repeats node 1's token, node 6 node 4's


def node_rows(tree, tokens: list[int], P: list[torch.Tensor]) -> torch.Tensor:
    """p [N, V]: the toy target's next-token distribution after each node's path."""
    out = []
    for v in range(tree.size):
        path = [tokens[u] for u in tree.path_to(v)[1:]]
        out.append(P[len(path)][tuple(path)] if path else P[0])
    return torch.stack(out)


def test_pointmass_tree_preserves_the_target_distribution():
    V, draws = 4, 20_000
    tree = tree_from_parents(TREE_PARENTS)
    P = tables(V, tree.max_depth + 1, seed=4, scale=1.0)
    tokens = torch.tensor(TREE_TOKENS)
    p = node_rows(tree, TREE_TOKENS, P)
    gen = make_generator(5, "cpu")
    emitted, depth1 = [], 0
    for _ in range(draws):
        path, nxt = accept_tree_pointmass(tree, tokens, p, gen)
        emitted.append(tokens[path[1:]].tolist() + [nxt])
        depth1 += len(path) > 1
    y = complete(*list_emitted(emitted, len(P)), P, gen)
    exact = joint(P)
    counts = torch.bincount(flat_index(y, V), minlength=V ** len(P))
    assert chi2_pvalue(counts, exact) > P_MIN
    assert tv(torch.bincount(y[:, 0], minlength=V), P[0]) < 0.02
    # a depth-1 node is accepted iff y ~ p hits a distinct child token: p(2) + p(1)
    assert depth1 / draws == pytest.approx(float(P[0][[1, 2]].sum()), abs=0.015)
    assert max(len(e) for e in emitted) == tree.max_depth + 1


def test_pointmass_tree_one_hot_is_greedy():
    g = torch.Generator().manual_seed(1)
    gen = make_generator(0, "cpu")
    tree = tree_from_choices(MEDUSA_LIKE)
    for _ in range(100):
        tokens = torch.randint(0, 3, (tree.size,), generator=g)
        logits = torch.randn(tree.size, 3, generator=g, dtype=torch.float64)
        path, nxt = accept_tree_pointmass(tree, tokens, warp(logits, 0), gen)
        argmax = logits.argmax(-1)
        assert path == greedy_tree_accept(tree, tokens, argmax) and nxt == int(argmax[path[-1]])


# --- typical acceptance (lossy) ------------------------------------------------------------------


def test_typical_acceptance_is_lossy():
    tree = tree_from_parents([-1, 0, 0, 1])
    tokens = torch.tensor([0, 2, 3, 0])
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01],
                      [0.25, 0.25, 0.25, 0.25], [0.1, 0.6, 0.2, 0.1]], dtype=torch.float64)
    decision = typical_accept(tree, tokens, p)  # threshold 0.09 at the root: token 2 passes
    assert decision.lossy is True
    assert decision.path == [0, 1, 3] and decision.next_token == 1
    # lossy: token 2 (target probability 0.15) is emitted first with probability 1
    gen = make_generator(0, "cpu")
    assert all(typical_accept(tree, tokens, p, gen).path[:2] == [0, 1] for _ in range(20))
    one_hot = warp(p.log(), 0)
    greedy = greedy_tree_accept(tree, tokens, p.argmax(-1))
    assert typical_accept(tree, tokens, one_hot).path == greedy == [0]


# --- decode loops: temperature 0 == greedy -------------------------------------------------------


def check_counts(res, max_new: int) -> None:
    s = res.stats
    assert s.tokens == len(res.tokens) <= max_new and s.tokens == 1 + s.decode_tokens
    assert s.decode_forwards == len(res.step_tokens) == len(res.step_proposed)
    assert sum(res.step_tokens) == s.decode_tokens and s.proposed_tokens == sum(res.step_proposed)
    acc = s.accepted_per_pos
    assert all(a >= b for a, b in zip([s.drafts] + acc, acc))
    if res.stop_reason == "length":
        assert s.decode_tokens == s.decode_forwards + sum(acc)


@pytest.fixture(scope="module")
def big():
    target = make_target("sdpa")
    return target, make_head(target)


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g)
        out.append(torch.cat([ids, ids[: ids.numel() // 2]]) if i % 2 else ids)
    return out


CHAIN_KINDS = {"sampled_eagle3": (SampledEagle3Proposer, 3), "greedy_eagle3": (Eagle3Proposer, 2),
               "ngram": (None, 3)}


@pytest.mark.parametrize("kind", list(CHAIN_KINDS))
def test_chain_temperature_zero_equals_greedy(big, kind):
    target, head = big
    cls, k = CHAIN_KINDS[kind]
    for i, prompt in enumerate(prompts(2, seed=7)):
        ref = greedy_decode(target, prompt, 16)
        proposer = NgramProposer() if cls is None else cls(head, target)
        res = decode(target, proposer, prompt, 16, k, temperature=0, top_p=0.5,
                              top_k=3, seed=i, rule="exact")
        assert res.tokens == ref.tokens, (kind, prompt.tolist())
        assert res.lossy is False and res.stats.drafts > 0
        check_counts(res, 16)


@pytest.mark.parametrize("kind", ["static", "eagle2", "typical"])
def test_tree_temperature_zero_equals_greedy(big, kind):
    target, head = big
    for i, prompt in enumerate(prompts(2, seed=8)):
        ref = greedy_decode(target, prompt, 16)
        proposer = (Eagle3DynamicTreeProposer(head, target, depth=3, top_k=3, total_tokens=10)
                    if kind == "eagle2" else Eagle3StaticTreeProposer(head, target, MEDUSA_LIKE))
        rule = "typical" if kind == "typical" else "exact"
        res = decode(target, proposer, prompt, 16, temperature=0, seed=i, rule=rule)
        assert res.tokens == ref.tokens, (kind, prompt.tolist())
        assert res.lossy is (rule == "typical") and res.rule == ("typical" if rule == "typical" else "pointmass")
        check_counts(res, 16)


def test_seeds_eos_and_budget(big):
    target, head = big
    prompt = prompts(1, seed=9)[0]
    a = decode(target, SampledEagle3Proposer(head, target), prompt, 16, 3, seed=5, rule="exact")
    b = decode(target, SampledEagle3Proposer(head, target), prompt, 16, 3, seed=5, rule="exact")
    c = decode(target, SampledEagle3Proposer(head, target), prompt, 16, 3, seed=6, rule="exact")
    assert a.tokens == b.tokens != c.tokens and len(a.tokens) == 16
    check_counts(a, 16)
    eos = a.tokens[5]
    cut = decode(target, SampledEagle3Proposer(head, target), prompt, 16, 3, seed=5,
                          eos_token_ids=[eos], rule="exact")
    assert cut.tokens == a.tokens[: a.tokens.index(eos) + 1] and cut.stop_reason == "eos"
    tree = decode(target, Eagle3StaticTreeProposer(head, target, MEDUSA_LIKE),
                                prompt, 16, seed=5, rule="exact")
    assert len(tree.tokens) == 16 and tree.lossy is False
    check_counts(tree, 16)
    assert decode(target, NO_DRAFT, prompt, 0, 3, rule="exact").tokens == []


# --- decode loops: the output distribution is the target's ---------------------------------------


V_SMALL = 6


def build_small():
    """Target: 4 layers, 6-token vocabulary, sharpened logits; head: 5-token draft vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.1)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peakier distributions: top-p really cuts tokens
    target = Target(model, None, Path("random-llama"))
    torch.manual_seed(1)
    options = Eagle3Options(ttt_steps=3, draft_vocab_size=5, aux_layers=[1, 2, 3])
    head = Eagle3Head.for_target(options, target.config)
    used = torch.tensor([0, 1, 2, 4, 5])  # token 3 is outside the draft vocabulary
    head.set_vocab_map(used - torch.arange(5), torch.isin(torch.arange(V_SMALL), used))
    with torch.no_grad():
        head.lm_head.weight.mul_(4.0)
    return target, head.to(torch.float64).eval()


@pytest.fixture(scope="module")
def small():
    return build_small()


def exact_first_tokens(target, prompt: torch.Tensor, n: int, **warping) -> torch.Tensor:
    """Exact warped joint of the first n sampled tokens, (V,)*n, from one batched forward."""
    V, P = V_SMALL, prompt.numel()
    grids = torch.cartesian_prod(*[torch.arange(V)] * (n - 1)).reshape(-1, n - 1)  # [V^(n-1), n-1]
    seqs = torch.cat([prompt.expand(grids.shape[0], -1), grids], 1)
    T = seqs.shape[1]
    logits = target.forward(seqs, attention_mask=causal_mask(0, T, target.dtype, "cpu"),
                            position_ids=torch.arange(T).expand(seqs.shape[0], -1)).logits
    probs = warp(logits[:, P - 1:], **warping)  # [V^(n-1), n, V]
    out = probs[:, n - 1]  # [V^(n-1), V]
    for j in range(n - 1):
        out = out * probs[torch.arange(grids.shape[0]), j, grids[:, j]][:, None]
    return out.reshape((V,) * n)


E2E = {  # name: (loop, warping, seeds)
    "chain_t1": ("chain", {"temperature": 1.0}, 300),
    "chain_top_p": ("chain", {"temperature": 1.0, "top_p": 0.9}, 300),
    "static_tree_t1": ("static", {"temperature": 1.0}, 300),
    "eagle2_tree_top_p": ("eagle2", {"temperature": 1.0, "top_p": 0.9}, 300),
}


@pytest.mark.parametrize("name", list(E2E))
def test_sampled_output_matches_the_target(small, name):
    target, head = small
    loop, warping, seeds = E2E[name]
    prompt = torch.tensor([1, 3, 0, 2, 5, 4, 1])
    n = 3
    exact = exact_first_tokens(target, prompt, n, **warping)
    counts = torch.zeros(V_SMALL ** n, dtype=torch.long)
    accepted = rejected = 0
    for seed in range(seeds):
        if loop == "chain":  # 5 tokens: the first verification step drafts k = 3
            res = decode(target, SampledEagle3Proposer(head, target), prompt, 5, k=3,
                                  seed=seed, **warping, rule="exact")
        else:
            proposer = (Eagle3StaticTreeProposer(head, target, [(0,), (1,), (0, 0), (1, 0), (0, 1)])
                        if loop == "static" else
                        Eagle3DynamicTreeProposer(head, target, depth=2, top_k=2, total_tokens=6))
            res = decode(target, proposer, prompt, 4, seed=seed, **warping, rule="exact")
        counts[flat_index(torch.tensor([res.tokens[:n]]), V_SMALL)] += 1
        first = res.step_tokens[0] - 1  # drafts accepted by the first verification step
        accepted += first
        rejected += first < res.step_proposed[0] and res.step_proposed[0] > 0
    pvalue = chi2_pvalue(counts, exact)
    assert pvalue > P_MIN, (name, pvalue)
    assert accepted > seeds // 4 and rejected > seeds // 10  # both branches were exercised
