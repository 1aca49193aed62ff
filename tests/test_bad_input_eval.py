"""`specheads eval` refuses bad options and files by name before decoding anything."""

from __future__ import annotations

import pytest

from refusals import BINARY, LATIN1, refused, write_prompts


@pytest.fixture
def work(tmp_path):
    write_prompts(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt here"}\n')
    (tmp_path / "binary.jsonl").write_bytes(BINARY)
    (tmp_path / "latin1.jsonl").write_bytes(LATIN1)
    (tmp_path / "broken.json").write_text("{not json")
    return tmp_path


@pytest.mark.parametrize("extra,needles", [
    (["--limit", "0"], ["--limit 0", ">= 1"]),
    (["--k", "0"], ["--k must be >= 1"]),
    (["--prompts", "missing.jsonl"], ["missing.jsonl", "does not exist"]),
    (["--prompts", "binary.jsonl"], ["binary.jsonl", "binary"]),
    (["--prompts", "latin1.jsonl"], ["latin1.jsonl", "not UTF-8"]),
    (["--prompts", "bad.jsonl"], ["bad.jsonl:2", "'prompt'"]),
    (["--verifier-json", "missing.json"], ["--verifier-json 'missing.json'"]),
    (["--bench-json", "broken.json"], ["broken.json", "not valid JSON"]),
    (["--draft", "no_export"], ["no_export", "does not exist"]),
    (["--target", "no_target"], ["no_target"]),
    (["--tree", "eagle2", "--top-k", "0"], ["--top-k"]),
])
def test_bad_eval_input_is_named(work, tiny_target_dir, random_export_dir, extra, needles):
    base = {"--target": str(tiny_target_dir), "--draft": str(random_export_dir),
            "--prompts": "prompts.jsonl", "--out": "out"}
    for key, value in zip(extra[::2], extra[1::2]):
        if key in base:
            base[key] = value
    args = [x for kv in base.items() for x in kv] + [x for kv in zip(extra[::2], extra[1::2])
                                                     if kv[0] not in base for x in kv]
    refused(["eval", *args], needles, work, watch=(tiny_target_dir, random_export_dir), output=work / "out")
    assert not (work / "out").exists()
