"""The engine calls' keep-alive HTTP/1.1 client (``tracestore.gateway.engines.wire``), against real
servers on local sockets: an aiohttp server for the replies engines give, and raw asyncio servers
for the ones that misbehave (a kept connection closed under a request, no reply, a reply cut
short). Through :class:`~tracestore.gateway.engines.http.post`, failures must be the adapters'
EngineRefused / EngineLost, as they are on aiohttp's client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("httptools")
aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from tracestore.gateway.engines.base import EngineLost, EngineRefused  # noqa: E402
from tracestore.gateway.engines.http import post, sse_events  # noqa: E402
from tracestore.gateway.engines.wire import EngineHTTP  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _aiohttp_server(peers: list[Any]) -> tuple[web.AppRunner, str]:
    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(body=b'{"echo":' + await request.read() + b"}", content_type="application/json")

    async def sse(request: web.Request) -> web.StreamResponse:
        n = int((await request.json())["n"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # chunked: no Content-Length
        for i in range(n):
            await resp.write(b'data: {"i":%d,"pad":"%s"}\n\n' % (i, b"x" * (i * 700)))
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def closing(request: web.Request) -> web.Response:
        return web.Response(body=b"{}", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_post("/v1/echo", echo)
    app.router.add_post("/v1/sse", sse)
    app.router.add_post("/v1/closing", closing)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1"


async def _raw_server(
    on_request: Callable[[int, int, asyncio.StreamWriter], Awaitable[bool]],
) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """A server that reads each request (headers + Content-Length body) and lets ``on_request(conn,
    n, writer)`` answer it; it returns False to close the connection. Counts its connections."""
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(len(conns))
        me, n = conns[-1], 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                if not await on_request(me, n, writer):
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    port = _free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}", conns


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def _call(wire: EngineHTTP, url: str, path: str, body: bytes) -> tuple[int, bytes]:
    async with post(None, url, path, body, TIMEOUT, wire) as resp:  # type: ignore[arg-type]
        return resp.status, await resp.read()


def test_calls_reuse_one_kept_connection_and_bodies_come_back_whole() -> None:
    async def main() -> None:
        peers: list[Any] = []
        runner, url = await _aiohttp_server(peers)
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        try:
            for i in range(20):
                body = b'{"i":%d,"big":"%s"}' % (i, b"y" * (i * 5000))
                status, raw = await _call(wire, url, "/echo", body)
                assert (status, raw) == (200, b'{"echo":' + body + b"}")
            assert len(set(peers)) == 1, peers  # one connection carried all 20
            # concurrent calls open connections of their own and keep them for the next ones
            got = await asyncio.gather(*(_call(wire, url, "/echo", b"%d" % i) for i in range(8)))
            assert [raw for _, raw in got] == [b'{"echo":%d}' % i for i in range(8)]
            assert 1 < len(set(peers)) <= 9
            # a reply that says Connection: close is not kept
            before, kept = len(set(peers)), len(wire._idle)  # noqa: SLF001
            assert (await _call(wire, url, "/closing", b"{}"))[0] == 200
            assert len(wire._idle) == kept - 1  # it took a kept one and did not give it back  # noqa: SLF001
            await _call(wire, url, "/echo", b"1")
            assert len(set(peers)) == before  # an older kept connection served it
        finally:
            wire.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_chunked_sse_reply_reads_as_its_events_in_order() -> None:
    async def main() -> None:
        runner, url = await _aiohttp_server([])
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        try:
            for _ in range(2):  # the second on the kept connection
                async with post(None, url, "/sse", b'{"n":12}', TIMEOUT, wire) as resp:  # type: ignore[arg-type]
                    assert resp.status == 200
                    events = [e async for e in sse_events(resp)]
                assert events[-1] == b"[DONE]"
                assert [int(e.split(b",")[0][5:]) for e in events[:-1]] == list(range(12))
                assert len(events[11]) == len(b'{"i":11,"pad":""}') + 11 * 700
            assert len(wire._idle) == 1  # noqa: SLF001
        finally:
            wire.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_kept_connection_closed_under_the_request_is_retried_once_on_a_new_one() -> None:
    async def answer_first_only(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        if n > 0:
            return False  # the server had closed it idle: the request is dropped unanswered
        w.write(_ok(b'{"conn":%d}' % conn))
        await w.drain()
        return True

    async def main() -> None:
        server, url, conns = await _raw_server(answer_first_only)
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        try:
            assert await _call(wire, url, "/x", b"{}") == (200, b'{"conn":0}')
            assert await _call(wire, url, "/x", b"{}") == (200, b'{"conn":1}')
            assert len(conns) == 2
        finally:
            wire.close()
            server.close()

    asyncio.run(main())


def test_no_reply_on_a_new_connection_is_lost_and_nothing_listening_is_refused() -> None:
    async def never_answers(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        return False

    async def cut_short(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\":")
        await w.drain()
        return False

    async def silent(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    async def main() -> None:
        server, url, conns = await _raw_server(never_answers)
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        with pytest.raises(EngineLost, match="no reply"):
            await _call(wire, url, "/x", b"{}")
        assert len(conns) == 1  # a new connection is not retried: the engine may have taken it
        server.close()

        server, url, _ = await _raw_server(cut_short)
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        async with post(None, url, "/x", b"{}", TIMEOUT, wire) as resp:  # type: ignore[arg-type]
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await resp.read()
        assert wire._idle == []  # noqa: SLF001
        server.close()

        server, url, _ = await _raw_server(silent)
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        short = aiohttp.ClientTimeout(total=0.5, sock_connect=5)
        with pytest.raises(EngineLost, match="TimeoutError"):
            async with post(None, url, "/x", b"{}", short, wire):  # type: ignore[arg-type]
                pass
        server.close()

        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        wire = EngineHTTP.for_url(url)
        assert wire is not None
        with pytest.raises(EngineRefused, match="cannot connect"):
            await _call(wire, url, "/x", b"{}")

    asyncio.run(main())


def test_https_engines_stay_on_aiohttp() -> None:
    assert EngineHTTP.for_url("https://engine.example:8443") is None
    assert EngineHTTP.for_url("http://127.0.0.1:30000") is not None
