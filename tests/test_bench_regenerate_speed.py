"""bench/regenerate_speed.py on the tiny target: plain batched and --draft at two batch sizes in one
run, answers equal, tau of the drafted runs, JSON + Markdown (no timing asserted)."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def speed_bench():
    """The benchmark script loaded as a module (bench/ is scripts, not a package)."""
    module = load_bench("regenerate_speed.py")
    yield module
    unload_bench(module)


def test_bench_times_plain_and_drafted_batches(speed_bench, tiny_target_dir, random_export_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b):", "import os\nimport os", "class A:\n    pass", "for i in range(3):"]
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "bench"
    rc = speed_bench.main(["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts",
                           str(prompts), "--out", str(out), "--max-new-tokens", "10", "--batch-sizes", "1,3",
                           "--plain-batch-size", "2"])
    assert rc == 0 and "| --draft | 3 |" in capsys.readouterr().out
    report = json.loads((out / "regenerate_speed.json").read_text())
    methods = report["methods"]
    assert [(m["drafted"], m["batch_size"]) for m in methods] == [(False, 2), (True, 1), (True, 3)]
    assert report["answers_equal"] is True and all(m["answers_equal"] == 4 for m in methods)
    assert len({m["tokens"] for m in methods}) == 1 and 4 <= methods[0]["tokens"] <= 40  # greedy: same answers
    assert methods[0]["tau"] is None and all(m["tau"] >= 1.0 for m in methods[1:])
    assert all(m["wall_s"] > 0 and m["tokens_per_s"] > 0 and m["speedup_vs_plain"] > 0 for m in methods)
    assert report["settings"]["num_prompts"] == 4 and report["settings"]["draft_batch_sizes"] == [1, 3]
    assert (out / "regenerate_speed.md").read_text().startswith("# Regeneration speed")


def test_bench_refuses_bad_batch_sizes(speed_bench, capsys):
    with pytest.raises(SystemExit):
        speed_bench.main(["--target", "t", "--draft", "d", "--prompts", "p", "--out", "o", "--batch-sizes", "0,x"])
    assert "--batch-sizes '0,x'" in capsys.readouterr().err
