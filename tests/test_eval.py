"""`specheads eval`: prompts file -> metrics.json + outputs.jsonl on a real tiny target folder."""

from __future__ import annotations

import json
import shutil

import pytest

from specheads.cli import main as cli
from specheads.data.prompts import encode_chat
from specheads.eval.offline import samples_from_outputs
from specheads.eval.online import alpha_from_tau, evaluate
from specheads.target import Target, TargetError


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir):
    return tiny_target_dir


@pytest.fixture(scope="module")
def export_dir(random_export_dir):
    return random_export_dir


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": "p1", "prompt": "def add(a, b):"},
            {"id": "mt1", "category": "writing", "turns": ["import os", "and then?"]},
            {"id": "long", "prompt": "x = 1\n" * 300}]  # longer than the 256-token context
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_writes_metrics_and_outputs(target_dir, export_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    cost = tmp_path / "llamacpp_cost.json"  # llama.cpp's measured curve: verification linear in n (a CPU)
    cost.write_text(json.dumps({"version": "v", "quantization": "Q4_1", "threads": 2, "curve": {
        "t_ms": {str(n): 5.0 * n for n in range(1, 5)}, "plain_step_ms": 5.0, "draft_fixed_ms": 1.0,
        "draft_per_token_ms": 0.7}}))
    rc = cli(["eval", "--target", str(target_dir), "--draft", str(export_dir), "--prompts",
              str(prompts_file), "--out", str(out), "--max-new-tokens", "12", "--k", "2", "--llamacpp-cost", str(cost)])
    printed = capsys.readouterr().out
    assert rc == 0 and "tau=" in printed
    # the demo's table, every row: the drafter, the free proposers, the hybrid rows
    assert "specheads eval: 3 prompts, k=2" in printed and "n-gram (prompt lookup)" in printed
    assert "acceptance per position" in printed and "hybrid choose" in printed
    m = json.loads((out / "metrics.json").read_text())
    assert m["greedy_equal"] is True and m["mismatched_ids"] == [] and m["k"] == 2
    assert m["num_prompts"] == 3 and m["num_turns"] == 3
    assert [(s["id"], s["turn"]) for s in m["skipped"]] == [("long", 0)]
    d = m["speculative"]
    assert (m["tau"], m["cost_ratio"]) == (d["tau"], d["cost_ratio_c"])
    assert len(d["acceptance_per_position"]) == len(d["acceptance_per_position_conditional"]) == 2
    assert d["tau"] == pytest.approx(d["tokens"] / d["target_forwards"]) and d["tau"] >= 1.0
    assert d["cost_ratio_c"] > 0 and d["predicted_speedup"] > 0 and 0 <= d["alpha_estimate"] <= 1
    assert d["prefill_forwards"] == 3 and d["new_tokens"] <= 3 * 12
    assert m["ngram"]["tau"] >= 1.0 and m["ngram"]["greedy_equal"] is True
    assert m["suffix"]["tau"] >= 1.0 and m["suffix"]["greedy_equal"] is True  # vLLM's method: suffix
    assert m["suffix"]["max_tree_depth"] == 24 and m["suffix"]["tokens"] == m["ngram"]["tokens"]
    assert m["plain"]["tokens"] == d["new_tokens"] and m["plain"]["wall_s"] > 0
    assert m["provenance"]["fingerprint_checked"] is True
    assert m["provenance"]["target"]["vocab_size"] == 512
    # calibration: a record per draft position reached, but in each turn's last step (no accept follows it)
    cal = m["calibration"]
    assert cal["accepted"] <= d["num_accepted_tokens"] and d["num_drafts"] - m["num_turns"] <= cal["records"]
    assert sum(r["count"] for r in cal["reliability_raw"]) == cal["records"] == sum(cal["map"]["counts"])
    assert 0 <= cal["ece_raw"] <= 1 and cal["map"]["bins"] == sorted(cal["map"]["bins"])
    # the drafter with suffix decoding: choose, union, adaptive; each lossless, measured and predicted
    for name in ("hybrid", "union", "adaptive"):
        r = m[name]
        assert r["greedy_equal"] is True and r["free"] == "suffix" and r["free_note"] is None, name
        assert r["tau"] >= 1.0 and r["measured_speedup"] > 0 and r["predicted_speedup"] > 0, name
        assert r["tokens"] == d["tokens"] and sum(r["steps_per_draft"].values()) <= r["target_forwards"], name
    assert m["suffix"]["predicted_speedup_model"] == "measured step mix priced by measured step costs"
    # the rows' costs per family (mixes.RowCosts): one plain step, a target curve each
    families = m["prediction"]["costs_by_family"]
    assert set(families) == {"plain", "model", "free"}
    assert len({f["plain_step_s"] for f in families.values()}) == 1 and all(f["target_s"] for f in families.values())
    engines = m["advice"]["engines"]
    assert engines["vllm"]["use"] in ("suffix", "drafter") and engines["sglang"]["use"] in ("ngram", "drafter")
    assert engines["specheads"]["use"] in ("drafter", "hybrid", "union", "adaptive")
    # llama.cpp priced at its own (linear) costs: no k pays, whatever the acceptance
    assert engines["llama.cpp"]["use"] == "no speculation" and engines["llama.cpp"]["curve_from"] == str(cost)
    assert m["llamacpp"]["spec_type"] == "draft-eagle3" and max(m["llamacpp"]["speedup_by_k"].values()) < 1.0
    by = m["advice"]["by_concurrency"]  # the best k per batch size, as vLLM's schedule
    assert [r["batch_size"] for r in by["rows"]] == [1, 8, 32] and by["drafter"] == "grouped"  # one draft group over B rows
    assert by["vllm_num_speculative_tokens_per_batch_size"] == [[1, 1, by["rows"][0]["best_k"]], [2, 8, by["rows"][1]["best_k"]],
                                                               [9, 32, by["rows"][2]["best_k"]]]
    rec = m["advice"]["recommended"]  # one recommendation (eval/recommend.py): batch 1's band is its k
    assert rec["vllm_num_speculative_tokens_per_batch_size"] == by["vllm_num_speculative_tokens_per_batch_size"]
    assert by["rows"][0]["best_k"] == rec["k"] == (m["advice"]["vllm"]["num_speculative_tokens"] if rec["speculate"] else 0)
    report = (out / "report.md").read_text()
    assert "adaptive draft length (drafter + suffix) tau" in report and "Best setting per engine" in report
    assert "num_speculative_tokens_per_batch_size" in report
    assert "## In llama.cpp (its own measured costs)" in report and "use: **no speculation**" in report
    assert "## Draft calibration" in report and f"ECE {cal['ece_raw']:.3f}" in report and (out / "reliability.png").is_file()

    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [(r["id"], r["turn"]) for r in rows] == [("p1", 0), ("mt1", 0), ("mt1", 1)]
    assert all(r["plain_ids"] == r["speculative_ids"] and r["greedy_equal"] for r in rows)
    assert rows[1]["category"] == "writing" and isinstance(rows[0]["speculative_text"], str)
    # the second turn continues the conversation with the model's own first answer
    target = Target.load(str(target_dir), device="cpu")
    eos = target.tokenizer.eos_token_id
    answer = target.tokenizer.decode([t for t in rows[1]["plain_ids"] if t != eos],
                                     skip_special_tokens=True)
    expected = encode_chat(target.tokenizer, [
        {"role": "user", "content": "import os"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"}])
    assert rows[2]["prompt_tokens"] == len(expected)
    # offline parity samples hold exactly the prompts the online eval decoded from
    samples = samples_from_outputs(target.tokenizer, out / "outputs.jsonl")
    assert [s.loss_mask.count(0) for s in samples] == [r["prompt_tokens"] for r in rows if r["turn"] == 0]


def test_eval_refuses_a_draft_for_another_target(target_dir, export_dir, prompts_file, tmp_path):
    other = tmp_path / "export"
    shutil.copytree(export_dir, other)
    meta = json.loads((other / "specheads.json").read_text())
    meta["target"]["embedding_sketch"] = [[-v for v in row] for row in meta["target"]["embedding_sketch"]]
    (other / "specheads.json").write_text(json.dumps(meta))
    with pytest.raises(TargetError, match="embedding_sketch"):
        evaluate(str(target_dir), str(other), str(prompts_file), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
def test_alpha_from_tau_inverts_the_chain_formula(alpha):
    k = 4
    tau = sum(alpha ** j for j in range(k + 1))
    assert alpha_from_tau(tau, k) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_tau(k + 1, k) == 1.0


SEEDED = ("tau", "tokens", "target_forwards", "new_tokens", "acceptance_per_position", "steps_per_draft",
          "model_levels", "model_steps", "greedy_equal", "free")  # a sampled hybrid row's fields that are not timings


def test_eval_samples_losslessly_and_reproducibly(target_dir, export_dir, prompts_file, tmp_path):
    """--temperature > 0: seeded speculative sampling, the hybrid rows included; no token equality is
    claimed, but the same seed gives the same samples."""
    runs = []
    for name in ("a", "b"):
        rc = cli(["eval", "--target", str(target_dir), "--draft", str(export_dir), "--prompts", str(prompts_file),
                  "--out", str(tmp_path / name), "--max-new-tokens", "12", "--temperature", "1.0",
                  "--top-p", "0.9", "--seed", "7"])
        assert rc == 0
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        assert metrics["greedy_equal"] is None and metrics["sampling"] == {"temperature": 1.0, "top_p": 0.9, "seed": 7}
        assert metrics["speculative"]["tau"] >= 1.0 and metrics["speculative"]["tokens"] > 0
        for mix in ("hybrid", "union", "adaptive"):  # sampled as the other rows, timed against sampled plain
            r = metrics[mix]
            assert r["greedy_equal"] is None and r["tau"] >= 1.0 and r["measured_speedup"] > 0, mix
            assert r["tokens"] > 0 and r["acceptance_per_position"] and r["predicted_speedup"] > 0, mix
        assert metrics["adaptive"]["length_costs"]["verify"][0] == 1.0  # `--adaptive` can read it back
        assert metrics["advice"]["sampling"] == metrics["sampling"] and metrics["advice"]["engines"]["specheads"]
        assert "at temperature 1, top-p 0.9" in (tmp_path / name / "report.md").read_text()
        rows = [json.loads(line) for line in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
        for row in rows:  # the per-method seconds are timings; everything else must repeat
            assert row["methods"]["mix_plain"]["tokens"] == row["methods"]["plain"]["tokens"]  # seeded alike
            row["methods"].pop("mix_adaptive")  # its draft lengths follow the timed step costs
            for tally in row["methods"].values():
                tally.pop("wall_s")
        runs.append((rows, {mix: {key: metrics[mix][key] for key in SEEDED} for mix in ("hybrid", "union")}))
    assert runs[0] == runs[1]  # same seed, same samples


def test_tree_eval_runs_the_union_and_says_why_not_the_chain_hybrids(target_dir, export_dir, prompts_file, tmp_path):
    """--tree eagle2: the union verifies the drafter's tree with the free draft (greedy-equal); hybrid
    choose and adaptive length draft chains, so their rows say why they were not run."""
    out = tmp_path / "tree"
    rc = cli(["eval", "--target", str(target_dir), "--draft", str(export_dir), "--prompts", str(prompts_file),
              "--out", str(out), "--max-new-tokens", "12", "--tree", "eagle2", "--depth", "2", "--top-k", "2",
              "--total-tokens", "6"])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["tree"]["kind"] == "eagle2" and m["greedy_equal"] is True
    u = m["union"]
    assert u["greedy_equal"] is True and u["mismatched_ids"] == [] and u["tokens"] == m["speculative"]["tokens"]
    assert u["tau"] >= 1.0 and u["measured_speedup"] > 0 and u["predicted_speedup"] > 0 and u["model_levels"] > 0
    for name in ("hybrid", "adaptive"):
        assert m[name] == {"skipped": "not run with a tree draft: --hybrid choose and --adaptive draft chains: "
                                      "use --tree chain, or --hybrid union for trees"}, name
    assert m["step_costs"]["target_s"]["1"] > 0 and "advice" not in m and "prediction" not in m
    assert "union (drafter + suffix in one tree) tau" in (out / "report.md").read_text()
    assert "adaptive draft length (drafter + the free proposer): skipped (" in (out / "report.md").read_text()
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert all({*r["methods"]} == {"plain", "speculative", "ngram", "suffix", "mix_plain", "mix_union"} for r in rows)


def test_eval_loads_the_target_in_the_dtype_asked(target_dir, export_dir, tmp_path, capsys):
    """--dtype bfloat16 --device cpu: the fp32-trained head is accepted (same target, other dtype),
    the draft follows the target's dtype, and the provenance says what ran."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bf16"
    rc = cli(["eval", "--target", str(target_dir), "--draft", str(export_dir), "--prompts", str(prompts),
               "--out", str(out), "--max-new-tokens", "4", "--k", "2", "--no-predict",
               "--dtype", "bfloat16", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    m = json.loads((out / "metrics.json").read_text())
    assert m["provenance"]["dtype"] == "bfloat16" and m["provenance"]["device"] == "cpu"
    assert m["provenance"]["fingerprint_checked"] is True and m["greedy_equal"] is True
    # no step costs were measured: the free rows name no seed-formula speed-up as a prediction
    lines = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("- n-gram")]
    assert len(lines) == 1 and "not predicted (no measured step costs" in lines[0] and "predicted 1" not in lines[0]
