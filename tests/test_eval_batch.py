"""`specheads eval --batch-size N` (eval/waves.py): the same tau, acceptance, outputs and calibration
records as batch 1 on the tiny target, multi-turn rows and a skipped prompt included; and
bench/batched_eval.py, which runs both in one go."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench, unload_bench

from specheads.cli import main as cli

ROWS = [{"id": "p1", "prompt": "def add(a, b):"},
        {"id": "mt1", "category": "writing", "turns": ["import os", "and then?", "more"]},
        {"id": "p2", "prompt": "x = x + x + x + x"},
        {"id": "long", "prompt": "x = 1\n" * 300},  # longer than the 256-token context: skipped
        {"id": "mt2", "turns": ["class A:", "def f(self):"]},
        {"id": "p3", "prompt": "for i in range(10): print(i)"}]
# what may not move with the batch size (seconds may; so may suffix decoding's drafts)
STATS = ("tau", "acceptance_per_position", "acceptance_per_position_conditional", "num_drafts",
         "num_accepted_tokens", "target_forwards", "tokens", "greedy_equal")
OUTPUT_KEYS = ("id", "turn", "prompt", "prompt_tokens", "plain_ids", "speculative_ids", "speculative_text",
               "greedy_equal", "tau", "ngram_tau", "stop_reason", "decode_tokens", "decode_forwards")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def evals(tiny_target_dir, random_export_dir, prompts):
    """The same eval at batch sizes 1 and 3 -> {size: (metrics, output rows, report.md)}."""
    out = {}
    for size in (1, 3):
        folder = prompts.parent / f"b{size}"
        rc = cli(["eval", "--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts",
                  str(prompts), "--out", str(folder), "--max-new-tokens", "12", "--k", "2", "--quiet",
                  "--batch-size", str(size)])
        assert rc == 0
        rows = [json.loads(line) for line in (folder / "outputs.jsonl").read_text().splitlines()]
        out[size] = json.loads((folder / "metrics.json").read_text()), rows, (folder / "report.md").read_text()
    return out


def test_batched_eval_has_batch_ones_numbers(evals):
    (m1, rows1, _), (m3, rows3, report) = evals[1], evals[3]
    assert (m1["batch_size"], m3["batch_size"]) == (1, 3)
    assert m3["measured_speedup_baseline"] == "plain decoding at batch size 3"
    assert "- batch size 3 (sequences per target forward)" in report
    for name in ("speculative", "ngram"):  # drafts that do not depend on other rows
        assert {s: m3[name][s] for s in STATS} == {s: m1[name][s] for s in STATS}, name
    assert m1["ngram"]["num_accepted_tokens"] > 0  # the n-gram row accepts: its counts are checked
    assert m3["suffix"]["greedy_equal"] is m1["suffix"]["greedy_equal"] is True
    assert m3["suffix"]["tokens"] == m1["suffix"]["tokens"]
    assert (m3["greedy_equal"], m3["skipped"], m3["num_turns"]) == (m1["greedy_equal"], m1["skipped"], 8)
    assert [(s["id"], s["turn"]) for s in m3["skipped"]] == [("long", 0)]
    # outputs.jsonl: the same rows in the same (row, turn) order, multi-turn answers included
    assert [(r["id"], r["turn"]) for r in rows3] == [("p1", 0), ("mt1", 0), ("mt1", 1), ("mt1", 2), ("p2", 0),
                                                      ("mt2", 0), ("mt2", 1), ("p3", 0)]
    assert [{k: r[k] for k in OUTPUT_KEYS} for r in rows3] == [{k: r[k] for k in OUTPUT_KEYS} for r in rows1]
    # calibration records: one per settled draft position, the same count and outcomes at both sizes
    cal1, cal3 = m1["calibration"], m3["calibration"]
    assert (cal3["records"], cal3["accepted"]) == (cal1["records"], cal1["accepted"]) and cal1["records"] > 0
    assert [r["count"] for r in cal3["reliability_raw"]] == [r["count"] for r in cal1["reliability_raw"]]


def test_batched_eval_decodes_the_hybrid_rows(evals):
    m3, rows3, _ = evals[3]
    for name in ("hybrid", "union", "adaptive"):
        assert m3[name]["greedy_equal"] is True and m3[name]["tokens"] == m3["speculative"]["tokens"], name
    assert all({"mix_plain", "mix_hybrid", "mix_union", "mix_adaptive"} <= set(r["methods"]) for r in rows3)


def test_batched_eval_script(tiny_target_dir, random_export_dir, prompts, tmp_path, capsys):
    """bench/batched_eval.py runs each batch size's eval and compares them (no timing asserted)."""
    script = load_bench("batched_eval.py")
    try:
        rc = script.main(["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts",
                          str(prompts), "--out", str(tmp_path / "be"), "--batch-sizes", "1,2", "--limit", "2",
                          "--max-new-tokens", "6", "--no-predict", "--device", "cpu"])
        with pytest.raises(ValueError, match="--batch-size must be >= 1"):
            script.parse_sizes("1,0")
        with pytest.raises(ValueError, match="--batch-sizes"):
            script.parse_sizes("1,x")
    finally:
        unload_bench(script)
    assert rc == 0 and "| batch | eval s |" in capsys.readouterr().out
    report = json.loads((tmp_path / "be" / "batched_eval.json").read_text())
    runs = report["runs"]
    assert [r["batch_size"] for r in runs] == report["conditions"]["batch_sizes"] == [1, 2]
    for r in runs:
        assert r["vs_first"]["same_outputs"] and r["vs_first"]["same_tau_exact_methods"]
        assert r["greedy_equal_turns"] == r["num_turns"] == 4 and r["wall_s"] > 0
        assert set(r["methods"]) >= {"speculative", "ngram"}
        assert (tmp_path / "be" / f"b{r['batch_size']}" / "metrics.json").is_file()
    assert runs[1]["methods"]["ngram"]["tau"] == runs[0]["methods"]["ngram"]["tau"]
    md = (tmp_path / "be" / "batched_eval.md").read_text()
    assert md.startswith("# Eval at several batch sizes") and "| ngram |" in md


