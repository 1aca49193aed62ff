"""Speculative verification: proposers, greedy chain acceptance and the decode loops."""

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

__all__ = [
    "DecodeError", "DecodeResult", "DecodeStats", "Eagle3Proposer", "NgramProposer", "Proposer",
    "accepted_prefix", "causal_mask", "generate", "greedy_decode", "lookup_continuation",
    "trim_cache",
]
