"""Acceptance rules of the decode loop (`verify.loop`): which drafted tokens the target keeps.

A rule sees one verified draft tree (a chain is the tree that is a path), the tokens of its nodes
and the target's logits for a child of every node, and returns the accepted path and the next
token. It also says how the first token is chosen and how a chain proposer must draft for it
(`ChainDraw`: top-1 or sampled from the proposer's q):

* `GreedyRule`: argmax (docs/algorithms.md §8.1), chains and trees; lossless.
* `LeviathanRule`: Leviathan / Chen speculative sampling (§8.2), chains only; drafts are sampled
  from the proposer's own q when it can (`protocols.SampledProposer`), else treated as point
  masses.
* `PointMassRule`: EAGLE-2/3 recursive rejection for deterministic trees (§8.3); lossless.
* `TypicalRule`: Medusa typical acceptance (§8.4) of deterministic drafts; LOSSY.

Every rule works on batch row 0 and refuses B > 1 (`one_row`): the loop's boundaries carry a
batch dimension, the rules do not batch yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from specheads.protocols import SampledProposer
from specheads.verify.sampling import (
    Warper,
    accept_chain,
    accept_tree_pointmass,
    check_warp,
    make_generator,
    point_mass,
    sample,
    typical_accept,
    warp,
)
from specheads.verify.steps import DecodeError, DecodeResult, DecodeStats, SampleResult
from specheads.verify.trees import Tree

Decision = tuple[list[list[int]], list[int]]  # per sequence: accepted path (root first), next token


class AcceptRule(Protocol):
    """What the loop asks of an acceptance rule (shapes at the batch boundary: B == 1 today)."""

    name: str
    lossy: bool

    def first_token(self, logits: torch.Tensor) -> list[int]: ...  # prefill logits [B, V] -> [B]

    def chain_draw(self, proposer) -> ChainDraw: ...  # how a chain proposer drafts for it

    def decide(self, tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
               q: torch.Tensor | None) -> Decision: ...  # tokens [B, N], logits [B, N, V]

    def new_result(self, stats: DecodeStats) -> DecodeResult: ...


def one_row(x: torch.Tensor, what: str) -> torch.Tensor:
    """Row 0 of a [B, ...] tensor; a clear error for B != 1 (the rules decide one sequence)."""
    if x.shape[0] != 1:
        raise DecodeError(f"{what} has batch size {x.shape[0]}: the decoder runs one sequence "
                          "at a time (batch size 1); decode the prompts one by one")
    return x[0]


# --- greedy --------------------------------------------------------------------------------------


def accepted_prefix(draft: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Greedy chain acceptance: draft [k], target_argmax [>= k] -> length of the matching prefix."""
    k = draft.shape[0]
    if k == 0:
        return 0
    match = (draft == target_argmax[:k]).long()
    return int(match.cumprod(0).sum())


def greedy_tree_accept(tree: Tree, tokens: torch.Tensor, argmax: torch.Tensor) -> list[int]:
    """tokens [N], argmax [N] -> accepted path (node indices, root first).

    From the root, move to the first child whose token equals the current node's argmax; stop
    at a node without such a child. The bonus token is argmax[path[-1]]. On a chain this is
    `accepted_prefix`.
    """
    parents, toks, best = tree.parents.tolist(), tokens.tolist(), argmax.tolist()
    path = [0]
    for i in range(1, len(parents)):  # topological order: a child comes after its parent
        if parents[i] == path[-1] and toks[i] == best[path[-1]]:
            path.append(i)
    return path


def deterministic_drafts(proposer, k: int) -> torch.Tensor:
    """The proposer's top-1 chain: ids [<= k]."""
    return proposer.propose(k).reshape(-1)[:k]


