"""The viewer's aiohttp application (``tracestore ui``): routes, discovery, errors.

Every page has its JSON: ``/X`` renders the view that ``/api/X`` returns as
JSON (same data layer call). Routes:

* ``/`` — runs; ``/runs/{run}`` — a run; ``/runs/{run}/owners/{owner}`` —
  an owner's sessions; ``/runs/{run}/replay/{task}/{status}`` — a replay
  cell's groups; ``/runs/{run}/sessions/{sid}`` — a session's tree;
  ``/runs/{run}/sessions/{sid}/path/{num}`` — the path to node ``num``,
  per token; ``/health`` — liveness and the viewer's own counters.

No request SCANs the keyspace: the run list and the owner tags that have no
heartbeat (nothing indexes them) are found by :class:`Discovery`, once
before the app serves and then in the background when a request finds them
older than ``rescan_s`` (the page says how old they are). Everything else
is read from the run's indexes at each request (:mod:`.runs`,
:mod:`.sessions`). Read-only: it works with the ``observer`` ACL role.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
from aiohttp import web

from ..errors import (
    ConfigError,
    CorruptData,
    InvalidId,
    InvalidInput,
    PermissionDenied,
    SessionReleased,
    StorageError,
    TracestoreError,
)
from ..keys import Keys
from ..run import server_ms
from ..runs import run_ids
from ..scripts import ScanAll
from ..store import AsyncTraceStore
from ..validate import is_run_id, validate_run
from . import html, html_session
from .runs import overview, owner_view, replay_view, run_context, run_view
from .sessions import IndexCache, path_view, session_view
from .views import NotFound

Decoder = Callable[[int], str]


@dataclass(frozen=True)
class UiConfig:
    """Options of ``tracestore ui`` (docs/viewer.md)."""

    url: str | None = None
    #: Show only this run (None: every run on the server).
    run: str | None = None
    prefix: str = "ts"
    #: ``builtin``, a Hugging Face tokenizer directory, or None (token ids only).
    tokenizer: str | None = None
    #: How old the discovered run list and owner tags may get before a request refreshes them (background).
    rescan_s: float = 60.0


@dataclass
class Counters:
    """What the viewer did (``/health``): requests served, discovery passes and the SCAN calls they made."""

    requests: int = 0
    rescans: int = 0
    started_ms: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Discovery:
    """Run ids and owner tags found by SCAN, off the request path.

    ``refresh()`` scans (the run list: meta records; owner tags: owner sets
    of every run, or of the fixed run); ``poke()``, called by each request,
    starts a refresh in the background when the last one is older than
    ``rescan_s`` and none is running. A request never waits for a SCAN.
    """

    def __init__(self, store: AsyncTraceStore, cfg: UiConfig, counters: Counters) -> None:
        self.store = store
        self.cfg = cfg
        self.counters = counters
        self.runs: list[str] = [cfg.run] if cfg.run else []
        self.owners: dict[str, set[str]] = {}
        self.listed_ms: int | None = None
        self._at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """One discovery pass: SCAN for runs (unless fixed) and owner sets. Raises what the store raises."""
        ctx = self.store.context
        now = await self.store.run(server_ms(ctx))
        prefix = self.cfg.prefix
        if self.cfg.run is None:
            self.runs = await self.store.run(run_ids(ctx))
            pattern = f"{prefix}:{{*}}:o:*"
        else:
            pattern = Keys(prefix, self.cfg.run).owner_pattern
        keys = await self.store.execute(ScanAll(pattern, count=1000, type="set"))
        owners: dict[str, set[str]] = {}
        head = f"{prefix}:{{"
        for key in keys:
            end = key.find("}", len(head))
            run = key[len(head) : end] if key.startswith(head) and end > 0 else ""
            tag = Keys(prefix, run).owner_of_key(key) if is_run_id(run) else None
            if tag:
                owners.setdefault(run, set()).add(tag)
        self.owners = owners
        self.listed_ms = now
        self._at = time.monotonic()
        self.counters.rescans += 1

    def poke(self) -> None:
        """Start a background refresh if the last one is older than ``rescan_s`` (never waits)."""
        if time.monotonic() - self._at < self.cfg.rescan_s or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._quiet())

    async def _quiet(self) -> None:
        with contextlib.suppress(TracestoreError):  # a failed pass keeps the last lists; the next poke retries
            await self.refresh()

    async def close(self) -> None:
        """Cancel a running refresh."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TracestoreError):
                await self._task


