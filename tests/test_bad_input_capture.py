"""`specheads capture` and `specheads vocab-stats` refuse bad options and recipes before the
target runs."""

from __future__ import annotations

import shutil

import pytest
from refusals import LATIN1, RECIPE, refused, write_data


@pytest.fixture
def work(tmp_path, tiny_target_dir):
    shutil.copy(RECIPE, tmp_path / "recipe.yaml")
    write_data(tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes(LATIN1)
    return tmp_path, ["recipe.yaml", f"target.path={tiny_target_dir}", "data.train=[data.jsonl]",
                      "data.max_length=128"]


@pytest.mark.parametrize("extra,needles", [
    (["--shard-mb", "0"], ["--shard-mb 0.0", "positive"]),
    (["--shard-mb", "nan"], ["--shard-mb nan"]),
    (["--batch-size", "0"], ["--batch-size 0"]),
    (["--batch-size", "1000000000"], ["--batch-size = 1000000000", "GiB"]),
    (["data.max_length=100000"], ["data.max_length = 100000", "max_position_embeddings"]),
    (["data.train=[missing.jsonl]"], ["data.train[0] 'missing.jsonl'"]),
])
def test_bad_capture_input_is_named(work, tiny_target_dir, extra, needles):
    cwd, base = work
    refused(["capture", *base, *extra, "--out", "feats"], needles, cwd, watch=(tiny_target_dir,),
            output=cwd / "feats")
    assert not (cwd / "feats").exists()


def test_capture_needs_an_output(work, tiny_target_dir):
    cwd, base = work
    refused(["capture", *base], ["pass --out DIR", "data.features"], cwd, watch=(tiny_target_dir,))


@pytest.mark.parametrize("extra,needles", [
    (["--workers", "0"], ["--workers 0"]),
    (["data.train=[latin1.jsonl]"], ["latin1.jsonl", "not UTF-8"]),
    (["data.train=[missing.jsonl]"], ["data.train[0] 'missing.jsonl'"]),
    (["data.max_length=100000"], ["data.max_length = 100000"]),
])
def test_bad_vocab_stats_input_is_named(work, tiny_target_dir, extra, needles):
    cwd, base = work
    refused(["vocab-stats", *base, *extra, "--out", "out/vocab.safetensors"], needles, cwd,
            watch=(tiny_target_dir,), output=cwd / "out")
    assert not (cwd / "out").exists()


def test_vocab_stats_needs_an_output(work, tiny_target_dir):
    cwd, base = work
    refused(["vocab-stats", *base], ["pass --out FILE"], cwd, watch=(tiny_target_dir,))
