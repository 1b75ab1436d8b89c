"""SGLang's native protocol (``--engine-api sglang``, the default).

Token ids in, token ids + log-probabilities (+ routed experts) out::

    POST /generate        {"rid", "input_ids", "sampling_params": {"max_new_tokens",
                           "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                           "ignore_eos", "sampling_seed"}, "return_logprob": true,
                           "return_routed_experts": bool, "stream": bool}
      -> {"output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort",
          "matched": id|str|null}, "prompt_tokens", "completion_tokens",
          "output_token_logprobs": [[logprob, id, null], ...], "weight_version",
          "routed_experts": base64 int32 LE, "routed_experts_shape": [rows, layers, top_k]}}
      (stream: SSE ``data: {...}`` chunks carrying the *new* ids and logprobs
      since the previous chunk, the last one with ``finish_reason``; then
      ``data: [DONE]``)
    POST /abort_request   {"rid"}  (the request ends with finish_reason "abort"
                                    and the ids generated so far)
    GET  /get_model_info  {"model_path", "vocab_size", "max_len"|"context_length", "weight_version"}
    GET  /health

Routed experts are the rows of every token fed through the model (``prompt +
output - 1`` rows, no dummy row); ``routed_experts_shape`` is an extension of
this project's reference engine, without it the rows are kept flat.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import aiohttp
import orjson

from .base import (
    Chunk,
    EngineInfo,
    EngineLost,
    EngineOutput,
    EngineRejected,
    EngineRequest,
    json_body,
    register,
)
from .http import EngineHTTP, detail, gone, json_object, post, probe, sse_events


@register
class SGLangEngine:
    """An SGLang server (or ``tracestore engine --api sglang``) at ``url``."""

    api: ClassVar[str] = "sglang"

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> None:
        self.url = url
        self.session = session
        self.timeout = timeout
        self.wire = EngineHTTP.for_url(url)  # the turn calls' connections (None: on aiohttp)

    def close(self) -> None:
        """Close the kept connections of the turn calls (the gateway's shutdown)."""
        if self.wire is not None:
            self.wire.close()

    @staticmethod
    def payload(req: EngineRequest, *, stream: bool) -> bytes:
        """The JSON body of a ``/generate`` call."""
        s = req.sampling
        sp: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "stop_token_ids": list(s.stop_token_ids),
        }
        if s.stop:
            sp["stop"] = list(s.stop)
        if s.ignore_eos:
            sp["ignore_eos"] = True
        if s.seed is not None:
            sp["sampling_seed"] = s.seed
        rest = {
            "rid": req.rid,
            "sampling_params": sp,
            "return_logprob": True,
            "return_routed_experts": req.routed_experts,
            "stream": stream,
        }
        return json_body("input_ids", req.input_ids, rest)

    @staticmethod
    def chunk(reply: dict[str, Any]) -> Chunk:
        """One reply (or SSE chunk) of ``/generate`` as a :class:`Chunk`."""
        meta = reply.get("meta_info") or {}
        ids = tuple(int(x) for x in reply.get("output_ids") or ())
        lps = tuple(float(x[0]) for x in meta.get("output_token_logprobs") or ())
        fr = meta.get("finish_reason")
        finish: str | None = None
        matched: int | str | None = None
        if isinstance(fr, dict):
            finish = str(fr.get("type"))
            matched = fr.get("matched")
        elif isinstance(fr, str):
            finish = fr
        shape = meta.get("routed_experts_shape")
        return Chunk(
            ids=ids,
            logprobs=lps,
            finish=finish,
            matched=matched,
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            routed_experts=meta.get("routed_experts"),
            experts_shape=tuple(int(x) for x in shape) if isinstance(shape, list) else None,
        )

    async def generate(self, req: EngineRequest) -> EngineOutput:
        """One non-streaming ``/generate`` call."""
        async with post(self.session, self.url, "/generate", self.payload(req, stream=False), self.timeout, self.wire) as resp:
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineLost(self.url, f"connection lost while reading the reply: {exc!r}") from exc
            if resp.status != 200:
                raise EngineRejected(self.url, resp.status, detail(raw))
            out = EngineOutput()
            out.add(self.chunk(json_object(self.url, raw)))
            if out.finish is None:
                raise EngineLost(self.url, "reply without finish_reason")
            return out

    async def stream(self, req: EngineRequest) -> AsyncIterator[Chunk]:
        """A streaming ``/generate`` call: one :class:`Chunk` per SSE chunk."""
        async with post(self.session, self.url, "/generate", self.payload(req, stream=True), self.timeout, self.wire) as resp:
            if resp.status != 200:
                raise EngineRejected(self.url, resp.status, detail(await resp.read()))
            finished = False
            try:
                async for data in sse_events(resp):
                    if data == b"[DONE]":
                        break
                    c = self.chunk(json_object(self.url, data))
                    finished = finished or c.finish is not None
                    yield c
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineLost(self.url, f"stream broken: {exc!r}") from exc
            if not finished:
                raise EngineLost(self.url, "stream ended without a finish reason")

    async def abort(self, rid: str) -> bool:
        """``POST /abort_request``; False when the engine could not be told."""
        try:
            async with self.session.post(
                self.url + "/abort_request",
                data=orjson.dumps({"rid": rid}),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def stopped(self, rid: str) -> bool:
        """``/abort_request`` answered 2xx (nothing runs under ``rid`` any more: SGLang answers so
        for a request that ended too), or the engine is gone."""
        return await self.abort(rid) or await gone(self.session, self.url)

    async def info(self) -> EngineInfo:
        """``GET /get_model_info`` (vocabulary size and context length where reported)."""
        body = await probe(self.session, self.url, "/get_model_info")
        ctx = body.get("max_len", body.get("context_length", body.get("max_total_num_tokens")))
        vocab = body.get("vocab_size")
        version = body.get("weight_version")
        return EngineInfo(
            model=str(body["model_path"]) if body.get("model_path") is not None else None,
            vocab_size=int(vocab) if isinstance(vocab, int) else None,
            max_context=int(ctx) if isinstance(ctx, int) else None,
            weight_version=None if version is None else str(version),
        )

    async def health(self) -> bool:
        """``GET /health`` answers 200."""
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


__all__ = ["SGLangEngine"]
