"""Strict recipes: unknown keys and wrong types fail with the key's name; overrides apply."""

from pathlib import Path

import pytest

from specheads.config import ConfigError, load_recipe

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo" / "eagle3.yaml"


def test_demo_recipe_loads_with_overrides():
    r = load_recipe(RECIPE, ["train.lr=1e-4", "head.ttt_steps=5", "data.train=[a.jsonl, b.jsonl]"])
    assert r.train.lr == pytest.approx(1e-4)
    assert r.head.ttt_steps == 5 and r.head.kind == "eagle3"
    assert r.data.train == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize("override,needle", [
    ("train.lrr=1", "recipe.train.lrr"),
    ("head.ttt_stepz=3", "head.ttt_stepz"),
    ("bogus.x=1", "recipe.bogus"),
])
def test_unknown_key_is_named(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_recipe(RECIPE, [override])


@pytest.mark.parametrize("override,needle", [
    ("train.max_steps=ten", "recipe.train.max_steps: expected an integer"),
    ("train.resume=maybe", "recipe.train.resume: expected true/false"),
    ("head.kind=medusa9", "head.kind 'medusa9'"),
])
def test_wrong_values_are_named(override, needle):
    with pytest.raises(ValueError, match=needle):
        load_recipe(RECIPE, [override])


def test_unknown_key_in_yaml_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(RECIPE.read_text() + "\nextra_section:\n  a: 1\n")
    with pytest.raises(ConfigError, match="recipe.extra_section"):
        load_recipe(bad)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_one_path_for_data_train_and_a_guess_for_a_misspelt_key():
    assert load_recipe(RECIPE, ["data.train=/data/train.jsonl"]).data.train == ["/data/train.jsonl"]
    with pytest.raises(ConfigError, match=r"unknown key 'recipe\.train\.max_step'\. Did you mean 'recipe\.train\.max_steps'\?"):
        load_recipe(RECIPE, ["train.max_step=3"])
    with pytest.raises(ConfigError, match=r"Did you mean 'head\.ttt_steps'\?"):
        load_recipe(RECIPE, ["head.ttt_stepz=3"])
    with pytest.raises(ConfigError, match=r"head\.aux_layers: expected a list"):  # only strings stand for a list
        load_recipe(RECIPE, ["head.aux_layers=3"])
