"""bench/suffix_replay.py: replaying suffix decoding with adaptive length over known answers counts
every answer token once, a verify curve no draft can pay back gives exactly plain decoding's cost,
and on repeated text longer free drafts pay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import suffix_replay  # noqa: E402


def write_eval(folder: Path, verify: list[float], answers: list[list[int]]) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    outputs = folder / "outputs.jsonl"
    outputs.write_text("".join(json.dumps({"id": str(i), "turn": 0, "prompt": f"say it {i}", "plain_ids": a}) + "\n"
                               for i, a in enumerate(answers)))
    metrics = folder / "metrics.json"
    metrics.write_text(json.dumps({"adaptive": {"length_costs": {"verify": verify, "draft": 0.0, "fixed": 0.0}}}))
    return outputs, metrics


SPAN = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.mark.parametrize("verify,plain", [([1.0, 50.0, 60.0], True), ([1.0, 1.05, 1.1, 1.15, 1.2], False)])
def test_replay_counts_every_token_and_prices_plain_steps_exactly(tmp_path, tiny_target_dir, verify, plain):
    answers = [SPAN * 4 + [5 + i] for i in range(3)]
    outputs, metrics = write_eval(tmp_path / "eval", verify, answers)
    history = tmp_path / "history.jsonl"
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a b c"}]
    history.write_text(json.dumps({"messages": turns}) + "\n")
    assert suffix_replay.main(["--target", str(tiny_target_dir), "--outputs", str(outputs), "--costs", str(metrics),
                               "--history", str(history), "--out", str(tmp_path / "out")]) == 0
    r = json.loads((tmp_path / "out" / "suffix_replay.json").read_text())
    assert [s["name"] for s in r["settings"]] == [s[0] for s in suffix_replay.SETTINGS] and r["history_answers"] == 1
    for s in r["settings"]:
        assert s["tokens"] == sum(len(a) for a in answers)
        if plain:  # no draft pays: every step a plain one, cost = tokens
            assert s["cost_plain_steps"] == pytest.approx(s["tokens"]) and s["speedup"] == pytest.approx(1.0)
    if not plain:
        by = {s["name"]: s["speedup"] for s in r["settings"]}
        assert by["k <= 8, raw probabilities"] > by["k <= 3, raw probabilities"] > 1.0
    assert "| k <= 8, calibrated online |" in (tmp_path / "out" / "suffix_replay.md").read_text()
    for s in r["settings"]:  # the reliability counters: every bin seen, survivors within what was settled
        assert s["reliability"] and all(0 <= b["kept"] <= b["settled"] for b in s["reliability"])
