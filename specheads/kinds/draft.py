"""Draft models (a small HF causal LM): examples and engine-check side."""

from __future__ import annotations

import torch

from specheads.heads.draft import DraftHead, DraftOptions
from specheads.kinds.base import EngineSide, Example, Kind, random_head
from specheads.verify.steps import causal_mask, positions


def example_head(target, seed: int):
    return random_head(DraftHead, DraftOptions(num_layers=2, ttt_steps=3), target, seed, 0.02, init_from_target=True)


def no_states(ours, ids):
    """A draft model reads no target states: the engine taps none."""
    return None, None


def first_pass(ours, ids, next_token, out, anchors, k):
    """The draft model over the prompt: logits [T, V]."""
    T = ids.shape[1]
    return ours.head.model(input_ids=ids, attention_mask=causal_mask(0, T, torch.float32, ids.device),
                           position_ids=positions(0, T, ids.device)).logits[0].float()


KIND = Kind(
    "draft",
    examples=(Example("draft", example_head, 4, ("vllm", "sglang")),),
    engine_side=EngineSide(no_states, first_pass),
)
