"""The runs on a server: list them with their activity and footprint, delete one (docs/design.md section 12).

A run exists while its meta record ``ts:{R}:meta`` does. :func:`list_runs`
reads, for every run under the store's key prefix, when it was created, its
live sessions and the owners holding them, its last activity and what its
control plane costs on the server (keys and ``MEMORY USAGE`` bytes of
``ts:{R}:*``). :func:`delete_run` removes every key of one run (control
plane and the data of every session) and nothing else: the keys come from
SCAN patterns that only that run's keys match, each is checked against the
run's key layout before it is deleted, and they are unlinked grouped by hash
slot (one command per slot; one round trip per node on a cluster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .context import Context
from .errors import PermissionDenied, RunInUse, RunRecordMissing
from .keys import Keys, key_slot, meta_pattern, run_of_meta_key
from .ownership import OwnerInfo, owners
from .replay import REPLAY_OWNER
from .replies import text
from .scripts import Batch, Cmd, Op, ScanAll, ServerTime, chunks, group_by_slot

#: Keys per UNLINK / per MEMORY USAGE pipeline slice.
KEY_CHUNK = 500


@dataclass(frozen=True)
class RunSummary:
    """One run as ``tracestore runs`` shows it."""

    run: str
    #: When the run's meta record was created (server ms), None if it has none.
    created_ms: int | None
    #: Sessions currently owned (sum over the owner sets).
    live_sessions: int
    #: Owner tags holding live sessions, most sessions first.
    owners: tuple[str, ...]
    #: Owners of the run whose heartbeat deadline lies in the future.
    heartbeating: int
    #: Newest server time the run's control plane records: its creation, its last
    #: release event, a gate seal or install, or an owner's heartbeat deadline
    #: (counted up to now while it lies in the future).
    last_activity_ms: int | None
    #: Control-plane keys (``ts:{R}:*``) and their memory on the server (bytes,
    #: ``MEMORY USAGE`` with its default sampling of large aggregates).
    control_keys: int
    control_bytes: int
    #: The server clock when this was read (ms), to show ages.
    server_ms: int
    #: The run's counters (``store.stats()``): sessions opened and released, ever.
    sessions_opened: int = 0
    sessions_released: int = 0


@dataclass(frozen=True)
class RunDeleted:
    """What :func:`delete_run` removed."""

    run: str
    #: Control-plane keys removed (``ts:{R}:*``, the meta record last).
    control_keys: int
    #: Data-plane keys removed (``ts:{R/sid}:*``).
    data_keys: int
    #: Sessions whose data was removed.
    sessions: int
    #: Owners that held live sessions and were overridden with ``force=True``.
    forced_owners: tuple[str, ...] = ()
    #: Turn counter shards removed (``ts:{R|<tag>}:turns``, one per slot that counted turns).
    turn_shards: int = 0
    #: False when the run had no meta record (its keys were removed with ``force=True``).
    had_record: bool = True


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run on the server, whether or not its record ``ts:{R}:meta`` exists.

    A run whose record is gone while keys remain (the server restarted or
    was flushed, and a client that outlived it wrote again) is no run for
    the commands that list runs; these counts are what ``tracestore run
    delete R --force`` would remove.
    """

    run: str
    #: True when the run's meta record exists.
    has_record: bool
    #: Control-plane keys (``ts:{R}:*``, the meta record included when present).
    control_keys: int
    #: Data-plane keys (``ts:{R/sid}:*``) and the sessions they belong to.
    data_keys: int
    sessions: int
    #: Turn counter shards (``ts:{R|<tag>}:turns``).
    turn_shards: int

    @property
    def total(self) -> int:
        """Every key of the run."""
        return self.control_keys + self.data_keys + self.turn_shards

    def describe(self) -> str:
        """``12 control keys, 42 data keys of 14 sessions, 3 turn counter shards`` (for messages)."""
        return (
            f"{self.control_keys} control keys, {self.data_keys} data keys of {self.sessions} "
            f"sessions, {self.turn_shards} turn counter shards"
        )