@dataclass(frozen=True)
class ChainDraw:
    """How a rule has a chain proposer draft: its top-1 chain (`sampler` None) or sampled from its
    own warped q (`sampler` = (warper, generator)); `point_mass`: the rule needs q of a top-1 chain.
    The per-row path (`run`) and a draft group (`verify.loop`) both finish a chain with `q_for`."""

    sampler: tuple[Warper, torch.Generator] | None = None
    point_mass: bool = False

    def run(self, proposer, k: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """proposer's drafts [n <= k] and their q [n, V] (None when the rule needs none)."""
        if self.sampler is None:
            return self.q_for(deterministic_drafts(proposer, k), None, vocab_size)
        tokens, q = proposer.propose_sampled(k, *self.sampler)
        return tokens.reshape(-1)[:k], q[:k]

    def q_for(self, tokens: torch.Tensor, q: torch.Tensor | None,
              vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A drafted chain tokens [n] with its sampled q [n, V] (None for a top-1 chain) -> what the
        rule verifies: the point mass of a top-1 chain when it needs q."""
        if q is None and self.point_mass:
            q = point_mass(tokens, vocab_size)
        return tokens, q


TOP1 = ChainDraw()


class GreedyRule:
    """Keep the drafts the target's argmax agrees with; the bonus is the argmax after them."""

    name, lossy = "greedy", False

    def first_token(self, logits: torch.Tensor) -> list[int]:
        return [int(one_row(logits, "the prefill logits").argmax())]  # logits [B, V]

    def chain_draw(self, proposer) -> ChainDraw:
        return TOP1

    def decide(self, tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
               q=None) -> Decision:
        argmax = one_row(logits, "the verification logits").argmax(-1)  # [N]
        path = greedy_tree_accept(tree, one_row(tokens, "the verified tokens"), argmax)
        return [path], [int(argmax[path[-1]])]

    def new_result(self, stats: DecodeStats) -> DecodeResult:
        return DecodeResult(tokens=[], stop_reason="length", stats=stats)


# --- sampled -------------------------------------------------------------------------------------


@dataclass
class SampledRule:
    """Shared by the sampling rules: the target's warp (the draft's too), the seeded generator."""

    warper: Warper
    gen: torch.Generator
    seed: int

    name = "sampled"
    lossy = False

    def first_token(self, logits: torch.Tensor) -> list[int]:
        row = one_row(logits, "the prefill logits")  # [V]
        return [int(sample(self.warper(row).to(self.gen.device), self.gen))]

    def chain_draw(self, proposer) -> ChainDraw:
        return TOP1

    def probs(self, tokens: torch.Tensor,
              logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N] tokens and [B, N, V] logits -> row 0's tokens [N] and warped p [N, V], where
        the generator draws."""
        toks = one_row(tokens, "the verified tokens").to(self.gen.device)
        p = self.warper(one_row(logits, "the verification logits"))
        return toks, p.to(self.gen.device)

    def new_result(self, stats: DecodeStats) -> SampleResult:
        return SampleResult(tokens=[], stop_reason="length", stats=stats, rule=self.name,
                            lossy=self.lossy, seed=self.seed)


class LeviathanRule(SampledRule):
    """Accept d_j with probability min(1, p/q), replace the first rejection from the residual."""

    name = "leviathan"

    def chain_draw(self, proposer) -> ChainDraw:
        """Sampled from the proposer's own q if it can (a `SampledProposer`), else its top-1 chain
        as a point mass."""
        if isinstance(proposer, SampledProposer):
            return ChainDraw(sampler=(self.warper, self.gen))
        return ChainDraw(point_mass=True)

    def decide(self, tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
               q: torch.Tensor | None) -> Decision:
        n = tree.size - 1
        if int(tree.depths[-1]) != n or (q is None and n > 0):  # a path: last node at depth n
            raise DecodeError("Leviathan / Chen acceptance verifies a chain with its draft "
                              "distributions q; use the point-mass or typical rule for trees")
        toks, p = self.probs(tokens, logits)  # [1 + n], [1 + n, V]
        V = p.shape[-1]
        q = torch.empty(0, V) if q is None else one_row(q, "the draft distributions")  # [n, V]
        m, nxt = accept_chain(toks[1:], q.reshape(n, V).to(self.gen.device), p, self.gen)
        return [list(range(m + 1))], [nxt]


class PointMassRule(SampledRule):
    """EAGLE-2/3: try each child of the current node against its residual (top-k drafts)."""

    name = "pointmass"

    def decide(self, tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
               q=None) -> Decision:
        toks, p = self.probs(tokens, logits)  # [N], [N, V]
        path, nxt = accept_tree_pointmass(tree, toks, p, self.gen)
        return [path], [nxt]


@dataclass
class TypicalRule(SampledRule):
    """Accept a node whose token's p under its parent beats min(epsilon, delta * exp(-H))."""

    epsilon: float = 0.09
    delta: float = 0.3

    name = "typical"
    lossy = True

    def decide(self, tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
               q=None) -> Decision:
        toks, p = self.probs(tokens, logits)  # [N], [N, V]
        decision = typical_accept(tree, toks, p, self.gen, posterior_threshold=self.epsilon,
                                  posterior_alpha=self.delta)
        return [decision.path], [decision.next_token]


RULES = {"leviathan": LeviathanRule, "pointmass": PointMassRule, "typical": TypicalRule}
NAMES = ("greedy", "exact", "typical")  # what `make_rule` takes; "exact" is lossless sampling


def sampled_rule(rule: str, device, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, epsilon: float = 0.09, delta: float = 0.3) -> SampledRule:
    """A sampling rule of `RULES` by name, its warp checked and its generator seeded on `device`."""
    check_warp(temperature, top_p, top_k)
    warper = partial(warp, temperature=temperature, top_p=top_p, top_k=top_k)
    gen = make_generator(seed, device)
    if rule == "typical":
        return TypicalRule(warper, gen, seed, epsilon, delta)
    return RULES[rule](warper, gen, seed)


def make_rule(name: str, tree: bool, device, temperature: float = 1.0, top_p: float = 1.0,
              top_k: int = 0, seed: int = 0, epsilon: float = 0.09, delta: float = 0.3) -> AcceptRule:
    """The rule called `name` (one of NAMES) for a chain or a `tree` draft: "greedy"; "exact"
    speculative sampling (Leviathan / Chen on chains, EAGLE point mass on trees; lossless);
    "typical" (Medusa typical acceptance; LOSSY)."""
    if name not in NAMES:
        raise DecodeError(f"unknown acceptance rule '{name}': use one of {NAMES}")
    if name == "greedy":
        return GreedyRule()
    if name == "exact":
        name = "pointmass" if tree else "leviathan"
    return sampled_rule(name, device, temperature, top_p, top_k, seed, epsilon, delta)
