"""Leases through a failover of the run's primary (issue 25 items 5 and 6), on a 3+3 cluster.

* An admit under ``durability="replicas"`` whose write no replica confirmed
  (DurabilityUnconfirmed) is settled by its caller's retry path, not left to
  expire into poison: by hand (``settle(err.lease_id, "aborted",
  retry_until_s=...)``) or by the admit itself (``on_unconfirmed="settle"``).
* Settles whose replies are lost while the control slot's primary dies are
  sent again with their lease ids until they land (``retry_until_s``): load
  through a SIGKILL of that primary and a takeover leaves 0 live and 0
  poisoned leases.

Each test starts its own cluster (it breaks it); the loss is arranged as in
tests/test_failover.py, not hoped for.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from tracestore import DurabilityUnconfirmed, LeaseFenced, OutcomeUnknown, StorageError, TraceStore
from tracestore.servers import LocalCluster

T = TypeVar("T")


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A fresh 3+3 cluster (the test breaks it)."""
    c = LocalCluster(primaries=3, replicas=1).start()
    yield c
    c.stop()


@pytest.fixture
def auto_cluster() -> Iterator[LocalCluster]:
    """A fresh 3+3 cluster that fails over by itself: a primary silent for 2 s is replaced
    by its replica (cluster-node-timeout 2000 ms, the default is 15 s)."""
    c = LocalCluster(primaries=3, replicas=1, extra_args=["--cluster-node-timeout", "2000"]).start()
    yield c
    c.stop()


