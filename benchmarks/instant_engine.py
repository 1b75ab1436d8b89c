"""An instant engine for the gateway benchmarks: SGLang's ``/generate`` and vLLM's
``/v1/completions`` with token ids, and vLLM's ``/v1/chat/completions`` with messages, answered
at once (one process serves the three shapes).

It parses the request (as any engine must) and replies with a fixed answer
(``--answer`` encoded by the builtin tokenizer, then the stop id) and fixed
log-probabilities, so that a benchmark measures what sits in front of it,
not a model. It remembers the ``input_ids`` of the last request
(``GET /last``) so the benchmark can send exactly those ids to it directly.

The vLLM shape answers what ``tracestore/gateway/engines/vllm.py`` sends
(always streamed): one SSE chunk with the prompt's ids (``prompt_token_ids``,
as vLLM's first chunk with ``return_token_ids``), every answer id, one
logprob each and ``finish_reason: "stop"`` with ``stop_reason: null`` (an EOS
stop), then ``data: [DONE]``; ``GET /v1/models`` gives the model card.

The chat shape is for a gateway that forwards messages (the rLLM peer,
``benchmarks/baselines/rllm_gateway.py``): to count the work vLLM does for
such a request, it renders the messages with the chat template (the builtin
tokenizer's, the one ``tracestore gateway`` uses in the benchmarks) and
tokenises the whole prompt, every turn, as vLLM's frontend does, then answers
the same fixed answer in vLLM's non-streamed shape with ``logprobs`` and
``return_token_ids``: ``prompt_token_ids`` at the root, ``token_ids`` and
``stop_reason`` in the choice, ``logprobs.content`` one entry per answer id
(``token``, ``logprob``, ``bytes``, ``top_logprobs``), ``usage``. The message
is ``{"role", "content"}``, what ``tracestore gateway`` answers, so a client
sends the same conversation through either (vLLM adds null fields to it:
``tool_calls: []``, ``reasoning_content``, ...). Streaming is not served (a
400): the benchmarks' client does not stream.

Run: ``python -m benchmarks.instant_engine --port 0`` (prints ``listening on URL``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson
from aiohttp import web

from tracestore.gateway.serve import serve_forever
from tracestore.gateway.tokenizer import BuiltinTokenizer
from tracestore.trainer.tokenizer import TOKENIZER


class InstantEngine:
    """The fixed answer and the last request's ids."""

    def __init__(self, answer: str) -> None:
        self.ids = [*TOKENIZER.encode(answer), TOKENIZER.stop_id]
        self.lps = [[-0.5, t, None] for t in self.ids]
        self.text = answer
        self.last: list[int] = []
        self.requests = 0
        self.chat_tok = BuiltinTokenizer()
        pieces = [TOKENIZER.decode([t]) for t in self.ids]
        self.chat_lps = [{"token": p, "logprob": -0.5, "bytes": list(p.encode()), "top_logprobs": []} for p in pieces]

    async def _taken(self, request: web.Request, field: str) -> tuple[dict[str, Any], list[int]]:
        """The request's body and its input ids (``field``), remembered as the last ones."""
        body: dict[str, Any] = orjson.loads(await request.read())
        self.last = body[field]
        self.requests += 1
        return body, self.last

    async def generate(self, request: web.Request) -> web.Response:
        body, ids = await self._taken(request, "input_ids")
        meta = {
            "id": body.get("rid", ""),
            "finish_reason": {"type": "stop", "matched": TOKENIZER.stop_id},
            "prompt_tokens": len(ids),
            "completion_tokens": len(self.ids),
            "weight_version": "0",
            "output_token_logprobs": self.lps,
        }
        return web.Response(body=orjson.dumps({"output_ids": self.ids, "meta_info": meta}), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """vLLM's streamed ``/v1/completions`` with token ids: the whole answer in one chunk."""
        body, ids = await self._taken(request, "prompt")
        choice = {
            "index": 0,
            "text": self.text,
            "token_ids": self.ids,
            "logprobs": {"token_logprobs": [-0.5] * len(self.ids), "tokens": None, "top_logprobs": None, "text_offset": None},
            "finish_reason": "stop",
            "stop_reason": None,
            "prompt_token_ids": ids,
        }
        chunk = {"id": f"cmpl-{body.get('request_id', '')}", "object": "text_completion", "choices": [choice]}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def chat(self, request: web.Request) -> web.Response:
        """vLLM's non-streamed ``/v1/chat/completions``: the messages rendered and tokenised, then the answer."""
        body: dict[str, Any] = orjson.loads(await request.read())
        if body.get("stream"):
            return web.json_response({"object": "error", "message": "stream is not served", "code": 400}, status=400)
        prompt = self.chat_tok.render(body["messages"], body.get("tools"), True)
        ids = self.chat_tok.encode(prompt)
        self.last = ids
        self.requests += 1
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": self.text},
            "logprobs": {"content": self.chat_lps} if body.get("logprobs") else None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = self.ids
        out: dict[str, Any] = {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "instant"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(self.ids), "completion_tokens": len(self.ids)},
            "prompt_logprobs": None,
        }
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = ids
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "instant", "object": "model", "owned_by": "vllm", "root": "instant", "max_model_len": 1 << 20}
        return web.json_response({"object": "list", "data": [card]})

    async def last_ids(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.last), content_type="application/json")

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.ok)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
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
