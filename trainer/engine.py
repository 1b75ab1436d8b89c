"""The reference policy served over HTTP in SGLang's native shape (``tracestore engine``).

Endpoints (the subset of SGLang's native API a session gateway needs):

* ``POST /generate``: ``input_ids``, ``sampling_params`` (``max_new_tokens``,
  ``temperature`` (0 = greedy), ``stop_token_ids``, ``stop`` strings,
  ``ignore_eos``, ``sampling_seed``; ``top_p``/``top_k`` are accepted and
  ignored), ``return_logprob``, ``return_routed_experts``, ``stream``,
  ``rid``. The reply: ``output_ids``, ``text``, ``meta_info`` with ``id``,
  ``finish_reason`` (``{"type": "stop"|"length"|"abort", "matched"}``),
  ``prompt_tokens``, ``completion_tokens``, ``output_token_logprobs``
  (``[[logprob, id, null], ...]``), ``weight_version`` and, when asked,
  ``routed_experts`` (base64 of int32 little-endian rows, one per token fed
  through the model: ``prompt + output - 1`` rows, as SGLang) with
  ``routed_experts_shape`` ``[rows, layers, top_k]``. With ``stream`` the
  reply is SSE: each ``data:`` chunk carries the ids (and logprobs) new since
  the previous one, the last one the finish reason and the experts, then
  ``data: [DONE]``.
* ``POST /abort_request``: ``{"rid"}`` or ``{"abort_all": true}``; the
  request ends with finish reason ``abort`` (an abort that arrives before its
  request is remembered for a minute). A client that disconnects aborts its
  request too.
* ``POST /update_weights_from_disk``: ``{"model_path", "weight_version"}``
  loads a ``torch.save`` state dict (or a trainer checkpoint's ``model.pt``);
  ``POST /update_weight_version``: ``{"new_version"}``.
* ``GET /health``, ``GET /get_model_info``.

Generation runs one request at a time on a worker thread (the policy is
tiny, CPU-bound and single-threaded); weight loads run on the same thread,
between generations. :class:`PolicyEngine` can also serve from inside a
process that owns it (a rollout worker): :meth:`PolicyEngine.set_weights`.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import torch
from aiohttp import web

from .policy import Generation, MoEPolicy, load_numpy_state, new_policy, set_determinism
from .tokenizer import TOKENIZER

#: How long an abort for a request not seen yet is remembered.
EARLY_ABORT_S = 60.0


class BadRequest(ValueError):
    """A /generate body the engine cannot serve (answered 400)."""


@dataclass
class _Job:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    stop_ids: tuple[int, ...]
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    experts: bool
    abort: threading.Event = field(default_factory=threading.Event)
    emit: Callable[[int, float], None] | None = None
    matched: int | str | None = None
    version: int = 0


def _ids(body: dict[str, Any], vocab: int) -> list[int]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (text input is not supported)")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in ids):
        raise BadRequest(f"input_ids must be integers in [0, {vocab})")
    return ids


def _job(body: dict[str, Any], vocab: int, default_stop: int) -> _Job:
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = sp.get("max_new_tokens", 128)
    temp = sp.get("temperature", 1.0)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise BadRequest(f"max_new_tokens must be a positive integer, got {max_new!r}")
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
        raise BadRequest(f"temperature must be >= 0, got {temp!r}")
    stop_ids = sp.get("stop_token_ids") or [default_stop]
    if sp.get("ignore_eos"):
        stop_ids = []
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(x, int) for x in stop_ids) or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("stop_token_ids must be integers and stop non-empty strings")
    seed = sp.get("sampling_seed")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    return _Job(
        rid=rid,
        input_ids=_ids(body, vocab),
        max_new_tokens=max_new,
        temperature=float(temp),
        stop_ids=tuple(stop_ids),
        stop=tuple(stop),
        seed=seed if isinstance(seed, int) else None,
        logprobs=bool(body.get("return_logprob", True)),
        experts=bool(body.get("return_routed_experts", False)),
    )


class PolicyEngine:
    """A :class:`~trainer.policy.MoEPolicy` behind SGLang's native HTTP API.

    ``seed`` seeds the sampling generator shared by requests without their
    own ``sampling_seed``; ``version`` is the initial weight version.
    """

    def __init__(self, policy: MoEPolicy, *, seed: int = 0, version: int = 0) -> None:
        self.policy = policy
        self.tok = TOKENIZER
        self.version = version
        self.name = "tracestore-reference-moe"
        self._gen = torch.Generator().manual_seed(seed)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._lock = threading.Lock()
        self._running: dict[str, _Job] = {}
        self._early: OrderedDict[str, float] = OrderedDict()
        self.requests = 0
        self.aborted = 0

    def abort_all(self) -> int:
        """Abort every request running or queued (an engine pause before a weight update)."""
        with self._lock:
            for job in self._running.values():
                job.abort.set()
            return len(self._running)

    # -- weights ----------------------------------------------------------------------------

    def set_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        """Load numpy weights and set the version, between generations (blocks until done)."""

        def load() -> int:
            load_numpy_state(self.policy, state)
            self.version = version
            return version

        return self._pool.submit(load).result()

    def load_file(self, path: str, version: int) -> int:
        """Load a ``torch.save`` state dict (or a trainer ``model.pt``) and set the version."""
        ck = torch.load(path, weights_only=True, map_location="cpu")
        self.policy.load_state_dict(ck["model"] if isinstance(ck, dict) and "model" in ck else ck)
        self.version = version
        return version

    # -- generation (worker thread) ---------------------------------------------------------

    def _generate(self, job: _Job) -> Generation:
        job.version = self.version
        gen = torch.Generator().manual_seed(job.seed) if job.seed is not None else self._gen
        out: list[int] = []

        def on_token(tid: int, lp: float) -> bool:
            out.append(tid)
            if job.emit is not None:
                job.emit(tid, lp)
            if job.stop:
                tail = self.tok.decode(out[-64:])
                for s in job.stop:
                    if tail.endswith(s):
                        job.matched = s
                        return True
            return False

        g = self.policy.generate(
            job.input_ids,
            max_new_tokens=job.max_new_tokens,
            stop_id=job.stop_ids,
            generator=gen,
            temperature=job.temperature,
            should_abort=job.abort.is_set,
            on_token=on_token,
        )
        if g.finish_reason == "stop" and job.matched is None and g.output_ids:
            job.matched = g.output_ids[-1]
        if g.finish_reason == "abort":
            self.aborted += 1  # counted here: a client that left never reads the reply
        return g

    # -- HTTP -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._http_generate)
        app.router.add_post("/abort_request", self._http_abort)
        app.router.add_post("/update_weights_from_disk", self._http_load)
        app.router.add_post("/update_weight_version", self._http_version)
        app.router.add_get("/health", self._http_health)
        app.router.add_get("/get_model_info", self._http_info)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        with self._lock:
            for job in self._running.values():
                job.abort.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _meta(self, job: _Job, ids: list[int], lps: list[float], finish: dict[str, Any] | None, n: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": finish,
            "prompt_tokens": len(job.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": str(job.version),
        }
        if job.logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
        return meta

    def _final(self, job: _Job, g: Generation, meta: dict[str, Any]) -> None:
        if job.experts:
            rows = np.ascontiguousarray(g.routed_experts[1:], dtype="<i4")
            meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
            meta["routed_experts_shape"] = list(rows.shape)

    def _register(self, job: _Job) -> None:
        with self._lock:
            now = time.monotonic()
            while self._early and next(iter(self._early.values())) < now - EARLY_ABORT_S:
                self._early.popitem(last=False)
            if self._early.pop(job.rid, None) is not None:
                job.abort.set()
            self._running[job.rid] = job
            self.requests += 1

    def _unregister(self, job: _Job) -> None:
        with self._lock:
            self._running.pop(job.rid, None)

    async def _http_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            job = _job(body, self.tok.vocab_size, self.tok.stop_id)
            if len(job.input_ids) >= self.policy.cfg.max_len:
                raise BadRequest(
                    f"prompt of {len(job.input_ids)} tokens leaves no room (max_len {self.policy.cfg.max_len})"
                )
        except BadRequest as exc:
            return _error(400, str(exc))
        self._register(job)
        loop = asyncio.get_running_loop()
        try:
            if body.get("stream"):
                return await self._stream(request, job, loop)
            g = await loop.run_in_executor(self._pool, self._generate, job)
            meta = self._meta(job, g.output_ids, g.logprobs, _finish(g, job), len(g.output_ids))
            self._final(job, g, meta)
            return web.Response(
                body=orjson.dumps({"text": self.tok.decode(g.output_ids), "output_ids": g.output_ids, "meta_info": meta}),
                content_type="application/json",
            )
        except ValueError as exc:
            return _error(400, str(exc))
        except (asyncio.CancelledError, ConnectionResetError):
            job.abort.set()  # the client went away: stop generating for it
            raise
        finally:
            self._unregister(job)

    async def _stream(self, request: web.Request, job: _Job, loop: asyncio.AbstractEventLoop) -> web.StreamResponse:
        queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        def emit(t: int, lp: float) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (t, lp))

        job.emit = emit
        fut: asyncio.Future[Generation] = loop.run_in_executor(self._pool, self._generate, job)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = 0
        while True:
            getter: asyncio.Future[Any] = asyncio.ensure_future(queue.get())
            waiting: list[asyncio.Future[Any]] = [getter, fut]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                items: list[tuple[int, float]] = []
            else:
                items = [getter.result()]
            while not queue.empty():
                items.append(queue.get_nowait())
            if fut.done() and queue.empty():
                g = fut.result()  # raises ValueError: reported below, before any chunk
                ids = [t for t, _ in items]
                lps = [lp for _, lp in items]
                n += len(ids)
                meta = self._meta(job, ids, lps, _finish(g, job), n)
                self._final(job, g, meta)
                await resp.write(_sse({"text": self.tok.decode(ids), "output_ids": ids, "meta_info": meta}))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            if items:
                ids = [t for t, _ in items]
                n += len(ids)
                meta = self._meta(job, ids, [lp for _, lp in items], None, n)
                await resp.write(_sse({"text": self.tok.decode(ids), "output_ids": ids, "meta_info": meta}))

    async def _http_abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        with self._lock:
            if body.get("abort_all"):
                targets = list(self._running.values())
            else:
                rid = body.get("rid")
                if not isinstance(rid, str):
                    return _error(400, "rid must be a string (or abort_all: true)")
                job = self._running.get(rid)
                targets = [job] if job is not None else []
                if job is None:
                    self._early[rid] = time.monotonic()
                    while len(self._early) > 10_000:
                        self._early.popitem(last=False)
            for job in targets:
                job.abort.set()
        return web.json_response({"success": True, "aborted": len(targets)})

    async def _http_load(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            path = body.get("model_path")
            if not isinstance(path, str):
                raise BadRequest("model_path must be a path")
            version = _version(body.get("weight_version"), self.version + 1)
            loop = asyncio.get_running_loop()
            v = await loop.run_in_executor(self._pool, self.load_file, path, version)
        except (BadRequest, OSError, RuntimeError, KeyError) as exc:
            return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response({"success": True, "message": "weights loaded", "weight_version": str(v)})

    async def _http_version(self, request: web.Request) -> web.Response:
        try:
            version = _version((await self._body(request)).get("new_version"), self.version + 1)
        except BadRequest as exc:
            return _error(400, str(exc))

        def bump() -> int:
            self.version = version
            return version

        v = await asyncio.get_running_loop().run_in_executor(self._pool, bump)
        return web.json_response({"success": True, "weight_version": str(v)})

    async def _http_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _http_info(self, request: web.Request) -> web.Response:
        cfg = self.policy.cfg
        return web.json_response(
            {
                "model_path": self.name,
                "tokenizer_path": "builtin",
                "is_generation": True,
                "weight_version": str(self.version),
                "vocab_size": cfg.vocab_size,
                "max_len": cfg.max_len,
                "num_layers": cfg.n_layers,
                "top_k": cfg.top_k,
                "requests": self.requests,
                "aborted": self.aborted,
            }
        )


def _finish(g: Generation, job: _Job) -> dict[str, Any]:
    return {"type": g.finish_reason, "matched": job.matched if g.finish_reason == "stop" else None}


def _version(raw: Any, default: int) -> int:
    if raw is None:
        return default
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise BadRequest(f"weight version must be an integer, got {raw!r}") from None
    if v < 0:
        raise BadRequest(f"weight version must be >= 0, got {v}")
    return v


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequest", "code": status}, status=status)


def build_engine(*, seed: int = 0, warmup_steps: int = 0, max_len: int = 256, version: int = 0) -> PolicyEngine:
    """The reference policy (``seed``), warm-started for ``warmup_steps`` as the trainer does."""
    set_determinism(seed)
    policy = new_policy(TOKENIZER.vocab_size, seed=seed, max_len=max_len)
    if warmup_steps:
        from .warmup import warm_start

        warm_start(policy, TOKENIZER, steps=warmup_steps, seed=seed)
    policy.eval()
    return PolicyEngine(policy, seed=seed, version=version)


__all__ = ["BadRequest", "PolicyEngine", "build_engine"]
