"""The floor again, without aiohttp or redis-py: how cheap the same work gets in Python at all.

Not a product: the same six steps as :mod:`benchmarks.baselines.floor_gateway` (parse, tokenise
the last message, one pipelined store round trip, the engine call, one pipelined store round
trip, the answer), on raw :mod:`asyncio` protocols under uvloop: a minimal HTTP/1.1 server
(``Content-Length`` bodies, keep-alive, no chunked encoding, no validation), keep-alive
connections to the engine parsed by hand, and RESP written by hand and read by ``hiredis`` on a
few pipelined Redis connections. It tells what a gateway written against the sockets would cost
per turn on this machine: the lower bound under any HTTP and Redis library.

Run: ``python -m benchmarks.baselines.raw_floor_gateway --engine URL --url REDIS_URL --port 0``
(prints ``listening on URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from array import array
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import hiredis
import numpy as np
import orjson
import uvloop

from tracestore.gateway.tokenizer import BuiltinTokenizer


def _resp(*args: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Redis(asyncio.Protocol):
    """One Redis connection: pipelined commands, replies matched in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future[list[Any]], list[Any], int]] = deque()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut, acc, n = self.waiting[0]
            acc.append(reply)
            if len(acc) == n:
                self.waiting.popleft()
                fut.set_result(acc)

    def send(self, *cmds: bytes) -> asyncio.Future[list[Any]]:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((fut, [], len(cmds)))
        self.transport.write(b"".join(cmds))
        return fut


class _Engine(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the engine, one request at a time."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fut: asyncio.Future[bytes] | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head = self.buf.find(b"\r\n\r\n")
        if head < 0 or self.fut is None:
            return
        length = 0
        for line in bytes(self.buf[:head]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) >= head + 4 + length:
            body = bytes(self.buf[head + 4 : head + 4 + length])
            del self.buf[: head + 4 + length]
            fut, self.fut = self.fut, None
            fut.set_result(body)

    def post(self, host: str, path: str, body: bytes) -> asyncio.Future[bytes]:
        self.fut = asyncio.get_running_loop().create_future()
        self.transport.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), host.encode(), len(body), body)
        )
        return self.fut


class RawFloor:
    """The six steps; connections made on first use and kept."""

    def __init__(self, engine: str, url: str) -> None:
        e, r = urlsplit(engine), urlsplit(url)
        self.engine = (e.hostname or "127.0.0.1", e.port or 80)
        self.redis_at = (r.hostname or "127.0.0.1", r.port or 6379)
        self.tok = BuiltinTokenizer()
        self.tag = uuid.uuid4().hex[:6]
        self.redis: list[_Redis] = []
        self.idle: list[_Engine] = []
        self.turn = 0

    async def _rconn(self) -> _Redis:
        if len(self.redis) < 4:
            _, proto = await asyncio.get_running_loop().create_connection(_Redis, *self.redis_at)
            self.redis.append(proto)
            return proto
        self.turn += 1
        return self.redis[self.turn % len(self.redis)]

    async def _engine_call(self, body: bytes) -> bytes:
        conn = self.idle.pop() if self.idle else (await asyncio.get_running_loop().create_connection(_Engine, *self.engine))[1]
        try:
            return await conn.post(f"{self.engine[0]}:{self.engine[1]}", "/generate", body)
        finally:
            self.idle.append(conn)

    async def chat(self, raw: bytes) -> bytes:
        body = orjson.loads(raw)
        sid = str(body["session_id"])
        new = self.tok.encode(self.tok.render([body["messages"][-1]], None, True, {}))
        key = f"floor:{self.tag}:{{{sid}}}"
        r = await self._rconn()
        _, stored = await r.send(_resp("HINCRBY", key + ":gate", "leases", 1), _resp("GET", key + ":ids"))
        ids = array("i")
        if stored:
            ids.frombytes(stored)
        ids.extend(new)
        payload = orjson.dumps(
            {"input_ids": np.frombuffer(ids, dtype=np.int32), "sampling_params": {"max_new_tokens": int(body.get("max_tokens", 64))},
             "return_logprob": True},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        out = orjson.loads(await self._engine_call(payload))
        gen = array("i", out["output_ids"])
        await r.send(_resp("APPEND", key + ":ids", array("i", new).tobytes() + gen.tobytes()), _resp("HINCRBY", key + ":gate", "settled", 1))
        text = self.tok.decode([t for t in out["output_ids"] if t != self.tok.stop_token_ids[0]])
        return orjson.dumps({
            "id": "chatcmpl-" + uuid.uuid4().hex[:12],
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)},
        })


class _Server(asyncio.Protocol):
    """A minimal HTTP/1.1 server connection: POST bodies by Content-Length, answered in order."""

    def __init__(self, app: RawFloor) -> None:
        self.app = app
        self.buf = bytearray()
        self.transport: Any = None
        self.busy = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        head = self.buf.find(b"\r\n\r\n")
        if head < 0:
            return
        length = 0
        for line in bytes(self.buf[:head]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < head + 4 + length:
            return
        body = bytes(self.buf[head + 4 : head + 4 + length])
        del self.buf[: head + 4 + length]
        self.busy = True
        asyncio.ensure_future(self._serve(body))

    async def _serve(self, body: bytes) -> None:
        try:
            out, status = await self.app.chat(body), b"200 OK"
        except Exception as exc:  # noqa: BLE001 - a floor: the error as text
            out, status = repr(exc).encode(), b"500 Internal Server Error"
        self.transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (status, len(out), out)
        )
        self.busy = False
        self._next()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.baselines.raw_floor_gateway", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--url", required=True, help="the Redis server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    app = RawFloor(args.engine, args.url)

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _Server(app), args.host, args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"listening on http://{args.host}:{port}", flush=True)
        await server.serve_forever()

    uvloop.run(run())


if __name__ == "__main__":
    main()
