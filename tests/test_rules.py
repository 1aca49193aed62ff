"""The decode loop's acceptance rules on hand-made distributions, and the one-loop guard.

Golden paths where the rule is deterministic (greedy, typical with one-hot rows); for the
lossless sampling rules, the first emitted token over many seeded trials must follow the
target's p (the property that makes them lossless), with fixed seeds so nothing is flaky.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from random_models import make_target

from specheads.verify.loop import ChainShape, TreeShape, decode, run_loop
from specheads.verify.ngram_proposers import NO_DRAFT
from specheads.verify.rules import (
    GreedyRule,
    LeviathanRule,
    PointMassRule,
    TypicalRule,
    accepted_prefix,
    greedy_tree_accept,
    make_rule,
    sampled_rule,
)
from specheads.verify.sampling import make_generator, sample
from specheads.verify.steps import DecodeError
from specheads.verify.trees import chain_tree, tree_from_parents

V = 6
VERIFY = Path(__file__).resolve().parent.parent / "specheads" / "verify"


def one_hot_logits(rows: list[int]) -> torch.Tensor:
    """Logits [1, N, V] whose argmax in row i is rows[i] (batch of one)."""
    logits = torch.zeros(len(rows), V, dtype=torch.float64)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return logits[None]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_follows_the_argmax_child_and_emits_the_bonus():
    tree = tree_from_parents([-1, 0, 0, 1, 2, 2])  # root: children 1, 2; 2: children 4, 5
    tokens = torch.tensor([[9, 3, 4, 0, 1, 2]])  # [B, N]
    logits = one_hot_logits([4, 0, 2, 0, 0, 5])  # root wants 4 (node 2), node 2 wants 2 (node 5)
    path, nxt = GreedyRule().decide(tree, tokens, logits, None)
    assert (path, nxt) == ([[0, 2, 5]], [5])


def test_greedy_on_a_chain_is_the_matching_prefix():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        draft = torch.randint(0, 3, (4,), generator=g)
        argmax = torch.randint(0, 3, (5,), generator=g)
        logits = one_hot_logits(argmax.tolist())
        path, nxt = GreedyRule().decide(chain_tree(4), torch.cat([torch.tensor([7]), draft])[None],
                                        logits, None)
        m = accepted_prefix(draft, argmax)
        assert path == [list(range(m + 1))] and nxt == [int(argmax[m])]
        chain = torch.cat([torch.tensor([7]), draft])
        assert greedy_tree_accept(chain_tree(4), chain, argmax) == path[0]


# --- lossless sampling rules -------------------------------------------------------------------


P_ROOT = torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0, 0.0], dtype=torch.float64)


def first_token_freqs(decide_once, trials: int = 4000) -> torch.Tensor:
    counts = torch.zeros(V)
    for _ in range(trials):
        counts[decide_once()] += 1
    return counts / trials


def test_leviathan_first_token_follows_p_whatever_q_drafts():
    q = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0, 0.0], dtype=torch.float64)
    gen = make_generator(0, "cpu")
    rule = LeviathanRule(identity, gen, 0)
    p = torch.stack([P_ROOT, torch.full((V,), 1.0 / V, dtype=torch.float64)])[None]  # [1, 2, V]

    def once() -> int:
        d = int(sample(q, gen))
        (path,), (nxt,) = rule.decide(chain_tree(1), torch.tensor([[9, d]]), p, q[None, None])
        return d if len(path) == 2 else nxt

    freqs = first_token_freqs(once)
    assert torch.allclose(freqs, P_ROOT.float(), atol=0.03), freqs
    assert freqs[3:].sum() == 0  # never a token p gives zero mass


def test_leviathan_accepts_with_min_one_p_over_q():
    rule = LeviathanRule(identity, make_generator(1, "cpu"), 1)
    q = torch.zeros(V, dtype=torch.float64)
    q[0] = 1.0  # draft 0 with q = 1: accepted with probability p(0) = 0.2
    p = torch.stack([P_ROOT, P_ROOT])[None]
    accepted = sum(len(rule.decide(chain_tree(1), torch.tensor([[9, 0]]), p, q[None, None])[0][0])
                   == 2 for _ in range(4000))
    assert abs(accepted / 4000 - 0.2) < 0.03


def test_pointmass_first_token_follows_p_over_sibling_drafts():
    tree = tree_from_parents([-1, 0, 0])  # two deterministic drafts: tokens 1 and 0
    rule = PointMassRule(identity, make_generator(2, "cpu"), 2)
    p = torch.stack([P_ROOT, P_ROOT, P_ROOT])[None]  # [1, 3, V]

    def once() -> int:
        (path,), (nxt,) = rule.decide(tree, torch.tensor([[9, 1, 0]]), p, None)
        return [9, 1, 0][path[1]] if len(path) > 1 else nxt

    freqs = first_token_freqs(once)
    assert torch.allclose(freqs, P_ROOT.float(), atol=0.03), freqs


def test_pointmass_follows_a_one_hot_target_deterministically():
    tree = tree_from_parents([-1, 0, 0, 2])
    rule = PointMassRule(identity, make_generator(3, "cpu"), 3)
    p = torch.softmax(one_hot_logits([4, 0, 1, 2])[0] * 100, -1)[None]  # one-hot rows
    for _ in range(20):
        assert rule.decide(tree, torch.tensor([[9, 3, 4, 1]]), p, None) == ([[0, 2, 3]], [2])


# --- typical (lossy) -------------------------------------------------------------------------


def test_typical_golden_path_on_hand_made_entropies():
    # root p = [0.9, 0.05, 0.05]: H = 0.394, threshold min(0.09, 0.3 exp(-H) = 0.202) = 0.09:
    # token 0 (0.9) passes, token 1 (0.05) does not. Node 2's p is uniform over 3 tokens:
    # threshold min(0.09, 0.3 / 3 = 0.1) = 0.09 < 1/3, so its child (token 2) passes.
    tree = tree_from_parents([-1, 0, 0, 2])
    tokens = torch.tensor([[9, 1, 0, 2]])
    rows = torch.zeros(4, V, dtype=torch.float64)
    rows[0, :3] = torch.tensor([0.9, 0.05, 0.05])
    rows[1, 0] = 1.0
    rows[2, :3] = 1.0 / 3
    rows[3, 5] = 1.0  # after the accepted path: the next token is 5
    rule = TypicalRule(identity, make_generator(4, "cpu"), 4, epsilon=0.09, delta=0.3)
    assert rule.decide(tree, tokens, rows[None], None) == ([[0, 2, 3]], [5])
    assert rule.lossy and rule.new_result(None).lossy and rule.new_result(None).rule == "typical"


# --- rule selection and the batch boundary --------------------------------------------------


def test_rules_by_name_and_refusals():
    assert isinstance(sampled_rule("pointmass", "cpu"), PointMassRule)
    assert isinstance(make_rule("greedy", False, "cpu"), GreedyRule)
    assert isinstance(make_rule("exact", True, "cpu"), PointMassRule)
    assert isinstance(make_rule("exact", False, "cpu"), LeviathanRule)
    assert isinstance(make_rule("typical", True, "cpu"), TypicalRule)
    with pytest.raises(DecodeError, match="unknown acceptance rule 'leviathan'"):
        make_rule("leviathan", True, "cpu")
    with pytest.raises(ValueError, match="temperature"):
        sampled_rule("leviathan", "cpu", temperature=-1.0)
    rule = LeviathanRule(identity, make_generator(0, "cpu"), 0)
    with pytest.raises(DecodeError, match="chain"):
        rule.decide(tree_from_parents([-1, 0, 0]), torch.tensor([[9, 1, 0]]),
                    torch.stack([P_ROOT] * 3)[None], None)


def test_batch_of_two_is_refused_clearly():
    with pytest.raises(DecodeError, match="batch size 2"):
        GreedyRule().decide(chain_tree(0), torch.tensor([[1], [2]]),
                            one_hot_logits([0, 1]).reshape(2, 1, V), None)
    target = make_target()
    for shape in (ChainShape(2), TreeShape()):
        with pytest.raises(DecodeError, match="prompt_ids has batch size 2"):
            run_loop(target, NO_DRAFT, torch.tensor([[1, 2], [3, 4]]), 4, GreedyRule(), shape)
    with pytest.raises(DecodeError, match="prompt_ids has batch size 2"):
        decode(target, NO_DRAFT, [[1, 2], [3, 4]], 4)
    with pytest.raises(DecodeError, match=r"\[tokens\] or \[batch, tokens\]"):
        decode(target, NO_DRAFT, [[[1, 2]]], 4)
    with pytest.raises(DecodeError, match="needs a proposer"):
        decode(target, None, [1, 2], 4)


# --- one loop -------------------------------------------------------------------------------


def calls_in(path: Path) -> set[str]:
    """Names of the functions and methods a module calls."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return out