def wait_for(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 60.0) -> T:
    """Call ``read`` until ``ok`` holds for its value (errors of a failover retried); returns it."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            value = read()
            if ok(value):
                return value
        except StorageError:
            pass
        assert time.monotonic() < end, "never reached"
        time.sleep(0.05)


def _connect(cluster: LocalCluster, run: str, timeout_s: float) -> TraceStore:
    return TraceStore.connect(cluster.url, run=run, durability="replicas", durability_timeout_s=timeout_s)


def _fail_over(cluster: LocalCluster, primary: Any, replica: Any) -> None:
    """SIGKILL ``primary``, promote ``replica``, bring the old primary back as its replica."""
    primary.kill()
    replica.resume()
    cluster.takeover(replica)
    primary.restart()
    cluster.wait_replicas_online()


def test_an_unconfirmed_admit_is_settled_by_its_caller_through_a_failover(cluster: LocalCluster) -> None:
    """The documented recovery: the admit ran on the primary, no replica has it, the primary
    dies. The caller's settle of ``err.lease_id``, sent again until it lands, fences the id on
    the promoted replica (which never saw the admit): nothing live, nothing poisoned, and the
    lost admit can never arrive late."""
    run = f"gf-{uuid.uuid4().hex[:8]}"
    st, short = _connect(cluster, run, 10), _connect(cluster, run, 0.3)
    try:
        st.gate.settle(st.gate.admit("warm", "gw", 30), "completed")  # scripts loaded, replicated
        primary = cluster.primary_of(st.keys.gate)
        replica = cluster.cut_replica(primary)
        with pytest.raises(DurabilityUnconfirmed) as ei:
            short.gate.admit("s1", "gw", 60)
        err = ei.value
        assert err.lease_id and err.leases_settled is None  # (no on_unconfirmed: the caller's to settle)
        assert short.gate.status().live == 1  # it ran on the primary: a lease nobody would settle
        _fail_over(cluster, primary, replica)
        receipt = st.gate.settle(err.lease_id, "aborted", retry_until_s=60)
        assert (receipt.lease_id, receipt.admitted) == (err.lease_id, False)  # fenced: the promoted replica lacked it
        st_ = wait_for(st.gate.status, lambda s: True)
        assert (st_.live, st_.poisoned) == (0, 0)
        with pytest.raises(LeaseFenced):
            st.gate.admit("s1", "gw", 60, op_id=err.op_id)  # the lost admit, replayed late: refused
        with st.gate.weight_update(1, drain_timeout_s=5):
            pass
    finally:
        short.close()
        st.close()


def test_on_unconfirmed_settle_settles_the_lease_before_raising(cluster: LocalCluster) -> None:
    """The reliability run's 28 poisoned leases: admits whose replica acknowledged late. With
    on_unconfirmed="settle" the admit sends its settle again until a replica confirms it."""
    run = f"gf-{uuid.uuid4().hex[:8]}"
    st, short = _connect(cluster, run, 10), _connect(cluster, run, 0.3)
    try:
        st.gate.settle(st.gate.admit("warm", "gw", 30), "completed")
        primary = cluster.primary_of(st.keys.gate)
        replica = cluster.cut_replica(primary)
        out: list[BaseException] = []

        def admit() -> None:
            try:
                short.gate.admit("s2", "gw", 60, on_unconfirmed="settle")
            except BaseException as exc:  # noqa: BLE001 - inspected below
                out.append(exc)

        t = threading.Thread(target=admit)
        t.start()
        pc = primary.client()
        try:
            def settled_on_primary() -> bool:  # the admit ran, and its settle too (not confirmed yet)
                keys = pc.scan_iter(match=st.keys.gate_lease("*"), count=1000)
                return any(pc.hget(k, "outcome") == b"aborted" for k in keys)

            wait_for(settled_on_primary, bool)
        finally:
            pc.close()
        assert t.is_alive()  # still sending its settle: no replica confirmed it
        replica.resume()
        cluster.wait_replicas_online()
        t.join(60)
        assert not t.is_alive() and len(out) == 1
        err = out[0]
        assert isinstance(err, DurabilityUnconfirmed) and err.leases_settled is True
        assert "settled aborted" in str(err)
        (rec,) = st.gate.lease_records([err.lease_id or ""])
        assert rec is not None and rec.outcome == "aborted"
        s = st.gate.status()
        assert (s.live, s.poisoned) == (0, 0)
    finally:
        short.close()
        st.close()


def test_settles_ride_through_a_primary_failover_mid_load(auto_cluster: LocalCluster) -> None:
    """Four holders admit and settle while the control slot's primary is SIGKILLed and the
    cluster fails over by itself (seconds without a primary: longer than a client's own
    retries of a call). Every settle is sent with retry_until_s (same lease ids), every
    unconfirmed admit settles itself: afterwards no lease is live or poisoned, and every
    lease a holder was given was settled completed. (Without them, the settles that failed
    during the failover left their leases live: issue 25's 15-16 poisoned leases.)"""
    cluster = auto_cluster
    run = f"gf-{uuid.uuid4().hex[:8]}"
    stores = [_connect(cluster, run, 2) for _ in range(4)]
    stop = threading.Event()
    lock = threading.Lock()
    given: list[str] = []
    settled: list[str] = []
    unknown: list[OutcomeUnknown] = []
    crashed: list[BaseException] = []

    def holder(w: int, st: TraceStore) -> None:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                try:
                    lease = st.gate.admit(f"s-{w}-{i}", f"gw-{w}", 120, on_unconfirmed="settle")
                except OutcomeUnknown as exc:
                    with lock:
                        unknown.append(exc)
                    if not exc.leases_settled:  # its own settle gave up: settle it again, as a caller must
                        st.gate.settle_many(list(exc.lease_ids), "aborted", retry_until_s=120)
                    continue
                except StorageError:  # refused before it ran (no replica in sync yet): nothing to settle
                    time.sleep(0.05)
                    continue
                with lock:
                    given.append(lease.id)
                (r,) = st.gate.settle_many([lease], "completed", retry_until_s=120)
                assert r.outcome == "completed"
                with lock:
                    settled.append(lease.id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            crashed.append(exc)

    threads = [threading.Thread(target=holder, args=(w, s)) for w, s in enumerate(stores)]
    try:
        st = stores[0]
        st.gate.status()
        for t in threads:
            t.start()
        wait_for(lambda: len(settled), lambda n: n >= 40)
        primary = cluster.primary_of(st.keys.gate)
        (replica,) = cluster.replicas_of(primary)
        before = len(settled)
        primary.kill()  # mid-load: settles and admits in flight lose their replies
        wait_for(lambda: cluster.primary_of(st.keys.gate), lambda p: p is replica)  # the cluster's own failover
        primary.restart()
        cluster.wait_replicas_online()
        wait_for(lambda: len(settled), lambda n: n >= before + 40)  # the load goes on after the failover
        stop.set()
        for t in threads:
            t.join(180)
        assert not crashed, crashed
        assert all(not t.is_alive() for t in threads)
        assert cluster.primary_of(st.keys.gate) is replica
        s = wait_for(st.gate.status, lambda s: True)
        assert (s.live, s.poisoned) == (0, 0)
        assert sorted(settled) == sorted(given)
        recs = st.gate.lease_records(given)
        assert all(r is not None and r.outcome == "completed" for r in recs)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for s in stores:
            s.close()
