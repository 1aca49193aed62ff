"""Speed-up prediction: golden values of the acceptance models, the cost model, the advice."""

from __future__ import annotations

import itertools
import math

import pytest

from specheads.eval.predict import (
    PredictError,
    StepCosts,
    advice,
    best_tree,
    expected_tokens_chain,
    expected_tokens_tree,
    measure_costs,
    monotone,
    predict,
    rank_acceptance,
    simulated_tau,
)
from specheads.metrics import predicted_speedup


def test_chain_matches_the_seed_formula_for_constant_acceptance():
    a, c = 0.7, 0.1
    costs = StepCosts(target_s={1: 1.0}, draft_per_level_s=c)  # flat target cost, c per draft token
    pred = predict([a], costs, ks=range(1, 7), budgets=())
    for row in pred.chains:
        k = row["k"]
        assert row["expected_tokens"] == pytest.approx((1 - a ** (k + 1)) / (1 - a))
        assert row["speedup"] == pytest.approx(predicted_speedup(a, k, c))


def test_chain_uses_position_dependent_acceptance():
    cond = [0.8, 0.5, 0.25]
    assert expected_tokens_chain(cond, 1) == pytest.approx(1.8)
    assert expected_tokens_chain(cond, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    # past the measured positions the last conditional value repeats
    assert expected_tokens_chain(cond, 4) == pytest.approx(1 + 0.8 + 0.4 + 0.1 + 0.025)
    with pytest.raises(PredictError, match="no per-position acceptance"):
        expected_tokens_chain([], 2)


def test_tree_expectation_sums_path_probabilities():
    q = rank_acceptance([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]], depth=2)
    assert [v for row in rank_acceptance([[0.6, 0.1, 0.2]], depth=3) for v in row] == pytest.approx([0.6, 0.15, 0.15] * 3)
    with pytest.raises(PredictError, match="per-rank"):
        rank_acceptance([], depth=2)
    choices = [(0,), (1,), (0, 0)]
    assert expected_tokens_tree(choices, q) == pytest.approx(1 + 0.6 + 0.2 + 0.6 * 0.5)
    # a chain written as a tree gives the chain's number
    assert expected_tokens_tree([(0,), (0, 0)], q) == pytest.approx(expected_tokens_chain([0.6, 0.5], 2))


