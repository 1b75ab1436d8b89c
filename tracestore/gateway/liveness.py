"""What the gateway keeps checking in the background: its engines, its run's record, its owner tag.

One task per gateway, every ``interval_s`` (1 s):

* **engines**: ``GET /health`` of each; ``/health`` and ``/ready`` report
  them, and when none answers, a refused engine call is answered with
  ``x-should-retry: false`` so the SDKs fail fast instead of retrying for
  minutes;
* **the run's record** (``ts:{R}:meta``): a store that restarted without its
  data, or was flushed, no longer has it; from then on the gateway records
  nothing (every turn is a 503 that says so) instead of writing keys of a run
  no command can see;
* **its lease holder tag**, heart-beaten every few seconds, and the leases of
  gateways that stopped heart-beating (killed): every ``HEAL_EVERY_S`` it aborts
  their requests at their engines and settles the leases shown stopped
  ``aborted`` (``gate.resolve_dead_holders``), so a dead gateway's leases
  never block a weight update;
* **the owner tag** of sessions it opens without ``X-Tracestore-Owner``
  (``--owner``): heart-beaten, so ``tracestore gc`` releases those sessions
  once the gateway is gone, instead of leaving them to an owner that never
  heart-beats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..errors import OwnerLost, TracestoreError
from ..gate.aborts import http_abort
from ..runlock import record_exists
from ..store import AsyncTraceStore
from .engines import Engine

log = logging.getLogger(__name__)

#: Heartbeat ttl of the gateway's lease holder tag: its leases are resolvable this long after it dies.
HOLDER_TTL_S = 10.0
#: How often a gateway resolves the leases of dead gateways.
HEAL_EVERY_S = 5.0


class Liveness:
    """The background checks (see the module docstring)."""

    def __init__(
        self,
        store: AsyncTraceStore,
        engines: dict[str, Engine],
        owner: str,
        holder: str,
        *,
        engine_api: str = "sglang",
        interval_s: float = 1.0,
        owner_ttl_s: float = 30.0,
        holder_ttl_s: float = HOLDER_TTL_S,
    ) -> None:
        self.store = store
        self.engines = engines
        self.owner = owner
        self.holder = holder
        self.engine_api = engine_api
        self.holder_ttl_s = holder_ttl_s
        self.resolved = 0  # leases of dead holders this gateway resolved
        self._holder_beat = 0.0
        self._healed = 0.0
        self.interval_s = interval_s
        self.owner_ttl_s = owner_ttl_s
        self.engines_up: dict[str, bool] = {url: True for url in engines}  # until the first check
        self.run_lost = False
        self.owner_lost = False
        self.checked_ms = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # set by close(): the loop ends even if a call swallowed its cancellation
        self._beat = 0.0

    @property
    def any_engine_up(self) -> bool:
        """True when at least one engine answered its last health check."""
        return any(self.engines_up.values())

    def problems(self) -> list[str]:
        """What makes the gateway unable to serve now, one line each (empty: healthy)."""
        out = []
        if self.run_lost:
            out.append(f"the trace store lost run {self.store.run_id!r} (its record is gone: the server restarted or was flushed)")
        if not self.any_engine_up:
            out.append("no engine answers its health check")
        return out

    def start(self) -> None:
        """Start checking (inside the running loop); checks once first."""
        self._task = asyncio.create_task(self._run(), name="gateway-liveness")

    async def close(self) -> None:
        """Stop checking; say this holder stopped cleanly (kept while it still has leases)."""
        if self._task is not None:
            self._closing = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            try:
                await self.store.gate.holder_done(self.holder)
            except TracestoreError as exc:
                log.warning("gateway: could not say holder %s stopped: %s", self.holder, exc)

    async def check(self) -> None:
        """One round of checks (engines, run record, owner heartbeat)."""
        ups = await asyncio.gather(*(e.health() for e in self.engines.values()))
        for url, up in zip(self.engines, ups, strict=True):
            if self.engines_up.get(url) != up:
                log.warning("gateway: engine %s is %s", url, "up" if up else "down (its health check fails)")
            self.engines_up[url] = up
        try:
            exists = await self.store.run(record_exists(self.store.context))
            if not exists and not self.run_lost:
                log.error(
                    "gateway: the trace store lost run %r (its record is gone); recording nothing from now on: "
                    "restart the gateway",
                    self.store.run_id,
                )
            self.run_lost = self.run_lost or not exists
            now = time.monotonic()
            if not self.run_lost and now - self._holder_beat > self.holder_ttl_s / 3:
                await self.store.gate.heartbeat(self.holder, self.holder_ttl_s)
                self._holder_beat = now
            if not self.run_lost and now - self._healed > HEAL_EVERY_S:
                self._healed = now
                await self._heal()
            if not self.run_lost and not self.owner_lost and now - self._beat > self.owner_ttl_s / 3:
                await self.store.heartbeat(self.owner, self.owner_ttl_s)
                self._beat = now
        except OwnerLost:
            self.owner_lost = True
            log.error("gateway: gc declared owner %r lost; sessions it opens now are refused", self.owner)
        except TracestoreError as exc:  # the store is unreachable: requests say so themselves
            log.warning("gateway: liveness check: %s", exc)
        self.checked_ms = time.time() * 1000

    async def _heal(self) -> None:
        """Resolve the leases of gateways that died: abort their requests at their engines, settle
        the ones shown stopped ``aborted`` (a holder that came back keeps its own)."""
        report = await self.store.gate.resolve_dead_holders(http_abort(self.engine_api))
        n = len(report.settled)
        if n:
            self.resolved += n
            log.warning("gateway: resolved %d lease(s) of dead gateway(s) %s", n, ", ".join(report.dead_holders))

    async def _run(self) -> None:
        # ``_closing``, not only the cancellation, ends the loop: a cancellation that lands inside an
        # HTTP call with a timeout can come out as a TimeoutError (handled as "engine down"), and a
        # loop that only waited for CancelledError then slept on while close() waited for it forever.
        while not self._closing:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep checking
                log.warning("gateway: liveness check failed: %s", exc)
            if not self._closing:
                await asyncio.sleep(self.interval_s)

    def report(self) -> dict[str, Any]:
        """The ``/health`` body's checks."""
        return {"engines": dict(self.engines_up), "run_record": not self.run_lost, "owner": self.owner, "owner_lost": self.owner_lost}


def health_body(live: Liveness | None, run: str, model: str, engines: list[str]) -> tuple[dict[str, Any], int]:
    """The ``/health`` answer: ``ok`` (200) or ``unhealthy`` (503) with one line per problem."""
    problems = live.problems() if live is not None else ["starting"]
    body: dict[str, Any] = {"status": "unhealthy" if problems else "ok", "run": run, "model": model, "engines": engines}
    if live is not None:
        body["checks"] = live.report()
    if problems:
        body["problems"] = problems
    return body, 503 if problems else 200


__all__ = ["Liveness", "health_body"]
