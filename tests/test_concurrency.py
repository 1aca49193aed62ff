"""Speed-up by concurrency (eval/concurrency.py, bench/concurrency.py): the batch cost model's golden
values (per-row and grouped drafter, the loop's overhead per step and per row), the drafter timed
through the real draft-group path (its forwards counted), the best k per batch size as vLLM's
schedule, and the bench on the tiny target."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load_bench, unload_bench

from specheads.eval.concurrency import BatchCosts, LoopOverhead, predict_by_batch, vllm_schedule
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


# the drafter's step over B rows x k drafts as one group: batch 32 costs 3x batch 1, not 32x
DRAFTS = {1: {1: 0.2, 2: 0.3, 4: 0.5}, 32: {1: 0.6, 2: 0.9, 4: 1.5}}


def test_grouped_drafter_and_loop_overhead_golden_values():
    """D_B(k): batch 1's own drafting; above, the micro-timed group step scaled by one factor, the
    median over k of batch 1's drafting in real decodes over its micro-timing (0.15 / 0.2, 0.25 / 0.3,
    0.45 / 0.5 -> 5 / 6); the loop: batch 1's overhead plus the measured seconds per extra row."""
    costs = BatchCosts(FORWARDS, PER_ROW, DRAFTS, LoopOverhead.growing(PER_ROW, 0.001, 0.0005))
    assert costs.draft(1, 3) == pytest.approx(0.35)  # batch 1: its own decodes' drafting
    assert costs.draft(32, 3) == pytest.approx(1.2 * 5 / 6)
    assert costs.draft(16, 3) == pytest.approx((0.4 + 0.8 * 15 / 31) * 5 / 6)
    assert costs.draft(32, 6) == pytest.approx(2.1 * 5 / 6)  # past the timed k: linear
    assert costs.loop.spec(32) == pytest.approx(0.02 + 31 * 0.001)
    assert costs.spec_step(32, 3) == pytest.approx(13.0 + 1.0 + 0.051)
    assert costs.plain_step(32) == pytest.approx(4.0 + 0.01 + 31 * 0.0005)
    assert costs.speedup(32, 3, 2.5) == pytest.approx(2.5 * 4.0255 / 14.051)
    assert costs.spec_step(1, 3) == pytest.approx(BatchCosts(FORWARDS, PER_ROW).spec_step(1, 3))  # batch 1 unchanged
    d = costs.to_dict()
    assert d["drafter"] == "grouped" and d["drafts_s"]["32"]["4"] == 1.5
    assert d["loop_overhead"]["spec_step_s"] == pytest.approx(0.019) and d["loop_overhead"]["spec_row_s"] == 0.001
    per_row = BatchCosts(FORWARDS, PER_ROW).to_dict()
    assert per_row["drafter"] == "per row" and per_row["drafts_s"] is None
    assert per_row["loop_overhead"]["spec_step_s"] == 0.0  # the old model: everything per row


def test_loop_growth_per_row_is_the_slope_between_median_steps():
    from specheads.eval.concurrency import _per_row

    one, many = [(1, 0.02), (1, 0.03), (1, 0.025)], [(8, 0.06), (7, 0.05), (8, 0.07)]
    assert _per_row(one, many) == pytest.approx(0.035 / 7)
    assert _per_row(many, one) == 0.0 and _per_row([], many) == 0.0  # never negative, nothing measured: 0


def test_batch_costs_scale_the_micro_curve_by_the_in_situ_one():
    slower = StepCosts(target_s={n: 2 * s for n, s in PER_ROW.target_s.items()}, plain_step_s=2.02)
    costs = BatchCosts(FORWARDS, slower)
    assert costs.target(32, 4) == pytest.approx(26.0) and costs.target(1, 9) == pytest.approx(3.6)


