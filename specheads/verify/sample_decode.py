"""Speculative sampling entry points (chain and tree), batch size 1, seeded: `verify.loop` with
a sampling rule from `verify.rules`.

Every token is drawn from the target's warped distribution (`sampling.warp`): the first one from
the prefill, later ones through an acceptance rule:

* chain (`sample_generate`): Leviathan / Chen speculative sampling (docs/algorithms.md
  §8.2). A proposer with `propose_sampled(k, warper, gen) -> (tokens [n], q [n, V])` samples its
  drafts from its own warped q (`SampledEagle3Proposer`); any other chain proposer (n-gram, a
  greedy EAGLE-3 proposer) proposes deterministically and is treated as a point mass q.
  `rule="typical"` verifies deterministic top-1 drafts with Medusa typical acceptance instead
  (LOSSY, flagged like the tree rule below).
* tree (`sample_tree_generate`): the EAGLE-2/3 point-mass rule over the deterministic top-k
  trees of the existing tree proposers (§8.3), or Medusa typical acceptance (§8.4), which is
  LOSSY and flagged `lossy=True` on the result.

Both lossless rules leave the output distributed exactly as sampling the target token by token;
at temperature 0 they reduce to greedy verification, so the output equals greedy decoding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specheads.verify.decode import as_batch
from specheads.verify.loop import ChainShape, TreeShape, decode
from specheads.verify.proposers import Eagle3Proposer
from specheads.verify.rules import Warper, draft_chain, sampled_rule
from specheads.verify.sampling import expand_draft_logits, sample
from specheads.verify.steps import SampleResult, positions, trim_cache

__all__ = ["CHAIN_RULES", "TREE_RULES", "SampleResult", "SampledEagle3Proposer", "draft_chain",
           "sample_generate", "sample_tree_generate"]

TREE_RULES = ("pointmass", "typical")
CHAIN_RULES = ("leviathan", "typical")


class SampledEagle3Proposer(Eagle3Proposer):
    """EAGLE-3 chain proposer that samples d_j ~ q_j = warp(draft logits) and returns q.

    Same verified state as `Eagle3Proposer` (start / accept unchanged); q is expressed over the
    target vocabulary, 0 outside the draft vocabulary, warped exactly like the target.
    """

    @torch.no_grad()
    def propose_sampled(self, k: int, warper: Warper,
                        gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        head, out = self.head, self.last_out
        V = self.target.vocab_size
        ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=out.device))
        tokens, qs = [], []
        for j in range(k):
            if j > 0:
                emb = self.target.embed(tokens[-1].reshape(1, 1))
                out = head.step(out, emb, positions(self.rows - 1 + j, 1, out.device), None,
                                self.cache)
            q = warper(expand_draft_logits(head.logits(out)[0, -1], ids, V))  # [V]
            tokens.append(sample(q.to(gen.device), gen).to(out.device))
            qs.append(q)
        trim_cache(self.cache, self.rows)
        if not tokens:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return torch.stack(tokens), torch.stack(qs)


def sample_generate(target, proposer, prompt_ids, max_new_tokens: int, k: int,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    eos_token_ids: Iterable[int] = (), rule: str = "leviathan",
                    epsilon: float = 0.09, delta: float = 0.3) -> SampleResult:
    """Speculative sampling with a chain of <= k drafts per target forward.

    rule "leviathan" (default): lossless speculative sampling. rule "typical": Medusa typical
    acceptance of the proposer's deterministic drafts with thresholds min(epsilon, delta *
    exp(-H)), LOSSY (result.lossy is True). `proposer` None (or k == 0) gives plain ancestral
    sampling from the warped target. The same seed reproduces the same tokens; temperature 0
    equals greedy decoding token for token.
    """
    shape = ChainShape(k)
    accept = sampled_rule(rule, target.device, temperature, top_p, top_k, seed, epsilon, delta,
                          allowed=CHAIN_RULES, shape="chain")
    return decode(target, proposer, as_batch(prompt_ids), max_new_tokens, accept, shape,
                  eos_token_ids)[0]


def sample_tree_generate(target, proposer, prompt_ids, max_new_tokens: int,
                         temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, eos_token_ids: Iterable[int] = (),
                         rule: str = "pointmass", epsilon: float = 0.09,
                         delta: float = 0.3) -> SampleResult:
    """Tree speculative sampling: one target forward per draft tree.

    rule "pointmass" (default): EAGLE-2/3 acceptance for deterministic top-k trees, lossless.
    rule "typical": Medusa typical acceptance with thresholds min(epsilon, delta * exp(-H)),
    LOSSY (result.lossy is True). `proposer` None gives plain ancestral sampling through the
    tree path. Temperature 0 equals greedy decoding token for token under either rule.
    """
    accept = sampled_rule(rule, target.device, temperature, top_p, top_k, seed, epsilon, delta,
                          allowed=TREE_RULES, shape="tree")
    return decode(target, proposer, as_batch(prompt_ids), max_new_tokens, accept, TreeShape(),
                  eos_token_ids)[0]