def _brute_force_best(q, budget):
    """Every rooted sub-tree of the width-2, depth-3 full tree with budget-1 nodes."""
    nodes = [p for d in range(1, 4) for p in itertools.product(range(2), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(nodes, budget - 1):
        chosen = set(subset)
        closed = all(p[:-1] in chosen or len(p) == 1 for p in chosen)
        if closed:
            best = max(best, expected_tokens_tree(chosen, q))
    return best


@pytest.mark.parametrize("budget", [2, 4, 6])
def test_greedy_tree_is_optimal(budget):
    q = rank_acceptance([[0.7, 0.18], [0.4, 0.36], [0.6, 0.24]], depth=3)
    paths, value = best_tree(q, budget)
    assert len(paths) == budget - 1
    assert value == pytest.approx(expected_tokens_tree(paths, q))
    assert value == pytest.approx(_brute_force_best(q, budget))


def test_cost_model_interpolates_and_prefers_the_cheap_length():
    costs = StepCosts(target_s={1: 1.0, 5: 2.0, 9: 6.0}, draft_fixed_s=0.1, draft_per_level_s=0.05)
    assert costs.target(3) == pytest.approx(1.5)
    assert costs.target(13) == pytest.approx(10.0)  # linear past the last measured count
    assert costs.step(4, 3) == pytest.approx(1.75 + 0.1 + 0.15)
    pred = predict([0.9], costs, ks=range(1, 9), budgets=(8,), rank_q=[[0.9, 0.05]])
    assert pred.trees and predict([0.9], costs, ks=range(1, 9), budgets=(8,)).trees == []  # none unmeasured
    # verification gets expensive past 5 tokens: the best chain stops before it
    assert pred.best_chain()["k"] == 4
    adv = advice(pred)
    assert adv["vllm"]["num_speculative_tokens"] == 4
    assert adv["sglang"] == {**adv["sglang"], "speculative_num_steps": 4, "speculative_eagle_topk": 1,
                             "speculative_num_draft_tokens": 5}


def test_monotone_fit_removes_timing_noise():
    assert monotone([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert monotone([1.0, 2.0]) == [1.0, 2.0]


def test_simulated_tau_grows_with_k_and_budget():
    sim = simulated_tau([0.7, 0.6, 0.5], ks=range(1, 5), budgets=(4, 16),
                        rank_q=[[0.7, 0.15, 0.05], [0.6, 0.2, 0.1], [0.5, 0.2, 0.1]])
    assert simulated_tau([0.7], ks=range(1, 5), budgets=(4,))["tree"] == {}
    chain = [sim["chain"][str(k)] for k in range(1, 5)]
    assert chain == sorted(chain) and chain[0] == pytest.approx(1.7)
    assert sim["tree"]["4"] >= chain[2] - 1e-9  # the best 4-token tree is at least the chain of 3
    assert sim["tree"]["16"] > sim["tree"]["4"]


def test_measure_costs_on_a_real_target():
    from random_models import make_head, make_target

    target = make_target()
    head = make_head(target)
    costs = measure_costs(target, head, [[1, 2, 3, 4, 5, 6]], k_max=3, max_new_tokens=8,
                          max_nodes=8, reps=2)
    counts = sorted(costs.target_s)
    assert counts[0] == 1 and counts[-1] == 8
    times = [costs.target_s[n] for n in counts]
    assert all(t > 0 for t in times) and times == sorted(times)
    assert costs.draft_per_level_s >= 0 and costs.plain() > 0
    pred = predict([0.5, 0.4], costs, ks=(1, 2, 3), budgets=(4,))
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in pred.chains)


def test_prediction_skips_prompts_without_room_for_the_timed_forwards():
    from random_models import make_head, make_target

    from specheads.eval.predict import TARGET_COUNTS, prediction_metrics

    target = make_target()
    head = make_head(target)
    ctx = target.config.max_position_embeddings
    too_long = [1] * (ctx - max(TARGET_COUNTS))  # one token short of the room the timings need
    assert prediction_metrics(target, head, [too_long], [0.5, 0.4], k_max=2) == {}


def _prediction(speedups: dict[int, float]):
    from specheads.eval.predict import Prediction

    return Prediction(chains=[{"k": k, "nodes": k + 1, "expected_tokens": 1.0 + k / 2, "step_s": 1.0,
                               "speedup": s} for k, s in speedups.items()])


def test_recommended_k_is_stable_under_timing_noise():
    """Near-equal lengths swap the arg-max between runs; the recommendation must not follow."""
    import random

    from specheads.eval.predict import NEAR_TIE

    rng = random.Random(0)
    base = {1: 1.10, 2: 1.30, 3: 1.31, 4: 1.30, 5: 1.25, 6: 1.1}
    picks = set()
    for _ in range(200):
        noisy = {k: s * (1 + rng.uniform(-NEAR_TIE / 3, NEAR_TIE / 3)) for k, s in base.items()}
        picks.add(_prediction(noisy).best_chain()["k"])
    assert picks == {2}
    # a clear winner still wins
    assert _prediction({1: 1.1, 2: 1.2, 3: 1.5, 4: 1.3}).best_chain()["k"] == 3


def test_no_speculation_recommended_when_nothing_beats_plain_decoding():
    from specheads.eval.predict import advice, advice_summary
    from specheads.eval.report import advice_lines, prediction_table

    pred = _prediction({1: 0.79, 2: 0.95, 3: 1.02, 4: 0.9})
    adv = advice(pred)
    assert adv["speculate"] is False and adv["best_chain"]["k"] == 3
    assert "vllm" not in adv and "sglang" not in adv
    assert advice_summary(adv).startswith("no speculation")
    text = "\n".join(advice_lines(adv))
    assert "No speculation" in text and "num_speculative_tokens" not in text
    d = pred.to_dict()
    d["costs"] = {"plain_step_s": 1.0, "target_s": {"1": 1.0}}
    assert not any("(recommended)" in line for line in prediction_table(d))
    # one chain predicted clearly faster: recommended, and marked once in the table
    good = _prediction({1: 0.9, 2: 1.2})
    assert advice(good)["speculate"] is True and advice(good)["vllm"]["num_speculative_tokens"] == 2
    gd = {**good.to_dict(), "costs": {"plain_step_s": 1.0, "target_s": {"1": 1.0}}}
    assert sum("(recommended)" in line for line in prediction_table(gd)) == 1


def test_model_card_never_recommends_a_slowdown(tmp_path):
    import json

    from specheads.eval.predict import advice
    from specheads.hub import model_card

    folder = tmp_path / "export"
    (folder / "eval").mkdir(parents=True)
    (folder / "specheads.json").write_text(json.dumps({"kind": "eagle3", "format": "vllm"}))
    pred = _prediction({1: 0.79, 2: 0.7})
    metrics = {"greedy_equal": True, "tau": 1.4, "num_prompts": 2, "prediction": pred.to_dict(),
               "advice": advice(pred), "speculative": {"acceptance_per_position": [0.4]}}
    (folder / "eval" / "metrics.json").write_text(json.dumps(metrics))
    card = model_card(folder, license_id="apache-2.0")
    assert "no speculation" in card and "0.79x" in card and "num_speculative_tokens=" not in card


def test_eval_headline_uses_the_one_prediction():
    from specheads.eval.online import use_prediction

    pred = _prediction({1: 1.2, 2: 1.4, 3: 1.35})
    metrics = {"k": 3, "predicted_speedup": 9.9, "speculative": {"predicted_speedup": 9.9},
               "prediction": pred.to_dict()}
    use_prediction(metrics)
    assert metrics["predicted_speedup"] == metrics["speculative"]["predicted_speedup"] == 1.35
def test_rank_acceptance_is_measured_by_the_offline_pass():
    """The EAGLE-3 head counts, per draft step, the rank of the target's token among its
    candidates; rank 0 is exactly the chain's conditional acceptance, ranks sum to at most 1,
    and the counts equal a direct recount from the head's own step logits."""
    import types

    import torch
    from random_models import make_head, make_target

    from specheads.data.tokenize import TokenizedSample
    from specheads.eval.offline import offline_acceptance

    target = make_target()
    target.tokenizer = types.SimpleNamespace(pad_token_id=0)  # the random target has ids only
    head = make_head(target)
    torch.manual_seed(0)
    samples = [TokenizedSample(str(n), torch.randint(3, 60, (24,)).tolist(), [0] * 6 + [1] * 18) for n in range(3)]
    acc = offline_acceptance(target, head, samples)
    q = acc["rank_acceptance"]
    assert len(q) == head.config.ttt_steps and all(len(row) == 8 for row in q)
    for row, cond in zip(q, acc["acc_cond"]):
        assert row[0] == pytest.approx(cond) and sum(row) <= 1 + 1e-9
    assert sum(q[0][1:]) > 0  # siblings do get accepted: the measurement is not the top-1 alone


# --- step mixes (eval/mixes.py) ------------------------------------------------------------------


def mix_stats(steps: dict[int, int], tokens: int, **timing):
    from specheads.verify.steps import DecodeStats

    return DecodeStats(decode_forwards=sum(steps.values()), decode_tokens=tokens, steps_by_nodes=dict(steps), **timing)


def test_a_step_mix_is_priced_by_the_cost_curve():
    """10 ms plain step; 2 plain steps + 3 steps verifying 4 tokens (12 ms each), 1 ms overhead, 6 model
    levels at 2 ms and 3 drafted steps at 1 ms, 0.5 ms of free proposer per step:
    2*10 + 3*12 + 5*(1 + 0.5) + 6*2 + 3*1 = 78.5 ms for 11 tokens, plain 110 ms -> 1.401x."""
    from specheads.eval.mixes import row_speedup

    costs = StepCosts({1: 0.010, 4: 0.012}, draft_fixed_s=0.001, draft_per_level_s=0.002, overhead_s=0.001,
                      plain_step_s=0.010)
    stats = mix_stats({1: 2, 4: 3}, 11)
    assert row_speedup(costs, stats, None, levels=6, model_steps=3, free_step_s=0.0005) == pytest.approx(110 / 78.5)
    plain = mix_stats({1: 5}, 5)
    assert row_speedup(StepCosts({1: 0.010}, plain_step_s=0.010), plain, plain) == pytest.approx(1.0)  # plain: plain
    # a decode that measured its proposer's seconds (9 ms here) is priced with them instead of the levels:
    # 2*10 + 3*12 + 5*1 + 9 = 70 ms for the same 11 tokens
    measured = mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009)
    assert row_speedup(costs, measured, None, levels=6, model_steps=3, free_step_s=0.0005) == pytest.approx(110 / 70)


def scaled_costs(costs: StepCosts, factor: float) -> StepCosts:
    """`costs` as a pass running `factor` times slower would have measured them."""
    return StepCosts({n: s * factor for n, s in costs.target_s.items()}, costs.draft_fixed_s * factor,
                     costs.draft_per_level_s * factor, costs.overhead_s * factor, costs.plain_step_s * factor)


def test_a_pass_slowed_as_a_whole_moves_no_prediction():
    """The costs' pass (10 ms one-token forward) and the timed pass (plain: 100 forwards in 1 s, 10 ms) agree;
    the row spent 9 ms in its proposer: 2*10 + 3*12 + 5*1 + 9 = 70 ms for 11 tokens of 10.5 ms -> 1.65x.
    A first pass 20% slower (every cost x1.2) or a timed pass 20% slower (the row's proposer and plain's
    forwards x1.2) leave it there; the proposer's seconds taken as they are (no time base, the old
    prediction) moved it to 11 * 12.6 / (1.2 * 61 + 9) ms = 1.686x."""
    from specheads.eval.mixes import row_speedup, time_base

    costs = StepCosts({1: 0.010, 4: 0.012}, draft_fixed_s=0.001, draft_per_level_s=0.002, overhead_s=0.001,
                      plain_step_s=0.0105)
    slow_first = scaled_costs(costs, 1.2)
    row = mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009)
    plain = mix_stats({1: 100}, 100, target_decode_s=1.0)
    assert row_speedup(costs, row, plain) == pytest.approx(11 * 10.5 / 70)
    assert time_base(slow_first, plain) == pytest.approx(1.2) and time_base(costs, plain) == pytest.approx(1.0)
    assert row_speedup(slow_first, row, plain) == pytest.approx(11 * 10.5 / 70)
    slow_row = mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009 * 1.2)
    slow_plain = mix_stats({1: 100}, 100, target_decode_s=1.2)
    assert row_speedup(costs, slow_row, slow_plain) == pytest.approx(11 * 10.5 / 70)
    assert row_speedup(slow_first, row, None) == pytest.approx(11 * 12.6 / (1.2 * 61 + 9))  # one time base lost
    assert row_speedup(slow_first, row, None) > 1.02 * row_speedup(slow_first, row, plain)
    # priced proposers (no measured seconds) are in the costs' own base already: the time base leaves them
    priced = mix_stats({1: 2, 4: 3}, 11)
    assert row_speedup(slow_first, priced, slow_plain, levels=6) == pytest.approx(11 * 10.5 / (61 + 12))


