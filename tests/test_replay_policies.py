"""Take policies on real servers: fifo, staleness and priority orders (issue 23, item 4).

``priority`` takes the groups with the highest ``payload["priority"]`` first,
in put order among equals, and the groups without a priority after every
group with one, in put order. Its index (``ts:{R}:rb:p:<task>:<status>``) is
kept by every script that moves groups: put, take (any policy), expire (and
the expiry inside a take), claim_retry, and a checkpoint restores it. These
tests check the orders, the ties, expiry together with priority, bad
priorities (refused before anything is written), the index after every
kind of move, and the checkpoint round trip.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tracestore import InvalidInput, TraceStore
from tracestore.replay import REPLAY_OWNER, Group
from tracestore.replay.policies import POLICIES
from tracestore.replies import text

PRODUCER = "rollout:p"

#: gid -> (min_version, priority or None), in put order.
BUFFER: dict[str, tuple[int, float | None]] = {
    "a": (5, 1), "b": (3, None), "c": (4, 7.5), "d": (3, 1), "e": (6, -2), "f": (4, None), "g": (5, 7.5),
}


def _put(store: TraceStore, gid: str, minv: int, prio: Any = None, task: str = "math", **kw: Any) -> Group:
    sids = (f"{gid}.s0", f"{gid}.s1")
    store.open_sessions(list(sids), PRODUCER)
    payload = {"rewards": [1.0, 0.0]}
    if prio is not None:
        payload["priority"] = prio
    g = Group(gid=gid, task=task, sids=sids, min_version=minv, payload=payload, **kw)
    assert store.replay.put(g, PRODUCER).stored
    return g


def _fill(store: TraceStore, task: str = "math") -> None:
    """Put BUFFER into ``task`` (gids are run-wide: another task's are ``<task>-<gid>``)."""
    for gid, (minv, prio) in BUFFER.items():
        _put(store, gid if task == "math" else f"{task}-{gid}", minv, prio, task=task)


def _priority_index(store: TraceStore, task: str, status: str) -> list[tuple[str, float]]:
    key = store.keys.rb_priorities(task, status)
    return [(text(m), float(s)) for m, s in store.redis.zrange(key, 0, -1, withscores=True)]


def _check_index(store: TraceStore, task: str = "math") -> None:
    """Every cell's priority index lists exactly its stored groups that have a priority."""
    for status in ("completed", "aborted", "expired"):
        want = sorted(
            (f"{g.seq:010d}:{g.gid}", -float(g.payload["priority"]) + 0.0)
            for g in store.replay.groups(task, status)
            if "priority" in g.payload
        )
        assert sorted(_priority_index(store, task, status)) == want, (task, status)


def test_policies_are_the_registry() -> None:
    assert list(POLICIES) == ["fifo", "staleness", "priority"]


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("fifo", ["a", "b", "c", "d", "e", "f", "g"]),
        ("staleness", ["b", "d", "c", "f", "a", "g", "e"]),
        # 7.5 (c before g: put order), 1 (a before d), -2, then the groups without one (b, f)
        ("priority", ["c", "g", "a", "d", "e", "b", "f"]),
    ],
)
def test_each_policy_takes_in_its_order(store: TraceStore, policy: str, order: list[str]) -> None:
    _fill(store)
    got: list[str] = []
    for n in (2, 1, 3, 1):  # in several takes: each continues where the last one stopped
        taken = store.replay.take("math", n, owner="train:0", policy=policy)
        assert len(taken) == n
        got += [g.gid for g in taken]
        _check_index(store)
    assert got == order
    assert store.replay.count() == 0 and _priority_index(store, "math", "completed") == []
    assert store.sessions("train:0") == sorted(f"{g}.s{i}" for g in BUFFER for i in range(2))


