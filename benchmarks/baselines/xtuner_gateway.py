"""Baseline: an XTuner-style session server (aiohttp + the one-Ray-actor text trie).

The shape of XTuner's ``SessionServer`` (PRIOR_ART.md, "Single-phase
write"), written from its description, in front of the same engine and with
the same tokenizer and chat template as ``tracestore gateway``:

* before the request: render the messages with the generation prompt,
  ``search`` the session's trie in the store actor (one Ray call), tokenise
  only the text after the matched prefix, send prefix ids + delta ids;
* after the response: render the old prompt and the new one (with the
  answer, no generation prompt, right-stripped), ``search`` again, then
  ``insert`` the delta node and the response node (two Ray calls, in flight
  together).

The store is :class:`benchmarks.baselines.actor_store.TextTrieStore` in one
Ray actor. No gate, no routing, no ownership (XTuner's merged design has
none in the session server): only what its per-request store traffic costs.
OpenAI chat completions only, not streamed.

Run: ``python -m benchmarks.baselines.xtuner_gateway --engine URL --port 0``
(starts a local Ray runtime; prints ``listening on URL``).
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tracestore.gateway.serve import serve_forever
from tracestore.gateway.tokenizer import BuiltinTokenizer

from .actor_store import TokenizedSegment, remote_class


class XTunerStyleGateway:
    """One aiohttp app: the session server, calling the trie actor per request."""

    def __init__(self, engine: str, store: Any) -> None:
        self.engine = engine
        self.store = store
        self.tok = BuiltinTokenizer()
        self.http: aiohttp.ClientSession | None = None

    async def chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        messages = body["messages"]
        sid = body.get("session_id") or request.headers["X-Session-Id"]
        prompt = self.tok.render(messages, None, True)
        pos, segs = await self.store.search.remote(sid, prompt)
        prefix = [t for s in segs for t in s.token_ids]
        delta = self.tok.encode(prompt[pos:])
        payload = {
            "input_ids": prefix + delta,
            "sampling_params": {"max_new_tokens": body.get("max_tokens", 1024), "stop_token_ids": list(self.tok.stop_token_ids)},
            "return_logprob": True,
        }
        assert self.http is not None
        async with self.http.post(self.engine + "/generate", data=orjson.dumps(payload)) as resp:
            reply = orjson.loads(await resp.read())
        out = reply["output_ids"]
        lps = [x[0] for x in reply["meta_info"]["output_token_logprobs"]]
        content = self.tok.decode(out[:-1] if out and out[-1] in self.tok.stop_token_ids else out)
        assistant = {"role": "assistant", "content": content}
        old = self.tok.render(messages, None, True)
        new = self.tok.render([*messages, assistant], None, False).rstrip()
        pos2, _ = await self.store.search.remote(sid, old)
        writes = []
        if delta:
            writes.append(self.store.insert.remote(sid, old, TokenizedSegment(old[pos2:], delta)))
        writes.append(self.store.insert.remote(sid, new, TokenizedSegment(new[len(old) :], out, list(out), lps)))
        for w in writes:
            await w
        n_in = len(prefix) + len(delta)
        return web.Response(
            body=orjson.dumps(
                {
                    "id": "chatcmpl-baseline",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": assistant, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": n_in, "completion_tokens": len(out), "total_tokens": n_in + len(out)},
                }
            ),
            content_type="application/json",
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)

        async def startup(app: web.Application) -> None:
            self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def cleanup(app: web.Application) -> None:
            if self.http is not None:
                await self.http.close()

        app.on_startup.append(startup)
        app.on_cleanup.append(cleanup)
        return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.baselines.xtuner_gateway", description=__doc__)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    store = remote_class().remote()
    gw = XTunerStyleGateway(args.engine, store)

    async def make() -> web.Application:
        return gw.app()

    try:
        serve_forever(make, args.host, args.port, lambda url: print(f"listening on {url}", flush=True))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
