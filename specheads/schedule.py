"""Deterministic training schedules: which samples each (step, micro-batch, rank) reads, the
learning-rate factor per step, and the held-out validation split. Pure functions of the recipe,
so a resumed run continues exactly where a killed one stopped."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

SCHEDULES = ("cosine", "constant", "wsd")


@dataclass
class BatchPlan:
    """Deterministic data order: optimizer step -> sample indices of one (micro-batch, rank).

    One optimizer step consumes `batch_size * world * accum` samples (the global batch). Each
    epoch is a seeded permutation cut into windows of `bucket` global batches; inside a window
    samples are sorted by length so a batch pads little, and batch order is shuffled. Slice
    `micro * world + rank` of a global batch goes to that micro-batch of that rank, so 2 ranks
    x 1 micro-batch read exactly what 1 rank x 2 accumulated micro-batches read.
    """

    lengths: list[int]
    batch_size: int
    world: int
    rank: int
    seed: int
    accum: int = 1
    bucket: int = 32

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world * self.accum

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.lengths) // self.global_batch)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - bounded (2 epochs); the plan lives as long as the run
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=gen).tolist()
        n = self.batches_per_epoch * self.global_batch
        perm = perm[:n] if len(perm) >= self.global_batch else (perm * self.global_batch)[: self.global_batch]
        window = self.bucket * self.global_batch
        batches = []
        for w in range(0, len(perm), window):
            chunk = sorted(perm[w:w + window], key=lambda k: self.lengths[k])
            batches += [chunk[b:b + self.global_batch] for b in range(0, len(chunk), self.global_batch)]
        order = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[o] for o in order]

    def indices(self, step: int, micro: int = 0) -> list[int]:
        epoch, pos = divmod(step, self.batches_per_epoch)
        batch = self.epoch_batches(epoch)[pos]
        part = micro * self.world + self.rank
        return batch[part * self.batch_size:(part + 1) * self.batch_size]

    __hash__ = object.__hash__


def lr_factor(step: int, max_steps: int, warmup: int, schedule: str = "cosine",
              decay_fraction: float = 0.2, min_ratio: float = 0.0) -> float:
    """LR multiplier at `step`: linear warmup, then cosine / constant / warmup-stable-decay.

    wsd holds the peak until the last `decay_fraction` of the steps, then decays linearly.
    Every schedule ends at `min_ratio` of the peak (except constant).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay = max(1, round(decay_fraction * max_steps))
        start = max(warmup, max_steps - decay)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, max_steps - start))
        return min_ratio + (1 - min_ratio) * (1 - progress)
    raise ValueError(f"train.schedule '{schedule}': expected one of {', '.join(SCHEDULES)}")


def validation_split(n: int, val_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, held-out) index lists; held-out is `val_samples` long (0 = none)."""
    if val_samples >= n:
        raise ValueError(f"train.val_samples={val_samples} leaves no training sample out of {n}; "
                         "lower it")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    return sorted(perm[val_samples:]), sorted(perm[:val_samples])
