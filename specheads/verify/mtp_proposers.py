"""Proposers for MTP heads and small draft models: chains and static trees.

Protocols: verify/proposers.py (chains), verify/tree_decode.py (trees).

MTP: step j keeps its own KV cache of "real" rows, those whose inputs are all verified
(row i at step j reads E(x_{i+j+1}) and step j-1's row i, so step j holds rows 0..N-1-j when
x_N is the last verified token). A proposal runs, at each step j, the rows that involve draft
tokens and then drops them, so every draft equals the teacher-forced training computation.
A static tree runs the same rows per tree node, with a tree mask (`MtpTreeProposer`).

Draft model: an ordinary causal LM with its own KV cache over the verified tokens; a static tree
is drafted level by level with a tree mask over that cache (`DraftModelTreeProposer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads.hf_compat import cache_kwargs
from specheads.target import TargetError, TargetOutput
from specheads.verify.decode import causal_mask, positions, trim_cache
from specheads.verify.tree_decode import check_tree_attention, tree_attention_mask
from specheads.verify.trees import SettingsError, Tree, tree_from_choices


def check_vocab_fits(kind: str, vocab_size: int, hidden_size: int | None, target) -> None:
    """Refuse a drafter whose vocabulary (or width, for MTP) differs from the target's."""
    problems = []
    if vocab_size != target.vocab_size:
        problems.append(f"vocab_size {vocab_size} vs the target's {target.vocab_size}")
    if hidden_size is not None and hidden_size != target.hidden_size:
        problems.append(f"hidden_size {hidden_size} vs the target's {target.hidden_size}")
    if problems:
        raise TargetError(f"the {kind} head does not fit this target: " + "; ".join(problems))


class MtpProposer:
    """Greedy chain drafts from an MTP head, module j % D at draft step j."""

    layers: list[int] = []  # only TargetOutput.final is read

    def __init__(self, head, target):
        check_vocab_fits("MTP", head.config.vocab_size, head.config.hidden_size, target)
        self.head, self.target = head.eval(), target
        self.tokens: list[int] = []
        self.h0 = None  # [1, N, H]: target final-normed states for positions 0..N-1
        self.outs: list[torch.Tensor] = []  # step j -> [1, R_j, H] real rows
        self.caches: list[DynamicCache] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.head.layers[0].eh_proj.weight.dtype

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.target.embed(torch.tensor([ids], device=self.target.device))  # [1, n, H]

    def _run(self, j: int, hidden, ids: list[int], first_row: int) -> torch.Tensor:
        """Rows first_row.. of step j (hidden [1, n, H], E(ids)) on top of step j's cache -> [1, n, H]."""
        n = hidden.shape[1]
        pos = positions(first_row + j, n, hidden.device)
        embeds = self.head.embed_rows(self._embed(ids).to(self.dtype), pos)
        mask = causal_mask(first_row, n, self.dtype, hidden.device)
        return self.head.step(j, hidden, embeds, pos, mask, self.caches[j])

    def _advance(self, steps: int) -> None:
        """Extend every step's real rows to what the verified tokens allow."""
        N = len(self.tokens) - 1
        while len(self.outs) < steps:
            self.outs.append(self.h0.new_zeros(1, 0, self.h0.shape[-1]).to(self.dtype))
            self.caches.append(DynamicCache())
        for j in range(steps):
            have, want = self.outs[j].shape[1], max(N - j, 0)
            if want <= have:
                continue
            src = self.h0 if j == 0 else self.outs[j - 1]
            out = self._run(j, src[:, have:want].to(self.dtype), self.tokens[have + j + 1: want + j + 1], have)
            self.outs[j] = torch.cat([self.outs[j], out], dim=1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.target.lm_head.weight.to(h.dtype))

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        ids = prompt_ids.reshape(-1)
        self.tokens = ids.tolist() + [int(first_token)]
        self.h0 = out.final[:, : ids.numel()]
        self.outs, self.caches = [], []

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """k draft tokens [k]; rows built from drafts are dropped from the caches afterwards."""
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        self._advance(k)
        N = len(self.tokens) - 1
        ext, drafts = list(self.tokens), []
        spec = self.outs[0][:, :0]  # step j-1's rows built from drafts (none at step 0)
        for j in range(k):
            real = max(N - j, 0)
            if j == 0:
                last = self.outs[0][:, -1:]
            else:
                src = torch.cat([self.outs[j - 1][:, real:], spec], dim=1)  # step j-1 rows real..N-1
                spec = self._run(j, src, ext[real + j + 1: N + j + 1], real)
                trim_cache(self.caches[j], real)
                last = spec[:, -1:]
            d = int(self._logits(last)[0, -1].argmax())
            drafts.append(d)
            ext.append(d)
        return torch.tensor(drafts, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput, start: int) -> None:
        if start != self.h0.shape[1]:
            raise RuntimeError(f"MTP state out of step: have {self.h0.shape[1]} target rows, asked to add at {start}")
        n = inputs.numel()
        self.h0 = torch.cat([self.h0, out.final[:, :n]], dim=1)
        self.tokens += [int(t) for t in following.reshape(-1).tolist()]