def run_keys(ctx: Context) -> Op[RunKeys]:
    """Count the keys of the store's run (:class:`RunKeys`), with or without its record.

    Reads only: a SCAN of every primary per key family (control plane,
    sessions' data, turn counter shards) and one EXISTS.
    """
    k = ctx.keys
    control = [key for key in (yield ScanAll(k.control_pattern, count=1000)) if k.control_suffix(key)]
    data = [key for key in (yield ScanAll(k.data_pattern, count=1000)) if k.sid_of_data_key(key)]
    shards = yield ScanAll(k.turn_shard_pattern, count=1000)
    has = yield Cmd(("EXISTS", k.meta), key=k.meta)
    return RunKeys(
        run=k.run,
        has_record=bool(int(has)),
        control_keys=len(control),
        data_keys=len(data),
        sessions=len({k.sid_of_data_key(key) for key in data}),
        turn_shards=len(shards),
    )


def run_ids(ctx: Context) -> Op[list[str]]:
    """Ids of the runs under the store's key prefix that this user may read, sorted.

    SCAN on every primary finds every run's meta record (SCAN shows every
    key name, whatever the ACL); a run whose meta record the server's ACL
    does not let this user read is left out (one EXISTS each, pipelined; one
    more round trip per run only when some are refused).
    """
    prefix = ctx.keys.prefix
    keys = yield ScanAll(meta_pattern(prefix), count=1000)
    runs = sorted({r for k in keys if (r := run_of_meta_key(k, prefix))})
    metas = [Keys(prefix, r).meta for r in runs]
    try:
        yield Batch(tuple(Cmd(("EXISTS", m), key=m) for m in metas))
        return runs
    except PermissionDenied:
        pass
    readable = []
    for run, meta in zip(runs, metas, strict=True):
        try:
            yield Cmd(("EXISTS", meta), key=meta)
        except PermissionDenied:
            continue
        readable.append(run)
    return readable


def _i(x: Any) -> int | None:
    if x is None:
        return None
    try:
        return int(float(text(x)))
    except ValueError:
        return None


def _summary(ctx: Context, run: str, now: int) -> Op[RunSummary]:
    k = Keys(ctx.keys.prefix, run)
    keys = [key for key in (yield ScanAll(k.control_pattern, count=1000)) if k.control_suffix(key)]
    tags = sorted({t for key in keys if (t := k.owner_of_key(key))})
    head = (
        Cmd(("HGET", k.meta, "created_ms"), key=k.meta),
        Cmd(("XREVRANGE", k.events, "+", "-", "COUNT", 1), key=k.events),
        Cmd(("HMGET", k.gate, "sealed_ms", "installed_ms"), key=k.gate),
        Cmd(("ZRANGE", k.owners, 0, -1, "WITHSCORES"), key=k.owners),
        Cmd(("HMGET", k.stats, "sessions_opened", "sessions_released"), key=k.stats),
    )
    sizes = tuple(Cmd(("SCARD", k.owner(t)), key=k.owner(t)) for t in tags)
    mem = tuple(Cmd(("MEMORY", "USAGE", key), key=key) for key in keys)
    replies = yield Batch(head + sizes + mem)
    h = len(head)
    created, last_event, gate_ms, beats, counts = replies[:h]
    held = sorted(
        ((t, int(n)) for t, n in zip(tags, replies[h : h + len(tags)], strict=True) if int(n)),
        key=lambda x: (-x[1], x[0]),
    )
    deadlines = [int(float(beats[i + 1])) for i in range(0, len(beats), 2)]
    times = [_i(created), *(_i(x) for x in gate_ms)]
    if last_event:  # a stream entry id starts with its server time in ms
        times.append(_i(text(last_event[0][0]).split("-", 1)[0]))
    times += [min(d, now) for d in deadlines]
    known = [t for t in times if t is not None]
    return RunSummary(
        run=run,
        created_ms=_i(created),
        live_sessions=sum(n for _, n in held),
        owners=tuple(t for t, _ in held),
        heartbeating=sum(1 for d in deadlines if d > now),
        last_activity_ms=max(known) if known else None,
        control_keys=len(keys),
        control_bytes=sum(int(x or 0) for x in replies[h + len(tags) :]),
        server_ms=now,
        sessions_opened=_i(counts[0]) or 0,
        sessions_released=_i(counts[1]) or 0,
    )


