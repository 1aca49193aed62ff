"""Medusa-2 heads (Medusa trained with LoRA on the target): the export tests' example."""

from __future__ import annotations

from specheads.heads.medusa2 import Medusa2Head, Medusa2Options
from specheads.kinds.base import Example, Kind, random_head


def example_head(target, seed: int):
    return random_head(Medusa2Head, Medusa2Options(num_heads=2, lora_r=2), target, seed)


KIND = Kind("medusa2", examples=(Example("medusa2", example_head, 9, ("medusa", "vllm-0.32"), matrix=False),))
