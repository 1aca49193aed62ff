"""Greedy tree speculative decoding: one target forward per step over a whole token tree.

Each step verifies [root, nodes...] in one pass (docs/algorithms.md §8.5): RoPE positions
follow depth (`P + depth`), an additive 4-D mask lets a node see the whole cached prefix and its
own ancestors, and the new keys / values land in cache slots P .. P+N-1. Greedy acceptance
(§8.1) walks down from the root, always to the child holding the parent's argmax; the bonus
token is the argmax at the deepest accepted node. The cache is then compacted to the prefix plus
the accepted path (§8.5), so the next step starts from exactly what plain decoding would have.

Sequence bookkeeping is the chain loop's (`verify.decode`): `seq` = prompt + emitted tokens, the
target cache holds every position of `seq` but the last, which is the next tree's root.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

import torch

from specheads.target import TargetOutput
from specheads.verify.decode import (
    DecodeError,
    DecodeResult,
    DecodeStats,
    Clock,
    prefill,
    context_length,
    cut_at_eos,
    prepare_prompt,
)
from specheads.verify.trees import Tree, chain_tree, prune, subtree

TREE_ATTENTION = ("eager", "sdpa")


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


# --- pure helpers ------------------------------------------------------------------------------


def check_tree_attention(config, what: str = "the target") -> None:
    """Refuse attention kernels that ignore an arbitrary 4-D mask (tree verification needs one)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl in TREE_ATTENTION:
        return
    why = ("flash attention ignores custom 4-D masks, so tree nodes would see their siblings"
           if "flash" in impl else "it is not tested with custom 4-D tree masks")
    raise DecodeError(
        f"{what} uses attn_implementation='{impl}': tree verification cannot use it ({why}). "
        f"Load it with attn_implementation='sdpa' or 'eager'"
    )


def tree_attention_mask(tree_mask: torch.Tensor, past: int, dtype: torch.dtype,
                        device) -> torch.Tensor:
    """tree_mask [N, N] bool (ancestor-or-self) -> additive mask [1, 1, N, past + N].

    0 where a node may attend (every prefix column, its ancestors and itself), dtype min elsewhere.
    """
    n = tree_mask.shape[0]
    allow = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device),
                       tree_mask.to(device)], dim=1)  # [N, past + N]
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[None, None]


def tree_forward(target, tokens: torch.Tensor, tree: Tree, past: int, cache,
                 layers=()) -> TargetOutput:
    """Run tree tokens [N] (root first) after `past` cached positions; appends N cache slots.

    Returns logits [1, N, V]: row j is the target's distribution for a child of node j.
    """
    device = target.device
    position_ids = (tree.depths.to(device) + past)[None]  # [1, N]
    mask = tree_attention_mask(tree.mask, past, target.dtype, device)  # [1, 1, N, past + N]
    return target.forward(tokens.reshape(1, -1).to(device), layers=list(layers),
                          attention_mask=mask, position_ids=position_ids, cache=cache,
                          use_cache=True)


def greedy_tree_accept(tree: Tree, tokens: torch.Tensor, argmax: torch.Tensor) -> list[int]:
    """tokens [N], argmax [N] -> accepted path (node indices, root first).

    From the root, move to the first child whose token equals the current node's argmax; stop
    at a node without such a child. The bonus token is argmax[path[-1]].
    """
    parents, toks, best = tree.parents.tolist(), tokens.tolist(), argmax.tolist()
    path = [0]
    for i in range(1, len(parents)):  # topological order: a child comes after its parent
        if parents[i] == path[-1] and toks[i] == best[path[-1]]:
            path.append(i)
    return path


def compact_cache(cache, past: int, path: list[int] | torch.Tensor) -> None:
    """Keep cache positions [0, past) and the tree slots past + path, in that order, in place."""
    path = torch.as_tensor(path, dtype=torch.long)
    n = path.numel()
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise DecodeError("tree verification does not support sliding-window cache layers yet")
        idx = (path + past).to(layer.keys.device)
        for name in ("keys", "values"):
            full = getattr(layer, name)  # [B, heads, past + N, head_dim]
            rows = full.index_select(-2, idx)  # gathered first: safe when slots overlap
            full[..., past: past + n, :] = rows
            setattr(layer, name, full[..., : past + n, :])
    if cache.get_seq_length() != past + n:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} positions after compaction, "
                           f"expected {past + n}")


