"""Speed-up by concurrency (eval/concurrency.py, bench/concurrency.py): the batch cost model's golden
values, the best k per batch size as vLLM's schedule, and the bench on the tiny target."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench, unload_bench

from specheads.eval.concurrency import BatchCosts, predict_by_batch, vllm_schedule
from specheads.eval.predict import StepCosts, expected_tokens_chain

# forwards over B rows x n tokens: batch 1 barely grows with n, batch 32 grows with every token
FORWARDS = {1: {1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}, 32: {1: 4.0, 2: 7.0, 4: 13.0, 9: 28.0}}
PER_ROW = StepCosts(target_s={1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}, draft_fixed_s=0.05, draft_per_level_s=0.1,
                    overhead_s=0.02, plain_step_s=1.01)


def test_batch_costs_golden_values():
    costs = BatchCosts(FORWARDS, PER_ROW)
    assert costs.target(32, 3) == pytest.approx(10.0)  # linear between 2 and 4 tokens
    assert costs.plain_step(1) == pytest.approx(1.01)
    assert costs.plain_step(32) == pytest.approx(4.0 + 32 * 0.01)
    assert costs.spec_step(32, 3) == pytest.approx(13.0 + 32 * (0.05 + 0.3 + 0.02))
    assert costs.speedup(1, 3, 2.5) == pytest.approx(2.5 * 1.01 / (1.3 + 0.37))


def test_batch_costs_scale_the_micro_curve_by_the_in_situ_one():
    slower = StepCosts(target_s={n: 2 * s for n, s in PER_ROW.target_s.items()}, plain_step_s=2.02)
    costs = BatchCosts(FORWARDS, slower)
    assert costs.target(32, 4) == pytest.approx(26.0) and costs.target(1, 9) == pytest.approx(3.6)


def test_best_k_shrinks_with_batch_size_and_turns_off_when_nothing_gains():
    cond = [0.8, 0.7, 0.6, 0.5]
    rows = {r["batch_size"]: r for r in predict_by_batch(BatchCosts(FORWARDS, PER_ROW), cond)}
    assert rows[1]["best_k"] >= 2 and rows[1]["best_speedup"] > 1.5
    assert rows[32]["best_k"] == 0 and rows[32]["best_speedup"] == 1.0  # every k loses at batch 32
    k = rows[1]["best_k"]
    assert rows[1]["speedup_by_k"][str(k)] == pytest.approx(
        expected_tokens_chain(cond, k) * 1.01 / BatchCosts(FORWARDS, PER_ROW).spec_step(1, k))
    assert vllm_schedule(list(rows.values())) == [[1, 1, k], [2, 32, 0]]


@pytest.fixture(scope="module")
def concurrency_bench():
    module = load_bench("concurrency.py")
    yield module
    unload_bench(module)


def test_bench_measures_every_batch_size_greedy_equal(concurrency_bench, tiny_target_dir, random_export_dir, tmp_path,
                                                       capsys):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b): return a + b\ndef add(a, b):", "import os\nimport os", "x = 1\ny = 2\nx = 1", "for i in"]
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "bench"
    rc = concurrency_bench.main(["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts",
                                 str(prompts), "--out", str(out), "--max-new-tokens", "10", "--batch-sizes", "1,3"])
    assert rc == 0 and "| batch |" in capsys.readouterr().out
    report = json.loads((out / "concurrency.json").read_text())
    assert [r["batch_size"] for r in report["rows"]] == [1, 3] and report["greedy_equal"] is True
    one, three = report["rows"]
    assert one["tokens"] == three["tokens"] and one["tau"] == pytest.approx(three["tau"])  # acceptance is per row
    assert all(r["predicted_speedup"] > 0 and r["plain_tok_s"] > 0 for r in report["rows"])
    assert [b["batch_size"] for b in report["best_k"]] == [1, 3]
    assert report["vllm_num_speculative_tokens_per_batch_size"][0][:2] == [1, 1]
    assert set(report["costs"]["forwards_s"]) == {"1", "3"} and report["settings"]["engine"] == "specheads verifier"


def test_bench_refuses_batch_sizes_without_one(concurrency_bench, capsys):
    with pytest.raises(SystemExit):
        concurrency_bench.main(["--target", "t", "--draft", "d", "--prompts", "p", "--out", "o", "--batch-sizes", "8,32"])
    assert "including 1" in capsys.readouterr().err


def test_timed_rows_are_ragged_like_a_real_batch():
    from specheads.eval.concurrency import ragged_pasts

    assert ragged_pasts(10, 1) == [10] and ragged_pasts(10, 4) == [10, 9, 10, 9]


def test_continuous_batching_schedule_golden():
    from specheads.eval.concurrency import continuous_seconds

    # 3 requests of 2, 3, 1 steps into 2 slots: steps with 2, 2, 2 active rows, then 1 (the third joins at step 3)
    assert continuous_seconds([2, 3, 1], 2, lambda b: 10.0 * b) == pytest.approx(20 + 20 + 20)
    assert continuous_seconds([2, 3, 1], 1, lambda b: 1.0) == 6  # one at a time: every step of every request
    costs = BatchCosts(FORWARDS, PER_ROW)
    assert costs.workload_speedup(1, 3, [10], [4]) == pytest.approx(10 * 1.01 / (4 * costs.spec_step(1, 3)))
    assert costs.target(16, 1) == pytest.approx(1.0 + 3.0 * 15 / 31)  # between the measured batch sizes
