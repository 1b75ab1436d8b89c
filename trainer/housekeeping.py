"""What the driver does with the store around the loop: count, reclaim after a crash, drain at the end.

These run in the driver process (no Ray needed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tracestore import TraceStore
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
    cleared = 0
    while st.poison:  # status() lists the poison set 100 at a time
        got = store.gate.clear_poison([p.lease_id for p in st.poison], "resumed-holders-restarted")
        cleared += len(got)
        if not got:
            break
        st = store.gate.status()
    if cleared:
        out["poisoned leases cleared"] = cleared
    if st.state == "sealed":  # the learner died inside a weight update: nobody else reopens
        store.gate.reopen()
        out["gate reopened"] = 1
    return out


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
