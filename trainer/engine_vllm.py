"""The reference policy in vLLM's OpenAI-compatible shape (``tracestore engine --api vllm``).

What a vLLM server (>= 0.10.2, the first with ``return_token_ids``) answers,
for the requests a session gateway sends it:

* ``POST /v1/completions`` with ``prompt`` a list of token ids (one
  prompt; ``[[ids]]`` too), ``max_tokens`` (default 16), ``temperature``,
  ``top_p`` / ``top_k`` / ``min_p`` (accepted, ignored: the reference
  policy samples the whole distribution), ``stop`` (a string or a list),
  ``stop_token_ids``, ``ignore_eos`` (the EOS ``<|im_end|>`` no longer stops
  it; ``stop_token_ids`` still do, as in vLLM), ``seed``, ``logprobs`` (the
  number of alternatives, 0-20), ``return_token_ids``, ``stream``,
  ``stream_options.include_usage``, ``request_id``, ``model`` (404 when it
  names another model). A prompt that leaves no room for ``max_tokens``
  under ``max_model_len`` is a 400, as in vLLM (vLLM rejects, it does not
  clamp); so are text prompts, ``n`` > 1 and ``echo`` here.
* The reply: ``{"id": "cmpl-<rid>", "object": "text_completion",
  "created", "model", "choices": [{"index": 0, "text", "logprobs":
  {"text_offset", "token_logprobs", "tokens", "top_logprobs"}, "finish_reason":
  "stop"|"length"|"abort", "stop_reason", "token_ids", "prompt_token_ids",
  "prompt_logprobs": null}], "usage": {"prompt_tokens", "completion_tokens",
  "total_tokens"}}``. ``token_ids`` are every generated id, the stop id
  included; ``stop_reason`` is the stop id of ``stop_token_ids`` or the stop
  string that ended it, and null for the EOS (or a length); ``text`` drops
  special tokens and a matched stop string.
* Streamed (``stream: true``): SSE ``data:`` chunks of ``object:
  "text_completion"`` whose choice carries the ids new since the previous
  chunk (``token_ids``), their logprobs, the text delta, ``finish_reason`` and
  ``stop_reason`` (null until the last), ``prompt_token_ids`` in the first
  chunk only; with ``stream_options.include_usage`` a last chunk with
  ``choices: []`` and the usage; then ``data: [DONE]``.
* A client that disconnects aborts its request (that is how vLLM is aborted:
  there is no abort endpoint); a request ended by the engine itself reports
  ``finish_reason: "abort"``.
* Errors: ``{"error": {"message", "type": "BadRequestError"|"NotFoundError",
  "param", "code"}}`` with the HTTP status in ``code``.
* ``GET /v1/models``: ``{"object": "list", "data": [{"id", "object":
  "model", "created", "owned_by": "vllm", "root", "parent": null,
  "max_model_len", "permission": [...]}]}`` (no vocabulary size, as vLLM).
* ``GET /health``: 200, empty body.

Plus the reference engine's extras (``/update_weights_from_disk``,
``/update_weight_version``, ``/get_model_info``; :mod:`.engine`).
Logprobs are those of the sampling distribution (softmax of logits /
temperature), in both shapes: vLLM's ``--logprobs-mode processed_logprobs``
(its default ``raw_logprobs`` reports them before the temperature).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from .batching import Job, Sampled
from .engine import BadRequest, PolicyEngine, read_json, sse, token_ids
from .policy import Generation
from .tokenizer import SPECIAL_TOKENS, TOKENIZER

#: vLLM's default ``--max-logprobs``.
MAX_LOGPROBS = 20

_SPECIAL = frozenset(TOKENIZER.token_id(t) for t in SPECIAL_TOKENS)


class NotFound(BadRequest):
    """A request naming a model this engine does not serve (404)."""


class Completion:
    """One ``/v1/completions`` request: its job and how to answer it."""

    def __init__(self, body: dict[str, Any], engine: PolicyEngine, header_rid: str | None) -> None:
        self.engine = engine
        model = body.get("model")
        if model is not None and model != engine.name:
            raise NotFound(f"The model `{model}` does not exist.", "model")
        for name, ok in (("n", body.get("n", 1) in (None, 1)), ("echo", not body.get("echo"))):
            if not ok:
                raise BadRequest(f"{name} is not supported by the reference engine", name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, (str, type(None))) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            raise BadRequest("text prompts are not supported by the reference engine: send token ids", "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            raise BadRequest("one prompt per request", "prompt")
        ids = token_ids(prompt, TOKENIZER.vocab_size, "prompt")
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens
        if not _is_int(max_tokens) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        limit = engine.max_len
        if max_tokens > limit:
            raise BadRequest(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        if len(ids) > limit - max_tokens:
            raise BadRequest(
                f"You passed {len(ids)} input tokens and requested {max_tokens} output tokens. However, "
                f"the model's context length is only {limit} tokens, resulting in a maximum input length "
                f"of {limit - max_tokens} tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        temp = body.get("temperature")
        temp = 1.0 if temp is None else temp
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
            raise BadRequest(f"temperature must be >= 0, got {temp!r}", "temperature")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a non-empty string or a list of them", "stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(_is_int(x) for x in stop_ids):
            raise BadRequest("stop_token_ids must be a list of integers", "stop_token_ids")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}", "logprobs")
        options = body.get("stream_options")
        if options and not body.get("stream"):
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        seed = body.get("seed")
        rid = header_rid or body.get("request_id") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("request_id must be a string", "request_id")
        self.ignore_eos = bool(body.get("ignore_eos"))
        self.stream = bool(body.get("stream"))
        self.usage = bool(isinstance(options, dict) and options.get("include_usage"))
        self.logprobs: int | None = logprobs
        self.return_ids = bool(body.get("return_token_ids"))
        eos = () if self.ignore_eos else (TOKENIZER.stop_id,)
        self.job = Job(
            rid=rid,
            input_ids=ids,
            max_new_tokens=max_tokens,
            temperature=float(temp),
            stop_ids=frozenset([*stop_ids, *eos]),
            stop=tuple(stop),
            seed=seed if _is_int(seed) else None,
            top_n=logprobs or 0,
        )
        self.id = f"cmpl-{rid}"
        self.created = int(time.time())
        # what a stream decoded and sent so far
        self.decoded = ""
        self.sent_text = 0
        self.first = True

    def stop_reason(self, g: Generation) -> int | str | None:
        """vLLM's ``stop_reason``: the stop id or string, null for the EOS and for other finishes."""
        matched = self.job.matched
        if g.finish_reason != "stop" or (matched == TOKENIZER.stop_id and not self.ignore_eos):
            return None
        return matched

    def text(self, ids: list[int]) -> str:
        """The text of a whole answer: special tokens dropped, cut before a matched stop string."""
        text = TOKENIZER.decode(t for t in ids if t not in _SPECIAL)
        matched = self.job.matched
        if isinstance(matched, str) and matched in text:
            return text[: text.index(matched)]
        return text

    def logprob_block(self, tokens: list[Sampled], offset: int) -> dict[str, Any] | None:
        """``choices[0].logprobs`` for ``tokens``, text offsets from ``offset``."""
        if self.logprobs is None:
            return None
        pieces = [TOKENIZER.decode([t.id]) for t in tokens]
        offsets = []
        for p in pieces:
            offsets.append(offset)
            offset += len(p)
        tops = []
        for t, p in zip(tokens, pieces, strict=True):
            top = {p: max(t.logprob, -9999.0)}
            for alt, lp in t.top[: self.logprobs]:
                top.setdefault(TOKENIZER.decode([alt]), max(lp, -9999.0))
            tops.append(top)
        return {
            "text_offset": offsets,
            "token_logprobs": [max(t.logprob, -9999.0) for t in tokens],
            "tokens": pieces,
            "top_logprobs": tops,
        }

    def usage_block(self, completion: int) -> dict[str, Any]:
        """``usage``."""
        prompt = len(self.job.input_ids)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion, "prompt_tokens_details": None}

    def chunk(self, tokens: list[Sampled], g: Generation | None) -> dict[str, Any]:
        """One streamed chunk: the tokens new since the last one (the finish with the last).

        The text is streamed as vLLM does: held back by the longest stop
        string's length - 1 until the end, and cut before a matched stop.
        """
        offset = self.sent_text
        self.decoded += TOKENIZER.decode(t.id for t in tokens if t.id not in _SPECIAL)
        visible = self.decoded
        matched = self.job.matched
        if g is not None and isinstance(matched, str) and matched in visible:
            visible = visible[: visible.index(matched)]
        elif g is None and self.job.stop:
            visible = visible[: max(0, len(visible) - (max(map(len, self.job.stop)) - 1))]
        delta = visible[self.sent_text :]
        self.sent_text = max(self.sent_text, len(visible))
        choice: dict[str, Any] = {
            "index": 0,
            "text": delta,
            "logprobs": self.logprob_block(tokens, offset),
            "finish_reason": None if g is None else g.finish_reason,
            "stop_reason": None if g is None else self.stop_reason(g),
            "prompt_token_ids": self.job.input_ids if self.return_ids and self.first else None,
            "token_ids": [t.id for t in tokens] if self.return_ids else None,
        }
        self.first = False
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.engine.name, "choices": [choice]}

    def whole(self, tokens: list[Sampled], g: Generation) -> dict[str, Any]:
        """The non-streamed reply."""
        choice = {
            "index": 0,
            "text": self.text(g.output_ids),
            "logprobs": self.logprob_block(tokens, 0),
            "finish_reason": g.finish_reason,
            "stop_reason": self.stop_reason(g),
            "token_ids": g.output_ids if self.return_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": self.job.input_ids if self.return_ids else None,
        }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.engine.name,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.usage_block(len(g.output_ids)),
            "kv_transfer_params": None,
        }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status)


