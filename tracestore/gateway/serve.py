"""Serving an aiohttp application: from the CLI (foreground) or from a background thread.

Shared by the gateway and the reference engine (``trainer/engine.py``):
:func:`serve_forever` prints ``listening on http://H:P`` once the socket is
bound (``--port 0`` picks a free port, and the line tells which) and stops
cleanly on SIGINT/SIGTERM; :class:`BackgroundServer` runs an app on its own
event loop in a daemon thread (tests, benchmarks, a Ray actor).

Handlers are cancelled when their client disconnects
(``handler_cancellation``): that is how the gateway learns a client left
mid-request. A gateway's application is served by the gateway's own
HTTP/1.1 server (:mod:`.h1`), which keeps that and aiohttp's other semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import ConfigError
from . import h1

AppFactory = Callable[[], Awaitable[web.Application]]


async def start_site(app: web.Application, host: str, port: int, *, reuse_port: bool = False) -> tuple[Any, str]:
    """Bind ``app`` on ``host:port``; returns the runner (``await runner.cleanup()`` stops it) and
    the URL actually bound. ``reuse_port``: SO_REUSEPORT, so that several processes serve one port
    (the kernel spreads new connections over them; a client whose process died connects to another
    on its retry). A gateway's application is served by the gateway's own HTTP server (:mod:`.h1`),
    any other by aiohttp's."""
    if h1.available(app):
        server = h1.H1Server(app, app[h1.H1_ROUTES])
        await server.start(host, port, reuse_port)
        return server, _url(host, server.addresses[0][1] if server.addresses else port)
    # auto_decompress off: a body's Content-Encoding is the handler's to decode (the gateway answers an
    # encoding it does not take, or a body that is not what its header says, with a 4xx in the caller's shape)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, _url(host, runner.addresses[0][1] if runner.addresses else port)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_forever(
    make_app: AppFactory, host: str, port: int, announce: Callable[[str], None], *, reuse_port: bool = False
) -> None:
    """Run the app until SIGINT/SIGTERM; ``announce(url)`` is called once it listens (``reuse_port``:
    see :func:`start_site`)."""

    async def main() -> None:
        app = await make_app()
        tune_gc()  # (before it listens: a bad TRACESTORE_GC refuses to start)
        runner, url = await start_site(app, host, port, reuse_port=reuse_port)
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

    run_loop(main())


#: The cyclic collector's thresholds of a serving process (CPython's default: 700, 10, 10).
GC_THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    """Set a serving process's cyclic garbage collector for throughput (unless ``TRACESTORE_GC=default``).

    Once the app is built, before it listens: what start-up made (modules, the tokenizer's tables, the
    app) is collected once and frozen (``gc.freeze``: never traversed again), and a collection
    of the youngest generation waits for :data:`GC_THRESHOLDS` ``[0]`` new objects instead of 700.
    A turn allocates a few hundred container objects; with the defaults the collector ran every
    few turns and, through the older generations, traversed every cached session index: a
    quarter of a gateway's CPU per turn (measured: 1.8 s of collections over 5,000 turns).
    Garbage without cycles is freed at once either way; only cycles wait a little longer.
    ``TRACESTORE_GC=A,B,C`` sets other thresholds (ConfigError on anything else).
    """
    import gc
    import os

    want = os.environ.get("TRACESTORE_GC", "").strip()
    if want == "default":
        return
    thresholds: tuple[int, ...] = GC_THRESHOLDS
    if want:
        try:
            thresholds = tuple(int(x) for x in want.split(","))
            if len(thresholds) != 3 or min(thresholds) < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"TRACESTORE_GC={want!r}: give 'default' or three positive integers A,B,C (gc.set_threshold)") from None
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def run_loop(coro: Awaitable[None]) -> None:
    """``asyncio.run``, on uvloop when it is installed (unless ``TRACESTORE_UVLOOP=0``)."""
    import os

    if os.environ.get("TRACESTORE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(coro)  # type: ignore[arg-type]
            return
    asyncio.run(coro)  # type: ignore[arg-type]


class BackgroundServer:
    """An aiohttp app served from a daemon thread with its own event loop.

    ``start()`` returns the bound URL once the app listens (re-raising a
    startup error); ``stop()`` shuts it down and joins the thread. Also a
    context manager.
    """

    def __init__(self, make_app: AppFactory, host: str = "127.0.0.1", port: int = 0) -> None:
        self._make_app = make_app
        self.host = host
        self.port = port
        self.url = ""
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 60.0) -> str:
        """Start serving; returns ``http://host:port``. Raises what the startup raised."""
        self._thread = threading.Thread(target=self._run, name="aiohttp-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server did not start within {timeout_s}s")
        if self._error is not None:
            raise self._error
        return self.url

    def call(self, coro: Awaitable[object], timeout_s: float = 60.0) -> object:
        """Run ``coro`` on the server's loop from another thread; return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)  # type: ignore[arg-type]

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                self.app = await self._make_app()
                runner, self.url = await start_site(self.app, self.host, self.port)
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

        asyncio.run(main())

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving (in-flight handlers are cancelled) and join the thread."""
        if self._loop is not None and self._stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["GC_THRESHOLDS", "BackgroundServer", "serve_forever", "start_site", "tune_gc"]
