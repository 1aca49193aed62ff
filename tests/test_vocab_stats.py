"""Vocabulary statistics: counted once (streamed, multi-process), equal to training's own count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specheads.config import load_recipe
from specheads.data.samples import prepare_samples
from specheads.data.vocab_stats import VocabStatsError, load_vocab_stats, read_vocab_stats, vocab_stats
from specheads.heads.vocab import count_tokens
from specheads.target import Target
from specheads.train import build_head

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo" / "eagle3.yaml"


def test_counts_equal_training_count_and_build_the_same_vocab(tiny_target_dir, demo_data_dir, tmp_path):
    over = [f"target.path={tiny_target_dir}", f"data.train=[{demo_data_dir / 'train.jsonl'}]",
            "data.max_length=96", "head.draft_vocab_size=128"]
    recipe = load_recipe(RECIPE, over)
    one = vocab_stats(recipe, tmp_path / "one.safetensors", workers=1, report=lambda *_: None)
    two = vocab_stats(recipe, tmp_path / "two.safetensors", workers=2, report=lambda *_: None)
    counts, meta = read_vocab_stats(one)
    target = Target.load(str(tiny_target_dir), device="cpu")
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    assert torch.equal(counts, count_tokens(samples, target.vocab_size))
    assert torch.equal(read_vocab_stats(two)[0], counts)
    assert meta["num_tokens"] == sum(sum(s.loss_mask) for s in samples) > 0
    cached = build_head(load_recipe(RECIPE, over + [f"data.vocab_stats={one}"]), target, samples[:3])
    counted = build_head(recipe, target, samples)
    assert torch.equal(cached.d2t, counted.d2t) and torch.equal(cached.t2d, counted.t2d)
    target.tokenizer.add_tokens(["<|another|>"])  # another tokenizer: refused
    with pytest.raises(VocabStatsError, match="another tokenizer"):
        load_vocab_stats(one, target)
    with pytest.raises(VocabStatsError, match="no such file"):
        load_vocab_stats(tmp_path / "missing.safetensors", target)


def test_held_out_samples_are_not_counted(tiny_target_dir, demo_data_dir, tmp_path):
    """With train.val_samples, vocab-stats counts exactly the samples training trains on."""
    from specheads.schedule import validation_split

    over = [f"target.path={tiny_target_dir}", f"data.train=[{demo_data_dir / 'train.jsonl'}]",
            "data.max_length=96", "train.val_samples=12", "train.seed=3"]
    recipe = load_recipe(RECIPE, over)
    counts, meta = read_vocab_stats(vocab_stats(recipe, tmp_path / "v.safetensors", workers=2,
                                                report=lambda *_: None))
    target = Target.load(str(tiny_target_dir), device="cpu")
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    train_idx, _ = validation_split(len(samples), 12, 3)
    trained = [samples[i] for i in train_idx]
    assert torch.equal(counts, count_tokens(trained, target.vocab_size))
    assert not torch.equal(counts, count_tokens(samples, target.vocab_size))  # the held-out ones differ
    assert meta["num_samples"] == len(trained) == len(samples) - 12