def test_eval_hybrid_rows_price_in_the_timed_pass_time_base():
    """eval's rows (`mix_metrics`): the rows' plain decodes are the time base at batch 1, so a first pass
    20% slower predicts the same; above batch 1 (shared forwards: no batch-1 forward timed) none is used."""
    from specheads.eval.mixes import MixTally, RowCosts, mix_metrics

    costs = StepCosts({1: 0.010, 4: 0.012}, overhead_s=0.001, plain_step_s=0.0105)
    tallies = {"hybrid": MixTally(stats=mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009, wall_s=0.08))}
    plain = mix_stats({1: 100}, 100, target_decode_s=1.0, wall_s=1.1)

    def predicted(c, batch_size):
        rows = mix_metrics(tallies, plain, RowCosts.same(c), "suffix", None, None, batch_size=batch_size)
        return rows["hybrid"]["predicted_speedup"]

    assert predicted(scaled_costs(costs, 1.2), 1) == pytest.approx(predicted(costs, 1)) == pytest.approx(11 * 10.5 / 70)
    assert predicted(scaled_costs(costs, 1.2), 2) == pytest.approx(11 * 12.6 / (1.2 * 61 + 9))


def test_in_situ_costs_replace_the_micro_timings_where_the_decodes_met_them():
    """Plain decodes met 1 token at 8 ms (not the micro 10), the draft's 4 tokens at 15 ms (micro 12);
    2 tokens (unmet) keep the micro curve scaled by the nearest met count's ratio (8/10); the drafter's
    per-step part = (0.5 s - 2 ms * 100 levels) / 50 steps = 6 ms; overhead = the draft's rest per step."""
    from specheads.eval.mixes import in_situ_costs
    from specheads.verify.adaptive_proposers import LengthCosts

    micro = StepCosts({1: 0.010, 2: 0.011, 4: 0.012}, draft_fixed_s=0.001, draft_per_level_s=0.002,
                      overhead_s=0.003, plain_step_s=0.011)
    plain = mix_stats({1: 100}, 100, wall_s=0.9, target_prefill_s=0.1)
    plain.target_s_by_nodes = {1: 0.8}
    draft = mix_stats({4: 50}, 150, wall_s=1.5, target_prefill_s=0.1, target_decode_s=0.75, proposer_s=0.5,
                      proposed_tokens=100)
    draft.target_s_by_nodes = {4: 0.75}
    costs = in_situ_costs(micro, plain, draft)
    assert costs.target_s == pytest.approx({1: 0.008, 2: 0.011 * 0.8, 4: 0.015})
    assert costs.draft_fixed_s == pytest.approx(0.006) and costs.draft_per_level_s == 0.002
    assert costs.overhead_s == pytest.approx((1.5 - 0.1 - 0.75 - 0.5) / 50) and costs.plain_step_s == pytest.approx(0.008)
    lengths = LengthCosts.from_step_costs(costs, 3)
    assert lengths.verify[0] == 1.0 and lengths.verify[3] == pytest.approx((0.015 + 0.003) / 0.008)
    assert lengths.draft == pytest.approx(0.25) and lengths.fixed == pytest.approx(0.75)
    few = mix_stats({1: 3}, 3, wall_s=1.0)  # fewer than MIN_STEPS: nothing measured, the micro costs stay
    assert in_situ_costs(micro, few, mix_stats({}, 0)) is micro


