"""A recipe's samples: its conversations read, tokenised, and split into training and held-out.

Training, `capture` and `vocab-stats` all take their samples from here, so the tokens a vocabulary
is counted from are the tokens training supervises (held-out samples excluded from both).
"""

from __future__ import annotations

from typing import TypeVar

from specheads.config import Recipe
from specheads.data.conversations import Conversation, DataError, read_conversations
from specheads.data.tokenize import TokenizedSample, TokenizeStats, tokenize_all
from specheads.schedule import validation_split

T = TypeVar("T")


def read_recipe_conversations(recipe: Recipe, report=print) -> list[Conversation]:
    """Every conversation of `data.train`, in order, with one line per source on what was kept."""
    if not recipe.data.train:
        raise DataError("data.train is empty: list at least one dataset file or folder")
    convs = []
    for source in recipe.data.train:
        rows, stats = read_conversations(source, fmt=recipe.data.format,
                                         skip_malformed=recipe.data.skip_malformed)
        convs.extend(rows)
        skipped = f", skipped {stats.skipped} malformed (e.g. {stats.reasons[0]})" if stats.skipped else ""
        report(f"[specheads] {source}: {stats.kept} of {stats.read} rows ({stats.format}){skipped}")
    return convs


def prepare_samples(recipe: Recipe, tokenizer, report=print) -> list[TokenizedSample]:
    """Read and tokenise the recipe's data (assistant-only loss masks, verified); samples left with
    no supervised token are dropped. Held-out samples are still in: see `split_samples`."""
    convs = read_recipe_conversations(recipe, report)
    tstats = TokenizeStats()
    samples = tokenize_all(tokenizer, convs, recipe.data.max_length, end_of_turn=recipe.data.end_of_turn,
                           stats=tstats)
    report(f"[specheads] tokenised {tstats.kept} samples (max_length {recipe.data.max_length}): "
           f"{tstats.truncated} truncated, {tstats.dropped} dropped with no supervised token left")
    if not samples:
        raise DataError("no training sample has a supervised token after tokenisation")
    return samples


def split_samples(recipe: Recipe, items: list[T]) -> tuple[list[T], list[T]]:
    """(training, held-out): the seeded split of `train.val_samples` over the kept samples.

    `items` are the samples `prepare_samples` keeps, or anything in the same order and number
    (e.g. their conversations), so every caller holds out the same ones."""
    train_idx, val_idx = validation_split(len(items), recipe.train.val_samples, recipe.train.seed)
    return [items[i] for i in train_idx], [items[i] for i in val_idx]
