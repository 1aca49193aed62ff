"""EAGLE-1 (kind "eagle"): examples and engine-check side."""

from __future__ import annotations

from specheads.heads.eagle import EagleHead, EagleOptions
from specheads.kinds.base import EngineSide, Example, Kind, final_states, random_head, step_logits
from specheads.verify.eagle1_proposers import bind_to_target


def example_head(target, seed: int):
    return random_head(EagleHead, EagleOptions(ttt_steps=3), target, seed, 0.05)


def first_pass(ours, ids, next_token, out, anchors, k):
    return step_logits(ours, ids, next_token, out.final)


def prepare(head, ours):
    """The head reads the target's lm_head: attach it (and refuse a target it does not fit)."""
    bind_to_target(head, ours.target)
    return head


KIND = Kind(
    "eagle",
    examples=(Example("eagle", example_head, 3, ("vllm", "sglang")),),
    engine_side=EngineSide(final_states, first_pass),
    prepare=prepare,
)