def test_batched_eval_in_rounds_adds_up_the_parts(tiny_target_dir, random_export_dir, prompts, tmp_path):
    """--rounds 2: each size runs on both halves of the prompts in turn; the merged counts are the
    single run's (prompt lookup's tau, turns, outputs), the seconds those of the parts."""
    script = load_bench("batched_eval.py")
    common = ["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts", str(prompts),
              "--batch-sizes", "1,2", "--limit", "3", "--max-new-tokens", "6", "--no-predict", "--device", "cpu"]
    try:
        assert script.main(common + ["--out", str(tmp_path / "one")]) == 0
        assert script.main(common + ["--out", str(tmp_path / "two"), "--rounds", "2"]) == 0
        assert script.main(common + ["--out", str(tmp_path / "bad"), "--rounds", "4"]) == 1  # 3 prompts
    finally:
        unload_bench(script)
    one, two = (json.loads((tmp_path / d / "batched_eval.json").read_text())["runs"] for d in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert b["num_turns"] == a["num_turns"] == b["greedy_equal_turns"]
        assert b["methods"]["ngram"]["tau"] == pytest.approx(a["methods"]["ngram"]["tau"])
        assert b["methods"]["ngram"]["tokens"] == a["methods"]["ngram"]["tokens"]
        assert b["wall_s"] == pytest.approx(sum(b["parts_wall_s"])) and len(b["parts_wall_s"]) == 2
        assert b["vs_first"]["same_outputs"]
    assert (tmp_path / "two" / "b2" / "part1" / "metrics.json").is_file()
    assert "In 2 rounds" in (tmp_path / "two" / "batched_eval.md").read_text()
