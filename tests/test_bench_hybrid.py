"""bench/hybrid.py on the tiny target: every method runs, equals plain greedy, JSON + Markdown."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from bench_scripts import load_bench, unload_bench

from specheads.verify.steps import DecodeStats


@pytest.fixture(scope="module")
def hybrid_bench():
    """The benchmark script loaded as a module (bench/ is scripts, not a package)."""
    module = load_bench("hybrid.py")
    yield module
    unload_bench(module)


def test_bench_writes_every_method(hybrid_bench, tiny_target_dir, random_export_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def add(a, b): return a + b\ndef add(a, b):"}) + "\n"
                       + json.dumps({"id": "b", "prompt": "import os\nimport os"}) + "\n")
    out = tmp_path / "bench"
    rc = hybrid_bench.main(["--target", str(tiny_target_dir), "--draft", str(random_export_dir),
                            "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "12"])
    assert rc == 0 and "| method |" in capsys.readouterr().out
    report = json.loads((out / "hybrid.json").read_text())
    names = [r["method"] for r in report["methods"]]
    assert names[:4] == ["plain", "eagle3 k=3", "ngram k=3", "suffix k=3"]
    assert len(names) == 4 + len(hybrid_bench.HYBRIDS) + len(hybrid_bench.ADAPTIVE) and names[-2:] == [
        "adaptive eagle3+suffix", "adaptive eagle3"]
    assert report["greedy_equal"] is True and report["settings"]["k"] == 3 and report["settings"]["k_max"] >= 3
    for row in report["methods"]:
        assert row["tokens"] == report["methods"][0]["tokens"] and row["tau"] >= 1.0 and row["predicted_speedup"] > 0
        if row["settings"].get("kind") in ("hybrid", "adaptive"):
            assert sum(row["chosen"].values()) > 0
    assert report["first_pass"]["records"] > 0 and report["summary"]["best_hybrid"] in names
    assert report["summary"]["worst_prediction"] in names and len(report["settings"]["load"]) == 3
    assert (out / "hybrid.md").read_text().startswith("# Hybrid benchmark")
    assert set(report["first_pass"]["decodes"]) >= {"plain", "draft"}
    # every row keeps its decode stats: re-priced offline, each row predicts what the run wrote
    rc = hybrid_bench.main(["--reprice", str(out), "--out", str(tmp_path / "again")])
    assert rc == 0 and "| method | measured |" in capsys.readouterr().out
    repriced = json.loads((tmp_path / "again" / "hybrid_repriced.json").read_text())
    assert [r["method"] for r in repriced["methods"]] == names and repriced["time_base"] > 0
    for row, again in zip(report["methods"], repriced["methods"]):
        assert again["now"] == pytest.approx(row["predicted_speedup"]) == pytest.approx(again["saved"]), row["method"]


def legacy_report(first_slow: float) -> dict:
    """A hybrid.json of before rows kept their decode stats: plain (100 forwards, 10 ms each in the timed pass)
    and one row (11 tokens in 5 forwards, 9 ms in its proposer) priced 61 ms by costs of a first pass
    `first_slow` times slower, its proposer seconds added as measured (the old prediction)."""
    costs = {"target_s": {"1": 0.010 * first_slow}, "plain_step_s": 0.0105 * first_slow}
    old = 11 * 0.0105 * first_slow / (0.061 * first_slow + 0.009)
    return {"first_pass": {"costs": costs, "free_step_s": {}},
            "methods": [{"method": "plain", "settings": {"kind": "plain"}, "tau": 1.0, "target_forwards": 100,
                         "target_decode_s": 1.0, "proposer_s": 0.0, "speedup": 1.0, "predicted_speedup": 0.95},
                        {"method": "row", "settings": {"kind": "adaptive"}, "tau": 2.2, "target_forwards": 5,
                         "target_decode_s": 0.06, "proposer_s": 0.009, "speedup": 1.6, "predicted_speedup": old}]}


def test_reprice_puts_an_old_run_in_one_time_base(hybrid_bench):
    """A saved run whose first pass ran 20% slow: its row was predicted 1.686x; re-priced, 11 * 10.5 / 70 =
    1.65x, what a first pass at the timed pass's speed predicts (and did, saved)."""
    slow = hybrid_bench.reprice(legacy_report(1.2), "slow.json")
    assert slow["time_base"] == pytest.approx(1.2) and slow["target_curves"].startswith("blended")
    assert slow["methods"][1]["saved"] == pytest.approx(11 * 12.6 / (1.2 * 61 + 9))
    assert slow["methods"][1]["now"] == pytest.approx(11 * 10.5 / 70)
    even = hybrid_bench.reprice(legacy_report(1.0), "even.json")["methods"]
    assert even[1]["now"] == pytest.approx(even[1]["saved"]) == pytest.approx(11 * 10.5 / 70)
    assert even[0]["now"] == pytest.approx(0.95)  # plain has no proposer seconds to move


