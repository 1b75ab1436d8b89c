"""The gate's log (tracestore/gate_log.py): one entry per seal, install and reopen, on real servers.

What the viewer's gate timeline and drain times are read from: the entries
are appended by the gate scripts in the same atomic call as the change, a
retried call (same op id) appends nothing, and the stream is capped.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tracestore import TraceStore
from tracestore.gate import LOG_ENTRIES, reopen, seal
from tracestore.gate_log import GateEvent, cycles, gate_events
from tracestore.scripts import gather


def _events(store: TraceStore, n: int = 100) -> list[GateEvent]:
    return list(reversed(store.run(gate_events(store.context, n))))  # oldest first


def test_a_weight_update_logs_its_seal_drain_install_and_reopen(store: TraceStore) -> None:
    g = store.gate
    lease = g.admit("s1", "worker-1", 60)
    done: list[Any] = []

    def update() -> None:
        with g.weight_update(1, drain_timeout_s=60) as drained:
            done.append(drained)

    t = threading.Thread(target=update)
    t.start()
    while t.is_alive() and g.status().state != "sealed":  # the update sealed; its drain waits for our lease
        time.sleep(0.005)
    receipt = g.settle(lease, "completed")
    t.join(60)
    assert done and done[0].drained
    seal_e, install_e, reopen_e = _events(store)
    assert (seal_e.ev, seal_e.version, seal_e.live) == ("seal", 0, 1)
    assert (install_e.ev, install_e.version, install_e.previous) == ("install", 1, 0)
    assert install_e.sealed_ms == seal_e.ms
    # drained when the last lease settled: after the settle, not before (server clock)
    assert install_e.drained_ms is not None and seal_e.ms <= receipt.settled_ms <= install_e.drained_ms
    assert install_e.drained_ms <= install_e.ms
    assert (reopen_e.ev, reopen_e.version, reopen_e.sealed_ms, reopen_e.drained_ms) == (
        "reopen", 1, seal_e.ms, install_e.drained_ms)
    (cycle,) = cycles(_events(store))
    assert cycle.installed == (1,) and cycle.version_from == 0 and cycle.version_to == 1
    assert cycle.live_at_seal == 1 and cycle.reopened_ms == reopen_e.ms
    assert cycle.drain_ms == install_e.drained_ms - seal_e.ms
    assert cycle.sealed_for_ms == reopen_e.ms - seal_e.ms
    # the gate hash forgets the cycle's drain time once reopened: the next seal starts afresh
    assert store.redis.hget(store.keys.gate, "drained_ms") is None


def test_an_operators_cycle_without_drain_takes_its_install_as_the_drain(store: TraceStore) -> None:
    g = store.gate
    g.seal()
    g.seal()  # sealing a sealed gate changes nothing and logs nothing
    g.install(3)
    g.reopen()
    g.reopen()  # neither does reopening an open gate
    seal_e, install_e, reopen_e = _events(store)
    assert [e.ev for e in (seal_e, install_e, reopen_e)] == ["seal", "install", "reopen"]
    assert seal_e.live == 0 and install_e.drained_ms == install_e.ms
    (cycle,) = cycles([seal_e, install_e, reopen_e])
    assert cycle.installed == (3,) and cycle.drain_ms == install_e.ms - seal_e.ms


def test_a_drain_check_records_when_the_sealed_gate_emptied(store: TraceStore) -> None:
    g = store.gate
    g.seal()
    assert g.drain(5).drained
    drained = int(store.redis.hget(store.keys.gate, "drained_ms"))
    g.drain(5)  # a later check keeps the first time
    assert int(store.redis.hget(store.keys.gate, "drained_ms")) == drained
    g.reopen()  # abandoned: nothing installed, the drain time is kept in the reopen entry
    seal_e, reopen_e = _events(store)
    assert reopen_e.drained_ms == drained and seal_e.ms <= drained <= reopen_e.ms
    (cycle,) = cycles([seal_e, reopen_e])
    assert cycle.installed == () and cycle.version_to == 0 and cycle.drain_ms == drained - seal_e.ms


def test_reopening_a_gate_never_sealed_logs_nothing(store: TraceStore) -> None:
    store.gate.reopen()
    assert _events(store) == []


def test_retried_calls_log_once(store: TraceStore) -> None:
    g = store.gate
    g.seal(op_id="seal-1")
    g.seal(op_id="seal-1")
    g.install(1, op_id="install-1")
    assert g.install(1, op_id="install-1") == 0  # the first reply, not StaleVersion
    g.reopen(op_id="reopen-1")
    g.reopen(op_id="reopen-1")
    assert [e.ev for e in _events(store)] == ["seal", "install", "reopen"]


def test_the_log_is_capped(store: TraceStore) -> None:
    ctx = store.context
    n = LOG_ENTRIES // 2 + 3  # seal + reopen per cycle: more entries than the cap
    ops = []
    for _ in range(n):
        ops += [seal(ctx), reopen(ctx)]
    store.run(gather(ops))
    assert store.redis.xlen(store.keys.gate_log) == LOG_ENTRIES
    newest = store.run(gate_events(ctx, 2))
    assert [e.ev for e in newest] == ["reopen", "seal"]


def test_cycles_of_a_window_that_lost_its_seal() -> None:
    """A window of the log that starts after a seal (trimmed) still gives the cycle its seal time."""
    events = [
        GateEvent("1000-0", "install", 1000, 5, previous=4, sealed_ms=900, drained_ms=950),
        GateEvent("1100-0", "reopen", 1100, 5, sealed_ms=900, drained_ms=950),
        GateEvent("2000-0", "seal", 2000, 5, live=7),
    ]
    first, second = cycles(list(reversed(events)))  # any order in, oldest first out
    assert (first.sealed_ms, first.drain_ms, first.version_from, first.installed) == (900, 50, 4, (5,))
    assert first.sealed_for_ms == 200
    assert (second.sealed_ms, second.reopened_ms, second.live_at_seal, second.drain_ms) == (2000, None, 7, None)
