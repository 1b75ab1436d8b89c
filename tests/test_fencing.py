"""Fencing (issue 11 item 3): a gate version lower than one seen raises StateRolledBack.

The state is rolled back for real: a standalone server saves an RDB at
version 1, installs version 2, is killed and restarted on that RDB (the
failover to a lagging replica is in tests/test_failover.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import connect_async
from tracestore import InvalidInput, StateRolledBack, StorageError, TraceStore
from tracestore.servers import EmbeddedServer


def _install(st: TraceStore, version: int) -> None:
    with st.gate.weight_update(version, drain_timeout_s=1):
        pass


@pytest.fixture
def rolled_back() -> Iterator[tuple[EmbeddedServer, TraceStore]]:
    """A store that saw version 2 on a server now back at version 1 (restarted on an older RDB)."""
    srv = EmbeddedServer().start()
    st = TraceStore.connect(srv.url, run="fence", retries=8)
    try:
        st.open_sessions(["a", "b"], "worker")
        _install(st, 1)
        srv.client().save()  # dump.rdb at version 1
        _install(st, 2)
        assert st.gate.seen_version == 2
        srv.kill()
        srv.restart()  # loads dump.rdb: version 1
        yield srv, st
    finally:
        st.close()
        srv.stop()


def _reconnected(call: Any) -> Any:
    """The store's pooled connections died with the server: the first call may fail once."""
    try:
        return call()
    except StorageError:
        return call()


def test_every_reply_carrying_the_version_is_fenced(rolled_back: tuple[EmbeddedServer, TraceStore]) -> None:
    srv, st = rolled_back
    with pytest.raises(StateRolledBack) as err:
        _reconnected(st.gate.status)
    assert (err.value.what, err.value.seen, err.value.found) == ("gate version", 2, 1)
    assert "fence(1)" in str(err.value)
    with TraceStore.connect(srv.url, run="fence") as fresh:
        assert fresh.gate.status().version == 1  # a client that saw nothing accepts the older state
        with pytest.raises(StateRolledBack):
            st.gate.admit("a", "w", 30)
        status = fresh.gate.status()
        assert status.live == 0 and status.poisoned == 0  # the lease it got was aborted at once
        with pytest.raises(StateRolledBack):
            st.gate.admit_many([("a", "w"), ("b", "w")], 30)
        assert fresh.gate.status().live == 0
        with pytest.raises(StateRolledBack):
            st.gate.drain(0)
        # weight_update refuses before its body and leaves the gate open
        ran = False
        with pytest.raises(StateRolledBack):
            with st.gate.weight_update(3, drain_timeout_s=1):
                ran = True
        assert not ran and fresh.gate.status().state == "open" and fresh.gate.status().version == 1


def test_fence_accepts_the_older_state_or_seeds_a_floor(rolled_back: tuple[EmbeddedServer, TraceStore]) -> None:
    srv, st = rolled_back
    with pytest.raises(StateRolledBack) as err:
        _reconnected(st.gate.status)
    st.gate.fence(err.value.found)
    assert st.gate.seen_version == 1
    lease = st.gate.admit("a", "w", 30)
    assert lease.version == 1
    st.gate.settle(lease, "completed")
    _install(st, 2)  # the operator re-installs what the engines run
    assert st.gate.seen_version == 2
    with TraceStore.connect(srv.url, run="fence") as other:
        other.gate.fence(5)  # a restarted process that knows its engines run version 5
        with pytest.raises(StateRolledBack):
            other.gate.status()
        with pytest.raises(InvalidInput):
            other.gate.fence(-1)


def test_the_async_store_is_fenced_too(rolled_back: tuple[EmbeddedServer, TraceStore], arun: Any) -> None:
    srv, _ = rolled_back

    async def main() -> None:
        st = await connect_async(srv.url, "fence")
        try:
            st.gate.fence(2)
            with pytest.raises(StateRolledBack):
                await st.gate.admit("a", "w", 30)
            with TraceStore.connect(srv.url, run="fence") as fresh:
                assert fresh.gate.status().live == 0  # aborted, as on the sync store
            st.gate.fence(1)
            assert (await st.gate.admit("a", "w", 30)).version == 1
        finally:
            await st.close()

    arun(main())


def test_install_over_a_rolled_back_gate_is_reported(rolled_back: tuple[EmbeddedServer, TraceStore]) -> None:
    """A direct install (no drain first) acts, then reports what it replaced."""
    srv, st = rolled_back
    with TraceStore.connect(srv.url, run="fence") as fresh:
        fresh.gate.seal()
    with pytest.raises(StateRolledBack) as err:
        _reconnected(lambda: st.gate.install(3))
    assert (err.value.seen, err.value.found) == (2, 1)
    with TraceStore.connect(srv.url, run="fence") as fresh:
        assert fresh.gate.status().version == 3
