"""bench/hybrid.py on the tiny target: every method runs, equals plain greedy, JSON + Markdown."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench, unload_bench


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
