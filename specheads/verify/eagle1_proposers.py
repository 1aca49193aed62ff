"""EAGLE-1 proposers: the EAGLE-3 chain and tree proposers, fed the target's final-normed state.

The draft's verified state is built exactly as for EAGLE-3 (`eagle3_proposers.Eagle3Proposer`):
row i of the draft cache (position i) reads f_i and the embedding of token i+1, and its output
predicts token i+2. Only the feature differs: f_i is the target's lm_head input (TargetOutput.final)
instead of fused aux layers. Drafting a chain or tree is then the same code, because an EAGLE-1
head offers the same `step` / `logits` / `to_target_ids` building blocks.
"""

from __future__ import annotations

import torch

from specheads.target import TargetOutput
from specheads.verify.eagle3_proposers import (
    Eagle3DynamicTreeProposer,
    Eagle3Proposer,
    Eagle3StaticTreeProposer,
    SampledEagle3Proposer,
)
from specheads.verify.steps import check_vocab_fits


def bind_to_target(head, target) -> None:
    """Refuse a head that does not fit the target; attach the target's lm_head for `logits`."""
    check_vocab_fits("EAGLE-1", head.config.vocab_size, head.config.hidden_size, target)
    head.bind_lm_head(target.lm_head)


class _FinalFeatureRows:
    """Mixin: real draft rows read the target's final-normed state instead of fused aux layers."""

    def _taps(self, out: TargetOutput, n: int) -> torch.Tensor:
        if out.final is None:
            raise RuntimeError("the target output carries no final-normed state (TargetOutput.final)")
        return out.final[:, :n]  # [1, n, H]

    def _features(self, taps: torch.Tensor) -> torch.Tensor:
        return taps.to(self.dtype)


class Eagle1Proposer(_FinalFeatureRows, Eagle3Proposer):
    """Greedy chain drafts from an EAGLE-1 head."""

    def __init__(self, head, target):
        bind_to_target(head, target)
        super().__init__(head, target)


class SampledEagle1Proposer(_FinalFeatureRows, SampledEagle3Proposer):
    """Chain drafts sampled from q = warp(draft logits) (lossless speculative sampling)."""

    def __init__(self, head, target):
        bind_to_target(head, target)
        super().__init__(head, target)


class Eagle1StaticTreeProposer(Eagle3StaticTreeProposer):
    """A static tree of EAGLE-1 drafts (a node holds a rank of its parent's draft top-k)."""

    def __init__(self, head, target, tree):
        bind_to_target(head, target)
        super().__init__(head, target, tree)
        self.chain = Eagle1Proposer(head, target)


class Eagle1DynamicTreeProposer(Eagle3DynamicTreeProposer):
    """EAGLE-2 dynamic trees over an EAGLE-1 head (the original EAGLE-2 setting)."""

    def __init__(self, head, target, depth: int = 5, top_k: int = 8, total_tokens: int = 48):
        bind_to_target(head, target)
        super().__init__(head, target, depth, top_k, total_tokens)
        self.chain = Eagle1Proposer(head, target)


def make_proposer(spec, head, target, sampled: bool = False):
    """EAGLE-1 proposer for a `TreeSpec`: chain (sampled or greedy), EAGLE-2 or static tree."""
    if spec.kind == "chain":
        return SampledEagle1Proposer(head, target) if sampled else Eagle1Proposer(head, target)
    if spec.kind == "eagle2":
        return Eagle1DynamicTreeProposer(head, target, spec.depth, spec.top_k, spec.total_tokens)
    return Eagle1StaticTreeProposer(head, target, list(spec.choices))
