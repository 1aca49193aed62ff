"""bench/verifier.py on the tiny target: every method runs, equals plain greedy, JSON + Markdown."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def verifier():
    """The benchmark script loaded as a module (bench/ is scripts, not a package)."""
    module = load_bench("verifier.py")
    yield module
    unload_bench(module)


@pytest.fixture(scope="module")
def export_dir(random_export_dir):
    return random_export_dir


def test_bench_writes_every_method(verifier, tiny_target_dir, export_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n"
                       + json.dumps({"id": "b", "turns": ["import os", "more"]}) + "\n"
                       + json.dumps({"id": "c", "prompt": "unused"}) + "\n")
    out = tmp_path / "bench"
    rc = verifier.main(["--target", str(tiny_target_dir), "--draft", str(export_dir),
                        "--prompts", str(prompts), "--out", str(out), "--limit", "2",
                        "--max-new-tokens", "8", "--device", "cpu", "--eagle2", "2:2:6,3:3:10"])
    assert rc == 0
    assert "| method |" in capsys.readouterr().out

    report = json.loads((out / "verifier.json").read_text())
    names = [r["method"] for r in report["methods"]]
    assert names == ["plain", *(f"chain k={k}" for k in range(1, 9)), "static n=21",
                     "eagle2 d=2 k=2 n=6", "eagle2 d=3 k=3 n=10", "ngram k=3"]
    assert report["greedy_equal"] is True
    assert report["settings"]["num_prompts"] == 2 and report["settings"]["dtype"] == "float32"
    for row in report["methods"]:
        assert row["greedy_equal"] is True and row["mismatched_ids"] == []
        assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0 and row["wall_s"] > 0
        assert row["tokens"] == report["methods"][0]["tokens"]
    plain = report["methods"][0]
    assert plain["tau"] == 1.0 and plain["speedup"] == pytest.approx(1.0)
    assert len(report["methods"][8]["acceptance_per_position"]) == 8  # chain k=8

    md = (out / "verifier.md").read_text()
    assert md.startswith("# Verifier benchmark")
    table = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(names)
    assert all(f"| {name} |" in md for name in names) and "| NO |" not in md


def test_bench_argument_errors(verifier, tiny_target_dir, export_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="DEPTH:TOP_K:TOTAL_TOKENS"):
        verifier.parse_budgets("4:4")
    rc = verifier.main(["--target", str(tiny_target_dir), "--draft", str(tmp_path / "missing"),
                        "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")])
    assert rc == 1 and "error" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_batched_equals_batch_one(verifier, tiny_target_dir, export_dir, tmp_path):
    """--batch-size 3: each method decodes the prompts together; tau, tokens and per-position
    acceptance are batch 1's (every method's drafts are per-row), every row still plain greedy."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "import os", "x = x + x", "for i in"])))
    reports = {}
    for size in (1, 3):
        out = tmp_path / f"b{size}"
        rc = verifier.main(["--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompts", str(prompts),
                            "--out", str(out), "--max-new-tokens", "10", "--device", "cpu", "--chain-ks", "2",
                            "--eagle2", "2:2:6", "--batch-size", str(size)])
        assert rc == 0
        reports[size] = json.loads((out / "verifier.json").read_text())
    assert reports[3]["settings"]["batch_size"] == 3 and reports[1]["settings"]["batch_size"] == 1
    assert "batch 3, greedy" in (tmp_path / "b3" / "verifier.md").read_text()
    keys = ("method", "tau", "tokens", "target_forwards", "acceptance_per_position", "greedy_equal")
    assert [{k: r[k] for k in keys} for r in reports[3]["methods"]] == [{k: r[k] for k in keys}
                                                                        for r in reports[1]["methods"]]
    assert reports[3]["greedy_equal"] is True


@pytest.mark.parametrize("size", ["0", "-1"])
def test_bench_refuses_a_bad_batch_size(verifier, tiny_target_dir, export_dir, tmp_path, capsys, size):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    rc = verifier.main(["--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompts", str(prompts),
                        "--out", str(tmp_path / "o"), "--batch-size", size])
    assert rc == 1 and "--batch-size must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
