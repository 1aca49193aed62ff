"""The HTTP transport of `specheads serve`: the listening socket, bound before the target loads
(a port in use fails in a second, naming the port), and uvicorn's h11 protocol with two changes:
malformed HTTP (e.g. a non-integer Content-Length) is answered with an OpenAI-shaped JSON 4xx
instead of plain text, and a request whose headers never complete gets a 408 after the read
timeout instead of holding its connection forever; a body is read within the read timeout and
`--max-body-mb` (`read_body`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import sys

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from specheads.serve.engine import RequestError
from specheads.serve.protocol import error_body

_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
            431: "Request Header Fields Too Large"}


class ServeError(ValueError):
    """`specheads serve` cannot start (the message says why and what to do)."""


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port (0 picks a free port); ServeError naming the port
    when it is taken or not allowed, or the host when it is not an address of this machine."""
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port} is not a TCP port: pass 0..65535 (0 picks a free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ServeError(f"--host '{host}' does not resolve ({err.strerror}): pass an address of "
                         "this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise ServeError(_bind_message(host, port, err)) from None
    return sock


def _bind_message(host: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another server?): stop it, or pass "
                "another --port (--port 0 picks a free one)")
    if err.errno == errno.EACCES:
        return (f"port {port} on {host} needs privileges this user lacks: pass a port above 1023 "
                "(--port 0 picks a free one)")
    if err.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine: pass e.g. 127.0.0.1 or 0.0.0.0"
    return f"cannot listen on {host} port {port}: {err.strerror or err}"


def _write_json(transport, status: int, message: str, param: str | None) -> None:
    """A complete JSON error response written straight to the socket, then closed."""
    body = json.dumps(error_body(message, status, param)).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    transport.write(head + body)
    transport.close()


class JsonErrorsH11(H11Protocol):
    """uvicorn's h11 protocol: malformed HTTP -> JSON 4xx naming the header; headers that do not
    arrive within `header_timeout` seconds -> 408 (the body's own timeout is the app's)."""

    header_timeout = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_timer = None
        self._arm_headers_timer()

    def _arm_headers_timer(self) -> None:
        """Time the next request's headers (uvicorn starts a new cycle once they are complete)."""
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        self._headers_timer = self.loop.call_later(self.header_timeout, self._headers_late, self.cycle)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # keep-alive: the next request's headers are timed too
            self._arm_headers_timer()

    def connection_lost(self, exc) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        super().connection_lost(exc)

    def _headers_late(self, armed) -> None:
        """No request began since the timer was armed, and none is being answered."""
        idle = self.cycle is armed and (armed is None or armed.response_complete)
        if idle and not self.transport.is_closing():
            _write_json(self.transport, 408, f"the request headers did not arrive within "
                        f"{self.header_timeout:g} s (read timeout)", None)

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn while it handles h11's RemoteProtocolError (sys.exc_info holds it)."""
        exc = sys.exc_info()[1]
        status = getattr(exc, "error_status_hint", 400) or 400
        detail = str(exc) if exc is not None else msg
        param = "Content-Length" if "content-length" in detail.lower() else None
        hint = " (it must be one non-negative integer: the body's size in bytes)" if param else ""
        _write_json(self.transport, status, f"malformed HTTP request: {detail}{hint}", param)


def protocol_class(header_timeout: float) -> type[JsonErrorsH11]:
    """The protocol class uvicorn instantiates per connection, with this header timeout."""
    return type("SpecheadsH11", (JsonErrorsH11,), {"header_timeout": float(header_timeout)})


async def read_body(request: Request, timeout: float, max_body: int) -> tuple[dict, int]:
    """(the request body as a JSON object, its size in bytes), within `timeout` seconds and `max_body` bytes."""
    declared = request.headers.get("content-length")
    cap = f"at most {max_body} bytes (--max-body-mb)"
    if declared is not None and int(declared) > max_body:
        raise RequestError(f"Content-Length {declared}: this server accepts bodies of {cap}", "Content-Length", 413)

    async def read() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise RequestError(f"the body exceeds {cap}", "body", 413)
            parts.append(chunk)
        return b"".join(parts)

    try:
        raw = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout:g} s (read timeout): "
                           "send the whole body, with a Content-Length that matches it",
                           "body", 408) from None
    except ClientDisconnect:
        raise RequestError("the client disconnected while sending the body", "body") from None
    if not raw.strip():
        raise RequestError("the request needs a JSON object as its body", "body")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"the body is not valid JSON: {err}", "body") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got a {type(body).__name__}", "body")
    return body, len(raw)
