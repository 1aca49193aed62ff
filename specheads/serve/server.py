"""`specheads serve`: an OpenAI-compatible HTTP server on FastAPI + uvicorn.

Routes: POST /v1/chat/completions and /v1/completions (streaming as server-sent events in OpenAI's
chunk format, `stream_options.include_usage` honoured), GET /v1/models, /health and /metrics
(prometheus_client, vLLM's metric names).

Concurrent requests decode together on one decode thread (serve/scheduler.py: up to `--max-batch`
rows per target forward, joining and leaving at step boundaries), so the event loop keeps answering
/health, /metrics and new connections while they run. Requests beyond the batch wait in a bounded
FIFO (`--max-queue`); past it they get 503 with Retry-After. Every client error is a 4xx JSON error
in OpenAI's shape naming the field (`param`); bodies and headers that do not arrive within
`--read-timeout` get a 408. A streaming client that goes away leaves the batch at the next step.

One client cannot stall the others: bodies are capped (`--max-body-mb`, default 8), a prompt that
cannot fit the context is refused from its characters before it is tokenised (data/text_bound.py),
and prompts are tokenised on lanes of their own (serve/lanes.py: large bodies apart from small ones,
neither on the event loop nor the decode thread). Every `--log-interval` seconds after traffic, one
log line gives throughput and draft acceptance (serve/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specheads.cli_options import (
    mixing_from_args,
    spec_from_args,
)
from specheads.cli_parsers import serve_parser
from specheads.data.text_bound import text_chars
from specheads.mixing import Mixing
from specheads.serve.engine import Cancelled, Engine, Params, RequestError
from specheads.serve.lanes import lane_for, make_lanes
from specheads.serve.metrics import CONTENT_TYPE, Metrics, ThroughputLog
from specheads.serve.protocol import (
    Responder,
    error_body,
    include_usage,
    parse_messages,
    parse_params,
    parse_prompt,
    parse_template_kwargs,
    parse_tool_choice,
    parse_tools,
)
from specheads.serve.scheduler import Overloaded, Scheduler
from specheads.serve.transport import ServeError, bind, protocol_class, read_body, url_of
from specheads.session import Session
from specheads.verify.ragged import check_batch_attention
from specheads.verify.steps import DecodeError

MAX_BODY_MB = 8.0  # default cap on a request body: see ServeOptions.max_body_mb


@dataclass(frozen=True)
class ServeOptions:
    """Admission and timeouts of one server."""

    max_queue: int = 256  # requests waiting behind the batch; more get 503
    read_timeout: float = 30.0  # seconds for a request's headers, and again for its body
    log_requests: bool = False
    max_batch: int = 8  # requests decoding together (rows per target forward)
    # a 128K-token context of text is about 0.5-1.5 MB of JSON (~4 characters a token, 1-3 bytes each):
    # 8 MB leaves room for tool schemas and escaped text, and bounds what one request makes the server hold
    max_body_mb: float = MAX_BODY_MB
    log_interval: float = 10.0  # seconds between throughput / acceptance log lines (0: none)

    def __post_init__(self):
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ServeError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ServeError(f"--max-batch must be an integer >= 1 (1 decodes one request at a time), "
                             f"got {self.max_batch!r}")
        if not 0 < self.read_timeout < math.inf:
            raise ServeError(f"--read-timeout must be a positive number of seconds, "
                             f"got {self.read_timeout!r}")
        if not 0 < self.max_body_mb < math.inf:
            raise ServeError(f"--max-body-mb must be a positive number of megabytes, got {self.max_body_mb!r}")
        if not 0 <= self.log_interval < math.inf:
            raise ServeError(f"--log-interval must be a number of seconds >= 0 (0: no log line), "
                             f"got {self.log_interval!r}")

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def log(message: str) -> None:
    """One line on the server's stderr (server-side failures; never a traceback)."""
    print(f"specheads serve: {message}", file=sys.stderr, flush=True)


