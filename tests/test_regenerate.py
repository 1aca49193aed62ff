"""Regeneration with the target: assistant turns become the target's own greedy answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import start_server

from specheads.data.conversations import Conversation, Message
from specheads.data.prompts import encode_chat
from specheads.data.regenerate_run import read_rows, run_regenerate
from specheads.data.regenerate_turns import (
    LocalBackend,
    RegenerateError,
    RegenOptions,
    generate_batch,
    regenerate_local,
    shape_answer,
)
from specheads.data.resume import RowWriter, read_index
from specheads.target import Target
from specheads.verify.loop import greedy_decode


def test_regenerate_matches_plain_greedy(tiny_target_dir):
    target = Target.load(str(tiny_target_dir), device="cpu")
    tok = target.tokenizer
    convs = [
        Conversation("a", [Message("user", "def add(a, b):\n    \"\"\"Sum.\"\"\""), Message("assistant", "x")]),
        Conversation("b", [Message("system", "be brief"), Message("user", "def f():"), Message("assistant", "y"),
                           Message("user", "def g(self, name, default=None):"), Message("assistant", "z")]),
    ]
    out, stats = regenerate_local(target, convs, max_new_tokens=12, batch_size=2, progress=False)
    assert [m.role for m in out[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert out[1].messages[0].content == "be brief" and out[1].messages[3].content.startswith("def g")
    assert stats.turns == 3 and stats.conversations == 2
    for conv in out:
        for i, msg in enumerate(conv.messages):
            if msg.role != "assistant":
                continue
            history = [{"role": m.role, "content": m.content} for m in conv.messages[:i]]
            # the two-step encoding regeneration used before data/prompts.py, as an independent
            # reference: encode_chat must give these very ids
            prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert encode_chat(tok, history) == ids
            ref = greedy_decode(target, ids, 12, eos_token_ids=[tok.eos_token_id]).tokens
            ref = [t for t in ref if t != tok.eos_token_id]
            assert msg.content == tok.decode(ref, skip_special_tokens=True)
    assert stats.settings["target"]["tokenizer_sha256"] == target.fingerprint()["tokenizer_sha256"]


# --- the command: files, backends, resume ------------------------------------------------------

SLICE = Path(__file__).parent / "fixtures" / "sharegpt_slice.json"  # 40 ShareGPT-format rows, 1-3 turns


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_row_writer_repairs_a_killed_tail(tmp_path):
    out = tmp_path / "rows.jsonl"
    w = RowWriter(out)
    for i in range(3):
        w.write(f"r{i}", {"id": f"r{i}"})
    w.close()
    with open(out, "a") as f:  # a row written but never indexed, then half a row
        f.write('{"id": "r3"}\n{"id": "r4", "mess')
    with open(str(out) + ".index", "a") as f:
        f.write('"r3"\t9')  # half an index line
    w = RowWriter(out)
    assert w.done == {"r0", "r1", "r2"} and w.dropped_tail > 0
    w.write("r3", {"id": "r3"})
    with pytest.raises(ValueError, match="already"):
        w.write("r1", {"id": "r1"})
    w.close()
    assert [r["id"] for r in read_out(out)] == ["r0", "r1", "r2", "r3"]
    assert read_index(out)[0] == ["r0", "r1", "r2", "r3"]
    (tmp_path / "orphan.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="without"):
        RowWriter(tmp_path / "orphan.jsonl")


def test_thinking_and_tool_rows_local(tiny_target_dir, tmp_path):
    assert shape_answer("<think>hmm\n</think>\n\nyes", None, RegenOptions(thinking="drop")) == "yes"
    assert shape_answer("yes", "hmm", RegenOptions(thinking="keep")) == "<think>\nhmm\n</think>\n\nyes"
    assert shape_answer("yes", "hmm", RegenOptions(thinking="drop")) == "yes"
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    rows = [{"id": "t", "tools": [{"type": "function", "function": {"name": "lookup"}}], "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "def f():"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "old answer"}]},
        {"id": "plain", "messages": [{"role": "user", "content": "def g():"},
                                     {"role": "assistant", "content": "old"}]}]
    src = tmp_path / "tools.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = Target.load(str(tiny_target_dir), device="cpu")
    opts = RegenOptions(max_new_tokens=8)
    report = run_regenerate(src, tmp_path / "out.jsonl", LocalBackend(target, opts, 2), opts)
    assert (report.finished, report.failed, report.turns) == (2, 0, 2)
    out = {r["id"]: r for r in read_out(tmp_path / "out.jsonl")}
    msgs = out["t"]["messages"]
    assert msgs[:4] == rows[0]["messages"][:4] and out["t"]["tools"] == rows[0]["tools"]
    assert msgs[4]["role"] == "assistant" and msgs[4]["content"] != "old answer"
    skip = RegenOptions(max_new_tokens=8, tools="skip")
    report = run_regenerate(src, tmp_path / "skip.jsonl", LocalBackend(target, skip, 2), skip)
    assert (report.finished, report.skipped_tools) == (1, 1)
    other = RegenOptions(max_new_tokens=9)
    with pytest.raises(RegenerateError, match="other options"):
        run_regenerate(src, tmp_path / "out.jsonl", LocalBackend(target, other, 2), other)


def _regenerate_cmd(out: Path, *backend: str) -> list[str]:
    return [sys.executable, "-m", "specheads", "regenerate", str(SLICE), "--out", str(out),
            "--max-new-tokens", "8", "--limit", "20", *backend]


def test_regenerate_through_server_survives_sigkill_and_matches_local(tiny_target_dir, random_export_dir,
                                                                      tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, url = start_server(["--target", str(tiny_target_dir), "--draft", str(random_export_dir),
                              "--device", "cpu"])
    try:
        out = tmp_path / "regen.jsonl"
        cmd = _regenerate_cmd(out, "--endpoint", url, "--concurrency", "2", "--retries", "1")
        victim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        index = Path(str(out) + ".index")
        deadline = time.monotonic() + 600  # generous for a loaded machine; the index decides
        while time.monotonic() < deadline and victim.poll() is None:
            if index.exists() and index.read_text().count("\n") >= 3:
                break
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait() == -signal.SIGKILL
        killed_at = len(read_index(out)[0])
        assert 3 <= killed_at < 20, "the kill must land in the middle of the run"
        from specheads.regenerate_command import main  # the resumed run: same command, in-process

        assert main(cmd[4:]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["resumed"] == killed_at and report["finished"] == 20 - killed_at
        assert report["failed"] == 0 and report["rows"] == 20
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    served = read_out(out)
    ids = [r.id for r in read_rows(SLICE, limit=20)]
    assert sorted(r["id"] for r in served) == sorted(ids) and len(served) == 20  # nothing lost or twice
    meta = json.loads(Path(str(out) + ".meta.json").read_text())
    assert meta["options"]["max_new_tokens"] == 8 and meta["report"]["finished"] == 20 - killed_at
    assert meta["target"]["tokenizer_sha256"]  # the server's target fingerprint is recorded

    local_out = tmp_path / "local.jsonl"
    opts = RegenOptions(max_new_tokens=8)
    target = Target.load(str(tiny_target_dir), device="cpu")
    report = run_regenerate(SLICE, local_out, LocalBackend(target, opts, 8), opts, limit=20)
    local = {r["id"]: r for r in read_out(local_out)}
    assert report.finished == 20 and report.truncated == sum(
        r["regenerated"]["truncated_turns"] > 0 for r in local.values())
    source = {r.id: r for r in read_rows(SLICE)}
    for row in served:
        # greedy speculative decoding behind the server == greedy generate in this process
        assert row["messages"] == local[row["id"]]["messages"], row["id"]
        roles = [m["role"] for m in row["messages"]]
        assert roles == [m["role"] for m in source[row["id"]].messages]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert users == [m["content"] for m in source[row["id"]].messages if m["role"] == "user"]


SHARED = Path(os.environ.get("SPECHEADS_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.mark.skipif(not (SHARED / "sharegpt_dummy_conversations.json").is_file(),
                    reason="the public ShareGPT sample is not present (optional data)")
def test_regenerate_public_sharegpt_sample(tiny_target_dir, tmp_path):
    """The public FastChat ShareGPT sample, multi-turn, through the local backend."""
    src = SHARED / "sharegpt_dummy_conversations.json"
    opts = RegenOptions(max_new_tokens=8)
    target = Target.load(str(tiny_target_dir), device="cpu")
    report = run_regenerate(src, tmp_path / "out.jsonl", LocalBackend(target, opts, 8), opts, limit=12)
    assert report.finished == 12 and report.failed == 0
    source = {r.id: r for r in read_rows(src, limit=12)}
    for row in read_out(tmp_path / "out.jsonl"):
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in source[row["id"]].messages]


def test_local_rows_are_yielded_per_batch_and_resume_counts_all_runs(tiny_target_dir, tmp_path):
    """A finished row leaves the local backend after its own batch (so it is written before the
    next batch runs); after a resume meta.json's `all_runs` counts every run's truncations."""
    target = Target.load(str(tiny_target_dir), device="cpu")
    opts = RegenOptions(max_new_tokens=3)  # every answer is cut: every row counts as truncated
    rows = read_rows(SLICE)
    single = [r for r in rows if sum(m["role"] == "assistant" for m in r.messages) == 1][:6]
    calls, plain = [], generate_batch(target, opts)
    it = LocalBackend(target, opts, 2, lambda prompts, n: calls.append(len(prompts)) or plain(prompts, n)).run_iter(single)
    first = [next(it), next(it)]
    assert calls == [2], calls  # two rows out after the first batch of two, nothing else run
    assert all(r["regenerated"]["truncated_turns"] == 1 for r in first)
    assert len(single) == 6 and len(list(it)) == 4 and calls == [2, 2, 2]
    out = tmp_path / "regen.jsonl"
    first_run = run_regenerate(SLICE, out, LocalBackend(target, opts, 4), opts, limit=5)
    second = run_regenerate(SLICE, out, LocalBackend(target, opts, 4), opts, limit=12)
    meta = json.loads(Path(str(out) + ".meta.json").read_text())
    assert (first_run.finished, second.resumed, second.finished) == (5, 5, 7)
    assert meta["report"]["truncated"] == second.truncated == 7  # this run only
    assert meta["all_runs"]["rows"] == 12 and meta["all_runs"]["truncated"] == 12
    assert meta["all_runs"]["turns"] == sum(r["regenerated"]["turns"] for r in read_out(out))


def test_speculative_regeneration_gives_plain_greedy_answers(tiny_target_dir, random_export_dir, tmp_path, capsys):
    """--draft: every answer comes from speculative decoding in a session, batched or one prompt at
    a time, and greedy answers are token for token those of batched plain generate; meta.json
    names the draft."""
    from specheads.regenerate_command import main

    common = [str(SLICE), "--max-new-tokens", "12", "--limit", "12", "--target", str(tiny_target_dir),
              "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "plain.jsonl"), "--batch-size", "4"]) == 0
    for size in ("3", "1"):
        assert main([*common, "--out", str(tmp_path / f"spec{size}.jsonl"), "--draft", str(random_export_dir),
                     "--batch-size", size]) == 0
        assert "speculation tau" in capsys.readouterr().err
    plain = {r["id"]: r for r in read_out(tmp_path / "plain.jsonl")}
    for size in ("3", "1"):
        spec = read_out(tmp_path / f"spec{size}.jsonl")
        assert len(spec) == len(plain) == 12
        assert sum(r["regenerated"]["turns"] for r in spec) > 12  # multi-turn rows: later turns see new answers
        for row in spec:
            assert row["messages"] == plain[row["id"]]["messages"], (size, row["id"])
            assert row["regenerated"] == plain[row["id"]]["regenerated"], (size, row["id"])
    meta = json.loads((tmp_path / "spec3.jsonl.meta.json").read_text())
    assert meta["backend"]["draft"] == str(Path(random_export_dir).resolve())
    assert "draft" not in json.loads((tmp_path / "plain.jsonl.meta.json").read_text())["backend"]


def test_speculative_batches_forward_their_prompts_together(tiny_target_dir, random_export_dir):
    """SessionDecoder hands a whole batch to one decode_many call with its batch size (rows share
    target forwards), and sums the decodes' counts for tau."""
    from specheads.regenerate_command import SessionDecoder
    from specheads.session import GREEDY, Session, load_draft

    target = Target.load(str(tiny_target_dir), device="cpu")
    session = Session(target, load_draft(random_export_dir, target), eos=[target.tokenizer.eos_token_id])
    calls, decode_many = [], session.decode_many
    session.decode_many = lambda prompts, n, sampling, size: calls.append((len(prompts), size)) or decode_many(
        prompts, n, sampling, size)
    decoder = SessionDecoder(session, RegenOptions(max_new_tokens=6), 3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    out = decoder(prompts, 6)
    assert calls == [(3, 3)] and len(out) == 3
    assert out == [greedy_decode(target, p, 6, eos_token_ids=[target.tokenizer.eos_token_id]).tokens for p in prompts]
    assert decoder.stats.tokens == sum(len(t) for t in out) and decoder.stats.summary()["tau"] >= 1.0
    with pytest.raises(ValueError, match="1 samplings for 3 prompts"):
        decode_many(prompts, 6, [GREEDY], 3)


def test_sampled_speculative_regeneration_is_seeded_per_prompt(tiny_target_dir, random_export_dir, tmp_path, capsys):
    """Sampled --draft answers are seeded per prompt (prompt_seed: --seed and the prompt's ids):
    the same at --batch-size 3 and 1 and equal to the prompt decoded alone with that seed; another
    --seed changes them; a run killed between rows and resumed writes the same rows."""
    from specheads.data.regenerate_turns import prompt_seed
    from specheads.regenerate_command import main
    from specheads.session import Session, load_draft
    from specheads.verify.settings import Sampling

    common = [str(SLICE), "--max-new-tokens", "10", "--target", str(tiny_target_dir), "--device", "cpu",
              "--draft", str(random_export_dir), "--temperature", "0.9", "--top-p", "0.95"]
    runs = {"b3": ["--batch-size", "3", "--limit", "8"], "b1": ["--batch-size", "1", "--limit", "8"],
            "seed": ["--batch-size", "3", "--limit", "8", "--seed", "5"],
            "resumed": ["--batch-size", "3", "--limit", "3"]}
    for name, extra in runs.items():
        assert main([*common, "--out", str(tmp_path / f"{name}.jsonl"), *extra]) == 0
    assert main([*common, "--out", str(tmp_path / "resumed.jsonl"), "--batch-size", "2", "--limit", "8"]) == 0
    capsys.readouterr()
    out = {name: {r["id"]: r["messages"] for r in read_out(tmp_path / f"{name}.jsonl")} for name in runs}
    assert out["b3"] == out["b1"] == out["resumed"] and len(out["b3"]) == 8
    assert out["seed"] != out["b3"]
    # the first answer of a row, decoded alone with its own seed
    target = Target.load(str(tiny_target_dir), device="cpu")
    session = Session(target, load_draft(random_export_dir, target), eos=[target.tokenizer.eos_token_id])
    row = read_rows(SLICE, limit=1)[0]
    first = next(i for i, m in enumerate(row.messages) if m["role"] == "assistant")
    ids = encode_chat(target.tokenizer, [dict(m) for m in row.messages[:first]], row.tools)
    alone = session.decode(ids, 10, Sampling(temperature=0.9, top_p=0.95, seed=prompt_seed(0, ids))).result.tokens
    eos = target.tokenizer.eos_token_id
    alone = alone[: alone.index(eos)] if eos in alone else alone
    assert out["b3"][row.id][first]["content"] == target.tokenizer.decode(alone, skip_special_tokens=True)
    assert prompt_seed(0, ids) != prompt_seed(0, ids + [1]) and prompt_seed(0, ids) != prompt_seed(1, ids)