def list_runs(ctx: Context, runs: Sequence[str] | None = None) -> Op[list[RunSummary]]:
    """A :class:`RunSummary` of every run under the store's key prefix (or of ``runs``).

    Cost per run: one SCAN of ``ts:{R}:*`` (every primary; a Valkey 8 cluster
    scans only the run's slot) and one pipelined round trip.
    """
    names = list(runs) if runs is not None else (yield from run_ids(ctx))
    now = yield ServerTime(ctx.keys.meta)
    out: list[RunSummary] = []
    for run in names:
        out.append((yield from _summary(ctx, run, now)))
    return out


def live_owners(infos: Sequence[OwnerInfo], now_ms: int) -> list[OwnerInfo]:
    """Owners that hold sessions and may still be running.

    An owner counts as live unless gc declared it lost or its heartbeat
    deadline passed; an owner that never heart-beat cannot be told dead, so
    it counts as live. The replay buffer's tag (``replay``) is no process:
    groups waiting in the buffer do not keep a run alive.
    """
    return [
        o
        for o in infos
        if o.sessions
        and o.owner != REPLAY_OWNER
        and o.lost_ms is None
        and (o.deadline_ms is None or o.deadline_ms > now_ms)
    ]


def _unlink_cmds(keys: Sequence[str], cluster: bool) -> list[Cmd]:
    groups = (
        list(group_by_slot((key_slot(key), key) for key in keys).values()) if cluster else [list(keys)]
    )
    return [
        Cmd(("UNLINK", *part), key=part[0])
        for group in groups
        for part in chunks(group, KEY_CHUNK)
    ]


def delete_run(ctx: Context, *, force: bool = False) -> Op[RunDeleted]:
    """Delete every key of the store's run: its control plane and all its sessions' data.

    Refused with :class:`~tracestore.errors.RunInUse` while live owners (see
    :func:`live_owners`; the replay buffer is none) hold sessions, unless ``force=True``. Keys of other
    runs are never touched: SCAN patterns match only this run's keys, and
    each key is checked against the run's layout before it is deleted. Data
    keys are unlinked grouped by hash slot, then the control plane, its meta
    record last (an interrupted delete leaves the run listed; run it again).
    Idempotent: deleting a deleted run removes nothing. Cost: a SCAN of
    every primary per key family, one pipelined round trip per node.

    A run whose meta record is missing (the server restarted or was flushed
    while a client went on writing to it) is deleted the same way, but only
    with ``force=True``: without it, :class:`~tracestore.errors.RunRecordMissing`
    (with the counts of its keys) is raised when it still has keys
    (``RunDeleted.had_record`` is False after a forced delete of one).

    Not atomic against writers: a process still writing to the run after
    ``force=True`` recreates the keys it writes.
    """
    k = ctx.keys
    had_record = bool(int((yield Cmd(("EXISTS", k.meta), key=k.meta))))
    if not had_record and not force:
        left = yield from run_keys(ctx)
        if left.total:
            raise RunRecordMissing(
                k.run, left.control_keys, left.data_keys, left.sessions, left.turn_shards
            )
    infos = yield from owners(ctx)
    now = yield ServerTime(k.meta)
    live = live_owners(infos, now)
    if live and not force:
        raise RunInUse(k.run, [(o.owner, o.sessions) for o in live])
    data = [key for key in (yield ScanAll(k.data_pattern, count=1000)) if k.sid_of_data_key(key)]
    control = [key for key in (yield ScanAll(k.control_pattern, count=1000)) if k.control_suffix(key)]
    sessions = {k.sid_of_data_key(key) for key in data}
    # the turn counter's shards by name (all 16,384: no SCAN, and no pattern to trust)
    shards = _unlink_cmds(k.turn_shards(), ctx.cluster)
    cmds = _unlink_cmds(data, ctx.cluster) + _unlink_cmds([c for c in control if c != k.meta], ctx.cluster)
    replies = yield Batch(tuple(shards + cmds))
    if k.meta in control:
        yield Cmd(("UNLINK", k.meta), key=k.meta)
    return RunDeleted(
        run=k.run,
        control_keys=len(control),
        data_keys=len(data),
        sessions=len(sessions),
        forced_owners=tuple(o.owner for o in live),
        turn_shards=sum(int(r) for r in replies[: len(shards)]),
        had_record=had_record,
    )
