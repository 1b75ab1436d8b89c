"""Failover: the stall of a hung primary, and what a failover to a lagging replica loses (issue 11).

Two experiments, each on fresh local clusters of 3 primaries + 3 replicas
(embedded valkey, ``cluster-node-timeout`` 3 s):

``stall``
    A client calls ``heartbeat`` (one control-plane script) in a loop,
    counting failures (StorageError) and going on. The primary serving the
    run's control plane is SIGSTOPped (a hung node: connections stay open,
    nothing answers). Figures: ``failover_s`` (from the SIGSTOP until every
    live node sees the replica as primary) and ``stall_s`` (from the SIGSTOP
    until the first successful call after it), with the old default
    timeouts (socket 10 s, connect 5 s) and the new ones (socket 1 s,
    connect 2 s), side by side in one run, ``repeats`` times each.

``loss``
    A workload like the issue's: two producers (open 4 sessions, put them
    as a group), a learner (take a group, release its sessions), a weight
    updater (``weight_update`` every 0.3 s), two workers (admit, settle).
    After 1.5 s the replica of the control plane's shard is frozen and its
    link dropped; 1 s later its primary is killed and the frozen replica is
    promoted (``CLUSTER FAILOVER TAKEOVER``); the old primary rejoins as its
    replica; the workload goes on for 2 s more. Then a fresh client audits
    every acknowledged call (returned without error): opens whose session
    is unknown, puts whose sessions went back to their producer, releases
    whose session is live again, takes whose group is back in the buffer,
    installs above the final version, admitted leases whose record is gone
    (all *lost*); groups taken by two acknowledged takes and sessions
    released by two acknowledged releases (*doubled*). Run with
    ``durability="none"`` and ``"replicas"`` (``durability_timeout_s`` 0.25).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tracestore import (
    DurabilityUnconfirmed,
    GateSealed,
    NotDrained,
    StateRolledBack,
    StorageError,
    TraceStore,
    TracestoreError,
)
from tracestore.replay import Group
from tracestore.servers import LocalCluster

OLD_TIMEOUTS = {"socket_timeout_s": 10.0, "connect_timeout_s": 5.0}


# -- stall of a hung primary ----------------------------------------------------------------


def _failover_done(cluster: LocalCluster, key: str, replica: Any) -> bool:
    try:
        return cluster.primary_of(key) is replica
    except Exception:
        return False


def stall_once(opts: dict[str, Any]) -> dict[str, Any]:
    """SIGSTOP the control plane's primary under a calling client; time the failover and the stall."""
    cluster = LocalCluster(primaries=3, replicas=1).start()
    st = TraceStore.connect(cluster.url, run=f"stall-{os.getpid()}", **opts)
    calls: list[tuple[float, float, bool]] = []  # (start, end, succeeded)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                st.heartbeat("w", 30)
                calls.append((start, time.monotonic(), True))
            except StorageError:
                calls.append((start, time.monotonic(), False))

    t = threading.Thread(target=loop)
    try:
        primary = cluster.primary_of(st.keys.meta)
        (replica,) = cluster.replicas_of(primary)
        # ask a node of another shard, so the poll itself never waits on the hung node
        others = [s for s in cluster.servers if s is not primary and s is not replica]
        cluster.servers = others + [replica, primary]
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        primary.pause()
        failover = None
        while time.monotonic() - t0 < 60:
            if _failover_done(cluster, st.keys.meta, replica):
                failover = time.monotonic() - t0
                break
            time.sleep(0.05)
        # the stall ends with the first success of a call made after the SIGSTOP (a call
        # in flight at that moment may have been answered just before the node stopped)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(ok and s0 >= t0 for s0, _, ok in calls):
            time.sleep(0.05)
        stop.set()
        t.join()
        first_ok = min((end for s0, end, ok in calls if ok and s0 >= t0), default=None)
        return {
            "failover_s": round(failover, 2) if failover is not None else None,
            "stall_s": round(first_ok - t0, 2) if first_ok is not None else None,
            "failed_calls": sum(1 for _, end, ok in calls if not ok and end > t0),
        }
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        st.close()
        primary.resume()
        cluster.stop()


def stall(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"old_defaults": [], "new_defaults": []}
    for _ in range(repeats):  # alternate, so the machine's load falls on both alike
        out["old_defaults"].append(stall_once(OLD_TIMEOUTS))
        out["new_defaults"].append(stall_once({}))
    for k in ("old_defaults", "new_defaults"):
        rows = out[k]
        out[f"{k}_max_stall_s"] = max(r["stall_s"] for r in rows)
        out[f"{k}_max_excess_s"] = round(max(r["stall_s"] - r["failover_s"] for r in rows), 2)
    return out


# -- the workload and the audit ----------------------------------------------------------------


