"""Static trees over drafters whose depth-d candidates do not depend on the drafted prefix.

Medusa heads and DFlash blocks rank every depth's tokens from the verified context alone, so the
node at choice path (r_1, .., r_d) holds the r_d-th most likely token at depth d, and one set of
rankings fills the whole tree (`trees.tokens_by_rank`). The chain proposer underneath keeps the
state; this class only shapes its rankings into a tree (`protocols.TreeProposer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specheads.verify.trees import Tree, TreeError, tokens_by_rank, tree_from_choices

# depth (1-based), n -> the n most likely target ids [n] at that depth
Ranker = Callable[[int, int], torch.Tensor]


class RankTreeProposer:
    """A fixed tree filled from `rankings()`; subclasses say how deep their drafter reaches."""

    def __init__(self, chain, tree: Tree | list, max_depth: int, why: str):
        self.chain = chain
        self.layers = chain.layers
        self.tree = tree if isinstance(tree, Tree) else tree_from_choices(tree)
        if self.tree.max_depth > max_depth:
            raise TreeError(f"the tree is {self.tree.max_depth} levels deep but {why}: use a tree of "
                            f"depth <= {max_depth}")
        self.max_nodes = self.tree.size

    def start(self, prompt_ids, first_token, out) -> None:
        self.chain.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self.chain.accept(inputs, following, out, start)

    def rankings(self) -> Ranker:
        """The ranker for this step (computed once per step, read by every node)."""
        raise NotImplementedError

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """The tree and its node tokens [N-1] (target ids; the root is the last verified token)."""
        tokens = tokens_by_rank(self.tree, self.rankings())  # [N]
        return self.tree, tokens[1:].to(self.chain.target.device)
