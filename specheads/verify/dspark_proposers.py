"""DSpark proposers: DFlash's block forward (verify/dflash_proposers.py), then the Markov head left to
right over the drafted slots, as vLLM 0.33 (`dspark/speculator.py` `_sample_sequential`) and SGLang
0.5.23 (`dspark_draft.py`) run it: logits_i = lm_head(h_i) + bias(prev_i), prev_1 = the anchor (the
last verified token), prev_{i+1} = the token drafted at slot i (target ids).

A slot's distribution now depends on the drafts before it, so a draft is an autoregressive chain:
greedy drafts take each argmax, sampled drafts sample slot by slot and hand the verifier each q_i
on the path drawn (Leviathan's rule stays lossless). Static trees (rank r of slot d regardless of
the path) do not describe such a draft and are refused.

The confidence head's per-slot outputs, P(slot i accepted | slots before it accepted), of the last
block drafted are `confidence()`; the engines multiply them into a survival for adaptive
verification (docs/dspark_format.md §2). Ours reads them per slot as it is drafted: a `ConfidenceWarper`
(eval's calibration probe, the adaptive draft length's stopping rule) records the head's estimate in
place of the draft's top probability, so the adaptive rule cuts a block where the head expects it to
fail and eval reports the head's calibration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specheads.verify.dflash_proposers import DFlashProposer
from specheads.verify.sampling import sample_draft_rows
from specheads.verify.trees import SettingsError


class DSparkProposer(DFlashProposer):
    """Greedy drafts: k = min(asked, G) tokens from one backbone forward and k Markov steps."""

    def __init__(self, head, target):
        super().__init__(head.dflash, target)  # the backbone's context cache and block forward
        self.dspark = head.eval()
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (states [n, H], prev [n]) of the last block

    def max_drafts(self, k: int) -> int:
        return min(k, self.dspark.config.block_size)

    def draft_block(self, k: int, pick: Callable[[torch.Tensor], torch.Tensor],
                    confide: Callable[[float], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafts [k] (target ids) and their logits [k, Vd] (base + Markov bias); `pick(logits [Vd])`
        chooses slot i's target id, which is slot i+1's previous token. `confide(p)`, with a confidence
        head, hears slot i's P(accepted | earlier accepted) before slot i is picked."""
        states = self.block_states(k, self.dspark.config.first_slot)  # [k, H]
        base = self.head.logits(states, self.target.lm_head.weight)  # [k, Vd]
        markov = self.dspark.markov_head
        prev = torch.full((k,), self.anchor, dtype=torch.long, device=states.device)
        confide = confide if self.dspark.confidence_head is not None else None
        rows, tokens = [], []
        for i in range(k):
            # the head's own latent over slots 1..i+1 (the rnn state runs from slot 1), last slot's bias
            latent = markov.latent(states[None, None, : i + 1], prev[None, None, : i + 1])[0, 0, -1]
            rows.append(base[i] + markov.bias(latent).to(base.dtype))
            if confide is not None:
                confide(float(self.dspark.confidence(states[i], prev[i])))
            tokens.append(pick(rows[-1]).reshape(()).to(prev.device))
            if i + 1 < k:
                prev[i + 1] = tokens[-1]
        self.last = (states, prev)
        return torch.stack(tokens), torch.stack(rows)

    @torch.no_grad()
    def block_logits(self, k: int) -> torch.Tensor:
        """The greedy block's logits [k, Vd] (each slot biased by the argmax before it)."""
        return self.draft_block(k, self._argmax)[1]

    def _argmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(row.argmax(-1))

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Up to k greedy draft tokens [<= G] (target ids)."""
        k = self.max_drafts(k)
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        return self.draft_block(k, self._argmax)[0].cpu()

    @torch.no_grad()
    def confidence(self) -> torch.Tensor | None:
        """P(slot i accepted | slots 1..i-1 accepted) [n] of the last block drafted, as the engines
        compute it (sigmoid of the confidence head on cat[h_i, markov_w1[prev_i]]); None without a
        confidence head or before the first draft."""
        if self.dspark.confidence_head is None or self.last is None:
            return None
        states, prev = self.last
        return self.dspark.confidence(states, prev)


class SampledDSparkProposer(DSparkProposer):
    """Drafts sampled slot by slot from q_i = warp(logits_i), each slot's bias from the token sampled
    before it; the q_i returned are those of the path drawn."""

    @torch.no_grad()
    def propose_sampled(self, k: int, warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        k, V = self.max_drafts(k), self.target.vocab_size
        if k < 1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        qs = []

        def draw(row: torch.Tensor) -> torch.Tensor:
            token, q = sample_draft_rows(row[None], self.head, V, warper, gen)  # [1], [1, V]
            qs.append(q[0])
            return token[0]

        tokens = self.draft_block(k, draw, getattr(warper, "report", None))[0]  # a ConfidenceWarper hears the head
        return tokens.cpu(), torch.stack(qs)


def make_proposer(spec, head, target, sampled: bool = False):
    """A chain (sampled from q when `sampled`); trees are refused."""
    if spec.kind == "chain":
        return SampledDSparkProposer(head, target) if sampled else DSparkProposer(head, target)
    raise SettingsError(f"a DSpark head drafts each slot from the token before it (its Markov head), so a block "
                        f"is one chain: '{spec.kind}' trees are not supported; use --tree chain")