def load_decoder(spec: str) -> tuple[Decoder, str]:
    """A token decoder for ``--tokenizer``: ``builtin`` (the reference policy's) or a Hugging Face directory.

    Returns ``(decode one id -> text, name)``. Raises ConfigError when the
    tokenizer cannot be loaded (transformers missing, not a directory, not a tokenizer).
    """
    if spec == "builtin":
        from ..trainer.tokenizer import TOKENIZER  # the trainer's pure-Python tokenizer (no torch)

        return lru_cache(maxsize=1 << 16)(lambda i: TOKENIZER.decode([i])), "builtin"
    try:
        from transformers import AutoTokenizer  # the gateway extra; only when asked for
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"--tokenizer {spec!r} needs the extra tracestore[gateway]: {exc}") from None
    try:
        tok: Any = AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, ...)
        raise ConfigError(f"--tokenizer {spec!r}: cannot load it: {type(exc).__name__}: {exc}") from None
    return lru_cache(maxsize=1 << 16)(lambda i: str(tok.decode([i], skip_special_tokens=False))), spec


STORE = web.AppKey("store", AsyncTraceStore)
DISCOVERY = web.AppKey("discovery", Discovery)
CACHE = web.AppKey("cache", IndexCache)
COUNTERS = web.AppKey("counters", Counters)


def _status_of(exc: TracestoreError) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, (InvalidId, InvalidInput)):
        return 400
    if isinstance(exc, PermissionDenied):
        return 403
    if isinstance(exc, SessionReleased):
        return 410
    if isinstance(exc, StorageError):
        return 503
    return 500


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Typed errors as their status with one line: JSON under /api, a page elsewhere. Security headers on all."""
    counters = request.app[COUNTERS]
    counters.requests += 1
    try:
        resp = await handler(request)
    except TracestoreError as exc:
        status = _status_of(exc)
        name = type(exc).__name__
        counters.errors[name] = counters.errors.get(name, 0) + 1
        message = " ".join(str(exc).split())
        if isinstance(exc, CorruptData):
            message = f"stored data does not decode: {message}"
        if request.path.startswith("/api/"):
            resp = web.json_response({"error": {"type": name, "message": message}}, status=status,
                                     dumps=lambda x: orjson.dumps(x).decode())
        else:
            resp = web.Response(text=html.error_page(status, f"{name}: {message}"), status=status,
                                content_type="text/html")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["Content-Security-Policy"] = (
        "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; form-action 'self'"
    )
    resp.headers["X-Content-Type-Options"] = "nosniff"
    return resp


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or len(raw) > 12:
        raise InvalidInput(name, f"must be a non-negative integer, got {raw!r:.40}")
    return int(raw)


def _run(request: web.Request) -> str:
    return validate_run(request.match_info["run"])


View = Callable[[web.Request], Awaitable[Any]]


def _pair(app: web.Application, path: str, load: View, render: Callable[[Any], str]) -> None:
    """Serve ``load``'s view at ``path`` as HTML (``render``) and at ``/api`` + ``path`` as JSON."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=render(await load(request)), content_type="text/html")

    async def api(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(await load(request)), content_type="application/json")

    app.router.add_get(path, page)
    app.router.add_get("/api/runs" if path == "/" else "/api" + path, api)