def test_priority_ties_are_put_order_and_numbers_compare_as_floats(store: TraceStore) -> None:
    prios = [3, 3.0, 10**6, -0.0, 0, 1e-9, 2.5, 3, -1e300, 1e300]
    for i, p in enumerate(prios):
        _put(store, f"t{i}", 0, p)
    got = [g.gid for g in store.replay.take("math", len(prios), owner="train:0", policy="priority")]
    want = sorted(range(len(prios)), key=lambda i: (-float(prios[i]), i))
    assert got == [f"t{i}" for i in want]
    assert got[:2] == ["t9", "t2"] and got[-1] == "t8"
    assert [g for g in got if g in ("t0", "t1", "t7")] == ["t0", "t1", "t7"]  # 3 == 3.0: put order
    assert [g for g in got if g in ("t3", "t4")] == ["t3", "t4"]  # -0.0 == 0: put order


def test_count_and_the_other_policies_ignore_priorities(store: TraceStore) -> None:
    _fill(store)
    assert store.replay.count() == len(BUFFER) and store.replay.count("math", "completed") == len(BUFFER)
    assert len(_priority_index(store, "math", "completed")) == 5  # b and f have none
    fifo = store.replay.take("math", 2, owner="train:0")  # a fifo take keeps the index too
    assert [g.gid for g in fifo] == ["a", "b"] and store.replay.count() == len(BUFFER) - 2
    _check_index(store)
    rest = store.replay.take("math", 5, owner="train:1", policy="priority")
    assert [g.gid for g in rest] == ["c", "g", "d", "e", "f"]


def test_priority_with_expiry(store: TraceStore) -> None:
    """Stale groups are expired first and never taken, however high their priority; a kept one
    carries its priority into the expired cell, and claim_retry takes it out of the index."""
    _put(store, "old-hi", 1, 100)  # retryable: kept as expired
    _put(store, "old-hi-drop", 1, 99, retryable=False)  # released
    _put(store, "new-lo", 9, 1)
    _put(store, "new-none", 9)
    _put(store, "new-hi", 8, 50)
    got = store.replay.take("math", 2, owner="train:0", current_version=9, max_staleness=2, policy="priority")
    assert [g.gid for g in got] == ["new-hi", "new-lo"]
    assert got.expired == ("old-hi",) and sorted(got.released) == ["old-hi-drop.s0", "old-hi-drop.s1"]
    assert [m for m, _ in _priority_index(store, "math", "expired")] == [f"{1:010d}:old-hi"]
    _check_index(store)
    # a short priority take expires too (issue 29), with the priority carried over
    _put(store, "old-2", 3, 5)
    short = store.replay.take("math", 2, owner="train:0", current_version=9, max_staleness=2, policy="priority")
    assert not short and short.ready == 1 and short.expired == ("old-2",)
    assert [g.gid for g in store.replay.groups("math", "expired")] == ["old-hi", "old-2"]
    _check_index(store)
    # expire(): the same upkeep
    _put(store, "old-3", 2, -4, status="aborted")
    rep = store.replay.expire(9, 2, statuses=("aborted",))
    assert rep.kept == ("old-3",) and _priority_index(store, "math", "aborted") == []
    _check_index(store)
    claimed = store.replay.claim_retry("math", 10, PRODUCER)
    assert [g.gid for g in claimed] == ["old-hi", "old-2", "old-3"]
    assert claimed[0].payload["priority"] == 100
    assert _priority_index(store, "math", "expired") == [] and store.replay.count("math", "expired") == 0
    _check_index(store)
    # put again by the producer, it is indexed again under its new seq
    g = claimed[0]
    assert store.replay.put(Group(g.gid, "math", g.sids, payload=g.payload, min_version=9), PRODUCER).stored
    assert [g.gid for g in store.replay.take("math", 2, owner="train:1", policy="priority")] == ["old-hi", "new-none"]


