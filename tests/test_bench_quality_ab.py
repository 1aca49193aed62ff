"""bench/quality_ab.py: every configuration is a valid recipe, the summary's numbers and table."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench, unload_bench

from specheads.config import load_recipe


@pytest.fixture(scope="module")
def qab():
    module = load_bench("quality_ab.py")
    yield module
    unload_bench(module)


def test_every_configuration_is_a_valid_recipe(qab):
    for name, overrides in qab.CONFIGS.items():
        recipe = load_recipe(qab.RECIPE, [*qab.BASE, *overrides])
        assert recipe.head.kind == "eagle3", name
    combined = load_recipe(qab.RECIPE, [*qab.BASE, *qab.CONFIGS["combined"]])
    assert (combined.train.optimizer, combined.head.loss, combined.head.qk_norm) == ("muon", "lk", True)


def test_summary_mean_spread_and_table(qab):
    runs = [{"config": c, "seed": s, "tau": t, "train_s": 10.0}
            for c, taus in (("baseline", (1.5, 1.7, 1.6)), ("muon", (1.9, 1.8, 2.0))) for s, t in enumerate(taus)]
    summary = qab.summarise(runs)
    assert summary["baseline"]["tau_mean"] == pytest.approx(1.6)
    assert summary["muon"]["tau_spread"] == pytest.approx(0.2)
    cond = qab.conditions(80, [0, 1, 2], 12.0, 400, 48)
    table = qab.markdown(summary, cond)
    assert "| muon | 1.900 | 0.200 | 0.100 | +0.300 | 1.900 1.800 2.000 | 10 |" in table
    assert f"{cond['torch_threads']} thread(s)" in table


def test_every_smollm2_configuration_is_a_valid_recipe():
    """bench/quality_ab_real.py: quality_ab's options over the SmolLM2 recipe (its norm_before_fc is the baseline)."""
    real = load_bench("quality_ab_real.py")
    try:
        recipe_path = real.real_model.RECIPE
        configs = real.configs()
        assert "baseline" not in configs and "norm_before_fc" not in configs and "no_norm_before_fc" in configs
        for name, overrides in configs.items():
            head = load_recipe(recipe_path, overrides).head
            assert not (head.norm_before_fc and head.fc_norm), name
        e31 = load_recipe(recipe_path, configs["eagle31"]).head
        assert (e31.norm_before_fc, e31.fc_norm, e31.norm_output) == (False, True, True)
        assert load_recipe(recipe_path, configs["lk"]).head.loss == "lk"
    finally:
        unload_bench(real)
