"""Draft shapes of the decode loop (`verify.loop`), one per sequence: what a proposer drafts and
how its accepted path reaches the proposer again.

* `ChainShape(k)`: a chain of <= k drafts (the tree that is a path); the accepted inputs are a
  prefix, so the proposer gets the verified rows as they are (rows past the path ignored);
* `TreeShape`: any tree from a `protocols.TreeProposer`, cut to the budget and context; the
  proposer gets the rows of the accepted path only, gathered (root first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.protocols import TreeProposer
from specheads.target import TargetOutput
from specheads.verify.rules import AcceptRule
from specheads.verify.steps import DecodeError, DecodeStats, check_tree_attention, fit_tree, gather_rows
from specheads.verify.trees import Tree, chain_tree

Plan = tuple[Tree, torch.Tensor, torch.Tensor | None]  # a row's tree, its tokens [N], q [1, n, V]


@dataclass
class ChainShape:
    """A chain of <= k drafts per step (verified with a causal mask, the path a prefix)."""

    k: int
    _trees: dict[int, Tree] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.k < 0:
            raise DecodeError(f"k (draft length) must be >= 0, got {self.k}")

    def check(self, target) -> None:
        pass

    def new_stats(self) -> DecodeStats:
        return DecodeStats(accepted_per_pos=[0] * self.k)

    def drafts_with(self, proposer) -> bool:
        return self.k > 0

    def depth(self, tree: Tree) -> int:
        return tree.size - 1  # a path

    def tree(self, n: int) -> Tree:
        """The chain of n drafts as a tree (built once per length)."""
        if n not in self._trees:
            self._trees[n] = chain_tree(n)
        return self._trees[n]

    def length(self, remaining: int) -> int:
        """Drafts to ask for with `remaining` tokens left in the budget (the bonus is one)."""
        return min(self.k, remaining - 1)

    def draft(self, proposer, rule: AcceptRule, remaining: int, vocab_size: int) -> Plan:
        nodes, q = rule.chain_draw(proposer).run(proposer, self.length(remaining), vocab_size)
        return self.plan(nodes, q)

    def planned(self, draw, drafted: tuple, vocab_size: int) -> Plan:
        """A proposer's drafted chain (ids [n], q [n, V] or None), as the rule's `ChainDraw` needs it."""
        return self.plan(*draw.q_for(*drafted, vocab_size))

    def plan(self, nodes: torch.Tensor, q: torch.Tensor | None) -> Plan:
        """A drafted chain nodes [n] (q [n, V] or None) as this step's tree, nodes and q [1, n, V]."""
        return self.tree(nodes.numel()), nodes, None if q is None else q[None]

    def fit(self, tree: Tree, tokens: torch.Tensor, remaining: int, past: int, ctx):
        return tree, tokens  # k <= remaining - 1 <= context room already

    def accepted(self, tokens: torch.Tensor, out: TargetOutput,
                 path: list[int]) -> tuple[torch.Tensor, TargetOutput]:
        """The accepted inputs [1, m+1] and the rows of `out` behind them (a prefix: as is)."""
        return tokens[None, : len(path)], out


class TreeShape:
    """Any draft tree per step: tree-mask verification, the cache compacted to the accepted path."""

    def check(self, target) -> None:
        check_tree_attention(target.config)

    def new_stats(self) -> DecodeStats:
        return DecodeStats()

    def drafts_with(self, proposer) -> bool:
        return True

    def depth(self, tree: Tree) -> int:
        return tree.max_depth

    def tree(self, n: int) -> Tree:
        return chain_tree(n)

    def length(self, remaining: int) -> int:
        """Drafts past the root the budget leaves (a tree is cut to it by `fit`)."""
        return remaining - 1

    def draft(self, proposer, rule: AcceptRule, remaining: int, vocab_size: int) -> Plan:
        return self.planned(None, proposer.propose_tree(), vocab_size)

    def planned(self, draw, drafted: tuple, vocab_size: int) -> Plan:
        """A proposer's drafted tree (tree, node tokens [N-1])."""
        tree, nodes = drafted
        return tree, nodes.reshape(-1), None

    def fit(self, tree: Tree, tokens: torch.Tensor, remaining: int, past: int, ctx):
        return fit_tree(tree, tokens, remaining, past, ctx)  # tokens [N']

    def accepted(self, tokens: torch.Tensor, out: TargetOutput,
                 path: list[int]) -> tuple[torch.Tensor, TargetOutput]:
        path_t = torch.tensor(path)
        return tokens[path_t][None], gather_rows(out, path_t)


def draft_shape(proposer, k: int) -> ChainShape | TreeShape:
    """The proposer decides: a tree proposer drafts trees, any other a chain of <= k."""
    return TreeShape() if isinstance(proposer, TreeProposer) else ChainShape(k)
