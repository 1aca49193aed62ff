"""MTP modules inside the target checkpoint: examples on tiny released-family targets; the engines
load the weights (no draft forward is compared: the export is the target)."""

from __future__ import annotations

import json

from specheads.heads.mtp import MtpHead, MtpOptions
from specheads.kinds.base import Example, Kind, random_head

FAMILIES = ("deepseek_v3", "qwen3_next", "qwen3_5")


def example_head(target, seed: int):
    return random_head(MtpHead, MtpOptions(num_layers=1, ttt_steps=1), target, seed, 0.02, init_from_target=True)


def layout(ours) -> str:
    """The target family the engine picks its MTP class by (config.json model_type of the export)."""
    return json.loads((ours.meta.folder / "config.json").read_text()).get("model_type", "")


KIND = Kind(
    "mtp",
    examples=tuple(Example(f"mtp-{family}", example_head, 6, ("vllm", "sglang"),
                           f"tiny {family} (released config, sizes scaled)", family=family) for family in FAMILIES),
    layout=layout,
)
