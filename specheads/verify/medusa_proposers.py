"""Medusa proposers: a chain (argmax of heads 1..k) and static trees (Medusa choice lists).

Medusa heads read only the target's final-normed state at the last verified position, never the
drafted prefix, so a node's token depends on its depth and rank alone: the node at choice path
(r_1, .., r_d) holds the r_d-th most likely token of head d. Nothing is cached between steps
except that one state [1, H] (docs/algorithms.md §1).
"""

from __future__ import annotations

import torch

from specheads.target import TargetError, TargetOutput
from specheads.verify.rank_trees import Ranker, RankTreeProposer
from specheads.verify.settings import chain_or_static
from specheads.verify.trees import Tree


def check_medusa_fits(head, target) -> None:
    """Refuse heads whose width / vocabulary differ from the target's."""
    cfg = head.config
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise TargetError(f"the Medusa heads (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) do not fit "
                          f"this target (hidden {target.hidden_size}, vocab {target.vocab_size})")


class MedusaProposer:
    """Chain drafts: d_j = argmax of head j on the last verified position's final state."""

    layers: list[int] = []

    def __init__(self, head, target):
        check_medusa_fits(head, target)
        self.head = head.eval()
        self.target = target
        self.last = None  # final-normed state of the last verified position: [1, H]

    def _remember(self, out: TargetOutput, row: int) -> None:
        if out.final is None:
            raise RuntimeError("the target output carries no final-normed state (TargetOutput.final)")
        self.last = out.final[0, row: row + 1]  # [1, H]

    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        self._remember(out, prompt_ids.numel() - 1)

    @torch.no_grad()
    def ranked(self, depth: int, k: int) -> torch.Tensor:
        """The top-k token ids [k] of head `depth` (1-based)."""
        return self.head.head_logits(depth - 1, self.last)[0].topk(k).indices

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Up to min(k, K) draft tokens [n]."""
        n = min(k, self.head.config.num_heads)
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        return self.head.all_logits(self.last)[:n, 0].argmax(-1)  # [n]

    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None:
        self._remember(out, inputs.numel() - 1)


class MedusaStaticTreeProposer(RankTreeProposer):
    """A fixed Medusa tree: node (r_1, .., r_d) holds rank r_d of head d (rank 0 = argmax)."""

    def __init__(self, head, target, tree: Tree | list):
        n = head.config.num_heads
        super().__init__(MedusaProposer(head, target), tree, n, f"there are only {n} Medusa heads")

    def rankings(self) -> Ranker:
        return self.chain.ranked


def make_proposer(spec, head, target, sampled: bool = False):
    """Medusa proposer for a `TreeSpec`: a chain or a static tree (drafts are always top-k; sampled
    chains verify them as point masses, which stays lossless)."""
    return chain_or_static(spec, MedusaProposer, MedusaStaticTreeProposer, head, target, "Medusa heads",
                           " (each head ignores the drafted prefix)")
