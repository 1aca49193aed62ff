"""Training-free proposers: prompt lookup (n-gram), the empty draft, and a fixed-tree oracle stub.

`NO_DRAFT` is the one way to say "no drafter": it proposes nothing, so the decode loop runs plain
decoding through the same path (and a streaming wrapper still sees every token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specheads.verify.trees import Tree, TreeError, tree_from_choices


class NullProposer:
    """Proposes nothing: every step verifies only the last token (plain decoding)."""

    layers: list[int] = []

    def start(self, prompt_ids, first_token, out=None) -> None:
        pass

    def propose(self, k: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)  # [0]

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        pass


NO_DRAFT = NullProposer()


def lookup_continuation(context: torch.Tensor, k: int, max_ngram: int = 3,
                        min_ngram: int = 1) -> torch.Tensor:
    """Prompt lookup: context [L] -> up to k tokens that followed an earlier occurrence of the
    longest trailing n-gram (n = max_ngram .. min_ngram); empty when nothing matches.

    Among the earlier occurrences, the latest one followed by k full tokens wins (recent text is
    the best guess); when none is, the earliest one, which is followed by the most tokens.
    """
    L = context.numel()
    for n in range(max_ngram, min_ngram - 1, -1):
        if n < 1 or L <= n:
            continue
        tail = context[L - n:]
        windows = context[: L - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram start
        hits = (windows == tail).all(-1).nonzero().flatten()
        if hits.numel():
            full = hits[L - (hits + n) >= k]
            begin = int(full[-1] if full.numel() else hits[0]) + n
            return context[begin: begin + k]
    return context.new_empty(0)


class NgramProposer:
    """Training-free baseline: propose what followed the trailing n-gram earlier in the context."""

    layers: list[int] = []

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context = torch.empty(0, dtype=torch.long)

    def fork(self) -> NgramProposer:
        """The same lookup for another concurrent request (its own context)."""
        return NgramProposer(self.max_ngram, self.min_ngram)

    def start(self, prompt_ids: torch.Tensor, first_token: int, out=None) -> None:
        self.context = torch.cat([prompt_ids.reshape(-1).cpu().long(), torch.tensor([first_token])])

    def propose(self, k: int) -> torch.Tensor:
        return lookup_continuation(self.context, k, self.max_ngram, self.min_ngram)

    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        self.context = torch.cat([self.context, following.reshape(-1).cpu().long()])


class FixedTreeProposer:
    """Stub: a fixed tree whose node tokens come from `fill(context) -> tokens [N-1]`.

    `context` is the list of all tokens so far (prompt + emitted, the root last). For tests
    and for measuring how a tree shape would fare with a given oracle.
    """

    layers: list[int] = []

    def __init__(self, tree: Tree | list, fill: Callable[[list[int]], torch.Tensor]):
        self.tree = tree if isinstance(tree, Tree) else tree_from_choices(tree)
        self.fill = fill
        self.max_nodes = self.tree.size
        self.context: list[int] = []

    def start(self, prompt_ids, first_token, out=None) -> None:
        self.context = prompt_ids.reshape(-1).tolist() + [int(first_token)]

    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        tokens = torch.as_tensor(self.fill(list(self.context)), dtype=torch.long).reshape(-1)
        if tokens.numel() != self.tree.size - 1:
            raise TreeError(f"fill gave {tokens.numel()} tokens for {self.tree.size - 1} nodes")
        return self.tree, tokens

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        self.context.extend(following.reshape(-1).tolist())
