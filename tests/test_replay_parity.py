"""The replay buffer's contracts beyond DESIGN section 7 (issue 13), on every backend.

XTuner's ReplayBuffer tests were the checklist (zero-size operations, default
retry, status filters, token-level expiry, staleness from the traces, ...);
the tests are written from the behaviour, against real servers.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tests.conftest import connect_async
from tests.test_replay import _snapshot
from tracestore import (
    InvalidId,
    InvalidInput,
    NodeConflict,
    PromptMismatch,
    Segment,
    SessionReleased,
    Taken,
    TraceStore,
)
from tracestore import replay as rb
from tracestore.replay import REPLAY_OWNER, Group
from tracestore.replies import text
from tracestore.scripts import Batch, Eval

PRODUCER = "rollout:p"


def _trace(store: TraceStore, sid: str, versions: list[int]) -> str:
    """Record one turn per version in session ``sid``; returns the last response node's key."""
    prompt = f"<u>{sid}</u>"
    for i, v in enumerate(versions):
        resp = f"<a>{i}</a>"
        store.record_turn(
            sid, prompt, resp, prefix=store.lookup(sid, prompt),
            delta_token_ids=[3, 4] if i == 0 else [5], response_token_ids=[7, 8, 9],
            response_logprobs=[-0.5, -0.25, -0.125], version=v,
        )
        prompt = prompt + resp + "<t>tool</t>"
    return prompt[: -len("<t>tool</t>")]


def _group(store: TraceStore, gid: str, versions: list[list[int]] | None = None, *, nsess: int = 2,
           owner: str = PRODUCER, task: str = "math", **kw: Any) -> Group:
    """Open the group's sessions; record traces at ``versions`` (one list per member) if given."""
    n = len(versions) if versions is not None else nsess
    sids = tuple(f"{gid}.m{i}" for i in range(n))
    store.open_sessions(list(sids), owner)
    for sid, vs in zip(sids, versions or [], strict=False):
        _trace(store, sid, vs)
    return Group(gid, task, sids, **kw)


def _put(store: TraceStore, gid: str, versions: list[list[int]] | None = None, **kw: Any) -> Group:
    owner = kw.pop("owner", PRODUCER)
    put_kw = {x: kw.pop(x) for x in ("current_version", "max_staleness", "per_member") if x in kw}
    g = _group(store, gid, versions, owner=owner, **kw)
    store.replay.put(g, owner, **put_kw)
    return g


def _events(store: TraceStore) -> list[tuple[str, str]]:
    return [(v[b"sid"].decode(), v[b"reason"].decode()) for _, v in store.redis.xrange(store.keys.events)]


# -- issue 13, items 1-5: fixes ----------------------------------------------------------------


def test_non_retryable_expired_put_is_released_not_stored(store: TraceStore) -> None:
    g = _group(store, "x", nsess=3, status="expired", retryable=False, min_version=0)
    res = store.replay.put(g, PRODUCER)
    assert not res.stored and res.status is None and sorted(res.released) == sorted(g.sids)
    assert store.replay.count("math", "expired") == 0 and store.replay.count() == 0
    assert sorted(_events(store)) == sorted((s, "expired") for s in g.sids)
    assert all(store.owner_of(s) is None for s in g.sids)
    assert all(store.redis.exists(store.keys.dead(s)) for s in g.sids)  # data purged
    assert store.replay.claim_retry("math", 5, "rollout:q") == []
    # a retryable expired group is stored and claimable
    r = _group(store, "r", status="expired", min_version=0)
    assert store.replay.put(r, PRODUCER).status == "expired"
    assert [c.gid for c in store.replay.claim_retry("math", 5, "rollout:q")] == ["r"]


def test_zero_size_take_and_claim_are_no_ops(store: TraceStore) -> None:
    _put(store, "c", min_version=0)
    _put(store, "a", status="aborted", min_version=0)
    before = _snapshot(store)
    nothing = store.replay.take("math", 0, owner="train:0", current_version=9, max_staleness=0)
    assert isinstance(nothing, Taken) and not nothing and nothing.ready is None
    assert store.replay.claim_retry("math", 0, "rollout:q") == []
    assert not store.replay.take_many({}, owner="train:0")
    assert not store.replay.take_many({"math": 0, "code": 0}, owner="train:0", current_version=9, max_staleness=0)
    assert store.replay.ready("math", 0) and store.replay.ready_many({})
    assert _snapshot(store) == before  # not even the expiry a take with max_staleness runs
    with pytest.raises(InvalidInput, match="0..2000"):
        store.replay.take("math", 2001, owner="train:0")


