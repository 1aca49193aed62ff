"""`specheads train` refuses bad recipes and overrides by key, before loading the target."""

from __future__ import annotations

import shutil

import pytest
from refusals import BINARY, LATIN1, RECIPE, refused, write_data


@pytest.fixture
def work(tmp_path, tiny_target_dir):
    """A copy of the demo recipe, a small dataset, the base overrides pointing at them."""
    shutil.copy(RECIPE, tmp_path / "recipe.yaml")
    write_data(tmp_path)
    base = [f"target.path={tiny_target_dir}", "data.train=[data.jsonl]", "train.output_dir=run",
            "data.max_length=128"]
    return tmp_path, base, tiny_target_dir


@pytest.mark.parametrize("override,needles", [
    ("train.max_steps=0", ["train.max_steps = 0", ">= 1"]),
    ("train.save_every=0", ["train.save_every = 0"]),
    ("train.log_every=0", ["train.log_every = 0"]),
    ("train.keep_last=0", ["train.keep_last = 0"]),
    ("train.lr=0", ["train.lr = 0.0", "> 0"]),
    ("train.lr=.nan", ["train.lr = nan"]),
    ("train.batch_size=0", ["train.batch_size = 0"]),
    ("train.batch_size=1000000000", ["train.batch_size = 1000000000", "GiB"]),
    ("data.max_length=100000", ["data.max_length = 100000", "max_position_embeddings"]),
    ("head.ttt_steps=0", ["head.ttt_steps = 0"]),
    ("train.lrr=1", ["recipe.train.lrr"]),
    ("train.lr=[", ["override 'train.lr=['"]),
    ("data.train=[missing.jsonl]", ["data.train[0] 'missing.jsonl' does not exist"]),
    ("data.features=nowhere", ["data.features 'nowhere' does not exist"]),
])
def test_bad_value_is_named_before_anything_runs(work, override, needles):
    cwd, base, target = work
    refused(["train", "recipe.yaml", *base, override], needles, cwd, watch=(target,), output=cwd / "run")
    assert not (cwd / "run").exists()  # refused before the run folder was made


@pytest.mark.parametrize("content,needle", [(BINARY, "binary"), (LATIN1, "not UTF-8")])
def test_unreadable_recipe_file_is_named(work, content, needle):
    cwd, base, target = work
    (cwd / "recipe.yaml").write_bytes(content)
    refused(["train", "recipe.yaml", *base], ["recipe.yaml", needle], cwd, watch=(target,))


def test_non_utf8_data_file_is_named(work):
    cwd, base, target = work
    (cwd / "data.jsonl").write_bytes(LATIN1)
    refused(["train", "recipe.yaml", *base, "train.max_steps=1"], ["data.jsonl", "not UTF-8"], cwd,
            watch=(target,), output=cwd / "run")


def test_missing_target_is_named(work):
    cwd, base, _ = work
    refused(["train", "recipe.yaml", *base, "target.path=no/such/target"], ["no/such/target"], cwd)


def test_debug_flag_shows_the_traceback(work):
    """--debug (and SPECHEADS_DEBUG=1) keep the traceback for bug reports."""
    from refusals import cli

    cwd, base, _ = work
    r = cli(["--debug", "train", "recipe.yaml", *base, "train.max_steps=0"], cwd)
    assert r.returncode != 0 and "Traceback" in r.stderr and "train.max_steps" in r.stderr
    r = cli(["train", "recipe.yaml", *base, "train.max_steps=0"], cwd, SPECHEADS_DEBUG="1")
    assert "Traceback" in r.stderr


def test_prompt_only_rows_point_to_regenerate(work):
    """A prompts file (questions, no answers) as training data: the message says to have the target
    answer it with `specheads regenerate`, not only to set data.format."""
    from refusals import write_prompts

    cwd, base, target = work
    write_prompts(cwd)
    text = refused(["train", "recipe.yaml", *base, "data.train=[prompts.jsonl]", "train.max_steps=1"],
                   ["prompts.jsonl: cannot detect the data format", "first row keys: ['prompt']",
                    "these rows are prompts without answers, and data.train needs conversations with answers: "
                    "have the target write them with `specheads regenerate prompts.jsonl --out ANSWERS.jsonl"],
                   cwd, watch=(target,), output=cwd / "run")
    assert "data.path" not in text and not (cwd / "run").exists()
