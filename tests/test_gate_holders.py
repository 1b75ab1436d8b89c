"""Holders that heal the gate (issue 25 item 1): heartbeats, the leases of dead holders, their resolution.

Real servers; the engine of the end-to-end test is the scripted SGLang-shaped
engine process (tests/_scripted_engine.py) and the holder a real process,
frozen with SIGSTOP (its connection to the engine stays open, its heartbeat
stops) and then resumed: it comes back to a lease already resolved.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner

from tests._dump import dump_run
from tests._families import FamilyDirs, family_dirs
from tests._scripted_engine import ScriptedEngine
from tests.conftest import connect_async
from tracestore import HolderNotDead, InvalidId, InvalidInput, TraceStore
from tracestore.cli import main
from tracestore.gate import AdmitRequest, DeadLease, SettlementReceipt

__all__ = ["family_dirs"]  # the session fixture, imported so pytest finds it

T = TypeVar("T")
ENGINE = "http://127.0.0.1:9/"  # (never contacted by the in-process tests)


def wait_for(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """Call ``read`` until ``ok`` holds for its value; returns it (AssertionError on timeout)."""
    end = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value):
            return value
        assert time.monotonic() < end, f"never reached: last value {value!r}"
        time.sleep(0.02)


def dead_ids(store: TraceStore) -> list[str]:
    return sorted(d.lease_id for d in store.gate.dead_holder_leases())


# -- the lease record ---------------------------------------------------------------------------


def test_a_lease_records_its_engine_and_request(store: TraceStore) -> None:
    g = store.gate
    plain = g.admit("s0", "gw-0", 30)
    assert sorted(store.redis.hkeys(store.keys.gate_lease(plain.id))) == [
        b"admitted_ms", b"deadline_ms", b"holder", b"sid", b"ttl_ms", b"version",
    ]  # None keeps today's record
    one = g.admit("s1", "gw-1", 30, engine="http://10.0.0.7:30000", request="rid-1")
    many = g.admit_many(
        [("s2", "gw-1"), AdmitRequest("s3", "gw-1", "https://e.example/v1", "rid-3"), ("s4", "gw-2", ENGINE, "rid-4")],
        30,
    )
    recs = g.lease_records([plain.id, one.id, *(x.id for x in many)])
    got = [(r.sid, r.holder, r.engine, r.request) for r in recs if r is not None]
    assert got == [
        ("s0", "gw-0", None, None),
        ("s1", "gw-1", "http://10.0.0.7:30000", "rid-1"),
        ("s2", "gw-1", None, None),
        ("s3", "gw-1", "https://e.example/v1", "rid-3"),
        ("s4", "gw-2", ENGINE, "rid-4"),
    ]
    before = dump_run(store)
    for bad in ("ftp://e:1", "http://", "http://a b", "10.0.0.7:30000", "http://" + "x" * 250, 7):
        with pytest.raises(InvalidInput, match="engine"):
            g.admit("s5", "gw-1", 30, engine=bad, request="r")  # type: ignore[arg-type]
    with pytest.raises(InvalidId, match="engine request id"):
        g.admit("s5", "gw-1", 30, engine=ENGINE, request="has space")
    with pytest.raises(InvalidInput, match="requests"):
        g.admit_many([("s5", "gw-1", ENGINE, "r", "extra")], 30)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="on_unconfirmed"):
        g.admit("s5", "gw-1", 30, on_unconfirmed="ignore")
    with pytest.raises(InvalidInput, match="retry_until_s"):
        g.settle_many([plain], "completed", retry_until_s=-1)
    assert dump_run(store) == before  # bad input writes nothing
    # settled with a definite outcome, a lease keeps only its receipt (engine and request go)
    g.settle(one, "completed", resolution="engine-restarted")
    rec = g.lease_records([one.id])[0]
    assert rec is not None and (rec.engine, rec.request, rec.resolution) == (None, None, "engine-restarted")
    g.settle_many([plain, *many], "completed")
    assert g.status().live == 0
    assert not store.redis.exists(store.keys.gate_held)  # every settle left the held index


# -- dead holders ---------------------------------------------------------------------------------


def test_only_the_leases_of_holders_whose_heartbeat_stopped_are_listed(store: TraceStore) -> None:
    g = store.gate
    g.heartbeat("gw-short", 0.3)
    g.heartbeat("gw-long", 120)
    a1 = g.admit("a1", "gw-short", 120, engine=ENGINE, request="ra1")
    a2 = g.admit("a2", "gw-short", 120)  # no engine: listed, but nobody can abort it
    a3 = g.admit("a3", "gw-short", 120, engine=ENGINE, request="ra3")
    g.admit("b1", "gw-long", 120, engine=ENGINE, request="rb1")
    c1 = g.admit("c1", "gw-never", 120, engine=ENGINE, request="rc1")  # never heart-beats: left to its deadline
    held = store.redis.zrange(store.keys.gate_held, 0, -1)
    assert f"gw-short {a1.id}".encode() in held and not any(m.startswith(b"gw-never ") for m in held)
    assert store.redis.hget(store.keys.gate_lease(c1.id), "held") is None  # not indexed: costs nothing more
    g.settle(a3, "completed")  # settled by its holder before it stopped: not listed
    dead = wait_for(lambda: g.dead_holder_leases(), lambda d: len(d) == 2)
    by_id = {d.lease_id: d for d in dead}
    assert set(by_id) == {a1.id, a2.id}
    d1 = by_id[a1.id]
    assert (d1.sid, d1.holder, d1.engine, d1.request, d1.state, d1.version) == ("a1", "gw-short", ENGINE, "ra1", "live", 0)
    assert d1.holder_deadline_ms < d1.server_ms and d1.deadline_ms > d1.server_ms
    assert (by_id[a2.id].engine, by_id[a2.id].request) == (None, None)


def test_a_holder_that_comes_back_is_not_robbed(store: TraceStore) -> None:
    """Between the two steps (list, then settle) the holder heart-beats again: the settle
    script sees it alive and settles nothing; the lease stays the holder's."""
    g = store.gate
    g.heartbeat("gw-a", 0.2)
    lease = g.admit("s1", "gw-a", 120, engine=ENGINE, request="r1")
    never = g.admit("s2", "gw-never", 120)
    dead = wait_for(lambda: g.dead_holder_leases(), bool)
    assert [d.lease_id for d in dead] == [lease.id]
    g.heartbeat("gw-a", 60)  # it comes back (the caller aborted nothing yet, or its abort was late)
    before = dump_run(store)
    out = g.settle_dead([*dead, never.id])
    assert all(isinstance(x, HolderNotDead) for x in out)
    back, nb = out
    assert isinstance(back, HolderNotDead) and isinstance(nb, HolderNotDead)
    assert (back.lease_id, back.holder) == (lease.id, "gw-a") and back.deadline_ms is not None
    assert (nb.holder, nb.deadline_ms) == ("gw-never", None) and "never heart-beat" in str(nb)
    assert dump_run(store) == before  # nothing written
    assert g.status().live == 2 and dead_ids(store) == []
    # it stops again, for good: now the lease is resolved, and its own late settle replays that
    g.heartbeat("gw-a", 0.05)
    wait_for(lambda: dead_ids(store), lambda ids: ids == [lease.id])
    (receipt,) = g.settle_dead([lease])
    assert isinstance(receipt, SettlementReceipt)
    assert (receipt.outcome, receipt.resolution, receipt.replayed) == ("aborted", "holder-dead", False)
    late = g.settle(lease, "completed")
    assert late.replayed and (late.outcome, late.resolution) == ("aborted", "holder-dead")
    assert g.lease_records([lease.id])[0].resolution == "holder-dead"  # type: ignore[union-attr]
    with pytest.raises(InvalidInput, match="outcome"):
        g.settle_dead([never], "completed")  # a dead holder's lease is aborted or failed, nothing else
    g.settle(never, "completed")
    assert g.status().live == 0


