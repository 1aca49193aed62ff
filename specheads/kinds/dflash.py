"""DFlash block drafters: examples and engine-check side (blocks at anchors spread over the prompt)."""

from __future__ import annotations

import torch

from specheads.engine_facts import DFLASH_SPECULATORS_OFFSET
from specheads.heads.dflash import DFlashHead, DFlashOptions
from specheads.kinds.base import EngineSide, Example, Kind, random_head, tapped_states
from specheads.verify.dflash_proposers import DFlashProposer


def example_head(target, seed: int):
    return random_head(DFlashHead, DFlashOptions(num_layers=1, block_size=4), target, seed, 0.05)


def as_trained(head, ours):
    """The head rebuilt with the config it was trained with (specheads.json `head_config`) and the
    export's weights: the mask token, causality and taps we compare with are the trained ones, not
    whatever config.json says (the engine reads config.json)."""
    trained = ours.meta.head_config
    if not trained:
        return head
    cls = type(head)  # DFlashHead, or a kind built on it (DSpark)
    rebuilt = cls(cls.Config(**trained), attn_implementation="eager")
    rebuilt.load_state_dict(head.state_dict())
    return rebuilt.eval()


def features(ours, ids):
    return tapped_states(ours, ids, ours.head.required_layers())


@torch.no_grad()
def first_pass(ours, ids, next_token, out, anchors, k):
    """Slots 1..k of the block at each anchor [len(anchors) * k, V], from our proposer."""
    return blocks_at(DFlashProposer(ours.head, ours.target), ours, ids, next_token, out, anchors, k)


def blocks_at(proposer, ours, ids, next_token, out, anchors, k) -> torch.Tensor:
    """`proposer.block_logits(k)` of the block at each anchor (context x_<a, anchor x_a, or
    next_token after the prompt), full vocabulary [len(anchors) * k, V]."""
    T, rows = ids.shape[1], []
    for a in anchors:
        proposer.start(ids[0, :a], next_token if a == T else int(ids[0, a]), out)
        rows.append(ours.full_vocab(proposer.block_logits(k).float()))
    return torch.cat(rows)


def expect(ours, engine: str) -> dict:
    """The mask token; vLLM's aux ids count HF hidden states (DFlash id + offset)."""
    return backbone_expect(ours.meta.head_config or {}, engine)


def backbone_expect(hc: dict, engine: str) -> dict:
    """What the engine derives from a DFlash backbone's trained config `hc` (DSpark's `dflash`)."""
    want = {"mask_token_id": hc.get("mask_token_id")}
    if engine == "vllm":
        want["aux_layer_ids"] = [t + DFLASH_SPECULATORS_OFFSET for t in hc.get("target_layer_ids") or []] or None
    return want


KIND = Kind(
    "dflash",
    examples=(Example("dflash", example_head, 8, ("vllm", "vllm-native", "sglang"), "block size 4, 8 anchors"),),
    engine_side=EngineSide(features, first_pass, expect, anchors=True),
    prepare=as_trained,
)
