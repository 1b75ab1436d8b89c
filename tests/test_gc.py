"""``gc`` and ``tracestore gc`` on every backend (docs/design.md section 5, invariants 4 and 5).

Owner loss itself is covered in tests/test_ownership.py (scenario 6); here:
crash leftovers, orphan data, tombstone retention, consumer groups of gone
holders, event-stream trimming, the CLI, and gc running concurrently with
the disaggregated workload without touching anything live.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from tests._dump import dump_run
from tests.test_ownership import _race, data_intact, data_purged, events, write_turn
from tracestore import Group, InvalidInput, SessionReleased, TraceStore
from tracestore import gc as gcmod
from tracestore.cli import main
from tracestore.run import server_ms
from tracestore.scripts import Batch, Eval


def test_gc_purges_data_left_by_a_crash_between_release_and_purge(store: TraceStore) -> None:
    sids = [f"s{i}" for i in range(6)]
    store.open_sessions(sids, "train:1")
    for s in sids:
        write_turn(store, s)
    # Phase 1 only: the process "dies" before purging.
    assert store.release(sids[:4], "train:1", "consumed", purge=False) == sids[:4]
    assert all(data_intact(store, s) for s in sids[:4])

    report = store.gc()
    assert sorted(report.sessions_purged) == sids[:4]
    assert report.orphan_sessions == () and report.sessions_released == ()
    assert all(data_purged(store, s) for s in sids[:4])
    assert all(data_intact(store, s) for s in sids[4:])  # live sessions untouched
    with pytest.raises(SessionReleased):
        write_turn(store, sids[0])
    assert store.gc().sessions_purged == ()  # nothing left the second time
    assert len(events(store)) == 4  # gc appends no event for a purge


def test_gc_reports_orphan_data_without_deleting_it(store: TraceStore) -> None:
    write_turn(store, "never-opened")  # data plane written, no control record
    store.open_session("opened", "rollout:0")
    write_turn(store, "opened")
    report = store.gc()
    assert report.orphan_sessions == ("never-opened",)
    assert data_intact(store, "never-opened") and data_intact(store, "opened")
    assert store.gc(scan_data=False).orphan_sessions == ()


def test_gc_trims_tombstones_past_retention_only(store: TraceStore) -> None:
    store.open_sessions(["old", "young", "live"], "train:1")
    write_turn(store, "old")
    store.release(["old"], "train:1")
    time.sleep(2.1)  # "old" is now older than the 2 s retention below, for good

    assert store.gc().tombstones_trimmed == 0  # default retention: 1 day
    with pytest.raises(SessionReleased):
        store.open_session("old", "rollout:0")

    # "young" is released one round trip before the gc pass reads the server clock: well
    # inside 2 s, even on a busy machine (the pass skips the data scan, whose time grows with
    # the whole keyspace).
    store.release(["young"], "train:1")
    report = store.gc(tombstone_retention_s=2.0, scan_data=False)
    assert report.tombstones_trimmed == 1
    r, k = store.redis, store.keys
    assert r.zscore(k.released, "old") is None and r.zscore(k.released, "young") is not None
    assert not r.exists(k.session("old")) and not r.exists(k.dead("old"))
    assert store.session_states(["young", "live"]) == {
        "young": ("", "released"),
        "live": ("train:1", "live"),
    }
    # Past the retention an id is forgotten; that is what the retention is for.
    store.open_session("old", "rollout:0")
    assert store.owner_of("old") == "rollout:0"


def test_gc_forgets_lost_owner_marks_past_retention(store: TraceStore) -> None:
    store.heartbeat("rollout:x", 0.05)
    store.open_session("s", "rollout:x")
    time.sleep(0.1)
    assert store.gc().owners_lost == ("rollout:x",)
    assert store.redis.zscore(store.keys.owners_lost, "rollout:x") is not None
    store.gc(tombstone_retention_s=0)
    assert store.redis.zscore(store.keys.owners_lost, "rollout:x") is None


def _read_group(store: TraceStore, group: str, count: int, ack: int) -> list[str]:
    k = store.keys.events
    got = store.redis.xreadgroup(group, "c1", {k: ">"}, count=count)
    ids = [i.decode() if isinstance(i, bytes) else i for _s, entries in got for i, _f in entries]
    if ack:
        store.redis.xack(k, group, *ids[:ack])
    return ids


def test_gc_trims_events_below_the_slowest_group(store: TraceStore) -> None:
    sids = [f"s{i}" for i in range(10)]
    store.open_sessions(sids, "train:1")
    store.release(sids, "train:1")
    k = store.keys.events
    store.redis.xgroup_create(k, "fast", id="0")
    store.redis.xgroup_create(k, "slow", id="0")
    _read_group(store, "fast", 10, ack=10)
    slow_ids = _read_group(store, "slow", 6, ack=3)  # entries 4..6 pending, 7..10 unread

    report = store.gc()
    assert report.groups_removed == ()
    assert report.events_trimmed == 3
    left = [i.decode() if isinstance(i, bytes) else i for i, _f in store.redis.xrange(k, "-", "+")]
    assert left[0] == slow_ids[3]  # the oldest pending entry of the slowest group stays
    assert len(left) == 7

    _read_group(store, "slow", 10, ack=0)
    store.redis.xack(k, "slow", *slow_ids[3:], *left[3:])
    assert store.gc().events_trimmed == 6  # up to the last delivered id, which stays
    assert store.redis.xlen(k) == 1


def test_gc_removes_groups_of_gone_holders_then_trims_by_retention(store: TraceStore) -> None:
    store.open_sessions(["a", "b", "c"], "train:1")
    store.release(["a", "b", "c"], "train:1")
    k = store.keys.events
    store.redis.xgroup_create(k, "gone", id="0")
    store.redis.xgroup_create(k, "alive", id="0")
    _read_group(store, "gone", 1, ack=0)  # reads once, then its process dies
    time.sleep(2.1)  # "gone" is idle for longer than the 2 s limit below, for good
    _read_group(store, "alive", 1, ack=1)
    # "alive" read a few round trips before gc looks (no data scan, whose time grows with
    # the whole keyspace): well inside 2 s, even on a busy machine.
    report = store.gc(group_idle_limit_s=2.0, scan_data=False)
    assert report.groups_removed == ("gone",)
    names = {g["name"] for g in store.redis.xinfo_groups(k)}
    assert {n.decode() if isinstance(n, bytes) else n for n in names} == {"alive"}

    store.redis.xgroup_destroy(k, "alive")
    assert store.gc().events_trimmed == 0  # no group: keep a day of events
    assert store.gc(event_retention_s=0).events_trimmed == 3
    assert store.redis.xlen(k) == 0


def test_gc_owner_lost_script_never_declares_a_fresh_owner_lost(store: TraceStore) -> None:
    """Guard: gc_owner_lost.lua's own heartbeat-deadline check (server clock).

    Called directly, the script leaves an owner alone whose deadline is in the future or
    who never heart-beat. And in a real gc pass that selected an owner as expired, an
    owner that heart-beats between that selection and the script is not declared lost
    (the client's view is stale; only the server-side check sees the new deadline).
    """
    store.heartbeat("rollout:fresh", 60)
    store.open_sessions(["f0", "f1"], "rollout:fresh")
    store.open_sessions(["n0"], "rollout:never-beat")
    write_turn(store, "f0")
    for owner in ("rollout:fresh", "rollout:never-beat"):
        gen = gcmod.release_lost_owner(store.context, owner)
        members = store.execute(next(gen))
        batch = gen.send(members)
        replies = store.execute(batch)
        assert [int(r[0]) for r in replies] == [0]  # the script itself says: not lost
        with pytest.raises(StopIteration) as stop:
            gen.send(replies)
        assert stop.value.value == (False, [])
    assert store.redis.zcard(store.keys.owners_lost) == 0
    assert store.sessions("rollout:fresh") == ["f0", "f1"] and data_intact(store, "f0")
    assert store.sessions("rollout:never-beat") == ["n0"]
    store.heartbeat("rollout:fresh", 60)  # not lost: its heartbeat is still accepted

    # gc selects an expired owner, the owner heart-beats, then gc's script runs.
    store.heartbeat("rollout:late", 0.05)
    store.open_sessions(["l0", "l1"], "rollout:late")
    write_turn(store, "l0")
    time.sleep(0.1)
    gen2 = gcmod.gc(store.context, scan_data=False)
    req = next(gen2)
    scripts_seen: list[str] = []
    try:
        while True:
            if isinstance(req, Batch) and any(
                isinstance(r, Eval) and r.script.name == "gc_owner_lost" for r in req.requests
            ):
                if not scripts_seen:
                    assert [r.args[0] for r in req.requests] == ["rollout:late"]  # selected as expired
                    store.heartbeat("rollout:late", 60)  # ... and alive again before the script runs
                scripts_seen.append("gc_owner_lost")
            req = gen2.send(store.execute(req))
    except StopIteration as stop2:
        report = stop2.value
    assert scripts_seen, "gc never called gc_owner_lost"
    assert report.owners_lost == () and report.sessions_released == ()
    assert store.redis.zscore(store.keys.owners_lost, "rollout:late") is None
    assert store.sessions("rollout:late") == ["l0", "l1"] and data_intact(store, "l0")
    assert events(store) == []


def test_gc_rejects_bad_arguments_before_io(store: TraceStore) -> None:
    for kw in ({"tombstone_retention_s": -1}, {"group_idle_limit_s": "x"}, {"event_retention_s": True}):
        with pytest.raises(InvalidInput):
            store.gc(**kw)


def test_gc_concurrent_with_the_workload_touches_nothing_live(store_factory: Any) -> None:
    reports = _race(store_factory, steps=6, per_step=4, with_gc=True)
    assert reports, "gc never ran"
    for rep in reports:
        assert rep.sessions_released == () and rep.owners_lost == ()
        assert rep.orphan_sessions == ()
        # gc may purge a consumed session before the learner's own purge: both are idempotent.
        assert all(s.startswith("p") for s in rep.sessions_purged)


def test_cli_gc_and_sessions(url: str, run_id: str, store: TraceStore) -> None:
    store.heartbeat("rollout:gone", 0.05)
    store.open_sessions(["g0", "g1"], "rollout:gone")
    store.open_sessions(["r0"], "replay")
    write_turn(store, "orphan")
    time.sleep(0.1)
    runner = CliRunner()
    r = runner.invoke(main, ["sessions", "--url", url, "--run", run_id])
    assert r.exit_code == 0, r.output
    assert "rollout:gone" in r.output and "replay" in r.output

    r = runner.invoke(main, ["gc", "--url", url, "--run", run_id, "--json", "--check"])
    assert r.exit_code == 2, r.output  # orphan data found
    rep = orjson.loads(r.output)
    assert rep["owners_lost"] == ["rollout:gone"]
    assert sorted(rep["sessions_released"]) == ["g0", "g1"]
    assert rep["orphan_sessions"] == ["orphan"]

    r = runner.invoke(main, ["gc", "--url", url, "--run", run_id])
    assert r.exit_code == 0, r.output
    assert "orphan data" in r.output
    r = runner.invoke(main, ["sessions", "--url", url, "--run", run_id, "--owner", "replay"])
    assert r.exit_code == 0 and r.output.split() == ["r0"]
    r = runner.invoke(main, ["sessions", "--url", url, "--run", run_id, "--json"])
    infos = {o["owner"]: o for o in orjson.loads(r.output)}
    assert infos["rollout:gone"]["lost_ms"] is not None and infos["replay"]["sessions"] == 1
    r = runner.invoke(main, ["gc", "--url", url, "--run", run_id, "--tombstone-retention", "-1"])
    assert r.exit_code == 2 and "Invalid value for '--tombstone-retention'" in r.output


def test_gc_async(url: str, run_id: str, arun: Any) -> None:
    from tests.conftest import connect_async

    async def body() -> Any:
        st = await connect_async(url, run_id)
        try:
            await st.heartbeat("rollout:a", 0.05)
            await st.open_sessions(["a0", "a1"], "rollout:a")
            await st.open_sessions(["t0"], "train:1")
            await st.redis.hset(st.keys.idx("t0"), "x", "1")  # some data of t0
            await st.release(["t0"], "train:1", purge=False)
            k = st.keys.events
            await st.redis.xgroup_create(k, "h", id="0")
            await st.redis.xreadgroup("h", "c", {k: ">"}, count=1)
            time.sleep(0.1)
            return await st.gc(group_idle_limit_s=3600)
        finally:
            await st.close()

    rep = arun(body())
    assert rep.owners_lost == ("rollout:a",)
    assert sorted(rep.sessions_released) == ["a0", "a1"]
    assert rep.sessions_purged == ("t0",)
    assert rep.groups_removed == ()
    assert rep.events_trimmed == 0  # the group still has the first event pending


def test_a_clean_run_leaves_its_data_and_counters_only(url: str, run_id: str) -> None:
    """Issue 12 item 4: after a run that closed cleanly and its retry records expired, no lease,
    op record, heartbeat, owner set or session hash is left, and gc finds nothing to do."""
    st = TraceStore.connect(url, run=run_id, op_ttl_s=1)
    st.heartbeat("rollout:0", 30)
    st.heartbeat("train:1", 30)
    router = st.router(["ep-a", "ep-b"])
    sids = [f"s{i}" for i in range(8)]
    st.open_sessions(sids, "rollout:0")
    for s in sids:
        router.acquire(s)
        lease = st.gate.admit(s, "rollout:0", 30)
        write_turn(st, s)
        st.gate.settle(lease, "completed")
    st.replay.put(Group("g1", "calc", tuple(sids[:4])), owner="rollout:0")
    st.replay.put(Group("g2", "calc", tuple(sids[4:]), "failed"), owner="rollout:0")
    st.replay.take("calc", 1, owner="train:1", current_version=0)
    st.release_owner("train:1", "consumed")
    router.retire(sids)
    with st.gate.weight_update(1, 5):
        pass
    expected = st.stats()
    st.close()
    time.sleep(1.5)

    with TraceStore.connect(url, run=run_id) as after:
        r, k = after.redis, after.keys
        control = {k.control_suffix(x.decode()) for x in r.scan_iter(match=k.control_pattern, count=1000)}
        families = {c.split(":", 1)[0] if c.split(":", 1)[0] not in ("gate", "route", "rb") else c for c in control if c}
        assert families <= {
            "meta", "stats", "released", "events", "gate", "gate:signal", "gate:log", "route:retired", "rb:seq",
            "rb:tasks", "rb:bytes",
        }, families
        if "gate:signal" in families:  # a drain's wake-up token, gone within a minute
            assert 0 < r.pttl(k.gate_signal) <= 60_000
        data = {x.decode() for x in r.scan_iter(match=k.data_pattern, count=1000)}
        assert data == {k.dead(s) for s in sids}
        assert after.stats() == expected and expected.turns_recorded == 8
        assert (expected.sessions_opened, expected.sessions_released, expected.groups_put) == (8, 8, 1)
        report = after.gc()
        assert report.owners_lost == () and report.sessions_released == () and report.sessions_purged == ()


def _gc_cli(url: str, run: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``tracestore gc`` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "gc", "--url", url, "--run", run, *args],
        capture_output=True, text=True, timeout=120,
    )


def test_gc_check_is_a_dry_run_that_reports_what_the_pass_then_does(
    url: str, run_id: str, store: TraceStore
) -> None:
    """`tracestore gc --check` changes no key of the run (a dump of every key is equal after it),
    and reports what the next pass does: the owner it declares lost and the sessions it releases,
    the leftover data it purges, the orphan data, the old tombstone, the idle consumer group and
    the events it trims. (Before, --check ran the pass.)"""
    k = store.keys
    store.open_sessions(["e0", "e1"], "train:1")
    store.release(["e0", "e1"], "train:1")  # two events ...
    store.redis.xgroup_create(k.events, "holder", id="$")  # ... below this holder's mark: 1 to trim
    store.redis.xgroup_create(k.events, "gone", id="0-1")  # positioned in 1970: idle, removed
    store.redis.zadd(k.released, {"e0": 1}, xx=True)  # e0's tombstone is past any retention
    store.open_session("t0", "train:2")
    write_turn(store, "t0")
    store.release(["t0"], "train:2", purge=False)  # a crash between release and purge
    write_turn(store, "orphan")  # data, no control record
    beat = store.heartbeat("rollout:gone", 0.05)
    store.open_sessions(["g0", "g1"], "rollout:gone")
    while store.run(server_ms(store.context)) <= beat.deadline_ms:  # the deadline passes
        time.sleep(0.01)
    before = dump_run(store)

    dry = _gc_cli(url, run_id, "--check", "--json")
    assert dry.returncode == 2, dry.stderr  # orphan data found
    plan = orjson.loads(dry.stdout)
    assert dump_run(store) == before, "gc --check changed the run"
    assert plan["dry_run"] is True
    assert plan["owners_lost"] == ["rollout:gone"] and plan["sessions_released"] == ["g0", "g1"]
    assert plan["sessions_purged"] == ["t0"] and plan["orphan_sessions"] == ["orphan"]
    assert plan["tombstones_trimmed"] == 1 and plan["events_trimmed"] == 1
    assert plan["groups_removed"] == ["gone"]
    table = _gc_cli(url, run_id, "--check")
    assert table.returncode == 2 and "dry run" in table.stdout and "owners to declare lost" in table.stdout
    assert dump_run(store) == before

    done = _gc_cli(url, run_id, "--json")
    assert done.returncode == 0, done.stderr
    did = orjson.loads(done.stdout)
    assert did["dry_run"] is False
    assert {f: sorted(v) if isinstance(v, list) else v for f, v in did.items() if f != "dry_run"} == {
        f: v for f, v in plan.items() if f != "dry_run"
    }
    assert store.owners()[0].lost_ms is not None and data_purged(store, "t0")
    again = orjson.loads(_gc_cli(url, run_id, "--check", "--json").stdout)
    assert again["owners_lost"] == [] and again["sessions_purged"] == [] and again["tombstones_trimmed"] == 0
