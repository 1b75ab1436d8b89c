"""Control plane: session ownership and release (DESIGN section 5).

Every session has exactly one owner tag (``rollout:<worker>``, ``replay``,
``train:<step>``, ``eval:<step>``). The scripts in ``lua/`` change a
session's state, its owner index and the event stream atomically, and replay
their recorded reply when redis-py retries a call whose reply was lost.

Release has two phases (invariant 4): the control-plane script
(``lua/release.lua``, one atomic call per chunk of 4,000 sessions: state,
owner index, tombstone, one event each) and then the idempotent purge of the
released sessions' data keys (:mod:`tracestore.purge`), pipelined and grouped
by node. A crash between the phases leaves data that :func:`tracestore.gc.gc`
purges; it never leaves a live session without data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import validate
from .context import Context, OpId, mutating
from .errors import InvalidInput
from .purge import purge_sessions
from .replies import Reply, pairs, stored, text
from .scripts import Batch, Cmd, Eval, Op, ScanAll, gather, script, variadic_evals
from .validate import duration_ms, validate_id, validate_ids


def _dedup(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def session_states(ctx: Context, sids: list[str]) -> Op[dict[str, tuple[str, str] | None]]:
    """Owner and state of each session (None when unknown).

    Raises InvalidId before I/O. One round trip per 4,000 sessions (pipelined).
    """
    sids = validate_ids("session id", sids)
    k = ctx.keys
    evals = variadic_evals("session_states", (k.released,), k.session_keys(sids), (), sids)
    replies = yield Batch(tuple(evals))
    r = Reply([x for part in replies for x in part], "session_states")
    out: dict[str, tuple[str, str] | None] = {}
    for sid in sids:
        with stored(ctx.keys.session(sid), "owner/state"):
            owner, state = r.text(), r.text()
            if state not in ("live", "released", ""):
                raise ValueError(f"unknown state {state!r:.40}")
        out[sid] = (owner, state) if state else None
    return out


@mutating
def open_session(
    ctx: Context,
    sid: str,
    owner: str,
    *,
    version: int = 0,
    group: str | None = None,
    op_id: str | None = None,
) -> Op[int]:
    """Open session ``sid`` owned by ``owner``; returns the open time (server ms).

    ``version`` is the weight version at open (``born``); ``group`` an optional
    replay group id. Raises InvalidId (before I/O), SessionExists (already
    open), SessionReleased (the id was released: ids are never reused),
    OwnerLost (gc declared ``owner`` lost), OutcomeUnknown (reply lost: call
    again with its ``op_id``). ``op_id``: the caller's idempotency key (see
    README, "Lost replies"); a call again with it returns the first reply.
    One round trip.
    """
    k = ctx.keys
    validate.version("version", version)
    if group is not None:
        validate_id("group id", group)
    op = ctx.op(op_id, "open")
    reply = yield Eval(
        script("open_session"),
        (k.session(sid), k.owner(owner), k.released, op.key, k.owners_lost, k.stats),
        (sid, owner, version, group or "", ctx.op_ttl_ms),
        op_id=op.id,
    )
    return Reply(reply, "open_session").int()


@mutating
def open_sessions(
    ctx: Context,
    sids: Sequence[str],
    owner: str,
    *,
    version: int = 0,
    group: str | None = None,
    op_id: str | None = None,
) -> Op[int]:
    """Open many sessions owned by ``owner``; returns how many were opened.

    All or nothing per chunk of 4,000 (each chunk is one atomic script that
    checks every id before writing). Raises the errors of :func:`open_session`
    (InvalidId before I/O; a duplicate id in ``sids`` is InvalidInput).
    ``op_id``: as :func:`open_session` (one op key per chunk, derived from
    it). One pipelined round trip.
    """
    k = ctx.keys
    sids = validate_ids("session id", sids)
    if len(set(sids)) != len(sids):
        raise InvalidInput("sids", "duplicate session ids")
    okey = k.owner(owner)
    validate.version("version", version)
    if group is not None:
        validate_id("group id", group)
    if not sids:
        return 0
    evals = ctx.op_evals(
        "open_sessions",
        sids,
        lambda op_key, part: (okey, k.released, k.owners_lost, op_key, k.stats, *k.session_keys(part)),
        lambda part: (owner, version, group or "", ctx.op_ttl_ms, *part),
        op=ctx.op(op_id, "open"),
    )
    yield Batch(tuple(evals))
    return len(sids)


def owner_of(ctx: Context, sid: str) -> Op[str | None]:
    """Current owner of a live session, else None (unknown or released). One round trip."""
    states = yield from session_states(ctx, [sid])
    st = states[sid]
    return st[0] if st is not None and st[1] == "live" else None


@mutating
def transfer(
    ctx: Context, sids: Sequence[str], from_owner: str, to_owner: str, *, op_id: str | None = None
) -> Op[list[str]]:
    """Move the live sessions of ``sids`` that ``from_owner`` owns to ``to_owner``.

    Returns the moved ids in input order; sessions owned by someone else,
    released or unknown are left untouched and not returned. Raises InvalidId
    (before I/O), OwnerLost (``to_owner`` was declared lost by gc) and
    OutcomeUnknown (call again with its ``op_id``: the first reply, never a
    second move). One op key per chunk of 4,000, derived from ``op_id``. One
    pipelined round trip.
    """
    k = ctx.keys
    sids = _dedup(validate_ids("session id", sids))
    ofrom, oto = k.owner(from_owner), k.owner(to_owner)
    if not sids:
        return []
    evals = ctx.op_evals(
        "transfer",
        sids,
        lambda op_key, part: (ofrom, oto, k.owners_lost, op_key, *k.session_keys(part)),
        lambda part: (from_owner, to_owner, ctx.op_ttl_ms, *part),
        op=ctx.op(op_id, "transfer"),
    )
    replies = yield Batch(tuple(evals))
    return [text(x) for r in replies for x in r]


def release_evals(
    ctx: Context,
    sids: Sequence[str],
    owner: str,
    reason: str,
    op: OpId,
    *,
    at_least_one: bool = False,
    start: int = 0,
) -> list[Eval]:
    """The control-plane calls of a release: one ``release`` script per chunk, each with its op key.

    ``sids`` must be validated already. Chunk ``i`` replays under
    ``op.key_of(i)``, so a retry (redis-py's, or the caller's with the same
    ``op_id``) returns its first reply.
    """
    k = ctx.keys
    okey = k.owner(owner)
    head = len(k.session_head)
    return ctx.op_evals(
        "release",
        sids,
        lambda op_key, part: (okey, k.released, k.events, op_key, k.stats, *k.session_keys(part)),
        lambda part: (owner, reason, ctx.op_ttl_ms, head),
        op=op,
        at_least_one=at_least_one,
        start=start,
    )


def released_ids(reply: Sequence[object]) -> list[str]:
    """The ids a ``release`` script call released: its reply is one string, the ids joined by newlines."""
    joined = text(reply[0])
    return joined.split("\n") if joined else []


@mutating
def release(
    ctx: Context,
    sids: Sequence[str],
    owner: str,
    reason: str = "released",
    *,
    purge: bool = True,
    op_id: str | None = None,
) -> Op[list[str]]:
    """Release the sessions of ``sids`` that ``owner`` owns; returns the released ids.

    Release-if-owned: sessions owned by someone else, unknown or already
    released are untouched and not returned. Each released session gets
    exactly one event on ``ts:{R}:events`` (fields ``sid``, ``owner``,
    ``reason``, ``ms``) in the same atomic script that changes its state, and
    a tombstone that forbids reopening its id. Then (``purge=True``) its data
    keys are deleted and the data tombstone is written, so later writes fail
    with SessionReleased. Across all callers and retries each session is
    returned at most once.

    Raises InvalidId (before I/O) and OutcomeUnknown when a reply was lost
    (a broken connection, or the purge failed after the release became
    final): calling again with the same ``sids`` and ``op_id=err.op_id``
    returns the ids the first call released (its chunks replay their
    replies; gc purges data a failed purge left). Two pipelined round trips
    (release chunks of 4,000, then purge grouped by node); one when nothing
    was released or ``purge=False``.
    """
    sids = _dedup(validate_ids("session id", sids))
    validate_id("owner tag", owner)
    validate_id("reason", reason)
    if not sids:
        return []
    return (yield from _release(ctx, sids, owner, reason, purge, ctx.op(op_id, "release")))


def _release(
    ctx: Context, sids: list[str], owner: str, reason: str, purge: bool, op: OpId, *, probe: bool = False
) -> Op[list[str]]:
    """Release validated ``sids`` under ``op``; then purge what was released.

    ``probe`` (release_owner with a caller's op id): ``sids`` is a snapshot
    the first attempt may have seen larger, so the chunks after the last
    one are asked for replays too, until one has none (an empty chunk
    releases nothing).
    """
    evals = release_evals(ctx, sids, owner, reason, op, at_least_one=probe)
    replies = yield Batch(tuple(evals))
    parts = [released_ids(r) for r in replies]
    released = [s for part in parts for s in part] if len(parts) > 1 else parts[0]
    n = len(evals)
    while probe and parts[-1]:
        (probe_eval,) = release_evals(ctx, [], owner, reason, op, at_least_one=True, start=n)
        parts = [released_ids((yield probe_eval))]
        released += parts[-1]
        n += 1
    if purge and released:
        yield from purge_sessions(ctx, released)
    return released


@mutating
def release_owner(
    ctx: Context, owner: str, reason: str = "released", *, purge: bool = True, op_id: str | None = None
) -> Op[list[str]]:
    """Release every session ``owner`` owns at the time of the call; returns their ids.

    The owner set is read with one SMEMBERS, then released with the
    release-if-owned script in chunks of 4,000 (pipelined), so no single
    call holds the server for the whole set and a session that moved away
    in between is not released. Sessions opened for ``owner`` after the
    snapshot are not included (call again to release them). The scripts
    take the ids from the client rather than reading the set themselves,
    because a script may only touch keys it receives in KEYS.

    Raises InvalidId (before I/O) and OutcomeUnknown: calling again with
    its ``op_id`` returns the sessions the first call released (each chunk
    replays; the first call's snapshot is not re-read, so sessions it had
    not reached stay owned: release them with a new call). Three round trips (SMEMBERS, release, purge); with a caller's
    ``op_id``, one more that asks whether the first attempt released
    further chunks.
    """
    okey = ctx.keys.owner(owner)
    validate_id("reason", reason)
    op = ctx.op(op_id, "release")
    members = yield Cmd(("SMEMBERS", okey), key=okey)
    sids = sorted(text(m) for m in members)
    if not sids and not op.given:
        return []
    return (yield from _release(ctx, sids, owner, reason, purge, op, probe=op.given))


def sessions(ctx: Context, owner: str | None = None) -> Op[list[str]]:
    """Live session ids of ``owner`` (sorted), or of every owner when ``owner`` is None.

    Raises InvalidId (before I/O). One round trip for an owner; for all
    owners a SCAN of the run's owner sets on every primary, then one
    pipelined round trip.
    """
    k = ctx.keys
    if owner is not None:
        okey = k.owner(owner)
        members = yield Cmd(("SMEMBERS", okey), key=okey)
        return sorted(text(m) for m in members)
    keys = yield ScanAll(k.owner_pattern, type="set")
    if not keys:
        return []
    replies = yield Batch(tuple(Cmd(("SMEMBERS", key), key=key) for key in sorted(set(keys))))
    return sorted({text(m) for r in replies for m in r})


@dataclass(frozen=True)
class OwnerInfo:
    """One owner tag of a run: live sessions, heartbeat deadline, lost mark."""

    owner: str
    sessions: int
    #: Heartbeat deadline (server ms), None when the owner never heart-beat.
    deadline_ms: int | None
    #: When gc declared the owner lost (server ms), else None.
    lost_ms: int | None


def owners(ctx: Context) -> Op[list[OwnerInfo]]:
    """Every owner tag of the run with its live session count and heartbeat state.

    Owners come from a SCAN of the owner sets (every primary), the heartbeat
    zset and the lost zset. Three round trips plus the SCAN.
    """
    k = ctx.keys
    keys = yield ScanAll(k.owner_pattern, type="set")
    tags = {t for key in keys if (t := k.owner_of_key(key))}
    hb, lost = yield Batch(
        (
            Cmd(("ZRANGE", k.owners, 0, -1, "WITHSCORES"), key=k.owners),
            Cmd(("ZRANGE", k.owners_lost, 0, -1, "WITHSCORES"), key=k.owners_lost),
        )
    )
    with stored(k.owners):
        deadlines = {text(m): int(float(sc)) for m, sc in pairs(hb)}
    with stored(k.owners_lost):
        lost_at = {text(m): int(float(sc)) for m, sc in pairs(lost)}
    names = sorted(tags | set(deadlines) | set(lost_at))
    if not names:
        return []
    counts = yield Batch(tuple(Cmd(("SCARD", k.owner(n)), key=k.owner(n)) for n in names))
    return [
        OwnerInfo(n, int(c), deadlines.get(n), lost_at.get(n))
        for n, c in zip(names, counts, strict=True)
    ]


@dataclass(frozen=True)
class Heartbeat:
    """Reply of :func:`heartbeat`: the owner is alive until ``deadline_ms`` (server clock)."""

    owner: str
    deadline_ms: int


@mutating
def heartbeat(ctx: Context, owner: str, ttl_s: float, *, op_id: str | None = None) -> Op[Heartbeat]:
    """Record that ``owner`` is alive for ``ttl_s`` more seconds (server clock).

    Once an owner has heart-beat, ``gc`` releases its sessions (reason
    ``owner-lost``) when a deadline passes without a new heartbeat, and marks
    it lost. Raises InvalidId/InvalidInput (before I/O) and OwnerLost when gc
    already declared this owner lost: its sessions stay released, and the
    process must continue under a new owner tag. A heartbeat records no
    reply: calling again (after an OutcomeUnknown, whose ``op_id`` it names)
    only moves the deadline to ``ttl_s`` from then, which is what a caller
    retrying a heartbeat wants. One round trip.
    """
    k = ctx.keys
    validate_id("owner tag", owner)
    ttl_ms = duration_ms("ttl_s", ttl_s)
    op = ctx.op(op_id, "heartbeat")
    reply = yield Eval(script("heartbeat"), (k.owners, k.owners_lost), (owner, ttl_ms), op_id=op.id)
    heartbeating(ctx).add(owner)
    return Heartbeat(owner, Reply(reply, "heartbeat").int())


def heartbeat_many(
    ctx: Context, owners: Sequence[str], ttl_s: float, *, op_id: str | None = None
) -> Op[list[Heartbeat]]:
    """:func:`heartbeat` for each of ``owners`` (a process's tags), pipelined: one round trip.

    Every tag is checked before any I/O (InvalidId/InvalidInput). The
    heartbeats are separate scripts: if gc declared a tag lost, the others
    are still recorded and OwnerLost is raised afterwards. They share one op
    id (``op_id``, else a fresh one), which only names the call (a heartbeat
    records no reply): an OutcomeUnknown carries it; calling again is safe.
    """
    oid = ctx.op(op_id, "heartbeat").id
    return (yield from gather([heartbeat(ctx, o, ttl_s, op_id=oid) for o in owners]))


def heartbeating(ctx: Context) -> set[str]:
    """The owner tags this client heart-beat for (deregistered when it closes)."""
    tags: set[str] = ctx.caches.setdefault("heartbeats", set())
    return tags


def deregister(ctx: Context, owner: str) -> Op[bool]:
    """Say that ``owner`` is done: drop its heartbeat, so gc never declares it lost.

    Returns True when the owner has no heartbeat any more. Refused (False,
    heartbeat kept) while the owner still owns sessions: if its process does
    not come back, gc must release them when the deadline passes. A store
    deregisters the tags it heart-beat for when it closes. Raises InvalidId
    before I/O. Idempotent. One round trip.
    """
    k = ctx.keys
    okey = k.owner(owner)
    reply = yield Eval(script("owner_done"), (k.owners, okey), (owner,))
    done = Reply(reply, "owner_done").flag()
    if done:
        heartbeating(ctx).discard(owner)
    return done


def deregister_all(ctx: Context) -> Op[list[str]]:
    """Deregister every owner tag this client heart-beat for; returns those kept (they own sessions).

    One pipelined round trip (none when the client never heart-beat).
    """
    k = ctx.keys
    tags = sorted(heartbeating(ctx))
    if not tags:
        return []
    sc = script("owner_done")
    replies = yield Batch(tuple(Eval(sc, (k.owners, k.owner(t)), (t,)) for t in tags))
    kept = [t for t, r in zip(tags, replies, strict=True) if not Reply(r, "owner_done").flag()]
    heartbeating(ctx).intersection_update(kept)
    return kept
