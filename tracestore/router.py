"""Session affinity: which entrypoint serves a session (DESIGN section 6).

A multi-turn session should keep hitting the same entrypoint (its engine
holds the session's KV cache). ``store.router(entrypoints)`` gives a
:class:`Router` whose :meth:`~Router.acquire` is sticky, places a new session
on the least-loaded entrypoint of the router's list, and moves a session
whose entrypoint is no longer in that list. :meth:`~Router.retire` ends
sessions: their routes are dropped and tombstones make ``acquire`` raise
:class:`~tracestore.errors.SessionRetired` until the retention passes (an
HTTP front end answers **410 Gone**, so an agent does not silently start a
fresh conversation under an old id).

Routes and load counts are shared by every router of the run (keys
``ts:{R}:route``, ``ts:{R}:route:load``, ``ts:{R}:route:retired``); the
entrypoint list is an argument of each script call, so routers with
different lists behave predictably: each places and keeps sessions only on
its own entrypoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .context import Context
from .errors import InvalidInput
from .gate import _ms
from .keys import validate_id, validate_ids
from .scripts import Batch, Eval, Op, chunks, new_op_id, script

if TYPE_CHECKING:
    from ._io import AsyncIO, SyncIO
    from .store import TraceStore

#: Default lifetime of a retirement tombstone.
DEFAULT_RETENTION_S = 24 * 3600.0


@dataclass(frozen=True)
class Route:
    """Where ``acquire`` sent a session and why.

    ``how``: ``sticky`` (already there), ``new`` (first placement) or
    ``moved`` (its previous entrypoint, ``previous``, left the list).
    """

    sid: str
    entrypoint: str
    how: str
    previous: str | None = None


@dataclass(frozen=True)
class RouteTable:
    """The run's routing table: load per entrypoint and looked-up routes.

    ``routes`` maps each looked-up sid to its entrypoint, None (not routed)
    or ``"!retired"`` (tombstoned).
    """

    routed: int
    retired: int
    load: dict[str, int]
    routes: dict[str, str | None]


def validate_entrypoints(entrypoints: Sequence[str]) -> tuple[str, ...]:
    """Check a router's entrypoint list: non-empty, valid ids, no duplicates."""
    eps = validate_ids("entrypoint", entrypoints)
    if not eps:
        raise InvalidInput("entrypoints", "a router needs at least one entrypoint")
    dup = sorted({e for e in eps if eps.count(e) > 1})
    if dup:
        raise InvalidInput("entrypoints", f"duplicate entrypoint(s) {dup}")
    return tuple(eps)


def _keys(ctx: Context) -> tuple[str, str, str]:
    k = ctx.keys
    return (k.route, k.route_load, k.route_retired)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def acquire_route(ctx: Context, entrypoints: tuple[str, ...], sid: str) -> Op[Route]:
    """Route ``sid`` (sticky; least-loaded placement; moved off removed entrypoints).

    Atomic: concurrent acquires of one new session all get the same answer.
    Raises SessionRetired for a retired session (HTTP 410 Gone), InvalidId
    before I/O. A retried call (reply lost) returns its first reply. One round trip.
    """
    validate_id("session id", sid)
    keys = (*_keys(ctx), ctx.keys.op(new_op_id()))
    reply = yield Eval(script("route_acquire"), keys, (sid, ctx.config.op_ttl_s * 1000, *entrypoints))
    prev = _s(reply[2])
    return Route(sid, _s(reply[0]), _s(reply[1]), prev or None)


def acquire(ctx: Context, entrypoints: tuple[str, ...], sid: str) -> Op[str]:
    """The entrypoint that serves ``sid`` (see :func:`acquire_route`). One round trip."""
    route = yield from acquire_route(ctx, entrypoints, sid)
    return route.entrypoint


