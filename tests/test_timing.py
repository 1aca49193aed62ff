"""Measurements that a shared machine cannot turn into advice (eval/timing.py, eval/concurrency.py,
eval/recommend.py): timed configurations interleaved on a fake clock, where a burst of load on one
of them does not flip which is faster (a block per configuration does flip it); a noisy timing timed
again and marked; measured rows interleaved over rounds with their spread kept; the per-batch-size
schedule never turning speculation off where the same run measured a speed-up, nor where the
prediction is uncertain; one recommendation, the same in the report, the README's serve commands,
the terminal and the pushed card."""

from __future__ import annotations

import itertools
import random

import pytest

from specheads.eval.concurrency import BatchCosts, keep_measured, measure_by_batch, predict_by_batch, vllm_schedule
from specheads.eval.predict import MIN_GAIN, StepCosts, advice, advice_summary, predict, verdict
from specheads.eval.timing import NOISY, Timing, round_robin, turned
from specheads.verify.steps import DecodeResult, DecodeStats


class FakeClock:
    """A timer (timing.round_robin's `timer`): each call returns its key, costs `cost[key]` seconds of
    fake time, `factor` times that while the fake time is inside `burst` (a job starting beside ours)."""

    def __init__(self, cost: dict, burst: tuple[float, float] = (0.0, 0.0), factor: float = 3.0):
        self.cost, self.burst, self.factor = cost, burst, factor
        self.now, self.order = 0.0, []

    def __call__(self, call) -> float:
        key = call()
        self.order.append(key)
        seconds = self.cost[key] * (self.factor if self.burst[0] <= self.now < self.burst[1] else 1.0)
        self.now += seconds
        return seconds


def calls_of(keys) -> dict:
    return {key: (lambda key=key: key) for key in keys}


def blocked(clock: FakeClock, keys, reps: int) -> dict:
    """The old way: every repetition of one key, then the next key's."""
    return {key: Timing.of([clock(lambda key=key: key) for _ in range(reps)]).median for key in keys}


COST = {"plain": 1.0, "spec": 0.8}  # speculation is faster
BURST = (7.0, 18.0)  # lands on most of the drafter's block when timed block by block


def test_a_burst_on_one_block_flips_the_old_measurement_but_not_the_interleaved_one():
    old = blocked(FakeClock(COST, BURST), COST, reps=7)
    assert old["spec"] > old["plain"]  # the burst became the advice: plain looks faster
    timings = round_robin(calls_of(COST), reps=7, timer=FakeClock(COST, BURST))
    assert timings["spec"].median < timings["plain"].median  # the right choice survives the burst
    assert timings["spec"].median == pytest.approx(0.8) and timings["plain"].median == pytest.approx(1.0)


@pytest.mark.parametrize("start", [0.0, 2.0, 5.0, 9.0])
def test_no_burst_of_a_third_of_the_run_flips_the_choice_wherever_it_lands(start):
    timings = round_robin(calls_of(COST), reps=9, timer=FakeClock(COST, (start, start + 5.0)))
    assert min(timings, key=lambda k: timings[k].median) == "spec"


def test_the_order_turns_every_repetition():
    clock = FakeClock({"a": 1.0, "b": 1.0, "c": 1.0})
    round_robin(calls_of("abc"), reps=3, timer=clock)
    assert clock.order == list("abcbcacab")
    assert turned([1, 2, 3], 4) == [2, 3, 1] and turned([], 2) == []


def test_a_steady_timing_is_timed_once_a_noisy_one_again_and_marked():
    steady = round_robin(calls_of(["x"]), reps=5, timer=FakeClock({"x": 2.0}))
    assert steady["x"].samples == 5 and steady["x"].spread == 0.0 and not steady["x"].noisy
    wild = itertools.cycle([1.0, 3.0])
    noisy = round_robin(calls_of(["x"]), reps=4, timer=lambda call: next(wild), max_rounds=3)
    assert noisy["x"].samples == 12 and noisy["x"].noisy and noisy["x"].spread > NOISY
    t = Timing.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (t.q1, t.median, t.q3) == (2.0, 3.0, 4.0) and t.to_dict()["spread"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="reps >= 1"):
        round_robin(calls_of(["x"]), reps=0)


