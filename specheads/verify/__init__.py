"""Speculative verification: proposers, trees, acceptance rules and the decode loop."""

from specheads.verify.decode import (
    DecodeError,
    DecodeResult,
    DecodeStats,
    accepted_prefix,
    causal_mask,
    generate,
    greedy_decode,
    trim_cache,
)
from specheads.verify.proposers import Eagle3Proposer, NgramProposer, Proposer, lookup_continuation
from specheads.verify.sample_decode import sample_generate, sample_tree_generate
from specheads.verify.tree_decode import tree_generate
from specheads.verify.trees import Tree, chain_tree, tree_from_choices, tree_from_parents

__all__ = [
    "DecodeError", "DecodeResult", "DecodeStats", "Eagle3Proposer", "NgramProposer", "Proposer",
    "Tree", "accepted_prefix", "causal_mask", "chain_tree", "generate", "greedy_decode",
    "lookup_continuation", "sample_generate", "sample_tree_generate", "tree_from_choices",
    "tree_from_parents", "tree_generate", "trim_cache",
]