class VLLMShape:
    """The vLLM-shaped HTTP API over a :class:`~trainer.engine.PolicyEngine`."""

    def __init__(self, engine: PolicyEngine) -> None:
        self.engine = engine

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.engine.add_extras(app)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = Completion(await read_json(request), self.engine, request.headers.get("X-Request-Id"))
        except BadRequest as exc:
            return _error(404 if isinstance(exc, NotFound) else 400, str(exc), exc.param)
        job = req.job
        self.engine.register(job)
        try:
            if req.stream:
                return await self._stream(request, req)
            got, g = await self.engine.complete(job)
            return web.json_response(req.whole(got, g))
        except (asyncio.CancelledError, ConnectionResetError):
            job.abort.set()  # the client went away: vLLM aborts the request
            raise
        finally:
            self.engine.unregister(job)

    async def _stream(self, request: web.Request, req: Completion) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = 0
        async for tokens, g in self.engine.run(req.job):
            if not tokens and g is None:
                continue
            n += len(tokens)
            await resp.write(sse(req.chunk(tokens, g)))
        if req.usage:
            tail = {"id": req.id, "object": "text_completion", "created": req.created, "model": self.engine.name,
                    "choices": [], "usage": req.usage_block(n)}
            await resp.write(sse(tail))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        e = self.engine
        now = int(time.time())
        card = {
            "id": e.name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": e.name,
            "parent": None,
            "max_model_len": e.max_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


def vllm_app(engine: PolicyEngine) -> web.Application:
    """``engine`` served in vLLM's OpenAI-compatible shape."""
    return VLLMShape(engine).app()


__all__ = ["Completion", "VLLMShape", "vllm_app"]
