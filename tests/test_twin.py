"""One operation, two runners (tracestore/twin.py): store.run / execute, scoped operations, Blocking."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.conftest import connect_async
from tracestore import AsyncTraceStore, TraceStore, traces
from tracestore.gate import GateStatus, status, weight_update
from tracestore.scripts import Blocking, Cmd, Op


def _thread_and_ping(store_ctx: Any) -> Op[tuple[int, bool]]:
    tid = yield Blocking(threading.get_ident)
    pong = yield Cmd(("PING",), key=store_ctx.keys.meta)
    return tid, bool(pong)


def test_run_and_execute_drive_any_operation(store: TraceStore) -> None:
    st = store.run(status(store.context))
    assert isinstance(st, GateStatus) and (st.state, st.version) == ("open", 0)
    tid, pong = store.run(_thread_and_ping(store.context))
    assert tid == threading.get_ident() and pong  # the sync runner calls Blocking in place
    assert store.execute(Cmd(("PING",), key=store.keys.meta))
    # a request error is thrown into the operation, which may handle it
    def tolerant() -> Op[str]:
        try:
            yield Cmd(("NOSUCHCOMMAND",), key=store.keys.meta)
        except Exception as exc:  # what the runner threw in
            return type(exc).__name__
        return "no error"

    assert store.run(tolerant()) == "StorageError"


def test_async_runner_calls_blocking_in_a_worker_thread(url: str, run_id: str, arun: Any) -> None:
    async def go() -> tuple[int, int, bool]:
        a = await connect_async(url, run_id)
        try:
            tid, pong = await a.run(_thread_and_ping(a.context))
            return threading.get_ident(), tid, pong
        finally:
            await a.close()

    loop_tid, tid, pong = arun(go())
    assert tid != loop_tid and pong


def test_a_scoped_operation_cannot_be_run_and_cleans_up(store: TraceStore) -> None:
    with pytest.raises(RuntimeError, match="context manager"):
        store.run(weight_update(store.context, 1, 1))
    st = store.gate.status()
    assert (st.state, st.version) == ("open", 0)  # sealed, then reopened by its finally; no install


def test_async_weight_update_reopens_when_the_body_raises(url: str, run_id: str, arun: Any) -> None:
    async def go() -> tuple[str, int]:
        a = await connect_async(url, run_id)
        try:
            with pytest.raises(ValueError, match="push failed"):
                async with a.gate.weight_update(2, drain_timeout_s=1) as res:
                    assert res.drained and (await a.gate.status()).sealed
                    raise ValueError("push failed")
            st = await a.gate.status()
            async with a.gate.weight_update(3, drain_timeout_s=1):
                pass
            return st.state, (await a.gate.status()).version
        finally:
            await a.close()

    assert arun(go()) == ("open", 3)


def test_methods_keep_the_operations_docstrings_and_names(store: TraceStore) -> None:
    assert TraceStore.lookup.__doc__ == traces.lookup.__doc__ == AsyncTraceStore.lookup.__doc__
    assert store.lookup.__doc__ == traces.lookup.__doc__ and store.lookup.__name__ == "lookup"
    assert store.gate.weight_update.__doc__ == weight_update.__doc__
    assert "request gate" in (TraceStore.gate.__doc__ or "")
    assert store.gate is store.gate and store.replay is store.replay  # made once per store
    assert store.router(["a"]) is not store.router(["a"])  # a router per entrypoint list
