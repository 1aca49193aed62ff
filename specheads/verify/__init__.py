"""Our speculative decoder: proposers, trees, acceptance rules and the decode loop.

Doors: `loop.decode` (any proposer, any rule) with `loop.greedy_decode` as the plain reference,
`loop.decode_batch` of `loop.request`s (several sequences per target forward), and the session
(`specheads.session`). Proposers come from `registry.make_proposer`.
"""

from specheads.verify.loop import Request, decode, decode_batch, greedy_decode, request
from specheads.verify.ngram_proposers import NO_DRAFT, NgramProposer, lookup_continuation
from specheads.verify.rules import accepted_prefix
from specheads.verify.steps import DecodeError, DecodeResult, DecodeStats, SampleResult, causal_mask, trim_cache
from specheads.verify.trees import Tree, chain_tree, tree_from_choices, tree_from_parents

__all__ = [
    "NO_DRAFT", "DecodeError", "DecodeResult", "DecodeStats", "NgramProposer", "Request", "SampleResult", "Tree",
    "accepted_prefix", "causal_mask", "chain_tree", "decode", "decode_batch", "greedy_decode",
    "lookup_continuation", "request",
    "tree_from_choices", "tree_from_parents", "trim_cache",
]
