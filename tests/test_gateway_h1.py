"""The gateway's own HTTP/1.1 server (``tracestore.gateway.h1``) on real sockets: raw clients for
what the SDKs rarely send (pipelined requests, ``Expect: 100-continue``, chunked bodies,
malformed requests, HEAD) and aiohttp's client for the rest; the handlers are small ones of this
file, served through :func:`tracestore.gateway.serve.start_site` as a gateway is. The gateway's
own routes are served by it in every other gateway test (``start_gateway``, ``tracestore
gateway``: ``test_gateway.py`` checks that they are)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

httptools = pytest.importorskip("httptools")
aiohttp = pytest.importorskip("aiohttp")
import orjson  # noqa: E402
from aiohttp import web  # noqa: E402

from tracestore.gateway import h1  # noqa: E402
from tracestore.gateway.serve import start_site  # noqa: E402

LIMIT = 1000


class _Replies:
    """Replies parsed by httptools off a raw socket."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self._h: dict[str, str] = {}
        self._b: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._h[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._b.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._h, b"".join(self._b)))
        self._h, self._b = {}, []


async def _read(reader: asyncio.StreamReader, n: int, got: _Replies | None = None) -> _Replies:
    got = got or _Replies()
    while len(got.done) < n:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, f"connection closed after {len(got.done)} of {n} replies"
        got.parser.feed_data(data)
    return got


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