# --- verdicts, bands and the schedule --------------------------------------------------------------


def test_verdict_is_off_only_when_no_gain_fits_in_the_spread():
    gain = 1 + MIN_GAIN
    assert verdict(1.3, 1.2, 1.4) == "on"
    assert verdict(1.1, 0.95, 1.25) == "uncertain"  # predicted to gain, maybe slower than plain
    assert verdict(0.98, 0.9, 1.07) == "uncertain"  # predicted not to gain, maybe gaining: never a hard off
    assert verdict(0.98, 0.9, gain - 1e-9) == "off"
    assert verdict(1.02, 1.02, 1.02) == "off"  # no spread: as before, below the gain is off


FORWARDS = {1: {1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}, 8: {1: 2.0, 2: 3.0, 4: 5.0, 9: 10.0}}
PER_ROW = StepCosts(target_s={1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}, draft_fixed_s=0.05, draft_per_level_s=0.1,
                    overhead_s=0.02, plain_step_s=1.01)
COND = [0.8, 0.7, 0.6, 0.5]


def test_an_uncertain_band_keeps_speculation_on_and_says_so():
    certain = {r["batch_size"]: r for r in predict_by_batch(BatchCosts(FORWARDS, PER_ROW), COND)}
    assert certain[8]["best_k"] == 0 and certain[8]["verdict"] == "off"  # no spread: off, as before
    top = certain[8]["top_speedup"]
    spread = (1 + MIN_GAIN) / top - 1 + 0.01  # just wide enough to reach the gain
    noisy = {r["batch_size"]: r for r in predict_by_batch(BatchCosts(FORWARDS, PER_ROW, spreads={1: 0.0, 8: spread}), COND)}
    assert noisy[8]["verdict"] == "uncertain" and noisy[8]["best_k"] == noisy[8]["top_k"] > 0
    assert noisy[8]["speedup_high"] >= 1 + MIN_GAIN > noisy[8]["speedup_low"]
    assert noisy[1]["best_k"] == certain[1]["best_k"]  # batch 1 priced by its own spread (0 here)


def test_the_issue_schedule_keeps_the_measured_speedup_at_batch_8():
    """The issue's run: predicted 0.91x at batch 8 -> k 0, while the same run measured 1.49x there."""
    rows = [{"batch_size": 1, "best_k": 5, "best_speedup": 1.4, "top_k": 5, "top_speedup": 1.4, "verdict": "on"},
            {"batch_size": 8, "best_k": 0, "best_speedup": 1.0, "top_k": 2, "top_speedup": 0.91, "verdict": "off"},
            {"batch_size": 32, "best_k": 8, "best_speedup": 1.27, "top_k": 8, "top_speedup": 1.27, "verdict": "on"}]
    assert vllm_schedule(rows) == [[1, 1, 5], [2, 8, 0], [9, 32, 8]]  # the advice the issue shows
    kept = keep_measured(rows, {1: (3, 1.3), 8: (3, 1.49), 32: (3, 1.04)})
    assert vllm_schedule(kept) == [[1, 1, 5], [2, 8, 3], [9, 32, 8]]
    assert "measured 1.49x at k=3" in kept[1]["kept_on"] and kept[1]["verdict"] == "uncertain"
    assert kept[0] == rows[0] and kept[2] == rows[2]  # bands that speculate keep their predicted k


