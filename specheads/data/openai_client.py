"""A small client for OpenAI-compatible servers (vLLM, SGLang, `specheads serve`) on urllib.

Every request has a timeout; connection errors, timeouts, 429 and 5xx answers are retried with
exponential backoff (with jitter); other 4xx answers fail at once (retrying cannot help).
"""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


class EndpointError(ValueError):
    """The server refused a request or stayed unreachable after the retries."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to call: base URL (…/v1 added if missing), timeouts and retries."""

    url: str
    api_key: str | None = None
    timeout: float = 120.0  # seconds per request
    retries: int = 4  # attempts after the first
    backoff: float = 1.0  # seconds before the first retry; doubles each time (capped at 30)

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


def _once(ep: Endpoint, path: str, body: dict | None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(ep.base + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if ep.api_key:
        req.add_header("Authorization", f"Bearer {ep.api_key}")
    with urllib.request.urlopen(req, timeout=ep.timeout) as resp:
        return json.loads(resp.read())


def _retryable(err: Exception) -> bool:
    if isinstance(err, urllib.error.HTTPError):
        return err.code == 429 or err.code >= 500
    return isinstance(err, (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                            json.JSONDecodeError))


def _describe(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        try:
            detail = err.read().decode("utf-8", "replace")[:500]
        except OSError:
            detail = ""
        return f"HTTP {err.code} {err.reason}: {detail}".strip()
    return f"{type(err).__name__}: {err}"


def call(ep: Endpoint, path: str, body: dict | None = None) -> dict:
    """GET (body None) or POST `path` under the base URL -> the JSON answer, with retries."""
    for attempt in range(ep.retries + 1):
        try:
            return _once(ep, path, body)
        except Exception as err:  # noqa: BLE001 - classified below
            if not _retryable(err):
                raise EndpointError(f"{ep.base}{path}: {_describe(err)}") from None
            if attempt == ep.retries:
                raise EndpointError(f"{ep.base}{path}: still failing after {ep.retries + 1} "
                                    f"attempts: {_describe(err)}") from None
            time.sleep(min(30.0, ep.backoff * 2 ** attempt) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")


def served_model(ep: Endpoint, name: str | None) -> dict:
    """The /v1/models entry to use: `name`, or the only/first model served."""
    models = call(ep, "/models").get("data") or []
    if name is None:
        if not models:
            raise EndpointError(f"{ep.base}/models lists no model")
        return models[0]
    for m in models:
        if m.get("id") == name:
            return m
    raise EndpointError(f"{ep.base} does not serve model '{name}'; it serves "
                        f"{[m.get('id') for m in models]}")


def chat(ep: Endpoint, body: dict) -> tuple[str, str | None, str]:
    """One non-streaming chat completion -> (content, reasoning or None, finish_reason)."""
    out = call(ep, "/chat/completions", {**body, "stream": False})
    try:
        choice = out["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"{ep.base}/chat/completions: unexpected answer {str(out)[:300]}") from None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    return msg.get("content") or "", reasoning, choice.get("finish_reason") or "stop"
