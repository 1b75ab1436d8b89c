"""The engine calls' HTTP/1.1 client: keep-alive connections to one engine, parsed by ``httptools``.

Every turn makes one engine call, and aiohttp's client spends more CPU around it than the rest of
the call's I/O: measured side by side on the floor gateway (``benchmarks gateway``), ~0.4 ms of
CPU per call on this project's 2-core machines, more than the aiohttp server's whole request.
The calls the gateway makes per turn are the simplest HTTP there is (a POST of a JSON body to an
engine it was configured with, answered by one JSON body or an SSE stream), so they go on
connections of this module: an :mod:`asyncio` protocol per connection, the reply parsed by
``httptools`` (llhttp, the parser of Node.js and uvicorn: ``Content-Length`` and chunked bodies,
keep-alive), idle connections kept per engine.

It answers like aiohttp's ``ClientResponse`` where the adapters look (``status``, ``read()``,
``content.iter_any()``, ``release()``, ``close()``), and fails like it: a connection that cannot
be made raises :class:`NoConnection` (``EngineRefused`` in :class:`~.http.post`); a reply cut short raises
``aiohttp.ServerDisconnectedError`` / ``ClientPayloadError``; a timeout ``asyncio.TimeoutError``.
Only plain ``http://`` engines use it (``https://`` stays on aiohttp), and only for the turn's
POST: probes, health checks and aborts stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

try:  # the gateway extra installs it; without it, the engine calls stay on aiohttp
    import httptools
except ImportError:  # pragma: no cover - exercised only without the extra
    httptools = None  # type: ignore[assignment]

#: An idle connection older than this is closed, not reused: servers close theirs after a few
#: seconds (uvicorn, vLLM's and SGLang's server: 5 s), and a request sent as the server closes
#: the connection would fail with nothing received.
IDLE_S = 3.0
#: Idle connections kept per engine.
KEEP = 256


class NoConnection(OSError):
    """No connection to the engine could be made (refused, unreachable): it took no request."""


class _Conn(asyncio.Protocol):
    """One connection: the reply of the request sent on it, as it arrives."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.parser: Any = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers_done: asyncio.Future[None] | None = None
        self.pieces: deque[bytes] = deque()
        self.complete = False
        self.lost: BaseException | None = None
        self.eof = False
        self.wake: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.got = False  # a byte of the current reply arrived
        self.keep = False  # the reply allows the connection's reuse (read as it completes: the parser resets)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - engines do not upgrade
            self._fail(aiohttp.ClientPayloadError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed reply: {exc}"))

    def eof_received(self) -> bool:
        self.eof = True
        try:
            self.parser.feed_data(b"")  # a body delimited by the close ends here
        except httptools.HttpParserError:
            pass
        if not self.complete:
            self._fail(aiohttp.ServerDisconnectedError("the engine closed the connection"))
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        if not self.complete:
            self._fail(aiohttp.ServerDisconnectedError(f"connection lost: {exc!r}" if exc else "the engine closed the connection"))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep = bool(self.parser.should_keep_alive())
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)
        self._wake()

    # -- helpers ------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def reusable(self) -> bool:
        """Idle, whole and open: can carry the next request."""
        return (
            self.complete and self.lost is None and not self.eof and self.transport is not None
            and not self.transport.is_closing() and self.keep
        )


