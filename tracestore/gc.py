"""Garbage collection of a run's control and data planes (docs/design.md section 5, invariants 4, 5).

``gc`` is safe to run at any time, from any process, concurrently with the
workload: every step either goes through an atomic release-if-owned script
that re-checks its condition on the server, or only touches state that is
already final (released sessions, tombstones past their retention, consumer
groups idle past a limit). It never touches a live session of a live owner.

Steps, in order:

0. **Dead lease holders** (docs/gate.md, Holders that stop): with an
   ``abort`` function (``tracestore gc`` passes an HTTP one), the unsettled
   leases of holders whose heartbeat stopped are aborted at their engines
   and settled ``aborted`` (:func:`~tracestore.gate.holders.resolve_dead_holders`);
   without one they are only counted. Holders dead for longer than
   ``holder_retention_s`` that hold nothing are forgotten.
1. **Lost owners**: an owner whose heartbeat deadline passed is recorded as
   lost and its sessions are released with reason ``owner-lost``; owners
   already lost are swept again (sessions moved to them later go too). A lost
   owner's heartbeat raises OwnerLost, so nothing is resurrected.
2. **Crash leftovers** (``scan_data=True``): SCAN every primary for the run's
   data keys; a session whose control record says released (or that has a
   release tombstone) but still has data is purged; data with no control
   record at all is *reported* (``orphan_sessions``), not deleted: the data
   plane may legitimately write before the session is opened.
3. **Tombstones** older than ``tombstone_retention_s``: the released record,
   the session hash and the data tombstone go; lost-owner marks of owners
   without sessions go too.
4. **Consumer groups** of ``ts:{R}:events`` whose consumers were all idle for
   longer than ``group_idle_limit_s`` are destroyed (their holders are gone;
   a holder that comes back re-creates its group and reconciles).
5. **Event stream**: entries below the slowest remaining group (its oldest
   pending entry, else its last delivered id) are trimmed with XTRIM MINID;
   with no group left, entries older than ``event_retention_s``.

``gc(dry_run=True)`` (``tracestore gc --check``) changes nothing: it reads
what each step would act on and reports it in the same :class:`GcReport`
(``dry_run`` True), as of the moment it reads (a real pass re-checks every
deadline on the server, so an owner that heart-beats meanwhile is spared).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .context import Context
from .gate.holders import Abort, dead_holders_and_leases, forget_dead_holders, resolve_dead_holders
from .ownership import session_states
from .purge import purge_sessions
from .replies import Reply, field_map, text
from .run import server_ms
from .scripts import Batch, Cmd, Eval, Op, ScanAll, chunks, script
from .validate import duration_ms

OWNER_LOST = "owner-lost"
#: Default retention of release tombstones (s). A tombstone costs ~90 B on the
#: run's control-plane primary and ~60 B on the session's data slot: 1 day of
#: 10 million sessions is ~0.9 GB on that primary (docs/capacity.md). Raise it
#: for frameworks that reuse session ids after a day.
TOMBSTONE_RETENTION_S = 86_400
#: Default retention of release events when no consumer group is left (s).
EVENT_RETENTION_S = 86_400
#: Consumer groups idle for longer than this (s) are removed.
GROUP_IDLE_LIMIT_S = 3_600
#: Lease holders whose heartbeat ran out longer ago than this (s), holding no lease, are forgotten.
HOLDER_RETENTION_S = 86_400
_SWEEPS = 8  # passes over a lost owner's set; it can only shrink once the owner is lost
_COUNT_PAGE = 5000  # event ids read per round trip when a dry run counts what a trim would remove


@dataclass(frozen=True)
class GcReport:
    """What one ``gc`` pass did."""

    #: Owners declared lost in this pass (heartbeat expired).
    owners_lost: tuple[str, ...] = ()
    #: Sessions released with reason ``owner-lost`` in this pass.
    sessions_released: tuple[str, ...] = ()
    #: Released sessions whose leftover data (a crash between release and purge) was purged.
    sessions_purged: tuple[str, ...] = ()
    #: Sessions with data keys but no control record (reported, not deleted).
    orphan_sessions: tuple[str, ...] = ()
    #: Release tombstones removed because they were older than the retention.
    tombstones_trimmed: int = 0
    #: Entries removed from ``ts:{R}:events``.
    events_trimmed: int = 0
    #: Consumer groups removed because their holders were gone too long.
    groups_removed: tuple[str, ...] = ()
    #: True for a dry run (``gc(dry_run=True)``): nothing was changed, every field says
    #: what a pass would have done at the time of the reads.
    dry_run: bool = False
    #: Unsettled leases of lease holders whose heartbeat stopped (found this pass).
    dead_holder_leases: tuple[str, ...] = ()
    #: Of those, the leases aborted at their engines and settled ``aborted`` (``abort`` given).
    leases_resolved: tuple[str, ...] = ()
    #: Lease holders forgotten (dead longer than the retention, holding nothing).
    holders_forgotten: tuple[str, ...] = ()

    def summary(self) -> list[tuple[str, object]]:
        """(what, count) rows for tables (worded "would ..." for a dry run)."""
        if self.dry_run:
            return [
                ("owners to declare lost", len(self.owners_lost)),
                ("sessions to release (owner-lost)", len(self.sessions_released)),
                ("leftover data to purge (sessions)", len(self.sessions_purged)),
                ("orphan data (sessions, reported)", len(self.orphan_sessions)),
                ("tombstones to trim", self.tombstones_trimmed),
                ("events to trim", self.events_trimmed),
                ("consumer groups to remove", len(self.groups_removed)),
                ("leases of dead holders to resolve", len(self.dead_holder_leases)),
                ("dead lease holders to forget", len(self.holders_forgotten)),
            ]
        return [
            ("owners declared lost", len(self.owners_lost)),
            ("sessions released (owner-lost)", len(self.sessions_released)),
            ("leftover data purged (sessions)", len(self.sessions_purged)),
            ("orphan data (sessions, reported)", len(self.orphan_sessions)),
            ("tombstones trimmed", self.tombstones_trimmed),
            ("events trimmed", self.events_trimmed),
            ("consumer groups removed", len(self.groups_removed)),
            ("leases of dead holders", len(self.dead_holder_leases)),
            ("leases resolved (aborted at their engine)", len(self.leases_resolved)),
            ("dead lease holders forgotten", len(self.holders_forgotten)),
        ]


def _id_tuple(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def release_lost_owner(ctx: Context, owner: str) -> Op[tuple[bool, list[str]]]:
    """Release ``owner``'s sessions if its heartbeat expired; ``(lost, released ids)``.

    The deadline is re-checked on the server by ``gc_owner_lost``; an owner
    alive at that moment is left alone (``lost`` False).
    """
    k = ctx.keys
    okey = k.owner(owner)
    fixed = (k.owners, k.owners_lost, okey, k.released, k.events)
    released: list[str] = []
    for _ in range(_SWEEPS):
        members = yield Cmd(("SMEMBERS", okey), key=okey)
        sids = sorted(text(m) for m in members)
        evals = ctx.op_evals(
            "gc_owner_lost",
            sids,
            lambda op_key, part: (*fixed, op_key, k.stats, *k.session_keys(part)),
            lambda part: (owner, OWNER_LOST, ctx.op_ttl_ms, *part),
            op=ctx.op(None, "gc"),
            at_least_one=True,  # the deadline check runs even when the owner has no session
        )
        replies = [Reply(r, "gc_owner_lost") for r in (yield Batch(tuple(evals)))]
        # Each chunk re-checks the deadline: a later chunk may see it pass after the
        # first one did not, and then it released its sessions (events appended).
        lost = [r.flag() for r in replies]
        if not any(lost):
            return False, released
        released.extend(x for r in replies for x in r.rest_texts())
        if not sids:
            break
    return True, released


def _lost_owners(ctx: Context, now: int) -> Op[tuple[list[str], list[str]]]:
    """(owners whose deadline passed, lost owners that still own sessions)."""
    k = ctx.keys
    expired, lost = yield Batch(
        (
            Cmd(("ZRANGEBYSCORE", k.owners, "-inf", now), key=k.owners),
            Cmd(("ZRANGE", k.owners_lost, 0, -1), key=k.owners_lost),
        )
    )
    lost_names = [text(x) for x in lost]
    still: list[str] = []
    if lost_names:
        counts = yield Batch(tuple(Cmd(("SCARD", k.owner(n)), key=k.owner(n)) for n in lost_names))
        still = [n for n, c in zip(lost_names, counts, strict=True) if int(c) > 0]
    return [text(x) for x in expired], still


def _leftover_data(ctx: Context) -> Op[tuple[list[str], list[str]]]:
    """(released sessions that still have data, sessions with data but no control record)."""
    k = ctx.keys
    keys = yield ScanAll(k.data_pattern)
    with_data = sorted({sid for key in keys if k.is_trace_data(key) and (sid := k.sid_of_data_key(key))})
    if not with_data:
        return [], []
    states = yield from session_states(ctx, with_data)
    unknown = [s for s in with_data if states[s] is None]
    tomb: set[str] = set()
    if unknown:
        replies = yield Batch(
            tuple(Cmd(("ZMSCORE", k.released, *part), key=k.released) for part in chunks(unknown, 4000))
        )
        scores = [x for r in replies for x in r]
        tomb = {s for s, sc in zip(unknown, scores, strict=True) if sc is not None}
    st_released = [s for s in with_data if (st := states[s]) is not None and st[1] == "released"]
    purge = sorted(set(st_released) | tomb)
    orphans = [s for s in unknown if s not in tomb]
    return purge, orphans


def _trim_tombstones(ctx: Context, cutoff: int) -> Op[int]:
    k = ctx.keys
    sc = script("gc_trim_tombstones")
    total = 0
    while True:
        old = yield Cmd(
            ("ZRANGEBYSCORE", k.released, "-inf", cutoff, "LIMIT", 0, sc.chunk), key=k.released
        )
        sids = [text(x) for x in old]
        if not sids:
            break
        # Read the data tombstones while the release tombstones still forbid reuse: once
        # trimmed, an id may be reopened, released and purged again before we delete, and
        # that purge's tombstone must stay (gc_clear_dead deletes only the value read here).
        deads = yield Batch(tuple(Cmd(("GET", k.dead(s)), key=k.dead(s)) for s in sids))
        op = ctx.op(None, "gc")
        reply = yield Eval(
            sc, (k.released, op.key, *k.session_keys(sids)), (cutoff, ctx.op_ttl_ms, *sids), op_id=op.id
        )
        trimmed = [text(x) for x in reply]
        dead_of = {s: d for s, d in zip(sids, deads, strict=True) if d is not None}
        clear = [s for s in trimmed if s in dead_of]
        if clear:
            cd = script("gc_clear_dead")
            yield Batch(tuple(Eval(cd, (k.dead(s),), (dead_of[s],)) for s in clear))
        total += len(trimmed)
        if len(sids) < sc.chunk or not trimmed:
            break
    # Lost-owner marks past the retention, once the owner has nothing left.
    lost = yield Cmd(("ZRANGEBYSCORE", k.owners_lost, "-inf", cutoff), key=k.owners_lost)
    names = [text(x) for x in lost]
    if names:
        counts = yield Batch(tuple(Cmd(("SCARD", k.owner(n)), key=k.owner(n)) for n in names))
        empty = [n for n, c in zip(names, counts, strict=True) if int(c) == 0]
        if empty:
            yield Cmd(("ZREM", k.owners_lost, *empty), key=k.owners_lost)
    return total


def _groups(
    ctx: Context, now: int, idle_limit_ms: int, *, remove: bool = True
) -> Op[tuple[list[str], list[dict[str, Any]]]]:
    """(groups removed, groups kept with their XINFO fields); ``remove=False``: those it would remove."""
    k = ctx.keys
    exists = yield Cmd(("EXISTS", k.events), key=k.events)
    if not int(exists):
        return [], []
    raw = yield Cmd(("XINFO", "GROUPS", k.events), key=k.events)
    groups = [field_map(g) for g in raw]
    removed: list[str] = []
    kept: list[dict[str, Any]] = []
    replies = yield Batch(
        tuple(Cmd(("XINFO", "CONSUMERS", k.events, text(g["name"])), key=k.events) for g in groups)
    )
    for g, consumers in zip(groups, replies, strict=True):
        name = text(g["name"])
        idles = [int(field_map(c)["idle"]) for c in consumers]
        if idles:
            idle = min(idles)
        else:  # never read: judge by the time of the last id it was positioned at
            idle = now - _id_tuple(text(g["last-delivered-id"]))[0]
        if idle > idle_limit_ms:
            if remove:
                yield Cmd(("XGROUP", "DESTROY", k.events, name), key=k.events)
            removed.append(name)
        else:
            kept.append(g)
    return removed, kept


def _trim_events(
    ctx: Context, now: int, kept: list[dict[str, Any]], retention_ms: int, *, trim: bool = True
) -> Op[int]:
    """Trim the event stream below the slowest kept group (or the retention); the entries removed.

    ``trim=False`` counts the entries a trim would remove and removes none.
    """
    k = ctx.keys
    if kept:
        marks: list[tuple[int, int]] = []
        for g in kept:
            mark = _id_tuple(text(g["last-delivered-id"]))
            if int(g.get("pending", 0)):
                summary = yield Cmd(("XPENDING", k.events, text(g["name"])), key=k.events)
                # redis-py parses the summary into a dict; a raw reply is [n, min, max, consumers].
                oldest = summary.get("min") if isinstance(summary, dict) else summary[1]
                if oldest is not None:
                    mark = min(mark, _id_tuple(text(oldest)))
            marks.append(mark)
        low = min(marks)
    else:
        low = (max(0, now - retention_ms), 0)
    if low == (0, 0):
        return 0
    if not trim:
        return (yield from _count_below(ctx, f"{low[0]}-{low[1]}"))
    # XTRIM of a missing stream answers 0: no EXISTS round trip needed.
    n = yield Cmd(("XTRIM", k.events, "MINID", f"{low[0]}-{low[1]}"), key=k.events)
    return int(n)


def _count_below(ctx: Context, min_id: str) -> Op[int]:
    """Entries of the event stream with an id below ``min_id`` (what XTRIM MINID would remove).

    Pages of :data:`_COUNT_PAGE` ids (one round trip each): a dry run reads
    the ids it counts, it trims nothing.
    """
    k = ctx.keys
    start, total = "-", 0
    while True:
        page = yield Cmd(("XRANGE", k.events, start, f"({min_id}", "COUNT", _COUNT_PAGE), key=k.events)
        total += len(page)
        if len(page) < _COUNT_PAGE:
            return total
        start = f"({text(page[-1][0])}"


def _dead_holders(
    ctx: Context, now: int, abort: Abort | None, retention_ms: int, dry_run: bool
) -> Op[tuple[list[str], list[str], list[str]]]:
    """(leases of dead holders, those resolved, holders forgotten): step 0 of :func:`gc`.

    A dry run resolves nothing and names the holders a pass would forget.
    """
    if abort is not None and not dry_run:
        rep = yield from resolve_dead_holders(ctx, abort)
        holders, found = list(rep.dead_holders), [d.lease_id for d in rep.found]
        resolved = [r.lease_id for r in rep.settled]
        return found, resolved, (yield from forget_dead_holders(ctx, holders, now - retention_ms))
    holders, leases = yield from dead_holders_and_leases(ctx)
    found = [d.lease_id for d in leases]
    if not dry_run:
        return found, [], (yield from forget_dead_holders(ctx, holders, now - retention_ms))
    holding = {d.holder for d in leases}
    idle = [h for h in holders if h not in holding]
    k = ctx.keys
    scores = (yield Batch(tuple(Cmd(("ZSCORE", k.gate_holders, h), key=k.gate_holders) for h in idle))) if idle else []
    old = [h for h, sc in zip(idle, scores, strict=True) if sc is not None and float(sc) < now - retention_ms]
    return found, [], old


def gc(
    ctx: Context,
    *,
    tombstone_retention_s: float = TOMBSTONE_RETENTION_S,
    group_idle_limit_s: float = GROUP_IDLE_LIMIT_S,
    event_retention_s: float = EVENT_RETENTION_S,
    scan_data: bool = True,
    dry_run: bool = False,
    abort: Abort | None = None,
    holder_retention_s: float = HOLDER_RETENTION_S,
) -> Op[GcReport]:
    """One garbage-collection pass over the run; returns a :class:`GcReport`.

    Releases the sessions of owners whose heartbeat expired (reason
    ``owner-lost``; the owner is marked lost and cannot come back), purges
    data that a crash left behind released sessions, reports data keys with
    no control record (SCAN of every primary; skipped with
    ``scan_data=False``), trims release tombstones older than
    ``tombstone_retention_s``, removes consumer groups idle for longer than
    ``group_idle_limit_s`` and trims ``ts:{R}:events`` below the slowest
    remaining group (or to ``event_retention_s`` when none is left). With
    ``abort`` (see :func:`~tracestore.gate.holders.resolve_dead_holders`;
    :func:`tracestore.gate.aborts.http_abort` stops requests over HTTP) it
    first resolves the leases of lease holders whose heartbeat stopped;
    without, it counts them. Lease holders dead for longer than
    ``holder_retention_s`` that hold no lease are forgotten. Never touches a
    live session of a live owner, nor a lease of a live holder. Safe to run
    concurrently with the workload and with another gc. With ``dry_run=True`` it changes
    nothing and reports what a pass would do now (``GcReport.dry_run``):
    the owners whose deadline passed and their sessions, the leftover and
    orphan data, the tombstones past the retention, the idle groups and the
    events a trim would remove, the leases of dead holders (aborting none).
    Raises InvalidInput (before I/O), StorageError. Round trips: a few per
    lost owner, one SCAN per primary, plus about fifteen (a dry run: one per
    5,000 events it counts).
    """
    retention_ms = duration_ms("tombstone_retention_s", tombstone_retention_s, allow_zero=True)
    idle_ms = duration_ms("group_idle_limit_s", group_idle_limit_s, allow_zero=True)
    event_ms = duration_ms("event_retention_s", event_retention_s, allow_zero=True)
    holder_ms = duration_ms("holder_retention_s", holder_retention_s, allow_zero=True)
    now = yield from server_ms(ctx)
    dead_leases, resolved, forgotten = yield from _dead_holders(ctx, now, abort, holder_ms, dry_run)
    holders = GcReport(dead_holder_leases=tuple(dead_leases), leases_resolved=tuple(resolved),
                       holders_forgotten=tuple(forgotten))
    if dry_run:
        plan = yield from _plan(ctx, now, retention_ms, idle_ms, event_ms, scan_data)
        return dataclasses.replace(plan, dead_holder_leases=holders.dead_holder_leases,
                                   holders_forgotten=holders.holders_forgotten)

    expired, lost_with_sessions = yield from _lost_owners(ctx, now)
    owners_lost: list[str] = []
    released: list[str] = []
    for owner in dict.fromkeys([*expired, *lost_with_sessions]):
        lost, ids = yield from release_lost_owner(ctx, owner)
        if lost and owner in expired:
            owners_lost.append(owner)
        released.extend(ids)
    if released:
        yield from purge_sessions(ctx, released)

    purged: list[str] = []
    orphans: list[str] = []
    if scan_data:
        purged, orphans = yield from _leftover_data(ctx)
        if purged:
            yield from purge_sessions(ctx, purged)

    trimmed = yield from _trim_tombstones(ctx, now - retention_ms)
    removed, kept = yield from _groups(ctx, now, idle_ms)
    events_trimmed = yield from _trim_events(ctx, now, kept, event_ms)
    return GcReport(
        owners_lost=tuple(owners_lost),
        sessions_released=tuple(released),
        sessions_purged=tuple(purged),
        orphan_sessions=tuple(orphans),
        tombstones_trimmed=trimmed,
        events_trimmed=events_trimmed,
        groups_removed=tuple(removed),
        dead_holder_leases=holders.dead_holder_leases,
        leases_resolved=holders.leases_resolved,
        holders_forgotten=holders.holders_forgotten,
    )


def _plan(
    ctx: Context, now: int, retention_ms: int, idle_ms: int, event_ms: int, scan_data: bool
) -> Op[GcReport]:
    """What :func:`gc` would do at server time ``now``, read without a write (its dry run)."""
    k = ctx.keys
    expired, lost_with_sessions = yield from _lost_owners(ctx, now)
    owners = list(dict.fromkeys([*expired, *lost_with_sessions]))
    held: list[Any] = []
    if owners:
        held = yield Batch(tuple(Cmd(("SMEMBERS", k.owner(o)), key=k.owner(o)) for o in owners))
    released = sorted({text(m) for members in held for m in members})
    purged: list[str] = []
    orphans: list[str] = []
    if scan_data:
        purged, orphans = yield from _leftover_data(ctx)
    old = yield Cmd(("ZCOUNT", k.released, "-inf", now - retention_ms), key=k.released)
    removed, kept = yield from _groups(ctx, now, idle_ms, remove=False)
    events = yield from _trim_events(ctx, now, kept, event_ms, trim=False)
    return GcReport(
        owners_lost=tuple(expired),
        sessions_released=tuple(released),
        sessions_purged=tuple(purged),
        orphan_sessions=tuple(orphans),
        tombstones_trimmed=int(old),
        events_trimmed=events,
        groups_removed=tuple(removed),
        dry_run=True,
    )
