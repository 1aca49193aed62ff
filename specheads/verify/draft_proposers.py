"""Draft-model proposers: an ordinary causal LM sharing the target's tokenizer, with its own KV
cache over the verified tokens; chains, and static trees drafted level by level with a tree mask
over that cache (`DraftModelTreeProposer`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specheads.hf_compat import cache_kwargs
from specheads.verify.settings import chain_or_static
from specheads.verify.steps import causal_mask, check_tree_attention, check_vocab_fits, positions, trim_cache
from specheads.verify.trees import Tree, tree_from_choices


class DraftModelProposer:
    """Greedy chain drafts from an independent causal LM sharing the target's tokenizer."""

    layers: list[int] = []

    def __init__(self, head, target):
        check_vocab_fits("draft-model", head.config.vocab_size, None, target)
        self.model, self.target = head.model.eval(), target
        self.tokens: list[int] = []
        self.cache = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Feed ids at the next positions -> next-token logits [V] of the last one."""
        past = self.cache.get_seq_length()
        x = torch.tensor([ids], device=self.device)
        mask = causal_mask(past, len(ids), next(self.model.parameters()).dtype, self.device)
        out = self.model(input_ids=x, attention_mask=mask, position_ids=positions(past, len(ids), self.device),
                         use_cache=True, **cache_kwargs(self.cache))
        return out.logits[0, -1]

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out=None) -> None:
        self.tokens = prompt_ids.reshape(-1).tolist() + [int(first_token)]
        self.cache = DynamicCache()

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Cache every verified token, then k greedy drafts; draft rows are dropped afterwards."""
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        verified = len(self.tokens)
        logits = self._feed(self.tokens[self.cache.get_seq_length():])
        drafts = [int(logits.argmax())]
        while len(drafts) < k:
            drafts.append(int(self._feed(drafts[-1:]).argmax()))
        trim_cache(self.cache, verified)
        return torch.tensor(drafts, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        self.tokens += [int(t) for t in following.reshape(-1).tolist()]


class DraftModelTreeProposer:
    """Static trees from a draft model: node (r_1, .., r_d) holds the r_d-th most likely token of
    the draft model after the prefix and the tokens of its ancestors.

    One draft forward per tree level: the nodes of depth d-1 that have children go in together,
    each attending to the verified cache, its ancestors' rows and itself (a 4-D tree mask, node
    positions = root position + depth); the rows are dropped from the cache afterwards.
    """

    def __init__(self, head, target, tree: Tree | list):
        check_tree_attention(head.model.config, "the draft model")
        self.chain = DraftModelProposer(head, target)
        self.layers = self.chain.layers
        self.tree = tree if isinstance(tree, Tree) else tree_from_choices(tree)
        self.max_nodes = self.tree.size

    def start(self, prompt_ids, first_token, out=None) -> None:
        self.chain.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        self.chain.accept(inputs, following, out, start)

    def _feed_level(self, nodes: list[int], tokens: list[int], slot: dict[int, int],
                    verified: int) -> torch.Tensor:
        """Run `nodes` (their tokens) as one batch of tree rows -> next-token logits [n, V]."""
        chain, tree = self.chain, self.tree
        past, n = chain.cache.get_seq_length(), len(nodes)
        dtype, device = next(chain.model.parameters()).dtype, chain.device
        allow = torch.zeros(n, past + n, dtype=torch.bool, device=device)  # [n, past + n]
        allow[:, :verified] = True
        for i, v in enumerate(nodes):
            allow[i, [slot[a] for a in tree.path_to(v)[1:-1]]] = True  # ancestors below the root
            allow[i, past + i] = True
            slot[v] = past + i
        mask = torch.zeros(n, past + n, dtype=dtype, device=device)
        mask.masked_fill_(~allow, torch.finfo(dtype).min)
        pos = (tree.depths[nodes].to(device) + verified - 1)[None]  # [1, n]
        x = torch.tensor([[tokens[v] for v in nodes]], device=device)
        out = chain.model(input_ids=x, attention_mask=mask[None, None], position_ids=pos,
                          use_cache=True, **cache_kwargs(chain.cache))
        return out.logits[0]  # [n, V]

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """The tree and the tokens of nodes 1..N-1 [N-1]."""
        chain, tree = self.chain, self.tree
        verified = len(chain.tokens)  # the root (last verified token) is cached last
        root_logits = chain._feed(chain.tokens[chain.cache.get_seq_length():])  # [V]
        depths, ranks = tree.depths.tolist(), tree.ranks.tolist()
        tokens, slot = [chain.tokens[-1]] + [0] * (tree.size - 1), {0: verified - 1}
        logits = {0: root_logits}
        for depth in range(1, tree.max_depth + 1):
            level = [v for v in range(tree.size) if depths[v] == depth]
            for parent in sorted({int(tree.parents[v]) for v in level}):
                kids = [v for v in level if int(tree.parents[v]) == parent]
                top = logits[parent].topk(max(ranks[v] for v in kids) + 1).indices.tolist()
                for v in kids:
                    tokens[v] = top[ranks[v]]
            inner = [v for v in level if tree.children(v)]
            if inner:
                logits.update(zip(inner, self._feed_level(inner, tokens, slot, verified)))
        trim_cache(chain.cache, verified)
        return tree, torch.tensor(tokens[1:], dtype=torch.long)


def make_proposer(spec, head, target, sampled: bool = False):
    """A chain or a static tree. Drafts are deterministic (top-k), so sampled decoding verifies
    them as point masses, which stays lossless."""
    return chain_or_static(spec, DraftModelProposer, DraftModelTreeProposer, head, target, "a draft model")
