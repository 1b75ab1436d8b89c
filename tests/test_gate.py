"""The request gate (DESIGN section 6) on real servers: races, dead holders, drain, bad input."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests._dump import dump_run
from tests.conftest import connect_async
from tracestore import TraceStore
from tracestore.errors import (
    GatePoisoned,
    GateSealed,
    InvalidId,
    InvalidInput,
    LeaseFenced,
    NotDrained,
    SessionReleased,
    StaleVersion,
    UnknownLease,
)
from tracestore.gate import MAX_BLOCK_S, Lease, admit, admit_many, drain, install, settle
from tracestore.gate.cycle import _reopen_as, _seal_as
from tracestore.scripts import Batch, Cmd

# -- helpers ---------------------------------------------------------------------------------


def live_and_poison(store: TraceStore) -> tuple[set[str], set[str]]:
    k = store.keys
    live, poison = store.execute(
        Batch((Cmd(("ZRANGE", k.gate_leases, 0, -1), key=k.gate_leases), Cmd(("HKEYS", k.gate_poison), key=k.gate_poison)))
    )
    dec = lambda xs: {x.decode() if isinstance(x, bytes) else x for x in xs}  # noqa: E731
    return dec(live), dec(poison)


# -- basics ------------------------------------------------------------------------------------


def test_admit_settle_receipts_and_versions(store: TraceStore) -> None:
    g = store.gate
    st = g.status()
    assert (st.state, st.version, st.live, st.poisoned) == ("open", 0, 0, 0)
    lease = g.admit("s1", "worker-1", 30)
    assert isinstance(lease, Lease) and lease.version == 0 and lease.sid == "s1"
    assert g.status().live == 1
    first = g.settle(lease, "completed")
    assert (first.outcome, first.late, first.poisoned, first.replayed) == ("completed", False, False, False)
    # settling twice (a retry or a second caller) returns the first receipt, even with another outcome
    again = g.settle(lease.id, "failed")
    assert again == first and again.replayed and again.outcome == "completed"
    assert g.status().live == 0
    live = g.admit("s2", "worker-2", 30)
    rec, live_rec = g.lease_records([lease.id, live.id])
    assert live_rec is not None and (live_rec.sid, live_rec.holder, live_rec.outcome) == ("s2", "worker-2", None)
    # a settled lease keeps only its receipt (what a retried settle returns), until op_ttl_s
    assert rec is not None and (rec.outcome, rec.version, rec.settled_ms) == ("completed", 0, first.settled_ms)
    assert (rec.sid, rec.holder) == ("s1", "")
    assert sorted(store.redis.hkeys(store.keys.gate_lease(lease.id))) == [b"outcome", b"settled_ms", b"sid", b"version"]
    assert 0 < store.redis.pttl(store.keys.gate_lease(lease.id)) <= store.config.op_ttl_s * 1000
    g.settle(live, "completed")

    with g.weight_update(version=7, drain_timeout_s=1) as res:
        assert res.drained and res.ok
        assert g.status().sealed
    st = g.status()
    assert (st.state, st.version) == ("open", 7)
    assert g.admit("s1", "worker-1", 30).version == 7


def test_admit_under_seal_carries_the_retry_hint(store: TraceStore) -> None:
    g = store.gate
    st = g.seal(retry_after_ms=1234)
    assert st.sealed and st.sealed_ms is not None
    with pytest.raises(GateSealed) as ei:
        g.admit("s1", "w", 5)
    assert ei.value.retry_after_ms == 1234 and ei.value.version == 0
    assert g.status().live == 0
    assert g.seal().sealed_ms == st.sealed_ms  # sealing a sealed gate keeps its first seal time
    assert not g.reopen().sealed
    g.admit("s1", "w", 5)


def test_unknown_outcome_poisons_and_late_definite_settle_resolves(store: TraceStore) -> None:
    g = store.gate
    unknown = g.admit("s1", "w", 30)
    r = g.settle(unknown, "unknown")
    assert r.poisoned and not r.late
    expired = g.admit("s2", "w", 0.05)
    time.sleep(0.1)
    st = g.status()
    assert st.live == 0 and st.poisoned == 2  # the overdue lease counts as poisoned before any sweep
    assert {p.reason for p in st.poison} == {"unknown", "overdue"}
    g.seal()
    res = g.drain(1)
    assert res.drained and not res.ok and set(res.poisoned_ids) == {unknown.id, expired.id}
    assert res.newly_poisoned == (expired.id,)
    with pytest.raises(GatePoisoned) as ei:
        g.install(1)
    assert set(ei.value.lease_ids) == {unknown.id, expired.id}
    # the holder of the expired lease comes back with a definite outcome: its poison entry goes
    late = g.settle(expired, "completed")
    assert late.late and not late.poisoned
    assert live_and_poison(store) == (set(), {unknown.id})
    # settling the unknown one again does not change its first receipt (still poisoned)
    assert g.settle(unknown, "completed").poisoned
    with pytest.raises(GatePoisoned):
        g.install(1)
    assert g.clear_poison([unknown.id, "not-poisoned"], "retried-by-operator") == [unknown.id]
    assert g.lease_records([unknown.id])[0].resolution == "retried-by-operator"  # type: ignore[union-attr]
    assert g.install(1) == 0
    assert g.status().version == 1


def test_renew_extends_and_an_expired_lease_is_not_revived(store: TraceStore) -> None:
    g = store.gate
    lease = g.admit("s1", "w", 2)
    renewed = g.renew(lease, 8)  # one round trip after the admit: well inside its 2 s
    assert renewed.deadline_ms > lease.deadline_ms + 5000
    time.sleep(2.1)  # past the first deadline
    assert g.status().live == 1  # renewed: not overdue
    short = g.admit("s2", "w", 0.05)
    time.sleep(0.1)
    with pytest.raises(GatePoisoned):
        g.renew(short)
    assert short.id in live_and_poison(store)[1]
    g.settle(lease, "completed")
    with pytest.raises(InvalidInput, match="already settled"):
        g.renew(lease)


def test_admit_many_is_all_or_none_and_settle_many_settles_each(store: TraceStore) -> None:
    g = store.gate
    reqs = [(f"burst-{i}", f"w{i % 3}") for i in range(300)]
    leases = g.admit_many(reqs, 30)
    assert [x.sid for x in leases] == [sid for sid, _ in reqs] and len({x.id for x in leases}) == 300
    assert {x.version for x in leases} == {0} and len({x.deadline_ms for x in leases}) == 1
    assert g.status().live == 300
    rec = g.lease_records([leases[7].id])[0]
    assert rec is not None and (rec.sid, rec.holder) == ("burst-7", "w1")
    # a retry of the same call (same lease ids) returns the recorded admission, admits nothing more
    req = next(admit_many(store.context, reqs[:5], 30))
    first, again = store.execute(req), store.execute(req)
    assert first[:2] == again[:2] and (first[2], again[2]) == (0, 1)
    assert g.status().live == 305
    g.seal()
    before = dump_run(store)
    with pytest.raises(GateSealed):
        g.admit_many(reqs[:10], 30)
    with pytest.raises(InvalidInput, match="at most 1000"):
        g.admit_many([("s", "w")] * 1001, 30)
    with pytest.raises(InvalidId):
        g.admit_many([("ok", "w"), ("bad sid", "w")], 30)
    assert dump_run(store) == before
    assert g.admit_many([], 30) == []

    # settle_many: a lease never admitted among them is fenced, the others settled
    ids = [x.id for x in leases[:-1]]
    receipts = g.settle_many([*ids[:100], "0" * 32, *ids[100:]], "completed")
    assert [r.admitted for r in receipts].count(False) == 1 and not receipts[100].admitted
    assert g.status().live == 6
    receipts = g.settle_many(ids[:3], "failed")  # again: the first receipts
    assert [r.outcome for r in receipts] == ["completed"] * 3 and all(r.replayed for r in receipts)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(g.drain(20)))
    t.start()
    time.sleep(0.2)
    rest = [x.id for x in live_and_poison_leases(store)]
    assert len(rest) == 6
    g.settle_many(rest, "aborted")  # the settle that empties the live set wakes the drainer
    t.join(15)
    assert out and out[0].drained and out[0].waited_s < 10  # woken, not timed out


def test_a_released_session_is_admitted_no_more_requests(store: TraceStore) -> None:
    g = store.gate
    store.open_session("done-1", "train:1")
    store.open_session("live-1", "rollout:0")
    lease = g.admit("done-1", "w0", 30)  # admitted while live
    assert store.release(["done-1"], "train:1", "consumed") == ["done-1"]
    g.settle(lease, "completed")  # an in-flight request still settles
    before = dump_run(store)
    with pytest.raises(SessionReleased) as info:
        g.admit("done-1", "w0", 30)
    assert info.value.sid == "done-1"
    with pytest.raises(SessionReleased):  # all or none: the live session is not admitted either
        g.admit_many([("live-1", "w0"), ("done-1", "w0")], 30)
    assert dump_run(store) == before
    assert g.admit("live-1", "w0", 30).sid == "live-1"


def live_and_poison_leases(store: TraceStore) -> list[Lease]:
    live, _ = live_and_poison(store)
    return [Lease(x, 0) for x in sorted(live)]


# -- the seal race ---------------------------------------------------------------------------


def test_seal_race_no_admission_after_seal_and_no_lease_lost(store: TraceStore) -> None:
    g = store.gate
    sealed = threading.Event()
    admitted: list[Lease] = []
    expected_poison: set[str] = set()
    violations: list[str] = []
    refused = 0
    lock = threading.Lock()

    def worker(w: int) -> None:
        nonlocal refused
        i = 0
        while True:
            after_seal = sealed.is_set()
            try:
                lease = g.admit(f"s-{w}-{i}", f"w{w}", 1.0)
            except GateSealed:
                with lock:
                    refused += 1
                if after_seal:
                    return
                continue
            finally:
                i += 1
            if after_seal:
                violations.append(lease.id)
            with lock:
                admitted.append(lease)
            if i % 7 == 0:
                with lock:
                    expected_poison.add(lease.id)  # abandoned: must expire into poison
            elif i % 5 == 0:
                g.settle(lease, "unknown")
                with lock:
                    expected_poison.add(lease.id)
            else:
                g.settle(lease, "completed")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(admitted) < 60 and time.monotonic() < deadline:  # a busy gate, however slow the box
        time.sleep(0.01)
    st = g.seal()
    sealed.set()
    for t in threads:
        t.join(10)
    assert not violations, f"admitted after seal() returned: {violations[:3]}"
    assert len(admitted) > 50 and refused >= 8
    assert all(not t.is_alive() for t in threads)
    res = g.drain(5)
    assert res.drained and res.live == 0
    live, poison = live_and_poison(store)
    assert not live and poison == expected_poison
    records = g.lease_records([lease.id for lease in admitted])
    for lease, rec in zip(admitted, records, strict=True):
        assert rec is not None, f"lease {lease.id} lost"
        assert rec.admitted_ms <= st.sealed_ms  # type: ignore[operator]
        assert rec.outcome is not None or lease.id in poison


# -- a holder that dies -----------------------------------------------------------------------

HOLDER = """
import sys, time
from tracestore import TraceStore
st = TraceStore.connect(sys.argv[1], run=sys.argv[2], create_run=False)
lease = st.gate.admit("victim", "doomed-worker", float(sys.argv[3]))
print(lease.id, flush=True)
time.sleep(600)
"""


def test_killed_holder_expires_into_poison_then_clear_and_install(store: TraceStore, url: str) -> None:
    g = store.gate
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, store.run_id, "3.0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lease_id = proc.stdout.readline().strip()
        assert lease_id, "holder did not admit"
        assert g.status().live == 1
    finally:
        proc.kill()
        proc.wait(10)
    g.seal()
    res = g.drain(20)  # wakes at the dead lease's deadline (server clock) and poisons it
    assert res.drained and res.newly_poisoned == (lease_id,) and res.poisoned_ids == (lease_id,)
    assert res.waited_s < 10  # woken at the deadline, not at its own timeout
    with pytest.raises(GatePoisoned) as ei:
        g.install(1)
    assert ei.value.lease_ids == [lease_id]
    st = g.status()
    assert not st.installable and st.poison[0].reason == "expired"
    rec = g.lease_records([lease_id])[0]
    assert rec is not None and (rec.holder, rec.sid, rec.outcome) == ("doomed-worker", "victim", None)
    with pytest.raises(GatePoisoned):
        with g.weight_update(1, drain_timeout_s=1):
            pytest.fail("body must not run while poisoned")
    assert g.status().sealed  # weight_update found the gate sealed and left it so
    assert g.clear_poison([lease_id], "worker-died") == [lease_id]
    assert g.install(1) == 0
    st = g.reopen()
    assert (st.state, st.version, st.poisoned) == ("open", 1, 0)


# -- weight_update ------------------------------------------------------------------------------


def test_weight_update_reopens_without_installing_when_the_body_raises(store: TraceStore) -> None:
    g = store.gate
    g.settle(g.admit("s", "w", 5), "completed")
    with pytest.raises(RuntimeError, match="push failed"):
        with g.weight_update(3, drain_timeout_s=1):
            assert g.status().sealed
            raise RuntimeError("push failed")
    st = g.status()
    assert (st.state, st.version) == ("open", 0)
    with pytest.raises(StaleVersion):
        with g.weight_update(0, drain_timeout_s=1):
            pytest.fail("body must not run for a stale version")
    assert g.status().state == "open"
    live = g.admit("s", "w", 30)
    with pytest.raises(NotDrained):
        with g.weight_update(3, drain_timeout_s=0.1):
            pytest.fail("body must not run while a lease is live")
    assert g.status().state == "open"
    g.settle(live, "aborted")
    with g.weight_update(3, drain_timeout_s=1):
        pass
    assert g.status().version == 3


def test_weight_update_checks_the_version_before_sealing(store: TraceStore) -> None:
    g = store.gate
    fresh = dump_run(store)
    assert store.keys.gate not in fresh  # a fresh run: the gate has no key yet
    with pytest.raises(StaleVersion) as sv:
        with g.weight_update(0, drain_timeout_s=30):
            pytest.fail("body must not run for a version that can never install")
    assert (sv.value.current, sv.value.requested) == (0, 0)
    assert dump_run(store) == fresh  # nothing sealed, no ts:{R}:gate left behind
    with g.weight_update(4, drain_timeout_s=1):
        pass
    lease = g.admit("s", "w", 60)  # a live lease: a drain would wait its whole timeout
    before = dump_run(store)
    t0 = time.monotonic()
    for v in (4, 3):
        with pytest.raises(StaleVersion):
            with g.weight_update(v, drain_timeout_s=30):
                pytest.fail("body must not run")
    assert time.monotonic() - t0 < 5  # refused at once, not after the drain timeout
    assert dump_run(store) == before  # admissions were never refused; nothing written
    g.settle(g.admit("s2", "w", 5), "completed")
    g.settle(lease, "completed")


def test_weight_update_leaves_an_operators_seal_in_place(store: TraceStore) -> None:
    g = store.gate
    g.seal()  # an operator paused admissions
    with g.weight_update(4, drain_timeout_s=1):
        pass
    st = g.status()
    assert (st.state, st.version) == ("sealed", 4)  # installed, and still sealed for the operator
    with pytest.raises(RuntimeError):
        with g.weight_update(5, drain_timeout_s=1):
            raise RuntimeError("push failed")
    assert g.status().state == "sealed"
    assert g.reopen().state == "open"
    # an operator sealing during a weight update keeps the gate sealed after it
    with g.weight_update(5, drain_timeout_s=1):
        g.seal()
    assert (g.status().state, g.status().version) == ("sealed", 5)
    g.reopen()
    # sealer tokens: a retried seal still holds; another token cannot reopen it
    ctx = store.context
    a, b = ctx.op("a" * 32, "update"), ctx.op("b" * 32, "update")
    req = next(_seal_as(ctx, a, 6))
    assert store.execute(req)[-1] == store.execute(req)[-1] in ("a" * 32, b"a" * 32)
    assert store.run(_reopen_as(ctx, b)).state == "sealed"
    # a weight update that died while sealed: the next one takes its seal over and reopens
    with g.weight_update(6, drain_timeout_s=1):
        pass
    assert (g.status().state, g.status().version) == ("open", 6)
    a2 = ctx.op("a2" * 16, "update")
    assert store.run(_seal_as(ctx, a2, 7))
    assert store.run(_reopen_as(ctx, a2)).state == "open"


def test_async_weight_update_and_drain(url: str, run_id: str, arun: Any) -> None:
    async def main() -> None:
        st = await connect_async(url, run_id)
        try:
            g = st.gate
            lease = await g.admit("s", "w", 30)
            with pytest.raises(NotDrained):
                async with g.weight_update(2, drain_timeout_s=0.05):
                    pytest.fail("body must not run while a lease is live")
            assert (await g.status()).state == "open"
            await g.seal()

            async def settle_later() -> None:
                await asyncio.sleep(0.2)
                await g.settle(lease, "completed")

            task = asyncio.create_task(settle_later())
            res = await g.drain(20)
            await task
            assert res.drained and 0.15 < res.waited_s < 10  # woken by the settle, not timed out
            await g.reopen()
            with pytest.raises(ValueError):
                async with g.weight_update(2, drain_timeout_s=1):
                    raise ValueError("body")
            assert (await g.status()).version == 0
            async with g.weight_update(2, drain_timeout_s=1) as r:
                assert r.ok
            s = await g.status()
            assert (s.state, s.version) == ("open", 2)
        finally:
            await st.close()

    arun(main())


# -- concurrent installers --------------------------------------------------------------------


def test_concurrent_installers_one_wins_and_version_is_monotonic(store_factory: Any) -> None:
    stores = [store_factory() for _ in range(6)]
    stores[0].gate.seal()
    barrier = threading.Barrier(len(stores))
    wins: list[tuple[int, int]] = []
    stale: list[int] = []
    lock = threading.Lock()

    def installer(st: TraceStore, version: int) -> None:
        barrier.wait()
        try:
            prev = st.gate.install(version)
        except StaleVersion:
            with lock:
                stale.append(version)
        else:
            with lock:
                wins.append((prev, version))

    def race(versions: list[int]) -> None:
        wins.clear()
        stale.clear()
        threads = [threading.Thread(target=installer, args=(s, v)) for s, v in zip(stores, versions, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)

    race([1] * 6)  # one version, six installers: exactly one wins
    assert wins == [(0, 1)] and len(stale) == 5
    race([2, 3, 4, 5, 6, 7])  # different versions: successes form an increasing chain
    chain = sorted(wins)
    assert chain[0][0] == 1 and chain[-1][1] == 7
    for (p1, v1), (p2, v2) in zip(chain, chain[1:], strict=False):
        assert v1 == p2 and p1 < v1 < v2
    assert len(wins) + len(stale) == 6
    assert stores[0].gate.status().version == 7


# -- retries are idempotent ----------------------------------------------------------------------


def test_retried_scripts_replay_their_first_reply(store: TraceStore) -> None:
    ctx = store.context
    # admit: the lease id is the operation id, so a retry returns the same lease
    gen = admit(ctx, "s", "w", 30)
    req = next(gen)
    first, retry = store.execute(req), store.execute(req)
    assert first[:2] == retry[:2] and (first[2], retry[2]) == (0, 1)  # version, deadline; replayed
    assert store.gate.status().live == 1
    lid = req.args[1]  # ARGV: ttl, then (lease id, sid, holder)
    # settle: a retry returns the first receipt
    req = next(settle(ctx, lid, "completed"))
    a, b = store.execute(req), store.execute(req)
    assert a[:6] == b[:6] and (a[6], b[6]) == (1, 0)
    # install: a retried success is not reported as StaleVersion
    store.gate.seal()
    req = next(install(ctx, 5))
    assert store.execute(req) == store.execute(req)
    assert store.gate.status().version == 5
    with pytest.raises(StaleVersion):
        store.gate.install(5)


# -- bad input: typed errors and no state change --------------------------------------------------


def test_settling_a_lease_never_admitted_fences_its_id(store: TraceStore) -> None:
    """The recovery of an admit whose reply was lost and which never ran (README, "Lost
    replies"): its settle succeeds and fences the id; an admit with it is refused, nothing
    admitted, alone or in a batch (tests/test_lost_replies.py loses the reply for real)."""
    g = store.gate
    before = g.status()
    receipt = g.settle("never-1", "aborted")
    assert (receipt.lease_id, receipt.outcome, receipt.version) == ("never-1", "aborted", -1)
    assert (receipt.admitted, receipt.late, receipt.poisoned, receipt.replayed) == (False, False, False, False)
    again = g.settle("never-1", "completed")
    assert again == receipt and again.replayed  # the first settlement is final, as for any lease
    with pytest.raises(LeaseFenced) as ei:
        g.admit("s-late", "w", 30, op_id="never-1")  # the lost admit, arriving late
    assert ei.value.lease_id == "never-1" and "new lease" in str(ei.value)
    # admit_many: a fenced lease anywhere in the batch refuses the whole batch
    assert not g.settle("many-9#1", "unknown").admitted  # fenced: an unknown outcome poisons nothing
    with pytest.raises(LeaseFenced) as ei:
        g.admit_many([("a", "w"), ("b", "w"), ("c", "w")], 30, op_id="many-9")
    assert ei.value.lease_id == "many-9#1"
    after = g.status()
    assert (after.live, after.poisoned, after.version) == (before.live, before.poisoned, before.version) == (0, 0, 0)
    recs = g.lease_records(["many-9#0", "many-9#2"])
    assert recs == [None, None]  # nothing of the batch was admitted
    with pytest.raises(UnknownLease):  # never admitted: nothing to renew
        g.renew("never-1")
    # the fence is a receipt: it expires with the receipt retention (op_ttl_s), a lease's TTL
    pttl = store.redis.pttl(store.keys.gate_lease("never-1"))
    assert 0 < pttl <= store.context.op_ttl_ms
    lease = g.admit("s-late", "w", 30)  # a new lease for the same session is admitted as usual
    assert g.settle(lease, "completed").admitted and g.status().live == 0


def test_bad_input_raises_typed_errors_and_changes_nothing(store: TraceStore) -> None:
    g = store.gate
    g.settle(g.admit("s0", "w", 30), "completed")
    live = g.admit("s1", "w", 30)
    before = dump_run(store)
    assert before
    with pytest.raises(UnknownLease):
        g.renew("0" * 32)
    with pytest.raises(InvalidInput, match="ttl_s"):
        g.admit("s2", "w", -1)
    with pytest.raises(InvalidInput, match="ttl_s"):
        g.admit("s2", "w", 0)
    with pytest.raises(InvalidInput, match="ttl_s"):
        g.renew(live, -5)
    with pytest.raises(InvalidInput, match="outcome"):
        g.settle(live, "done")
    with pytest.raises(InvalidInput, match="timeout_s"):
        g.drain(-1)
    with pytest.raises(InvalidInput, match="version"):
        g.install(-1)
    with pytest.raises(InvalidId):
        g.admit("bad sid", "w", 5)
    with pytest.raises(InvalidId):
        g.settle("no{braces}", "completed")
    with pytest.raises(NotDrained) as nd:
        g.install(1)  # open gate
    assert nd.value.state == "open"
    with pytest.raises(StaleVersion):
        g.install(0)  # not larger than the current version
    assert dump_run(store) == before

    g.seal()
    with pytest.raises(NotDrained) as nd:
        g.install(1)  # sealed, but a lease is live
    assert (nd.value.state, nd.value.live) == ("sealed", 1)
    g.settle(live, "completed")
    g.install(2)
    before = dump_run(store)
    for v in (2, 1, 0):
        with pytest.raises(StaleVersion) as sv:
            g.install(v)
        assert (sv.value.current, sv.value.requested) == (2, v)
    with pytest.raises(GateSealed):
        g.admit("s3", "w", 5)
    assert dump_run(store) == before
    assert g.status().version == 2


# -- install guards, one test each (issue 18 item 2) ----------------------------------------------


def test_install_is_refused_while_any_lease_is_live(store_factory: Any) -> None:
    """Guard: gate_install.lua's live-lease check (invariant 1: no request in flight sees
    its weights change). Every refusal changes nothing; the settle of the last lease
    makes the same install succeed."""
    a, b = store_factory(), store_factory()
    leases = [a.gate.admit(f"s{i}", f"w{i}", 30) for i in range(3)]
    a.gate.seal()
    for left in (3, 2, 1):
        before = dump_run(a)
        for installer in (a, b):  # any client, same answer
            with pytest.raises(NotDrained) as nd:
                installer.gate.install(1)
            assert (nd.value.state, nd.value.live) == ("sealed", left)
        assert dump_run(a) == before
        st = b.gate.status()
        assert (st.version, st.live, st.installable) == (0, left, False)
        a.gate.settle(leases[3 - left], "completed")
    assert b.gate.install(1) == 0
    assert a.gate.status().version == 1
    assert [r.version for r in a.gate.lease_records([x.id for x in leases])] == [0, 0, 0]  # type: ignore[union-attr]


def test_install_is_refused_on_an_open_gate(store: TraceStore) -> None:
    """Guard: gate_install.lua's sealed check. With no lease live and nothing poisoned, only
    the open state stands between a caller and a weight change under new admissions."""
    g = store.gate
    g.settle(g.admit("s0", "w", 30), "completed")
    for _ in range(2):  # a gate never sealed, then one sealed and reopened
        st = g.status()
        assert (st.state, st.live, st.poisoned, st.installable) == ("open", 0, 0, False)
        before = dump_run(store)
        with pytest.raises(NotDrained) as nd:
            g.install(1)
        assert (nd.value.state, nd.value.live) == ("open", 0)
        assert dump_run(store) == before
        g.seal()
        g.reopen()
    g.seal()
    assert g.install(1) == 0
    assert g.status().version == 1


# -- drain wakes on the last settle ----------------------------------------------------------------


def test_drain_wakes_on_the_last_settle_without_polling(store: TraceStore) -> None:
    g = store.gate
    leases = [g.admit(f"s{i}", "w", 30) for i in range(50)]
    g.seal()
    requests: list[str] = []
    out: dict[str, Any] = {}

    def drainer() -> None:
        # Drive the drain operation by hand to count the requests it sends.
        gen = drain(store.context, 20)
        try:
            req = next(gen)
            while True:
                requests.append(type(req).__name__ if not isinstance(req, Cmd) else str(req.args[0]))
                req = gen.send(store.execute(req))
        except StopIteration as stop:
            out["res"] = stop.value
            out["t"] = time.monotonic()

    t = threading.Thread(target=drainer)
    t.start()
    time.sleep(0.2)
    for lease in leases[:-1]:
        g.settle(lease, "completed")
    time.sleep(0.3)
    assert t.is_alive(), "drain returned with a lease still live"
    t0 = time.monotonic()
    g.settle(leases[-1], "completed")
    t.join(15)
    assert not t.is_alive()
    assert out["t"] - t0 < 10  # woken by the settle, long before drain's own 20 s timeout
    res = out["res"]
    assert res.drained and res.live == 0 and res.waited_s < 15
    # a check, then blocking reads each followed by a check; one blocking read (woken by the
    # last settle, not by the other 49), unless the machine was so slow that a read reached its
    # MAX_BLOCK_S cap first: at most one more per MAX_BLOCK_S the drain waited
    assert requests[0] == "Eval" and requests[1::2] == ["BLPOP"] * (len(requests) // 2)
    assert requests[2::2] == ["Eval"] * (len(requests) // 2) and len(requests) % 2 == 1 and len(requests) >= 3
    assert len(requests) // 2 <= 1 + int(res.waited_s / MAX_BLOCK_S), requests


def test_several_drainers_all_wake(store_factory: Any) -> None:
    s1, s2, s3 = store_factory(), store_factory(), store_factory()
    lease = s1.gate.admit("s", "w", 30)
    s1.gate.seal()
    results: list[Any] = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.gate.drain(20))) for s in (s2, s3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s1.gate.settle(lease, "completed")
    for t in threads:
        t.join(15)
    assert len(results) == 2 and all(r.drained for r in results)
    assert time.monotonic() - t0 < 10  # both woken by the settle, not by their 20 s timeout


def test_drain_times_out_and_reports_live(store: TraceStore) -> None:
    g = store.gate
    g.admit("s", "w", 30)
    g.seal()
    t0 = time.monotonic()
    res = g.drain(0.3)
    assert not res.drained and res.live == 1 and not res.ok
    assert 0.25 < time.monotonic() - t0 < 10
    assert g.drain(0).live == 1


def test_drain_blocks_longer_than_the_socket_timeout(url: str, run_id: str, arun: Any) -> None:
    # The blocking read runs on a connection whose read timeout covers the wait
    # (sync and async, standalone and cluster): a short socket timeout does not cut it.
    with TraceStore.connect(url, run=run_id, socket_timeout_s=0.5) as st:
        st.gate.admit("s", "w", 30)
        res = st.gate.drain(1.2)
        assert res.live == 1 and res.waited_s >= 1.1

    async def main() -> None:
        st = await connect_async(url, run_id, socket_timeout_s=0.5)
        try:
            res = await st.gate.drain(1.2)
            assert res.live == 1 and res.waited_s >= 1.1
        finally:
            await st.close()

    arun(main())
