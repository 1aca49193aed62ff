"""`specheads serve` under load, on loopback only, with a bounded number of requests and time:
64 concurrent streaming clients all succeed, decoded in batches, while /health keeps answering; a
full queue answers 503 with Retry-After (never a dropped connection); a streaming client that goes
away leaves the batch and frees its row without changing the other rows' answers. The server's
stderr never holds a traceback."""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest
from servers import launch, wait_listening

from specheads.serve.metrics import parse_metrics

CLIENTS = 64
MAX_TOKENS = 8
RUNNING = 'vllm:num_requests_running{engine="0",model_name="tiny"}'


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


def request(url: str, method: str, path: str, body: dict | None = None, timeout: float = 60.0):
    """One request on its own connection -> (status, headers, body text)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read().decode()  # headers: case-insensitive
    finally:
        conn.close()


def stream_ok(status: int, text: str) -> str | None:
    """None when `text` is a complete, successful event stream; else what is wrong."""
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    if status != 200 or not events or events[-1] != "[DONE]":
        return f"status {status}, last event {events[-1:] or text[:200]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks) or chunks[-1].get("usage") is None:
        return f"bad chunks: {chunks[-2:]}"
    return None


@pytest.fixture(scope="module")
def server(varied_target_dir):
    proc = launch(["--target", str(varied_target_dir), "--device", "cpu", "--max-queue", "128",
                   "--max-batch", "8"])
    url = wait_listening(proc)
    yield proc, url
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def stderr_of(proc) -> str:
    proc.terminate()
    proc.wait(timeout=30)
    return proc.stderr.read()


def test_64_concurrent_streaming_clients_all_succeed_and_health_answers(server):
    proc, url = server
    before = parse_metrics(request(url, "GET", "/metrics")[2])
    failures, health, running = [], [], []
    start = threading.Barrier(CLIENTS + 1)

    def client(i: int) -> None:
        start.wait()
        try:
            status, _, text = request(url, "POST", "/v1/chat/completions",
                                      chat_body(f"def f{i}(x):", MAX_TOKENS, True))
            problem = stream_ok(status, text)
        except OSError as err:  # a reset or refused connection is a failure too
            problem = f"{type(err).__name__}: {err}"
        if problem:
            failures.append((i, problem))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    while any(t.is_alive() for t in threads) and time.perf_counter() - t0 < 120:
        h0 = time.perf_counter()
        status, _, text = request(url, "GET", "/health", timeout=10)
        health.append((status, text, time.perf_counter() - h0))
        running.append(parse_metrics(request(url, "GET", "/metrics", timeout=10)[2])[RUNNING])
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert not failures, failures[:5]
    assert len(health) >= 3 and all(s == 200 and json.loads(t) == {"status": "ok"} for s, t, _ in health)
    assert max(d for *_, d in health) < 2.0, health  # the decode does not block the event loop
    after = parse_metrics(request(url, "GET", "/metrics")[2])
    done = sum(after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total")
               and 'finished_reason="abort"' not in k)
    assert done == CLIENTS
    assert after[RUNNING] == 0 and 1 < max(running) <= 8, running  # decoded in batches of <= --max-batch


def test_full_queue_answers_503_with_retry_after(tiny_target_dir):
    """--max-batch 2 --max-queue 1: two requests decode, one waits, the rest are told to come back later."""
    proc = launch(["--target", str(tiny_target_dir), "--device", "cpu", "--max-queue", "1", "--max-batch", "2"])
    url = wait_listening(proc)
    try:
        results = []
        start = threading.Barrier(8)

        def client(i: int) -> None:
            start.wait()
            try:
                results.append(request(url, "POST", "/v1/chat/completions",
                                       chat_body(f"class C{i}:", 150, False)))
            except OSError as err:
                results.append((0, {}, f"{type(err).__name__}: {err}"))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = sorted(r[0] for r in results)
        assert set(codes) == {200, 503} and codes.count(200) >= 3, [r[:1] + r[2:] for r in results]
        for status, headers, text in results:
            if status == 503:
                err = json.loads(text)["error"]
                assert int(headers["Retry-After"]) >= 1 and "--max-queue 1" in err["message"]
                assert "--max-batch 2" in err["message"]
                assert err["code"] == 503 and err["type"] == "ServiceUnavailable"
            else:
                assert json.loads(text)["usage"]["completion_tokens"] == 150
        # the queue drained: a new request is served again
        assert request(url, "POST", "/v1/chat/completions", chat_body("def g():", 4, False))[0] == 200
    finally:
        err = stderr_of(proc)
    assert "Traceback" not in err, err


def test_client_that_goes_away_frees_the_decoder(server):
    proc, url = server
    abort = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    generated = 'vllm:generation_tokens_total{engine="0",model_name="tiny"}'
    before = parse_metrics(request(url, "GET", "/metrics")[2])
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = chat_body("def long(x):", 240, True)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # gone after the first event: ~240 tokens left undecoded
    t0 = time.perf_counter()
    status, _, text = request(url, "POST", "/v1/chat/completions", chat_body("def g():", 4, False))
    waited = time.perf_counter() - t0
    assert status == 200, text
    after = parse_metrics(request(url, "GET", "/metrics")[2])
    assert after[abort] - before[abort] == 1
    assert after[generated] - before[generated] == 4  # the abandoned decode counts no tokens
    # a decode of 240 tokens takes ~2 s here: the abandoned one stopped well before its end
    assert waited < 10, waited


def streamed(text: str) -> tuple[str, dict]:
    """(the text, the usage) of a complete chat event stream."""
    chunks = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]), chunks[-1]["usage"]


def test_a_client_going_away_mid_batch_leaves_the_other_answers_unchanged(server):
    """A streaming client disconnects while three others decode beside it: its row leaves the
    batch (counted as an abort) and the others' answers equal the same requests sent alone."""
    proc, url = server
    abort = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    bodies = [chat_body(f"def keep{i}(x):", 60 + 10 * i, True) for i in range(3)]
    alone = [streamed(request(url, "POST", "/v1/chat/completions", b)[2]) for b in bodies]
    before = parse_metrics(request(url, "GET", "/metrics")[2])
    u = urlparse(url)
    leaver = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    leaver.request("POST", "/v1/chat/completions", json.dumps(chat_body("def long(x):", 240, True)),
                   {"Content-Type": "application/json"})
    assert leaver.getresponse().status == 200
    started, texts = [threading.Event() for _ in bodies], [""] * len(bodies)

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(bodies[i]), {"Content-Type": "application/json"})
        lines = []
        for line in conn.getresponse():
            lines.append(line)
            if sum(x.startswith(b"data: ") for x in lines) >= 3:  # role chunk + two deltas: decoding
                started[i].set()
        texts[i] = b"".join(lines).decode()
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    decoding = [t.is_alive() for t in threads]
    leaver.close()  # gone mid-decode, beside the three others
    for t in threads:
        t.join(60)
    assert all(decoding), decoding
    assert [streamed(t) for t in texts] == alone
    after = parse_metrics(request(url, "GET", "/metrics")[2])
    assert after[abort] - before[abort] == 1


def test_server_stderr_has_no_traceback(server):
    """Runs last in this module: everything above left no traceback on the server's stderr."""
    proc, _ = server
    err = stderr_of(proc)
    assert "Traceback" not in err, err
