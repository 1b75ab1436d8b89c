"""What a resumed trainer does with what its killed processes left (no Ray needed)."""

from __future__ import annotations

from tracestore import TraceStore
from tracestore.trainer.housekeeping import StoreCounts, reclaim_dead_owners, store_counts


def test_reclaim_releases_dead_owners_resolves_their_leases_and_reopens_the_gate(
    store: TraceStore,
) -> None:
    store.open_sessions(["r1", "r2"], "rollout:w0.dead")
    store.open_sessions(["p1"], "producer.dead")
    store.open_sessions(["b1"], "replay")  # a buffered group's session: kept
    store.heartbeat("rollout:w0.dead", 60)  # the dead processes' heartbeats (not expired yet)
    store.heartbeat("producer.dead", 60)
    store.heartbeat("eval:1.dead", 60)  # heart-beat, holds nothing
    store.gate.admit("r1", "w0", 0.5)  # in flight when the worker died
    store.gate.seal()  # the learner died inside a weight update
    out = reclaim_dead_owners(store, lease_ttl_s=0.5)
    assert out["rollout:w0.dead"] == 2 and out["producer.dead"] == 1
    assert out["poisoned leases cleared"] == 1 and out["gate reopened"] == 1
    assert store.sessions() == ["b1"]
    st = store.gate.status()
    assert st.state == "open" and st.live == 0 and st.poisoned == 0
    # no heartbeat of a dead process is left for gc to report lost later
    assert store.redis.zcard(store.keys.owners) == 0
    counts = store_counts(store)
    assert counts == StoreCounts(opened=4, released=3, live=1, events=3)
    # a second pass finds nothing to do
    assert reclaim_dead_owners(store, lease_ttl_s=0.5) == {}
