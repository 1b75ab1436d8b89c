"""Exact run counters: ``store.stats()`` (``tracestore.run.stats``; DESIGN section 12, issue 12 item 2).

Each counter is changed in the same script as the state it counts, so the
tests drive every path that changes one (open, release, the replay buffer,
gc's owner loss, record_turn), retries included, and compare the counters
with what the server holds; then trim everything gc trims and check that
the counters did not move.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.conftest import connect_async
from tests.test_ownership import write_turn
from tracestore import Group, SessionExists, TraceStore
from tracestore.keys import key_slot
from tracestore.ownership import release_evals
from tracestore.run import RunStats
from tracestore.scripts import Batch
from tracestore.traces import PrefixMatch


def record(store: TraceStore, sid: str, turn: int, *, times: int = 1) -> list[int]:
    """Record turn ``turn`` of ``sid`` (each turn extends the last one) ``times`` times with the
    same arguments (a retry); returns the nodes each call wrote."""
    prompt = "".join(f"<user>q{i}</user><assistant>a{i}</assistant>" for i in range(turn)) + f"<user>q{turn}</user>"
    m = store.lookup(sid, prompt)
    return [
        store.record_turn(
            sid, prompt, f"<assistant>a{turn}</assistant>", prefix=m,
            delta_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], version=0,
        ).written
        for _ in range(times)
    ]


def test_a_new_run_counts_nothing(store: TraceStore) -> None:
    assert store.stats() == RunStats()
    assert store.stats().sessions_live == 0


def test_every_counter_follows_its_state(store: TraceStore) -> None:
    r, k = store.redis, store.keys
    store.open_session("a", "rollout:0")
    store.open_sessions([f"s{i}" for i in range(10)], "rollout:0")
    with pytest.raises(SessionExists):
        store.open_sessions(["s0", "new"], "rollout:0")  # all or nothing: counts nothing
    assert store.stats().sessions_opened == 11

    # turns: a new turn counts, a retried (equal) turn writes nothing and does not
    assert record(store, "a", 0) == [2]
    assert record(store, "a", 1) == [2]
    assert record(store, "a", 2, times=2) == [2, 0]
    assert store.stats().turns_recorded == 3

    # transfers count nothing; a release counts each session once, however often asked
    assert store.transfer(["s0", "s1", "s2"], "rollout:0", "train:1") == ["s0", "s1", "s2"]
    assert store.release(["s0", "s1", "s2", "s3"], "train:1") == ["s0", "s1", "s2"]
    assert store.release(["s0", "s1"], "train:1") == []
    st = store.stats()
    assert (st.sessions_released, st.release_events) == (3, 3)

    # the replay buffer: a stored put, a failed put (released, not stored), take, expire, claim
    rb = store.replay
    rb.put(Group("g3", "calc", ("s7",), "completed", min_version=5), owner="rollout:0")
    rb.put(Group("g1", "calc", ("s4", "s5"), "completed", min_version=0), owner="rollout:0")
    rb.put(Group("g2", "calc", ("s6",), "completed", min_version=0, retryable=True), owner="rollout:0")
    rb.put(Group("g4", "calc", ("s8",), "failed"), owner="rollout:0")
    assert [g.gid for g in rb.take("calc", 1, owner="train:2", current_version=5)] == ["g3"]
    rep = rb.expire(current_version=9, max_staleness=2)
    assert rep.kept == ("g2",) and rep.released_groups == ("g1",)
    assert [g.gid for g in rb.claim_retry("calc", 5, "rollout:1")] == ["g2"]
    st = store.stats()
    assert (st.groups_put, st.groups_taken, st.groups_expired, st.groups_claimed) == (3, 1, 2, 1)
    # released so far: s0..s2, s8 (failed group), s4 and s5 (expired, not retryable)
    assert (st.sessions_released, st.release_events) == (6, 6)
    assert st.sessions_opened == 11 and st.sessions_live == 5

    # the counters agree with the state the server holds
    assert r.xlen(k.events) == st.release_events and r.zcard(k.released) == st.sessions_released
    assert len(store.sessions()) == st.sessions_live


def test_gc_trims_state_never_counters(store: TraceStore) -> None:
    """Issue 12 item 1: gc trimmed events and tombstones, and the accounting broke. Not any more."""
    r, k = store.redis, store.keys
    sids = [f"s{i}" for i in range(20)]
    store.open_sessions(sids, "rollout:0")
    for s in sids[:5]:
        write_turn(store, s)
    store.heartbeat("rollout:0", 0.05)
    time.sleep(0.15)
    report = store.gc()  # the owner is lost: its 20 sessions are released by gc
    assert len(report.sessions_released) == 20
    before = store.stats()
    assert (before.sessions_opened, before.sessions_released, before.release_events) == (20, 20, 20)
    assert before.turns_recorded == 5
    time.sleep(0.05)
    report = store.gc(tombstone_retention_s=0, event_retention_s=0)
    assert report.tombstones_trimmed == 20 and report.events_trimmed == 20
    assert r.xlen(k.events) == 0 and r.zcard(k.released) == 0
    assert store.stats() == before


def test_a_retried_script_counts_once(store: TraceStore) -> None:
    """The op record replays a retried call's reply before anything is written or counted."""
    sids = [f"s{i}" for i in range(5)]
    store.open_sessions(sids, "train:1")
    evals = release_evals(store.context, sids, "train:1", "consumed")
    first = store.execute(Batch(tuple(evals)))
    again = store.execute(Batch(tuple(evals)))  # the same op ids: what redis-py sends on a retry
    assert first == again
    st = store.stats()
    assert (st.sessions_released, st.release_events) == (5, 5)
    assert store.redis.xlen(store.keys.events) == 5