async def make_app(cfg: UiConfig) -> web.Application:
    """The viewer's application, connected and with its first discovery pass done.

    Raises ConfigError (bad URL, a tokenizer that does not load), StorageError
    (unreachable server), PermissionDenied (a user that may not read the run).
    """
    decoder = load_decoder(cfg.tokenizer) if cfg.tokenizer else None
    store = await AsyncTraceStore.connect(cfg.url, run=cfg.run or "default", prefix=cfg.prefix, create_run=False)
    counters = Counters()
    disc = Discovery(store, cfg, counters)
    try:
        await disc.refresh()
        counters.started_ms = disc.listed_ms or 0
    except BaseException:
        await store.close()
        raise
    app = web.Application(middlewares=[_errors])
    app[STORE], app[DISCOVERY], app[CACHE], app[COUNTERS] = store, disc, IndexCache(), counters
    ctx = store.context

    async def runs(request: web.Request) -> Any:
        disc.poke()
        return await store.run(overview(ctx, disc.runs, page=max(1, _int(request, "page", 1)), url=store.url,
                                        listed_ms=disc.listed_ms, fixed_run=cfg.run))

    async def one_run(request: web.Request) -> Any:
        disc.poke()
        run = _run(request)
        view = await store.run(run_view(run_context(ctx, run), known_owners=disc.owners.get(run, ()),
                                        owners_listed_ms=disc.listed_ms,
                                        owners_page=max(1, _int(request, "owners_page", 1))))
        if view.created_ms is None and not any(view.counters.values()):
            raise NotFound("run", f"no run {run!r} on {store.url} (its meta record ts:{{{run}}}:meta is absent)")
        return view

    async def owner(request: web.Request) -> Any:
        return await store.run(owner_view(run_context(ctx, _run(request)), request.match_info["owner"],
                                          cursor=request.query.get("cursor", "0") or "0"))

    async def replay(request: web.Request) -> Any:
        mi = request.match_info
        return await store.run(replay_view(run_context(ctx, _run(request)), mi["task"], mi["status"],
                                           offset=_int(request, "offset", 0)))

    async def session(request: web.Request) -> Any:
        return await store.run(session_view(run_context(ctx, _run(request)), app[CACHE], request.match_info["sid"],
                                            page=max(1, _int(request, "page", 1))))

    async def path(request: web.Request) -> Any:
        num = request.match_info["num"]
        if not num.isdigit() or len(num) > 10:
            raise InvalidInput("node", f"must be a node number, got {num!r:.40}")
        dec = decoder[0] if decoder else None
        return await store.run(path_view(run_context(ctx, _run(request)), app[CACHE], request.match_info["sid"],
                                         int(num), offset=_int(request, "offset", 0),
                                         count=max(1, _int(request, "count", 1000)), decode=dec,
                                         tokenizer=decoder[1] if decoder else None))

    async def go(request: web.Request) -> web.StreamResponse:
        sid = request.query.get("sid", "").strip()
        if not sid:
            raise InvalidInput("sid", "give a session id")
        raise web.HTTPFound(f"/runs/{html.q(_run(request))}/sessions/{html.q(sid)}")

    async def health(request: web.Request) -> web.Response:
        doc = {"ok": True, "requests": counters.requests, "rescans": counters.rescans, "runs": len(disc.runs),
               "listed_ms": disc.listed_ms, "errors": counters.errors, "cached_sessions": len(app[CACHE])}
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    _pair(app, "/", runs, html.runs_page)
    _pair(app, "/runs/{run}", one_run, html.run_page)
    _pair(app, "/runs/{run}/owners/{owner}", owner, html.owner_page)
    _pair(app, "/runs/{run}/replay/{task}/{status}", replay, html.replay_page)
    _pair(app, "/runs/{run}/sessions/{sid}", session, html_session.session_page)
    _pair(app, "/runs/{run}/sessions/{sid}/path/{num}", path, html_session.path_page)
    app.router.add_get("/runs/{run}/go", go)
    app.router.add_get("/health", health)

    async def cleanup(_app: web.Application) -> None:
        await disc.close()
        await store.close()

    app.on_cleanup.append(cleanup)
    return app


async def start(cfg: UiConfig, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Build the app and bind it on ``host:port`` (0: a free port); returns the runner and the URL bound.

    Raises what :func:`make_app` raises, and OSError when the address cannot be bound.
    """
    app = await make_app(cfg)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"


def serve_forever(cfg: UiConfig, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve the viewer until SIGINT/SIGTERM; ``announce(url)`` once it listens. Raises what :func:`start` raises."""

    async def main() -> None:
        runner, url = await start(cfg, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        announce(url)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


__all__ = ["Discovery", "UiConfig", "load_decoder", "make_app", "serve_forever", "start"]
