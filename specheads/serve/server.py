"""`specheads serve`: an OpenAI-compatible HTTP server on the standard library's ThreadingHTTPServer.

Routes: POST /v1/chat/completions and /v1/completions (streaming as server-sent events in OpenAI's
chunk format, `stream_options.include_usage` honoured), GET /v1/models, /health and /metrics
(Prometheus, vLLM's metric names). Requests are decoded one at a time (the engine's lock); the
other routes answer while a request decodes. HTTP/1.0: one request per connection.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specheads.serve.engine import Engine, RequestError
from specheads.serve.metrics import CONTENT_TYPE, Metrics
from specheads.serve.protocol import (
    Responder, error_body, include_usage, parse_messages, parse_params, parse_prompt,
)

MAX_BODY = 64 << 20


class Handler(BaseHTTPRequestHandler):
    """Routes one HTTP request to the engine; `self.server.app` holds engine, metrics, info."""

    server_version = "specheads"
    _headers_sent = False

    def log_message(self, fmt, *args) -> None:  # quiet unless --log-requests
        if self.server.app.get("log"):
            super().log_message(fmt, *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def do_GET(self) -> None:
        app, path = self.server.app, self.path.split("?")[0]
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/metrics":
            self._send(200, app["metrics"].render().encode(), CONTENT_TYPE)
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [app["model_card"]]})
        else:
            self._json(404, error_body(f"no route GET {path}", 404))

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, error_body(f"no route POST {path}", 404))
            return
        try:
            body = self._body()
            ids, params, chat = self._prepare(body, path.endswith("chat/completions"))
        except RequestError as err:
            self._json(400, error_body(str(err), 400))
            return
        self._complete(body, ids, params, chat)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n <= 0 or n > MAX_BODY:
            raise RequestError("the request needs a JSON body (with a Content-Length)")
        try:
            body = json.loads(self.rfile.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _prepare(self, body: dict, chat: bool):
        """Body -> (prompt ids, Params, chat?), refusing what the engine cannot serve."""
        engine: Engine = self.server.app["engine"]
        model = body.get("model")
        if model not in (None, engine.model_name):
            raise RequestError(f"model '{model}' is not served here; this server serves "
                               f"'{engine.model_name}'")
        params = parse_params(body)
        if chat:
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise RequestError("'chat_template_kwargs' must be an object")
            ids = engine.chat_ids(parse_messages(body), body.get("tools"), kwargs)
        else:
            ids = engine.text_ids(parse_prompt(body))
        if max(ids, default=0) >= engine.target.vocab_size or min(ids, default=0) < 0:
            raise RequestError(f"prompt token ids must lie in 0..{engine.target.vocab_size - 1}")
        engine.budget(ids, params)  # context check before any response is started
        return ids, params, chat

    def _complete(self, body: dict, ids, params, chat: bool) -> None:
        app = self.server.app
        engine, metrics = app["engine"], app["metrics"]
        responder = Responder(chat, engine.model_name)
        metrics.change_running(1)
        try:
            if body.get("stream"):
                done = self._stream(responder, ids, params, include_usage(body))
            else:
                done = self._record(engine.complete(ids, params))
                self._json(200, responder.full(done))
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            metrics.record_abort()
            return
        except Exception as err:  # noqa: BLE001 - reported to the client, server keeps serving
            metrics.record_abort()
            if not self._headers_sent:
                self._json(500, error_body(f"{type(err).__name__}: {err}", 500))
            else:
                self._event({"error": error_body(str(err), 500)["error"]})
            return
        finally:
            metrics.change_running(-1)

    def _record(self, done):
        """Count a finished request before its last bytes go out (a scrape after it sees it)."""
        self.server.app["metrics"].record(done.stats, done.prompt_tokens, len(done.tokens),
                                          done.finish_reason)
        return done

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, responder: Responder, ids, params, with_usage: bool):
        """Server-sent events: role chunk, text deltas, finish chunk, [usage chunk], [DONE]."""
        self.send_response(200)
        self._headers_sent = True
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        if responder.chat:
            self._event(responder.chunk(role=True))
        done = self._record(self.server.app["engine"].complete(
            ids, params, emit=lambda text: self._event(responder.chunk(text))))
        self._event(responder.chunk(None, done.finish_reason))
        if with_usage:
            self._event(responder.usage_chunk(done))
        self._event("[DONE]")
        return done


def model_card(engine: Engine, draft: str | None) -> dict:
    """The /v1/models entry; `specheads` carries what regeneration records as provenance."""
    extra = {"target": engine.target.fingerprint(), "draft": draft,
             "speculation": engine.spec.describe() if engine.head is not None else None}
    return {"id": engine.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "specheads", "root": str(engine.target.path),
            "max_model_len": engine.context, "specheads": extra}


def build_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, draft: str | None = None,
                 log: bool = False) -> ThreadingHTTPServer:
    """A bound (not yet serving) server; port 0 picks a free port (`server.server_address`)."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.app = {"engine": engine, "metrics": Metrics(engine.model_name),
                  "model_card": model_card(engine, draft), "log": log}
    return server


def load_engine(target_path: str, draft: str | None, spec, device: str, dtype: str | None,
                model_name: str | None) -> Engine:
    """Target (+ exported draft, checked against it) -> Engine."""
    from specheads.generate import default_dtype, load_checked_draft
    from specheads.target import Target
    from specheads.verify.settings import check_tree_fits, with_default_k

    target = Target.load(target_path, dtype=dtype or default_dtype(device), device=device)
    head = None
    if draft:
        head, meta = load_checked_draft(draft, target)
        spec = with_default_k(spec, meta, head)
        check_tree_fits(spec, target)
    return Engine(target, head, spec, model_name or target.path.name)


def main(argv: list[str] | None = None) -> int:
    from specheads.verify.settings import add_tree_arguments, spec_from_args

    p = argparse.ArgumentParser(prog="specheads serve", description=(
        "Serve the target (with an exported draft, or plainly) behind an OpenAI-compatible API "
        "with Prometheus /metrics using vLLM's speculative-decoding metric names."))
    p.add_argument("--target", required=True, help="local HF model folder or builtin:tiny")
    p.add_argument("--draft", default=None, help="export folder from `specheads export` (default: none)")
    add_tree_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--served-model-name", default=None, help="default: the target folder's name")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--log-requests", action="store_true")
    a = p.parse_args(argv)
    engine = load_engine(a.target, a.draft, spec_from_args(a), a.device, a.dtype, a.served_model_name)
    server = build_server(engine, a.host, a.port, a.draft, a.log_requests)
    host, port = server.server_address[:2]
    print(f"specheads serve: model '{engine.model_name}' listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