def test_one_bad_micro_timing_does_not_reprice_its_count():
    """A count whose batch-1 micro-timing drew 6x too slow leaves the scale (a median) and batch 8's
    price of that count alone; batch 1 stays what its own decodes measured."""
    bad = {1: {**FORWARDS[1], 2: 6.6}, 32: FORWARDS[32]}
    costs = BatchCosts(bad, PER_ROW)
    assert costs.target_scale == pytest.approx(1.0)
    assert costs.target(32, 2) == pytest.approx(7.0) and costs.target(1, 2) == pytest.approx(1.1)


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
    costs = report["costs"]  # EAGLE-3 chain rows draft as a group: the drafter timed over B rows, k = 1 .. 4
    assert costs["drafter"] == "grouped" and set(costs["drafts_s"]) == {"1", "3"}
    assert set(costs["drafts_s"]["3"]) == {"1", "2", "3", "4"}
    assert costs["loop_overhead"]["spec_row_s"] >= 0 and costs["loop_overhead"]["plain_row_s"] >= 0


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


@pytest.fixture(scope="module")
def random_pair():
    from random_models import make_head, make_target

    target = make_target()
    return target, make_head(target)


@pytest.mark.parametrize("rows", [1, 4])
def test_drafter_timing_runs_the_group_path_k_forwards_per_step(random_pair, rows):
    """Every timed step runs k drafter forwards over all `rows` rows (the catch-up forward of the
    longest row's k + 1 accepted tokens, then k - 1 draft positions), whatever the batch size;
    per-row drafting would run k forwards per row."""
    from test_batch_draft import Forwards

    from specheads.eval.concurrency import time_batch_drafts

    target, head = random_pair
    prompt = list(range(3, 23))  # 20 tokens
    count = Forwards(head)
    try:
        timed = time_batch_drafts(target, head, prompt, batch_sizes=(rows,), ks=(3,), reps=2)
        shapes = count.take()
    finally:
        count.close()
    assert set(timed) == {rows} and set(timed[rows]) == {3} and timed[rows][3] > 0
    starts = [(1, 20 - 3 - 2 - b % 2) for b in range(rows)]  # each row started on its own prefix
    steps = (len(shapes) - len(starts)) // 3  # warm-up + 2 timed steps, + 2 per round a noisy machine adds
    assert steps in (3, 5, 7) and shapes == starts + [(rows, 4), (rows, 1), (rows, 1)] * steps


def test_drafter_timing_is_none_for_a_head_that_does_not_group(random_pair):
    """A head whose attention ignores 4-D masks drafts row by row: the per-row model prices it."""
    from random_models import make_head

    from specheads.eval.concurrency import time_batch_drafts

    target, _ = random_pair
    head = make_head(target)
    config = head.layers[0].self_attn.config
    was, config._attn_implementation = config._attn_implementation, "flash_attention_2"
    try:
        assert time_batch_drafts(target, head, list(range(3, 23)), batch_sizes=(1, 4), ks=(1, 2), reps=1) is None
    finally:
        config._attn_implementation = was


def test_drafter_timing_refuses_a_prompt_too_short(random_pair):
    from specheads.eval.concurrency import time_batch_drafts
    from specheads.eval.predict import PredictError

    target, head = random_pair
    with pytest.raises(PredictError, match="too short to time drafts of 4: it needs 8"):
        time_batch_drafts(target, head, [5, 6, 7], batch_sizes=(1,), ks=range(1, 5), reps=1)


def test_a_rewound_drafter_repeats_its_step_exactly(random_pair):
    """checkpoint / rewind (what makes the timed step repeatable): after a rewind the same accept
    and drafts give the same draft tokens, and the draft cache is back to its rows."""
    from specheads.eval.concurrency import positions_of
    from specheads.verify.eagle3_proposers import Eagle3Proposer
    from specheads.verify.steps import new_cache, target_step

    target, head = random_pair
    ids = torch.arange(3, 23)
    prefill = target_step(target, ids[None], 0, new_cache(target), head.required_layers())
    drafter = Eagle3Proposer(head, target)
    drafter.start(ids[:12], int(ids[12]), prefill)
    point = drafter.checkpoint()

    def step():
        drafter.accept(ids[12:15], ids[13:16], positions_of(prefill, 12, 3), 12)
        return drafter.propose(4).tolist()

    first = step()
    assert drafter.rows == 15
    drafter.rewind(point)
    assert drafter.rows == 12 and drafter.cache.get_seq_length() == 12
    assert step() == first and len(first) == 4
