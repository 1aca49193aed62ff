"""Token trees as data: parent pointers, depths, ancestor masks and root-to-leaf paths.

A tree of N nodes is stored in topological order: node 0 is the root (the last emitted token,
not yet in the target cache; parent -1), every other node's parent has a smaller index (depth-1
nodes have parent 0). Everything the verifier needs is derived once from the parents
(docs/algorithms.md §1 and §4):

* `depths [N]`: root 0; also the RoPE position offset of each node (siblings share a position).
* `mask [N, N]` bool: `mask[i, j]` iff j is an ancestor of i or i itself (row = what node i
  may attend to inside the tree).
* `paths [num_leaves, max_depth + 1]`: one row per leaf, the node indices from the root down to
  that leaf, padded with -1; rows are ordered by leaf index.

Static trees come from Medusa-style choice lists (tuples of sibling ranks, the root implicit) and
are cached per shape; dynamic trees (EAGLE-2) come straight from parent pointers. A chain of k
drafts is the tree `chain_tree(k)`. Tensors of a cached tree are shared: never modify them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class SettingsError(ValueError):
    """Speculation settings that cannot run (a tree, a draft length, a sampling rule); the message
    names the option to change."""


class TreeError(ValueError):
    """A tree description that cannot be turned into a valid token tree."""


@dataclass(frozen=True, eq=False)
class Tree:
    """An immutable token tree (see the module docstring for the conventions)."""

    parents: torch.Tensor  # [N] long; -1 for the root, parents[i] < i otherwise
    depths: torch.Tensor  # [N] long
    mask: torch.Tensor  # [N, N] bool, ancestor-or-self
    paths: torch.Tensor  # [num_leaves, max_depth + 1] long, padded -1
    ranks: torch.Tensor  # [N] long: rank among the parent's top-k (static trees); root 0

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self, node: int) -> list[int]:
        """Indices of the direct children of `node`, ascending."""
        return (self.parents == node).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node` (both included)."""
        path = [node]
        while path[-1] > 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]


# --- derived buffers (pure functions over parent pointers) -------------------------------------


def check_parents(parents: torch.Tensor) -> None:
    """Refuse parent pointers that are not a rooted tree in topological order."""
    if parents.dim() != 1 or parents.numel() == 0:
        raise TreeError(f"parents must be a non-empty 1-D tensor, got shape {tuple(parents.shape)}")
    if int(parents[0]) != -1:
        raise TreeError(f"node 0 is the root and must have parent -1, got {int(parents[0])}")
    idx = torch.arange(parents.numel())
    bad = ((parents[1:] < 0) | (parents[1:] >= idx[1:])).nonzero().flatten() + 1
    if bad.numel():
        i = int(bad[0])
        raise TreeError(
            f"node {i} has parent {int(parents[i])}: every non-root node needs a parent in "
            f"0..{i - 1} (nodes in topological order, root = node 0)"
        )


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] -> depths [N] (root 0)."""
    depths = torch.zeros_like(parents)
    for i in range(1, parents.numel()):
        depths[i] = depths[parents[i]] + 1
    return depths


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] -> bool [N, N]: row i = ancestors of i and i itself."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def retrieval_paths(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """parents [N], depths [N] -> root-to-leaf node ids [num_leaves, max_depth + 1], -1 padded."""
    n = parents.numel()
    is_parent = torch.zeros(n, dtype=torch.bool)
    is_parent[parents[1:]] = True
    leaves = (~is_parent).nonzero().flatten().tolist()
    paths = torch.full((len(leaves), int(depths.max()) + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            paths[row, depths[node]] = node
            node = int(parents[node])
    return paths


def tree_from_parents(parents: Sequence[int] | torch.Tensor,
                      ranks: Sequence[int] | torch.Tensor | None = None) -> Tree:
    """Parent pointers [N] (root -1 at node 0, topological order) -> Tree (for dynamic trees)."""
    parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1).cpu()
    check_parents(parents)
    depths = depths_of(parents)
    if ranks is None:
        ranks = sibling_ranks(parents)
    ranks = torch.as_tensor(ranks, dtype=torch.long).reshape(-1).cpu()
    if ranks.shape != parents.shape:
        raise TreeError(f"ranks has {ranks.numel()} entries for a tree of {parents.numel()} nodes")
    return Tree(parents=parents, depths=depths, mask=ancestor_mask(parents),
                paths=retrieval_paths(parents, depths), ranks=ranks)


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] -> ranks [N]: order of each node among its siblings (by index); root 0."""
    ranks = torch.zeros_like(parents)
    seen: dict[int, int] = {}
    for i in range(1, parents.numel()):
        p = int(parents[i])
        ranks[i] = seen.get(p, 0)
        seen[p] = int(ranks[i]) + 1
    return ranks