def stats_json(steps: dict[int, int], tokens: int, target_s: dict[int, float] | None = None, **timing) -> dict:
    """A saved DecodeStats (hybrid.json's form: per-count keys as strings)."""
    return {**asdict(DecodeStats(decode_forwards=sum(steps.values()), decode_tokens=tokens, **timing)),
            "steps_by_nodes": {str(n): c for n, c in steps.items()},
            "target_s_by_nodes": {str(n): s for n, s in (target_s or {}).items()}}


def family_report() -> dict:
    """A saved run whose first pass met slower target steps in the drafter's decodes (15 ms at 4 tokens)
    than in the free proposer's (13 ms) and plain's (8 ms at 1; micro 10 / 12 ms at 1 / 4); the drafter's
    decodes leave 1 ms of loop per step. The timed pass: plain 100 forwards of 8 ms (time base 1.0), and
    an EAGLE-3 and an n-gram row of the same mix: 2 one-token and 3 four-token steps, 11 tokens, 9 ms
    in the proposer."""
    row = stats_json({1: 2, 4: 3}, 11, proposer_s=0.009)
    decodes = {"plain": stats_json({1: 100}, 100, {1: 0.8}, wall_s=0.9, target_prefill_s=0.1, target_decode_s=0.8),
               "draft": stats_json({4: 50}, 150, {4: 0.75}, wall_s=1.4, target_prefill_s=0.1, target_decode_s=0.75,
                                   proposer_s=0.5, proposed_tokens=100),
               "ngram": stats_json({1: 60, 4: 40}, 180, {1: 0.48, 4: 0.52}, wall_s=1.1, target_prefill_s=0.1,
                                   target_decode_s=1.0, proposer_s=0.01)}
    micro = {"target_s": {"1": 0.010, "2": 0.011, "4": 0.012}, "draft_fixed_s": 0.001, "draft_per_level_s": 0.002,
             "overhead_s": 0.003, "plain_step_s": 0.011}
    return {"first_pass": {"costs": micro, "costs_micro": micro, "decodes": decodes, "free_step_s": {"ngram": 0.0001}},
            "methods": [{"method": "plain", "settings": {"kind": "plain"}, "speedup": 1.0, "predicted_speedup": 0.9,
                         "decode_stats": stats_json({1: 100}, 100, target_decode_s=0.8)},
                        {"method": "eagle3 k=3", "settings": {"kind": "eagle3"}, "speedup": 1.0,
                         "predicted_speedup": 1.2, "decode_stats": row},
                        {"method": "ngram k=3", "settings": {"kind": "ngram"}, "speedup": 1.2,
                         "predicted_speedup": 1.2, "decode_stats": row}]}


def test_reprice_prices_each_row_by_its_familys_first_pass_decodes(hybrid_bench):
    """Rebuilt from the saved decodes: the EAGLE-3 row's target steps at the drafter's curve (12.5 ms at 1
    token: micro x 15/12; 15 ms at 4) -> 11 * 8 / (2*12.5 + 3*15 + 5*1 + 9) = 88 / 84; the n-gram row's at the
    free curve (8, 13 ms) -> 88 / 69; plain 800 / (800 + 100 * 1) ms. One blended curve (14.11 ms at 4 tokens)
    would have priced both rows alike."""
    repriced = hybrid_bench.reprice(family_report(), "family.json")
    assert repriced["target_curves"] == "by family" and repriced["time_base"] == pytest.approx(1.0)
    plain, eagle, ngram = (r["now"] for r in repriced["methods"])
    assert eagle == pytest.approx(88 / 84) and ngram == pytest.approx(88 / 69) and plain == pytest.approx(800 / 900)
    assert repriced["costs_by_family"]["model"]["target_s"]["4"] == pytest.approx(0.015)
    assert "- model: 12.50, 13.75, 14.3" in hybrid_bench.reprice_markdown(repriced)

@pytest.mark.parametrize("content, words", [
    (None, "no such file"), ("{not json", "not JSON"), ("{}", "'first_pass'"),
    (json.dumps({"first_pass": {"costs": {"target_s": {"1": -1}}, "free_step_s": {}}, "methods": []}), "target_s"),
    (json.dumps({"first_pass": {"costs": {"target_s": {"1": 0.01}}, "free_step_s": {}}, "methods": [{"method": "x"}]}),
     "plain row"),
])
def test_reprice_refuses_what_is_not_a_saved_run(hybrid_bench, tmp_path, capsys, content, words):
    path = tmp_path / "hybrid.json"
    if content is not None:
        path.write_text(content)
    assert hybrid_bench.main(["--reprice", str(path)]) == 1
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and not (tmp_path / "hybrid_repriced.json").exists()
