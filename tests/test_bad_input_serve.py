"""Bad input to `specheads serve`, against a real server process on loopback.

Every client error must come back as a 4xx JSON error in OpenAI's shape whose message and
`param` name the field; the connection is answered, never dropped; the server keeps serving; and
its stderr never holds a traceback. Raw sockets send what a well-behaved client library would
refuse to (NaN literals, a non-integer Content-Length, a body that never arrives).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from urllib.parse import urlparse

import pytest
from servers import launch, wait_listening

READ_TIMEOUT = 2  # seconds the server waits for a body or headers (--read-timeout)
MSG = [{"role": "user", "content": "def f(x):"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_target_dir, tmp_path_factory):
    """(base URL, path of the server's stderr log)."""
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with open(log, "w") as err:
        proc = launch(["--target", str(tiny_target_dir), "--device", "cpu",
                       "--read-timeout", str(READ_TIMEOUT)], stderr=err)
    url = wait_listening(proc)
    yield url, log
    proc.terminate()
    proc.wait(timeout=30)


def exchange(url: str, data: bytes, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Send raw bytes on a fresh connection; read until the server closes -> (status, headers, body)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply, "the server closed the connection without an answer"
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def http(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = {"Host": "127.0.0.1", "Connection": "close", "Content-Type": "application/json",
            "Content-Length": str(len(body)), **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post(path: str, obj) -> bytes:
    """json.dumps writes NaN / Infinity literals, which Python's json (and so the server) reads."""
    return http("POST", path, json.dumps(obj).encode())


CASES = {
    # id: (raw request, status, param, words in the message)
    "temperature_nan": (post(COMPLETIONS, {"prompt": "x", "temperature": float("nan")}), 400, "temperature", "finite"),
    "temperature_inf": (post(CHAT, {"messages": MSG, "temperature": float("inf")}), 400, "temperature", "finite"),
    "temperature_range": (post(COMPLETIONS, {"prompt": "x", "temperature": 5}), 400, "temperature", "[0, 2]"),
    "temperature_string": (post(COMPLETIONS, {"prompt": "x", "temperature": "hot"}), 400, "temperature", "number"),
    "top_p_nan": (post(COMPLETIONS, {"prompt": "x", "top_p": float("nan")}), 400, "top_p", "finite"),
    "top_p_zero": (post(COMPLETIONS, {"prompt": "x", "top_p": 0}), 400, "top_p", "lie in"),
    "max_tokens_1e30": (post(COMPLETIONS, {"prompt": "x", "max_tokens": 1e30}), 400, "max_tokens", "lie in"),
    "max_tokens_fraction": (post(CHAT, {"messages": MSG, "max_tokens": 2.5}), 400, "max_tokens", "integer"),
    "max_tokens_zero": (post(CHAT, {"messages": MSG, "max_tokens": 0}), 400, "max_tokens", "lie in"),
    "max_completion_tokens_bool": (post(CHAT, {"messages": MSG, "max_completion_tokens": True}), 400,
                                   "max_completion_tokens", "integer"),
    "seed_2_pow_70": (post(COMPLETIONS, {"prompt": "x", "seed": 2**70, "temperature": 1}), 400, "seed", "lie in"),
    "content_number": (post(CHAT, {"messages": [{"role": "user", "content": 5}]}), 400,
                       "messages[0].content", "string"),
    "content_image_part": (post(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                           400, "messages[0].content", "text parts"),
    "message_without_role": (post(CHAT, {"messages": [{"content": "hi"}]}), 400, "messages[0]", "role"),
    # json.dumps writes a lone surrogate as the escape "\ud800", as a careless client would
    "content_lone_surrogate": (post(CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}), 400,
                               "messages[0].content", "lone surrogate U+D800 at position 1"),
    "content_part_lone_surrogate": (post(CHAT, {"messages": [MSG[0], {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]}), 400,
        "messages[1].content[1].text", "lone surrogate U+DFFF at position 0"),
    "tool_arguments_lone_surrogate": (post(CHAT, {"messages": [MSG[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"x": "\udc80"}'}}]}]}), 400,
        "messages[1].tool_calls[0].function.arguments", "lone surrogate U+DC80 at position 7"),
    "tools_lone_surrogate": (post(CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "description": "x\ud83d"}}]}), 400,
        "tools[0].function.description", "lone surrogate U+D83D at position 1"),
    "prompt_lone_surrogate": (post(COMPLETIONS, {"prompt": "def f\udc00"}), 400, "prompt",
                              "lone surrogate U+DC00 at position 5"),
    "role_unknown": (post(CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role",
                     "unknown role 'wizard'; expected one of system, developer, user, assistant, tool"),
    "role_unknown_later": (post(CHAT, {"messages": [MSG[0], {"role": "User", "content": "hi"}]}), 400,
                           "messages[1].role", "unknown role 'User'"),
    "messages_empty": (post(CHAT, {"messages": []}), 400, "messages", "non-empty"),
    "tools_string": (post(CHAT, {"messages": MSG, "tools": "search"}), 400, "tools", "list"),
    "tools_without_function": (post(CHAT, {"messages": MSG, "tools": [{"type": "function"}]}), 400,
                               "tools[0]", "function"),
    "tools_parameters_list": (post(CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]}), 400,
        "tools[0].function.parameters", "schema"),
    "template_kwargs_list": (post(CHAT, {"messages": MSG, "chat_template_kwargs": [1]}), 400,
                             "chat_template_kwargs", "object"),
    "stop_numbers": (post(COMPLETIONS, {"prompt": "x", "stop": [1, 2]}), 400, "stop", "strings"),
    "stream_string": (post(COMPLETIONS, {"prompt": "x", "stream": "yes"}), 400, "stream", "true or false"),
    "stream_options_list": (post(COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": [1]}), 400,
                            "stream_options", "object"),
    "n_two": (post(COMPLETIONS, {"prompt": "x", "n": 2}), 400, "n", "not supported"),
    "prompt_ids_outside_vocab": (post(COMPLETIONS, {"prompt": [1, 10**9]}), 400, "prompt", "token ids"),
    "prompt_empty": (post(COMPLETIONS, {"prompt": ""}), 400, "prompt", "non-empty"),
    "prompt_too_long": (post(COMPLETIONS, {"prompt": "x " * 400}), 400, "prompt", "context"),
    "unknown_model": (post(COMPLETIONS, {"prompt": "x", "model": "gpt-9"}), 404, "model", "gpt-9"),
    "unknown_model_lone_surrogate": (post(COMPLETIONS, {"prompt": "x", "model": "gpt\ud800"}), 404, "model",
                                     "model 'gpt\\ud800' does not exist"),
    "max_tokens_beyond_context": (post(COMPLETIONS, {"prompt": "x", "max_tokens": 100000}), 400, "max_tokens",
                                  "too large: 100000"),
    "max_completion_tokens_beyond_context": (post(CHAT, {"messages": MSG, "max_completion_tokens": 300}), 400,
                                             "max_completion_tokens", "too large: 300"),
    "prompt_chars_cannot_fit": (post(COMPLETIONS, {"prompt": "x" * 200_000}), 400, "prompt", "at least"),
    "messages_chars_cannot_fit": (post(CHAT, {"messages": [{"role": "user", "content": "x" * 200_000}]}), 400,
                                  "messages", "at least"),
    "tool_choice_required": (post(CHAT, {"messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}}]}), 400, "tool_choice", "required"),
    "tool_choice_unknown_tool": (post(CHAT, {"messages": MSG, "tool_choice": {"type": "function", "function": {
        "name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "tool_choice", "not in"),
    "tool_choice_without_tools": (post(CHAT, {"messages": MSG, "tool_choice": "auto"}), 400, "tool_choice",
                                  "needs 'tools'"),
    "tool_choice_named_without_tools": (post(CHAT, {"messages": MSG, "tool_choice": {"type": "function",
                                        "function": {"name": "f"}}}), 400, "tool_choice", "none given"),
    "tool_choice_number": (post(CHAT, {"messages": MSG, "tool_choice": 3}), 400, "tool_choice", "must be"),
    "malformed_json": (http("POST", CHAT, b'{"messages": [}'), 400, "body", "not valid JSON"),
    "json_array_body": (http("POST", CHAT, b"[1, 2]"), 400, "body", "JSON object"),
    "deeply_nested_json": (http("POST", CHAT, b"[" * 100_000 + b"]" * 100_000), 400, "body", "JSON"),
    "empty_body": (http("POST", COMPLETIONS, b""), 400, "body", "JSON object"),
    "content_length_not_integer": (http("POST", CHAT, b"{}", {"Content-Length": "abc"}), 400,
                                   "Content-Length", "Content-Length"),
    "content_length_huge": (http("POST", CHAT, b"{}", {"Content-Length": str(10**12)}), 413,
                            "Content-Length", "at most"),
    "body_never_arrives": (http("POST", CHAT, b'{"messages"', {"Content-Length": "500"}), 408,
                           "body", "did not arrive"),
    "unknown_route": (http("GET", "/v1/nothing"), 404, None, "/v1/nothing"),
    "get_on_post_route": (http("GET", CHAT), 405, None, CHAT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_a_json_4xx_naming_the_field(server, case):
    url, log = server
    raw, status, param, words = CASES[case]
    code, headers, body = exchange(url, raw)
    assert code == status, body
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and words in err["message"], err
    if param and param != "body":
        assert param.split("[")[0] in err["message"] or param in err["message"], err
    assert "Traceback" not in log.read_text()
    # the server is still answering
    assert exchange(url, http("GET", "/health"))[0] == 200


def test_lone_surrogate_message_says_what_and_what_to_do(server):
    """The whole message, not the tokenizer's `TypeError: TextEncodeInput must be Union[...]`."""
    url, _ = server
    raw = http("POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    code, _, body = exchange(url, raw)
    assert code == 400
    assert json.loads(body)["error"]["message"] == (
        "'messages[0].content': lone surrogate U+D800 at position 1 (counting from 0): half of a "
        "UTF-16 surrogate pair, not a character, so it cannot be tokenized; remove it or write the "
        "character meant (one outside the BMP as a whole pair, e.g. \\ud83d\\ude00)")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "smile \U0001F600 caf\u00e9"}],  # sent as the escapes \ud83d\ude00
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
     {"role": "assistant", "content": "return x"}, {"role": "user", "content": "and g?"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
])
def test_good_messages_are_still_answered(server, messages):
    """Characters outside the BMP (a whole surrogate pair in JSON) and every accepted role pass."""
    url, log = server
    code, _, body = exchange(url, post(CHAT, {"messages": messages, "max_tokens": 2, "temperature": 0}))
    assert code == 200, body
    assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    assert "Traceback" not in log.read_text()


def test_headers_that_never_complete_get_408(server):
    url, log = server
    code, _, body = exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", timeout=READ_TIMEOUT + 20)
    assert code == 408 and "did not arrive" in json.loads(body)["error"]["message"]
    # the same on a kept-alive connection, after a first request was answered
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=READ_TIMEOUT + 20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'{"status":"ok"}' not in first:
            first += sock.recv(65536)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    assert rest.startswith(b"HTTP/1.1 408") and b"did not arrive" in rest, rest
    assert "Traceback" not in log.read_text()


def test_port_in_use_is_named_before_the_target_loads(tmp_path):
    """The port is checked first: with a target folder that does not even exist, the error is
    about the port (so a real target would not have been loaded for nothing)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "specheads", "serve", "--target",
                               str(tmp_path / "no-such-target"), "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=120)
    finally:
        holder.close()
    assert proc.returncode == 1
    assert f"port {port}" in proc.stderr and "already in use" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr and "no-such-target" not in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], "--port 70000"),
    (["--port", "0", "--max-queue", "-1"], "--max-queue"),
    (["--port", "0", "--max-batch", "0"], "--max-batch must be an integer >= 1"),
    (["--port", "0", "--max-batch", "-3"], "--max-batch must be an integer >= 1"),
    (["--port", "0", "--read-timeout", "0"], "--read-timeout"),
    (["--port", "0", "--host", "no-such-host.invalid"], "--host 'no-such-host.invalid'"),
])
def test_bad_serve_options_fail_fast_naming_the_flag(tmp_path, args, words):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "specheads", "serve", "--target",
                           str(tmp_path / "no-such-target"), *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_max_batch_that_is_not_an_integer_names_the_flag(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "specheads", "serve", "--target",
                           str(tmp_path / "no-such-target"), "--max-batch", "many"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "--max-batch" in proc.stderr and "'many'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
