"""bench/heads.py on the tiny target: every registered kind trains, exports, reloads, stays lossless."""

from __future__ import annotations

import json

from bench_scripts import load_bench


def load_script():
    return load_bench("heads.py")


def test_side_by_side_table(tiny_target_dir, demo_data_dir, tmp_path, demo_run_dir):
    from specheads.heads import HEADS

    run = demo_run_dir
    bench = load_script()
    out = tmp_path / "out"
    rc = bench.main(["--run", str(run), "--out", str(out), "--steps", "2", "--limit", "2",
                     "--max-new-tokens", "8", "--k", "3", "train.batch_size=2", "data.max_length=96",
                     "train.log_every=1", "train.warmup_steps=1"])
    report = json.loads((out / "heads.json").read_text())
    assert rc == 0, [(r["kind"], r.get("error"), r.get("mismatched_ids")) for r in report["kinds"]]
    assert [r["kind"] for r in report["kinds"]] == [*HEADS, *bench.VARIANTS]
    for row in report["kinds"]:
        assert "error" not in row, row
        assert row["greedy_equal"] and row["params"] > 0 and row["train_s_per_step"] > 0
        assert 1.0 <= row["tau_chain"] <= 1.0 + 3
        assert len(row["acceptance_per_position"]) == 3
        # unconditional acceptance cannot rise with depth
        acc = row["acceptance_per_position"]
        assert all(a >= b for a, b in zip(acc, acc[1:]))
    md = (out / "heads.md").read_text()
    assert all(f"| {kind} |" in md for kind in [*HEADS, *bench.VARIANTS])


def test_unknown_kind_is_refused(tmp_path, capsys):
    bench = load_script()
    assert bench.main(["--run", str(tmp_path), "--out", str(tmp_path / "o"), "--kinds", "nope"]) == 2
    assert "unknown head kinds ['nope']" in capsys.readouterr().err


def test_predicted_chain_length_and_speedup(tiny_target_dir, demo_data_dir, tmp_path, demo_run_dir):
    """--predict: k chosen by eval/predict.py within the DFlash block, then measured and lossless."""
    run = demo_run_dir
    bench = load_script()
    out = tmp_path / "out"
    rc = bench.main(["--run", str(run), "--out", str(out), "--kinds", "dflash", "--steps", "2", "--limit", "2",
                     "--max-new-tokens", "8", "--k", "3", "--predict", "train.batch_size=2",
                     "data.max_length=96", "head.block_size=4"])
    report = json.loads((out / "heads.json").read_text())
    assert rc == 0, [(r["kind"], r.get("error"), r.get("mismatched_ids")) for r in report["kinds"]]
    row = report["kinds"][0]
    assert row["k_max"] == 3 and 1 <= row["predicted_k"] <= 3 and row["predicted_speedup"] > 0
    assert row["measured_speedup"] > 0 and 1.0 <= row["tau_predicted_k"] <= 4.0
    assert "| dflash | " in (out / "heads.md").read_text().split("measured speed-up")[1]
