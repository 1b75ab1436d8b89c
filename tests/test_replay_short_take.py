"""A take that finds too few fresh groups still expires the stale ones (issue 29, item 1).

Expiry is not part of a take's all-or-nothing: the groups beyond
``max_staleness`` are expired (retryable ones moved to ``expired``, the
others released, one event per session, data purged) whether or not the
take then finds its ``n`` ready groups. Before, a short take changed
nothing, so a buffer full of stale groups stayed "completed" forever and a
producer that keeps ``max_buffer`` completed groups stopped producing
(the trainer's starvation: tests/test_trainer_starvation.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tracestore import TraceStore
from tracestore.replay import REPLAY_OWNER, Group

PRODUCER = "rollout:p"


def _put(store: TraceStore, gid: str, task: str = "math", nsess: int = 2, **kw: Any) -> Group:
    sids = tuple(f"{gid}.s{i}" for i in range(nsess))
    store.open_sessions(list(sids), PRODUCER)
    g = Group(gid=gid, task=task, sids=sids, **kw)
    assert store.replay.put(g, PRODUCER).stored
    return g


def _events(store: TraceStore) -> list[tuple[str, str]]:
    return [(v[b"sid"].decode(), v[b"reason"].decode()) for _, v in store.redis.xrange(store.keys.events)]


@pytest.mark.parametrize("declared", [False, True])
def test_a_short_take_expires_the_stale_groups(store_factory: Any, declared: bool) -> None:
    """The issue's case: a group of version 3 is stale at version 6 with max_staleness 2."""
    store = store_factory(replay_declared_keys=declared)
    keep = _put(store, "old-retry", min_version=3)  # retryable (the default): kept as expired
    gone = _put(store, "old-drop", min_version=3, retryable=False)
    short = store.replay.take("math", 1, owner="train:0", current_version=6, max_staleness=2)
    assert not short and short.ready == 0
    assert short.expired == ("old-retry",) and sorted(short.released) == sorted(gone.sids)
    assert store.replay.count("math", "completed") == 0  # no longer counted as ready
    assert [g.gid for g in store.replay.groups("math", "expired")] == ["old-retry"]
    assert all(store.owner_of(s) == REPLAY_OWNER for s in keep.sids)
    assert sorted(_events(store)) == sorted((s, "expired") for s in gone.sids)  # one event each
    assert all(store.redis.exists(store.keys.dead(s)) for s in gone.sids)  # data purged
    st = store.stats()
    assert (st.groups_expired, st.groups_taken) == (2, 0)
    # nothing stale any more: the next short take writes nothing; a fresh group is taken
    again = store.replay.take("math", 1, owner="train:0", current_version=6, max_staleness=2)
    assert not again and again.expired == () and again.released == ()
    fresh = _put(store, "fresh", min_version=6)
    got = store.replay.take("math", 1, owner="train:0", current_version=6, max_staleness=2)
    assert [g.gid for g in got] == ["fresh"] and got.expired == ()
    assert all(store.owner_of(s) == "train:0" for s in fresh.sids)
    assert [g.gid for g in store.replay.claim_retry("math", 5, PRODUCER)] == ["old-retry"]


def test_a_short_take_many_expires_every_task(store: TraceStore) -> None:
    """All or nothing for the groups taken, not for the expiry: task a has enough, b is short."""
    _put(store, "a-old", task="a", min_version=1, retryable=False)
    _put(store, "a-new", task="a", min_version=9)
    _put(store, "b-old", task="b", min_version=1)
    short = store.replay.take_many({"a": 1, "b": 1}, owner="train:0", current_version=9, max_staleness=2)
    assert not short and short.ready == {"a": 1, "b": 0}
    assert short.expired == ("b-old",) and sorted(short.released) == ["a-old.s0", "a-old.s1"]
    assert [g.gid for g in store.replay.groups("a")] == ["a-new"]  # the fresh group stays put
    assert store.replay.count("b", "completed") == 0 and store.replay.count("b", "expired") == 1
    assert store.sessions("train:0") == []


def test_a_short_take_with_per_member_expiry_rerolls_the_stale_members(store: TraceStore) -> None:
    g = _put(store, "g", nsess=3, min_version=2)
    short = store.replay.take("math", 1, owner="train:0", current_version=9, max_staleness=2,
                              per_member=True)
    assert not short and short.expired == ("g",) and sorted(short.released) == sorted(g.sids)
    (back,) = store.replay.claim_retry("math", 1, PRODUCER)
    assert back.gid == "g" and back.sids == () and back.reroll == g.sids


def test_a_short_take_that_expired_replays_under_its_op_id(store: TraceStore) -> None:
    """A short take that wrote (its expiry) records its reply: the same op id replays it and
    appends no second event; a short take that wrote nothing records nothing."""
    gone = _put(store, "old", min_version=0, retryable=False)
    first = store.replay.take("math", 1, owner="train:0", current_version=5, max_staleness=1, op_id="t-1")
    events = _events(store)
    _put(store, "fresh", min_version=5)  # ready now, but the retry is the same call
    again = store.replay.take("math", 1, owner="train:0", current_version=5, max_staleness=1, op_id="t-1")
    assert not first and first.ready == 0 and sorted(first.released) == sorted(gone.sids)
    assert not again and again.ready == 0 and again.released == first.released
    assert _events(store) == events  # no second event
    got = store.replay.take("math", 1, owner="train:0", current_version=5, max_staleness=1, op_id="t-2")
    assert [g.gid for g in got] == ["fresh"]
    none = store.replay.take("math", 1, owner="train:0", current_version=5, max_staleness=1, op_id="t-3")
    assert not none and not store.redis.exists(store.keys.op("t-3"))
