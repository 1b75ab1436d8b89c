"""``store.list_runs``, ``store.delete_run`` and ``tracestore runs`` / ``run delete`` on every backend.

The delete test fills the run to delete and three neighbours whose ids share
its characters (``R``, ``Rx``, ``R-1``, ``R`` minus its last character) with
sessions, traces, replay groups, gate leases and heartbeats, dumps every key
of the neighbours (``DUMP`` and TTL, on every primary) and checks that the
dump is byte-identical afterwards, and that no key of any other run on the
server went missing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from tests.test_ownership import write_turn
from tracestore import Group, InvalidInput, RunInUse, RunRecordMissing, TraceStore
from tracestore.cli import main
from tracestore.keys import key_slot
from tracestore.scripts import Batch, Cmd


def _fill(st: TraceStore, tag: str) -> None:
    """A bit of everything a run writes: sessions with traces, a replay group, leases, owners."""
    sids = [f"{tag}-{i}" for i in range(6)]
    st.open_sessions(sids, "rollout:0")
    for s in sids:
        write_turn(st, s)
    st.replay.put(Group(f"g-{tag}", "calc", tuple(sids[:2]), min_version=0), "rollout:0")
    st.release([sids[2]], "rollout:0", "done")
    st.gate.admit(sids[3], "rollout:0", 60)
    st.router(["ep-a", "ep-b"]).acquire(sids[4])


def _keys_of_server(st: TraceStore) -> list[str]:
    c: Any = st.redis
    clients = [c.get_redis_connection(n) for n in c.get_primaries()] if st.cluster else [c]
    return sorted(k.decode() for cl in clients for k in cl.scan_iter(match="ts:*", count=1000))


def _dump(st: TraceStore, keys: list[str]) -> dict[str, tuple[bytes, bool]]:
    c: Any = st.redis
    return {k: (c.dump(k), c.pttl(k) > 0) for k in keys}


def test_delete_run_removes_its_keys_and_leaves_other_runs_byte_identical(
    url: str, run_id: str
) -> None:
    names = [run_id, f"{run_id}x", f"{run_id}-1", run_id[:-1]]
    stores = [TraceStore.connect(url, run=n) for n in names]
    try:
        for st, n in zip(stores, names, strict=True):
            _fill(st, n.replace(".", "_"))
        target = stores[0]
        everything = _keys_of_server(target)
        mine = [
            k for k in everything
            if k.startswith((f"ts:{{{run_id}}}:", f"ts:{{{run_id}/", f"ts:{{{run_id}|"))
        ]
        others = [k for k in everything if k not in set(mine)]
        # the neighbours byte for byte; the rest of the server (other tests' runs) by name
        near = [k for k in others if k.startswith(tuple(f"ts:{{{n}" for n in names[1:]))]
        assert len(mine) > 20 and len(near) > 60
        before = _dump(target, near)
        ttl = dict(zip(others, target.execute(Batch(tuple(Cmd(("PTTL", k), key=k) for k in others))), strict=True))

        # the gate lease's holder never heart-beat: a live owner, so refused
        with pytest.raises(RunInUse) as ei:
            target.delete_run()
        assert ("rollout:0", 3) in ei.value.owners
        assert set(_keys_of_server(target)) >= set(mine)  # nothing deleted

        done = target.delete_run(force=True)
        assert done.forced_owners == ("rollout:0",)
        assert done.sessions == 6 and done.control_keys + done.data_keys + done.turn_shards == len(mine)
        assert done.turn_shards > 0  # its turns were counted in its sessions' slots
        after = _keys_of_server(target)
        assert not set(after) & set(mine)
        assert _dump(target, near) == before
        # other tests' op records and leases may expire meanwhile (PTTL -2: already gone when
        # asked, after the listing); a key without a TTL (-1) must stay
        gone = set(others) - set(after)
        assert not {k for k in gone if ttl[k] == -1}, sorted(k for k in gone if ttl[k] == -1)
        assert run_id not in target.run_ids() and set(names[1:]) <= set(target.run_ids())
        again = target.delete_run()  # idempotent
        assert (again.control_keys, again.data_keys, again.sessions, again.turn_shards) == (0, 0, 0, 0)
    finally:
        for st in stores:
            st.close()


def test_delete_run_allows_owners_that_are_gone(store: TraceStore) -> None:
    store.open_sessions(["a", "b"], "rollout:dead")
    store.heartbeat("rollout:dead", 0.05)
    store.open_session("c", "rollout:alive")
    store.heartbeat("rollout:alive", 60)
    time.sleep(0.1)  # rollout:dead's deadline passes
    with pytest.raises(RunInUse) as ei:
        store.delete_run()
    assert ei.value.owners == [("rollout:alive", 1)]  # the expired one does not count
    store.release_owner("rollout:alive", "done")
    done = store.delete_run()
    assert done.forced_owners == () and done.control_keys > 0
    assert (done.sessions, done.data_keys) == (1, 1)  # the purge tombstone of "c"
    assert store.run_id not in store.run_ids()


def test_list_runs_reports_sessions_owners_activity_and_memory(url: str, run_id: str) -> None:
    with TraceStore.connect(url, run=run_id) as st, TraceStore.connect(url, run=f"{run_id}-idle") as idle:
        st.open_sessions(["a", "b", "c"], "rollout:0")
        st.open_session("d", "replay")
        st.heartbeat("rollout:0", 60)
        st.release(["c"], "rollout:0", "done")
        assert {run_id, idle.run_id} <= set(st.run_ids())
        # the other tests' runs on this server are not ours to wait for: name the two
        runs = {r.run: r for r in st.list_runs([run_id, idle.run_id])}
        r, i = runs[run_id], runs[idle.run_id]
        assert r.live_sessions == 3 and r.owners == ("rollout:0", "replay")
        assert r.heartbeating == 1 and r.last_activity_ms == r.server_ms
        assert r.created_ms is not None and r.created_ms <= r.server_ms
        assert r.control_keys > i.control_keys >= 1 and r.control_bytes > i.control_bytes > 0
        assert (r.sessions_opened, r.sessions_released) == (4, 1)  # the run's counters
        assert (i.live_sessions, i.owners, i.heartbeating) == (0, (), 0)
        assert i.last_activity_ms == i.created_ms

        cli = CliRunner().invoke(main, ["runs", "--url", url, "--json", run_id, idle.run_id])
        assert cli.exit_code == 0, cli.output
        rows = {d["run"]: d for d in orjson.loads(cli.output)}
        assert rows[run_id]["live_sessions"] == 3 and rows[run_id]["owners"] == ["rollout:0", "replay"]
        cli = CliRunner().invoke(main, ["runs", "--url", url, run_id, idle.run_id])
        assert cli.exit_code == 0, cli.output
        line = next(ln for ln in cli.output.splitlines() if ln.startswith(run_id + " "))
        assert "rollout:0, replay" in line and "heartbeat now" in line and " key" in line
        assert line.rstrip().endswith("4 / 1")
        cli = CliRunner().invoke(main, ["runs", "--url", url, "nosuch"])
        assert cli.exit_code == 2 and "no run 'nosuch'" in cli.output


def test_run_delete_command(standalone_url: str, run_id: str) -> None:
    with TraceStore.connect(standalone_url, run=run_id) as st:
        st.open_session("s", "rollout:0")
        st.heartbeat("rollout:0", 60)
        write_turn(st, "s")
    r = CliRunner().invoke(main, ["run", "delete", run_id, "--url", standalone_url])
    assert r.exit_code == 1
    assert "rollout:0 (1)" in r.output and "--force" in r.output
    r = CliRunner().invoke(main, ["run", "delete", run_id, "--url", standalone_url, "--force"])
    assert r.exit_code == 0, r.output
    assert f"deleted run {run_id!r}" in r.output and "of 1 sessions" in r.output
    assert "overrode live owners rollout:0" in r.output
    r = CliRunner().invoke(main, ["run", "delete", run_id, "--url", standalone_url])
    assert r.exit_code == 2 and f"no run {run_id!r}" in r.output


def test_a_run_of_an_older_trace_schema_is_refused_with_the_way_out(standalone_url: str, run_id: str) -> None:
    """A run written by a tracestore of schema 1 (32-hex node ids) is refused at connect, and removable."""
    with TraceStore.connect(standalone_url, run=run_id) as st:
        st.open_session("s", "rollout:0")
        st.redis.hset(st.keys.meta, "schema", "1")  # as the previous version created it
    with pytest.raises(InvalidInput, match=r"created with trace schema 1 .* writes schema 2: move it with "
                       r"`tracestore checkpoint save` .* or remove it with `tracestore run delete <run> --force`"):
        TraceStore.connect(standalone_url, run=run_id)
    r = CliRunner().invoke(main, ["run", "delete", run_id, "--url", standalone_url, "--force"])
    assert r.exit_code == 0, r.output
    with TraceStore.connect(standalone_url, run=run_id) as st:  # a new run of that id, this schema
        assert st.redis.hget(st.keys.meta, "schema") == b"2"


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``tracestore`` command as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "tracestore.cli", *args, "--url", url],
        capture_output=True, text=True, timeout=120,
    )


def _run_keys_on_server(st: TraceStore, run: str) -> list[str]:
    """Every key of ``run`` on every primary: control plane, sessions' data, turn counter shards."""
    return [k for k in _keys_of_server(st) if k.startswith((f"ts:{{{run}}}", f"ts:{{{run}/", f"ts:{{{run}|"))]