def test_only_the_loop_runs_verification_forwards():
    """The target's prefill / verification forwards and cache compaction are called from
    verify/loop.py alone (verify/steps.py and verify/ragged.py define them; verify/shapes.py cuts
    trees and gathers accepted rows for it): a second decode loop fails here. The batched loop
    runs every forward through `batch_forward`. One named exception: the grouped EAGLE drafter
    compacts its own stacked draft cache with `keep_paths` (verify/eagle3_proposers.py), never the
    target's."""
    loop_calls = {"batch_forward", "keep_paths", "merge_rows", "select_rows"}
    shape_calls = {"gather_rows", "fit_tree"}
    loop_only = loop_calls | shape_calls | {"prefill", "target_step", "tree_forward", "compact_cache"}
    allowed = {"eagle3_proposers.py": {"keep_paths"}}
    offenders = {}
    for path in sorted(VERIFY.glob("*.py")):
        if path.name in ("loop.py", "steps.py", "ragged.py", "shapes.py"):
            continue
        hit = calls_in(path) & loop_only - allowed.get(path.name, set())
        if hit:
            offenders[path.name] = sorted(hit)
    assert not offenders, offenders
    assert loop_calls <= calls_in(VERIFY / "loop.py")
    assert shape_calls <= calls_in(VERIFY / "shapes.py")
