"""Session affinity (DESIGN section 6) on real servers: stickiness, balance, moves, retirement."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests.conftest import connect_async
from tests.test_gate import dump_run
from tracestore import TraceStore
from tracestore.errors import InvalidId, InvalidInput, SessionRetired
from tracestore.router import retire, route_scope

EPS = ["ep-a", "ep-b", "ep-c", "ep-d"]


def test_concurrent_acquires_of_a_new_session_agree(store_factory: Any) -> None:
    stores = [store_factory() for _ in range(4)]
    routers = [s.router(EPS if i % 2 else list(reversed(EPS))) for i, s in enumerate(stores)]
    n_threads, sids = 12, [f"new-{i}" for i in range(8)]
    answers: dict[str, list[str]] = {sid: [] for sid in sids}
    lock = threading.Lock()
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        r = routers[t % len(routers)]
        for sid in sids:
            barrier.wait()
            ep = r.acquire(sid)
            with lock:
                answers[sid].append(ep)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for sid, eps in answers.items():
        assert len(eps) == n_threads and len(set(eps)) == 1, f"{sid} routed to {set(eps)}"
    table = routers[0].table(sids)
    assert table.routed == len(sids) and sum(table.load.values()) == len(sids)
    assert table.routes == {sid: answers[sid][0] for sid in sids}


def test_new_sessions_balance_across_entrypoints(store_factory: Any) -> None:
    stores = [store_factory() for _ in range(4)]
    placed: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(w: int) -> None:
        r = stores[w].router(EPS)
        for i in range(30):
            ep = r.acquire(f"bal-{w}-{i}")
            with lock:
                placed[ep] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # each placement is atomic and picks the least-loaded entrypoint: loads never differ by more than one
    assert sum(placed.values()) == 120 and set(placed.values()) == {30}
    assert stores[0].router(EPS).table().load == dict.fromkeys(EPS, 30)


def test_sticky_and_moved_when_its_entrypoint_is_removed(store: TraceStore) -> None:
    full = store.router(EPS)
    placed = {f"s{i}": full.acquire(f"s{i}") for i in range(8)}
    assert Counter(placed.values()) == Counter(dict.fromkeys(EPS, 2))
    for sid, ep in placed.items():
        route = full.acquire_route(sid)
        assert (route.entrypoint, route.how) == (ep, "sticky")
    # ep-d leaves: its sessions move to the least-loaded remaining ones, the others stay
    smaller = store.router(EPS[:3])
    for sid, ep in placed.items():
        route = smaller.acquire_route(sid)
        if ep == "ep-d":
            assert route.how == "moved" and route.previous == "ep-d" and route.entrypoint in EPS[:3]
        else:
            assert (route.entrypoint, route.how) == (ep, "sticky")
    table = smaller.table()
    assert "ep-d" not in table.load and sum(table.load.values()) == 8
    assert max(table.load.values()) - min(table.load.values()) <= 1
    # a moved session is sticky on its new entrypoint, also for the full router (ep-d is in its list)
    moved = [sid for sid, ep in placed.items() if ep == "ep-d"]
    for sid in moved:
        assert full.acquire_route(sid).how == "sticky"


def test_a_retried_retire_returns_its_first_reply(store: TraceStore) -> None:
    r = store.router(EPS)
    r.acquire("rt-1")
    req = next(retire(route_scope(store.context, EPS, retention_s=60), ["rt-1", "rt-2"]))  # one call, its reply lost
    first = store.execute(req)
    again = store.execute(req)  # redis-py re-sends the same scripts
    assert first == again
    assert [x.decode() if isinstance(x, bytes) else x for x in first[0]] == ["rt-1", "rt-2"]
    assert r.retire(["rt-1", "rt-2"]) == []  # a new call: nothing left to retire
    assert r.table().retired == 2


def test_retired_sessions_raise_session_retired_until_the_tombstone_expires(store: TraceStore) -> None:
    r = store.router(EPS, retention_s=4)  # the checks below take a few round trips, on a busy machine too
    a, b = r.acquire("old-a"), r.acquire("old-b")
    assert r.retire(["old-a", "never-routed"]) == ["old-a", "never-routed"]
    assert r.retire(["old-a"]) == []  # already retired: nothing changes
    for sid in ("old-a", "never-routed"):
        with pytest.raises(SessionRetired) as ei:
            r.acquire(sid)
        assert ei.value.sid == sid and "410" in str(ei.value)
    assert r.acquire("old-b") == b
    table = r.table(["old-a", "old-b", "never-routed"])
    assert table.routes == {"old-a": "!retired", "old-b": b, "never-routed": "!retired"}
    assert table.retired == 2 and table.routed == 1 and table.load.get(a, 0) == (1 if a == b else 0)
    time.sleep(4.1)
    route = r.acquire_route("old-a")  # the tombstone expired: the id can be placed afresh
    assert route.how == "new"
    assert r.table().retired == 0


def test_bad_input_is_refused_before_any_change(store: TraceStore) -> None:
    r = store.router(EPS)
    r.acquire("s1")
    r.retire(["gone"])
    before = dump_run(store)
    with pytest.raises(InvalidInput, match="at least one entrypoint"):
        store.router([])
    with pytest.raises(InvalidInput, match="duplicate"):
        store.router(["ep-a", "ep-a"])
    with pytest.raises(InvalidId):
        store.router(["has space"])
    with pytest.raises(InvalidInput, match="retention_s"):
        store.router(EPS, retention_s=-1)
    with pytest.raises(InvalidId):
        r.acquire("bad{sid}")
    with pytest.raises(InvalidId):
        r.retire(["ok", "bad sid"])
    with pytest.raises(SessionRetired):
        r.acquire("gone")
    assert dump_run(store) == before


def test_async_router(url: str, run_id: str, arun: Any) -> None:
    async def main() -> None:
        st = await connect_async(url, run_id)
        try:
            r = st.router(EPS)
            first = [await r.acquire(f"as{i}") for i in range(4)]
            assert sorted(first) == sorted(EPS)
            assert [await r.acquire(f"as{i}") for i in range(4)] == first
            assert await r.retire(["as0"]) == ["as0"]
            with pytest.raises(SessionRetired):
                await r.acquire("as0")
            assert (await r.table()).routed == 3
            with pytest.raises(InvalidInput):
                st.router([])
        finally:
            await st.close()

    arun(main())


def test_acquire_many_is_acquire_in_order_in_one_round_trip(store_factory: Any) -> None:
    from tests.test_scripts import _Counting

    a, b = store_factory(), store_factory()
    ra, rb = a.router(EPS), b.router(EPS)
    sids = [f"many-{i}" for i in range(10)]
    count = _Counting(a)
    got = ra.acquire_many(sids)
    assert len(count.requests) == 1
    assert got == [rb.acquire(s) for s in sids]  # sticky: the same answers one by one
    assert sorted(Counter(got).values()) == [2, 2, 3, 3]  # spread as one-by-one placements are
    ra.retire(sids[:1])
    with pytest.raises(SessionRetired):
        ra.acquire_many([*sids[1:3], sids[0], "many-new"])
    assert ra.table(["many-new"]).routes["many-new"] in EPS  # placed all the same
    with pytest.raises(InvalidId):
        ra.acquire_many(["ok", "bad id"])
    assert ra.table(["ok"]).routes.get("ok") is None  # refused before any I/O


def test_acquire_many_with_an_op_id_replays_its_placements(store: TraceStore) -> None:
    """Each sid's placement is recorded under the call's part: a call again replays them all."""
    r = store.router(EPS)
    sids = [f"opm-{i}" for i in range(6)]
    first = r.acquire_many(sids, op_id="route-step-1")
    assert r.acquire_many(sids, op_id="route-step-1") == first
    assert r.acquire(sids[0], op_id="route-step-1") == first[0]  # part 0: the call's own op key
    with pytest.raises(InvalidId):
        r.acquire_many(sids, op_id="bad id")
