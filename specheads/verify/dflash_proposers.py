"""DFlash block proposers: one draft forward drafts the whole chain (`protocols.Proposer`), or a
static tree (`protocols.TreeProposer`).

The draft keeps one KV cache per layer holding only context rows: the keys/values projected
from the target states of every verified position. A proposal appends the block [last verified
token (the anchor), mask x k] at the positions after them, reads slots 1..k, and drops the block
again, so every proposal is exactly the training computation for that anchor.

The slots never see each other's tokens, so, as with Medusa heads, a tree node's token depends on
its depth and rank alone: node (r_1, .., r_d) holds the r_d-th most likely token of slot d. The
tree is deterministic given the verified context: greedy verification and the point-mass sampling
rule keep the target's output (distribution) exactly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specheads.target import TargetError, TargetOutput
from specheads.verify.rank_trees import Ranker, RankTreeProposer
from specheads.verify.sampling import Warper, sample_draft_rows
from specheads.verify.steps import positions, trim_cache
from specheads.verify.trees import SettingsError, Tree


def check_dflash_fits(head, target) -> None:
    """Refuse a head whose vocabulary / width / taps do not match the target it runs with."""
    cfg, problems = head.config, []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} vs the target's {target.vocab_size}")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} vs the target's {target.hidden_size}")
    bad = [t for t in cfg.target_layer_ids if not 0 <= t <= target.num_layers - 2]
    if bad:
        problems.append(f"target_layer_ids {bad} outside 0..{target.num_layers - 2}")
    if problems:
        raise TargetError("the DFlash head does not fit this target: " + "; ".join(problems))


class DFlashProposer:
    """Greedy block drafts: k = min(asked, block_size - 1) tokens from one draft forward."""

    def __init__(self, head, target):
        check_dflash_fits(head, target)
        self.head, self.target = head.eval(), target
        self.layers = head.required_layers()
        self.cache: DynamicCache | None = None
        self.rows = 0  # context rows cached = position of the anchor
        self.anchor = 0  # the last verified token

    @property
    def dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def _add_context(self, out: TargetOutput, n: int, start: int) -> None:
        if start != self.rows:
            raise RuntimeError(f"DFlash context out of step: have {self.rows} rows, asked to add at {start}")
        aux = torch.cat([out.hidden[i][:, :n] for i in self.layers], dim=-1)  # [1, n, K*H]
        self.head.add_context(self.cache, self.head.context(aux), positions(start, n, aux.device))
        self.rows += n

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        self.cache, self.rows = DynamicCache(), 0
        self._add_context(out, prompt_ids.numel(), 0)
        self.anchor = int(first_token)

    def block_logits(self, k: int) -> torch.Tensor:
        """Draft logits [k, Vd] of slots 1..k of the block at the anchor; the block is dropped."""
        return self.head.logits(self.block_states(k), self.target.lm_head.weight)

    def block_states(self, k: int, first: int = 1) -> torch.Tensor:
        """Final-normed states [k, H] of slots first..first+k-1 of the block at the anchor (first = 1:
        the fill-in layout [anchor, mask x k]; 0: anchor-as-first, [anchor, mask x (k-1)]); the block
        is dropped."""
        cfg, device = self.head.config, self.target.device
        n = k + first  # query slots
        ids = torch.tensor([[self.anchor] + [cfg.mask_token_id] * (n - 1)], device=device)
        embeds = self.target.embed(ids)  # [1, n, H]
        mask = torch.zeros(n, self.rows + n, dtype=self.dtype, device=device)
        if cfg.causal:
            mask[:, self.rows:] = torch.full((n, n), torch.finfo(self.dtype).min, dtype=self.dtype, device=device).triu(1)
        out = self.head.block_forward(embeds, positions(self.rows, n, device), mask[None, None], self.cache)
        trim_cache(self.cache, self.rows)
        return out[0, first:]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens [<= block_size - 1] (target ids) from one forward."""
        k = min(k, self.head.config.block_size - 1)
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        return self.head.to_target_ids(self.block_logits(k).argmax(-1)).cpu()

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput, start: int) -> None:
        self._add_context(out, inputs.numel(), start)
        self.anchor = int(following.reshape(-1)[-1])


class SampledDFlashProposer(DFlashProposer):
    """Block drafts sampled slot by slot from q_s = warp(slot s logits). The slots do not see
    each other's samples, so each q_s depends on the verified context only: Leviathan's rule
    stays lossless with these q."""

    @torch.no_grad()
    def propose_sampled(self, k: int, warper: Warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        k = min(k, self.head.config.block_size - 1)
        V = self.target.vocab_size
        if k < 1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return sample_draft_rows(self.block_logits(k), self.head, V, warper, gen)  # logits [k, Vd]


class DFlashStaticTreeProposer(RankTreeProposer):
    """A fixed tree from one block forward: node (r_1, .., r_d) holds rank r_d of slot d (rank 0 =
    argmax). Drafts are top-k, never sampled: sampled decoding verifies them as point masses."""

    def __init__(self, head, target, tree: Tree | list):
        slots = head.config.block_size - 1
        super().__init__(DFlashProposer(head, target), tree, slots,
                         f"a block of {head.config.block_size} drafts {slots} tokens")

    def rankings(self) -> Ranker:
        logits = self.chain.block_logits(self.tree.max_depth)  # [D, Vd], one block forward
        return lambda d, n: self.chain.head.to_target_ids(logits[d - 1].topk(n).indices)


def make_proposer(spec, head, target, sampled: bool = False):
    """A chain (sampled from q when `sampled`) or a static tree (top-k drafts, verified as point
    masses when sampling). EAGLE-2 trees are refused: they grow a node's children from its own
    draft state, and a DFlash slot's distribution does not depend on the tokens before it."""
    if spec.kind == "chain":
        return SampledDFlashProposer(head, target) if sampled else DFlashProposer(head, target)
    if spec.kind == "static":
        return DFlashStaticTreeProposer(head, target, list(spec.choices))
    raise SettingsError(f"a DFlash head drafts one block per forward, every slot independent of the tokens "
                        f"before it: '{spec.kind}' trees are not supported; use --tree chain or a static tree "
                        f"file (--tree FILE.json, node (r_1, .., r_d) = rank r_d of slot d)")