def test_racing_releases_and_turns_stay_exact(store_factory: Any) -> None:
    stores = [store_factory() for _ in range(6)]
    sids = [f"s{i}" for i in range(300)]
    stores[0].open_sessions(sids, "train:1")
    got: list[list[str]] = []
    lock = threading.Lock()

    def releaser(st: TraceStore, i: int) -> None:
        mine = st.release(sids[i::2] + sids[::3], "train:1") if i % 2 else st.release_owner("train:1")
        with lock:
            got.append(mine)

    def writer(st: TraceStore, i: int) -> None:
        for s in sids[i * 50 : (i + 1) * 50]:
            st.record_turn(
                f"w-{s}", f"<user>{s}</user>", "<assistant>x</assistant>", prefix=PrefixMatch(0, [], None),
                delta_token_ids=[1], response_token_ids=[2], response_logprobs=[-1.0], version=0,
            )

    threads = [threading.Thread(target=releaser, args=(st, i)) for i, st in enumerate(stores[:4])]
    threads += [threading.Thread(target=writer, args=(st, i)) for i, st in enumerate(stores[4:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(x for g in got for x in g) == sorted(sids)  # each released once
    st = stores[0].stats()
    assert (st.sessions_opened, st.sessions_released, st.release_events, st.turns_recorded) == (300, 300, 300, 100)


def test_turn_shards_sit_in_the_slot_of_the_session(store: TraceStore) -> None:
    k = store.keys
    for i in range(200):
        sid = f"sess-{i}"
        assert key_slot(k.turn_shard(sid)) == key_slot(k.idx(sid))
    write_turn(store, "one")
    assert int(store.redis.get(k.turn_shard("one"))) == 1
    assert k.turn_shard("one") in k.turn_shards()


def test_async_stats(store: TraceStore, url: str, arun: Any) -> None:
    store.open_sessions(["a", "b"], "train:1")
    store.release(["a"], "train:1")
    write_turn(store, "b")

    async def main() -> RunStats:
        a = await connect_async(url, store.run_id)
        try:
            return await a.stats()
        finally:
            await a.close()

    st = arun(main())
    assert st == store.stats()
    assert (st.sessions_opened, st.sessions_released, st.turns_recorded) == (2, 1, 1)
