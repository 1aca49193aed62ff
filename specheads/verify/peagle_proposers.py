"""P-EAGLE proposers: the k chain drafts of a `parallel_drafting` EAGLE-3 head from one forward.

They draft on the EAGLE-3 chain state (`eagle3_proposers.Eagle3Proposer`, held as `chain`, which
keeps start / accept): draft 1 from the last real row (as EAGLE-3), drafts 2..k from k-1 mask
rows (fc(mask_hidden), the mask token, positions after the real rows) run together over the
real rows' cache. Verified as a chain (vLLM does the same); the mask rows are dropped after each
proposal.
"""

from __future__ import annotations

import torch

from specheads.verify.sampling import Warper, sample_draft_rows
from specheads.verify.steps import causal_mask, positions, trim_cache


class PEagleProposer:
    """Greedy parallel drafts from the EAGLE-3 chain state `chain` of a P-EAGLE head."""

    def __init__(self, chain):
        self.chain = chain
        self.head, self.target = chain.head, chain.target
        self.layers = chain.layers

    def start(self, prompt_ids, first_token, out) -> None:
        self.chain.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self.chain.accept(inputs, following, out, start)

    def _draft_logits(self, k: int) -> torch.Tensor:
        """Draft-vocab logits [k, Vd]: the last real row, then k-1 mask rows in one forward."""
        c, head = self.chain, self.head
        first = head.logits(c.last_out)[0]  # [1, Vd]
        if k == 1:
            return first
        n = k - 1
        hidden = head.fuse(head.mask_hidden[None, None]).expand(1, n, -1)  # [1, n, H]
        ids = torch.full((1, n), head.config.mask_token_id, device=self.target.device)
        mask = causal_mask(c.rows, n, c.dtype, hidden.device)
        out = head.step(hidden, self.target.embed(ids), positions(c.rows, n, hidden.device), mask, c.cache)
        trim_cache(c.cache, c.rows)
        return torch.cat([first, head.logits(out)[0]])  # [k, Vd]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens [k] (target ids)."""
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        return self.head.to_target_ids(self._draft_logits(k).argmax(-1)).cpu()


class SampledPEagleProposer(PEagleProposer):
    """Draft d sampled from q_d = warp(depth-d logits). No depth sees another's sample, so each
    q_d depends on the verified context only and Leviathan's rule stays lossless."""

    @torch.no_grad()
    def propose_sampled(self, k: int, warper: Warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        V = self.target.vocab_size
        if k < 1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return sample_draft_rows(self._draft_logits(k), self.head, V, warper, gen)  # logits [k, Vd]