class MtpTreeProposer:
    """Static trees from an MTP head: node (r_1, .., r_d) holds the r_d-th most likely token of
    step d-1 after its path (rank 0 everywhere = the chain's drafts).

    Step j (j >= 1) runs one row per node u of depth e <= j on a path to a depth-j node with
    children: it reads E(t_u) and step j-1's row of u's parent (the root's is step j-1's last
    real row), sits at position N-1+e and attends to step j's real rows, its ancestors' rows and
    itself. The children of a depth-j node come from the target head on its step-j row.
    """

    def __init__(self, head, target, tree: Tree | list):
        self.chain = MtpProposer(head, target)
        self.layers = self.chain.layers
        self.tree = tree if isinstance(tree, Tree) else tree_from_choices(tree)
        self.max_nodes = self.tree.size
        self.node_logits: dict[int, torch.Tensor] = {}  # last proposal: node -> child logits [V]

    def start(self, prompt_ids, first_token, out) -> None:
        self.chain.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self.chain.accept(inputs, following, out, start)

    def _step_rows(self, j: int, nodes: list[int], tokens: list[int],
                   prev: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Step j rows [1, 1, H] of `nodes` (topological) from step j-1's rows of their parents."""
        c, tree = self.chain, self.tree
        hidden = torch.cat([prev[int(tree.parents[u])] for u in nodes], dim=1)  # [1, n, H]
        real, idx = c.outs[j].shape[1], torch.tensor(nodes)
        pos = (tree.depths[idx].to(hidden.device) + len(c.tokens) - 2)[None]  # [1, n]: N-1+e
        mask = tree_attention_mask(tree.mask[idx][:, idx], real, c.dtype, hidden.device)
        embeds = c.head.embed_rows(c._embed([tokens[u] for u in nodes]).to(c.dtype), pos)
        out = c.head.step(j, hidden, embeds, pos, mask, c.caches[j])  # [1, n, H]
        trim_cache(c.caches[j], real)
        return {u: out[:, i: i + 1] for i, u in enumerate(nodes)}

    def _fill_children(self, rows: dict[int, torch.Tensor], tokens: list[int], depth: int) -> None:
        """Give the children of every depth-`depth` node their ranked tokens."""
        tree, ranks = self.tree, self.tree.ranks.tolist()
        for v in [v for v in rows if int(tree.depths[v]) == depth]:
            kids = tree.children(v)
            if kids:
                self.node_logits[v] = self.chain._logits(rows[v])[0, -1]  # [V]
                top = self.node_logits[v].topk(max(ranks[w] for w in kids) + 1)
                for w in kids:
                    tokens[w] = int(top.indices[ranks[w]])

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """The tree and the tokens of nodes 1..N-1 [N-1]."""
        c, tree = self.chain, self.tree
        c._advance(tree.max_depth)
        N, depths = len(c.tokens) - 1, tree.depths.tolist()
        tokens, self.node_logits = [c.tokens[-1]] + [0] * (tree.size - 1), {}
        rows = {0: c.outs[0][:, N - 1: N]}  # step 0: the root's row
        self._fill_children(rows, tokens, 0)
        for j in range(1, tree.max_depth):
            inner = [v for v in range(tree.size) if depths[v] == j and tree.children(v)]
            lo = max(1, j + 1 - N)  # shallower rows would sit before position 0
            need = sorted({u for v in inner for u in tree.path_to(v) if depths[u] >= lo})
            prev = dict(rows)
            if N - j >= 0:
                prev[0] = c.outs[j - 1][:, N - j: N - j + 1]  # step j-1's last real row
            rows = self._step_rows(j, need, tokens, prev)
            self._fill_children(rows, tokens, j)
        return tree, torch.tensor(tokens[1:], dtype=torch.long)


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
                         use_cache=True, **_cache(self.cache))
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


def _cache(cache) -> dict:
    return cache_kwargs(cache)


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
                          use_cache=True, **_cache(chain.cache))
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
    """Chains and static trees for both kinds. Drafts are deterministic (top-k), so
    sampled decoding verifies them as point masses, which stays lossless."""
    if spec.kind == "chain":
        return MtpProposer(head, target) if head.kind == "mtp" else DraftModelProposer(head, target)
    if spec.kind == "static":
        tree_cls = MtpTreeProposer if head.kind == "mtp" else DraftModelTreeProposer
        return tree_cls(head, target, list(spec.choices))
    what = "an MTP head" if head.kind == "mtp" else "a draft model"
    raise SettingsError(f"{what} cannot grow '{spec.kind}' trees here: use --tree chain or a "
                        "static tree file (--tree FILE.json)")