def test_groups_are_retryable_by_default(store: TraceStore) -> None:
    g = Group("g", "math", ("s",))
    assert g.retryable is True
    _put(store, "old", min_version=1)
    rep = store.replay.expire(10, 2)
    assert rep.kept == ("old",) and rep.released_groups == () and rep.released_sids == ()
    assert store.owner_of("old.m0") == REPLAY_OWNER and _events(store) == []
    assert [c.gid for c in store.replay.claim_retry("math", 1, "rollout:q")] == ["old"]


def test_expire_covers_aborted_groups_and_filters_by_status(store: TraceStore) -> None:
    _put(store, "c-old", min_version=1)
    _put(store, "a-old", status="aborted", min_version=1)
    _put(store, "a-old-n", status="aborted", min_version=1, retryable=False)
    _put(store, "a-new", status="aborted", min_version=9)
    only_completed = store.replay.expire(10, 2, statuses=("completed",))
    assert only_completed.kept == ("c-old",) and store.replay.count("math", "aborted") == 3
    rep = store.replay.expire(10, 2, statuses="aborted")
    assert rep.kept == ("a-old",) and rep.released_groups == ("a-old-n",)
    assert sorted(rep.released_sids) == ["a-old-n.m0", "a-old-n.m1"]
    assert [g.gid for g in store.replay.groups("math", "aborted")] == ["a-new"]
    assert [g.gid for g in store.replay.groups("math", "expired")] == ["c-old", "a-old"]  # put order
    _put(store, "both", status="aborted", min_version=0)
    assert store.replay.expire(10, 2).kept == ("both",)  # default: completed and aborted


def test_short_take_is_an_empty_falsy_taken(store: TraceStore) -> None:
    _put(store, "g0", min_version=0)
    short = store.replay.take("math", 2, owner="train:0")
    # docs/replay.md: a short take is a Taken with no groups, not a list
    assert isinstance(short, Taken) and not short and len(short) == 0 and list(short) == []
    assert short.groups == () and short.ready == 1 and short != []  # Taken(()) == [] is False
    full = store.replay.take("math", 1, owner="train:0")
    assert full and full[0].gid == "g0" and [g.gid for g in full] == ["g0"]


# -- item 2: per-member expiry ---------------------------------------------------------------


def test_per_member_expiry_rerolls_only_stale_members(store: TraceStore) -> None:
    # members' oldest versions 5, 2, 6, 1; at version 6 with max_staleness 2 the cutoff is 4
    g = _put(store, "g", [[5, 6], [2, 6], [6], [1, 5]], payload={"r": [1, 2, 3, 4]})
    _put(store, "later", [[6], [6]])
    events0 = len(_events(store))
    rep = store.replay.expire(6, 2, per_member=True)
    assert rep.kept == ("g",) and rep.released_groups == ()
    stale = (g.sids[1], g.sids[3])
    assert rep.released_sids == stale
    assert _events(store)[events0:] == [(s, "expired") for s in stale]  # one event each
    for s in stale:
        assert store.owner_of(s) is None and store.redis.exists(store.keys.dead(s))
        with pytest.raises(SessionReleased):
            store.export_training_trace(s, "x")
    fresh = (g.sids[0], g.sids[2])
    assert all(store.owner_of(s) == REPLAY_OWNER for s in fresh)
    [stored] = store.replay.groups("math", "expired")
    assert stored.sids == fresh and stored.reroll == stale and stored.member_versions == (5, 6)
    assert [x.gid for x in store.replay.groups("math")] == ["later"]  # the other group is untouched
    # claim_retry hands the group back with the members to re-roll; the fresh ones move
    [back] = store.replay.claim_retry("math", 5, "rollout:q")
    assert back.gid == "g" and back.sids == fresh and back.reroll == stale and back.status == "expired"
    assert back.payload == {"r": [1, 2, 3, 4]} and back.min_version == 1
    assert store.sessions("rollout:q") == sorted(fresh)
    # the producer rolls the stale members out again under new ids and puts the group again
    store.open_sessions(["g.m1b", "g.m3b"], "rollout:q")
    _trace(store, "g.m1b", [7])
    _trace(store, "g.m3b", [7])
    again = store.replay.put(Group("g", "math", (fresh[0], "g.m1b", fresh[1], "g.m3b")), "rollout:q")
    assert again.stored and again.min_version == 5
    [regrouped] = store.replay.groups("math", "completed")[1:]
    assert regrouped.member_versions == (5, 7, 6, 7) and regrouped.reroll == ()