def test_put_stale_at_put_and_aborted_groups_are_indexed_in_their_cell(store: TraceStore) -> None:
    store.open_sessions(["x.s0"], PRODUCER)
    res = store.replay.put(Group("x", "math", ("x.s0",), min_version=1, payload={"priority": 3}), PRODUCER,
                           current_version=9, max_staleness=2)
    assert res.status == "expired"
    _put(store, "y", 9, 2.5, status="aborted")
    assert [m for m, _ in _priority_index(store, "math", "expired")] == [f"{res.seq:010d}:x"]
    assert _priority_index(store, "math", "aborted") == [(f"{2:010d}:y", -2.5)]
    _check_index(store)


@pytest.mark.parametrize(
    "bad", [True, "high", None, math.nan, math.inf, -math.inf, 10**400, [1], {"v": 1}],
    ids=["bool", "str", "none", "nan", "inf", "-inf", "huge-int", "list", "dict"],
)
def test_a_bad_priority_is_refused_before_anything_is_written(store: TraceStore, bad: Any) -> None:
    store.open_sessions(["s0", "s1"], PRODUCER)
    ok = Group("ok", "math", ("s0",), min_version=0, payload={"priority": 1})
    bad_group = Group("bad", "math", ("s1",), min_version=0, payload={"priority": bad})
    with pytest.raises(InvalidInput) as exc:
        store.replay.put(bad_group, PRODUCER)
    assert exc.value.field == "payload.priority"
    with pytest.raises(InvalidInput):
        store.replay.put_many([ok, bad_group], PRODUCER)  # every group checked before any I/O
    assert store.replay.count() == 0 and store.sessions(PRODUCER) == ["s0", "s1"]
    assert _priority_index(store, "math", "completed") == []
    assert not store.redis.exists(store.keys.rb_seq)


def test_take_many_and_declared_keys_by_priority(store_factory: Any) -> None:
    a = store_factory()
    for t in ("x", "y"):
        _fill(a, task=t)
    def gids(groups: Any) -> list[str]:
        return [g.gid.split("-", 1)[1] for g in groups]

    got = a.replay.take_many({"x": 3, "y": 2}, owner="train:0", policy="priority")
    assert gids(got["x"]) == ["c", "g", "a"] and gids(got["y"]) == ["c", "g"]
    b = store_factory(replay_declared_keys=True)  # two round trips, the same result
    got = b.replay.take_many({"x": 3, "y": 4}, owner="train:1", policy="priority")
    assert gids(got["x"]) == ["d", "e", "b"] and gids(got["y"]) == ["a", "d", "e", "b"]
    _check_index(b, "x")
    _check_index(b, "y")
    with pytest.raises(InvalidInput, match="fifo, staleness, priority"):
        a.replay.take("x", 1, owner="train:0", policy="random")


def test_checkpoint_round_trips_the_priority_order(store: TraceStore, url: str, tmp_path: Any) -> None:
    _fill(store)
    _put(store, "ab", 0, 9, status="aborted")
    store.replay.take("math", 1, owner="train:0", policy="priority")  # c leaves: g is first now
    store.release_owner("train:0", "consumed")
    path = tmp_path / "run.tsck"
    store.checkpoint(str(path))
    other = TraceStore.connect(url, run=f"{store.keys.run}-r")
    try:
        other.restore(str(path))
        for status in ("completed", "aborted", "expired"):
            assert _priority_index(other, "math", status) == _priority_index(store, "math", status)
        _check_index(other)
        want = [g.gid for g in store.replay.take("math", 6, owner="train:1", policy="priority")]
        got = [g.gid for g in other.replay.take("math", 6, owner="train:1", policy="priority")]
        assert got == want == ["g", "a", "d", "e", "b", "f"]
        assert [g.gid for g in other.replay.claim_retry("math", 1, PRODUCER)] == ["ab"]
        assert _priority_index(other, "math", "aborted") == []
        assert other.owner_of("ab.s0") == PRODUCER and store.owner_of("ab.s0") == REPLAY_OWNER
    finally:
        other.close()
