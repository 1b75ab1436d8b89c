"""The gateway's own HTTP/1.1 server: one :mod:`asyncio` protocol per connection, requests parsed by
``httptools``.

Every turn crosses the gateway's HTTP server, and aiohttp's server spends more CPU per request
than the gateway's own HTTP needs: its per-connection task and stream reader, a request object
with lazy properties, a router, a middleware chain and a response writer, for requests that are
all one JSON body in and one JSON body or one SSE stream out. Measured side by side, this server
serves the same routes with a fraction of that (``docs/benchmarks/gateway.md``).

It serves the routes a :class:`~.server.Gateway` lists (:data:`H1_ROUTES` of its aiohttp
application), with the same handlers and the same answers: :func:`.serve.start_site` uses it for
an application that carries the table (``tracestore gateway``, :func:`~.server.start_gateway`),
and :meth:`~.server.Gateway.app` stays a plain aiohttp application for callers who embed it.
What aiohttp's server did is kept:

* handlers see a request with ``method``, ``path``, ``headers`` (case-insensitive), ``match_info``,
  ``read()`` (``web.HTTPRequestEntityTooLarge`` past the body limit) and per-request values
  (``request[key]``); they answer an aiohttp ``web.Response`` (written here) or write through
  :func:`send` and :func:`open_stream`;
* a client that disconnects cancels its handler (aiohttp's ``handler_cancellation``): that is how
  a turn learns its client left; writing to a closed connection raises ``ConnectionResetError``;
* keep-alive (idle connections closed after :data:`KEEPALIVE_S`), ``Expect: 100-continue``,
  chunked request bodies, pipelined requests answered in order, ``HEAD`` as ``GET`` without a
  body, a malformed request answered 400 and closed, an unexpected handler error 500;
* shutdown stops listening, closes idle connections, waits up to :data:`SHUTDOWN_S` for requests
  in flight, then cancels them (aiohttp's ``shutdown_timeout``), then runs the application's
  shutdown and cleanup hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

try:  # the gateway extra installs it; without it, start_site serves the aiohttp application
    import httptools
except ImportError:  # pragma: no cover - exercised only without the extra
    httptools = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

#: An idle keep-alive connection is closed after this long (aiohttp's default).
KEEPALIVE_S = 75.0
#: At shutdown, requests in flight get this long to finish before they are cancelled.
SHUTDOWN_S = 2.0
#: Parsed requests queued on one connection (pipelining) before it stops reading.
MAX_QUEUED = 16

Handler = Callable[[Any], Awaitable[web.StreamResponse]]
#: ``observe(route name, request, handler)``: what every request shares (status, latency, counters).
Observe = Callable[[str, Any, Handler], Awaitable[Any]]


@dataclass(frozen=True)
class Routes:
    """What the server serves: ``exact`` maps ``(method, path)`` to ``(route name, handler)``;
    ``trace`` serves ``GET /v1/sessions/{sid}/trace``; ``unknown`` everything else."""

    exact: dict[tuple[str, str], tuple[str, Handler]]
    trace: tuple[str, Handler]
    unknown: tuple[str, Handler]
    observe: Observe
    max_body: int


H1_ROUTES: web.AppKey[Routes] = web.AppKey("h1_routes", Routes)


class Request:
    """One parsed request, as the gateway's handlers read it (module docstring)."""

    __slots__ = ("method", "path", "raw_path", "headers", "match_info", "keep_alive", "_body", "_size", "_limit", "_values", "conn", "sent", "stream")

    def __init__(self, conn: _Conn, method: str, raw_path: str, headers: CIMultiDictProxy[str], keep_alive: bool,
                 body: bytes, size: int, limit: int) -> None:  # fmt: skip
        self.conn = conn
        self.method = method
        self.raw_path = raw_path  # as sent (routes match it; ``path`` is percent-decoded)
        self.path = unquote(raw_path) if "%" in raw_path else raw_path
        self.headers = headers
        self.keep_alive = keep_alive
        self.match_info: dict[str, str] = {}
        self._body = body
        self._size = size
        self._limit = limit
        self._values: dict[Any, Any] = {}
        self.sent = False  # the answer's head went out
        self.stream: Stream | None = None  # the streamed answer opened (ended once the handler returns)

    async def read(self) -> bytes:
        """The whole body; ``web.HTTPRequestEntityTooLarge`` past the limit."""
        if self._size > self._limit:
            raise web.HTTPRequestEntityTooLarge(max_size=self._limit, actual_size=self._size)
        return self._body

    def __getitem__(self, key: Any) -> Any:
        return self._values[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._values[key] = value

    def get(self, key: Any, default: Any = None) -> Any:
        """A per-request value (``default`` when unset)."""
        return self._values.get(key, default)


class Stream:
    """A streamed answer (chunked transfer encoding): ``write`` pieces, then ``write_eof``."""

    __slots__ = ("conn", "status", "_done")

    def __init__(self, conn: _Conn, status: int) -> None:
        self.conn = conn
        self.status = status
        self._done = False

    async def write(self, data: bytes) -> None:
        """One piece (nothing for an empty one: an empty chunk would end the body)."""
        if data:
            await self.conn.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def write_eof(self, data: bytes = b"") -> None:
        """The last piece, and the end of the answer."""
        if not self._done:
            self._done = True
            await self.conn.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")


async def send(request: Any, resp: web.Response) -> web.Response:
    """Write ``resp`` now (so that the work after it runs once the client has its answer)."""
    if isinstance(request, Request):
        await request.conn.respond(request, resp)
    else:
        await resp.prepare(request)
        await resp.write_eof()
    return resp


async def open_stream(request: Any, headers: dict[str, str]) -> Any:
    """Send a 200's head with ``headers`` and return what the body is written to (``write``,
    ``write_eof``): an aiohttp ``StreamResponse`` on aiohttp's server, a :class:`Stream` here."""
    if isinstance(request, Request):
        return await request.conn.open(request, headers)
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    return resp


_date = [0, b""]


def _date_header() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, email.utils.formatdate(now, usegmt=True).encode()
    return _date[1]  # type: ignore[return-value]


def _head(status: int, reason: str, headers: Any, tail: bytes, keep_alive: bool) -> bytes:
    out = [b"HTTP/1.1 %d %b\r\n" % (status, reason.encode("latin-1"))]
    for k, v in headers.items():
        if k.lower() not in _OURS:
            out.append(f"{k}: {v}\r\n".encode("latin-1"))
    out.append(b"Date: %b\r\n%b%b\r\n" % (_date_header(), tail, b"" if keep_alive else b"Connection: close\r\n"))
    return b"".join(out)


_OURS = frozenset({"content-length", "transfer-encoding", "connection", "date"})


class _Conn(asyncio.Protocol):
    """One client connection: its requests parsed as they arrive, served one at a time, in order."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.transport: Any = None
        self.parser: Any = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.idle_since = time.monotonic()
        self.closing = False
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.conns.discard(self)
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()  # the client left: its handler learns it (aiohttp's handler_cancellation)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(b"protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            self._refuse(f"malformed request: {exc}".encode())

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", [], [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        for k, v in self._headers:
            if k.lower() == "expect" and v.lower() == "100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= self.server.routes.max_body:
            self._body.append(body)  # past the limit, the rest is read and dropped: read() says 413

    def on_message_complete(self) -> None:
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        req = Request(
            self, self.parser.get_method().decode("latin-1"), path,
            CIMultiDictProxy(CIMultiDict(self._headers)), bool(self.parser.should_keep_alive()),
            b"".join(self._body), self._size, self.server.routes.max_body,
        )  # fmt: skip
        self.queue.append(req)
        if len(self.queue) >= MAX_QUEUED and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    # -- serving ------------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closing:
                req = self.queue.popleft()
                if self._paused_reading and len(self.queue) < MAX_QUEUED // 2:
                    self._paused_reading = False
                    self.transport.resume_reading()
                await self.server.handle(req)
                if not req.keep_alive or self.server.stopping:
                    self.closing = True
                    self.transport.close()
        except ConnectionResetError:  # the client left while its answer was written
            self.transport.close()
        finally:
            self.task = None
            self.idle_since = time.monotonic()

    async def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.transport.write(data)
        if self._paused:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    async def respond(self, req: Request, resp: web.Response) -> None:
        body = resp.body if isinstance(resp.body, bytes) else b""
        keep = req.keep_alive and not self.server.stopping
        head = _head(resp.status, resp.reason, resp.headers, b"Content-Length: %d\r\n" % len(body), keep)
        req.sent = True
        await self.write(head if req.method == "HEAD" else head + body)

    async def open(self, req: Request, headers: dict[str, str]) -> Stream:
        keep = req.keep_alive and not self.server.stopping
        req.sent = True
        await self.write(_head(200, "OK", headers, b"Transfer-Encoding: chunked\r\n", keep))
        req.stream = Stream(self, 200)
        return req.stream

    def _refuse(self, why: bytes) -> None:
        body = orjson.dumps({"error": {"message": why.decode(errors="replace"), "type": "invalid_request_error"}})
        head = _head(400, "Bad Request", {"Content-Type": "application/json"}, b"Content-Length: %d\r\n" % len(body), False)
        self.closing = True
        self.transport.write(head + body)
        self.transport.close()


class H1Server:
    """The listening socket, its connections and the application served (:func:`start`)."""

    def __init__(self, app: web.Application, routes: Routes) -> None:
        self.app = app
        self.routes = routes
        self.conns: set[_Conn] = set()
        self.stopping = False
        self.addresses: list[Any] = []
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def handle(self, req: Request) -> None:
        """Route ``req``, run its handler under ``observe``, write what it answers."""
        r = self.routes
        method = "GET" if req.method == "HEAD" else req.method
        got = r.exact.get((method, req.raw_path))
        if got is None:
            p = req.raw_path
            if method == "GET" and p.startswith("/v1/sessions/") and p.endswith("/trace") and p.count("/") == 4 and len(p) > 19:
                got = r.trace
                req.match_info["sid"] = unquote(p[13:-6])
            else:
                got = r.unknown
        name, handler = got
        try:
            resp = await r.observe(name, req, handler)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # an unexpected error: 500 (aiohttp's server did the same)
            log.exception("gateway: unexpected error serving %s %s", req.method, req.path)
            if req.sent:
                req.conn.transport.close()
                return
            body = {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "internal_error"}}
            resp = web.Response(body=orjson.dumps(body), status=500, content_type="application/json")
        if req.stream is not None:  # a handler may leave its stream open (an error event last): end it
            await req.stream.write_eof()
        elif not req.sent:
            await req.conn.respond(req, resp)

    async def start(self, host: str, port: int, reuse_port: bool) -> None:
        """Run the application's start-up hooks, then listen."""
        self.app.freeze()
        await self.app.startup()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Conn(self), host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=1024
            )
        except BaseException:
            await self._hooks_down()
            raise
        self.addresses = [s.getsockname() for s in self._server.sockets]
        self._sweeper = loop.call_later(KEEPALIVE_S / 5, self._sweep)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for more than :data:`KEEPALIVE_S`."""
        now = time.monotonic()
        for c in list(self.conns):
            if c.task is None and not c.queue and now - c.idle_since > KEEPALIVE_S:
                c.transport.close()
        self._sweeper = asyncio.get_running_loop().call_later(KEEPALIVE_S / 5, self._sweep)

    async def cleanup(self) -> None:
        """Stop listening; let requests in flight finish (up to :data:`SHUTDOWN_S`), cancel the
        rest; close every connection; run the application's shutdown and cleanup hooks."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        busy = [c.task for c in self.conns if c.task is not None]
        for c in list(self.conns):
            if c.task is None:
                c.transport.close()
        if busy:
            _, late = await asyncio.wait(busy, timeout=SHUTDOWN_S)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=SHUTDOWN_S)
        for c in list(self.conns):
            c.transport.close()
        await self._hooks_down()

    async def _hooks_down(self) -> None:
        try:
            await self.app.shutdown()
        finally:
            await self.app.cleanup()


def available(app: web.Application) -> bool:
    """True when ``app`` lists routes for this server and ``httptools`` is installed."""
    return httptools is not None and H1_ROUTES in app


__all__ = ["H1_ROUTES", "H1Server", "Request", "Routes", "Stream", "available", "open_stream", "send"]
