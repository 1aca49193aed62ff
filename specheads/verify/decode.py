"""Plain greedy decoding and greedy chain speculation: thin entry points over `verify.loop`.

Greedy chain verification (docs/algorithms.md §8.1) is lossless, so the speculative output equals
plain greedy decoding token for token; any difference is a bug (or, in low precision, an argmax
tie flipped by batched-vs-sequential numerics). The building blocks (results, masks, cache
trimming, timing) live in `verify.steps` and are re-exported here for the modules that use them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specheads.verify.loop import ChainShape, decode
from specheads.verify.rules import GreedyRule, accepted_prefix
from specheads.verify.steps import (
    Clock,
    DecodeError,
    DecodeResult,
    DecodeStats,
    causal_mask,
    context_length,
    cut_at_eos,
    new_cache,
    positions,
    prefill,
    prepare_prompt,
    target_step,
    trim_cache,
)

__all__ = [
    "Clock", "DecodeError", "DecodeResult", "DecodeStats", "accepted_prefix", "causal_mask",
    "context_length", "cut_at_eos", "generate", "greedy_decode", "new_cache", "positions",
    "prefill", "prepare_prompt", "target_step", "trim_cache",
]


def as_batch(prompt_ids) -> torch.Tensor:
    """A prompt (ids [P], any nesting) -> the loop's batch of one [1, P]."""
    return torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)


def greedy_decode(target, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per new token (the reference)."""
    return generate(target, None, prompt_ids, max_new_tokens, k=0, eos_token_ids=eos_token_ids)


def generate(target, proposer, prompt_ids, max_new_tokens: int, k: int,
             eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Speculative greedy decoding: propose <= k tokens, verify [last, d_1..d_k] in one forward.

    `proposer` None (or k == 0) gives plain greedy decoding. The output equals plain greedy
    decoding token for token; never more than max_new_tokens tokens; stops after an eos id.
    """
    shape = ChainShape(k)
    return decode(target, proposer, as_batch(prompt_ids), max_new_tokens, GreedyRule(), shape,
                  eos_token_ids)[0]