def retire(ctx: Context, sids: Sequence[str], retention_ms: int) -> Op[list[str]]:
    """Retire sessions: drop their routes and tombstone them for the retention.

    Returns the sids retired by this call (already retired ones are left as
    they are); a retried call (reply lost) returns its first reply. Raises
    InvalidId before I/O. One round trip per 4,000 sids.
    """
    ids = validate_ids("session id", sids)
    if not ids:
        return []
    sc = script("route_retire")
    ttl = ctx.config.op_ttl_s * 1000
    evals = tuple(
        Eval(sc, (*_keys(ctx), ctx.keys.op(new_op_id())), (retention_ms, ttl, *part))
        for part in chunks(ids, sc.chunk)
    )
    replies = yield Batch(evals)
    return [_s(x) for r in replies for x in r]


def route_table(ctx: Context, sids: Sequence[str] = ()) -> Op[RouteTable]:
    """Read the load per entrypoint, counts, and the routes of ``sids``. One round trip."""
    ids = validate_ids("session id", sids)
    r = yield Eval(script("route_status"), _keys(ctx), tuple(ids))
    routed, retired, n = int(r[0]), int(r[1]), int(r[2])
    load = {_s(r[3 + 2 * i]): int(float(r[4 + 2 * i])) for i in range(n)}
    looked = r[3 + 2 * n :]
    return RouteTable(routed, retired, load, {s: (_s(v) or None) for s, v in zip(ids, looked, strict=True)})


class Router:
    """Session affinity over a fixed list of entrypoints (``store.router([...])``)."""

    def __init__(
        self, io: SyncIO, ctx: Context, entrypoints: Sequence[str], retention_s: float
    ) -> None:
        self.entrypoints = validate_entrypoints(entrypoints)
        self.retention_ms = _ms("retention_s", retention_s)
        self._io = io
        self._ctx = ctx

    def acquire(self, sid: str) -> str:
        """The entrypoint that serves ``sid``: sticky, least-loaded when new.

        A session whose entrypoint is not in this router's list moves to one
        that is. Raises SessionRetired (front ends: 410 Gone) and InvalidId
        before I/O. One round trip.
        """
        return self._io.run(acquire(self._ctx, self.entrypoints, sid))

    def acquire_route(self, sid: str) -> Route:
        """Like :meth:`acquire`, returning the :class:`Route` (placement kind, previous)."""
        return self._io.run(acquire_route(self._ctx, self.entrypoints, sid))

    def retire(self, sids: Sequence[str]) -> list[str]:
        """Retire ``sids``; returns those retired by this call. See :func:`retire`."""
        return self._io.run(retire(self._ctx, sids, self.retention_ms))

    def table(self, sids: Sequence[str] = ()) -> RouteTable:
        """The run's routing table (all routers' routes). See :func:`route_table`."""
        return self._io.run(route_table(self._ctx, sids))


class AsyncRouter:
    """asyncio counterpart of :class:`Router` (``AsyncTraceStore.router([...])``)."""

    def __init__(
        self, io: AsyncIO, ctx: Context, entrypoints: Sequence[str], retention_s: float
    ) -> None:
        self.entrypoints = validate_entrypoints(entrypoints)
        self.retention_ms = _ms("retention_s", retention_s)
        self._io = io
        self._ctx = ctx

    async def acquire(self, sid: str) -> str:
        """Async counterpart of :meth:`Router.acquire`."""
        return await self._io.run(acquire(self._ctx, self.entrypoints, sid))

    async def acquire_route(self, sid: str) -> Route:
        """Async counterpart of :meth:`Router.acquire_route`."""
        return await self._io.run(acquire_route(self._ctx, self.entrypoints, sid))

    async def retire(self, sids: Sequence[str]) -> list[str]:
        """Async counterpart of :meth:`Router.retire`."""
        return await self._io.run(retire(self._ctx, sids, self.retention_ms))

    async def table(self, sids: Sequence[str] = ()) -> RouteTable:
        """Async counterpart of :meth:`Router.table`."""
        return await self._io.run(route_table(self._ctx, sids))


def read_routes(store: TraceStore, sids: Sequence[str] = ()) -> RouteTable:
    """The routing table of ``store``'s run without an entrypoint list (operators, CLI)."""
    return store._io.run(route_table(store._ctx, sids))


__all__ = [
    "DEFAULT_RETENTION_S",
    "AsyncRouter",
    "Route",
    "RouteTable",
    "Router",
    "read_routes",
    "validate_entrypoints",
]
