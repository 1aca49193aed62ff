"""Greedy tree speculative decoding: one target forward per step over a whole token tree.

Each step verifies [root, nodes...] in one pass (docs/algorithms.md §8.5); greedy acceptance
(§8.1) walks down from the root, always to the child holding the parent's argmax; the bonus
token is the argmax at the deepest accepted node. The loop is `verify.loop` with a `TreeShape`
and the `GreedyRule`; the tree building blocks live in `verify.steps` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from specheads.target import TargetOutput
from specheads.verify.decode import as_batch
from specheads.verify.loop import TreeShape, decode
from specheads.verify.rules import GreedyRule, greedy_tree_accept
from specheads.verify.steps import (
    TREE_ATTENTION,
    DecodeResult,
    check_tree_attention,
    compact_cache,
    fit_tree,
    gather_rows,
    tree_attention_mask,
    tree_forward,
)
from specheads.verify.trees import Tree

__all__ = [
    "TREE_ATTENTION", "TreeProposer", "check_tree_attention", "compact_cache", "fit_tree",
    "gather_rows", "greedy_tree_accept", "tree_attention_mask", "tree_forward", "tree_generate",
]


class TreeProposer(Protocol):
    """Like the chain `Proposer`, but `propose_tree` returns a tree and its node tokens.

    `accept` receives the verification rows of the accepted path only (root first), so a chain
    proposer's `accept` works unchanged.
    """

    layers: list[int]

    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None: ...

    def propose_tree(self) -> tuple[Tree, torch.Tensor]: ...  # tree, tokens of nodes 1..N-1 [N-1]

    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None: ...


def tree_generate(target, proposer: TreeProposer | None, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Greedy tree speculative decoding; equals plain greedy decoding token for token.

    `proposer` None gives plain greedy decoding through the tree path (a root-only tree per step).
    Never more than max_new_tokens tokens; stops after an eos id.
    """
    return decode(target, proposer, as_batch(prompt_ids), max_new_tokens, GreedyRule(),
                  TreeShape(), eos_token_ids)[0]
