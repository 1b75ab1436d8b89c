"""The floor: what any gateway that keeps token-exact traces in Redis and gates each turn must do.

Not a product and not a peer: a lower bound for ``benchmarks gateway``'s added latency on the
machine it runs on. Per chat request (OpenAI shape, a ``session_id``, not streamed) it does the
work no design of this kind can skip, and nothing else:

1. read and parse the body (``orjson``);
2. tokenise the last message alone (the builtin tokenizer: a turn's new text);
3. **one store round trip** before the engine: a pipeline of ``HINCRBY`` (a lease counter, the
   gate's admit) and ``GET`` of the session's stored ids (the path's ids, little-endian int32);
4. the engine call: the stored ids plus the new ones, as SGLang ``/generate`` JSON (one aiohttp
   client session, keep-alive);
5. **one store round trip** after it: ``APPEND`` of the new and the generated ids, ``HINCRBY``
   (the settle), in one pipeline: the turn is stored before the answer is sent;
6. the answer, with its usage.

No validation, no ownership, no canonical key, no template, no retries, no metrics, no routing,
no weight versions, no labels or logprobs stored: a request the real gateway would refuse or
record otherwise is answered anyway. What the real gateway adds on top is its own cost.

Run: ``python -m benchmarks.baselines.floor_gateway --engine URL --url REDIS_URL --port 0``
(prints ``listening on URL``).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from array import array
from typing import Any

import aiohttp
import numpy as np
import orjson
import redis.asyncio as aredis
from aiohttp import web

from tracestore.gateway.serve import serve_forever
from tracestore.gateway.tokenizer import BuiltinTokenizer


class FloorGateway:
    """One aiohttp app in front of one engine and one Redis server."""

    def __init__(self, engine: str, url: str) -> None:
        self.engine = engine.rstrip("/")
        self.url = url
        self.tok = BuiltinTokenizer()
        self.tag = uuid.uuid4().hex[:6]
        self.http: aiohttp.ClientSession | None = None
        self.r: Any = None

    async def start(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        # waits for a free connection (as the product's pool does) instead of failing at 100
        self.r = aredis.Redis(connection_pool=aredis.BlockingConnectionPool.from_url(self.url, max_connections=64))

    async def stop(self, app: web.Application) -> None:
        assert self.http is not None
        await self.http.close()
        await self.r.aclose()

    async def chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        sid = str(body["session_id"])
        last = body["messages"][-1]
        new = self.tok.encode(self.tok.render([last], None, True, {}))
        key = f"floor:{self.tag}:{{{sid}}}"
        async with self.r.pipeline(transaction=False) as p:
            p.hincrby(key + ":gate", "leases", 1)
            p.get(key + ":ids")
            _, stored = await p.execute()
        ids = array("i")
        if stored:
            ids.frombytes(stored)
        ids.extend(new)
        payload = orjson.dumps(
            {"input_ids": np.frombuffer(ids, dtype=np.int32), "sampling_params": {"max_new_tokens": int(body.get("max_tokens", 64))},
             "return_logprob": True},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        assert self.http is not None
        async with self.http.post(self.engine + "/generate", data=payload, headers={"Content-Type": "application/json"}) as resp:
            out = orjson.loads(await resp.read())
        gen = array("i", out["output_ids"])
        async with self.r.pipeline(transaction=False) as p:
            p.append(key + ":ids", array("i", new).tobytes() + gen.tobytes())
            p.hincrby(key + ":gate", "settled", 1)
            await p.execute()
        text = self.tok.decode([t for t in out["output_ids"] if t != self.tok.stop_token_ids[0]])
        reply = {
            "id": "chatcmpl-" + uuid.uuid4().hex[:12],
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)},
        }
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.baselines.floor_gateway", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--url", required=True, help="the Redis server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    gw = FloorGateway(args.engine, args.url)

    async def make() -> web.Application:
        return gw.app()

    serve_forever(make, args.host, args.port, lambda url: print(f"listening on {url}", flush=True))


if __name__ == "__main__":
    sys.exit(main())