def test_agentic_groups_expire_whole(store: TraceStore) -> None:
    a = _put(store, "agent", [[5], [1]], agentic=True)
    rep = store.replay.expire(6, 2, per_member=True)
    assert rep.kept == ("agent",) and rep.released_sids == ()
    [g] = store.replay.groups("math", "expired")
    assert g.sids == a.sids and g.reroll == () and g.agentic
    assert all(store.owner_of(s) == REPLAY_OWNER for s in a.sids)


def test_per_member_expiry_of_a_non_retryable_group_releases_it_whole(store: TraceStore) -> None:
    n = _put(store, "n", [[5], [1]], retryable=False)
    rep = store.replay.expire(6, 2, per_member=True)
    assert rep.released_groups == ("n",) and sorted(rep.released_sids) == sorted(n.sids)
    assert store.replay.count() == 0


def test_per_member_expiry_in_take_and_at_put(store: TraceStore) -> None:
    old = _put(store, "old", [[5], [1]])
    _put(store, "new", [[6], [6]])
    got = store.replay.take("math", 1, owner="train:0", current_version=6, max_staleness=2, per_member=True)
    assert [g.gid for g in got] == ["new"] and got.expired == ("old",) and got.released == (old.sids[1],)
    [kept] = store.replay.groups("math", "expired")
    assert kept.sids == (old.sids[0],) and kept.reroll == (old.sids[1],)
    # at put: a stale group is stored expired, only its stale members released
    g = _group(store, "late", [[6], [2], [3]])
    res = store.replay.put(g, PRODUCER, current_version=6, max_staleness=2, per_member=True)
    assert res.stored and res.status == "expired" and res.released == (g.sids[1], g.sids[2])
    late = store.replay.groups("math", "expired")[1]
    assert late.gid == "late" and late.sids == (g.sids[0],) and late.reroll == g.sids[1:]
    assert store.owner_of(g.sids[0]) == REPLAY_OWNER and store.owner_of(g.sids[1]) is None


# -- item 3: staleness from the traces ---------------------------------------------------------


def test_put_derives_min_version_from_the_traces(store: TraceStore) -> None:
    g = _group(store, "g", [[4, 5], [3, 7], [6]])
    store.open_session("g.bare", PRODUCER)  # no trace yet: takes the group's version
    res = store.replay.put(Group("g", "math", (*g.sids, "g.bare")), PRODUCER)
    assert res.min_version == 3
    [stored] = store.replay.groups("math")
    assert stored.min_version == 3 and stored.member_versions == (4, 3, 6, 3)
    # prompt-only tokens (labels -100) carry no staleness: a version-0 prompt segment is ignored
    store.open_session("ins", PRODUCER)
    store.insert("ins", "<p>", Segment([1, 2], version=0))
    store.insert("ins", "<p><a>", Segment([3], labels=[3], version=8))
    assert store.replay.put(Group("ins-g", "math", ("ins",)), PRODUCER).min_version == 8
    # no trace at all: current_version if given, else the version the gate installed
    store.open_sessions(["e1", "e2"], PRODUCER)
    assert store.replay.put(Group("e-g1", "math", ("e1",)), PRODUCER, current_version=11).min_version == 11
    store.gate.seal()
    store.gate.install(4)
    store.gate.reopen()
    assert store.replay.put(Group("e-g2", "math", ("e2",)), PRODUCER).min_version == 4