def model_card(engine: Engine, draft: str | None) -> dict:
    """The /v1/models entry; `specheads` carries what regeneration records as provenance."""
    fingerprint = {k: v for k, v in engine.target.fingerprint().items() if k != "embedding_sketch"}  # 32x5 floats
    extra = {"target": fingerprint, "draft": draft,
             "speculation": engine.spec.describe() if engine.head is not None else None}
    return {"id": engine.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "specheads", "root": str(engine.target.path),
            "max_model_len": engine.context, "specheads": extra}


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def error_response(err: RequestError):
    headers = {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(err.retry_after)
    if err.status == 408:
        headers["Connection"] = "close"  # the rest of the body may still arrive: drop it
    return JSONResponse(error_body(str(err), err.status, err.param), err.status, headers=headers)


def check_batching(engine: Engine, max_batch: int) -> None:
    """Refuse --max-batch > 1 on a target whose attention kernel cannot decode ragged rows."""
    if max_batch > 1:
        try:
            check_batch_attention(engine.target.config)
        except DecodeError as err:
            raise ServeError(f"--max-batch {max_batch}: {err} (--max-batch 1)") from None


class Service:
    """The app's state and request handling: engine, metrics, queue, options."""

    def __init__(self, engine: Engine, draft: str | None, options: ServeOptions):
        self.engine, self.options = engine, options
        self.metrics = Metrics(engine.model_name)
        self.card = model_card(engine, draft)
        check_batching(engine, options.max_batch)
        self.scheduler = Scheduler(engine, self.metrics, options.max_queue, options.max_batch)
        # tokenizing (chat templates) off the event loop and the decode thread (serve/lanes.py)
        self.lanes = make_lanes(engine)
        self.throughput = ThroughputLog(self.metrics, options.log_interval, log)

    def prepare(self, body: dict, chat: bool, tokenizer) -> tuple[list[int], Params]:
        """Body -> (prompt ids, Params), refusing what the engine cannot serve (before any
        response is started; a prompt that cannot fit the context before it is tokenised)."""
        engine = self.engine
        model = body.get("model")
        if model is not None and model != engine.model_name:
            raise RequestError(f"The model '{model}' does not exist: this server serves "
                               f"'{engine.model_name}'", "model", 404)
        params = parse_params(body)
        if chat:
            field, messages, tools = "messages", parse_messages(body), parse_tools(body)
            parse_tool_choice(body, tools)
            engine.check_chars(text_chars(messages), field)
            ids = engine.chat_ids(messages, tools, parse_template_kwargs(body), tokenizer)
        else:
            field, prompt = "prompt", parse_prompt(body)
            engine.check_chars(len(prompt) if isinstance(prompt, str) else 0, field)
            ids = engine.text_ids(prompt, tokenizer)
        vocab = engine.target.vocab_size
        if max(ids, default=0) >= vocab or min(ids, default=0) < 0:
            raise RequestError(f"prompt token ids must lie in 0..{vocab - 1}", field)
        engine.budget(ids, params, field, "max_completion_tokens" if body.get("max_completion_tokens") is not None
                      else "max_tokens")
        return ids, params

    async def complete(self, request: Request, chat: bool):
        """POST /v1/(chat/)completions."""
        try:
            body, size = await read_body(request, self.options.read_timeout, self.options.max_body)
            stream, with_usage = body.get("stream"), include_usage(body)
            loop = asyncio.get_running_loop()
            lane = lane_for(self.lanes, size)
            lane.enter()
            try:
                ids, params = await loop.run_in_executor(lane.pool, lane.run, self.prepare, body, chat)
            finally:
                del body  # a large body's memory goes back before the answer
                lane.done(loop)
            self.scheduler.admit()
        except RequestError as err:
            return error_response(err)
        except Exception as err:  # noqa: BLE001 - a bug of ours: reported, the server keeps serving
            log(f"internal error preparing {request.url.path}: {type(err).__name__}: {err}")
            return JSONResponse(error_body(f"{type(err).__name__}: {err}", 500), 500)
        responder = Responder(chat, self.engine.model_name)
        if stream:
            # queued here, not in the generator: a client gone before the first byte never runs
            # the generator, and its place in the queue must still be given back
            texts: asyncio.Queue = asyncio.Queue()
            future, cancel = self.scheduler.submit(
                ids, params, lambda text: loop.call_soon_threadsafe(texts.put_nowait, text))
            future.add_done_callback(lambda _f: texts.put_nowait(None))  # after every text delta
            return StreamingResponse(self.events(responder, texts, future, cancel, with_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        future, _ = self.scheduler.submit(ids, params)
        try:
            done = await future
        except Exception as err:  # noqa: BLE001 - as above
            log(f"internal error decoding {responder.id}: {type(err).__name__}: {err}")
            return JSONResponse(error_body(f"{type(err).__name__}: {err}", 500), 500)
        return JSONResponse(responder.full(done))

    async def events(self, responder: Responder, texts: asyncio.Queue, future: asyncio.Future,
                     cancel: threading.Event, with_usage: bool):
        """Server-sent events: role chunk, text deltas (from `texts`, None after the last),
        finish chunk, [usage chunk], [DONE]."""
        try:
            if responder.chat:
                yield sse(responder.chunk(role=True))
            while (text := await texts.get()) is not None:
                yield sse(responder.chunk(text))
            done = future.result()
            yield sse(responder.chunk(None, done.finish_reason))
            if with_usage:
                yield sse(responder.usage_chunk(done))
            yield sse("[DONE]")
        except Cancelled:
            return
        except Exception as err:  # noqa: BLE001 - headers are sent: the error goes in the stream
            log(f"internal error decoding {responder.id}: {type(err).__name__}: {err}")
            yield sse({"error": error_body(f"{type(err).__name__}: {err}", 500)["error"]})
        finally:
            cancel.set()  # a client that went away frees the decoder at its next step

    def close(self) -> None:
        self.throughput.close()
        self.scheduler.close()
        for lane in self.lanes.values():
            lane.pool.shutdown(wait=False, cancel_futures=True)


def build_app(engine: Engine, draft: str | None = None, options: ServeOptions = ServeOptions()):
    """The FastAPI application (`app.state.service` holds the Service)."""
    service = Service(engine, draft, options)
    app = FastAPI(title="specheads serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await service.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.complete(request, chat=False)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        what = {404: "no route", 405: "method not allowed:"}.get(exc.status_code, exc.detail)
        return JSONResponse(error_body(f"{what} {request.method} {request.url.path}", exc.status_code),
                            exc.status_code, headers=getattr(exc, "headers", None))

    return app


def build_server(app, options: ServeOptions = ServeOptions()):
    """A uvicorn server for `app` (run it with `.run(sockets=[bind(host, port)])`)."""
    import uvicorn

    config = uvicorn.Config(app, http=protocol_class(options.read_timeout), lifespan="off",
                            log_level="info" if options.log_requests else "warning",
                            access_log=options.log_requests, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


@contextlib.contextmanager
def serve_in_thread(engine: Engine, host: str = "127.0.0.1", port: int = 0, draft: str | None = None,
                    options: ServeOptions = ServeOptions()):
    """Serve `engine` from a background thread (notebooks, tests) -> yields the base URL."""
    sock = bind(host, port)
    app = build_app(engine, draft, options)
    server = build_server(app, options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise ServeError("the server thread stopped before it started")
            time.sleep(0.01)
        yield url_of(sock)
    finally:
        server.should_exit = True
        app.state.service.close()
        thread.join(30)
        sock.close()


def load_engine(target_path: str, draft: str | None, spec, device: str, dtype: str | None,
                model_name: str | None, allow_missing_fingerprint: bool = False,
                mixing: Mixing = Mixing()) -> Engine:
    """Target (+ exported draft, checked against it, combined with a free proposer as `mixing` says) -> Engine."""
    session = Session.open(target_path, draft, spec, device=device, dtype=dtype,
                           allow_missing_fingerprint=allow_missing_fingerprint, mixing=mixing)
    if draft:
        print(f"specheads serve: speculation: {session.mixing.describe()}"
              + (f"; {session.free_note}" if session.free_note else ""), flush=True)
    return Engine(session, model_name or session.target.path.name)


def serve(engine: Engine, sock: socket.socket, draft: str | None = None,
          options: ServeOptions = ServeOptions()) -> None:
    """Serve on a bound socket until SIGINT / SIGTERM."""
    app = build_app(engine, draft, options)
    server = build_server(app, options)
    print(f"specheads serve: model '{engine.model_name}' listening on {url_of(sock)}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.state.service.close()


def main(argv: list[str] | None = None) -> int:
    p = serve_parser()
    a = p.parse_args(argv)
    options = ServeOptions(a.max_queue, a.read_timeout, a.log_requests, a.max_batch, a.max_body_mb, a.log_interval)
    spec = spec_from_args(a)
    mixing = mixing_from_args(a, a.draft, spec)
    sock = bind(a.host, a.port)  # before the target loads: a port in use fails at once
    try:
        engine = load_engine(a.target, a.draft, spec, a.device, a.dtype, a.served_model_name,
                             a.allow_missing_fingerprint, mixing)
        serve(engine, sock, a.draft, options)
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
