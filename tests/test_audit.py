"""Audit of the mutating scripts against the ownership invariants (DESIGN sections 5-7).

Each test re-sends a script call exactly as redis-py does after a lost reply
(same EVALSHA, same op id), or drives a released session through the paths
that could move it, on a real server.
"""

from __future__ import annotations

import time
from typing import Any

from tracestore import TraceStore
from tracestore import gc as gcmod
from tracestore import replay as rb
from tracestore.replay import REPLAY_OWNER, Group
from tracestore.replies import text
from tracestore.router import acquire_route, route_scope

PRODUCER = "rollout:p"
EPS = ["ep-a", "ep-b", "ep-c"]



def _events(store: TraceStore) -> list[tuple[str, str]]:
    return [(text(f[b"sid"]), text(f[b"reason"])) for _id, f in store.redis.xrange(store.keys.events)]


def test_retried_route_acquire_returns_its_first_reply(store: TraceStore) -> None:
    ctx = store.context
    req = next(acquire_route(route_scope(ctx, EPS), "ra-1"))  # a new session: placed, reply lost
    first = store.execute(req)
    again = store.execute(req)  # redis-py re-sends the same call
    assert [text(x) for x in again] == [text(x) for x in first] and text(first[1]) == "new"
    assert store.router(EPS).table().load == {text(first[0]): 1}
    # a move (its entrypoint left the list): the retry still says moved, from where
    ep = text(first[0])
    others = tuple(e for e in EPS if e != ep)
    req = next(acquire_route(route_scope(ctx, others), "ra-1"))
    first = store.execute(req)
    again = store.execute(req)
    assert [text(x) for x in first][1:] == ["moved", ep]
    assert [text(x) for x in again] == [text(x) for x in first]
    assert store.router(EPS).table().load == {text(first[0]): 1}
    # a sticky acquire writes nothing and stays sticky
    assert store.router(EPS).acquire_route("ra-1").how == "sticky"


def test_retried_gc_owner_lost_releases_once(store: TraceStore) -> None:
    owner = "rollout:gone"
    sids = ["gl-1", "gl-2", "gl-3"]
    store.open_sessions(sids, owner)
    store.heartbeat(owner, 0.05)
    time.sleep(0.1)
    gen = gcmod.release_lost_owner(store.context, owner)
    members = store.execute(next(gen))
    batch = gen.send(members)
    first = store.execute(batch)
    again = store.execute(batch)  # the whole pipeline re-sent after a lost reply
    assert again == first
    assert sorted(text(x) for r in first for x in r[1:]) == sids
    assert sorted(_events(store)) == [(s, "owner-lost") for s in sids]
    assert store.sessions(owner) == []


def test_retried_failed_put_releases_once(store: TraceStore) -> None:
    sids = ("fp-1", "fp-2")
    store.open_sessions(list(sids), PRODUCER)
    req = rb.put_request(store.context, Group("fp", "math", sids, status="failed", min_version=0), PRODUCER)
    first = store.execute(req)
    again = store.execute(req)
    assert again == first and sorted(text(x) for x in first[3:]) == list(sids)
    assert sorted(_events(store)) == [(s, "failed") for s in sids]
    assert store.replay.count() == 0


def test_retried_expire_releases_once(store: TraceStore) -> None:
    sids = ("ex-1", "ex-2")
    store.open_sessions(list(sids), PRODUCER)
    store.replay.put(Group("ex", "math", sids, min_version=0, retryable=False), PRODUCER)
    gen = rb.expire(store.context, 10, 1, task="math")
    commit = next(gen)  # one script: it finds its groups and commits
    first = store.execute(commit)
    again = store.execute(commit)
    assert again == first
    assert sorted(_events(store)) == [(s, "expired") for s in sids]
    assert store.replay.count() == 0 and store.sessions(REPLAY_OWNER) == []


def test_a_released_session_in_a_group_is_not_moved_by_take_claim_or_transfer(store: TraceStore) -> None:
    a = ("rg-1", "rg-2")
    b = ("ra-1", "ra-2")
    store.open_sessions([*a, *b], PRODUCER)
    store.replay.put(Group("rg", "math", a), PRODUCER)
    store.replay.put(Group("ra", "math", b, status="aborted", retryable=True), PRODUCER)
    # the buffer's owner releases one session of each group while they are stored
    assert store.release([a[0], b[0]], REPLAY_OWNER, "dropped") == [a[0], b[0]]
    assert store.transfer([a[0]], REPLAY_OWNER, "train:x") == []
    taken = store.replay.take("math", 1, owner="train:0")
    assert [g.gid for g in taken] == ["rg"]
    claimed = store.replay.claim_retry("math", 1, "rollout:q")
    assert [g.gid for g in claimed] == ["ra"]
    # the live ones moved, the released ones stayed released and got no second event
    assert store.sessions("train:0") == [a[1]] and store.sessions("rollout:q") == [b[1]]
    assert store.owner_of(a[0]) is None and store.owner_of(b[0]) is None
    st = store.session_states([a[0], b[0]])
    assert all(v is not None and v[1] == "released" for v in st.values())
    assert sorted(_events(store)) == sorted([(a[0], "dropped"), (b[0], "dropped")])
    # nor can a group holding it be put again
    import pytest

    from tracestore import SessionReleased

    with pytest.raises(SessionReleased):
        store.replay.put(Group("rg2", "math", (a[0],)), "train:0")