def test_put_refuses_a_min_version_newer_than_the_traces(store: TraceStore) -> None:
    g = _group(store, "g", [[4], [2]])
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match="newer than the traces"):
        store.replay.put(Group("g", "math", g.sids, min_version=3), PRODUCER)
    assert _snapshot(store) == before
    assert store.replay.put(Group("g", "math", g.sids, min_version=1), PRODUCER).min_version == 1  # older: kept
    [stored] = store.replay.groups("math")
    assert stored.min_version == 1 and stored.member_versions == (4, 2)


def test_put_many_reads_every_groups_versions_in_one_round_trip(store: TraceStore) -> None:
    """put_many keeps put's semantics (min_version from the traces, current_version, a newer given
    min_version refused) with all the version reads in one round trip and all the puts in another."""
    from tests.test_scripts import _Counting

    a = _group(store, "a", [[4, 5], [3]])
    b = _group(store, "b", [[6]])
    store.open_session("c.m0", PRODUCER)  # no trace: takes current_version
    c = Group("c", "math", ("c.m0",))
    bad = _group(store, "bad", [[2]])
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match="newer than the traces"):
        store.replay.put_many([Group("a", "math", a.sids), Group("bad", "math", bad.sids, min_version=5)], PRODUCER)
    assert _snapshot(store) == before  # refused after the reads: nothing written for any group
    count = _Counting(store)
    res = store.replay.put_many([Group("a", "math", a.sids), Group("b", "math", b.sids), c], PRODUCER,
                                current_version=11)
    assert len(count.requests) == 2  # the versions, then the puts
    assert [r.min_version for r in res] == [3, 6, 11] and all(r.stored for r in res)
    assert [(g.gid, g.member_versions) for g in store.replay.groups("math")] == [
        ("a", (4, 3)), ("b", (6,)), ("c", (11,))
    ]
    # max_staleness at put: a non-retryable group already stale is released, the others stored
    old = _group(store, "old", [[1]])
    new = _group(store, "new", [[9]])
    res = store.replay.put_many(
        [Group("old", "math", old.sids, retryable=False), Group("new", "math", new.sids, retryable=False)],
        PRODUCER, current_version=10, max_staleness=2,
    )
    assert [r.stored for r in res] == [False, True] and res[0].released == old.sids
    assert store.owner_of(old.sids[0]) is None and store.owner_of(new.sids[0]) == REPLAY_OWNER
    assert store.replay.put_many([], PRODUCER) == []


def test_stale_mask_marks_stale_trained_tokens(store: TraceStore) -> None:
    store.open_session("s", PRODUCER)
    key = _trace(store, "s", [3, 5, 6])
    tr = store.export_training_trace("s", key)
    mask = tr.stale_mask(6, 1)  # tokens of versions < 5 are stale
    assert len(mask) == len(tr.input_ids)
    expected = [lab != -100 and v < 5 for lab, v in zip(tr.labels, tr.versions, strict=True)]
    assert mask == expected and sum(mask) == 3  # the first response's three tokens
    assert not any(m for m, lab in zip(mask, tr.labels, strict=True) if lab == -100)  # prompts never
    assert not any(tr.stale_mask(6, 3)) and sum(tr.stale_mask(6, 0)) == 6
    with pytest.raises(InvalidInput):
        tr.stale_mask(-1, 0)


# -- item 4: multi-task takes, at_most, readiness, expiry at put, keys of a session ------------------


def test_take_many_is_all_or_nothing_across_tasks(store: TraceStore) -> None:
    for i in range(3):
        _put(store, f"a{i}", task="a", min_version=i)
    _put(store, "b0", task="b", min_version=0)
    before = _snapshot(store)
    short = store.replay.take_many({"a": 2, "b": 2}, owner="train:0")
    assert not short and short.ready == {"a": 3, "b": 1} and short["a"] == () and len(short) == 0
    assert _snapshot(store) == before
    _put(store, "b1", task="b", min_version=1)
    got = store.replay.take_many({"a": 2, "b": 2}, owner="train:0", policy="staleness")
    assert [g.gid for g in got["a"]] == ["a0", "a1"] and [g.gid for g in got["b"]] == ["b0", "b1"]
    assert [g.gid for g in got] == ["a0", "a1", "b0", "b1"] and len(got) == 4 and got.ready is None
    assert all(g.task == t for t in ("a", "b") for g in got[t])
    assert store.sessions("train:0") == sorted(s for g in got for s in g.sids)
    assert [g.gid for g in store.replay.groups("a")] == ["a2"] and store.replay.count("b") == 0


