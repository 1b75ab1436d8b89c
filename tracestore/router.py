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

from .context import Context, mutating
from .errors import InvalidInput
from .replies import Reply, text
from .scripts import Batch, Eval, Op, gather, script
from .twin import AsyncPart, OpBuilder, SyncPart, op
from .validate import duration_ms, validate_id, validate_ids

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


@dataclass(frozen=True)
class RouteScope:
    """What the router's operations receive: the run's context, the entrypoints, the retention."""

    ctx: Context
    entrypoints: tuple[str, ...]
    retention_ms: int


def validate_entrypoints(entrypoints: Sequence[str]) -> tuple[str, ...]:
    """Check a router's entrypoint list: non-empty, valid ids, no duplicates."""
    eps = validate_ids("entrypoint", entrypoints)
    if not eps:
        raise InvalidInput("entrypoints", "a router needs at least one entrypoint")
    dup = sorted({e for e in eps if eps.count(e) > 1})
    if dup:
        raise InvalidInput("entrypoints", f"duplicate entrypoint(s) {dup}")
    return tuple(eps)


def route_scope(
    ctx: Context, entrypoints: Sequence[str], *, retention_s: float = DEFAULT_RETENTION_S
) -> RouteScope:
    """Validate a router's arguments (before any I/O) into its :class:`RouteScope`.

    Raises InvalidInput (empty list, duplicates, bad retention) or InvalidId.
    """
    return RouteScope(ctx, validate_entrypoints(entrypoints), duration_ms("retention_s", retention_s))


def _keys(ctx: Context) -> tuple[str, str, str]:
    k = ctx.keys
    return (k.route, k.route_load, k.route_retired)


@mutating
def acquire_route(scope: RouteScope, sid: str, *, op_id: str | None = None) -> Op[Route]:
    """Route ``sid`` (sticky; least-loaded placement; moved off removed entrypoints).

    Returns the :class:`Route` (placement kind, previous entrypoint). Atomic:
    concurrent acquires of one new session all get the same answer. Raises
    SessionRetired for a retired session (HTTP 410 Gone), InvalidId before
    I/O, OutcomeUnknown (call again with its ``op_id``: the first reply).
    One round trip.
    """
    validate_id("session id", sid)
    op = scope.ctx.op(op_id, "route")
    return (yield from _acquire_route(scope, sid, op.id, op.key))


def _acquire_route(scope: RouteScope, sid: str, op_id: str, op_key: str) -> Op[Route]:
    """:func:`acquire_route` of a checked sid, its reply recorded at ``op_key``."""
    ctx = scope.ctx
    reply = yield Eval(
        script("route_acquire"),
        (*_keys(ctx), op_key),
        (sid, ctx.op_ttl_ms, *scope.entrypoints),
        op_id=op_id,
    )
    r = Reply(reply, "route_acquire")
    entrypoint, how, prev = r.text(), r.text(), r.text()
    return Route(sid, entrypoint, how, prev or None)


@mutating
def acquire(scope: RouteScope, sid: str, *, op_id: str | None = None) -> Op[str]:
    """The entrypoint that serves ``sid``: sticky, least-loaded when new.

    A session whose entrypoint is not in this router's list moves to one
    that is. Raises SessionRetired (front ends: 410 Gone), InvalidId
    before I/O and OutcomeUnknown (see :func:`acquire_route`). One round trip.
    """
    route = yield from acquire_route(scope, sid, op_id=op_id)
    return route.entrypoint


@mutating
def acquire_many(scope: RouteScope, sids: Sequence[str], *, op_id: str | None = None) -> Op[list[str]]:
    """:func:`acquire` for each of ``sids``, pipelined: the entrypoints, in order. One round trip.

    Each placement is its own atomic script, applied in order (new sessions
    spread over the least-loaded entrypoints as if acquired one by one).
    Raises InvalidId before any I/O; SessionRetired (the first) after the
    others were placed. One op id names the call (``op_id``, else a fresh
    one); sid ``i`` records its reply under the call's part ``i`` (sid 0
    under the call's own op key), so after an OutcomeUnknown, calling again
    with ``op_id=err.op_id`` and the same sids replays every placement.
    """
    ids = validate_ids("session id", sids)
    op = scope.ctx.op(op_id, "route")
    routes = yield from gather([_acquire_route(scope, sid, op.id, op.key_of(i)) for i, sid in enumerate(ids)])
    return [r.entrypoint for r in routes]


@mutating
def retire(scope: RouteScope, sids: Sequence[str], *, op_id: str | None = None) -> Op[list[str]]:
    """Retire sessions: drop their routes and tombstone them for the router's retention.

    Returns the sids retired by this call (already retired ones are left as
    they are). Raises InvalidId before I/O and OutcomeUnknown (call again
    with its ``op_id``: the first reply). One round trip per 4,000 sids.
    """
    ids = validate_ids("session id", sids)
    if not ids:
        return []
    ctx = scope.ctx
    evals = ctx.op_evals(
        "route_retire",
        ids,
        lambda op_key, part: (*_keys(ctx), op_key),
        lambda part: (scope.retention_ms, ctx.op_ttl_ms, *part),
        op=ctx.op(op_id, "retire"),
    )
    replies = yield Batch(tuple(evals))
    return [text(x) for r in replies for x in r]


def route_table(ctx: Context, sids: Sequence[str] = ()) -> Op[RouteTable]:
    """The run's routing table (all routers' routes): load per entrypoint, counts, routes of ``sids``.

    Needs no entrypoint list: ``store.run(route_table(store.context, sids))``
    (operators, CLI). Raises InvalidId before I/O. One round trip.
    """
    ids = validate_ids("session id", sids)
    r = Reply((yield Eval(script("route_status"), _keys(ctx), tuple(ids))), "route_status")
    routed, retired, n = r.int(), r.int(), r.int()
    load = {}
    for _ in range(n):
        ep = r.text()
        load[ep] = r.score()
    looked = r.rest_texts()
    return RouteTable(routed, retired, load, {s: v or None for s, v in zip(ids, looked, strict=True)})


def _table(scope: RouteScope, sids: Sequence[str] = ()) -> Op[RouteTable]:
    """The run's routing table (all routers' routes). See :func:`route_table`."""
    return (yield from route_table(scope.ctx, sids))


class RouterMethods:
    """The router's methods, listed once for :class:`Router` and :class:`AsyncRouter`."""

    _scope: RouteScope

    @property
    def entrypoints(self) -> tuple[str, ...]:
        """The entrypoints this router places sessions on."""
        return self._scope.entrypoints

    @property
    def retention_ms(self) -> int:
        """Lifetime (ms) of the tombstones :meth:`retire` writes."""
        return self._scope.retention_ms

    acquire = op(acquire)
    acquire_many = op(acquire_many)
    acquire_route = op(acquire_route)
    retire = op(retire)
    table = op(_table)


class Router(RouterMethods, SyncPart[RouteScope]):
    """Session affinity over a fixed list of entrypoints (``store.router([...])``)."""


class AsyncRouter(RouterMethods, AsyncPart[RouteScope]):
    """asyncio counterpart of :class:`Router` (``AsyncTraceStore.router([...])``)."""


class RouterOps(RouterMethods, OpBuilder[RouteScope]):
    """The router's operations built and not run (``store.ops.router([...])``): ``.retire(sids)``."""


__all__ = [
    "DEFAULT_RETENTION_S",
    "AsyncRouter",
    "Route",
    "RouteScope",
    "RouteTable",
    "Router",
    "RouterOps",
    "route_scope",
    "route_table",
    "validate_entrypoints",
]
