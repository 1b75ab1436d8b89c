"""Replay buffer (DESIGN section 7) on real servers: put, take, claim_retry, expire, count."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tests.conftest import connect_async
from tracestore import InvalidId, InvalidInput, NotOwner, SessionReleased, TraceStore
from tracestore.errors import GroupExists
from tracestore.replay import REPLAY_OWNER, Group
from tracestore.replies import text

PRODUCER = "rollout:p"


def _group(store: TraceStore, gid: str, *, task: str = "math", nsess: int = 2, owner: str = PRODUCER,
           **kw: Any) -> Group:
    sids = tuple(f"{gid}.s{i}" for i in range(nsess))
    store.open_sessions(list(sids), owner)
    return Group(gid=gid, task=task, sids=sids, **kw)


def _put(store: TraceStore, gid: str, **kw: Any) -> Group:
    owner = kw.pop("owner", PRODUCER)
    g = _group(store, gid, owner=owner, **kw)
    res = store.replay.put(g, owner)
    assert res.stored == (g.status not in ("failed", "filtered"))
    return g


def _events(store: TraceStore) -> list[dict[str, str]]:
    out = []
    for _id, fields in store.redis.xrange(store.keys.events):
        out.append({k.decode(): v.decode() for k, v in fields.items()})
    return out


def _snapshot(store: TraceStore) -> dict[str, Any]:
    """Everything a replay call may change, to prove that a refused (or no-op) call wrote nothing."""
    r = store.redis
    k = store.keys
    snap: dict[str, Any] = {
        "events": r.xlen(k.events), "seq": r.get(k.rb_seq), "bytes": r.hgetall(k.rb_bytes),
        "groups": r.hgetall(k.rb_groups), "sids": r.hgetall(k.rb_sids), "payloads": r.hgetall(k.rb_payloads),
    }
    for owner in (PRODUCER, REPLAY_OWNER, "train:0"):
        snap[owner] = sorted(r.smembers(k.owner(owner)))
    for t in sorted(x.decode() for x in r.smembers(k.rb_tasks)):
        for s in ("completed", "aborted", "expired"):
            snap[f"{t}:{s}"] = r.zrange(k.rb_queue(t, s), 0, -1, withscores=True)
            snap[f"{t}:{s}:v"] = r.zrange(k.rb_versions(t, s), 0, -1, withscores=True)
    return snap


def test_put_then_take_moves_sessions(store: TraceStore) -> None:
    g1 = _put(store, "g1", payload={"rewards": [1.0, 0.0]}, min_version=3)
    g2 = _put(store, "g2")
    assert store.sessions(REPLAY_OWNER) == sorted(g1.sids + g2.sids)
    assert store.sessions(PRODUCER) == []
    assert store.replay.count() == 2 and store.replay.count("math", "completed") == 2
    taken = store.replay.take("math", 1, owner="train:0", current_version=3)
    assert [g.gid for g in taken] == ["g1"]
    got = taken.groups[0]
    assert got == g1 and got.payload == {"rewards": [1.0, 0.0]} and got.seq == 1
    assert all(store.owner_of(s) == "train:0" for s in g1.sids)
    assert all(store.owner_of(s) == REPLAY_OWNER for s in g2.sids)
    assert store.replay.count() == 1
    # a taken gid is gone from the buffer; nothing else changed
    for h in (store.keys.rb_groups, store.keys.rb_sids, store.keys.rb_payloads):
        assert store.redis.hkeys(h) == [b"g2"]


def test_concurrent_producers_and_learners(store_factory: Any) -> None:
    producers, per_producer, learners, n = 3, 24, 2, 4
    total = producers * per_producer
    taken: list[tuple[str, Group]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    done_putting = threading.Event()

    def produce(p: int) -> None:
        st = store_factory()
        try:
            for i in range(per_producer):
                _put(st, f"p{p}-g{i}", owner=f"rollout:{p}", min_version=i % 3)
        except BaseException as exc:
            errors.append(exc)

    def learn(j: int) -> None:
        st = store_factory()
        owner = f"train:{j}"
        try:
            while True:
                with lock:
                    if len(taken) >= total:
                        return
                got = st.replay.take("math", n, owner=owner, policy="staleness" if j % 2 else "fifo")
                if not got:
                    if done_putting.is_set() and st.replay.count("math") < n:
                        return
                    continue
                with lock:
                    taken.extend((owner, g) for g in got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=learn, args=(j,)) for j in range(learners)]
    for t in threads:
        t.start()
    for t in threads[:producers]:
        t.join(60)
    done_putting.set()
    for t in threads[producers:]:
        t.join(60)
    assert not errors, errors
    gids = [g.gid for _, g in taken]
    assert len(gids) == len(set(gids)), "a group was taken twice"
    assert len(gids) == total, f"lost {total - len(gids)} groups"
    st = store_factory()
    states = st.session_states([s for _, g in taken for s in g.sids])
    for owner, g in taken:
        assert all(states[s] == (owner, "live") for s in g.sids)
    assert st.replay.count() == 0 and st.sessions(REPLAY_OWNER) == []


# current version 8, one sync advances the version by 4: the previous sync's
# groups have staleness 4, a group spanning the two syncs has min_version 4..7.
VERSIONS = {"v8": 8, "v7": 7, "v5": 5, "v4": 4, "v3": 3, "v0": 0}


@pytest.mark.parametrize(
    ("max_staleness", "ready"),
    [(0, ["v8"]), (3, ["v8", "v7", "v5"]), (4, ["v8", "v7", "v5", "v4"]), (8, list(VERSIONS))],
)
def test_staleness_boundaries(store: TraceStore, max_staleness: int, ready: list[str]) -> None:
    for gid, v in VERSIONS.items():
        _put(store, gid, min_version=v, retryable=False)
    short = store.replay.take("math", len(ready) + 1, owner="train:0", current_version=8,
                              max_staleness=max_staleness)
    assert not short and short.ready == len(ready)
    # a short take takes nothing but expires the stale groups all the same (issue 29)
    stale = [g for g in VERSIONS if g not in ready]
    assert sorted(short.released) == sorted(f"{g}.s{i}" for g in stale for i in range(2))
    assert [g.gid for g in store.replay.groups("math")] == ready
    got = store.replay.take("math", len(ready), owner="train:0", current_version=8,
                            max_staleness=max_staleness)
    assert [g.gid for g in got] == ready and got.released == ()  # FIFO among the ready ones
    assert store.replay.count() == 0
    assert all(g.staleness(8) <= max_staleness for g in got)


def test_staleness_order_is_oldest_version_then_fifo(store: TraceStore) -> None:
    for gid, v in [("a", 5), ("b", 3), ("c", 5), ("d", 3), ("e", 4)]:
        _put(store, gid, min_version=v)
    got = store.replay.take("math", 5, owner="train:0", policy="staleness")
    assert [g.gid for g in got] == ["b", "d", "e", "a", "c"]
    for gid, v in [("f", 5), ("g", 3), ("h", 4)]:
        _put(store, gid, min_version=v)
    got = store.replay.take("math", 3, owner="train:0")
    assert [g.gid for g in got] == ["f", "g", "h"]


def test_expiry_never_reorders(store: TraceStore) -> None:
    versions = [9, 2, 8, 1, 9, 3, 7, 0, 8, 2]
    for i, v in enumerate(versions):
        _put(store, f"g{i}", min_version=v, retryable=bool(i % 2))
    rep = store.replay.expire(10, 3)  # stale: min_version < 7
    stale = [f"g{i}" for i, v in enumerate(versions) if v < 7]
    assert sorted(rep.kept + rep.released_groups) == sorted(stale)
    retry = [g for g in stale if int(g[1:]) % 2]
    assert rep.kept == tuple(sorted(retry, key=lambda g: (versions[int(g[1:])], int(g[1:]))))  # oldest first
    remaining = [g.gid for g in store.replay.groups("math")]
    assert remaining == [f"g{i}" for i, v in enumerate(versions) if v >= 7]
    staleness = [g.gid for g in store.replay.take("math", 5, owner="train:0", policy="staleness")]
    assert staleness == ["g6", "g2", "g8", "g0", "g4"]
    claimed = store.replay.claim_retry("math", 10, PRODUCER)
    assert [g.gid for g in claimed] == [g for g in stale if int(g[1:]) % 2]  # put order
    assert all(g.status == "expired" for g in claimed)


def test_short_take_changes_nothing(store: TraceStore) -> None:
    for i in range(3):
        _put(store, f"g{i}", min_version=i)
    before = _snapshot(store)
    got = store.replay.take("math", 4, owner="train:0")
    assert not got and got.ready == 3 and len(got) == 0
    got = store.replay.take("other-task", 1, owner="train:0")
    assert not got and got.ready == 0
    assert _snapshot(store) == before
    assert store.replay.count() == 3


def test_non_retryable_expiry_releases_with_one_event_each(store: TraceStore) -> None:
    _put(store, "old-r", min_version=0, retryable=True, nsess=3)
    _put(store, "old-n", min_version=0, retryable=False, nsess=3)
    _put(store, "new", min_version=5)
    events0 = len(_events(store))
    rep = store.replay.expire(5, 2)
    again = store.replay.expire(5, 2)  # nothing left to expire
    assert again.expired == 0
    assert rep.kept == ("old-r",) and rep.released_groups == ("old-n",)
    ev = _events(store)[events0:]
    assert Counter(e["sid"] for e in ev) == {f"old-n.s{i}": 1 for i in range(3)}
    assert {e["reason"] for e in ev} == {"expired"} and {e["owner"] for e in ev} == {REPLAY_OWNER}
    for i in range(3):
        assert store.owner_of(f"old-r.s{i}") == REPLAY_OWNER
        assert store.owner_of(f"old-n.s{i}") is None
        assert store.redis.exists(store.keys.dead(f"old-n.s{i}"))
    assert store.replay.count("math", "expired") == 1 and store.replay.count("math", "completed") == 1
    with pytest.raises(SessionReleased):
        store.export_training_trace("old-n.s0", "x")
    # overriding the groups' own flag
    _put(store, "old-2", min_version=1, retryable=True)
    rep = store.replay.expire(5, 2, retryable=False)
    assert rep.released_groups == ("old-2",)


def test_take_expires_first(store: TraceStore) -> None:
    _put(store, "stale-r", min_version=1, retryable=True)
    _put(store, "stale-n", min_version=1, retryable=False)
    _put(store, "fresh", min_version=6)
    events0 = len(_events(store))
    got = store.replay.take("math", 1, owner="train:0", current_version=6, max_staleness=2)
    assert [g.gid for g in got] == ["fresh"]
    assert got.expired == ("stale-r",) and sorted(got.released) == ["stale-n.s0", "stale-n.s1"]
    assert len(_events(store)) == events0 + 2
    assert store.replay.count("math", "expired") == 1


def test_failed_and_filtered_put_release_at_once(store: TraceStore) -> None:
    for status in ("failed", "filtered"):
        g = _group(store, f"g-{status}", nsess=3, status=status)
        store.redis.hset(store.keys.idx(g.sids[0]), "x", "1")
        res = store.replay.put(g, PRODUCER)
        assert not res.stored and sorted(res.released) == sorted(g.sids)
        ev = [e for e in _events(store) if e["sid"] in g.sids]
        assert len(ev) == 3 and {e["reason"] for e in ev} == {status}
        assert all(store.owner_of(s) is None for s in g.sids)
        assert not store.redis.exists(store.keys.idx(g.sids[0]))
    assert store.replay.count() == 0
    assert store.redis.hlen(store.keys.rb_groups) == 0


def test_claim_retry_of_aborted_groups(store: TraceStore) -> None:
    _put(store, "a1", status="aborted", retryable=True)
    _put(store, "c1")
    _put(store, "a2", status="aborted", retryable=True)
    assert store.replay.take("math", 2, owner="train:0").ready == 1  # aborted is not ready
    claimed = store.replay.claim_retry("math", 5, "rollout:q")
    assert [g.gid for g in claimed] == ["a1", "a2"] and all(g.status == "aborted" for g in claimed)
    assert store.sessions("rollout:q") == sorted(claimed[0].sids + claimed[1].sids)
    assert store.replay.claim_retry("math", 5, "rollout:q") == []
    # the producer finishes the rollouts and puts the group again, completed
    g = claimed[0]
    store.replay.put(Group(g.gid, g.task, g.sids, min_version=2), "rollout:q")
    assert [x.gid for x in store.replay.groups("math")] == ["c1", "a1"]


def test_bad_input_writes_nothing(store_factory: Any) -> None:
    store = store_factory(replay_payload_bytes=100)
    _put(store, "g0")
    g = _group(store, "g1")
    before = _snapshot(store)
    bad = [
        (Group("g1", "math", g.sids, status="done"), PRODUCER, InvalidInput),
        (Group("g1", "math", g.sids, payload={"x": "y" * 200}), PRODUCER, InvalidInput),
        (Group("g1", "math", g.sids, payload={"x": object()}), PRODUCER, InvalidInput),
        (Group("g1", "math", g.sids, min_version=-1), PRODUCER, InvalidInput),
        (Group("g1", "math", (g.sids[0], g.sids[0])), PRODUCER, InvalidInput),
        (Group("g1", "math", ()), PRODUCER, InvalidInput),
        (Group("g 1", "math", g.sids), PRODUCER, InvalidId),
        (Group("g1", "math", g.sids), "rollout:other", NotOwner),
        (Group("g1", "math", (*g.sids, "never-opened")), PRODUCER, NotOwner),
        (Group("g0", "math", g.sids), PRODUCER, GroupExists),
        (Group("g1", "math", ("g0.s0",)), PRODUCER, NotOwner),  # owned by the buffer now
    ]
    for group, owner, err in bad:
        with pytest.raises(err):
            store.replay.put(group, owner)
        assert _snapshot(store) == before, group
    with pytest.raises(InvalidInput):
        store.replay.take("math", -1, owner="train:0")
    with pytest.raises(InvalidInput):
        store.replay.take("math", 2001, owner="train:0")  # MAX_TAKE per call
    with pytest.raises(InvalidInput):
        store.replay.take_many({"math": 1500, "code": 501}, owner="train:0")  # in all
    with pytest.raises(InvalidInput):
        store.replay.claim_retry("math", 2001, PRODUCER)
    with pytest.raises(InvalidInput):
        store.replay.expire(5, 1, statuses=("expired",))
    with pytest.raises(InvalidInput):
        store.replay.put(Group("g1", "math", g.sids, retryable="yes"), PRODUCER)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        store.replay.put(Group("g1", "math", g.sids, agentic=1), PRODUCER)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        store.replay.take("math", 1, owner="train:0", policy="lifo")
    with pytest.raises(InvalidInput):
        store.replay.take("math", 1, owner="train:0", max_staleness=1)  # no current_version
    with pytest.raises(InvalidInput):
        store.replay.count(status="failed")
    store.release([g.sids[1]], PRODUCER)
    with pytest.raises(SessionReleased):
        store.replay.put(g, PRODUCER)
    assert store.replay.count() == 1


def test_async_replay(url: str, run_id: str, arun: Any, store: TraceStore) -> None:
    g = _group(store, "g1")

    async def go() -> Any:
        st = await connect_async(url, run_id)
        try:
            res = await st.replay.put(g, PRODUCER)
            n = await st.replay.count()
            taken = await st.replay.take("math", 1, owner="train:a")
            return res, n, taken
        finally:
            await st.close()

    res, n, taken = arun(go())
    assert res.stored and n == 1 and [x.gid for x in taken] == ["g1"]
    assert store.owner_of(g.sids[0]) == "train:a"


def test_stats(store: TraceStore) -> None:
    _put(store, "g0", min_version=4, payload={"r": 1})
    _put(store, "g1", min_version=2)
    _put(store, "a0", task="code", status="aborted", min_version=1)
    cells = {(c.task, c.status): c for c in store.replay.stats()}
    assert cells["math", "completed"].groups == 2 and cells["math", "completed"].oldest_version == 2
    assert cells["math", "completed"].bytes > 0
    assert cells["code", "aborted"].groups == 1 and cells["code", "completed"].groups == 0
    assert cells["code", "completed"].oldest_version is None and cells["code", "completed"].bytes == 0
    store.replay.take("math", 2, owner="train:0")
    cells = {(c.task, c.status): c for c in store.replay.stats("math")}
    assert cells["math", "completed"].bytes == 0


def test_retried_calls_replay_their_reply(store_factory: Any) -> None:
    """A call redis-py resends after a lost reply gets the first reply back, with no second effect."""
    from tracestore import replay as rb

    for declared in (False, True):
        store = store_factory(replay_declared_keys=declared)
        g = _group(store, f"g{int(declared)}", min_version=0)
        gen = rb.put(store.context, g, PRODUCER)
        store.execute(next(gen))  # the traces' versions (read only)
        ev = gen.send([[0, -1, 0]] * len(g.sids))
        first = store.execute(ev)
        assert store.execute(ev) == first  # resent: same reply, no GroupExists, no second seq
        assert store.replay.count() == 1
        gen = rb.take(store.context, "math", 1, owner=f"train:{int(declared)}")
        req = next(gen)
        if declared:  # with declared keys the first call only plans
            plan = store.execute(req)
            assert text(plan[0]) == "NEED"
            req = gen.send(plan)
        done = store.execute(req)
        assert text(done[0]) == "OK"
        assert store.execute(req) == done
        assert store.owner_of(g.sids[0]) == f"train:{int(declared)}" and store.replay.count() == 0
    assert store.redis.get(store.keys.rb_seq) == b"2"


def test_lost_owner_cannot_take_or_claim(store: TraceStore) -> None:
    import time

    from tracestore.errors import OwnerLost

    _put(store, "g1")
    _put(store, "a1", status="aborted", retryable=True)
    store.heartbeat("train:gone", 0.05)
    time.sleep(0.1)
    store.gc()
    before = _snapshot(store)
    with pytest.raises(OwnerLost):
        store.replay.take("math", 1, owner="train:gone")
    with pytest.raises(OwnerLost):
        store.replay.claim_retry("math", 1, "train:gone")
    assert _snapshot(store) == before


def test_take_behind_a_large_stale_backlog(store: TraceStore) -> None:
    """More stale groups than one take may expire: expired first in batches, then taken."""
    from tracestore import replay as rb
    from tracestore.scripts import Batch

    stale = [Group(f"old{i}", "math", (f"old{i}.s",), min_version=0, retryable=i % 2 == 0) for i in range(2100)]
    store.open_sessions([g.sids[0] for g in stale], PRODUCER)
    store.execute(Batch(tuple(rb.put_request(store.context, g, PRODUCER) for g in stale)))
    _put(store, "fresh", min_version=9)
    got = store.replay.take("math", 1, owner="train:0", current_version=9, max_staleness=1)
    assert [g.gid for g in got] == ["fresh"]
    assert len(got.expired) == 1050 and len(got.released) == 1050
    assert store.replay.count("math", "expired") == 1050 and store.replay.count("math", "completed") == 0
    assert len(_events(store)) == 1050


def test_cut_connection_retries_replay_the_first_reply(backend: str, url: str, run_id: str) -> None:
    """The reply of put/take is lost after the script ran; redis-py's retry gets the same reply."""
    from urllib.parse import urlparse

    from tests._netcut import CutProxy

    u = urlparse(url)
    if backend == "cluster" or u.scheme != "redis" or u.password:
        pytest.skip("needs a plain redis:// URL of one node")
    with CutProxy(u.hostname or "127.0.0.1", int(u.port or 6379)) as proxy:
        st = TraceStore.connect(proxy.url, run=run_id, retries=3)
        try:
            for i in range(4):
                _put(st, f"g{i}")
            st.replay.take("math", 1, owner="train:0")  # warm-up: scripts loaded
            g = _group(st, "g9")
            proxy.arm(skip=1)  # the traces' versions arrive; put runs on the server, its reply is lost
            res = st.replay.put(g, PRODUCER)
            assert proxy.cuts == 1 and res.stored and res.seq == 5
            events0 = len(_events(st))
            proxy.arm()  # take is one script: its reply is lost
            got = st.replay.take("math", 2, owner="train:1")
            assert proxy.cuts == 2
            assert [x.gid for x in got] == ["g1", "g2"]
            assert [x.gid for x in st.replay.groups("math")] == ["g3", "g9"]
            assert len(_events(st)) == events0
        finally:
            st.close()