def test_resolve_dead_holders_settles_what_abort_stopped_and_leaves_the_rest(store: TraceStore) -> None:
    g = store.gate
    g.heartbeat("gw-dead", 0.2)
    g.heartbeat("gw-live", 120)
    stopped = g.admit("s1", "gw-dead", 120, engine=ENGINE, request="r1")
    unanswered = g.admit("s2", "gw-dead", 120, engine=ENGINE, request="r2")
    expired = g.admit("s3", "gw-dead", 0.3, engine=ENGINE, request="r3")  # expires into poison first
    live = g.admit("s4", "gw-live", 120, engine=ENGINE, request="r4")
    wait_for(g.status, lambda st: st.poisoned == 1 and st.live == 3)
    wait_for(lambda: dead_ids(store), lambda ids: len(ids) == 3)
    seen: list[Sequence[DeadLease]] = []

    def abort(leases: Sequence[DeadLease]) -> list[str]:
        seen.append(leases)
        return [d.lease_id for d in leases if d.request in ("r1", "r3")]  # r2's engine did not answer

    rep = g.resolve_dead_holders(abort)
    assert sorted(d.lease_id for d in seen[0]) == sorted([stopped.id, unanswered.id, expired.id])
    assert {d.lease_id: d.state for d in seen[0]}[expired.id] in ("overdue", "poisoned")
    assert sorted(r.lease_id for r in rep.settled) == sorted([stopped.id, expired.id])
    assert all(r.outcome == "aborted" and r.resolution == "holder-dead" for r in rep.settled)
    assert rep.unresolved == (unanswered.id,) and rep.holder_back == () and rep.dead_holders == ("gw-dead",)
    st = g.status()
    assert (st.live, st.poisoned) == (2, 0)  # the expired one's poison is resolved: its request was stopped
    assert g.resolve_dead_holders(lambda leases: []).unresolved == (unanswered.id,)  # never settled blindly
    g.settle_many([unanswered, live], "completed")
    report = g.resolve_dead_holders(abort)
    assert report.found == () and report.dead_holders == ("gw-dead",)
    assert store.gc(scan_data=False, holder_retention_s=0).holders_forgotten == ("gw-dead",)
    assert g.resolve_dead_holders(abort).dead_holders == ()
    assert g.holder_done("gw-live") and not store.redis.exists(store.keys.gate_holders)