def first_pass_by_family():
    """Micro curve 10 / 11 / 12 ms at 1 / 2 / 4 tokens; the first pass's plain decodes met 1 token at 8 ms,
    the drafter's 4 tokens at 15 ms (its forward between target forwards slows them), the free proposer's
    1 token at 8 ms and 4 tokens at 13 ms; the drafter's decodes leave 1 ms of loop per step, plain's step
    is 8 ms."""
    micro = StepCosts({1: 0.010, 2: 0.011, 4: 0.012}, draft_fixed_s=0.001, draft_per_level_s=0.002,
                      overhead_s=0.003, plain_step_s=0.011)
    plain = mix_stats({1: 100}, 100, wall_s=0.9, target_prefill_s=0.1, target_decode_s=0.8,
                      target_s_by_nodes={1: 0.8})
    draft = mix_stats({4: 50}, 150, wall_s=1.4, target_prefill_s=0.1, target_decode_s=0.75, proposer_s=0.5,
                      proposed_tokens=100, target_s_by_nodes={4: 0.75})
    free = mix_stats({1: 60, 4: 40}, 180, wall_s=1.1, target_prefill_s=0.1, target_decode_s=1.0, proposer_s=0.01,
                     proposed_tokens=150, target_s_by_nodes={1: 0.48, 4: 0.52})
    return micro, plain, draft, free


