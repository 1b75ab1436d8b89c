"""A refused weight update does not hold the seal, and the retry hint is the wait to expect (issue 25 item 3).

Real servers, every backend. How long a refused update held the seal is
read from the gate's log (server clock), not timed by the test: a drain that
cannot succeed gives up at once (poison) or after its short dead-holder wait,
well before its drain timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from tests._dump import dump_run
from tests.conftest import connect_async
from tracestore import GatePoisoned, GateSealed, NotDrained, TraceStore
from tracestore.gate_log import cycles, gate_events

T = TypeVar("T")


def wait_for(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """Call ``read`` until ``ok`` holds for its value; returns it (AssertionError on timeout)."""
    end = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value):
            return value
        assert time.monotonic() < end, f"never reached: last value {value!r}"
        time.sleep(0.02)


def last_cycle_sealed_ms(store: TraceStore) -> int:
    """How long the newest weight-update cycle held the seal (server ms, from the gate's log)."""
    done = [c for c in cycles(store.run(gate_events(store.context, 50))) if c.sealed_for_ms is not None]
    assert done, "no closed cycle in the gate's log"
    return int(done[-1].sealed_for_ms or 0)


def test_a_poisoned_gate_is_not_sealed_by_a_weight_update(store: TraceStore) -> None:
    g = store.gate
    unknown = g.admit("s1", "w", 60)
    g.settle(unknown, "unknown")
    overdue = g.admit("s2", "w", 0.05)
    wait_for(g.status, lambda st: st.live == 0)  # past its deadline, not swept yet
    before = dump_run(store)
    with pytest.raises(GatePoisoned) as ei:
        with g.weight_update(1, drain_timeout_s=120):
            pytest.fail("the body must not run over poison")
    assert set(ei.value.lease_ids) == {unknown.id, overdue.id}
    assert dump_run(store) == before  # never sealed: no admission refused, nothing logged
    assert g.admit("s3", "w", 5).version == 0


def test_poison_during_the_drain_ends_it_at_once(store: TraceStore) -> None:
    """A lease expires while the drain waits for another: the install can no longer succeed,
    so the update gives up then, not at its drain timeout, and reopens."""
    g = store.gate
    g.admit("slow", "w", 120)  # would keep the drain waiting its whole timeout
    short = g.admit("short", "w", 3.0)  # (still live when the update starts, on a slow machine too)
    with pytest.raises(GatePoisoned) as ei:
        with g.weight_update(1, drain_timeout_s=60):
            pytest.fail("the body must not run over poison")
    assert ei.value.lease_ids == [short.id]
    st = g.status()
    assert (st.state, st.version, st.live) == ("open", 0, 1)
    assert last_cycle_sealed_ms(store) < 30_000  # its lease's deadline (3 s), not the drain timeout (60 s)


def test_live_leases_of_dead_holders_end_the_drain_after_a_short_wait(store: TraceStore) -> None:
    g = store.gate
    g.heartbeat("gw-dead", 0.2)
    orphan = g.admit("s1", "gw-dead", 120, engine="http://127.0.0.1:9", request="r1")
    wait_for(g.dead_holder_leases, bool)
    res = g.drain(0)
    assert (res.live, res.dead_held, res.dead_held_ids) == (1, 1, (orphan.id,))
    with pytest.raises(NotDrained) as ei:
        with g.weight_update(1, drain_timeout_s=60, dead_holder_wait_s=0.5):
            pytest.fail("the body must not run while a lease is live")
    err = ei.value
    assert (err.live, err.dead_held, err.lease_ids) == (1, 1, [orphan.id])
    assert "heartbeat stopped" in str(err) and "resolve_dead_holders" in str(err)
    assert g.status().state == "open"
    assert last_cycle_sealed_ms(store) < 30_000  # the dead-holder wait, not the drain timeout
    # a resolver settles it (its request was stopped): the next update goes through
    assert [r.lease_id for r in g.resolve_dead_holders(lambda leases: [d.lease_id for d in leases]).settled] == [
        orphan.id
    ]
    with g.weight_update(1, drain_timeout_s=5, dead_holder_wait_s=0.5):
        pass
    assert g.status().version == 1


def test_a_drain_waits_for_live_holders_then_gives_up_on_the_dead_ones(store: TraceStore) -> None:
    g = store.gate
    g.heartbeat("gw-dead", 0.2)
    g.heartbeat("gw-live", 120)
    g.admit("s1", "gw-dead", 120)
    mine = g.admit("s2", "gw-live", 120)
    wait_for(g.dead_holder_leases, bool)
    out: list[BaseException] = []

    def update() -> None:
        try:
            with g.weight_update(1, drain_timeout_s=60, dead_holder_wait_s=0.3):
                pass
        except BaseException as exc:  # noqa: BLE001 - inspected below
            out.append(exc)

    t = threading.Thread(target=update)
    t.start()
    wait_for(g.status, lambda st: st.sealed)
    assert t.is_alive()  # a live holder's lease: the drain waits for it
    g.settle(mine, "completed")
    t.join(30)
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], NotDrained)
    assert (out[0].live, out[0].dead_held) == (1, 1)
    assert g.status().state == "open"


