"""bench/vllm_speed.py's arithmetic (no engine): conditional acceptance from vLLM's cumulative counters,
the prediction priced from a step-cost curve, the best round with its spread, and the report rows."""

from __future__ import annotations

import argparse

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def vs_bench():
    module = load_bench("vllm_speed.py")
    yield module
    unload_bench(module)


def test_conditional_acceptance_from_cumulative_counts(vs_bench):
    assert vs_bench.conditional([80, 40, 10], 100) == [0.8, 0.5, 0.25]
    assert vs_bench.conditional([0, 0], 0) == [0.0, 0.0]


def test_prediction_prices_verification_and_drafting_from_the_curve(vs_bench):
    curve = {1: 0.010, 4: 0.012, 8: 0.020, 32: 0.050}
    # a perfect drafter of k = 3 verifies 4 tokens at batch 1: 4 tokens per 0.012 + 3 * 0.1 * 0.010 s
    p = vs_bench.predicted_speedup([1.0, 1.0, 1.0], 3, curve, 1, 0.1)
    assert p["expected_tokens"] == pytest.approx(4.0)
    assert p["speedup"] == pytest.approx(4 * 0.010 / (0.012 + 0.003))
    # at batch 8 the step verifies 32 tokens: the same drafts pay much less
    assert vs_bench.predicted_speedup([1.0, 1.0, 1.0], 3, curve, 8, 0.1)["speedup"] == pytest.approx(
        4 * 0.020 / (0.050 + 3 * 0.1 * 0.020))
    # nothing accepted: one token per (dearer) step, slower than plain
    assert vs_bench.predicted_speedup([0.0, 0.0, 0.0], 3, curve, 1, 0.0)["speedup"] < 1


def test_best_round_and_spread(vs_bench):
    rows = [{"output_tokens_per_s": 100.0, "tag": "a"}, {"output_tokens_per_s": 80.0, "tag": "b"}]
    best = vs_bench.best_of(rows)
    assert best["tag"] == "a" and best["rounds_tok_s"] == [100.0, 80.0] and best["spread"] == pytest.approx(0.25)


def row(tok_s, tpot_ms, acceptance=None):
    return {"output_tokens_per_s": tok_s, "rounds_tok_s": [tok_s], "spread": 0.0, "ttft_ms": None,
            "tpot_ms": {"p50": tpot_ms}, "failed": 0, "load_average": [0.0, 0.0, 0.0], "acceptance": acceptance}


def test_report_rows_compare_prediction_and_measurement(vs_bench):
    curve = {1: 0.010, 4: 0.016}
    timed = {("plain", 1): row(100.0, 10.0), ("ngram", 1): row(150.0, 6.0, {"acceptance_length": 2.0})}
    greedy = {"plain": {"tokens": [[1, 2]], "counters": None},
              "ngram": {"tokens": [[1, 2]], "counters": {"drafts": 10, "accepted_per_pos": [8, 4, 2]}}}
    args = argparse.Namespace(k=3)
    rows = {r["setting"]: r for r in vs_bench.report_rows(timed, greedy, curve, args, None, None)}
    ngram = rows["ngram"]
    assert ngram["measured_speedup"] == pytest.approx(1.5) and ngram["greedy_equal"]
    expected = (1 + 0.8 + 0.4 + 0.2) * 0.010 / 0.016
    assert ngram["predicted_speedup"] == pytest.approx(expected)
    # judged against the decode phase's speed-up (the TPOT ratio, 10 / 6), not the throughput ratio
    assert ngram["measured_decode_speedup"] == pytest.approx(10 / 6)
    assert ngram["within_10pct"] == (abs(expected / (10 / 6) - 1) <= 0.10)
    assert "predicted_speedup" not in rows["plain"]
