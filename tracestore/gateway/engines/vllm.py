"""vLLM's OpenAI-compatible server with token ids (``--engine-api vllm``).

Token ids in, token ids + log-probabilities out (vLLM >= 0.10.2, the first
that returns ``token_ids``)::

    POST /v1/completions  {"prompt": [ids], "max_tokens", "temperature", "top_p", "top_k",
                           "stop": [str], "stop_token_ids": [ids], "ignore_eos", "seed",
                           "logprobs": 1, "return_token_ids": true, "stream": true,
                           "request_id": rid}
      -> SSE ``data: {"id", "object": "text_completion", "choices": [{"index": 0, "text",
         "token_ids": [the ids new since the previous chunk], "logprobs": {"token_logprobs":
         [one per id], "tokens", "top_logprobs", "text_offset"}, "finish_reason": null |
         "stop" | "length" | "abort", "stop_reason": null | id | str,
         "prompt_token_ids" (first chunk only)}]}`` chunks, a usage chunk with
         ``choices: []`` when asked (ignored), ``data: {"error": {"message", "code"}}``
         on a failure mid-stream, then ``data: [DONE]``
    GET  /v1/models       {"data": [{"id", "root", "max_model_len"}]}  (no vocabulary size)
    GET  /health          200

What vLLM returns, read from its source (``entrypoints/openai/completion``,
``v1/core/sched/utils.check_stop``, ``v1/engine/detokenizer``):

* ``token_ids`` are every id it generated, the stop id included (a stop id
  of ``stop_token_ids`` or the EOS; for a stop string, the id whose text
  completed it; the string itself is only cut from ``text``);
* ``stop_reason`` is the id of ``stop_token_ids`` or the stop string that
  ended it, and null for the EOS: a ``stop`` finish without one matched the
  last id, which is what :attr:`Chunk.matched` says then;
* ``ignore_eos`` ignores only the EOS (``stop_token_ids`` still stop it),
  while the contract's ``ignore_eos`` goes on past the stop ids too: with
  it, no ``stop_token_ids`` are sent;
* a prompt with no room for ``max_tokens`` under ``max_model_len`` is a
  400, not a shorter answer;
* ``finish_reason`` ``abort`` comes from an abort inside the engine (its
  pause); ``repetition`` (asked for only with ``repetition_detection``) is
  read as ``stop``.

**Abort** = close the request's connection: vLLM aborts a request whose
client left (it has no abort endpoint). :meth:`VLLMEngine.abort` closes it;
the generation then ends with ``finish == "abort"`` and the ids received
before. That is why :meth:`VLLMEngine.generate` streams too (folding the
chunks): a non-streamed reply would lose the partial answer. An abort that
comes before the engine answered the request's headers takes effect when
they arrive; one for a request not sent yet is remembered for a minute.
No routed experts, no weight version (the gate's version is recorded).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import aiohttp

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
from .http import EngineHTTP, detail, json_object, post, probe, sse_events

#: How long an abort of a request not sent yet is remembered.
EARLY_ABORT_S = 60.0
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


class _Call:
    """A request in flight: its POST (to close) and whether it was aborted."""

    __slots__ = ("post", "aborted")

    def __init__(self, p: post) -> None:
        self.post = p
        self.aborted = False


@register
class VLLMEngine:
    """A vLLM server (or ``tracestore engine --api vllm``) at ``url``."""

    api: ClassVar[str] = "vllm"

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> None:
        self.url = url
        self.session = session
        self.timeout = timeout
        self.wire = EngineHTTP.for_url(url)  # the turn calls' connections (None: on aiohttp)
        self._calls: dict[str, _Call] = {}
        self._early: OrderedDict[str, float] = OrderedDict()

    def close(self) -> None:
        """Close the kept connections of the turn calls (the gateway's shutdown)."""
        if self.wire is not None:
            self.wire.close()

    @staticmethod
    def payload(req: EngineRequest) -> bytes:
        """The JSON body of a streamed ``/v1/completions`` call."""
        s = req.sampling
        body: dict[str, Any] = {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "logprobs": 1,
            "return_token_ids": True,
            "stream": True,
            "request_id": req.rid,
        }
        if s.ignore_eos:
            body["ignore_eos"] = True  # and no stop ids: the contract goes on past them too
        else:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        return json_body("prompt", req.input_ids, body)

    def chunk(self, data: bytes, last_id: int | None) -> Chunk | None:
        """One SSE payload as a :class:`Chunk` (None for a chunk without a choice: the usage).

        ``last_id``: the last id received before, the match of an EOS stop
        whose chunk brings no id. Raises EngineRejected for an error event
        or a reply without token ids or logprobs.
        """
        obj = json_object(self.url, data)
        err = obj.get("error")
        if err is not None:
            code = err.get("code") if isinstance(err, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise EngineRejected(self.url, status, detail(data))
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return None
        ch = choices[0]
        if not isinstance(ch, dict):
            raise EngineRejected(self.url, 502, "choices[0] is not an object")
        raw_ids = ch.get("token_ids")
        if not isinstance(raw_ids, list):
            raise EngineRejected(
                self.url, 502, "reply without choices[0].token_ids: vLLM returns them from 0.10.2 on (return_token_ids)"
            )
        ids = tuple(int(x) for x in raw_ids)
        lps: tuple[float, ...] = ()
        if ids:
            block = ch.get("logprobs")
            raw_lps = block.get("token_logprobs") if isinstance(block, dict) else None
            if not isinstance(raw_lps, list) or len(raw_lps) != len(ids) or any(x is None for x in raw_lps):
                raise EngineRejected(self.url, 502, f"{len(ids)} token ids without one logprob each")
            lps = tuple(float(x) for x in raw_lps)
        fr = ch.get("finish_reason")
        if fr is None:
            return Chunk(ids=ids, logprobs=lps)
        finish = _FINISH.get(str(fr))
        if finish is None:
            raise EngineRejected(self.url, 502, f"unknown finish_reason {fr!r}")
        matched: int | str | None = None
        if finish == "stop" and fr == "stop":
            sr = ch.get("stop_reason")
            matched = sr if isinstance(sr, (int, str)) and not isinstance(sr, bool) else (ids[-1] if ids else last_id)
        return Chunk(ids=ids, logprobs=lps, finish=finish, matched=matched)

    async def generate(self, req: EngineRequest) -> EngineOutput:
        """The whole generation, streamed and folded (so that an abort keeps the ids so far)."""
        out = EngineOutput()
        async for c in self.stream(req):
            out.add(c)
        return out

    async def stream(self, req: EngineRequest) -> AsyncIterator[Chunk]:
        """A streamed ``/v1/completions`` call: one :class:`Chunk` per SSE chunk with ids or a finish.

        Ends with ``finish == "abort"`` after :meth:`abort`; raises
        EngineRefused / EngineLost / EngineRejected.
        """
        if self._take_early(req.rid):
            yield Chunk(finish="abort")
            return
        call = _Call(post(self.session, self.url, "/v1/completions", self.payload(req), self.timeout, self.wire))
        self._calls[req.rid] = call
        finished = False
        try:
            async with call.post as resp:
                if call.aborted:
                    call.post.close()
                    yield Chunk(finish="abort")
                    return
                if resp.status != 200:
                    raise EngineRejected(self.url, resp.status, detail(await resp.read()))
                last_id: int | None = None
                try:
                    async for data in sse_events(resp):
                        if data == b"[DONE]" or finished:
                            continue  # read to the end: the connection is then kept for the next call
                        c = self.chunk(data, last_id)
                        if c is None or (not c.ids and c.finish is None):
                            continue
                        if c.ids:
                            last_id = c.ids[-1]
                        finished = c.finish is not None
                        yield c
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    if finished:
                        return
                    if call.aborted:
                        yield Chunk(finish="abort")
                        return
                    raise EngineLost(self.url, f"stream broken: {exc!r}") from exc
                if not finished:
                    if call.aborted:
                        yield Chunk(finish="abort")
                        return
                    raise EngineLost(self.url, "stream ended without a finish reason")
        except BaseException:
            call.post.close()  # a caller that left (or an error) ends the request at the engine
            raise
        finally:
            if self._calls.get(req.rid) is call:
                del self._calls[req.rid]

    async def abort(self, rid: str) -> bool:
        """Close request ``rid``'s connection (vLLM then aborts it); remembered when not sent yet."""
        call = self._calls.get(rid)
        if call is None:
            now = time.monotonic()
            self._early[rid] = now
            while self._early and (len(self._early) > 10_000 or next(iter(self._early.values())) < now - EARLY_ABORT_S):
                self._early.popitem(last=False)
            return True
        call.aborted = True
        call.post.close()
        return True

    async def stopped(self, rid: str) -> bool:
        """Always True after a lost connection: vLLM aborts a request whose client left, and an
        engine that is gone runs nothing."""
        await self.abort(rid)
        return True

    def _take_early(self, rid: str) -> bool:
        if not self._early:
            return False
        seen = self._early.pop(rid, None)
        return seen is not None and seen >= time.monotonic() - EARLY_ABORT_S

    async def info(self) -> EngineInfo:
        """``GET /v1/models``: the model and its ``max_model_len`` (vLLM reports no vocabulary size)."""
        body = await probe(self.session, self.url, "/v1/models")
        data = body.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise EngineLost(self.url, "GET /v1/models lists no model")
        card = data[0]
        ctx = card.get("max_model_len")
        return EngineInfo(
            model=str(card["id"]) if card.get("id") is not None else None,
            vocab_size=None,
            max_context=ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None,
            weight_version=None,
        )

    async def health(self) -> bool:
        """``GET /health`` answers 200."""
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


__all__ = ["VLLMEngine"]
