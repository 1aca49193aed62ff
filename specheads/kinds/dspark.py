"""DSpark block drafters: examples and engine-check side (DFlash's blocks at anchors spread over the
prompt, each block's slots biased by the Markov head from the greedy token before them)."""

from __future__ import annotations

from specheads.heads.dspark import DSparkHead, DSparkOptions
from specheads.kinds import dflash
from specheads.kinds.base import EngineSide, Example, Kind, random_head
from specheads.verify.dspark_proposers import DSparkProposer

FORMATS = ("vllm", "vllm-native", "sglang")


def example_head(target, seed: int, sample_from_anchor: bool = False):
    """Block of 3, rank 8, confidence head reading the Markov embedding (llama.cpp builds no other);
    perturbed so the Markov bias (markov_w2 starts at zero) and every norm matter."""
    options = DSparkOptions(num_layers=1, block_size=3, markov_rank=8, enable_confidence_head=True,
                            confidence_head_with_markov=True, sample_from_anchor=sample_from_anchor)
    return random_head(DSparkHead, options, target, seed, 0.05)


def gated_head(target, seed: int):
    """A gated Markov head: SGLang only (vLLM builds the vanilla head alone)."""
    options = DSparkOptions(num_layers=1, block_size=3, markov_rank=8, markov_head_type="gated")
    return random_head(DSparkHead, options, target, seed, 0.05)


def anchor_first_head(target, seed: int):
    """The example in the anchor-as-first layout (sample_from_anchor: true, the engines' own default)."""
    return example_head(target, seed, sample_from_anchor=True)


def first_pass(ours, ids, next_token, out, anchors, k):
    """The k drafted slots of the block at each anchor with the Markov bias of the greedy token before
    each [len(anchors) * k, V], from our proposer."""
    return dflash.blocks_at(DSparkProposer(ours.head, ours.target), ours, ids, next_token, out, anchors, k)


def expect(ours, engine: str) -> dict:
    """DFlash's mask token and aux ids (the backbone's), the block size G and the Markov fields."""
    hc = ours.meta.head_config or {}
    d = hc.get("dflash") or {}
    from_anchor = bool(hc.get("sample_from_anchor", False))
    want = {**dflash.backbone_expect(d, engine), "markov_rank": hc.get("markov_rank"), "sample_from_anchor": from_anchor,
            "block_size": d["block_size"] - (0 if from_anchor else 1) if d.get("block_size") else None,
            # vLLM copies markov_head_type and never reads it (vanilla only, refused at export)
            "markov_head_type": hc.get("markov_head_type") if engine == "sglang" else None}
    if hc.get("enable_confidence_head"):
        want["confidence_head"] = True
    return want


KIND = Kind(
    "dspark",
    examples=(Example("dspark", example_head, 9, FORMATS, "block 3, vanilla Markov rank 8, confidence head"),
              Example("dspark-gated", gated_head, 10, ("sglang",), "gated Markov head (SGLang only)"),
              Example("dspark-anchor", anchor_first_head, 11, FORMATS,
                      "block 3, anchor-as-first (sample_from_anchor: true), confidence head")),
    engine_side=EngineSide(dflash.features, first_pass, expect, anchors=True),
    prepare=dflash.as_trained,
)