def test_take_many_expires_every_task_first(store: TraceStore) -> None:
    _put(store, "a-old", task="a", min_version=1, retryable=False)
    _put(store, "b-old", task="b", min_version=1)
    _put(store, "a-new", task="a", min_version=9)
    _put(store, "b-new", task="b", min_version=9)
    got = store.replay.take_many({"a": 1, "b": 1}, owner="train:0", current_version=9, max_staleness=2)
    assert [g.gid for g in got] == ["a-new", "b-new"]
    assert got.expired == ("b-old",) and sorted(got.released) == ["a-old.m0", "a-old.m1"]


def test_take_at_most_takes_what_is_ready(store: TraceStore) -> None:
    for i in range(3):
        _put(store, f"g{i}", min_version=i)
    got = store.replay.take("math", 5, owner="train:0", at_most=True, current_version=3, max_staleness=1)
    assert [g.gid for g in got] == ["g2"] and got.expired == ("g0", "g1") and got.ready is None
    assert not store.replay.take("math", 5, owner="train:0", at_most=True)  # empty: falsy, no error
    _put(store, "a0", task="a", min_version=0)
    many = store.replay.take_many({"a": 4, "b": 4}, owner="train:0", at_most=True)
    assert [g.gid for g in many] == ["a0"] and many["b"] == ()


def test_ready_and_ready_many(store: TraceStore) -> None:
    assert not store.replay.ready("math", 1)
    for i, v in enumerate([1, 5, 6]):
        _put(store, f"g{i}", min_version=v)
    _put(store, "c0", task="code", min_version=6)
    _put(store, "ab", status="aborted", min_version=6)  # not ready: aborted groups are claimed, not taken
    assert store.replay.ready("math", 3) and not store.replay.ready("math", 4)
    assert store.replay.ready("math", 2, current_version=6, max_staleness=1)
    assert not store.replay.ready("math", 3, current_version=6, max_staleness=1)
    assert store.replay.ready_many({"math": 2, "code": 1}, current_version=6, max_staleness=1)
    assert not store.replay.ready_many({"math": 2, "code": 2})
    before = _snapshot(store)
    store.replay.ready_many({"math": 1, "code": 1}, current_version=9, max_staleness=0)
    assert _snapshot(store) == before  # read only
    with pytest.raises(InvalidInput):
        store.replay.ready("math", 1, max_staleness=1)
    with pytest.raises(InvalidId):
        store.replay.ready_many({"bad task": 1})


def test_put_expires_at_put(store: TraceStore) -> None:
    keep = _group(store, "keep", min_version=3)
    res = store.replay.put(keep, PRODUCER, current_version=9, max_staleness=2)
    assert res.stored and res.status == "expired" and res.released == ()
    assert [g.gid for g in store.replay.groups("math", "expired")] == ["keep"]
    drop = _group(store, "drop", min_version=3, retryable=False)
    res = store.replay.put(drop, PRODUCER, current_version=9, max_staleness=2)
    assert not res.stored and sorted(res.released) == sorted(drop.sids)
    assert sorted(e for e in _events(store) if e[0].startswith("drop")) == [(s, "expired") for s in drop.sids]
    fresh = _group(store, "fresh", min_version=7)
    assert store.replay.put(fresh, PRODUCER, current_version=9, max_staleness=2).status == "completed"
    with pytest.raises(InvalidInput):
        store.replay.put(_group(store, "x", min_version=7), PRODUCER, max_staleness=2)


