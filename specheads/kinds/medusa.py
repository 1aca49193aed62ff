"""Medusa heads: examples (no current engine serves them: the check expects both to refuse)."""

from __future__ import annotations

from specheads.heads.medusa import MedusaHead, MedusaOptions
from specheads.kinds.base import Example, Kind, random_head


def example_head(target, seed: int):
    return random_head(MedusaHead, MedusaOptions(num_heads=3, num_layers=1), target, seed, init_from_target=True)


KIND = Kind("medusa", examples=(Example("medusa", example_head, 5, ("vllm-0.32", "medusa"), "refused by both engines"),))
