"""bench/demo_runs.py: every row of make demo's table per run with its prediction error, the spread
between runs and the hybrid rows over the better single row (golden values from finished run
folders); a demo that fails names its run folder and log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import demo_runs  # noqa: E402

ROW = {"tau": 2.0, "greedy_equal": True, "acceptance_per_position": [0.6, 0.4, 0.2]}  # a decoded row (eval/table.py)


def write_summary(run: Path, measured: dict[str, float], predicted: dict[str, float]) -> None:
    """A finished demo folder: its demo_summary.json with the table's rows."""
    run.mkdir(parents=True)
    metrics = {"num_prompts": 64, "k": 3, "max_new_tokens": 96,
               "provenance": {"dtype": "float32", "git_sha": "abc"}}
    for key in measured:
        metrics[key] = {**ROW, "predicted_speedup": predicted[key], "measured_speedup": measured[key]}
        if key in demo_runs.MIX_NAMES:
            metrics[key]["free"] = "suffix"
    (run / "demo_summary.json").write_text(json.dumps({"metrics": metrics, "timings": {"total_s": 200.0}}))


def test_rows_errors_spread_and_hybrid_over_best_single(tmp_path):
    write_summary(tmp_path / "run1", {"speculative": 1.20, "ngram": 1.40, "suffix": 1.80, "adaptive": 2.10},
                  {"speculative": 1.26, "ngram": 1.40, "suffix": 1.85, "adaptive": 2.40})
    write_summary(tmp_path / "run2", {"speculative": 1.25, "ngram": 1.30, "suffix": 1.90, "adaptive": 1.95},
                  {"speculative": 1.25, "ngram": 1.35, "suffix": 1.90, "adaptive": 2.00})
    assert demo_runs.main(["--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "demo_runs.json").read_text())
    c = r["compare"]
    assert c["rows"] == ["speculative", "ngram", "suffix", "adaptive"]
    first = r["runs"][0]["rows"]
    assert first["speculative"]["error"] == pytest.approx(0.05) and first["speculative"]["within"]
    assert first["adaptive"]["error"] == pytest.approx(2.40 / 2.10 - 1) and not first["adaptive"]["within"]
    assert c["spread"]["suffix"]["measured_spread"] == pytest.approx(1.90 / 1.80 - 1)
    assert c["mix_over_best_single"]["adaptive"] == pytest.approx([2.10 / 1.40, 1.95 / 1.30])
    assert c["all_within"] is False and c["all_greedy_equal"] is True
    md = (tmp_path / "demo_runs.md").read_text()
    assert "adaptive draft length (drafter + suffix)" in md and "**over 10%**" in md and "run 2 1.50x" in md


def test_a_failed_demo_names_its_folder_and_log(tmp_path, capsys):
    assert demo_runs.main(["--out", str(tmp_path), "--", "--preset", "no-such-preset"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "run1") in err and str(tmp_path / "run1.log") in err
    assert "invalid choice" in (tmp_path / "run1.log").read_text()  # the demo's own words, kept
    assert not (tmp_path / "demo_runs.json").exists()


def test_one_run_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo_runs.main(["--out", str(tmp_path), "--runs", "1"])
    assert "at least 2" in capsys.readouterr().err