def gather_rows(out: TargetOutput, rows: torch.Tensor) -> TargetOutput:
    """Rows of a tree forward (logits and hidden states) along `rows` [n] -> a chain-like output."""
    rows = rows.to(out.logits.device)
    return TargetOutput(logits=out.logits.index_select(1, rows),
                        hidden={i: h.index_select(1, rows) for i, h in out.hidden.items()},
                        cache=out.cache,
                        final=None if out.final is None else out.final.index_select(1, rows))


def fit_tree(tree: Tree, tokens: torch.Tensor, remaining: int, past: int,
             ctx: int | None) -> tuple[Tree, torch.Tensor]:
    """Cut a proposed tree (tokens [N], root first) to the output budget and the context room."""
    if ctx is not None and tree.size > ctx:
        raise DecodeError(
            f"the draft tree has {tree.size} nodes but the target's context "
            f"(max_position_embeddings) is {ctx}: use a tree with fewer nodes"
        )
    kept = prune(tree, max_depth=remaining - 1, max_nodes=None if ctx is None else ctx - past)
    return subtree(tree, kept), tokens[kept.to(tokens.device)]


# --- the loop ------------------------------------------------------------------------------------


@torch.no_grad()
def tree_generate(target, proposer: TreeProposer | None, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Greedy tree speculative decoding; equals plain greedy decoding token for token.

    `proposer` None gives plain greedy decoding through the tree path (a root-only tree per step).
    Never more than max_new_tokens tokens; stops after an eos id.
    """
    check_tree_attention(target.config)
    ids, budget = prepare_prompt(target, prompt_ids, max_new_tokens)
    eos = frozenset(int(e) for e in eos_token_ids)
    layers = list(getattr(proposer, "layers", ())) if proposer is not None else []
    stats = DecodeStats()
    result = DecodeResult(tokens=[], stop_reason="length", stats=stats)
    tgt_clock, prop_clock = Clock(target.device), Clock(target.device)
    t_start = time.perf_counter()
    if budget == 0:
        stats.wall_s = time.perf_counter() - t_start
        return result

    ctx = context_length(target)
    cache, out = prefill(target, ids, layers, stats, tgt_clock)
    first = int(out.logits[0, -1].argmax())
    seq = ids[0].tolist() + [first]
    result.tokens.append(first)
    done = first in eos
    if proposer is not None and not done and budget > 1:
        with prop_clock:
            proposer.start(ids[0], first, out)
        stats.proposer_start_s, prop_clock.seconds = prop_clock.seconds, 0.0

    while not done and len(result.tokens) < budget:
        remaining = budget - len(result.tokens)
        past = len(seq) - 1
        root = torch.tensor([seq[-1]], device=target.device)
        tree, nodes = chain_tree(0), root[:0]
        if proposer is not None and remaining > 1:
            with prop_clock:
                tree, nodes = proposer.propose_tree()
        tokens = torch.cat([root, nodes.reshape(-1).to(target.device)])  # [N]
        tree, tokens = fit_tree(tree, tokens, remaining, past, ctx)
        with tgt_clock:
            out = tree_forward(target, tokens, tree, past, cache, layers)
            argmax = out.logits[0].argmax(-1)  # [N]
            path = greedy_tree_accept(tree, tokens, argmax)
            compact_cache(cache, past, path)
        path_t = torch.tensor(path, device=target.device)
        emitted = tokens[path_t[1:]].tolist() + [int(argmax[path[-1]])]
        emitted, done = cut_at_eos(emitted, eos)
        result.record_step(len(emitted), len(path) - 1, tree.size - 1, tree.max_depth)
        seq.extend(emitted)
        result.tokens.extend(emitted)
        if proposer is not None and not done and len(result.tokens) < budget:
            with prop_clock:
                proposer.accept(tokens[path_t], torch.tensor(emitted, device=target.device),
                                gather_rows(out, path_t), past)
    if done:
        result.stop_reason = "eos"
    stats.tokens = len(result.tokens)
    stats.target_decode_s = tgt_clock.seconds
    stats.proposer_s = prop_clock.seconds
    stats.wall_s = time.perf_counter() - t_start
    return result