# --- static trees --------------------------------------------------------------------------------


def normalize_choices(choices: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Choice list -> sorted tuple of rank tuples (by length, then lexicographically).

    Refuses empty paths, negative ranks, duplicates and paths whose prefix is missing.
    """
    paths = [tuple(int(r) for r in c) for c in choices]
    for p in paths:
        if not p:
            raise TreeError("a choice path is empty: the root is implicit, list its descendants")
        if min(p) < 0:
            raise TreeError(f"choice {list(p)} has a negative rank")
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TreeError(f"choice {list(dup)} is listed more than once")
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise TreeError(
                f"choice {list(p)} needs its prefix {list(p[:-1])}, which is not listed: every "
                "prefix of a path must itself be a path"
            )
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@functools.lru_cache(maxsize=64)
def _tree_from_sorted_choices(paths: tuple[tuple[int, ...], ...]) -> Tree:
    index = {p: i + 1 for i, p in enumerate(paths)}  # node index = sorted position + 1
    parents = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in paths]
    ranks = [0] + [p[-1] for p in paths]
    return tree_from_parents(parents, ranks)


def tree_from_choices(choices: Iterable[Sequence[int]]) -> Tree:
    """Medusa-format choice list (rank tuples; root implicit) -> Tree, cached per shape.

    Node i >= 1 is the (i-1)-th path after sorting by (length, lexicographic); its rank is the
    path's last entry (which top-k token of its parent it holds).
    """
    return _tree_from_sorted_choices(normalize_choices(choices))


def chain_tree(k: int) -> Tree:
    """The chain root -> d_1 -> ... -> d_k as a tree of k + 1 nodes."""
    if k < 0:
        raise TreeError(f"a chain needs k >= 0 drafts, got {k}")
    return tree_from_choices([(0,) * d for d in range(1, k + 1)])


# --- pruning -------------------------------------------------------------------------------------


def prune(tree: Tree, max_depth: int | None = None, max_nodes: int | None = None) -> torch.Tensor:
    """Nodes to keep [M] (ascending, root first): depth <= max_depth, then the first max_nodes.

    Both cuts keep the set ancestor-closed (parents precede children and are shallower).
    """
    keep = torch.ones(tree.size, dtype=torch.bool)
    if max_depth is not None:
        keep &= tree.depths <= max(max_depth, 0)
    kept = keep.nonzero().flatten()
    if max_nodes is not None:
        kept = kept[: max(max_nodes, 1)]
    return kept


def subtree(tree: Tree, kept: torch.Tensor) -> Tree:
    """The tree restricted to `kept` [M]: ascending, ancestor-closed node indices, root first."""
    if kept.numel() == tree.size:
        return tree
    new_index = torch.full((tree.size,), -1, dtype=torch.long)
    new_index[kept] = torch.arange(kept.numel())
    parents = tree.parents[kept]
    new_parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    if bool((new_parents[1:] < 0).any()):
        raise TreeError("the kept nodes are not ancestor-closed")
    return tree_from_parents(new_parents, tree.ranks[kept])


def tokens_by_rank(tree: Tree, ranked) -> torch.Tensor:
    """Node tokens [N] of a rank tree: node (r_1, .., r_d) holds the r_d-th best token of level d.

    `ranked(depth, n)` returns the n best target ids of level `depth` [n] (Medusa head d, DFlash slot d);
    the root (node 0) is left 0, it is the token already emitted.
    """
    depths, ranks = tree.depths.tolist(), tree.ranks.tolist()
    tokens = torch.zeros(tree.size, dtype=torch.long)
    for depth in range(1, tree.max_depth + 1):
        level = [v for v in range(tree.size) if depths[v] == depth]
        top = ranked(depth, max(ranks[v] for v in level) + 1).cpu()  # [n]
        for v in level:
            tokens[v] = top[ranks[v]]
    return tokens
