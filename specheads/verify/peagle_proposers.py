"""P-EAGLE proposers: the EAGLE-3 chain state (verify/proposers.py), but the k drafts come from
one forward: draft 1 from the last real row (as EAGLE-3), drafts 2..k from k-1 mask rows
(fc(mask_hidden), the mask token, positions after it) run together over the real rows' cache.
Verified as a chain (vLLM does the same); the mask rows are dropped after each proposal.
"""

from __future__ import annotations

import torch

from specheads.verify.decode import causal_mask, positions, trim_cache
from specheads.verify.proposers import Eagle3Proposer
from specheads.verify.sampling import sample_draft_rows


class PEagleProposer(Eagle3Proposer):
    """Greedy parallel drafts from a `parallel_drafting` EAGLE-3 head."""

    def _draft_logits(self, k: int) -> torch.Tensor:
        """Draft-vocab logits [k, Vd]: the last real row, then k-1 mask rows in one forward."""
        head = self.head
        first = head.logits(self.last_out)[0]  # [1, Vd]
        if k == 1:
            return first
        n = k - 1
        hidden = head.fuse(head.mask_hidden[None, None]).expand(1, n, -1)  # [1, n, H]
        ids = torch.full((1, n), head.config.mask_token_id, device=self.target.device)
        mask = causal_mask(self.rows, n, self.dtype, hidden.device)
        out = head.step(hidden, self.target.embed(ids), positions(self.rows, n, hidden.device), mask, self.cache)
        trim_cache(self.cache, self.rows)
        return torch.cat([first, head.logits(out)[0]])

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        return self.head.to_target_ids(self._draft_logits(k).argmax(-1)).cpu()


class SampledPEagleProposer(PEagleProposer):
    """Draft d sampled from q_d = warp(depth-d logits). No depth sees another's sample, so each
    q_d depends on the verified context only and Leviathan's rule stays lossless."""

    @torch.no_grad()
    def propose_sampled(self, k: int, warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.target.vocab_size
        if k < 1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return sample_draft_rows(self._draft_logits(k), self.head, V, warper, gen)  # logits [k, Vd]
