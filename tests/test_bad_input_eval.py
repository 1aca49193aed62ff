"""`specheads eval` refuses bad options and files by name before decoding anything."""

from __future__ import annotations

import json

import pytest
from refusals import BINARY, LATIN1, refused, write_prompts

ROLES = "expected one of system, developer, user, assistant, tool"


@pytest.fixture
def work(tmp_path):
    write_prompts(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"query": "no prompt here"}\n')
    (tmp_path / "binary.jsonl").write_bytes(BINARY)
    (tmp_path / "latin1.jsonl").write_bytes(LATIN1)
    (tmp_path / "broken.json").write_text("{not json")
    # json.dumps writes the lone surrogates as \ud800 escapes, the way they reach us from other tools
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "ok"}\n' + json.dumps({"turns": ["fine", "a\ud800b"]}) + "\n")
    (tmp_path / "surrogate_prompt.jsonl").write_text(json.dumps({"prompt": "\udc00"}) + "\n")
    held_out = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    (tmp_path / "wizard.jsonl").write_text(json.dumps({"messages": held_out}) + "\n" + json.dumps(
        {"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    return tmp_path


@pytest.mark.parametrize("extra,needles", [
    (["--limit", "0"], ["--limit 0", ">= 1"]),
    (["--k", "0"], ["--k must be >= 1"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1", "got 0"]),
    (["--batch-size", "-1"], ["--batch-size must be >= 1", "got -1"]),
    (["--prompts", "missing.jsonl"], ["missing.jsonl", "does not exist"]),
    (["--prompts", "binary.jsonl"], ["binary.jsonl", "binary"]),
    (["--prompts", "latin1.jsonl"], ["latin1.jsonl", "not UTF-8"]),
    (["--prompts", "bad.jsonl"], ["bad.jsonl:2: no prompt in this row of the prompts file (JSON lines)",
                                  "prompt, turns", "found 'query'"]),
    (["--prompts", "surrogate.jsonl"], ["surrogate.jsonl:2: field 'turns[1]': lone surrogate U+D800 at "
                                        "position 1", "remove it or write the character meant"]),
    (["--prompts", "surrogate_prompt.jsonl"], ["surrogate_prompt.jsonl:1: field 'prompt': lone surrogate "
                                               "U+DC00 at position 0"]),
    (["--verifier-json", "missing.json"], ["--verifier-json 'missing.json'"]),
    (["--bench-json", "broken.json"], ["broken.json", "not valid JSON"]),
    (["--llamacpp-cost", "broken.json"], ["llama.cpp cost file 'broken.json'", "not readable JSON"]),
    (["--llamacpp-cost", "missing.json"], ["'missing.json' does not exist", "bench/llamacpp.py --cost"]),
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


@pytest.mark.parametrize("extra,needles", [
    (["--mix-rows", "adaptive", "--no-predict"], ["--mix-rows adaptive asks for hybrid rows", "--no-predict"]),
    (["--mix-rows", "adaptive", "--tree", "eagle2"], ["--mix-rows adaptive", "not run with a tree draft",
                                                      "--tree chain"]),
])
def test_hybrid_rows_asked_that_cannot_run_are_refused(work, tiny_target_dir, random_export_dir, extra, needles):
    """Not dropped with no word on the terminal (report.md alone saying why), before the target loads."""
    args = ["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--prompts", "prompts.jsonl",
            "--out", "out", *extra]
    refused(["eval", *args], needles, work, watch=(tiny_target_dir, random_export_dir), output=work / "out")
    assert not (work / "out").exists()


def test_some_rows_a_tree_cannot_run_are_warned_about(caplog):
    from specheads.eval.mixes import check_asked_rows

    check_asked_rows(("union", "adaptive"), True, chain=False)
    assert "--mix-rows adaptive: not run with a tree draft" in caplog.text and "union" not in caplog.text.split(":")[0]


def test_bad_offline_data_is_named_before_the_target_loads(work, tiny_target_dir, random_export_dir):
    args = ["eval", "--offline", "--data", "wizard.jsonl", "--target", "no_target",
            "--draft", str(random_export_dir), "--out", "out"]
    refused(args, ["wizard.jsonl: row 1 (line 2): field 'messages[0].role': unknown role 'wizard'; "
                   f"{ROLES}"], work, watch=(random_export_dir,), output=work / "out")


@pytest.mark.parametrize("verb,history,needle", [
    ("eval", "missing.jsonl", "missing.jsonl: no such file or folder — check --suffix-history"),
    ("eval", "empty.jsonl", "empty.jsonl: the file holds no rows — check --suffix-history"),
    ("eval", "binary.jsonl", "not UTF-8 text (invalid byte at offset 128) — convert it to UTF-8 or check that "
                             "--suffix-history names the right file"),
    ("eval", "prompts.jsonl", "these rows are prompts without answers, and --suffix-history needs conversations "
                              "with answers: have the target write them with `specheads regenerate prompts.jsonl"),
])
def test_a_bad_suffix_history_names_the_flag(work, tiny_target_dir, random_export_dir, verb, history, needle):
    """Not the recipe keys (data.path, data.format) that eval does not have (serve reads the file
    through the same data.suffix_history.read_history)."""
    (work / "empty.jsonl").write_text("")
    args = ["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--suffix-history", history]
    args += ["--prompts", "prompts.jsonl", "--out", "out"]
    text = refused([verb, *args], [needle], work, watch=(tiny_target_dir, random_export_dir), output=work / "out")
    assert "data.path" not in text and "data.format" not in text and "data.train" not in text