def test_the_schedule_never_emits_0_where_a_speedup_was_measured():
    rng = random.Random(0)
    for _ in range(300):
        sizes = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], 3))
        rows = []
        for b in sizes:
            k = rng.choice([0, 0, 1, 3, 5])
            rows.append({"batch_size": b, "best_k": k, "best_speedup": rng.uniform(0.5, 2.0), "top_k": max(k, 2),
                         "top_speedup": rng.uniform(0.5, 1.2), "verdict": "off" if k == 0 else "on"})
        measured = {b: (rng.choice([1, 3, 4]), rng.uniform(0.6, 1.6)) for b in sizes if rng.random() < 0.7}
        schedule = vllm_schedule(keep_measured(rows, measured))
        for (_lo, hi, k) in schedule:
            if hi in measured and measured[hi][1] > 1.0:
                assert k > 0, (rows, measured, schedule)


# --- measured rows: interleaved rounds -------------------------------------------------------------


class FakeSession:
    """decode_many that costs fake seconds: plain steps 1.0 s and speculative 0.6 s per request at batch 1,
    both 4x cheaper per request at batch 8; `slow` (round, batch, drafted) calls run `factor` times slower."""

    k = 3

    def __init__(self, slow=(), factor: float = 2.5):
        self.slow, self.factor, self.calls, self.round = set(slow), factor, [], 0

    def decode_many(self, prompts, max_new_tokens, batch_size=1, drafted=True):
        self.calls.append((batch_size, drafted))
        seconds = (0.6 if drafted else 1.0) / (4 if batch_size > 1 else 1) * len(prompts)
        slow = (len(self.calls) - 1) // 4, batch_size, drafted  # 4 calls per round with two sizes
        seconds *= self.factor if slow in self.slow else 1.0
        share = seconds / len(prompts)
        return [DecodeResult([1, 2, 3], "length", DecodeStats(decode_forwards=2, decode_tokens=3, tokens=3, wall_s=share))
                for _ in prompts]


def fake_timed(fn):
    results = fn()
    return results, sum(r.stats.wall_s for r in results)


def test_measured_rows_are_interleaved_over_rounds_and_keep_their_spread(monkeypatch):
    import specheads.eval.concurrency as conc

    monkeypatch.setattr(conc, "timed", fake_timed)
    session = FakeSession()
    rows, stats, steps = measure_by_batch(session, [[1, 2]] * 4, 3, batch_sizes=(1, 8), rounds=2)
    assert session.calls == [(1, False), (1, True), (8, False), (8, True), (8, True), (8, False), (1, True), (1, False)]
    assert [r["measured_speedup"] for r in rows] == pytest.approx([1 / 0.6] * 2)
    assert rows[0]["measured_rounds"] == pytest.approx([1 / 0.6] * 2) and rows[0]["measured_spread"] == pytest.approx(0)
    assert rows[0]["greedy_equal"] == 4 and rows[0]["tokens"] == 12 and stats[1][0].tokens == 24
    # plain at batch 8 slowed 2.5x in the first round (the issue's 444 against 965 tok/s): the run's
    # speed-up stays between the rounds' and the spread says the measurement was noisy
    loaded = FakeSession(slow={(0, 8, False)})
    rows, _, _ = measure_by_batch(loaded, [[1, 2]] * 4, 3, batch_sizes=(1, 8), rounds=2)
    r8 = rows[1]
    assert r8["measured_rounds"] == pytest.approx([2.5 / 0.6, 1 / 0.6])
    assert r8["measured_speedup"] == pytest.approx(3.5 / 1.2) and r8["measured_spread"] == pytest.approx(1.5)


# --- one recommendation ----------------------------------------------------------------------------


def chain_prediction(spread: float = 0.0, plain: float = 1.0):
    costs = StepCosts(target_s={1: 1.0, 4: 1.2, 9: 1.6}, draft_per_level_s=0.05, plain_step_s=plain, spread=spread)
    return predict([0.7, 0.6, 0.5], costs, ks=range(1, 6))


def test_prediction_rows_carry_their_band_and_an_uncertain_advice_says_so():
    pred = chain_prediction(spread=0.3, plain=0.75)
    best = pred.best_chain()
    assert best["speedup_low"] == pytest.approx(best["speedup"] / 1.3)
    assert best["speedup_high"] == pytest.approx(best["speedup"] * 1.3)
    adv = advice(pred)
    assert pred.verdict() == "uncertain" and adv["speculate"] and "uncertain" in adv["uncertain"]
    assert "[uncertain: predicted" in advice_summary(adv)
    assert pred.to_dict()["verdict"] == "uncertain"


