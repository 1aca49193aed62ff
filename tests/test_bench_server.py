"""`specheads bench` against real `specheads serve` processes on loopback (with and without a draft),
and against a lossy server (a proxy that changes some answers) that the greedy-match check catches."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from servers import launch, wait_listening

from specheads.eval.bench import main as bench_main
from specheads.eval.bench import parse_prometheus, percentile, run_bench

PROMPTS = ["def add(a, b):", "class Stack:", "def read_config(path):", "import os\n\ndef walk(root):",
           "def fib(n):", "def parse(line):"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def servers(tiny_target_dir, random_export_dir):
    """(speculative URL, baseline URL): the same tiny target served with and without the draft
    (both processes start at once)."""
    procs = [launch(["--target", str(tiny_target_dir), "--draft", str(random_export_dir)]),
             launch(["--target", str(tiny_target_dir)])]
    try:
        yield tuple(wait_listening(p) for p in procs)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def local_counts(tiny_target_dir, random_export_dir) -> dict:
    """What the built-in verifier counts for the same prompts, settings and draft length."""
    from specheads.data.prompts import encode_chat
    from specheads.session import Session

    session = Session.open(str(tiny_target_dir), random_export_dir, dtype="float32", device="cpu")
    drafts = proposed = accepted = 0
    for text in PROMPTS:
        ids = encode_chat(session.target.tokenizer, [{"role": "user", "content": text}])
        res = session.decode(ids, MAX_TOKENS).result
        drafts += res.stats.drafts
        proposed += res.stats.proposed_tokens
        accepted += sum(res.stats.accepted_per_pos)
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted}


def test_bench_reports_every_figure(servers, prompts_file, tmp_path, tiny_target_dir, random_export_dir):
    spec_url, base_url = servers
    report = run_bench(spec_url, str(prompts_file), str(tmp_path / "out"), base_url, concurrency=[8, 1],
                       max_tokens=MAX_TOKENS, match_sample=4, progress=False)
    assert report["concurrency"] == [1, 8]
    rows = {(r["label"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(label, c) for label in ("speculative", "baseline") for c in (1, 8)}
    for row in rows.values():
        assert row["requests"] == len(PROMPTS) and row["failed"] == 0, row["errors"]
        assert 0 < row["output_tokens"] <= len(PROMPTS) * MAX_TOKENS
        assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "latency_ms"):
            s = row[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert row["ttft_ms"]["p50"] <= row["latency_ms"]["p50"]
    # acceptance from the server's Prometheus counters equals the verifier's own counts
    want = local_counts(tiny_target_dir, random_export_dir)
    for c in (1, 8):
        acc = rows[("speculative", c)]["acceptance"]
        assert acc["source"] == "vllm" and {k: acc[k] for k in want} == want
        assert acc["acceptance_length"] == pytest.approx(1 + want["accepted_tokens"] / want["drafts"])
        assert len(acc["per_position"]) >= 1
        assert rows[("baseline", c)]["acceptance"]["drafts"] == 0
    assert set(report["speedup"]) == {"1", "8"}
    assert report["greedy_match"] == {"sample": 4, "matched": 4, "rate": 1.0, "mismatches": []}
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["results"] == report["results"]
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| speculative | 8 |" in md and "4 / 4 identical — lossless on this sample" in md


class LossyProxy(BaseHTTPRequestHandler):
    """Forwards to `server.upstream`; changes one character of every non-streamed answer."""

    def log_message(self, *args) -> None:
        pass

    def _forward(self, body: bytes | None) -> None:
        req = urllib.request.Request(self.server.upstream + self.path, data=body,
                                     method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            data, ctype = resp.read(), resp.headers.get("Content-Type", "application/json")
        if body is not None and not json.loads(body).get("stream"):
            obj = json.loads(data)
            msg = obj["choices"][0]["message"]
            text = msg["content"]
            msg["content"] = text[: len(text) // 2] + "\u00a7" + text[len(text) // 2 + 1:]
            data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        self._forward(self.rfile.read(int(self.headers["Content-Length"])))


def test_greedy_match_catches_a_lossy_server(servers, prompts_file, tmp_path):
    spec_url, base_url = servers
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), LossyProxy)
    proxy.upstream = spec_url
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        code = bench_main(["--url", url, "--baseline-url", base_url, "--prompts", str(prompts_file),
                           "--concurrency", "1", "--max-tokens", str(MAX_TOKENS), "--num-prompts", "3",
                           "--match-sample", "3", "--out", str(tmp_path), "--no-progress"])
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert code == 1
    gm = json.loads((tmp_path / "bench.json").read_text())["greedy_match"]
    assert gm["matched"] == 0 and gm["sample"] == 3 and len(gm["mismatches"]) == 3
    assert "NOT LOSSLESS" in (tmp_path / "bench.md").read_text()


class FlakyProxy(BaseHTTPRequestHandler):
    """Forwards to `server.upstream`; of the streamed requests, the 2nd gets a 500 and the 3rd a
    stream cut off before [DONE] (a server that drops requests)."""

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        with urllib.request.urlopen(self.server.upstream + self.path, timeout=60) as resp:
            self._reply(200, resp.read(), resp.headers.get("Content-Type", "text/plain"))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if json.loads(body).get("stream"):
            with self.server.lock:
                self.server.streams += 1
                n = self.server.streams
            if n == 2:
                err = {"error": {"message": "injected failure", "type": "InternalServerError",
                                 "param": None, "code": 500}}
                return self._reply(500, json.dumps(err).encode(), "application/json")
        req = urllib.request.Request(self.server.upstream + self.path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            data, ctype = resp.read(), resp.headers.get("Content-Type", "application/json")
        if json.loads(body).get("stream") and n == 3:
            data = data[: data.index(b"data: [DONE]")]
        self._reply(200, data, ctype)


def test_bench_reports_failed_requests_and_exits_nonzero(servers, prompts_file, tmp_path, capsys):
    spec_url, base_url = servers
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), FlakyProxy)
    proxy.upstream, proxy.streams, proxy.lock = spec_url, 0, threading.Lock()
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        code = bench_main(["--url", url, "--baseline-url", base_url, "--prompts", str(prompts_file),
                           "--concurrency", "1,2", "--max-tokens", "4", "--num-prompts", "3",
                           "--match-sample", "2", "--out", str(tmp_path), "--no-progress"])
    finally:
        proxy.shutdown()
        proxy.server_close()
    term = capsys.readouterr()
    assert code == 1
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["label"], r["concurrency"]): r for r in report["results"]}
    assert rows[("speculative", 1)]["failed"] == 2 and rows[("speculative", 2)]["failed"] == 0
    assert report["failed_requests"] == 2 and all(rows[("baseline", c)]["failed"] == 0 for c in (1, 2))
    errors = rows[("speculative", 1)]["errors"]
    assert any("HTTP 500: injected failure" in e for e in errors) and any("[DONE]" in e for e in errors)
    # no speed-up from the partial level; the complete one keeps its figure
    assert set(report["speedup"]) == {"2"}
    md = (tmp_path / "bench.md").read_text()
    assert "| speculative | 1 | 1 / 3 **2 FAILED** |" in md and "1: not computed (requests failed)" in md
    assert "2 requests FAILED" in md and "2: " in md.split("Speed-up")[1]
    assert "speculative @ concurrency 1: 2 of 3 requests FAILED" in term.err
    assert "HTTP 500: injected failure" in term.err and "Traceback" not in term.err


def test_prometheus_parsing_and_percentiles():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 10',
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="1"} 5',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="1"} 3',
        "sglang:spec_accept_length 2.5",
    ])
    samples = parse_prometheus(text)
    assert ("vllm:spec_decode_num_drafts", {"model_name": "m", "engine": "1"}, 5.0) in samples
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos",
            {"model_name": "m", "engine": "0", "position": "1"}, 3.0) in samples
    assert ("sglang:spec_accept_length", {}, 2.5) in samples
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
