"""Reduced draft vocabulary: the most frequent supervised target tokens, as d2t offsets and t2d mask."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Frequencies over supervised (loss-masked) tokens -> counts [V] (int64)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.int64)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] -> (d2t [Vd] int64 offsets with target = i + d2t[i], t2d [V] bool).

    Keeps the Vd most frequent ids (ties and unseen ids broken by lower id) sorted ascending,
    exactly the convention vLLM and SGLang read.
    """
    vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    used = torch.sort(order).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids -> target ids (same shape)."""
    return draft_ids + d2t[draft_ids]


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The target->draft mask t2d [V] bool of the d2t offsets [Vd] (target id = i + d2t[i])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[torch.arange(d2t.numel()) + d2t] = True
    return t2d
