"""An instant engine for the gateway benchmark: SGLang's ``/generate`` answered at once.

It parses the request (as any engine must) and replies with a fixed answer
(``--answer`` encoded by the builtin tokenizer, then the stop id) and fixed
log-probabilities, so that a benchmark measures what sits in front of it,
not a model. It remembers the ``input_ids`` of the last request
(``GET /last``) so the benchmark can send exactly those ids to it directly.

Run: ``python -m benchmarks.instant_engine --port 0`` (prints ``listening on URL``).
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
from aiohttp import web

from tracestore.gateway.serve import serve_forever
from tracestore.trainer.tokenizer import TOKENIZER


class InstantEngine:
    """The fixed answer and the last request's ids."""

    def __init__(self, answer: str) -> None:
        self.ids = [*TOKENIZER.encode(answer), TOKENIZER.stop_id]
        self.lps = [[-0.5, t, None] for t in self.ids]
        self.last: list[int] = []
        self.requests = 0

    async def generate(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = orjson.loads(await request.read())
        ids = body["input_ids"]
        self.last = ids
        self.requests += 1
        meta = {
            "id": body.get("rid", ""),
            "finish_reason": {"type": "stop", "matched": TOKENIZER.stop_id},
            "prompt_tokens": len(ids),
            "completion_tokens": len(self.ids),
            "weight_version": "0",
            "output_token_logprobs": self.lps,
        }
        return web.Response(body=orjson.dumps({"output_ids": self.ids, "meta_info": meta}), content_type="application/json")

    async def last_ids(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.last), content_type="application/json")

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.ok)
        app.router.add_get("/last", self.last_ids)
        app.router.add_get("/health", self.ok)
        return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.instant_engine", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--answer", default="then add 3 then use mul 2 then reach done with sub 1 from 9")
    args = ap.parse_args(argv)
    eng = InstantEngine(args.answer)

    async def make() -> web.Application:
        return eng.app()

    serve_forever(make, args.host, args.port, lambda url: print(f"listening on {url}", flush=True))


if __name__ == "__main__":
    main()
