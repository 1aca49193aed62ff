"""What one client can cost a `specheads serve` process (real servers on loopback): a body that cannot
fit the context is refused before it is tokenised, bodies past --max-body-mb get 413, a small request
sent meanwhile is answered within a second, memory returns to about its level before; the periodic
throughput / acceptance line is written only after traffic."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from servers import launch, wait_listening

SMALL = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_target_dir, random_export_dir, tmp_path_factory):
    """(base URL, process, path of its stderr log): a draft, a throughput line every second."""
    log = tmp_path_factory.mktemp("limits") / "stderr.txt"
    with open(log, "w") as err:
        proc = launch(["--target", str(tiny_target_dir), "--draft", str(random_export_dir), "--device", "cpu",
                       "--log-interval", "1", "--max-body-mb", "16"], stderr=err)
    url = wait_listening(proc)
    yield url, proc, log
    proc.terminate()
    proc.wait(timeout=30)


def post(url: str, body: bytes, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def big_chat(megabytes: float) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "word " * int(megabytes * (1 << 20) / 5)}],
                       "max_tokens": 4}).encode()


def test_a_body_that_cannot_fit_is_refused_at_once_and_does_not_delay_another(server):
    url, proc, log = server
    assert post(url, json.dumps(SMALL).encode())[0] == 200  # warm
    before = rss_mb(proc.pid)
    big = big_chat(12)
    results = {}

    def send_big():
        t0 = time.monotonic()
        results["big"] = (*post(url, big), time.monotonic() - t0)

    threads = [threading.Thread(target=send_big) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    status, answer = post(url, json.dumps(SMALL).encode())
    small_s = time.monotonic() - t0
    for t in threads:
        t.join(120)
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert small_s < 1.5, small_s  # one second of waiting at most, plus its own short decode
    code, err, seconds = results["big"]
    assert code == 400 and err["error"]["param"] == "messages", err
    assert "at least" in err["error"]["message"] and "context is 256" in err["error"]["message"]
    assert seconds < 5, seconds  # refused from its length, not after tokenising 12 MB
    time.sleep(0.5)
    assert rss_mb(proc.pid) < before + 120, (before, rss_mb(proc.pid))
    assert "Traceback" not in log.read_text()


def test_a_body_past_the_cap_gets_413_naming_the_flag(server):
    """Answered from the Content-Length, before the body is read (a client library sending it meets a
    closed connection, so the headers go alone here)."""
    url, _, _ = server
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {17 << 20}\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and "--max-body-mb" in json.loads(body)["error"]["message"], reply


def test_the_throughput_line_follows_traffic_only(server):
    url, _, log = server
    assert post(url, json.dumps(SMALL).encode())[0] == 200
    time.sleep(2.5)
    lines = [line for line in log.read_text().splitlines() if "avg generation throughput" in line]
    assert lines and "tokens/s" in lines[-1] and "running: 0 reqs" in lines[-1], log.read_text()[-2000:]
    assert "mean acceptance length" in "".join(lines)  # a drafter's steps were counted
    time.sleep(2.5)  # idle: no new line
    assert len([line for line in log.read_text().splitlines() if "avg generation throughput" in line]) == len(lines)


def test_the_default_body_cap_is_stated_in_the_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specheads", "serve", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    assert "--max-body-mb" in out and "default 8.0" in " ".join(out.split()) and "--log-interval" in out


@pytest.fixture(scope="module")
def long_context_server(tiny_target_dir, tmp_path_factory):
    """The tiny target with a context of 1M tokens: a 4 MB prompt passes the character bound, so it is
    tokenised (seconds) before its token count refuses it."""
    import shutil

    folder = shutil.copytree(tiny_target_dir, tmp_path_factory.mktemp("long") / "tiny")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (folder / "config.json").write_text(json.dumps(config))
    proc = launch(["--target", str(folder), "--device", "cpu", "--log-interval", "0"])
    url = wait_listening(proc)
    yield url, proc
    proc.terminate()
    proc.wait(timeout=30)


def test_a_request_tokenised_for_seconds_does_not_hold_up_a_small_one(long_context_server):
    """The large body tokenises on its own lane (thread and tokenizer): small requests sent meanwhile are
    answered within a second; after it, the server's memory is back near where it was."""
    url, proc = long_context_server
    assert post(url, json.dumps(SMALL).encode())[0] == 200
    before = rss_mb(proc.pid)
    big = json.dumps({"messages": [{"role": "user", "content": "word another thing " * 230_000}]}).encode()
    result = {}
    sender = threading.Thread(target=lambda: result.update(big=post(url, big)))
    sender.start()
    time.sleep(1.0)  # the large one is being tokenised
    waits = []
    while sender.is_alive() and len(waits) < 5:
        t0 = time.monotonic()
        assert post(url, json.dumps(SMALL).encode())[0] == 200
        waits.append(time.monotonic() - t0)
    sender.join(180)
    code, err = result["big"]
    assert code == 400 and "tokens but the model's context is 1048576" in err["error"]["message"], err
    assert waits and max(waits) < 1.5, waits  # it was still tokenising while they were answered
    time.sleep(0.5)
    assert rss_mb(proc.pid) < before + 150, (before, rss_mb(proc.pid))


def test_large_requests_past_the_lanes_places_get_503(tiny_target_dir):
    from specheads.serve.engine import Engine
    from specheads.serve.lanes import MAX_LARGE_PENDING, SMALL_PROMPT_CHARS, lane_for, make_lanes
    from specheads.serve.scheduler import Overloaded
    from specheads.session import Session

    lanes = make_lanes(Engine(Session.open(str(tiny_target_dir), None, device="cpu")))
    large, small = lane_for(lanes, SMALL_PROMPT_CHARS + 1), lane_for(lanes, 100)
    for _ in range(MAX_LARGE_PENDING):
        large.enter()
    with pytest.raises(Overloaded, match="large requests") as err:
        large.enter()
    assert err.value.status == 503 and err.value.retry_after > 0
    small.enter()  # small requests keep their own places
    for lane in lanes.values():
        lane.pool.shutdown()
