"""Calls whose every reply is lost (issue 11 item 2): the caller learns the outcome with its op id.

A :class:`~tests._netcut.CutProxy` between the client and the server lets
each request reach the server (and run there) and drops every reply, the
retries' too, so redis-py gives up and the call raises OutcomeUnknown. The
tests then check what the server did, and that calling again with the
error's ``op_id`` returns the first reply without a second effect: a lost
``admit`` leaves no lease nobody can settle, a lost ``take`` hands over its
groups, a lost ``release`` its ids. Standalone (one proxy) and cluster (one
proxy per node); the other backends run the same engine.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest

from tests._netcut import CutProxy, proxied_cluster
from tests.test_ownership import data_purged, events, write_turn
from tracestore import AsyncTraceStore, LeaseFenced, OutcomeUnknown, TraceStore
from tracestore.replay import Group
from tracestore.servers import EmbeddedServer

Cut = tuple[TraceStore, Callable[[str], CutProxy]]


@pytest.fixture
def cut(backend: str, url: str, run_id: str) -> Iterator[Cut]:
    """A store whose replies pass through cutting proxies, and the proxy of a key's node."""
    if backend == "cluster":
        with proxied_cluster(url, run_id, retries=2) as pair:
            yield pair
        return
    if backend != "valkey":
        pytest.skip("runs on valkey and cluster (the other backends run the same engine)")
    u = urlparse(url)
    with CutProxy(u.hostname or "127.0.0.1", int(u.port or 6379)) as proxy:
        st = TraceStore.connect(proxy.url, run=run_id, retries=2)
        try:
            yield st, lambda key: proxy
        finally:
            st.close()