# seven CLI processes per backend: the standalone server and the cluster's primaries are the two cases
@pytest.mark.backends("valkey", "cluster")
def test_a_run_whose_record_is_gone_is_removed_by_run_delete_and_gc_with_force(url: str, run_id: str) -> None:
    """A client that outlived its store's data writes again without the run's record (the
    gateway after a server restart writes ts:{gw-1}... keys): every command answered
    `no run`, and only redis-cli could remove them. Now `run delete` and `gc --run` count them,
    change nothing without --force, and remove them with it, from every primary of a cluster,
    and nothing of a neighbour run."""
    lost, other = f"{run_id}-gw", f"{run_id}-gw2"
    with TraceStore.connect(url, run=lost) as a, TraceStore.connect(url, run=other) as b, \
            TraceStore.connect(url, run=run_id) as neighbour:
        for st, tag in ((a, "a"), (b, "b"), (neighbour, "n")):
            _fill(st, tag)
            st.open_session(f"{tag}-gw", "gateway")  # the gateway's owner: it never heart-beats
            write_turn(st, f"{tag}-gw")
        for st in (a, b):
            st.redis.delete(st.keys.meta)
        keep = _dump(neighbour, _run_keys_on_server(neighbour, run_id))
        left = _run_keys_on_server(a, lost)
        assert len({key_slot(k) for k in left}) > 3  # spread over slots (and a cluster's primaries)
        before = _dump(a, left)

        r = _cli(url, "sessions", "--run", lost)
        assert r.returncode == 1 and f"run {lost!r}" in r.stderr and "has no record" in r.stderr, r.stderr
        assert f"`tracestore run delete {lost} --force` removes them" in r.stderr
        assert f"{len(left)} of its keys remain" in r.stderr
        for args, code in ((("run", "delete", lost), 1), (("gc", "--run", lost), 1), (("gc", "--run", lost, "--check"), 2)):
            r = _cli(url, *args)
            assert r.returncode == code, (args, r.stdout, r.stderr)
            assert f"{len(left)} keys" in r.stdout + r.stderr or f"{len(left)} of its keys" in r.stderr
            assert _dump(a, _run_keys_on_server(a, lost)) == before, args  # nothing changed

        r = _cli(url, "gc", "--run", lost, "--force")
        assert r.returncode == 0, r.stderr
        assert f"removed run {lost!r} (it had no record)" in r.stdout
        assert _run_keys_on_server(a, lost) == []
        r = _cli(url, "run", "delete", other, "--force", "--json")
        assert r.returncode == 0, r.stderr
        done = orjson.loads(r.stdout)
        assert done["had_record"] is False and done["data_keys"] > 0 and done["turn_shards"] > 0
        assert _run_keys_on_server(b, other) == []
        r = _cli(url, "run", "delete", other, "--force")
        assert r.returncode == 2 and f"no run {other!r}" in r.stderr  # nothing left: no run
        assert _dump(neighbour, _run_keys_on_server(neighbour, run_id)) == keep
        with pytest.raises(RunRecordMissing):  # the library refuses too, without force
            neighbour.redis.delete(neighbour.keys.meta)
            neighbour.delete_run()
