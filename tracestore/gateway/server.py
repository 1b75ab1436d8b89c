"""The session gateway: an OpenAI/Anthropic-compatible HTTP front door that records every turn.

This module holds the application: :class:`Gateway` (the process's state:
store, tokenizer, engines, admission, metrics), its routes, and one aiohttp
middleware for what every request shares (status, latency, counters). A
request's path is a :class:`~.turn.Turn`; leases and the seal watcher are
:class:`~.admission.Admission`; the engine protocols are adapters behind one
contract (:mod:`.engines`); what goes wrong maps to an answer through one
table (:mod:`.failures`); options are :class:`~.config.GatewayConfig`;
start-up checks are :mod:`.startup`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from ..errors import InvalidId, SessionReleased, TracestoreError
from ..keys import validate_id
from ..session import ExpertHolder
from ..store import AsyncTraceStore
from . import anthropic, completions, openai, responses, stateful
from .admission import Admission
from .body import read_body
from .chat import ApiError, Wire, invalid
from .config import GatewayConfig
from .counting import count_tokens
from .endpoints import session_and_owner, trace_body
from .engines import Engine, close_engines, engine_class
from .h1 import H1_ROUTES, Routes
from .idprompts import TokenPrompts
from .liveness import Liveness, health_body
from .metrics import PARTS, GatewayStats, Metrics, Recent, Timing, thread_sched
from .parsers import reasoning_parser
from .prompts import PromptMode, TemplatePrompts
from .serve import BackgroundServer
from .services import Services
from .startup import TemplateFeatures, check_engines, probe_template
from .tito import TitoPrompts
from .tokenizer import ChatTokenizer, load_tokenizer
from .tracing import Spans
from .turn import STATUS_KEY, Turn

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Routes whose requests are turns (counted in :class:`GatewayStats` and the latency histograms).
TURN_ROUTES = frozenset({"chat_completions", "messages", "completions", "responses"})
#: Routes counted in ``requests_total`` (health checks and scrapes are not).
COUNTED_ROUTES = TURN_ROUTES | {"models", "trace", "count_tokens"}
TIMING: web.RequestKey[Timing] = web.RequestKey("timing", Timing)


class Gateway:
    """One gateway process's state: store, tokenizer, engines, admission, metrics.

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
        tracer_provider: Any = None,
    ) -> None:
        self.config = config.validate()
        self.spans = Spans(tracer_provider) if tracer_provider is not None else Spans.configured(config.otel)
        self.store = store
        self.tok = tokenizer
        self.holder = holder
        self.model = config.model or tokenizer.name
        self.name = config.holder
        self.owner = config.owner_tag
        self.metrics = Metrics()
        self._owns_store = owns_store
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recent = Recent()
        self._loop_tid: int | None = None
        self._loop_sched: tuple[float, float] | None = None
        self._status: dict[str, int] = {}
        # Each store call holds one pooled connection; past the pool size redis-py raises
        # instead of waiting, so calls queue here (a few connections stay for the watcher).
        self._db_slots = asyncio.Semaphore(config.redis_connections - 4)
        self.admission = Admission(
            store, self.name, config.lease_ttl_s, config.gate_poll_s, self.metrics, self._db, self._spawn
        )
        self.prompts: PromptMode = (TitoPrompts if config.prompt_mode == "tito" else TemplatePrompts)(
            store, tokenizer, holder, config.trace_sessions
        )
        self._session: aiohttp.ClientSession | None = None
        self.engines: dict[str, Engine] = {}
        self.services: Services | None = None
        self.completion_services: Services | None = None  # /v1/completions: token-id prompts, raw text
        self.liveness: Liveness | None = None

    @classmethod
    async def create(
        cls,
        config: GatewayConfig,
        *,
        store: AsyncTraceStore | None = None,
        tokenizer: ChatTokenizer | None = None,
        holder: ExpertHolder | None = None,
        tracer_provider: Any = None,
    ) -> Gateway:
        """Validate ``config``, load the tokenizer and connect the store (unless given).

        ``tracer_provider``: an OpenTelemetry TracerProvider to emit spans to (else ``--otel``
        decides). Raises ConfigError (options, tokenizer) and the errors of
        :meth:`AsyncTraceStore.connect`.
        """
        config.validate()
        tok = tokenizer or load_tokenizer(config.tokenizer, config.tool_parser, config.reasoning_parser)
        st = store or await AsyncTraceStore.connect(config.url, run=config.run, max_connections=config.redis_connections)
        return cls(config, st, tok, holder, owns_store=store is None, tracer_provider=tracer_provider)

    # -- application ------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (routes, the metrics middleware, startup and cleanup hooks).

        It also carries its routes for the gateway's own HTTP server (:mod:`.h1`), which
        :func:`.serve.start_site` serves it with; embedded elsewhere, it is plain aiohttp."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._observe])
        exact: dict[tuple[str, str], tuple[str, Any]] = {}
        for method, path, handler, name in self._routes():
            (app.router.add_get if method == "GET" else app.router.add_post)(path, handler, name=name)
            exact[(method, path)] = (name, handler)
        app.router.add_get("/v1/sessions/{sid}/trace", self._trace, name="trace")
        app.router.add_route("*", "/{tail:.*}", self._unknown, name="unknown")
        app[H1_ROUTES] = Routes(exact, ("trace", self._trace), ("unknown", self._unknown), self.observe, self.config.max_body_bytes)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def _routes(self) -> list[tuple[str, str, Any, str]]:
        return [
            ("POST", "/v1/chat/completions", self._openai, "chat_completions"), ("POST", "/v1/messages", self._anthropic, "messages"),
            ("POST", "/v1/completions", self._completions, "completions"), ("POST", "/v1/responses", self._responses, "responses"),
            ("POST", "/v1/messages/count_tokens", self._count_tokens, "count_tokens"), ("GET", "/v1/models", self._models, "models"),
            ("GET", "/health", self._health, "health"), ("GET", "/ready", self._ready, "ready"), ("GET", "/metrics", self._metrics, "metrics"),
        ]  # fmt: skip

    async def start(self) -> None:
        """Open the engine connections, run the start-up checks, start the seal watcher.

        Raises ConfigError when a start-up check fails (:func:`.startup.check_engines`).
        """
        timeout = aiohttp.ClientTimeout(total=self.config.engine_timeout_s, sock_connect=5.0)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        make = engine_class(self.config.engine_api)
        self.engines = {url: make(url, self._session, timeout) for url in self.config.engines}
        self.liveness = Liveness(
            self.store, self.engines, self.owner, self.name, engine_api=self.config.engine_api,
            owner_ttl_s=self.config.owner_ttl_s,
        )
        features = TemplateFeatures()
        max_context: int | None = None
        if self.config.startup_checks:
            try:
                max_context = await check_engines(self.tok, list(self.engines.values()))
                features = probe_template(self.tok, self.config.prompt_mode)
            except BaseException:
                await self.close()
                raise
            for note in features.notes:
                log.info("gateway: chat template of %s: %s", self.tok.name, note)
        self.services = Services(
            config=self.config,
            store=self.store,
            tok=self.tok,
            prompts=self.prompts,
            admission=self.admission,
            metrics=self.metrics,
            router=self.store.ops.router(list(self.config.engines)),
            engines=self.engines,
            db=self._db,
            spawn=self._spawn,
            experts=self.holder is not None,
            features=features,
            max_context=max_context,
            spans=self.spans,
            liveness=self.liveness,
        )
        # completions answer raw text: no reasoning split; their paths are keyed by token ids
        raw = copy.copy(self.tok)
        raw.reasoning = reasoning_parser("none")
        self.completion_services = dataclasses.replace(
            self.services, tok=raw, prompts=TokenPrompts(self.store, raw, self.holder, self.config.trace_sessions)
        )
        self._loop_tid, self._loop_sched = threading.get_native_id(), thread_sched(threading.get_native_id())
        self.admission.start()
        self.liveness.start()

    async def _startup(self, app: web.Application) -> None:
        await self.start()

    async def _cleanup(self, app: web.Application) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the watcher, wait for background work, close engine connections (and an owned store)."""
        await self.admission.close()
        if self.liveness is not None:
            await self.liveness.close()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        close_engines(self.engines.values())
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._owns_store:
            await self.store.close()
            self._owns_store = False
        self.spans.close()

    def stats(self) -> GatewayStats:
        """Counters for reports: chat requests by status, in flight, latency percentiles."""
        now, then = thread_sched(self._loop_tid), self._loop_sched
        return GatewayStats(
            loop_run_s=now[0] - then[0] if now and then else None,
            loop_wait_s=now[1] - then[1] if now and then else None,
            requests=sum(self._status.values()),
            by_status=dict(self._status),
            in_flight=len(self.admission.flights),
            overhead_p50_s=self._recent.pct("overhead", 0.5),
            overhead_p99_s=self._recent.pct("overhead", 0.99),
            total_p50_s=self._recent.pct("total", 0.5),
            parts_p50_s={
                p: x for p in (*PARTS, "other", "engine") if (x := self._recent.pct(p, 0.5)) is not None
            },
        )

    # -- what every request shares ----------------------------------------------------------

    @web.middleware
    async def _observe(self, request: web.Request, handler: Any) -> web.StreamResponse:
        return await self.observe(request.match_info.route.name, request, handler)  # type: ignore[no-any-return]

    async def observe(self, route: str | None, request: Any, handler: Any) -> Any:
        """Status, latency and counters of every request, in one place (both HTTP servers)."""
        if route not in COUNTED_ROUTES:
            return await handler(request)
        timing = request[TIMING] = Timing()
        turn = route in TURN_ROUTES
        status = "500"
        if turn:
            self.metrics.in_flight.inc()
        try:
            resp = await handler(request)
            status = str(request.get(STATUS_KEY, resp.status))
            return resp
        except asyncio.CancelledError:
            status = "499"  # client closed the request (nginx's code)
            raise
        finally:
            self.metrics.requests.labels(route, status).inc()
            if turn:
                self._status[status] = self._status.get(status, 0) + 1
                self.metrics.in_flight.dec()
                self.metrics.observe(timing, time.perf_counter() - timing.start, self._recent)

    def _error(self, wire: Wire, err: ApiError) -> web.Response:
        return web.Response(
            body=orjson.dumps(wire.error_body(err)),
            status=err.status,
            content_type="application/json",
            headers=err.headers(),
        )

    async def _db(self, coro: Awaitable[T]) -> T:
        """Await a store call once a pooled connection is free for it."""
        async with self._db_slots:
            return await coro

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- small endpoints --------------------------------------------------------------------

    @staticmethod
    def _wire_of(request: web.Request) -> Wire:
        return anthropic if "anthropic-version" in request.headers else openai

    async def _models(self, request: web.Request) -> web.Response:
        return _json(self._wire_of(request).models(self.model))

    async def _health(self, request: web.Request) -> web.Response:
        """200 ``ok`` while an engine answers and the run's record is there; else 503 (:func:`.liveness.health`)."""
        body, status = health_body(self.liveness, self.store.run_id, self.model, list(self.config.engines))
        return _json(body, status)

    async def _ready(self, request: web.Request) -> web.Response:
        """For load balancers: 200 when this gateway can serve a turn now, else 503."""
        problems = self.liveness.problems() if self.liveness is not None else ["starting"]
        return _json({"ready": not problems, "problems": problems}, 503 if problems else 200)

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
            tr = await self._db(self.prompts.export(sid))
            if tr is None and self.completion_services is not None:  # a completions session
                tr = await self._db(self.completion_services.prompts.export(sid))
            if tr is None:
                raise ApiError(
                    "not_found",
                    f"no turn of session {sid!r} was recorded by this gateway process "
                    "(export it with store.export_training_trace(sid, key))",
                )
        except InvalidId as exc:
            return self._error(wire, invalid(str(exc), "session_id"))
        except ApiError as err:
            return self._error(wire, err)
        except SessionReleased as exc:
            return self._error(wire, ApiError("gone", str(exc)))
        except TracestoreError as exc:
            return self._error(wire, ApiError("unavailable", f"{type(exc).__name__}: {exc}", retry_after_s=1.0))
        return _json(trace_body(sid, tr))

    # -- chat endpoints ---------------------------------------------------------------------

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, openai)

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, anthropic)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, completions)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, responses)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            return _json(await count_tokens(request, self.store, self.prompts, self.model, self.config.max_body_bytes, self._db))
        except ApiError as err:
            return self._error(anthropic, err)

    async def _chat(self, request: web.Request, wire: Wire) -> web.StreamResponse:
        try:
            return await self._turn(request, wire)
        except ApiError as err:
            return self._error(wire, err)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # a bug: answer in the native shape, keep serving
            log.exception("gateway: unexpected error")
            return self._error(wire, ApiError("internal", f"{type(exc).__name__}: {exc}"))

    async def _turn(self, request: web.Request, wire: Wire) -> web.StreamResponse:
        body = await read_body(request, self.config.max_body_bytes)
        req = wire.parse(body, self.config.default_max_tokens)
        if req.model != self.model:
            raise ApiError(
                "not_found",
                f"model {req.model!r} is not served here; GET /v1/models lists {self.model!r}",
                param="model",
                code="model_not_found",
            )
        sid, owner = session_and_owner(request, body, self.owner)
        request[TIMING].add("parse", request[TIMING].start)
        if wire is responses:  # previous_response_id: the conversation kept in the store (and its session)
            req, sid = await stateful.resolve(self.store, self._db, body, req, sid)
        services = self.completion_services if wire is completions else self.services
        assert services is not None
        return await Turn(services, request, wire, req, sid, owner, request[TIMING]).run()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def make_app(
    config: GatewayConfig, *, holder: ExpertHolder | None = None, tracer_provider: Any = None
) -> web.Application:
    """Create the gateway of ``config`` and its aiohttp application (``app[GATEWAY]`` holds it)."""
    gw = await Gateway.create(config, holder=holder, tracer_provider=tracer_provider)
    app = gw.app()
    app[GATEWAY] = gw
    return app


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def start_gateway(
    config: GatewayConfig,
    *,
    holder: ExpertHolder | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    tracer_provider: Any = None,
) -> BackgroundServer:
    """Serve a gateway from a background thread of this process; returns the started server.

    For a gateway embedded in a Ray actor (its ``holder`` a
    :class:`tracestore.ray.RefHolder`, so routed experts stay in this
    process's object store), a test or a benchmark. ``server.url`` is the
    base URL, ``server.app[GATEWAY]`` the :class:`Gateway`, ``server.stop()``
    shuts it down. Raises what :meth:`Gateway.create` and the start-up checks raise.
    """
    server = BackgroundServer(lambda: make_app(config, holder=holder, tracer_provider=tracer_provider), host, port)
    server.start()
    return server


__all__ = ["GATEWAY", "Gateway", "GatewayConfig", "GatewayStats", "make_app", "start_gateway"]