def test_trace_keys_lists_a_sessions_stored_keys(store_factory: Any) -> None:
    store = store_factory()
    store.open_session("s", PRODUCER)
    last = _trace(store, "s", [1, 2])
    keys = store.trace_keys("s")
    assert keys[-1] == last and keys == sorted(keys, key=len)
    assert keys == ["<u>s</u>", "<u>s</u><a>0</a>", "<u>s</u><a>0</a><t>tool</t>", last]
    for key in keys:  # every listed key is an exact stored key
        assert store.search("s", key).text_len == len(key)
    assert store.trace_keys("never-opened") == []
    store.release(["s"], PRODUCER, "done")
    store.drop_session_data("s")
    with pytest.raises(SessionReleased):
        store.trace_keys("s")
    quiet = store_factory(store_text=False)
    quiet.open_session("q", PRODUCER)
    _trace(quiet, "q", [1])
    with pytest.raises(InvalidInput, match="store_text"):
        quiet.trace_keys("q")
    with pytest.raises(InvalidId):
        store.trace_keys("a b")


# -- item 5: errors describing bad values are ValueErrors ------------------------------------------


def test_bad_value_errors_are_value_errors(store: TraceStore) -> None:
    store.open_session("s", PRODUCER)
    key = _trace(store, "s", [1])
    caught: list[type[BaseException]] = []
    attempts = [
        lambda: store.export_training_trace("s", key + "x"),  # PromptMismatch
        lambda: store.insert("s", key, Segment([1, 2, 3])),  # NodeConflict
        lambda: store.replay.take("math", -1, owner="train:0"),  # InvalidInput
        lambda: store.open_session("bad id", PRODUCER),  # InvalidId
    ]
    for attempt in attempts:
        try:
            attempt()
        except ValueError as exc:  # an XTuner-style handler catches every one of them
            caught.append(type(exc))
    assert caught == [PromptMismatch, NodeConflict, InvalidInput, InvalidId]


# -- item 6: one round trip ------------------------------------------------------------------------------


def _requests(store: TraceStore, operation: Any) -> tuple[list[Any], Any]:
    """Run ``operation`` through ``store``, recording every request it yields."""
    seen: list[Any] = []
    reply: Any = None
    try:
        while True:
            req = operation.send(reply)
            seen.append(req)
            reply = store.execute(req)
    except StopIteration as stop:
        return seen, stop.value


def test_take_claim_and_expire_are_one_round_trip(store_factory: Any) -> None:
    for declared in (False, True):
        st = store_factory(replay_declared_keys=declared)
        t = f"t{int(declared)}"
        for i in range(4):
            _put(st, f"{t}-g{i}", task=t, min_version=5)
        _put(st, f"{t}-a", task=t, status="aborted", min_version=5)
        seen, got = _requests(st, rb.take(st.context, t, 3, owner="train:0", current_version=5, max_staleness=0))
        assert len(got) == 3
        assert [type(r) for r in seen] == [Eval] * (2 if declared else 1)  # declared keys: plan, then commit
        seen, many = _requests(st, rb.take_many(st.context, {t: 1}, owner="train:0"))
        assert len(many) == 1 and len(seen) == (2 if declared else 1)
        seen, claimed = _requests(st, rb.claim_retry(st.context, t, 1, "rollout:q"))
        assert len(claimed) == 1 and len(seen) == (2 if declared else 1)
        _put(st, f"{t}-old", task=t, min_version=1)
        seen, rep = _requests(st, rb.expire(st.context, 5, 0, task=t, statuses=("completed",)))
        assert rep.kept == (f"{t}-old",)
        assert [type(r) for r in seen] == ([Eval, Eval] if declared else [Batch])


def test_declared_keys_give_the_same_results(store_factory: Any) -> None:
    results = []
    for declared in (False, True):
        st = store_factory(replay_declared_keys=declared)
        t = f"d{int(declared)}"
        _put(st, f"{t}-old", [[5], [1], [5]], task=t)
        _put(st, f"{t}-new", [[6], [6]], task=t)
        _put(st, f"{t}-ab", [[6]], task=t, status="aborted")
        got = st.replay.take_many({t: 1}, owner=f"train:{t}", current_version=6, max_staleness=2,
                                  per_member=True)
        claimed = st.replay.claim_retry(t, 5, f"rollout:{t}")
        results.append((
            [g.gid[3:] for g in got], [x[3:] for x in got.expired], [s[3:] for s in got.released],
            [(g.gid[3:], [s[3:] for s in g.sids], [s[3:] for s in g.reroll]) for g in claimed],
        ))
        assert st.replay.count(t) == 0
    assert results[0] == results[1]
    assert results[0][3] == [("old", ["old.m0", "old.m2"], ["old.m1"]), ("ab", ["ab.m0"], [])]