def test_lost_admit_leaves_no_lease_nobody_can_settle(cut: Cut) -> None:
    st, proxy_of = cut
    g = st.gate
    g.settle(g.admit("warm", "w", 30), "completed")  # scripts loaded, connection warm
    p = proxy_of(st.keys.gate)
    p.arm(times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        g.admit("s1", "worker-1", 30, op_id="adm-1")
    p.disarm()
    assert p.cuts >= 2  # the retries lost their replies too
    assert (ei.value.op_id, ei.value.lease_id) == ("adm-1", "adm-1")
    assert "adm-1" in str(ei.value)
    assert g.status().live == 1  # admitted on the server: a lease the caller never saw
    lease = g.admit("s1", "worker-1", 30, op_id="adm-1")  # the first reply, no second lease
    assert (lease.id, lease.sid) == ("adm-1", "s1")
    assert g.status().live == 1
    assert g.settle(lease, "completed").outcome == "completed"

    # without a caller's op id, the error names the lease id chosen before the call
    p.arm(times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        g.admit("s2", "worker-1", 30)
    p.disarm()
    lost = ei.value.lease_id
    assert lost is not None and lost == ei.value.op_id
    assert g.settle(lost, "aborted").lease_id == lost
    status = g.status()
    assert (status.live, status.poisoned) == (0, 0)
    with g.weight_update(1, drain_timeout_s=1):  # nothing is left to block a weight update
        pass
    assert g.status().version == 1

    # admit_many: every lease id is on the error
    p.arm(times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        g.admit_many([("a", "w"), ("b", "w")], 30, op_id="many-1")
    p.disarm()
    assert ei.value.lease_ids == ("many-1#0", "many-1#1")
    again = g.admit_many([("a", "w"), ("b", "w")], 30, op_id="many-1")
    assert [x.id for x in again] == ["many-1#0", "many-1#1"] and g.status().live == 2
    g.settle_many(again, "completed")


def _groups(st: TraceStore, n: int) -> list[Group]:
    out = []
    for i in range(n):
        sids = (f"g{i}.a", f"g{i}.b")
        st.open_sessions(list(sids), "rollout:p")
        g = Group(gid=f"g{i}", task="math", sids=sids, payload={"reward": i / 2})
        assert st.replay.put(g, "rollout:p").stored
        out.append(g)
    return out


def test_lost_take_hands_over_its_groups_on_the_second_call(cut: Cut) -> None:
    st, proxy_of = cut
    groups = _groups(st, 4)
    assert [x.gid for x in st.replay.take("math", 1, owner="train:0")] == ["g0"]  # warm
    n_events = len(events(st))
    p = proxy_of(st.keys.meta)
    # a take is one round trip (its commit); with declared keys the plan's reply arrives first
    p.arm(skip=1 if st.config.replay_declared_keys else 0, times=None)  # the commit's replies are lost
    with pytest.raises(OutcomeUnknown) as ei:
        st.replay.take("math", 2, owner="train:1", op_id="take-1")
    p.disarm()
    assert ei.value.op_id == "take-1" and p.cuts >= 2
    # the take committed: the groups left the buffer, their sessions are the taker's
    assert [x.gid for x in st.replay.groups("math")] == ["g3"]
    assert st.sessions("train:1") == ["g1.a", "g1.b", "g2.a", "g2.b"]
    got = st.replay.take("math", 2, owner="train:1", op_id="take-1")
    assert [(x.gid, x.task, x.sids, x.payload) for x in got] == [
        (g.gid, "math", g.sids, g.payload) for g in groups[1:3]
    ]
    assert [x.payload for x in got] == [{"reward": 0.5}, {"reward": 1.0}]
    # no second take: g3 is still there, nothing else moved, no event appended
    assert [x.gid for x in st.replay.groups("math")] == ["g3"]
    assert st.sessions("train:1") == ["g1.a", "g1.b", "g2.a", "g2.b"]
    assert len(events(st)) == n_events


def test_lost_release_returns_the_released_ids_on_the_second_call(cut: Cut) -> None:
    st, proxy_of = cut
    sids = [f"s{i}" for i in range(6)]
    st.open_sessions(sids, "train:1")
    for s in sids:
        write_turn(st, s)
    st.release(["warm"], "train:1")  # scripts loaded, connection warm
    p = proxy_of(st.keys.meta)
    p.arm(times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        st.release(sids[:3], "train:1", "consumed", op_id="rel-1")
    p.disarm()
    assert ei.value.op_id == "rel-1"
    # the release happened, and a call without the op id cannot tell which ids it released
    assert st.release(sids[:3], "train:1", "consumed") == []
    assert st.release(sids[:3], "train:1", "consumed", op_id="rel-1") == sids[:3]
    assert st.release(sids[:3], "train:1", "consumed", op_id="rel-1") == sids[:3]
    assert Counter(e["sid"] for e in events(st)) == Counter(sids[:3])
    assert all(data_purged(st, s) for s in sids[:3])  # the second call purged what the first left

    # the release's reply arrives, the purge's are lost: the ids are not lost with them
    sid = sids[3]
    data = proxy_of(st.keys.dead(sid))
    data.arm(skip=1 if data is p else 0, times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        st.release([sid], "train:1", "consumed")
    data.disarm()
    assert st.owner_of(sid) is None and st.release([sid], "train:1") == []  # released
    assert st.release([sid], "train:1", "consumed", op_id=ei.value.op_id) == [sid]
    assert data_purged(st, sid)

    # release_owner: the snapshot, then a lost release; the op id gives the ids back
    p.arm(skip=1, times=None)
    with pytest.raises(OutcomeUnknown) as ei:
        st.release_owner("train:1", "done", op_id="ro-1")
    p.disarm()
    assert st.sessions("train:1") == []
    assert sorted(st.release_owner("train:1", "done", op_id="ro-1")) == sids[4:]
    assert Counter(e["sid"] for e in events(st)) == Counter(sids)


def test_other_mutating_calls_replay_their_first_reply(cut: Cut) -> None:
    st, proxy_of = cut
    p = proxy_of(st.keys.meta)
    st.open_session("warm", "w")
    cases: list[tuple[str, Callable[[str], Any]]] = [
        ("open", lambda o: st.open_session("o1", "rollout:0", op_id=o)),
        ("transfer", lambda o: st.transfer(["o1"], "rollout:0", "replay", op_id=o)),
        ("install", lambda o: st.gate.install(7, op_id=o)),
        ("reopen", lambda o: st.gate.reopen(op_id=o)),
        ("acquire", lambda o: st.router(["e1", "e2"]).acquire_route("o1", op_id=o)),
        ("retire", lambda o: st.router(["e1", "e2"]).retire(["o1"], op_id=o)),
    ]
    st.gate.seal()
    for name, call in cases:
        op_id = f"{name}-1"
        p.arm(times=None)
        with pytest.raises(OutcomeUnknown) as ei:
            call(op_id)
        p.disarm()
        assert ei.value.op_id == op_id, name
        first = call(op_id)  # the first reply, not SessionExists / StaleVersion / a no-op
        assert call(op_id) == first, name
        if name == "transfer":
            assert first == ["o1"]
        if name == "install":
            assert first == 0  # the previous version
        if name == "acquire":
            assert first.how == "new"
        if name == "retire":
            assert first == ["o1"]
    assert st.owner_of("o1") == "replay" and st.gate.status().version == 7


def test_async_store_lost_release(backend: str, url: str, run_id: str, arun: Any) -> None:
    if backend != "valkey":
        pytest.skip("one backend suffices: the async store runs the same operations")
    u = urlparse(url)

    async def main() -> None:
        with CutProxy(u.hostname or "127.0.0.1", int(u.port or 6379)) as proxy:
            st = await AsyncTraceStore.connect(proxy.url, run=run_id, retries=2)
            try:
                await st.open_sessions(["a", "b"], "w")
                await st.release(["warm"], "w")
                proxy.arm(times=None)
                with pytest.raises(OutcomeUnknown) as ei:
                    await st.release(["a", "b"], "w", op_id="arel")
                proxy.disarm()
                assert ei.value.op_id == "arel"
                assert await st.release(["a", "b"], "w", op_id="arel") == ["a", "b"]
            finally:
                await st.close()

    arun(main())


def test_an_op_id_names_one_kind_of_call(store: TraceStore) -> None:
    from tracestore import InvalidId

    assert store.open_session("k1", "w", op_id="same") > 0
    # the same op id on another kind of call is another call: it runs, and replays its own reply
    assert store.release(["k1"], "w", op_id="same") == ["k1"]
    assert store.release(["k1"], "w", op_id="same") == ["k1"]
    assert store.open_session("k1", "w", op_id="same") > 0  # open's own first reply
    for bad in ("", "a#b", "has space", "{tag}", "x" * 129, 7, b"id"):
        with pytest.raises(InvalidId):
            store.release(["k1"], "w", op_id=bad)  # type: ignore[arg-type]


def _wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_readme_admit_recovery_works_whether_the_admit_ran_or_not() -> None:
    """README, "Lost replies": ``settle(err.lease_id, "aborted")`` after an admit's OutcomeUnknown,
    on a server paused with SIGSTOP so no reply comes (issue 31 item 5).

    It ran: the admit was on the server's socket when it froze and ran when it woke; the
    settle settles that lease. It never ran: the admit never left the client (its new
    connection's handshake timed out); the settle fences the id, and an admit with it
    arriving afterwards is refused, nothing admitted. A server of its own: it is paused.
    """
    with EmbeddedServer() as srv:
        # short timeouts only because these calls are meant to fail; no retries
        st = TraceStore.connect(srv.url, run="lost-admit", socket_timeout_s=0.3, retries=0)
        patient = TraceStore.connect(srv.url, run="lost-admit")
        try:
            g = st.gate
            g.settle(g.admit("warm", "w", 30), "completed")  # scripts loaded, one pooled connection
            # -- it ran: the request reached the frozen server and runs when it wakes
            srv.pause()
            try:
                with pytest.raises(OutcomeUnknown) as ei:
                    g.admit("s-ran", "worker-3", 120)
            finally:
                srv.resume()
            ran = ei.value.lease_id
            assert ran is not None
            _wait_for("the frozen admit to run", lambda: patient.gate.status().live == 1)
            # (the recovery through the client with normal timeouts: a just-woken server on a
            # loaded machine may take longer than 0.3 s to answer)
            receipt = patient.gate.settle(ran, "aborted")  # the README's recovery
            assert (receipt.lease_id, receipt.outcome, receipt.admitted) == (ran, "aborted", True)
            assert patient.gate.status().live == 0
            # -- it never ran: the admit never left (its connection's handshake timed out)
            st.redis.connection_pool.disconnect()
            srv.pause()
            try:
                with pytest.raises(OutcomeUnknown) as ei:
                    g.admit("s-never", "worker-3", 120)
            finally:
                srv.resume()
            never = ei.value.lease_id
            assert never is not None and never != ran
            receipt = patient.gate.settle(never, "aborted")  # the README's recovery: no UnknownLease
            assert (receipt.lease_id, receipt.outcome, receipt.admitted) == (never, "aborted", False)
            assert patient.gate.settle(never, "completed") == receipt  # settled once, like any lease
            # the admit arriving late (here: the same call again, same lease id) is refused
            with pytest.raises(LeaseFenced) as fenced:
                patient.gate.admit("s-never", "worker-3", 120, op_id=ei.value.op_id)
            assert fenced.value.lease_id == never
            status = patient.gate.status()
            assert (status.live, status.poisoned) == (0, 0)
            with patient.gate.weight_update(1, drain_timeout_s=1):  # nothing blocks an update
                pass
        finally:
            st.close()
            patient.close()
