"""EAGLE-3 proposers for a draft shape: a chain (drafts sampled from q when sampling) or an EAGLE-2
dynamic / static tree (trees are deterministic top-k either way)."""

from __future__ import annotations

from specheads.verify.peagle_proposers import PEagleProposer, SampledPEagleProposer
from specheads.verify.proposers import Eagle3Proposer
from specheads.verify.sample_decode import SampledEagle3Proposer
from specheads.verify.tree_proposers import Eagle3DynamicTreeProposer, Eagle3StaticTreeProposer
from specheads.verify.trees import SettingsError


def make_proposer(spec, head, target, sampled: bool = False):
    """The EAGLE-3 proposer for a `TreeSpec` (P-EAGLE heads: one forward per chain, chains only)."""
    if head.config.parallel_drafting:
        if spec.kind != "chain":
            raise SettingsError("a P-EAGLE head drafts all depths in one forward and was not trained for "
                                f"tree steps; '{spec.kind}' trees are not supported: use --tree chain")
        return SampledPEagleProposer(head, target) if sampled else PEagleProposer(head, target)
    if spec.kind == "chain" and sampled:
        return SampledEagle3Proposer(head, target)
    if spec.kind == "chain":
        return Eagle3Proposer(head, target)
    if spec.kind == "eagle2":
        return Eagle3DynamicTreeProposer(head, target, spec.depth, spec.top_k, spec.total_tokens)
    return Eagle3StaticTreeProposer(head, target, list(spec.choices))