class _App:
    """A small application served as the gateway's is: its routes in ``app[h1.H1_ROUTES]``."""

    def __init__(self) -> None:
        self.seen: list[str] = []  # route names, as observe saw them
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.cleaned = False

    async def echo(self, request: Any) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413, body=b'{"error":"too large"}', content_type="application/json")
        out = {"n": len(body), "path": request.path, "x": request.headers.get("x-test"), "m": request.method}
        return web.Response(body=orjson.dumps(out), content_type="application/json", headers={"X-Echo": "1"})

    async def stream(self, request: Any) -> Any:
        resp = await h1.open_stream(request, {"Content-Type": "text/event-stream"})
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write(b"")  # nothing: an empty chunk must not end the body
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    async def left_open(self, request: Any) -> Any:
        resp = await h1.open_stream(request, {"Content-Type": "text/event-stream"})
        await resp.write(b"event: error\ndata: {}\n\n")
        return resp  # not ended: the server ends it, as aiohttp's did

    async def slow(self, request: Any) -> web.Response:
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.Response(body=b"{}")

    async def boom(self, request: Any) -> web.Response:
        raise RuntimeError("a bug")

    async def trace(self, request: Any) -> web.Response:
        return web.Response(body=orjson.dumps({"sid": request.match_info["sid"]}), content_type="application/json")

    async def unknown(self, request: Any) -> web.Response:
        return web.Response(status=404, body=orjson.dumps({"no": f"{request.method} {request.path}"}))

    async def health(self, request: Any) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def observe(self, route: str, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        self.seen.append(route)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application()
        exact = {
            ("POST", "/v1/chat/completions"): ("echo", self.echo),
            ("POST", "/v1/messages"): ("stream", self.stream),
            ("POST", "/v1/messages/count_tokens"): ("open", self.left_open),
            ("POST", "/v1/responses"): ("slow", self.slow),
            ("POST", "/v1/completions"): ("boom", self.boom),
            ("GET", "/health"): ("health", self.health),
        }
        app[h1.H1_ROUTES] = h1.Routes(exact, ("trace", self.trace), ("unknown", self.unknown), self.observe, LIMIT)

        async def cleanup(_: web.Application) -> None:
            self.cleaned = True

        app.on_cleanup.append(cleanup)
        return app


def _serve(test: Callable[[_App, Any, str, int], Awaitable[None]]) -> _App:
    served = _App()

    async def main() -> None:
        runner, url = await start_site(served.app(), "127.0.0.1", 0)
        assert isinstance(runner, h1.H1Server)
        try:
            await test(served, runner, url, int(url.rsplit(":", 1)[1]))
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return served


def test_keep_alive_pipelining_and_routes() -> None:
    async def test(app: _App, server: Any, url: str, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/v1/chat/completions", b"a" * 10, "X-Test: one\r\n") + _post("/v1/chat/completions?q=1", b"b" * 20))
        got = await _read(reader, 2)  # pipelined: both answered, in order
        assert [orjson.loads(b)["n"] for _, _, b in got.done] == [10, 20]
        assert orjson.loads(got.done[0][2])["x"] == "one" and got.done[0][1]["x-echo"] == "1"
        assert orjson.loads(got.done[1][2])["path"] == "/v1/chat/completions"  # the query is not the path
        for i in range(18):
            writer.write(_post("/v1/chat/completions", b"c" * i))
            await _read(reader, 3 + i, got)
        assert len(server.conns) == 1
        writer.write(b"GET /v1/sessions/s%2F1/trace HTTP/1.1\r\nHost: x\r\n\r\n")
        writer.write(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        await _read(reader, 22, got)
        assert orjson.loads(got.done[20][2]) == {"sid": "s/1"}
        assert got.done[21][0] == 404 and orjson.loads(got.done[21][2]) == {"no": "GET /v1/chat/completions"}
        writer.close()

    app = _serve(test)
    assert app.seen.count("echo") == 20 and app.seen[-2:] == ["trace", "unknown"]
    assert app.cleaned


def test_expect_continue_chunked_head_and_limits() -> None:
    async def test(app: _App, server: Any, url: str, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        got = await _read(reader, 1)
        assert orjson.loads(got.done[0][2])["n"] == 5
        chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(chunked + b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
        await _read(reader, 2, got)
        assert orjson.loads(got.done[1][2])["n"] == 7
        writer.write(_post("/v1/chat/completions", b"z" * (LIMIT + 1)))  # read, dropped, answered 413
        writer.write(_post("/v1/chat/completions", b"y" * LIMIT))  # the connection still serves
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        writer.write(_post("/v1/chat/completions", b""))
        await _read(reader, 6, got)
        assert got.done[2][0] == 413
        assert got.done[3][0] == 200 and orjson.loads(got.done[3][2])["n"] == LIMIT
        assert got.done[4][0] == 500 and "RuntimeError: a bug" in orjson.loads(got.done[4][2])["error"]["message"]
        assert got.done[5][0] == 200
        writer.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a head, no body (the next reply follows it)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 15\r\n" in head
        writer.write(_post("/v1/chat/completions", b"w"))
        got = await _read(reader, 1)
        assert got.done[0][0] == 200 and orjson.loads(got.done[0][2])["n"] == 1
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        got = _Replies()
        data = await asyncio.wait_for(reader.read(), 10)  # answered, then closed (read() gets to EOF)
        got.parser.feed_data(data)
        assert got.done[0][0] == 400 and got.done[0][1]["connection"] == "close"

    _serve(test)


def test_stream_connection_close_and_aiohttp_client() -> None:
    async def test(app: _App, server: Any, url: str, port: int) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/messages", data=b"{}") as r:
                assert r.status == 200 and r.headers["Transfer-Encoding"] == "chunked"
                assert await r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            async with http.post(url + "/v1/messages/count_tokens", data=b"{}") as r:
                assert await r.read() == b"event: error\ndata: {}\n\n"  # a whole body: the last chunk was sent
            async with http.post(url + "/v1/chat/completions", data=b"x" * 30, headers={"Connection": "close"}) as r:
                assert r.status == 200 and (await r.json())["n"] == 30 and r.headers["Connection"] == "close"
            for _ in range(50):
                if not server.conns:
                    break
                await asyncio.sleep(0.02)
            assert not server.conns  # the server closed the connection the request asked to close

    _serve(test)


def test_disconnect_cancels_the_handler_and_idle_connections_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h1, "KEEPALIVE_S", 0.3)

    async def test(app: _App, server: Any, url: str, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/v1/responses", b"{}"))
        await asyncio.wait_for(app.started.wait(), 10)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 10)  # the client left: its handler was cancelled
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/v1/chat/completions", b"1"))
        await _read(reader, 1)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # idle past KEEPALIVE_S: closed by the server

    _serve(test)


def test_shutdown_cancels_what_outlasts_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h1, "SHUTDOWN_S", 0.2)
    served = _App()

    async def main() -> None:
        runner, url = await start_site(served.app(), "127.0.0.1", 0)
        port = int(url.rsplit(":", 1)[1])
        _, idle = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/v1/responses", b"{}"))
        await asyncio.wait_for(served.started.wait(), 10)
        await asyncio.wait_for(runner.cleanup(), 10)
        assert served.cancelled.is_set() and served.cleaned
        assert await asyncio.wait_for(reader.read(), 10) == b""
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)  # no longer listening
        idle.close()

    asyncio.run(main())