class Ledger:
    """Every acknowledged call of the workload, and how the others failed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened: list[str] = []
        self.put: dict[str, tuple[str, ...]] = {}
        self.taken: collections.Counter[str] = collections.Counter()
        self.released: collections.Counter[str] = collections.Counter()
        self.installed: list[int] = []
        self.leases: list[str] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.acknowledged: collections.Counter[str] = collections.Counter()

    def ok(self, kind: str) -> None:
        with self.lock:
            self.acknowledged[kind] += 1

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            self.errors[type(exc).__name__] += 1


def _role(stop: threading.Event, ledger: Ledger, step: Callable[[], None], pause_s: float) -> None:
    while not stop.is_set():
        try:
            step()
        except (GateSealed, NotDrained):
            pass
        except TracestoreError as exc:
            ledger.failed(exc)
            time.sleep(0.05)
        time.sleep(pause_s)


def workload(st: TraceStore, ledger: Ledger, stop: threading.Event) -> list[threading.Thread]:
    """Start the roles; each records what was acknowledged."""
    counters = collections.Counter[str]()
    version = [st.gate.status().version]

    def producer(p: int) -> Callable[[], None]:
        def step() -> None:
            counters[f"p{p}"] += 1
            i = counters[f"p{p}"]
            sids = [f"p{p}-{i}-{j}" for j in range(4)]
            st.open_sessions(sids, f"prod{p}")
            with ledger.lock:
                ledger.opened += sids
            ledger.ok("open")
            st.replay.put(Group(f"g{p}-{i}", "t", tuple(sids)), f"prod{p}")
            with ledger.lock:
                ledger.put[f"g{p}-{i}"] = tuple(sids)
            ledger.ok("put")

        return step

    def learner() -> None:
        taken = st.replay.take("t", 1, owner="learner")
        for g in taken:
            with ledger.lock:
                ledger.taken[g.gid] += 1
            ledger.ok("take")
            released = st.release(list(g.sids), "learner")
            with ledger.lock:
                ledger.released.update(released)
            ledger.ok("release")

    def updater() -> None:
        time.sleep(0.3)
        v = max(version[0], st.gate.seen_version) + 1
        with st.gate.weight_update(v, drain_timeout_s=0.5):
            pass
        version[0] = v
        with ledger.lock:
            ledger.installed.append(v)
        ledger.ok("install")

    def worker(w: int) -> Callable[[], None]:
        sid = f"w{w}"

        def step() -> None:
            lease = st.gate.admit(sid, f"worker{w}", 5)
            with ledger.lock:
                ledger.leases.append(lease.id)
            ledger.ok("admit")
            time.sleep(0.01)
            st.gate.settle(lease, "completed")
            ledger.ok("settle")

        return step

    st.open_sessions(["w0", "w1"], "workers")
    roles: list[tuple[Callable[[], None], float]] = [
        (producer(0), 0.01), (producer(1), 0.01), (learner, 0.01), (updater, 0.0),
        (worker(0), 0.0), (worker(1), 0.0),
    ]
    threads = [threading.Thread(target=_role, args=(stop, ledger, step, pause)) for step, pause in roles]
    for t in threads:
        t.start()
    return threads


def audit(st: TraceStore, ledger: Ledger) -> dict[str, Any]:
    """Lost and doubled acknowledged calls, read back by a client that saw nothing."""
    states = st.session_states(sorted(set(ledger.opened) | set(ledger.released)))
    lost_open = sum(1 for s in set(ledger.opened) if states.get(s) is None)
    lost_put = sum(
        1 for gid, sids in ledger.put.items()
        if any(states.get(s) is None or states[s][0].startswith("prod") for s in sids)
    )
    stored = {g.gid for g in st.replay.groups("t")}
    lost_take = sum(1 for gid in ledger.taken if gid in stored)
    lost_release = sum(1 for s in ledger.released if states.get(s) is None or states[s][1] != "released")
    final_version = st.gate.status().version
    lost_install = sum(1 for v in ledger.installed if v > final_version)
    records = st.gate.lease_records(ledger.leases) if ledger.leases else []
    lost_lease = sum(1 for r in records if r is None)
    return {
        # in the units of "lost": sessions opened/released, groups put/taken, versions, leases
        "acknowledged": {
            "open": len(set(ledger.opened)), "put": len(ledger.put), "take": sum(ledger.taken.values()),
            "release": sum(ledger.released.values()), "install": len(ledger.installed),
            "lease": len(ledger.leases),
        },
        "acknowledged_calls": dict(ledger.acknowledged),
        "errors": dict(ledger.errors),
        "lost": {
            "open": lost_open, "put": lost_put, "take": lost_take, "release": lost_release,
            "install": lost_install, "lease": lost_lease,
        },
        "doubled": {
            "take": sum(1 for n in ledger.taken.values() if n > 1),
            "release": sum(1 for n in ledger.released.values() if n > 1),
        },
        "final_version": final_version,
        "max_acknowledged_version": max(ledger.installed, default=0),
    }


def loss_once(level: str) -> dict[str, Any]:
    cluster = LocalCluster(primaries=3, replicas=1).start()
    run = f"loss-{level.replace('+', '_')}-{os.getpid()}"
    st = TraceStore.connect(cluster.url, run=run, durability=level, durability_timeout_s=0.25)
    ledger = Ledger()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        threads = workload(st, ledger, stop)
        time.sleep(1.5)
        primary = cluster.primary_of(st.keys.meta)
        replica = cluster.cut_replica(primary)
        time.sleep(1.0)
        primary.kill()
        replica.resume()
        cluster.takeover(replica)
        primary.restart()
        cluster.wait_replicas_online()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join()
        with TraceStore.connect(cluster.url, run=run) as fresh:
            out = audit(fresh, ledger)
        out["state_rolled_back_raised"] = ledger.errors.get(StateRolledBack.__name__, 0)
        out["durability_unconfirmed_raised"] = ledger.errors.get(DurabilityUnconfirmed.__name__, 0)
        return out
    finally:
        stop.set()
        for t in threads:
            t.join()
        st.close()
        cluster.stop()


def run(quick: bool) -> dict[str, Any]:
    repeats = 1 if quick else 3
    return {
        "cluster": "3 primaries + 3 replicas, embedded valkey, cluster-node-timeout 3000 ms",
        "stall": stall(repeats),
        "loss": {level: loss_once(level) for level in ("none", "replicas")},
    }