def test_each_row_family_is_priced_by_its_own_first_pass_decodes():
    """The drafter's curve: 15 ms at 4 tokens met, the micro curve x 15/12 elsewhere (12.5 ms at 1); the free
    curve: 8 ms at 1, 13 at 4, 11 x 8/10 at 2 (nearest met: 1); plain's: 8 ms at 1, the micro x 0.8 elsewhere.
    A row of 2 one-token and 3 four-token steps (11 tokens, 9 ms in its proposer, plain's time base: 1.0):
    running the drafter 2*12.5 + 3*15 + 5*1 + 9 = 84 ms, free 2*8 + 3*13 + 5 + 9 = 69 ms, against 11 * 8 ms
    plain. The blended curve (14.11 ms at 4 tokens over all 90 steps) priced both 72.3 ms."""
    from specheads.eval.mixes import MixTally, family, in_situ_costs, mix_metrics, row_costs, row_speedup

    micro, plain, draft, free = first_pass_by_family()
    rows = row_costs(micro, plain, draft, free)
    assert rows.model.target_s == pytest.approx({1: 0.0125, 2: 0.01375, 4: 0.015})
    assert rows.free.target_s == pytest.approx({1: 0.008, 2: 0.0088, 4: 0.013})
    assert rows.plain.target_s == pytest.approx({1: 0.008, 2: 0.0088, 4: 0.0096})
    for costs in (rows.plain, rows.model, rows.free):  # only the target curve differs between families
        assert (costs.overhead_s, costs.plain_step_s, costs.draft_fixed_s) == pytest.approx((0.001, 0.008, 0.006))
    assert [family(r) for r in ("plain", "eagle3", "hybrid", "union", "adaptive", "ngram", "suffix")] == [
        "plain", "model", "model", "model", "model", "free", "free"]
    row = mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009)
    timed_plain = mix_stats({1: 100}, 100, target_decode_s=0.8)  # the row's own pass: 8 ms forwards, base 1.0
    assert rows.speedup("adaptive", row, timed_plain) == pytest.approx(88 / 84)
    assert rows.speedup("union", row, timed_plain) == pytest.approx(88 / 84)
    assert rows.speedup("suffix", row, timed_plain) == pytest.approx(88 / 69)
    blended = in_situ_costs(micro, plain, draft, free)
    assert blended.target(4) == pytest.approx(1.27 / 90)
    assert row_speedup(blended, row, timed_plain) == pytest.approx(88 / (16 + 3 * 1270 / 90 + 5 + 9))
    assert abs(row_speedup(blended, row, timed_plain) / rows.speedup("hybrid", row, timed_plain) - 1) > 0.1
    # eval's rows go through the same rule: the hybrid row by the drafter's curve
    tallies = {"hybrid": MixTally(stats=mix_stats({1: 2, 4: 3}, 11, proposer_s=0.009, wall_s=0.08))}
    metrics = mix_metrics(tallies, timed_plain, rows, "suffix", None, None)
    assert metrics["hybrid"]["predicted_speedup"] == pytest.approx(88 / 84)