def test_put_many_puts_every_group_and_keeps_a_refused_one_apart(store: TraceStore) -> None:
    from tests.test_scripts import _Counting

    groups = [_group(store, f"pm{i}", payload={"i": i}) for i in range(5)]
    groups.append(_group(store, "pm-f", status="filtered"))
    count = _Counting(store)
    res = store.replay.put_many(groups, PRODUCER)
    # the traces' versions of all groups, then all the puts, then the purge of the filtered group's sessions
    assert len(count.requests) == 3
    assert [r.stored for r in res] == [True] * 5 + [False] and res[-1].released == groups[-1].sids
    assert [r.seq for r in res[:5]] == sorted(r.seq for r in res[:5])  # stored in the order given
    assert store.replay.count(task="math", status="completed") == 5
    again = [_group(store, "pm-new"), groups[0]]  # pm0 is stored already
    with pytest.raises(GroupExists):
        store.replay.put_many(again, PRODUCER)
    assert store.replay.count(task="math", status="completed") == 6  # pm-new went in all the same
    with pytest.raises(InvalidInput):
        store.replay.put_many([_group(store, "pm-x"), Group("pm-y", "math", ())], PRODUCER)
    assert store.replay.count(task="math", status="completed") == 6  # refused before any I/O


def test_put_many_with_an_op_id_replays_each_put(store: TraceStore) -> None:
    """A call again with the same op id and groups replays every put's first reply (main's op ids)."""
    groups = [_group(store, f"po{i}") for i in range(3)]
    first = store.replay.put_many(groups, PRODUCER, op_id="step-1/put")
    again = store.replay.put_many(groups, PRODUCER, op_id="step-1/put")  # not GroupExists
    assert [r.seq for r in again] == [r.seq for r in first] and all(r.stored for r in again)
    assert store.replay.count(task="math", status="completed") == 3
    # group 0 is recorded under the call's own op key: a put with that op id replays it too
    assert store.replay.put(groups[0], PRODUCER, op_id="step-1/put").seq == first[0].seq
    with pytest.raises(GroupExists):  # a fresh op id: the groups are stored already
        store.replay.put_many(groups[:1], PRODUCER)
    with pytest.raises(InvalidId):
        store.replay.put_many(groups, PRODUCER, op_id="bad#id")
