"""What the trainer does with the store around the loop: count, reclaim after a crash, drain at the end.

These run in the driver process (no Ray needed), except
:func:`reclaim_lost_worker`, which the learner runs when a rollout worker
died with the run going on. The counts come from the run's exact counters
(``store.stats()``), never from what gc trims.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from tracestore import TraceStore
from tracestore.gc import release_lost_owner
from tracestore.purge import purge_sessions
from tracestore.replay import MAX_TAKE

from .config import TASK


@dataclass(frozen=True)
class StoreCounts:
    """Sessions opened, released and live, and release events: the run's counters on the server."""

    opened: int
    released: int
    live: int
    events: int


def store_counts(store: TraceStore) -> StoreCounts:
    """The run's session counts: its exact counters (``store.stats()``).

    Changed by the scripts that open and release, never by gc trimming the
    event stream or the tombstones, and carried by the store checkpoint, so
    they hold across gc during the run and across a resume. One round trip.
    """
    s = store.stats()
    return StoreCounts(
        opened=s.sessions_opened, released=s.sessions_released, live=s.sessions_live, events=s.release_events
    )


def reclaim_dead_owners(
    store: TraceStore, lease_ttl_s: float, keep: tuple[str, ...] = ("replay",)
) -> dict[str, int]:
    """After a crash: release what the dead processes' owner tags still hold; resolve their leases.

    Requests in flight when the processes died hold leases nobody will
    settle: they stay live until their deadline, then poison the gate. The
    resuming trainer knows those holders are dead, so it waits for the
    deadlines and clears the poison (a weight update is refused until then),
    and reopens a gate that a learner killed inside a weight update left sealed.
    The dead tags' heartbeats are dropped (``deregister``) once they hold
    nothing, so a later gc does not report them lost a second time.
    Returns sessions released per owner tag, plus ``poisoned leases cleared``
    and ``gate reopened`` when it did those.
    """
    out: dict[str, int] = {}
    for o in store.owners():
        if o.owner in keep:
            continue
        if o.sessions:
            out[o.owner] = len(store.release_owner(o.owner, "owner-lost"))
        if o.deadline_ms is not None:  # its process is dead: gc must not find a heartbeat to judge later
            store.deregister(o.owner)
    deadline = time.monotonic() + lease_ttl_s + 5.0
    st = store.gate.status()
    while st.live and time.monotonic() < deadline:
        time.sleep(0.2)
        st = store.gate.status()
    cleared = clear_dead_poison(store, "resumed-holders-restarted")
    if cleared:
        out["poisoned leases cleared"] = cleared
    st = store.gate.status()
    if st.state == "sealed":  # the learner died inside a weight update: nobody else reopens
        store.gate.reopen()
        out["gate reopened"] = 1
    return out


def clear_dead_poison(
    store: TraceStore, resolution: str, holders: Collection[str] | None = None
) -> int:
    """Clear the poisoned leases whose holders are known dead (all when ``holders`` is None).

    A poisoned lease is a request whose outcome is unknown; when its holder
    is dead, nothing more will come of it, so the poison is cleared with
    ``resolution``. Leases of other holders are left poisoned. Returns how
    many were cleared. Two round trips per 100 poisoned leases.
    """
    cleared = 0
    skip: set[str] = set()
    while True:
        ids = [p.lease_id for p in store.gate.status().poison if p.lease_id not in skip]
        if not ids:  # status() lists the poison set 100 at a time
            return cleared
        if holders is not None:
            records = store.gate.lease_records(ids)
            mine = {r.lease_id for r in records if r is not None and r.holder in holders}
            skip.update(i for i in ids if i not in mine)
            ids = [i for i in ids if i in mine]
            if not ids:
                continue
        got = store.gate.clear_poison(ids, resolution)
        cleared += len(got)
        if not got:
            return cleared


def reclaim_lost_worker(
    store: TraceStore, worker: str, lease_ttl_s: float, owner_ttl_s: float
) -> dict[str, int]:
    """A rollout worker died with the run going on: gc declares its tags lost, its leases are resolved.

    The worker heartbeats its owner tags (``rollout:<worker>.<nonce>``);
    once it is dead their deadlines pass, and gc's lost-owner script
    declares each one lost and releases what it still owns (reason
    ``owner-lost``, one event per session, exactly as ``tracestore gc``
    would). Its requests in flight hold leases nobody will settle: they are
    poisoned at their deadline, which blocks the next weight update, and
    since their holder is known dead the poison is cleared (the resuming
    logic of :func:`reclaim_dead_owners`, for this holder only). Waits for
    both deadlines: at most ``owner_ttl_s`` and ``lease_ttl_s`` from now,
    plus a margin. Returns ``owner tags declared lost``, ``sessions
    released (owner-lost)`` and ``poisoned leases cleared``.
    """
    leases_done_ms = store.gate.status().server_ms + int(lease_ttl_s * 1000)
    prefix = f"rollout:{worker}."
    tags = [
        o.owner for o in store.owners()
        if o.owner.startswith(prefix) and o.deadline_ms is not None and o.lost_ms is None
    ]
    end = time.monotonic() + max(owner_ttl_s, lease_ttl_s) + 10.0
    lost: list[str] = []
    released = 0
    while tags and time.monotonic() < end:
        for tag in list(tags):
            declared, ids = store.run(release_lost_owner(store.context, tag))
            if ids:  # as gc does: the control plane first, then the data
                store.run(purge_sessions(store.context, ids))
            if declared:
                lost.append(tag)
                released += len(ids)
                tags.remove(tag)
        if tags:
            time.sleep(0.2)
    while store.gate.status().server_ms < leases_done_ms and time.monotonic() < end:
        time.sleep(0.2)
    cleared = clear_dead_poison(store, f"holder-lost:{worker}", holders={worker})
    return {
        "owner tags declared lost": len(lost),
        "sessions released (owner-lost)": released,
        "poisoned leases cleared": cleared,
    }


def drain_run(store: TraceStore) -> dict[str, int]:
    """End of run: take what is left in the buffer (stale or not) and release every owner's sessions.

    Returns how many groups it took (``completed``, ``retry``) and sessions
    it released per owner (``released:<owner>``).
    """
    left: dict[str, int] = {}
    try:
        while got := store.replay.take(TASK, MAX_TAKE, owner="shutdown", at_most=True):  # no staleness bound
            left["completed"] = left.get("completed", 0) + len(got)
        for _ in range(100):
            claimed = store.replay.claim_retry(TASK, 64, "shutdown")
            if not claimed:
                break
            left["retry"] = left.get("retry", 0) + len(claimed)
    finally:
        for o in store.owners():
            if o.sessions:
                left[f"released:{o.owner}"] = len(store.release_owner(o.owner, "run-end"))
    return left
