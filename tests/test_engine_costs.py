"""eval/engine_costs.py: the drafter priced at llama.cpp's own measured cost curve."""

from __future__ import annotations

import json

import pytest

from specheads.eval.engine_costs import EngineCostError, add_llamacpp_prediction, llamacpp_prediction, read_llamacpp_cost


def cost_file(tmp_path, t_ms, fixed=0.0, per=0.0, plain=10.0, **extra):
    path = tmp_path / "llamacpp_cost.json"
    curve = {"t_ms": {str(n): ms for n, ms in t_ms.items()}, "plain_step_ms": plain, "draft_fixed_ms": fixed,
             "draft_per_token_ms": per, **extra}
    path.write_text(json.dumps({"version": "0.5.0-dev", "quantization": "Q4_1", "threads": 2, "curve": curve}))
    return path


def test_linear_verification_means_no_speculation(tmp_path):
    """v(n) = n (what llama.cpp measured on SmolLM2 Q4_1, nearly): even a draft that is always accepted
    costs as much as the plain steps it saves, plus the drafter: speculation is never advised."""
    cost = read_llamacpp_cost(cost_file(tmp_path, {n: 10.0 * n for n in range(1, 6)}, per=1.4))
    pred = llamacpp_prediction([1.0, 1.0, 1.0, 1.0], cost, ks=(1, 2, 3, 4))
    # k=1: 2 tokens for t(2) + c = 20 + 1.4 ms -> 2 * 10 / 21.4
    assert pred["speedup_by_k"][1] == pytest.approx(20.0 / 21.4)
    assert not pred["speculate"] and pred["use"] == "no speculation" and pred["v"][3] == pytest.approx(3.0)
    assert pred["c"] == pytest.approx(0.14) and pred["measured_in"]["quantization"] == "Q4_1"


def test_flat_verification_advises_the_best_k(tmp_path):
    """A flat t(n) (a GPU-like curve): the golden speed-up per k, and the advised --spec-draft-n-max."""
    cost = read_llamacpp_cost(cost_file(tmp_path, dict.fromkeys(range(1, 6), 10.0), fixed=0.5, per=1.0))
    pred = llamacpp_prediction([0.8, 0.5], cost, ks=(1, 2, 3))
    # E tokens: k=1: 1.8; k=2: 1 + 0.8 + 0.4 = 2.2; k=3: 2.2 + 0.2 = 2.4 (position 3 repeats 0.5)
    assert pred["speedup_by_k"][1] == pytest.approx(1.8 * 10 / 11.5)
    assert pred["speedup_by_k"][2] == pytest.approx(2.2 * 10 / 12.5)
    assert pred["speedup_by_k"][3] == pytest.approx(2.4 * 10 / 13.5)
    assert pred["speculate"] and pred["best_k"] == 2 and pred["use"] == "--spec-draft-n-max 2"


def test_the_advice_names_what_llama_cpp_runs(tmp_path):
    cost = read_llamacpp_cost(cost_file(tmp_path, dict.fromkeys(range(1, 6), 10.0), per=1.0))
    metrics = {"speculative": {"acceptance_per_position_conditional": [0.9, 0.8, 0.7]},
               "advice": {"engines": {"llama.cpp": {"use": "draftless + draft", "flags": "x"}}}}
    add_llamacpp_prediction(metrics, cost, "eagle3", "vllm")
    entry = metrics["advice"]["engines"]["llama.cpp"]
    k = metrics["llamacpp"]["best_k"]
    assert entry["use"] == "drafter" and entry["flags"] == f"--spec-type draft-eagle3 --spec-draft-n-max {k}"
    assert entry["curve_from"] == str(tmp_path / "llamacpp_cost.json") and entry["predicted_speedup"] > 1.05
    other = {"speculative": {"acceptance_per_position_conditional": [0.9]}}
    add_llamacpp_prediction(other, cost, "medusa", "vllm")
    assert "llama.cpp runs no medusa drafter" in other["llamacpp"]["skipped"]


def test_bad_cost_files_are_named(tmp_path):
    with pytest.raises(EngineCostError, match="does not exist: write it with `python bench/llamacpp.py --cost"):
        read_llamacpp_cost(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(EngineCostError, match="bad.json' is not readable JSON"):
        read_llamacpp_cost(tmp_path / "bad.json")
    (tmp_path / "nocurve.json").write_text("{}")
    with pytest.raises(EngineCostError, match='has no "curve" object'):
        read_llamacpp_cost(tmp_path / "nocurve.json")
    path = cost_file(tmp_path, {1: 10.0})
    data = json.loads(path.read_text())
    del data["curve"]["draft_per_token_ms"]
    path.write_text(json.dumps(data))
    with pytest.raises(EngineCostError, match='"curve" lacks draft_per_token_ms'):
        read_llamacpp_cost(path)
    with pytest.raises(EngineCostError, match="not usable"):
        read_llamacpp_cost(cost_file(tmp_path, {1: -1.0}))