def test_in_script_keys_must_share_the_slot_of_the_declared_keys(store: TraceStore) -> None:
    """A session key prefix of another hash tag is refused before anything is read or written."""
    _put(store, "g", min_version=0)
    before = _snapshot(store)
    gen = rb.take(store.context, "math", 1, owner="train:0")
    ev = next(gen)
    assert isinstance(ev, Eval)
    args = list(ev.args)
    prefix = store.keys.session_prefix
    assert args.count(prefix) == 1
    args[args.index(prefix)] = prefix.replace(f"{{{store.run_id}}}", "{elsewhere}")
    with pytest.raises(InvalidInput, match="slot"):
        store.execute(Eval(ev.script, ev.keys, tuple(args)))
    assert _snapshot(store) == before


# -- item 7: concurrency ------------------------------------------------------------------------------


def test_concurrent_producers_and_learners_with_take_many_and_per_member_expiry(store_factory: Any) -> None:
    """Producers put groups of two tasks whose members' traces span versions; learners take_many
    with per-member expiry while the version advances; a reaper expires per member and claims.
    Every group ends taken or claimed exactly once, every session exactly once: owned by its
    taker or claimer, or released with exactly one event and listed in its group's reroll."""
    producers, per_producer = 3, 24
    clock = [6]
    clock_lock = threading.Lock()
    put: list[Group] = []
    taken: list[tuple[str, Group]] = []
    claimed: list[Group] = []
    released_by_takes: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    producing = threading.Event()
    producing.set()

    def now() -> int:
        with clock_lock:
            return clock[0]

    def produce(p: int) -> None:
        st = store_factory()
        try:
            for i in range(per_producer):
                task = "a" if i % 2 else "b"
                v = now()
                # the third member lags: fresh, one version behind, or two (stale at max_staleness 1)
                g = _group(st, f"p{p}-g{i}", [[v], [v], [v - i % 3]], owner=f"rollout:{p}", task=task)
                st.replay.put(g, f"rollout:{p}")
                with lock:
                    put.append(g)
                if p == 0 and i % 4 == 3:
                    with clock_lock:
                        clock[0] += 1
        except BaseException as exc:
            errors.append(exc)

    def learn(j: int) -> None:
        st = store_factory()
        try:
            while producing.is_set():
                got = st.replay.take_many({"a": 2, "b": 2}, owner=f"train:{j}", current_version=now(),
                                          max_staleness=1, per_member=True, at_most=j == 1)
                if j == 0 and got:  # all or nothing across the tasks
                    assert len(got["a"]) == 2 and len(got["b"]) == 2
                with lock:
                    taken.extend((f"train:{j}", g) for g in got)
                    released_by_takes.extend(got.released)
        except BaseException as exc:
            errors.append(exc)

    def reap() -> None:
        st = store_factory()
        try:
            while producing.is_set():
                st.replay.expire(now(), 1, per_member=True)
                for task in ("a", "b"):
                    got = st.replay.claim_retry(task, 4, "reaper")
                    with lock:
                        claimed.extend(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    others = [threading.Thread(target=learn, args=(j,)) for j in range(2)] + [threading.Thread(target=reap)]
    for t in threads + others:
        t.start()
    for t in threads:
        t.join(120)
    producing.clear()
    for t in others:
        t.join(120)
    assert not errors, errors
    # drain: expire and claim what is stale, take the rest
    st = store_factory()
    st.replay.expire(now(), 1, per_member=True)
    for task in ("a", "b"):
        claimed.extend(st.replay.claim_retry(task, 2000, "reaper"))
    final = st.replay.take_many({"a": 2000 // 2, "b": 2000 // 2}, owner="train:final", at_most=True)
    taken.extend(("train:final", g) for g in final)
    assert st.replay.count() == 0 and st.sessions(REPLAY_OWNER) == []

    outcomes = [g.gid for _, g in taken] + [g.gid for g in claimed]
    assert len(outcomes) == len(set(outcomes)), "a group was taken or claimed twice"
    assert sorted(outcomes) == sorted(g.gid for g in put), "a group was lost"
    reroll = [s for g in claimed for s in g.reroll]
    assert reroll and taken, "the test must see both outcomes"  # reroll: every third group lags by 2
    owners = st.session_states([s for g in put for s in g.sids])
    accounted: list[str] = []
    for owner, g in taken:
        assert g.reroll == ()
        assert all(owners[s] == (owner, "live") for s in g.sids)
        accounted += g.sids
    for g in claimed:
        assert all(owners[s] == ("reaper", "live") for s in g.sids)
        assert all(owners[s] is None or owners[s][1] == "released" for s in g.reroll)  # type: ignore[index]
        accounted += [*g.sids, *g.reroll]
    assert sorted(accounted) == sorted(s for g in put for s in g.sids), "a session was lost or doubled"
    events = Counter(sid for sid, reason in _events(st) if reason == "expired")
    assert events == Counter(reroll), "one release event per released session"
    assert set(released_by_takes) <= set(reroll)


# -- the async store ----------------------------------------------------------------------------------


def test_async_take_many_ready_and_trace_keys(url: str, run_id: str, arun: Any, store: TraceStore) -> None:
    _put(store, "a0", task="a", min_version=1)
    _put(store, "b0", task="b", min_version=1)
    store.open_session("s", PRODUCER)
    last = _trace(store, "s", [1])

    async def go() -> Any:
        st = await connect_async(url, run_id)
        try:
            ready = await st.replay.ready_many({"a": 1, "b": 1})
            got = await st.replay.take_many({"a": 1, "b": 1}, owner="train:a", current_version=1, max_staleness=0)
            keys = await st.trace_keys("s")
            return ready, got, keys
        finally:
            await st.close()

    ready, got, keys = arun(go())
    assert ready and [g.gid for g in got] == ["a0", "b0"] and keys[-1] == last


def test_checkpoint_keeps_member_versions_reroll_and_agentic(store: TraceStore, store_factory: Any,
                                                            tmp_path: Any, url: str) -> None:
    _put(store, "g", [[5], [1], [5]])
    _put(store, "ag", [[5], [1]], agentic=True)
    store.replay.expire(6, 2, per_member=True)
    _put(store, "c", [[6], [7]], payload={"x": 0.1 + 0.2})
    before = {s: store.replay.groups("math", s) for s in ("completed", "expired")}
    path = tmp_path / "ck.jsonl"
    store.checkpoint(path)
    other = TraceStore.connect(url, run=store.run_id + "-r")
    try:
        other.restore(path)
        after = {s: other.replay.groups("math", s) for s in ("completed", "expired")}
        assert after == before
        assert [g.member_versions for g in after["expired"]] == [(5, 5), (5, 1)]
        assert after["completed"][0].payload == {"x": 0.1 + 0.2}  # floats exact
        [back] = [g for g in other.replay.claim_retry("math", 5, "rollout:q") if g.gid == "g"]
        assert back.reroll == ("g.m1",) and back.sids == ("g.m0", "g.m2")
    finally:
        other.close()


def test_put_request_pipelines_puts_of_known_versions(store: TraceStore) -> None:
    groups = [Group(f"g{i}", "math", (f"g{i}.s",), min_version=i) for i in range(5)]
    store.open_sessions([g.sids[0] for g in groups], PRODUCER)
    replies = store.execute(Batch(tuple(rb.put_request(store.context, g, PRODUCER) for g in groups)))
    assert [rb.put_result(g.gid, g.min_version, r).seq for g, r in zip(groups, replies, strict=True)] == [1, 2, 3, 4, 5]
    assert [text(x) for x in store.redis.zrange(store.keys.rb_queue("math", "completed"), 0, -1)] == [
        g.gid for g in groups
    ]
    with pytest.raises(InvalidInput, match="min_version"):
        rb.put_request(store.context, Group("x", "math", ("s",)), PRODUCER)
