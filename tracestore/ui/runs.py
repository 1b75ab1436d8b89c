"""The viewer's data layer for runs: the runs page, a run, an owner's sessions, a replay cell.

Every function is an operation (a generator of requests, run by either
store with ``store.run(...)``) that reads only, with commands the
``observer`` ACL role has (docs/security.md), and never SCANs: lists come
from the run's own indexes (its counters, the heartbeat and lost zsets, the
owner sets by SSCAN cursor, the replay queues by rank, the release stream
by its newest entries, the gate's log), so a page costs the same on a run
of a thousand sessions as on one of a million. Owner tags that never
heart-beat have no index: the app discovers them in the background
(:mod:`.app`) and passes them in as ``known_owners``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import orjson

from ..context import Context
from ..errors import InvalidInput
from ..gate import GateStatus
from ..gate import status as gate_status
from ..gate_log import cycles, decode_entry
from ..keys import Keys
from ..replay import REPLAY_OWNER, STORED_STATUSES, read_groups
from ..replies import field_map, pairs, stored, text
from ..run import STATS_FIELDS, RunStats
from ..run import stats as run_stats
from ..scripts import Batch, Cmd, Op, ServerTime, gather
from ..validate import int_in, validate_id
from .views import (
    CycleRow,
    EventRate,
    GateView,
    GroupRow,
    Overview,
    OwnerRow,
    OwnerView,
    ReleaseEvent,
    ReplayCell,
    ReplayView,
    RunRow,
    RunView,
    SessionRow,
)

#: The run's aggregate control keys (few and fixed): what a run's memory figure sums.
#: Per-session hashes ``ts:{R}:s:<sid>`` and the data plane are not among them (no index
#: lists them without a SCAN); docs/capacity.md gives their size per session.
AGGREGATE_KEYS = (
    "meta", "stats", "owners", "owners_lost", "events", "released", "gate", "gate_leases", "gate_poison",
    "gate_log", "route", "route_load", "route_retired", "rb_groups", "rb_sids", "rb_payloads", "rb_bytes",
    "rb_tasks", "rb_seq",
)
#: Newest release events read per run page (rate and sparkline).
EVENTS_READ = 1000
#: Release events listed on a run page.
EVENTS_SHOWN = 20
#: Staleness buckets of a replay cell's histogram (0 .. n-1 versions behind, then "older").
STALENESS_BUCKETS = 16
#: Sparkline of the release rate: buckets of this many seconds...
BUCKET_S = 10
#: ... this many of them, up to now.
BUCKETS = 30


@lru_cache(maxsize=1024)
def _keys(prefix: str, run: str) -> Keys:
    """One key builder per run (it caches the 16,384 turn counter shard names it builds)."""
    return Keys(prefix, run)


def run_context(ctx: Context, run: str) -> Context:
    """A context of run ``run`` on the same server as ``ctx``.

    Fresh caches and fence each time: a viewer shows a run whose gate
    version went back (a failover, a restored checkpoint) instead of
    refusing it with StateRolledBack. Raises InvalidId for a bad run id.
    """
    return Context(_keys(ctx.keys.prefix, run), ctx.cluster, ctx.config)


def _i(x: Any) -> int | None:
    if x is None:
        return None
    try:
        return int(float(text(x)))
    except ValueError:
        return None


def parse_info(reply: Any) -> dict[str, str]:
    """An INFO reply (redis-py's dict, or the raw text) as ``{field: value}``."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    out: dict[str, str] = {}
    for line in text(reply).splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def _entry_ms(entry_id: Any) -> int:
    """Server time (ms) of a stream entry id ``<ms>-<seq>``."""
    return int(text(entry_id).split("-", 1)[0])


def _memory_cmds(k: Keys) -> list[Cmd]:
    return [Cmd(("MEMORY", "USAGE", getattr(k, a)), key=getattr(k, a)) for a in AGGREGATE_KEYS]


def _pages(total: int, per_page: int) -> int:
    return max(1, math.ceil(total / per_page))


# -- the runs page -----------------------------------------------------------------------------------


def _row_cmds(k: Keys, now: int) -> list[Cmd]:
    return [
        Cmd(("HGET", k.meta, "created_ms"), key=k.meta),
        Cmd(("HMGET", k.stats, *STATS_FIELDS), key=k.stats),
        Cmd(("XREVRANGE", k.events, "+", "-", "COUNT", 1), key=k.events),
        Cmd(("HMGET", k.gate, "state", "version", "sealed_ms", "installed_ms"), key=k.gate),
        Cmd(("ZRANGE", k.owners, -1, -1, "WITHSCORES"), key=k.owners),
        Cmd(("ZCOUNT", k.owners, f"({now}", "+inf"), key=k.owners),
        Cmd(("XREVRANGE", k.gate_log, "+", "-", "COUNT", 1), key=k.gate_log),
        Cmd(("INFO", "memory"), key=k.meta),
        *_memory_cmds(k),
    ]


def _row(run: str, now: int, r: list[Any]) -> RunRow:
    created, counts, last_event, gate, newest_beat, beating, last_log, info = r[:8]
    c = {f: _i(v) or 0 for f, v in zip(STATS_FIELDS, counts, strict=True)}
    times = [_i(created), _i(gate[2]), _i(gate[3])]
    if last_event:
        times.append(_entry_ms(last_event[0][0]))
    if last_log:
        times.append(_entry_ms(last_log[0][0]))
    beats = pairs(newest_beat)
    if beats:
        times.append(min(int(float(beats[0][1])), now))
    known = [t for t in times if t is not None]
    return RunRow(
        run=run,
        created_ms=_i(created),
        sessions_opened=c["sessions_opened"],
        sessions_released=c["sessions_released"],
        sessions_live=c["sessions_opened"] - c["sessions_released"],
        release_events=c["release_events"],
        groups_put=c["groups_put"],
        groups_taken=c["groups_taken"],
        groups_expired=c["groups_expired"],
        gate_state=text(gate[0]) if gate[0] is not None else "open",
        gate_version=_i(gate[1]) or 0,
        heartbeating=int(beating),
        last_activity_ms=max(known) if known else None,
        control_bytes=sum(int(x or 0) for x in r[8:]),
        node_used_memory=_i(parse_info(info).get("used_memory")),
    )


def overview(
    ctx: Context,
    runs: Sequence[str],
    *,
    page: int = 1,
    per_page: int = 20,
    url: str = "",
    listed_ms: int | None = None,
    fixed_run: str | None = None,
) -> Op[Overview]:
    """The runs page: page ``page`` of ``runs`` (sorted), each with its counters, memory and activity.

    ``runs`` is the run list the caller discovered (no SCAN here). Raises
    InvalidInput for a bad ``page``/``per_page``. Two round trips (the
    server clock, then one pipeline for every run of the page; per node on
    a cluster).
    """
    int_in("page", page, 1, 10**9)
    int_in("per_page", per_page, 1, 1000)
    names = sorted(runs)
    shown = names[(page - 1) * per_page : page * per_page]
    now = int((yield ServerTime(ctx.keys.meta)))
    groups = [_row_cmds(_keys(ctx.keys.prefix, r), now) for r in shown]
    replies = (yield Batch(tuple(c for g in groups for c in g))) if groups else []
    rows, pos = [], 0
    for run, cmds in zip(shown, groups, strict=True):
        rows.append(_row(run, now, replies[pos : pos + len(cmds)]))
        pos += len(cmds)
    return Overview(now, url, tuple(rows), len(names), page, _pages(len(names), per_page), listed_ms, fixed_run)


# -- a run ----------------------------------------------------------------------------------------------


def _rate(entries: list[Any], now: int) -> tuple[tuple[ReleaseEvent, ...], EventRate]:
    events: list[ReleaseEvent] = []
    times: list[int] = []
    for eid, fields in entries:
        ms = _entry_ms(eid)
        times.append(ms)
        if len(events) < EVENTS_SHOWN:
            f = {k: text(v) for k, v in field_map(fields).items()}
            events.append(ReleaseEvent(text(eid), ms, f.get("sid", ""), f.get("owner", ""), f.get("reason", "")))
    window_ms = 60_000
    in_window = sum(1 for t in times if t > now - window_ms)
    capped = len(entries) >= EVENTS_READ
    buckets = [0] * BUCKETS
    for t in times:
        b = (now - t) // (BUCKET_S * 1000)
        if 0 <= b < BUCKETS:
            buckets[BUCKETS - 1 - b] += 1
    rate = EventRate(
        per_s=in_window / (window_ms / 1000),
        window_s=window_ms / 1000,
        in_window=in_window,
        lower_bound=capped and bool(times) and times[-1] > now - window_ms,
        read=len(entries),
        bucket_s=BUCKET_S,
        buckets=tuple(buckets),
    )
    return tuple(events), rate


def _run_batch(k: Keys, cycles_n: int) -> Op[list[Any]]:
    cmds = (
        Cmd(("HGET", k.meta, "created_ms"), key=k.meta),
        Cmd(("HGET", k.gate, "drained_ms"), key=k.gate),
        Cmd(("XREVRANGE", k.gate_log, "+", "-", "COUNT", 3 * cycles_n), key=k.gate_log),
        Cmd(("ZRANGE", k.owners, 0, -1, "WITHSCORES"), key=k.owners),
        Cmd(("ZRANGE", k.owners_lost, 0, -1, "WITHSCORES"), key=k.owners_lost),
        Cmd(("SMEMBERS", k.rb_tasks), key=k.rb_tasks),
        Cmd(("HGETALL", k.rb_bytes), key=k.rb_bytes),
        Cmd(("XREVRANGE", k.events, "+", "-", "COUNT", EVENTS_READ), key=k.events),
        Cmd(("ZCARD", k.released), key=k.released),
        Cmd(("INFO", "memory"), key=k.meta),
        *_memory_cmds(k),
    )
    return list((yield Batch(cmds)))


def _cycle_row(c: Any) -> CycleRow:
    return CycleRow(
        c.sealed_ms, c.drained_ms, c.installed_ms, c.reopened_ms, c.version_from, c.version_to, c.installed,
        c.live_at_seal, c.drain_ms, c.sealed_for_ms,
    )


def _cell_cmds(k: Keys, task: str, status: str, version: int) -> list[Cmd]:
    q, v = k.rb_queue(task, status), k.rb_versions(task, status)
    cmds = [Cmd(("ZCARD", q), key=q), Cmd(("ZRANGE", v, 0, 0, "WITHSCORES"), key=v)]
    # the score is min_version + seq / 2**32: [V - s, V - s + 1) holds the groups s versions behind
    for s in range(STALENESS_BUCKETS):
        cmds.append(Cmd(("ZCOUNT", v, version - s, f"({version - s + 1}"), key=v))
    cmds.append(Cmd(("ZCOUNT", v, "-inf", f"({version - STALENESS_BUCKETS + 1}"), key=v))
    cmds.append(Cmd(("ZCOUNT", v, version + 1, "+inf"), key=v))
    return cmds


def run_view(
    ctx: Context,
    *,
    known_owners: Iterable[str] = (),
    owners_listed_ms: int | None = None,
    owners_page: int = 1,
    per_page: int = 50,
    cycles_n: int = 50,
) -> Op[RunView]:
    """The run page of ``ctx``'s run: counters, owners, the gate and its cycles, replay, releases.

    Owners: those with a heartbeat or a lost mark, the replay buffer's, and
    ``known_owners`` (discovered by the caller), each with its live session
    count (SCARD), most sessions first, page ``owners_page``. The gate's
    last ``cycles_n`` cycles come from its log. Raises InvalidInput for bad
    paging arguments, CorruptData for a stored value that does not decode.
    Three round trips (the server clock; counters, gate, log, heartbeats,
    events and memory in one pipeline; owner counts and the replay cells in
    another), whatever the number of sessions.
    """
    int_in("owners_page", owners_page, 1, 10**9)
    int_in("per_page", per_page, 1, 1000)
    int_in("cycles_n", cycles_n, 1, 1000)
    k = ctx.keys
    now = int((yield ServerTime(k.meta)))
    ops: list[Op[Any]] = [run_stats(ctx), gate_status(ctx), _run_batch(k, cycles_n)]
    parts: list[Any] = yield from gather(ops)  # one round trip for the three
    counters: RunStats = parts[0]
    gate: GateStatus = parts[1]
    rest: list[Any] = parts[2]
    created, drained, log, beats, lost, tasks, nbytes, entries, released, info = rest[:10]
    with stored(k.owners):
        deadlines = {text(m): int(float(s)) for m, s in pairs(beats)}
    with stored(k.owners_lost):
        lost_at = {text(m): int(float(s)) for m, s in pairs(lost)}
    with stored(k.rb_bytes):
        sizes = {f: int(v) for f, v in field_map(nbytes).items()}
    names = sorted({*known_owners, *deadlines, *lost_at, REPLAY_OWNER})
    cells = [(t, s) for t in sorted(text(x) for x in tasks) for s in STORED_STATUSES]
    cell_cmds = [_cell_cmds(k, t, s, gate.version) for t, s in cells]
    second = yield Batch((
        *(Cmd(("SCARD", k.owner(n)), key=k.owner(n)) for n in names),
        *(c for group in cell_cmds for c in group),
    ))
    rows = []
    for n, count in zip(names, second[: len(names)], strict=True):
        d, lo = deadlines.get(n), lost_at.get(n)
        if not int(count) and d is None and lo is None:
            continue
        beat = "lost" if lo is not None else "none" if d is None else "alive" if d > now else "expired"
        rows.append(OwnerRow(n, int(count), d, lo, beat))
    rows.sort(key=lambda o: (-o.sessions, o.owner))
    replay, pos = [], len(names)
    for (task, status), group in zip(cells, cell_cmds, strict=True):
        r = second[pos : pos + len(group)]
        pos += len(group)
        head = pairs(r[1])
        replay.append(ReplayCell(
            task, status, int(r[0]), math.floor(float(head[0][1])) if head else None,
            sizes.get(f"{status} {task}", 0), tuple(int(x) for x in r[2 : 2 + STALENESS_BUCKETS]),
            int(r[-2]), int(r[-1]),
        ))
    events, rate = _rate(entries, now)
    with stored(k.gate_log):
        log_events = [decode_entry(eid, fields, k.gate_log) for eid, fields in log]
    cyc = [_cycle_row(c) for c in cycles(log_events)]
    cyc.reverse()  # newest first
    if gate.sealed and cyc and cyc[0].reopened_ms is None and cyc[0].drained_ms is None and drained is not None:
        c0 = cyc[0]  # the cycle in progress: its drain time is in the gate hash until it reopens
        d0 = _i(drained)
        cyc[0] = CycleRow(c0.sealed_ms, d0, c0.installed_ms, None, c0.version_from, c0.version_to, c0.installed,
                          c0.live_at_seal, None if c0.sealed_ms is None or d0 is None else d0 - c0.sealed_ms, None)
    start = (owners_page - 1) * per_page
    return RunView(
        run=k.run,
        server_ms=now,
        created_ms=_i(created),
        counters={**counters.__dict__, "sessions_live": counters.sessions_live},
        gate=GateView(gate.state, gate.version, gate.live, gate.poisoned, gate.sealed_ms, _i(drained),
                      gate.installed_ms, tuple((p.lease_id, p.reason) for p in gate.poison)),
        cycles=tuple(cyc[:cycles_n]),
        owners=tuple(rows[start : start + per_page]),
        owners_total=len(rows),
        owners_page=owners_page,
        owners_pages=_pages(len(rows), per_page),
        owners_listed_ms=owners_listed_ms,
        replay=tuple(replay),
        events=events,
        rate=rate,
        control_bytes=sum(int(x or 0) for x in rest[10:]),
        node_used_memory=_i(parse_info(info).get("used_memory")),
        released_total=int(released),
    )


# -- an owner's sessions --------------------------------------------------------------------------------


def owner_view(ctx: Context, owner: str, *, cursor: str = "0", count: int = 100) -> Op[OwnerView]:
    """One page of ``owner``'s live sessions (SSCAN from ``cursor``), each with its record and node count.

    ``next_cursor`` continues the listing ("0": done). SSCAN may return a
    session twice across pages when the set changes meanwhile (never skips
    one that stays). Raises InvalidId/InvalidInput before I/O. Two round
    trips: the page of the owner set with its size and heartbeat, then the
    sessions' records and index sizes (pipelined, per node on a cluster).
    """
    validate_id("owner tag", owner)
    if not cursor.isdigit() or len(cursor) > 20:
        raise InvalidInput("cursor", f"must be a SSCAN cursor (digits), got {cursor!r:.40}")
    int_in("count", count, 1, 1000)
    k = ctx.keys
    okey = k.owner(owner)
    now = int((yield ServerTime(k.meta)))
    page, total, deadline = yield Batch((
        Cmd(("SSCAN", okey, cursor, "COUNT", count), key=okey),
        Cmd(("SCARD", okey), key=okey),
        Cmd(("ZSCORE", k.owners, owner), key=k.owners),
    ))
    nxt, members = text(page[0]), sorted({text(m) for m in page[1]})
    cmds: list[Cmd] = []
    for sid in members:
        cmds.append(Cmd(("HMGET", k.session(sid), "state", "born", "opened_ms", "group"), key=k.session(sid)))
        cmds.append(Cmd(("HLEN", k.idx(sid)), key=k.idx(sid)))
    replies = (yield Batch(tuple(cmds))) if cmds else []
    rows = []
    for j, sid in enumerate(members):
        h, n = replies[2 * j], replies[2 * j + 1]
        rows.append(SessionRow(sid, text(h[0]) if h[0] is not None else "?", _i(h[1]), _i(h[2]),
                               text(h[3]) if h[3] else None, max(0, int(n) - 2)))  # ('#e', '#v')
    return OwnerView(k.run, owner, now, int(total), _i(deadline), tuple(rows), cursor, nxt)


# -- a replay cell ---------------------------------------------------------------------------------------


def replay_view(ctx: Context, task: str, status: str, *, offset: int = 0, count: int = 50) -> Op[ReplayView]:
    """Groups ``offset .. offset + count - 1`` (FIFO order) of ``task`` with ``status``.

    Raises InvalidId/InvalidInput before I/O (a status that is never
    stored, paging out of range), CorruptData for a group that does not
    decode. Two round trips: the queue's page, size and the gate version,
    then the groups' records (three HMGETs).
    """
    validate_id("task", task)
    if status not in STORED_STATUSES:
        raise InvalidInput("status", f"must be one of {', '.join(STORED_STATUSES)}, got {status!r:.40}")
    int_in("offset", offset, 0, 2**31)
    int_in("count", count, 1, 1000)
    k = ctx.keys
    q = k.rb_queue(task, status)
    now = int((yield ServerTime(k.meta)))
    total, gids, version = yield Batch((
        Cmd(("ZCARD", q), key=q),
        Cmd(("ZRANGE", q, offset, offset + count - 1), key=q),
        Cmd(("HGET", k.gate, "version"), key=k.gate),
    ))
    v = _i(version) or 0
    groups = yield from read_groups(ctx, [text(g) for g in gids])
    rows = tuple(
        GroupRow(g.gid, g.seq or 0, g.min_version or 0, v - (g.min_version or 0), g.retryable, g.sids,
                 orjson.dumps(g.payload).decode()[:2000])
        for g in groups
    )
    return ReplayView(k.run, task, status, now, v, int(total), offset, rows)


__all__ = ["AGGREGATE_KEYS", "overview", "owner_view", "parse_info", "replay_view", "run_context", "run_view"]
