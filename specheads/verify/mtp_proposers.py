"""MTP proposers (DeepSeek-V3 style multi-token prediction heads): chains and static trees.

Step j keeps its own KV cache of "real" rows, those whose inputs are all verified (row i at
step j reads E(x_{i+j+1}) and step j-1's row i, so step j holds rows 0..N-1-j when x_N is the
last verified token). A proposal runs, at each step j, the rows that involve draft tokens and
then drops them, so every draft equals the teacher-forced training computation. A static tree
runs the same rows per tree node, with a tree mask (`MtpTreeProposer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads.target import TargetOutput
from specheads.verify.settings import chain_or_static
from specheads.verify.steps import causal_mask, check_vocab_fits, positions, tree_attention_mask, trim_cache
from specheads.verify.trees import Tree, tree_from_choices


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


def make_proposer(spec, head, target, sampled: bool = False):
    """A chain or a static tree. Drafts are deterministic (top-k), so sampled decoding verifies
    them as point masses, which stays lossless."""
    return chain_or_static(spec, MtpProposer, MtpTreeProposer, head, target, "an MTP head")
