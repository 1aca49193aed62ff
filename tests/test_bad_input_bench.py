"""Bad input to `specheads bench`, run as a real process: each error names the flag or file, exits
non-zero without a traceback, and writes nothing. Options are checked before any prompt is read
or server asked, so these cases need no server and no torch import (they take well under a
second each, except the prompt-file ones)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "specheads", "bench", *args],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "def f(x):"}) + "\n")
    return path


URL = "http://127.0.0.1:9"
CASES = {
    # id: (arguments besides --prompts / --out, exit code, words in stderr)
    "concurrency_words": (["--url", URL, "--concurrency", "a,b"], 1, "--concurrency 'a,b'"),
    "concurrency_zero": (["--url", URL, "--concurrency", "0,8"], 1, "--concurrency"),
    "concurrency_empty_item": (["--url", URL, "--concurrency", "1,,8"], 1, "--concurrency '1,,8'"),
    "max_tokens_zero": (["--url", URL, "--max-tokens", "0"], 1, "--max-new-tokens must be >= 1"),
    "max_tokens_text": (["--url", URL, "--max-tokens", "many"], 2, "--max-tokens"),
    "num_prompts_zero": (["--url", URL, "--num-prompts", "0"], 1, "--num-prompts must be >= 1"),
    "match_sample_negative": (["--url", URL, "--match-sample", "-1"], 1, "--match-sample must be >= 0"),
    "timeout_zero": (["--url", URL, "--timeout", "0"], 1, "--timeout"),
    "temperature_nan": (["--url", URL, "--temperature", "nan"], 1, "--temperature"),
    "temperature_negative": (["--url", URL, "--temperature", "-1"], 1, "--temperature"),
    "url_not_http": (["--url", "ftp://127.0.0.1/x"], 1, "--url 'ftp://127.0.0.1/x'"),
    "url_bad_port": (["--url", "http://127.0.0.1:99999"], 1, "--url 'http://127.0.0.1:99999'"),
    "baseline_url_no_host": (["--url", URL, "--baseline-url", "http://"], 1, "--baseline-url"),
    "api_unknown": (["--url", URL, "--api", "responses"], 2, "--api"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_option_names_the_flag(case, prompts, tmp_path):
    args, code, words = CASES[case]
    proc = bench([*args, "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_prompts_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = bench(["--url", URL, "--prompts", str(missing), "--out", str(tmp_path / "out")])
    assert proc.returncode == 1 and str(missing) in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_broken_prompts_line_is_named_before_any_server_is_asked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    # the URL is unreachable: the file's error must come first
    proc = bench(["--url", f"http://127.0.0.1:{closed_port()}", "--prompts", str(bad),
                  "--out", str(tmp_path / "out")])
    assert proc.returncode == 1 and f"{bad}:2" in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_unreachable_server_is_named(prompts, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    proc = bench(["--url", url, "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    assert proc.returncode == 1 and f"{url}/v1/models" in proc.stderr and "is the server up" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