def metrics_with(measured_speedup: float, by: dict | None = None) -> dict:
    """A chain eval's metrics whose prediction turns speculation off (plain step much cheaper)."""
    pred = chain_prediction(plain=0.6)
    adv = advice(pred)
    assert adv["speculate"] is False
    if by is not None:
        adv["by_concurrency"] = by
    return {"k": 3, "batch_size": 1, "speculative": {"measured_speedup": measured_speedup},
            "prediction": pred.to_dict(), "advice": adv}


def by_concurrency():
    return {"rows": [{"batch_size": 1, "best_k": 2, "best_speedup": 1.1}, {"batch_size": 8, "best_k": 0, "best_speedup": 1.0}],
            "vllm_num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 8, 0]]}


def test_settle_keeps_speculation_on_where_eval_measured_it_faster():
    from specheads.eval.recommend import settle

    m = metrics_with(1.2, by_concurrency())
    rec = settle(m)
    adv = m["advice"]
    assert rec["speculate"] and rec["k"] == 3 and adv["vllm"]["num_speculative_tokens"] == 3
    assert "measured 1.20x at k=3" in rec["note"] and "reason" not in adv
    assert rec["vllm_num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 8, 0]]  # batch 1's band is the headline
    off = metrics_with(0.9, by_concurrency())
    assert settle(off)["k"] == 0
    assert off["advice"]["by_concurrency"]["vllm_num_speculative_tokens_per_batch_size"] == [[1, 1, 0], [2, 8, 0]]
    assert settle({"advice": None}) is None


def test_one_recommendation_in_report_readme_serve_commands_terminal_and_card(tmp_path):
    """The issue's run printed k = 5, serve commands with 3 and a card with another schedule: after
    `settle` every reader shows the one k and the one schedule."""
    from specheads.demo import recommendation_lines
    from specheads.eval.recommend import settle
    from specheads.eval.report import attach_to_export, write_report
    from specheads.export.readme import serve_commands
    from specheads.hub import metrics_section

    pred = chain_prediction(plain=1.0)
    adv = advice(pred)
    adv["by_concurrency"] = {"rows": [{"batch_size": 1, "best_k": 6, "best_speedup": 1.3},
                                      {"batch_size": 8, "best_k": 3, "best_speedup": 1.1}],
                             "vllm_num_speculative_tokens_per_batch_size": [[1, 1, 6], [2, 8, 3]]}
    m = {"k": 3, "batch_size": 1, "tau": 2.0, "speculative": {"measured_speedup": 1.3, "acceptance_per_position": [0.7]},
         "prediction": pred.to_dict(), "advice": adv, "provenance": {}}
    k = settle(m)["k"]
    assert k == pred.best_chain()["k"] != 3
    schedule = [[1, 1, k], [2, 8, 3]]
    assert adv["recommended"]["vllm_num_speculative_tokens_per_batch_size"] == schedule
    export = tmp_path / "export"
    export.mkdir()
    from specheads.engine_facts import sglang_chain_flags
    from specheads.export.readme import TargetRef

    target = TargetRef("t", None, "/models/t", [])
    vllm_cmds = serve_commands("vllm", "/exp", target, 3, "eagle3")
    assert all('"num_speculative_tokens":3' in c for c in vllm_cmds)
    readme = "# Draft\n\n## Serve\n\n```bash\n" + "\n\n".join(vllm_cmds) + "\n\n" + \
        f"python -m sglang.launch_server --model-path t --speculative-algorithm EAGLE3 {sglang_chain_flags(3)}\n```\n"
    (export / "README.md").write_text(readme)
    write_report(tmp_path / "eval", m)
    attach_to_export(export, tmp_path / "eval")
    text = (export / "README.md").read_text()
    report = (tmp_path / "eval" / "report.md").read_text()
    assert f'"num_speculative_tokens":{k}' in text and '"num_speculative_tokens":3' not in text
    assert sglang_chain_flags(k) in text and sglang_chain_flags(3) not in text
    for doc in (text, report):
        assert f'`"num_speculative_tokens": {k}`' in doc and f"{schedule}" in doc
    terminal = "\n".join(recommendation_lines(adv))
    assert f"num_speculative_tokens={k}" in terminal and f"{schedule}" in terminal
    card = "\n".join(metrics_section(m))
    assert f"num_speculative_tokens={k}" in card


def test_eval_methods_take_turns_in_blocks_above_batch_one():
    """eval/waves.py: one block per method over every prompt let a GPU shared with training jobs
    time plain decoding 4.5x slower per step than prompt lookup (bench/results/real_model_gpu.md)."""
    from specheads.eval.waves import BLOCK_BATCHES, blocks

    assert blocks(list(range(3)), 1) == [[0], [1], [2]] and blocks([], 8) == []
    assert [len(b) for b in blocks(list(range(70)), 16)] == [32, 32, 6] and BLOCK_BATCHES == 2
    assert sum(blocks(list(range(70)), 16), []) == list(range(70))  # in order, every row once


def test_the_demo_table_shows_the_settled_k_per_batch_size():
    """The demo's concurrency table prints the best k per batch size as the eval settled it (batch 1's
    band is the headline k), not the table's own second opinion."""
    from specheads.demo import settled
    from specheads.eval.concurrency import markdown

    row = {"batch_size": 1, "prompts": 2, "tokens": 10, "plain_tok_s": 10.0, "spec_tok_s": 12.0, "plain_s": 1.0,
           "spec_s": 0.8, "measured_speedup": 1.25, "measured_speedup_wall": 1.2, "measured_rounds": [1.2, 1.3],
           "predicted_speedup": 1.2, "within_10pct": True, "greedy_equal": 2}
    table = {"k": 3, "rounds": 2, "rows": [row], "vllm_num_speculative_tokens_per_batch_size": [[1, 1, 4]],
             "best_k": [{"batch_size": 1, "best_k": 4, "best_speedup": 1.3}], "costs": {}}
    metrics = {"advice": {"by_concurrency": {"rows": [{"batch_size": 1, "best_k": 5, "best_speedup": 1.35}],
                                             "vllm_num_speculative_tokens_per_batch_size": [[1, 1, 5]]}}}
    text = markdown(settled(table, metrics))
    assert "| 5 (1.35x) |" in text and "[[1, 1, 5]]" in text and "[[1, 1, 4]]" not in text
    assert "1.25x (1.20-1.30x)" in text and "2 interleaved rounds" in text
    assert settled(table, {"advice": None}) is table


def test_a_band_the_run_confirmed_is_decided_without_the_micro_timings_spread():
    """bench/results/concurrency_demo_saturated.md: batch 1 predicted 0.53x at k = 3 and measured 0.54x,
    yet noisy micro-timings made k = 2's 1.03x 'uncertain' (0.35x to 3.03x) and kept speculation on."""
    from specheads.eval.concurrency import trust_confirmed

    band = {"batch_size": 1, "best_k": 2, "best_speedup": 1.03, "top_k": 2, "top_speedup": 1.03,
            "speedup_low": 0.35, "speedup_high": 3.03, "verdict": "uncertain"}
    gaining = {**band, "batch_size": 8, "top_speedup": 1.2, "best_speedup": 1.2}
    out = trust_confirmed([band, gaining], confirmed={1, 8})
    assert out[0]["best_k"] == 0 and out[0]["verdict"] == "off" and out[0]["confirmed"]
    assert out[1]["best_k"] == 2 and out[1]["verdict"] == "on"
    assert trust_confirmed([band], confirmed=set()) == [band]  # not confirmed: still uncertain, kept on
    # and a measured speed-up still wins over a confirmed off
    assert keep_measured(out, {1: (3, 1.1)})[0]["best_k"] == 3
