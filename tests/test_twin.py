"""One operation, two runners (tracestore/twin.py): store.run / execute, scoped operations, Blocking."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, get_args, get_origin, get_type_hints

import pytest

from tests.conftest import connect_async
from tracestore import (
    AsyncTraceStore,
    AsyncTurnRecorder,
    InvalidId,
    PrefixMatch,
    SessionReleased,
    SettlementReceipt,
    TraceStore,
    TurnRecorder,
    traces,
    twin,
)
from tracestore.gate import GateStatus, status, weight_update
from tracestore.ownership import Heartbeat
from tracestore.router import AsyncRouter, Router, RouterOps
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


# -- public signatures: what inspect (help(), IDEs) shows of a bound operation ------------------


def _bound(owner: type[Any]) -> list[tuple[str, Any]]:
    """The ``op`` and ``scoped`` descriptors a class lists (its own and inherited)."""
    return [
        (name, d) for klass in reversed(owner.__mro__) for name, d in vars(klass).items()
        if isinstance(d, (twin.op, twin.scoped))
    ]


def _operation_result(f: Any) -> Any:
    """``R`` of an operation ``f(scope, ...) -> Op[R]`` (``T`` of a scoped one's Body[T])."""
    ret = get_type_hints(f)["return"]
    arms = get_args(get_args(ret)[0])
    body = [get_args(a)[0] for a in arms if get_origin(a) is twin.Body]
    return body[0] if body else get_args(ret)[2]


def _runners(store: TraceStore) -> list[Any]:
    rec = TurnRecorder(store, lambda messages, gen: "", lambda text: [1])
    return [store, store.gate, store.replay, store.router(["ep-a"]), rec]


def test_bound_operations_show_their_public_signature_and_result_type(store: TraceStore) -> None:
    seen = 0
    for runner in _runners(store):
        for name, desc in _bound(type(runner)):
            sig = inspect.signature(getattr(runner, name))
            params = list(inspect.signature(desc.f).parameters)[1:]  # the scope is not the caller's
            assert list(sig.parameters) == params, (type(runner).__name__, name, sig)
            want = _operation_result(desc.f)
            if isinstance(desc, twin.scoped):
                want = AbstractContextManager[want]
            assert sig.return_annotation == want, (type(runner).__name__, name, sig)
            seen += 1
    assert seen > 50
    sig = inspect.signature(store.lookup)
    assert list(sig.parameters) == ["sid", "prompt_text"] and sig.return_annotation is PrefixMatch
    assert str(sig) == "(sid: str, prompt_text: str) -> tracestore.traces.types.PrefixMatch"
    assert inspect.signature(store.gate.settle).return_annotation is SettlementReceipt
    router = inspect.signature(store.router)
    assert list(router.parameters) == ["entrypoints", "retention_s"] and router.return_annotation is Router
    # store.ops builds the operation: same parameters, the operation's own type
    built = inspect.signature(store.ops.lookup)
    assert list(built.parameters) == ["sid", "prompt_text"] and built.return_annotation == Op[PrefixMatch]
    assert inspect.signature(store.ops.router).return_annotation is RouterOps


def test_async_bound_operations_are_coroutine_functions_of_the_same_result(url: str, run_id: str, arun: Any) -> None:
    async def go() -> list[tuple[str, Any, Any, bool]]:
        a = await connect_async(url, run_id)
        try:
            rec = AsyncTurnRecorder(a, lambda messages, gen: "", lambda text: [1])
            out = []
            for runner in (a, a.gate, a.replay, a.router(["ep-a"]), rec):
                for name, desc in _bound(type(runner)):
                    method = getattr(runner, name)
                    out.append((name, desc, inspect.signature(method), inspect.iscoroutinefunction(method)))
            out.append(("router", None, inspect.signature(a.router), False))
            return out
        finally:
            await a.close()

    found = arun(go())
    assert len(found) > 50
    for name, desc, sig, is_coroutine in found:
        if desc is None:
            assert sig.return_annotation is AsyncRouter and "ctx" not in sig.parameters
            continue
        assert list(sig.parameters) == list(inspect.signature(desc.f).parameters)[1:], (name, sig)
        result = _operation_result(desc.f)
        if isinstance(desc, twin.scoped):
            assert sig.return_annotation == AbstractAsyncContextManager[result], (name, sig)
        else:
            assert is_coroutine and sig.return_annotation == Coroutine[Any, Any, result], (name, sig)
    lookup = next(sig for name, _, sig, _ in found if name == "lookup")
    assert lookup.return_annotation == Coroutine[Any, Any, PrefixMatch]


# -- store.ops and store.gather: the batching door ------------------------------------------------


class _Counting:
    """Counts the requests a store executes (each is one round trip, per node)."""

    def __init__(self, store: Any) -> None:
        self.requests: list[Any] = []
        real = store.execute

        def execute(req: Any) -> Any:
            self.requests.append(req)
            return real(req)

        store.execute = execute


def test_store_ops_build_operations_that_gather_runs_in_shared_round_trips(store: TraceStore) -> None:
    built = store.ops.open_session("g-1", "rollout:0")
    assert store.owner_of("g-1") is None  # built, not run
    count = _Counting(store)
    opened = store.gather(built, store.ops.open_session("g-2", "rollout:0"), store.ops.gate.status())
    assert len(count.requests) == 1  # three operations, one round trip
    assert isinstance(opened[0], int) and isinstance(opened[1], int) and opened[2].state == "open"
    lease = store.gate.admit("g-1", "rollout:0", 30)
    count.requests.clear()
    released, receipt, routed = store.gather(
        store.ops.release(["g-1", "g-2"], "rollout:0", "done", purge=False),
        store.ops.gate.settle(lease, "completed"),
        store.ops.router(["ep-a"]).acquire("g-3"),
    )
    assert sorted(released) == ["g-1", "g-2"] and receipt.outcome == "completed" and routed == "ep-a"
    assert len(count.requests) == 1
    assert store.owner_of("g-1") is None and store.session_states(["g-1"])["g-1"] == ("", "released")
    # errors stay in place on request; otherwise the first one is raised after all ran
    again, owner = store.gather(
        store.ops.open_session("g-1", "rollout:0"), store.ops.owner_of("g-3"), errors_in_place=True
    )
    assert isinstance(again, SessionReleased) and owner is None
    with pytest.raises(SessionReleased):
        store.gather(store.ops.open_session("g-2", "x"), store.ops.open_session("g-4", "x"))
    assert store.owner_of("g-4") == "x"
    # a bad argument is refused before any I/O, for the whole call
    count.requests.clear()
    with pytest.raises(InvalidId):
        store.gather(store.ops.open_session("g-5", "x"), store.ops.open_session("bad id", "x"))
    assert count.requests == [] and store.owner_of("g-5") is None
    assert store.gather() == ()
    # a recorder's operations gather with the store's
    rec = TurnRecorder(store, lambda messages, gen: "".join(m["content"] for m in messages), lambda t: [1] * len(t))
    count.requests.clear()
    req, beat = store.gather(rec.ops.prepare("g-6", [{"role": "user", "content": "hi"}]), store.ops.heartbeat("x", 30))
    assert req.sid == "g-6" and req.input_ids == [1, 1] and isinstance(beat, Heartbeat)
    assert len(count.requests) == 1


def test_async_store_gather_and_ops(url: str, run_id: str, arun: Any) -> None:
    async def go() -> tuple[Any, ...]:
        a = await connect_async(url, run_id)
        try:
            await a.open_session("a-1", "w")
            got = await a.gather(a.ops.owner_of("a-1"), a.ops.gate.status(), a.ops.replay.count())
            released = await a.gather(a.ops.release_owner("w", "done"), a.ops.heartbeat("w2", 30))
            return got, (released[0], await a.owner_of("a-1"))
        finally:
            await a.close()

    (owner, status_, count), (released, after) = arun(go())
    assert owner == "w" and status_.state == "open" and count == 0
    assert released == ["a-1"] and after is None