def test_the_retry_hint_is_the_wait_the_seal_is_expected_to_last(store: TraceStore) -> None:
    """Cycle 1 pushes weights for 5 s (the gate sealed meanwhile). Refused admissions of the
    next cycles are told to come back when a cycle like the last one ends (not the seal's
    500 ms), and never after the current drain gives up.

    (5 s and a 3 s drain: each refused admission has seconds to land in its window, however
    slow the machine; with 3 s and 1.5 s a loaded machine could miss cycle 2's 1.5 s.)"""
    g = store.gate
    k = store.keys

    def sealed_for_ms() -> int:
        st = g.status()
        return st.server_ms - (st.sealed_ms or st.server_ms)

    with g.weight_update(1, drain_timeout_s=10):
        wait_for(sealed_for_ms, lambda ms: ms >= 5000)  # the push of the weights (the state cycle 2 expects)
    cycle_ms = int(store.redis.hget(k.gate, "cycle_ms"))
    assert cycle_ms >= 5000
    errors: list[BaseException] = []

    def update(version: int, drain_s: float) -> threading.Thread:
        def run() -> None:
            try:
                with g.weight_update(version, drain_timeout_s=drain_s):
                    pass
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        wait_for(g.status, lambda st: st.sealed)
        return t

    # cycle 2: a live lease and a short drain, which bounds the hint (it gives up and reopens then)
    live = g.admit("s-live", "w", 120)
    t = update(2, 3.0)
    with pytest.raises(GateSealed) as ei:
        g.admit("s-new", "w", 5)
    left = cycle_ms - sealed_for_ms()  # what a cycle like the last one would still take
    assert ei.value.retry_after_ms <= 3000 < left
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], NotDrained)

    # cycle 3: a long drain: the hint is what is left of a cycle as long as cycle 2
    cycle_ms = int(store.redis.hget(k.gate, "cycle_ms"))
    assert cycle_ms >= 3000
    t = update(2, 30)
    lo = cycle_ms - sealed_for_ms()
    with pytest.raises(GateSealed) as ei:
        g.admit("s-new", "w", 5)
    hi = cycle_ms - sealed_for_ms()
    hint = ei.value.retry_after_ms
    assert max(500, hi) <= hint <= max(500, lo) and hint > 500
    g.settle(live, "completed")
    t.join(30)
    assert len(errors) == 1 and g.status().version == 2

    # an operator's seal keeps the hint it was given
    g.seal(retry_after_ms=1234)
    with pytest.raises(GateSealed) as ei:
        g.admit("s-new", "w", 5)
    assert ei.value.retry_after_ms == 1234
    g.reopen()


def test_async_weight_update_gives_up_on_poison_too(url: str, run_id: str, arun: Any) -> None:
    async def main() -> None:
        st = await connect_async(url, run_id)
        try:
            g = st.gate
            await g.admit("slow", "w", 120)
            short = await g.admit("short", "w", 1.0)
            with pytest.raises(GatePoisoned) as ei:
                async with g.weight_update(1, drain_timeout_s=60):
                    pytest.fail("the body must not run over poison")
            assert ei.value.lease_ids == [short.id]
            assert (await g.status()).state == "open"
        finally:
            await st.close()

    arun(main())