def test_every_release_path_racing_releases_each_session_once(store_factory: Any) -> None:
    """release (buffer owner), take's expiry, expire and gc owner-lost race on the same sessions:
    each session is returned by at most one call and gets exactly one event."""
    import threading
    from collections import Counter

    main = store_factory()
    groups = [Group(f"rc{i}", "math", (f"rc{i}.a", f"rc{i}.b"), min_version=0, retryable=False) for i in range(60)]
    main.open_sessions([s for g in groups for s in g.sids], PRODUCER)
    for g in groups:
        main.replay.put(g, PRODUCER)
    lost = [f"rl{i}" for i in range(60)]
    main.open_sessions(lost, "rollout:lost")
    main.heartbeat("rollout:lost", 0.05)
    time.sleep(0.1)
    every = [s for g in groups for s in g.sids]
    returned: list[list[str]] = []
    errors: list[BaseException] = []

    def run(fn: Any) -> None:
        st = store_factory()
        try:
            returned.append(list(fn(st)))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    jobs = [
        lambda st: st.release(every, REPLAY_OWNER, "dropped"),
        lambda st: st.release(list(reversed(every)), REPLAY_OWNER, "dropped"),
        lambda st: st.replay.take("math", 1, owner="train:0", current_version=5, max_staleness=1).released,
        lambda st: st.replay.expire(5, 1, retryable=False).released_sids,
        lambda st: st.gc(scan_data=False).sessions_released,
        lambda st: st.gc(scan_data=False).sessions_released,
        lambda st: st.release(lost, "rollout:lost", "late"),
    ]
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    ids = Counter(s for r in returned for s in r)
    assert ids and max(ids.values()) == 1
    events = Counter(sid for sid, _reason in _events(main))
    assert set(events) == set(every) | set(lost) and max(events.values()) == 1
    assert set(ids) == set(events)
    assert main.sessions(REPLAY_OWNER) == [] and main.sessions("rollout:lost") == []


def test_gc_owner_lost_counts_a_later_chunk_that_saw_the_deadline_pass(store: TraceStore) -> None:
    """The chunks of one gc_owner_lost pipeline each check the deadline; when it passes between
    the first chunk and a later one, the later chunk releases its sessions: gc must report and
    purge them (they are released and have their events), not drop them as 'owner alive'."""
    from tracestore.scripts import Batch

    owner = "rollout:edge"
    n = 4001  # two chunks
    sids = [f"ce{i:05d}" for i in range(n)]
    store.open_sessions(sids, owner)
    store.heartbeat(owner, 60)
    gen = gcmod.release_lost_owner(store.context, owner)
    members = store.execute(next(gen))
    batch = gen.send(members)
    assert isinstance(batch, Batch) and len(batch.requests) == 2
    first = store.execute(batch.requests[0])  # the owner is still alive here
    store.heartbeat(owner, 0.05)  # its last heartbeat: the deadline passes before the second chunk
    time.sleep(0.1)
    second = store.execute(batch.requests[1])
    assert int(first[0]) == 0 and int(second[0]) == 1 and text(second[1]) == sids[-1]
    released: list[str] = []
    lost = False
    try:
        req = gen.send([first, second])
        while True:
            req = gen.send(store.execute(req))
    except StopIteration as stop:
        lost, released = stop.value
    assert lost
    assert sorted(released) == sids  # the later chunk's, then the rest on the next sweep
    assert store.sessions(owner) == []
    assert len(_events(store)) == n


def _turn(store: TraceStore, sid: str) -> None:
    store.record_turn(
        sid, "p", "r", prefix=store.lookup(sid, "p"), delta_token_ids=[1],
        response_token_ids=[2], response_logprobs=[-0.5], version=0,
    )


def test_trimming_an_old_tombstone_keeps_the_data_tombstone_of_a_reuse(store: TraceStore) -> None:
    """gc trims a tombstone past its retention (the id may be reused), then deletes the data
    tombstone in a second round trip. If the id was reopened, released and purged in between,
    that data tombstone is the new release's: deleting it would let writes to a purged session
    succeed again (DESIGN section 5, invariant 3)."""
    import pytest

    from tracestore import SessionReleased

    store.open_session("tr", "train:1")
    _turn(store, "tr")
    store.release(["tr"], "train:1")
    time.sleep(0.3)
    gen = gcmod._trim_tombstones(store.context, int(time.time() * 1000) - 200)
    from tracestore.scripts import Eval

    req = next(gen)
    while True:  # up to and including the trim script; next: delete the old data tombstones
        trim = isinstance(req, Eval) and req.script.name == "gc_trim_tombstones"
        req = gen.send(store.execute(req))
        if trim:
            break
    # meanwhile the forgotten id is reused, and released and purged again
    store.open_session("tr", "rollout:0")
    assert store.release(["tr"], "rollout:0") == ["tr"]
    try:
        while True:
            req = gen.send(store.execute(req))
    except StopIteration:
        pass
    assert store.redis.exists(store.keys.dead("tr"))
    with pytest.raises(SessionReleased):
        _turn(store, "tr")