class Reply:
    """A reply being read (the parts of ``aiohttp.ClientResponse`` the adapters use)."""

    def __init__(self, pool: EngineHTTP, conn: _Conn, deadline: float | None, read_s: float | None) -> None:
        self._pool, self._conn, self._deadline, self._read_s = pool, conn, deadline, read_s
        self.status = conn.status
        self.content = self  # resp.content.iter_any()
        self._done = False

    def _wait_s(self) -> float | None:
        left = None if self._deadline is None else self._deadline - time.monotonic()
        if self._read_s is not None:
            left = self._read_s if left is None else min(left, self._read_s)
        return left

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunked encoding removed)."""
        c = self._conn
        while True:
            while c.pieces:
                yield c.pieces.popleft()
            if c.complete:
                return
            if c.lost is not None:
                raise c.lost
            c.wake = asyncio.get_running_loop().create_future()
            wait = self._wait_s()
            if wait is not None and wait <= 0:
                raise asyncio.TimeoutError()
            try:
                await asyncio.wait_for(c.wake, wait) if wait is not None else await c.wake
            finally:
                c.wake = None

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.iter_any()])

    def release(self) -> None:
        """Done with the reply: its connection goes back to the pool when it is whole (else closed)."""
        if self._done:
            return
        self._done = True
        self._pool._give_back(self._conn)  # noqa: SLF001

    def close(self) -> None:
        """Close the connection now (vLLM aborts the request of a client that left)."""
        self._done = True
        c = self._conn
        c.lost = c.lost or aiohttp.ServerDisconnectedError("closed by the gateway")
        c._wake()  # noqa: SLF001
        if c.transport is not None:
            c.transport.close()


class EngineHTTP:
    """Keep-alive HTTP/1.1 connections to one ``http://`` engine, for its turn calls."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._head = b"Host: %s:%d\r\nContent-Type: application/json\r\nAccept: */*\r\n" % (self.host.encode(), self.port)
        self._idle: list[_Conn] = []

    @classmethod
    def for_url(cls, url: str) -> EngineHTTP | None:
        """The client for ``url``, or None (aiohttp then) for ``https://`` or without httptools."""
        return cls(url) if httptools is not None and urlsplit(url).scheme == "http" else None

    async def post(self, path: str, body: bytes, timeout: aiohttp.ClientTimeout) -> Reply:
        """Send ``POST path`` with a JSON ``body``; the reply once its headers are in. Raises
        :class:`NoConnection` when no connection can be made, aiohttp's errors or
        ``asyncio.TimeoutError`` when the reply does not come.

        A kept connection that the engine closed as the request went out (nothing of a reply came
        back) is retried once on a new connection, as HTTP clients do for idempotent requests: the
        engine closed it idle, so it did not take the request.
        """
        deadline = None if not timeout.total else time.monotonic() + timeout.total
        conn = self._take()
        if conn is not None:
            try:
                return await self._send(conn, path, body, timeout, deadline)
            except aiohttp.ServerDisconnectedError:
                if conn.got:
                    raise
        conn = await self._connect(timeout)
        return await self._send(conn, path, body, timeout, deadline)

    async def _connect(self, timeout: aiohttp.ClientTimeout) -> _Conn:
        connect_s = timeout.sock_connect or timeout.connect or timeout.total or None
        made = asyncio.get_running_loop().create_connection(_Conn, self.host, self.port)
        try:
            _, conn = await (asyncio.wait_for(made, connect_s) if connect_s else made)
        except asyncio.TimeoutError:  # an OSError too (3.11+): not a refusal, the engine may be slow
            raise
        except OSError as exc:
            raise NoConnection(exc.errno, exc.strerror or str(exc)) from exc
        return conn

    async def _send(
        self, conn: _Conn, path: str, body: bytes, timeout: aiohttp.ClientTimeout, deadline: float | None
    ) -> Reply:
        conn.headers_done = asyncio.get_running_loop().create_future()
        # the head and the body in one call, not one bytes made of both (a copy of a 32k context's
        # ~0.2 MB of ids: uvloop writes the two with one writev; asyncio's own loop joins them)
        conn.transport.writelines(
            (b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % ((self.prefix + path).encode(), self._head, len(body)), body)
        )
        wait = timeout.sock_read or None
        if deadline is not None:
            left = deadline - time.monotonic()
            wait = left if wait is None else min(wait, left)
        try:
            await (asyncio.wait_for(conn.headers_done, wait) if wait is not None else conn.headers_done)
        except BaseException:
            conn.headers_done = None  # nobody waits on it now (its failure is raised here)
            conn.transport.close()
            raise
        return Reply(self, conn, deadline, timeout.sock_read or None)

    def _take(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable() and now - conn.idle_since < IDLE_S:
                conn.status, conn.complete, conn.lost, conn.got, conn.keep = 0, False, None, False, False
                conn.pieces.clear()
                return conn
            conn.transport.close()
        return None

    def _give_back(self, conn: _Conn) -> None:
        if conn.reusable() and not conn.pieces and len(self._idle) < KEEP:
            conn.idle_since = time.monotonic()
            conn.headers_done = None
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        """Close the idle connections."""
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()


__all__ = ["EngineHTTP", "NoConnection", "Reply"]