def test_a_holder_done_keeps_its_heartbeat_while_it_holds_leases(store: TraceStore) -> None:
    g = store.gate
    g.heartbeat("gw", 60)
    lease = g.admit("s", "gw", 60)
    assert not g.holder_done("gw")  # its lease must stay resolvable if it does not come back
    g.settle(lease, "completed")
    assert g.holder_done("gw") and g.holder_done("gw")  # idempotent
    assert store.gc(scan_data=False, holder_retention_s=0).holders_forgotten == ()


def test_async_gate_resolves_with_its_abort_in_a_worker_thread(url: str, run_id: str, arun: Any) -> None:
    async def main() -> None:
        st = await connect_async(url, run_id)
        try:
            g = st.gate
            await g.heartbeat("gw-x", 0.1)
            lease = await g.admit("s", "gw-x", 60, engine=ENGINE, request="r")
            end = time.monotonic() + 30
            while not await g.dead_holder_leases():
                assert time.monotonic() < end
                await asyncio.sleep(0.02)
            threads: list[str] = []

            def abort(leases: Sequence[DeadLease]) -> list[str]:
                threads.append(threading.current_thread().name)
                return [d.lease_id for d in leases]

            rep = await g.resolve_dead_holders(abort)
            assert [r.lease_id for r in rep.settled] == [lease.id]
            assert threads and threads[0] != "MainThread"  # the event loop was not blocked by it
            assert (await g.status()).live == 0
        finally:
            await st.close()

    arun(main())


# -- end to end: a hung holder, a real engine, tracestore gc --------------------------------------

# (ttl 5 s, a beat every 0.2 s: a holder descheduled for a few seconds on a loaded machine is
# still alive at the first gc; once stopped, it is dead within 5 s, long before the 50 s answer)
HOLDER = r"""
import json, sys, threading, time, urllib.request
from tracestore import TraceStore
url, run, engine, holder = sys.argv[1:5]
st = TraceStore.connect(url, run=run, create_run=False)
st.gate.heartbeat(holder, 5.0)
lease = st.gate.admit("victim", holder, 300, engine=engine, request="rid-victim")
print(lease.id, flush=True)
def beat():
    while True:
        st.gate.heartbeat(holder, 5.0)
        time.sleep(0.2)
threading.Thread(target=beat, daemon=True).start()
body = json.dumps({"rid": "rid-victim", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2000}})
req = urllib.request.Request(engine + "/generate", data=body.encode(), headers={"Content-Type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=600).read())
finish = out["meta_info"]["finish_reason"]["type"]
r = st.gate.settle(lease, "aborted" if finish == "abort" else "completed")
print(finish, r.outcome, r.replayed, r.resolution, flush=True)
"""


def test_gc_aborts_a_hung_holders_request_at_its_engine_and_settles_its_lease(
    store: TraceStore, url: str, backend: str, family_dirs: FamilyDirs
) -> None:
    if backend not in ("valkey", "cluster"):
        pytest.skip("runs on valkey and cluster (an engine process per backend costs seconds)")
    g = store.gate
    with ScriptedEngine(family_dirs["qwen3"], "sglang") as eng:
        eng.script(default={"ids": list(range(200, 1200))}, token_delay_s=0.05)  # ~50 s unless aborted
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, url, store.run_id, eng.url, "gw-hung"],
            stdout=subprocess.PIPE, text=True, env={**os.environ},
        )
        try:
            assert proc.stdout is not None
            lease_id = proc.stdout.readline().strip()
            assert lease_id, "the holder did not admit"
            eng.wait_log(lambda log: any(r["rid"] == "rid-victim" and r["state"] == "running" for r in log))
            r = CliRunner().invoke(main, ["gc", "--url", url, "--run", store.run_id, "--no-scan"])
            assert r.exit_code == 0 and "leases of dead holders resolved" not in r.output, r.output  # alive: untouched
            os.kill(proc.pid, signal.SIGSTOP)  # hung: its connection to the engine stays open, its heartbeat stops
            wait_for(lambda: dead_ids(store), lambda ids: ids == [lease_id])
            assert g.status().live == 1
            r = CliRunner().invoke(main, ["gc", "--url", url, "--run", store.run_id, "--no-scan"])
            assert r.exit_code == 0, r.output
            assert f"leases of dead holders resolved: {lease_id}" in r.output
            log = eng.wait_log(lambda log: log[0]["state"] != "running")
            assert (log[0]["state"], log[0]["finish"]) == ("aborted", "abort")  # stopped at the engine, by gc
            assert len(log[0]["output_ids"]) < 1000
            st = g.status()
            assert (st.live, st.poisoned) == (0, 0)
            with g.weight_update(1, drain_timeout_s=5):  # nothing left to block it
                pass
            os.kill(proc.pid, signal.SIGCONT)  # it comes back: its settle replays the resolution
            assert proc.stdout.readline().split() == ["abort", "aborted", "True", "holder-dead"]
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    assert g.status().version == 1
