"""Reports: plots are real PNGs of the right content, report.md and metrics.json agree."""

from __future__ import annotations

import json

import pytest

from specheads.eval.predict import StepCosts, advice, predict
from specheads.eval.report import (
    RECOMMENDED,
    ReportError,
    attach_to_export,
    concurrency_series,
    tau_by_category,
    with_recommendations,
    write_report,
)


def _metrics():
    pred = predict([0.7, 0.6, 0.5], StepCosts(target_s={1: 1.0, 8: 1.5}, draft_per_level_s=0.05),
                   ks=range(1, 7), budgets=(8, 16))
    return {"tau": 2.1, "tree": {"kind": "chain", "k": 3}, "greedy_equal": True,
            "speculative": {"acceptance_per_position": [0.7, 0.42, 0.21],
                            "acceptance_per_position_conditional": [0.7, 0.6, 0.5]},
            "ngram": {"tau": 1.3}, "prediction": pred.to_dict(), "advice": advice(pred)}


def _png_size(path):
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(str(path)).shape


def test_write_report_writes_every_plot(tmp_path):
    outputs = [{"category": "math", "decode_tokens": 30, "decode_forwards": 10, "tau": 3.0},
               {"category": "math", "decode_tokens": 10, "decode_forwards": 10, "tau": 1.0},
               {"category": None, "decode_tokens": 20, "decode_forwards": 10, "tau": 2.0}]
    verifier = {"methods": [{"settings": {"kind": "plain"}, "speedup": 1.0},
                            {"settings": {"kind": "chain", "k": 2}, "speedup": 1.2},
                            {"settings": {"kind": "chain", "k": 3}, "speedup": 1.25}]}
    bench = {"results": [{"label": "eagle3", "concurrency": c, "output_tokens_per_s": 100.0 * c}
                         for c in (1, 2, 4)] + [{"concurrency": 1, "tokens_per_s": 80.0}]}
    m = write_report(tmp_path, _metrics(), outputs, verifier, bench)
    assert set(m["plots"]) == {"acceptance", "tau_by_category", "speedup", "concurrency"}
    for name in m["plots"].values():
        h, w, _ = _png_size(tmp_path / name)
        assert h > 200 and w > 400
    # tau per category sums counts before the ratio: (30 + 10) / (10 + 10), not the mean of 3 and 1
    assert m["tau_by_category"]["math"] == {"tau": 2.0, "turns": 2}
    assert m["measured_chain_speedup"] == {"2": 1.2, "3": 1.25}
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["plots"] == m["plots"]
    md = (tmp_path / "report.md").read_text()
    assert RECOMMENDED in md and "![speedup](speedup.png)" in md and "1.25x" in md
    assert '"num_speculative_tokens": ' + str(m["advice"]["vllm"]["num_speculative_tokens"]) in md


def test_tau_by_category_without_counts_averages_turns():
    assert tau_by_category([{"tau": 2.0}, {"tau": 3.0}]) == {"all": {"tau": 2.5, "turns": 2}}


def test_concurrency_input_errors_name_the_row():
    with pytest.raises(ReportError, match="non-empty 'results'"):
        concurrency_series({"rows": []}, "b.json")
    with pytest.raises(ReportError, match=r"b.json: results\[1\] needs 'concurrency'"):
        concurrency_series({"results": [{"concurrency": 1, "tokens_per_s": 1}, {"tokens_per_s": 2}]}, "b.json")


def test_recommendations_replace_their_section(tmp_path):
    adv = _metrics()["advice"]
    readme = "# Draft\n\n## Serve\n\nvllm serve x\n\n## Head\n\n- layers\n"
    adv["by_concurrency"] = {"rows": [{"batch_size": 1, "best_k": 3, "best_speedup": 1.5},
                                      {"batch_size": 8, "best_k": 0, "best_speedup": 1.0}],
                             "vllm_num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 0]]}
    once = with_recommendations(readme, adv)
    assert with_recommendations(once, adv) == once  # idempotent: the section is replaced
    assert "batch 1: k = 3 (1.50x), batch 8: no speculation" in once
    assert '`"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 0]]`' in once
    assert once.count(RECOMMENDED) == 1 and once.startswith(readme.rstrip("\n"))
    export = tmp_path / "export"
    export.mkdir()
    (export / "README.md").write_text(readme)
    write_report(tmp_path / "eval", _metrics())
    dest = attach_to_export(export, tmp_path / "eval")
    assert (dest / "metrics.json").is_file() and (dest / "speedup.png").is_file()
    assert RECOMMENDED in (export / "README.md").read_text()
    with pytest.raises(ReportError, match="run `specheads eval` first"):
        attach_to_export(export, tmp_path / "nothing")
