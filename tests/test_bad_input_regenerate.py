"""`specheads regenerate` refuses bad options, datasets and unreachable servers by name."""

from __future__ import annotations

import json

import pytest
from refusals import BINARY, LATIN1, refused, write_data

ROLES = "expected one of system, developer, user, assistant, tool"
ANSWER = {"role": "assistant", "content": "a"}


def write_rows(path, *rows):
    """JSON lines; json.dumps writes a lone surrogate as a \\ud800 escape, as other tools do."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def work(tmp_path):
    write_data(tmp_path)
    (tmp_path / "binary.jsonl").write_bytes(BINARY)
    (tmp_path / "latin1.jsonl").write_bytes(LATIN1)
    (tmp_path / "folder").mkdir()
    good = {"messages": [{"role": "user", "content": "q"}, ANSWER]}
    write_rows(tmp_path / "wizard.jsonl", good, {"messages": [{"role": "wizard", "content": "q"}, ANSWER]})
    write_rows(tmp_path / "surrogate.jsonl", {"messages": [{"role": "user", "content": "a\ud800b"}, ANSWER]})
    write_rows(tmp_path / "odd.jsonl", {"query": "q", "lang": "en"})
    (tmp_path / "empty.jsonl").write_text("")
    write_rows(tmp_path / "sharegpt.jsonl", {"conversations": [{"from": "human", "value": "caf\udce9"},
                                                              {"from": "gpt", "value": "a"}]})
    return tmp_path


@pytest.mark.parametrize("args,needles", [
    (["missing.jsonl", "--target", "T"], ["dataset 'missing.jsonl' does not exist"]),
    (["binary.jsonl", "--target", "T"], ["binary.jsonl", "binary"]),
    (["latin1.jsonl", "--target", "T"], ["latin1.jsonl", "not UTF-8"]),
    (["wizard.jsonl", "--target", "T"], ["wizard.jsonl: row 1: field 'messages[0].role': unknown role "
                                          f"'wizard'; {ROLES}"]),
    (["surrogate.jsonl", "--target", "T"], ["surrogate.jsonl: row 0: field 'messages[0].content': lone "
                                             "surrogate U+D800 at position 1", "remove it"]),
    (["sharegpt.jsonl", "--target", "T"], ["sharegpt.jsonl: row 0 (line 1): field 'conversations[0].value': "
                                            "lone surrogate U+DCE9 at position 3"]),
    (["odd.jsonl", "--target", "T"], ["cannot detect the data format", "['lang', 'query']",
                                      "set --format explicitly (one of sharegpt, openai, alpaca, text)"]),
    (["empty.jsonl", "--target", "T"], ["empty.jsonl: the file holds no rows — check the SOURCE argument"]),
    (["data.jsonl", "--target", "T", "--limit", "0"], ["--limit 0"]),
    (["data.jsonl", "--target", "T", "--concurrency", "0"], ["--concurrency 0"]),
    (["data.jsonl", "--target", "T", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["data.jsonl"], ["exactly one of --target", "--endpoint"]),
    (["data.jsonl", "--target", "T", "--out", "folder"], ["--out 'folder' is a folder"]),
    (["data.jsonl", "--endpoint", "http://127.0.0.1:9/v1", "--draft", "D"], ["--draft", "--endpoint"]),
    (["data.jsonl", "--target", "T", "--draft", "no-such-export"], ["no-such-export", "does not exist"]),
    (["data.jsonl", "--endpoint", "http://127.0.0.1:9/v1", "--retries", "0", "--timeout", "5"],
     ["http://127.0.0.1:9/v1", "Connection refused"]),
])
def test_bad_regenerate_input_is_named(work, tiny_target_dir, args, needles):
    args = [str(tiny_target_dir) if a == "T" else a for a in args]
    if "--out" not in args:
        args += ["--out", "out/regen.jsonl"]
    refused(["regenerate", *args], needles, work, watch=(tiny_target_dir,), output=work / "out")
    assert not (work / "out").exists()


def test_missing_device_is_named_before_loading(work, tiny_target_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused(["regenerate", "data.jsonl", "--target", str(tiny_target_dir), "--device", "cuda",
             "--out", "out/r.jsonl"], ["device 'cuda'"], work, watch=(tiny_target_dir,), output=work / "out")