def test_row_costs_fall_back_to_the_blend_where_a_family_met_nothing():
    """Free decodes absent (or below MIN_STEPS per count): free rows take the blended costs; no decode met
    anything: every family keeps the micro-timed costs."""
    from specheads.eval.mixes import in_situ_costs, row_costs

    micro, plain, draft, _ = first_pass_by_family()
    rows = row_costs(micro, plain, draft)
    assert rows.free == in_situ_costs(micro, plain, draft) and rows.model.target(4) == pytest.approx(0.015)
    few = mix_stats({4: 3}, 9, target_s_by_nodes={4: 0.1})
    assert row_costs(micro, plain, draft, few).free.target_s == in_situ_costs(micro, plain, draft, few).target_s
    nothing = row_costs(micro, mix_stats({1: 3}, 3, wall_s=1.0), mix_stats({}, 0))
    assert nothing.plain is nothing.model is nothing.free is micro

def test_engine_advice_names_each_engines_faster_setting():
    from specheads.eval.mixes import engine_advice

    metrics = {"predicted_speedup": 1.3, "suffix": {"predicted_speedup": 1.7}, "ngram": {"predicted_speedup": 1.2},
               "hybrid": {"predicted_speedup": 1.5}, "union": {"predicted_speedup": 1.4},
               "adaptive": {"predicted_speedup": 1.8}}
    adv = engine_advice(metrics, "eagle3", "vllm")
    assert adv["vllm"]["use"] == "suffix" and "suffix" in adv["vllm"]["flags"] and adv["vllm"]["engine"] == "vLLM 0.33"
    assert adv["sglang"]["use"] == "drafter" and adv["sglang"]["flags"] is None and adv["sglang"]["predicted_speedup"] == 1.3
    assert adv["llama.cpp"]["flags"].endswith(",draft-eagle3") and adv["specheads"]["use"] == "adaptive"
    assert engine_advice(metrics, "medusa", "sglang")["llama.cpp"]["use"] == "draftless"  # no GGUF draft for it
