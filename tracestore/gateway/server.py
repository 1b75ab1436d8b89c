"""The session gateway: an OpenAI/Anthropic-compatible HTTP front door that records every turn.

Per request with a session id (body ``session_id`` or header
``X-Session-Id``), in order (DESIGN section 10):

1. parse and check the body (4xx in the caller's native shape, before any I/O);
2. the first time this process sees the session: ``open_session(sid, owner)``
   (owner from ``X-Tracestore-Owner``, else ``--owner``; an open session is
   left as it is, a released one is a 410);
3. concurrently, one round trip: ``router.acquire`` (retired: 410), ``gate.admit``
   (sealed: 503 with ``Retry-After``; released: 410) and the recorder's
   ``prepare`` (chat template, prefix ``lookup``, tokenise only the text after
   the stored prefix);
4. the token ids to the session's engine (SGLang ``/generate``), streamed or not;
5. ``record_turn`` through :class:`~tracestore.session.AsyncTurnRecorder`
   (routed experts into the holder when there is one), before the client
   sees the end of the answer, so its next turn finds this one in the trie;
6. the answer (exact ``usage``), then ``gate.settle(lease, "completed")``.

Failures settle the lease with what is known and record nothing: client gone
mid-request ``aborted``; engine answered abort (a weight update) ``aborted``
and 503 so SDK clients retry; engine unreachable ``failed`` (it never got the
request) and 502; connection to the engine lost or timed out ``unknown``
(poisoned: a weight update waits until someone resolves it) and 502.

**Learning of a seal.** One watcher task per gateway, running only while
leased requests are in flight, reads ``gate.status()`` every
``gate_poll_s`` (default 50 ms): one small script call per interval per
gateway, not per request. When it sees the gate sealed it asks the engines
to abort every leased request in flight (``/abort_request``). A refused
admission (GateSealed) triggers the same at once. Latency from seal to the
engine's abort call: at most ``gate_poll_s`` plus one round trip. The watcher
also renews leases older than half their ttl.

Without a session id the gateway is a plain proxy: template, tokenise, an
engine chosen round-robin, nothing recorded, no lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import orjson
from aiohttp import web

from ..errors import (
    ConfigError,
    GateSealed,
    InvalidId,
    InvalidInput,
    NodeConflict,
    PrefixChanged,
    SessionExists,
    SessionReleased,
    SessionRetired,
    StorageError,
    TracestoreError,
)
from ..gate import DEFAULT_RETRY_AFTER_MS, Lease
from ..keys import validate_id
from ..session import AsyncTurnRecorder, ExpertHolder, Request
from ..store import AsyncTraceStore
from . import anthropic, openai
from ._http import BackgroundServer
from .chat import Answer, ApiError, ChatRequest, ToolCall, invalid, new_id
from .engine import (
    EngineClient,
    EngineLost,
    EngineRefused,
    EngineRejected,
    Generated,
    decode_experts,
)
from .metrics import Metrics
from .tokenizer import ChatTokenizer, Detokenizer, load_tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How many session ids a gateway remembers as opened (LRU).
OPENED_CACHE = 200_000


class Wire(Protocol):
    """What the server needs of a wire-format module (:mod:`.openai`, :mod:`.anthropic`)."""

    NAME: str

    def parse(self, body: dict[str, Any], default_max_tokens: int) -> ChatRequest: ...  # pragma: no cover
    def response(self, req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]: ...  # pragma: no cover
    def error_body(self, err: ApiError) -> dict[str, Any]: ...  # pragma: no cover
    def models(self, model: str) -> dict[str, Any]: ...  # pragma: no cover

    Stream: Any


@dataclass(frozen=True)
class GatewayConfig:
    """Options of a gateway (the ``tracestore gateway`` flags map onto it).

    ``engines``: engine base URLs, the router's entrypoints (sticky per
    session). ``owner``: owner tag of sessions opened without an
    ``X-Tracestore-Owner`` header. ``name``: lease holder name (default
    ``gateway-<host>-<pid>``). ``model``: the model name served (default: the
    tokenizer's). ``trace_sessions``: sessions whose latest turn
    ``/v1/sessions/{sid}/trace`` can export (LRU).
    """

    engines: tuple[str, ...]
    url: str | None = None
    run: str = "default"
    owner: str = "gateway"
    tokenizer: str = "builtin"
    tool_parser: str = "hermes"
    model: str | None = None
    name: str | None = None
    lease_ttl_s: float = 120.0
    gate_poll_s: float = 0.05
    max_body_bytes: int = 32 << 20
    engine_timeout_s: float = 600.0
    default_max_tokens: int = 1024
    trace_sessions: int = 4096
    redis_connections: int = 256

    def validate(self) -> GatewayConfig:
        """Check the options; raises ConfigError with a message a person can act on."""
        if not self.engines:
            raise ConfigError("at least one --engine URL is needed")
        for e in self.engines:
            if not re.match(r"https?://[^\s/]+\Z", e):
                raise ConfigError(f"--engine {e!r}: expected http://host:port (no path)")
        if len(set(self.engines)) != len(self.engines):
            raise ConfigError("--engine: the same URL is given twice")
        try:
            validate_id("owner", self.owner)
            if self.name is not None:
                validate_id("gateway name", self.name)
        except InvalidId as exc:
            raise ConfigError(str(exc)) from None
        for name in ("lease_ttl_s", "gate_poll_s", "engine_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.redis_connections < 8:
            raise ConfigError(f"redis_connections must be at least 8, got {self.redis_connections}")
        for name in ("max_body_bytes", "default_max_tokens", "trace_sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        return self


def _default_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:60] or "host"
    return f"gateway-{host}-{os.getpid()}"


@dataclass(frozen=True)
class GatewayStats:
    """Chat requests answered (``by_status``: HTTP status -> count; 503s are the refusals and
    aborts clients retried), requests in flight, and the gateway's own time per request
    (``overhead``: total minus the engine call) and total time, in seconds (None: no sample)."""

    requests: int
    by_status: dict[str, int]
    in_flight: int
    overhead_p50_s: float | None
    overhead_p99_s: float | None
    total_p50_s: float | None


def _pct(xs: deque[float], q: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


@dataclass(eq=False)
class _Call:
    """A request being served: what the seal watcher and the cleanup need."""

    rid: str
    sid: str | None
    engine: str
    lease: Lease | None = None
    renewed: float = field(default_factory=time.monotonic)
    abort_reason: str | None = None
    engine_started: bool = False
    engine_done: bool = False
    record_task: asyncio.Task[Any] | None = None
    settled: bool = False


@dataclass
class _Timing:
    start: float = field(default_factory=time.perf_counter)
    engine_s: float = 0.0
    store_s: float = 0.0


class Gateway:
    """One gateway process's state: store, tokenizer, engines, in-flight calls, metrics.

    Build it with :meth:`create` (connects the store and loads the
    tokenizer), then serve :meth:`app` (``tracestore gateway`` does both).
    ``holder`` keeps routed experts (a :class:`tracestore.ray.RefHolder`);
    without one the engines are not asked for them and turns are recorded
    without expert keys.
    """

    def __init__(
        self,
        config: GatewayConfig,
        store: AsyncTraceStore,
        tokenizer: ChatTokenizer,
        holder: ExpertHolder | None = None,
        *,
        owns_store: bool = False,
    ) -> None:
        self.config = config.validate()
        self.store = store
        self.tok = tokenizer
        self.holder = holder
        self.model = config.model or tokenizer.name
        self.name = config.name or _default_name()
        self.router = store.router(list(config.engines))
        self.metrics = Metrics()
        self.engines: EngineClient | None = None
        self._owns_store = owns_store
        self._calls: dict[str, _Call] = {}
        self._leased = 0
        self._busy = asyncio.Event()
        self._opened: OrderedDict[str, None] = OrderedDict()
        self._last: OrderedDict[str, tuple[list[Any], dict[str, Any], Any]] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._rr = 0
        self._overhead: deque[float] = deque(maxlen=10_000)
        self._total: deque[float] = deque(maxlen=10_000)
        self._status: dict[str, int] = {}
        self._stop_ids = frozenset(tokenizer.stop_token_ids)
        # Each store call holds one pooled connection; past the pool size redis-py raises
        # instead of waiting, so calls queue here (a few connections stay for the watcher).
        self._db_slots = asyncio.Semaphore(config.redis_connections - 4)
        # Admissions and settlements of one event-loop iteration go to Redis as one call.
        self._admits: _Coalescer[str, Lease] = _Coalescer(self._admit_batch, 1000)
        self._settles: _Coalescer[tuple[Lease, str], None] = _Coalescer(self._settle_batch, 1000)

    @classmethod
    async def create(
        cls,
        config: GatewayConfig,
        *,
        store: AsyncTraceStore | None = None,
        tokenizer: ChatTokenizer | None = None,
        holder: ExpertHolder | None = None,
    ) -> Gateway:
        """Validate ``config``, load the tokenizer and connect the store (unless given).

        Raises ConfigError (options, tokenizer) and the errors of
        :meth:`AsyncTraceStore.connect`.
        """
        config.validate()
        tok = tokenizer or load_tokenizer(config.tokenizer, config.tool_parser)
        st = store or await AsyncTraceStore.connect(config.url, run=config.run, max_connections=config.redis_connections)
        return cls(config, st, tok, holder, owns_store=store is None)

    # -- application ------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (routes, startup and cleanup hooks)."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/messages", self._anthropic)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/sessions/{sid}/trace", self._trace)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        self.engines = EngineClient(self.config.engine_timeout_s)
        self._watcher = asyncio.create_task(self._watch_gate(), name="gateway-gate-watcher")

    async def _cleanup(self, app: web.Application) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the watcher, wait for cleanups, close the engine client (and the store if owned)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self.engines is not None:
            await self.engines.close()
            self.engines = None
        if self._owns_store:
            await self.store.close()
            self._owns_store = False

    def stats(self) -> GatewayStats:
        """Counters for reports: chat requests by status, in flight, latency percentiles."""
        return GatewayStats(
            requests=sum(self._status.values()),
            by_status=dict(self._status),
            in_flight=len(self._calls),
            overhead_p50_s=_pct(self._overhead, 0.5),
            overhead_p99_s=_pct(self._overhead, 0.99),
            total_p50_s=_pct(self._total, 0.5),
        )

    # -- small endpoints --------------------------------------------------------------------

    @staticmethod
    def _wire_of(request: web.Request) -> Wire:
        return anthropic if "anthropic-version" in request.headers else openai

    def _error(self, wire: Wire, err: ApiError) -> web.Response:
        return web.Response(
            body=orjson.dumps(wire.error_body(err)),
            status=err.status,
            content_type="application/json",
            headers=err.headers(),
        )

    async def _models(self, request: web.Request) -> web.Response:
        self.metrics.requests.labels("models", "200").inc()
        return _json(self._wire_of(request).models(self.model))

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "run": self.store.run_id, "model": self.model, "engines": list(self.config.engines)})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _unknown(self, request: web.Request) -> web.Response:
        err = ApiError("not_found", f"no route {request.method} {request.path}")
        return self._error(self._wire_of(request), err)

    async def _trace(self, request: web.Request) -> web.Response:
        wire = self._wire_of(request)
        sid = request.match_info["sid"]
        try:
            validate_id("session id", sid)
            last = self._last.get(sid)
            if last is None:
                raise ApiError(
                    "not_found",
                    f"no turn of session {sid!r} was recorded by this gateway process "
                    "(export it with store.export_training_trace(sid, key))",
                )
            messages, assistant, tools = last
            key = self.tok.render([*messages, assistant], tools, False).rstrip()
            tr = await self._db(self.store.export_training_trace(sid, key))
        except InvalidId as exc:
            return self._error(wire, invalid(str(exc), "session_id"))
        except ApiError as err:
            return self._error(wire, err)
        except SessionReleased as exc:
            return self._error(wire, ApiError("gone", str(exc)))
        except TracestoreError as exc:
            return self._error(wire, ApiError("unavailable", f"{type(exc).__name__}: {exc}", retry_after_s=1.0))
        self.metrics.requests.labels("trace", "200").inc()
        return _json(
            {
                "session_id": sid,
                "input_ids": tr.input_ids,
                "labels": tr.labels,
                "logprobs": tr.logprobs,
                "versions": tr.versions,
                "expert_keys": tr.expert_keys,
            }
        )

    # -- chat endpoints ---------------------------------------------------------------------

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, openai, "chat_completions")

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, anthropic, "messages")

    async def _chat(self, request: web.Request, wire: Wire, route: str) -> web.StreamResponse:
        timing = _Timing()
        status = "500"
        self.metrics.in_flight.inc()
        try:
            resp = await self._chat_inner(request, wire, timing)
            status = str(resp.status)
            return resp
        except ApiError as err:
            status = str(err.status)
            return self._error(wire, err)
        except asyncio.CancelledError:
            status = "499"  # client closed the request (nginx's code)
            raise
        except Exception as exc:  # a bug: answer in the native shape, keep serving
            log.exception("gateway: unexpected error")
            return self._error(wire, ApiError("internal", f"{type(exc).__name__}: {exc}"))
        finally:
            total = time.perf_counter() - timing.start
            self._status[status] = self._status.get(status, 0) + 1
            self._total.append(total)
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, status).inc()
            self.metrics.latency.labels("total").observe(total)
            if timing.engine_s:
                self.metrics.latency.labels("engine").observe(timing.engine_s)
                self._overhead.append(total - timing.engine_s)
            if timing.store_s:
                self.metrics.latency.labels("tracestore").observe(timing.store_s)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                "too_large", f"request body over the limit of {self.config.max_body_bytes} bytes"
            ) from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return body

    async def _chat_inner(self, request: web.Request, wire: Wire, timing: _Timing) -> web.StreamResponse:
        body = await self._body(request)
        req = wire.parse(body, self.config.default_max_tokens)
        if req.model != self.model:
            raise ApiError(
                "not_found",
                f"model {req.model!r} is not served here; GET /v1/models lists {self.model!r}",
                param="model",
                code="model_not_found",
            )
        sid = body.get("session_id")
        header_sid = request.headers.get("X-Session-Id")
        if sid is not None and header_sid is not None and sid != header_sid:
            raise invalid("session_id in the body and X-Session-Id differ", "session_id")
        sid = sid if sid is not None else header_sid
        owner = request.headers.get("X-Tracestore-Owner", self.config.owner)
        try:
            if sid is not None:
                validate_id("session id", sid)
            validate_id("owner", owner)
        except InvalidId as exc:
            raise invalid(str(exc), "session_id" if exc.kind == "session id" else "X-Tracestore-Owner") from None
        if sid is None:
            return await self._proxy(request, wire, req, timing)
        return await self._turn(request, wire, req, sid, owner, timing)

    # -- a recorded turn --------------------------------------------------------------------

    def _recorder(self, req: ChatRequest) -> AsyncTurnRecorder:
        tools = req.tools
        memo: dict[tuple[int, bool], str] = {}

        def render(messages: Any, gen: bool) -> str:
            # The recorder renders the request's messages twice (prepare, then to check
            # the answer extends the same prompt): the list is not changed in between.
            key = (id(messages), gen)
            if messages is req.messages and key in memo:
                return memo[key]
            out = self.tok.render(messages, tools, gen)
            if messages is req.messages:
                memo[key] = out
            return out

        return AsyncTurnRecorder(self.store, render, self.tok.encode, _PutAhead() if self.holder is not None else None)

    async def _open(self, sid: str, owner: str) -> None:
        try:
            await self._db(self.store.open_session(sid, owner))
        except SessionExists:
            pass
        self._opened[sid] = None
        if len(self._opened) > OPENED_CACHE:
            self._opened.popitem(last=False)

    async def _turn(
        self, request: web.Request, wire: Wire, req: ChatRequest, sid: str, owner: str, timing: _Timing
    ) -> web.StreamResponse:
        rec = self._recorder(req)
        t0 = time.perf_counter()
        try:
            if sid not in self._opened:
                await self._open(sid, owner)
        except TracestoreError as exc:
            raise self._store_error(exc) from None
        phase = asyncio.ensure_future(
            asyncio.gather(
                self._db(rec.prepare(sid, req.messages)),
                self._db(self.router.acquire(sid)),
                self._admits.submit(sid),
                return_exceptions=True,
            )
        )
        try:
            prep, entry, lease = await asyncio.shield(phase)
        except asyncio.CancelledError:
            self._spawn(self._settle_phase(phase))
            raise
        timing.store_s += time.perf_counter() - t0
        errors = [x for x in (prep, entry, lease) if isinstance(x, BaseException)]
        if errors:
            if isinstance(lease, Lease):
                await self._settle(lease, "aborted")
            raise self._first_error(sid, errors)
        assert isinstance(prep, Request) and isinstance(lease, Lease)
        call = _Call(new_id("req-"), sid, str(entry), lease)
        return await self._serve(request, wire, req, call, prep.input_ids, timing, rec, prep)

    def _first_error(self, sid: str, errors: list[BaseException]) -> ApiError:
        for kind in (ApiError, SessionRetired, SessionReleased, GateSealed, InvalidInput):
            for e in errors:
                if isinstance(e, kind):
                    if isinstance(e, GateSealed):
                        self._abort_all("weight_update")  # learnt of a seal: stop what runs now
                    return e if isinstance(e, ApiError) else self._store_error(e)
        e = errors[0]
        if isinstance(e, TracestoreError):
            return self._store_error(e)
        raise e

    def _store_error(self, exc: TracestoreError) -> ApiError:
        if isinstance(exc, SessionRetired):
            self.metrics.gone.labels("retired").inc()
            return ApiError("gone", f"session {exc.sid!r} was retired: start a new session", code="session_retired")
        if isinstance(exc, SessionReleased):
            self.metrics.gone.labels("released").inc()
            return ApiError("gone", f"session {exc.sid!r} was released: start a new session", code="session_released")
        if isinstance(exc, GateSealed):
            self.metrics.sealed.labels("gate_sealed").inc()
            return ApiError(
                "unavailable",
                f"weights are being updated (gate sealed at version {exc.version}); retry",
                retry_after_s=exc.retry_after_ms / 1000,
                code="gate_sealed",
            )
        if isinstance(exc, InvalidInput):
            return invalid(str(exc), exc.field)
        return ApiError("unavailable", f"trace store unavailable: {type(exc).__name__}: {exc}", retry_after_s=1.0)

    async def _settle_phase(self, phase: asyncio.Future[Any]) -> None:
        """After a cancelled admission phase: settle its lease, if one was admitted."""
        results = await phase
        lease = results[2]
        if isinstance(lease, Lease):
            await self._settle(lease, "aborted")

    # -- the engine call, shared by turns and the plain proxy -------------------------------

    def _sampling(self, req: ChatRequest) -> dict[str, Any]:
        s: dict[str, Any] = {
            "max_new_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop_token_ids": list(self.tok.stop_token_ids),
        }
        if req.stop:
            s["stop"] = req.stop
        if req.ignore_eos:
            s["ignore_eos"] = True
        if req.seed is not None:
            s["sampling_seed"] = req.seed
        return s

    def _register(self, call: _Call) -> None:
        self._calls[call.rid] = call
        if call.lease is not None:
            self._leased += 1
            self._busy.set()

    def _unregister(self, call: _Call) -> None:
        if self._calls.pop(call.rid, None) is not None and call.lease is not None:
            self._leased -= 1
            if self._leased == 0:
                self._busy.clear()

    async def _serve(
        self,
        request: web.Request,
        wire: Wire,
        req: ChatRequest,
        call: _Call,
        input_ids: list[int],
        timing: _Timing,
        rec: AsyncTurnRecorder | None = None,
        prep: Request | None = None,
    ) -> web.StreamResponse:
        assert self.engines is not None
        self._register(call)
        body = EngineClient.payload(
            call.rid, input_ids, self._sampling(req), stream=req.stream, experts=self.holder is not None and rec is not None
        )
        self.metrics.tokens.labels("prompt").inc(len(input_ids))
        if prep is not None:
            self.metrics.tokens.labels("prompt_new").inc(len(prep.delta_ids))
        try:
            if call.abort_reason is not None:
                raise self._aborted(call)
            if req.stream:
                return await self._stream(request, wire, req, call, input_ids, body, timing, rec, prep)
            call.engine_started = True
            t0 = time.perf_counter()
            try:
                gen = await self.engines.generate(call.engine, body)
            finally:
                timing.engine_s += time.perf_counter() - t0
            call.engine_done = True
            if gen.finish == "abort":
                raise self._aborted(call)
            answer = self._answer(wire, req, gen, len(input_ids), call)
            if rec is not None and prep is not None:
                await self._record(call, rec, req, prep, answer, gen, timing)
            resp = web.Response(
                body=orjson.dumps(wire.response(req, answer, _rid(wire), self._piece)),
                content_type="application/json",
                headers=self._headers(call),
            )
            await resp.prepare(request)
            await resp.write_eof()
            self._completed(call)
            return resp
        except ApiError:
            await self._settle_call(call, "failed" if call.abort_reason is None else "aborted")
            raise
        except EngineRefused as exc:
            self.metrics.engine_errors.labels("refused").inc()
            await self._settle_call(call, "failed")
            raise ApiError("bad_gateway", str(exc), code="engine_unreachable") from None
        except EngineLost as exc:
            self.metrics.engine_errors.labels("lost").inc()
            self._spawn(self.engines.abort(call.engine, call.rid))
            await self._settle_call(call, "unknown")
            raise ApiError("bad_gateway", str(exc), code="engine_lost") from None
        except EngineRejected as exc:
            self.metrics.engine_errors.labels("rejected").inc()
            await self._settle_call(call, "failed")
            if 400 <= exc.status < 500:
                raise invalid(f"the engine refused the request: {exc.detail}") from None
            raise ApiError("bad_gateway", str(exc), code="engine_error") from None
        except (asyncio.CancelledError, ConnectionResetError):
            self._spawn(self._client_gone(call))
            raise
        except BaseException:
            await self._settle_call(call, "failed")
            raise

    def _aborted(self, call: _Call) -> ApiError:
        reason = call.abort_reason = call.abort_reason or "engine_abort"
        self.metrics.sealed.labels("weight_update").inc()
        self.metrics.aborted.labels(reason).inc()
        return ApiError(
            "unavailable",
            "the request was aborted for a weight update; retry",
            retry_after_s=DEFAULT_RETRY_AFTER_MS / 1000,
            code="aborted",
        )

    def _headers(self, call: _Call) -> dict[str, str]:
        h = {"X-Request-Id": call.rid}
        if call.sid is not None:
            h["X-Session-Id"] = call.sid
        if call.lease is not None:
            h["X-Tracestore-Version"] = str(call.lease.version)
        return h

    def _piece(self, tid: int) -> str:
        return self.tok.decode([tid])

    def _answer(self, wire: Wire, req: ChatRequest, gen: Generated, prompt_tokens: int, call: _Call) -> Answer:
        ids, lps = gen.output_ids, gen.logprobs
        if len(lps) != len(ids) or not ids:
            raise EngineRejected(call.engine, 502, f"{len(ids)} output ids with {len(lps)} logprobs")
        text_ids = ids[:-1] if gen.finish == "stop" and ids[-1] in self._stop_ids else ids
        text = self.tok.decode(text_ids)
        stop_string = gen.matched if isinstance(gen.matched, str) else None
        text = _cut(text, stop_string)
        if not req.ignore_eos:  # a model that spells out the end-of-turn marker ends its turn there
            text = _cut(text, self.tok.stop_word)
        calls: list[ToolCall] = []
        if req.parse_tools and req.tools:
            text, found = self.tok.parse_tool_calls(text, req.tools)
            prefix = "toolu_" if wire.NAME == "anthropic" else "call_"
            calls = [ToolCall(new_id(prefix), n, a) for n, a in found]
        finish = "length" if gen.finish == "length" else "tool_calls" if calls else "stop"
        version = call.lease.version if call.lease is not None else None
        return Answer(text, tuple(calls), finish, stop_string, ids, lps, prompt_tokens, version)

    async def _record(
        self,
        call: _Call,
        rec: AsyncTurnRecorder,
        req: ChatRequest,
        prep: Request,
        answer: Answer,
        gen: Generated,
        timing: _Timing,
    ) -> None:
        """Record the turn; the write is shielded from a client disconnect (it is the commit point)."""
        assert call.sid is not None and call.lease is not None
        experts = None
        if self.holder is not None and gen.routed_experts is not None:
            rows = len(prep.input_ids) + len(answer.output_ids) - 1
            try:
                experts = decode_experts(gen.routed_experts, gen.experts_shape, rows)
            except ValueError as exc:
                raise ApiError("bad_gateway", f"engine {call.engine}: {exc}", code="engine_error") from None
            await self._put_ahead(call.sid, rec, prep, experts)
        assistant = answer.message()
        t0 = time.perf_counter()
        call.record_task = asyncio.ensure_future(
            self._db(
                rec.after_response(
                    call.sid, req.messages, assistant, answer.output_ids, answer.logprobs, experts, call.lease.version
                )
            )
        )
        try:
            await asyncio.shield(call.record_task)
        except NodeConflict as exc:
            raise ApiError(
                "conflict", f"this turn is already recorded with other tokens ({exc}); retry", code="node_conflict"
            ) from None
        except PrefixChanged as exc:  # (an InvalidInput: before it)
            raise ApiError(
                "conflict",
                f"the conversation's stored prefix changed while this turn ran ({exc}); retry",
                code="prefix_changed",
            ) from None
        except InvalidInput as exc:
            raise ApiError(
                "internal",
                f"the turn cannot be recorded: {exc} (does the chat template re-render earlier turns "
                "differently once an answer is added? see docs/gateway.md)",
                code="unrecordable_turn",
            ) from None
        except SessionReleased as exc:
            raise self._store_error(exc) from None
        except StorageError as exc:
            raise ApiError("unavailable", f"trace store unavailable: {exc}", retry_after_s=1.0) from None
        finally:
            timing.store_s += time.perf_counter() - t0
        self.metrics.turns.inc()
        self.metrics.tokens.labels("completion").inc(answer.completion_tokens)
        self._last[call.sid] = (req.messages, assistant, req.tools)
        self._last.move_to_end(call.sid)
        if len(self._last) > self.config.trace_sessions:
            self._last.popitem(last=False)

    async def _put_ahead(self, sid: str, rec: AsyncTurnRecorder, prep: Request, experts: Any) -> None:
        """Put the delta's and the answer's expert rows into the holder on a worker thread.

        ``ray.put`` blocks; on the event loop it would stall every other
        request. The recorder then gets the keys in the order it asks for
        them (delta part, when the delta is not empty, then the answer's).
        If the recorder refuses the turn afterwards, the values stay under the
        session in the holder until the session is released.
        """
        assert self.holder is not None and isinstance(rec.holder, _PutAhead)
        p, d = len(prep.prefix.token_ids), len(prep.delta_ids)
        parts = ([experts[p : p + d]] if d else []) + [experts[p + d :]]
        loop = asyncio.get_running_loop()
        rec.holder.keys = [await loop.run_in_executor(None, self.holder.put, sid, x) for x in parts]

    # -- streaming --------------------------------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        wire: Wire,
        req: ChatRequest,
        call: _Call,
        input_ids: list[int],
        body: bytes,
        timing: _Timing,
        rec: AsyncTurnRecorder | None,
        prep: Request | None,
    ) -> web.StreamResponse:
        assert self.engines is not None
        sw = wire.Stream(req, _rid(wire), len(input_ids))
        det = Detokenizer(self.tok.decode)
        gen = Generated(prompt_tokens=len(input_ids))
        cuts = [s for s in (*req.stop, None if req.ignore_eos else self.tok.stop_word) if s]
        hold = max((len(s) for s in cuts), default=1) - 1
        text = ""
        sent = 0
        resp: web.StreamResponse | None = None

        async def open_stream() -> web.StreamResponse:
            r = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers(call)}
            )
            await r.prepare(request)
            await r.write(sw.start())
            return r

        call.engine_started = True
        t0 = time.perf_counter()
        try:
            async for meta, ids in self.engines.stream(call.engine, body):
                gen.add(meta, ids)
                text_ids = ids
                if gen.finish == "stop" and ids and ids[-1] in self._stop_ids:
                    text_ids = ids[:-1]
                text += det.push(text_ids)
                if req.parse_tools or gen.finish is not None:
                    continue
                shown = text
                for s in cuts:
                    shown = _cut(shown, s)
                safe = len(shown) if len(shown) < len(text) else max(sent, len(shown) - hold)
                if safe > sent:
                    if resp is None:
                        resp = await open_stream()
                    await resp.write(sw.text(shown[sent:safe]))
                    sent = safe
        except (EngineLost, EngineRefused, EngineRejected) as exc:
            timing.engine_s += time.perf_counter() - t0
            if resp is None:
                raise
            err = self._stream_failure(exc)
            await self._settle_call(call, "unknown" if isinstance(exc, EngineLost) else "failed")
            await resp.write(sw.error(err))
            return resp
        timing.engine_s += time.perf_counter() - t0
        call.engine_done = True
        if gen.finish == "abort":
            err = self._aborted(call)
            if resp is None:
                raise err
            await self._settle_call(call, "aborted")
            await resp.write(sw.error(err))
            return resp
        answer = self._answer(wire, req, gen, len(input_ids), call)
        if rec is not None and prep is not None:
            try:
                await self._record(call, rec, req, prep, answer, gen, timing)
            except ApiError as err:
                if resp is None:
                    raise
                await self._settle_call(call, "failed")
                await resp.write(sw.error(err))
                return resp
        if resp is None:
            resp = await open_stream()
        pending = answer.content[sent:] if answer.content.startswith(text[:sent]) else ""
        await resp.write(sw.end(answer, pending))
        await resp.write_eof()
        self._completed(call)
        return resp

    def _stream_failure(self, exc: Exception) -> ApiError:
        kind = "lost" if isinstance(exc, EngineLost) else "refused" if isinstance(exc, EngineRefused) else "rejected"
        self.metrics.engine_errors.labels(kind).inc()
        return ApiError("bad_gateway", str(exc), code=f"engine_{kind}")

    # -- plain proxy ------------------------------------------------------------------------

    async def _proxy(self, request: web.Request, wire: Wire, req: ChatRequest, timing: _Timing) -> web.StreamResponse:
        prompt = self.tok.render(req.messages, req.tools, True)
        ids = self.tok.encode(prompt)
        engine = self.config.engines[self._rr % len(self.config.engines)]
        self._rr += 1
        call = _Call(new_id("req-"), None, engine)
        return await self._serve(request, wire, req, call, ids, timing)

    # -- settling and cleanup ---------------------------------------------------------------

    async def _settle(self, lease: Lease, outcome: str) -> None:
        try:
            await self._settles.submit((lease, outcome))
        except Exception as exc:  # the lease then expires into the poison set: loud, not lost
            log.warning("gateway: could not settle lease %s as %s: %s", lease.id, outcome, exc)

    async def _admit_batch(self, sids: list[str]) -> list[Lease | BaseException]:
        """One ``admit_many`` for the admissions of one loop iteration.

        admit_many is all or nothing: when one session of the batch was released,
        each is admitted alone so that only that one is refused.
        """
        ttl = self.config.lease_ttl_s
        try:
            leases: list[Lease | BaseException] = list(
                await self._db(self.store.gate.admit_many([(s, self.name) for s in sids], ttl))
            )
            return leases
        except SessionReleased:
            if len(sids) == 1:
                raise
        alone = await asyncio.gather(*(self._db(self.store.gate.admit(s, self.name, ttl)) for s in sids), return_exceptions=True)
        return list(alone)

    async def _settle_batch(self, items: list[tuple[Lease, str]]) -> list[None | BaseException]:
        """Settle the leases of one loop iteration: one pipelined ``settle_many`` per outcome."""
        by: dict[str, list[Lease]] = {}
        for lease, outcome in items:
            by.setdefault(outcome, []).append(lease)
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self._db(self.store.gate.settle_many(ls, o)) for o, ls in by.items()))
        finally:
            self.metrics.latency.labels("settle").observe(time.perf_counter() - t0)
        return [None] * len(items)

    async def _settle_call(self, call: _Call, outcome: str) -> None:
        if call.settled:
            return
        call.settled = True
        self._unregister(call)
        if call.lease is not None:
            await self._settle(call.lease, outcome)

    def _completed(self, call: _Call) -> None:
        """The answer is out: settle ``completed`` in the background.

        Not awaited by the handler: a client that closes its connection right
        after reading the answer must not cancel the settlement.
        """
        call.settled = True
        self._unregister(call)
        if call.lease is not None:
            self._spawn(self._settle(call.lease, "completed"))

    async def _client_gone(self, call: _Call) -> None:
        """The client left (handler cancelled, or a write failed): abort, settle, record nothing new."""
        assert self.engines is not None
        if call.engine_started and not call.engine_done:
            await self.engines.abort(call.engine, call.rid)
        outcome = "aborted"
        if call.record_task is not None:
            try:
                await call.record_task
                outcome = "completed"  # recorded before the client left: the turn stands
            except Exception:
                outcome = "failed"
        else:
            self.metrics.aborted.labels("client_disconnect").inc()
        await self._settle_call(call, outcome)

    async def _db(self, coro: Awaitable[T]) -> T:
        """Await a store call once a pooled connection is free for it."""
        async with self._db_slots:
            return await coro

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the seal watcher -------------------------------------------------------------------

    def _abort_all(self, reason: str) -> int:
        """Mark every leased call aborted and ask the engines to stop those generating."""
        n = 0
        for call in list(self._calls.values()):
            if call.lease is None or call.abort_reason is not None or call.record_task is not None:
                continue
            call.abort_reason = reason
            n += 1
            if call.engine_started and not call.engine_done and self.engines is not None:
                self._spawn(self.engines.abort(call.engine, call.rid))
        return n

    async def _watch_gate(self) -> None:
        poll = self.config.gate_poll_s
        ttl = self.config.lease_ttl_s
        while True:
            await self._busy.wait()
            try:
                st = await self.store.gate.status()
                self.metrics.gate_polls.inc()
                if st.sealed:
                    self._abort_all("weight_update")
                now = time.monotonic()
                for call in list(self._calls.values()):
                    if call.lease is not None and not call.settled and now - call.renewed > ttl / 2:
                        call.renewed = now
                        await self.store.gate.renew(call.lease, ttl)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep watching: a dead watcher would miss the next seal
                log.warning("gateway: gate watcher: %s", exc)
            await asyncio.sleep(poll)


class _PutAhead:
    """The holder a turn's recorder sees: it hands out keys of values already put."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def put(self, sid: str, value: Any) -> str:
        """The next key put ahead for this turn."""
        return self.keys.pop(0)


X = TypeVar("X")
Y = TypeVar("Y")


class _Coalescer(Generic[X, Y]):
    """Gathers the calls made during one event-loop iteration into one batch call.

    ``flush(items)`` returns one result (or exception) per item, in order;
    an exception it raises goes to every item of the batch. No timer: a batch
    is sent on the loop's next iteration, so a lone call waits for nothing.
    """

    def __init__(self, flush: Callable[[list[X]], Awaitable[list[Y | BaseException]]], limit: int) -> None:
        self._flush = flush
        self._limit = limit
        self._items: list[tuple[X, asyncio.Future[Y]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, item: X) -> Y:
        """Queue ``item`` for the next batch and wait for its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Y] = loop.create_future()
        if not self._items:
            loop.call_soon(self._start)
        self._items.append((item, fut))
        return await fut

    def _start(self) -> None:
        items, self._items = self._items, []
        for i in range(0, len(items), self._limit):
            task = asyncio.ensure_future(self._run(items[i : i + self._limit]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[tuple[X, asyncio.Future[Y]]]) -> None:
        try:
            results = await self._flush([x for x, _ in items])
        except BaseException as exc:  # every caller of the batch gets it
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (_, fut), res in zip(items, results, strict=True):
            if fut.done():
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)


def _cut(text: str, stop: str | None) -> str:
    if not stop:
        return text
    i = text.find(stop)
    return text if i < 0 else text[:i]


def _rid(wire: Wire) -> str:
    return new_id("msg_" if wire.NAME == "anthropic" else "chatcmpl-")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def make_app(config: GatewayConfig, *, holder: ExpertHolder | None = None) -> web.Application:
    """Create the gateway of ``config`` and its aiohttp application (``app[GATEWAY]`` holds it)."""
    gw = await Gateway.create(config, holder=holder)
    app = gw.app()
    app[GATEWAY] = gw
    return app


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def start_gateway(
    config: GatewayConfig, *, holder: ExpertHolder | None = None, host: str = "127.0.0.1", port: int = 0
) -> BackgroundServer:
    """Serve a gateway from a background thread of this process; returns the started server.

    For a gateway embedded in a Ray actor (its ``holder`` a
    :class:`tracestore.ray.RefHolder`, so routed experts stay in this
    process's object store), a test or a benchmark. ``server.url`` is the
    base URL, ``server.app[GATEWAY]`` the :class:`Gateway`, ``server.stop()``
    shuts it down. Raises what :meth:`Gateway.create` raises.
    """
    server = BackgroundServer(lambda: make_app(config, holder=holder), host, port)
    server.start()
    return server


__all__ = ["GATEWAY", "Gateway", "GatewayConfig", "GatewayStats", "make_app", "start_gateway"]
