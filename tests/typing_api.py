"""Static checks of the public API's types, run through mypy by tests/test_typing.py (never executed).

Each ``assert_type`` fails mypy when a result is not exactly the stated type
(``Any`` included); each ``# type: ignore[...]`` fails it (strict mode warns
about unused ignores) when a wrong call stops being an error. The
``reveal_type`` lines print what mypy sees (the test checks them too).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager

from typing_extensions import assert_type, reveal_type

from tracestore import AsyncTraceStore, TraceStore, TracestoreError
from tracestore.gate import AsyncGate, DrainResult, Gate, GateStatus, Lease, SettlementReceipt
from tracestore.replay import AsyncReplay, Group, PutResult, Replay, Taken, TakenMany
from tracestore.router import AsyncRouter, Route, Router, RouterOps, RouteTable, route_table
from tracestore.run import RunInfo
from tracestore.scripts import Op
from tracestore.session import AsyncTurnRecorder, Request, TurnRecorder
from tracestore.traces import PrefixMatch, Trace, Turn


async def async_results(s: AsyncTraceStore) -> None:
    reveal_type(await s.lookup("sid", "prompt"))
    reveal_type(await s.gate.status())
    reveal_type(s.gate)
    reveal_type(s.replay)
    reveal_type(s.router(["ep-a"]))
    m = await s.lookup("sid", "prompt")
    assert_type(m, PrefixMatch)
    assert_type(
        await s.record_turn(
            "sid", "p", "r", prefix=m, delta_token_ids=[1], response_token_ids=[2],
            response_logprobs=[-0.1], version=0,
        ),
        Turn,
    )
    assert_type(await s.export_training_trace("sid", "p"), Trace)
    assert_type(await s.export_node("sid", "0123456789abcdef"), Trace)
    assert_type(await s.release(["sid"], "owner"), list[str])
    assert_type(await s.init_run(), RunInfo)
    assert_type(s.gate, AsyncGate)
    assert_type(await s.gate.status(), GateStatus)
    lease = await s.gate.admit("sid", "worker", 30)
    assert_type(lease, Lease)
    assert_type(await s.gate.settle(lease, "completed"), SettlementReceipt)
    assert_type(s.gate.weight_update(1, 5.0), AbstractAsyncContextManager[DrainResult])
    async with s.gate.weight_update(1, drain_timeout_s=5.0) as drained:
        assert_type(drained, DrainResult)
    assert_type(s.replay, AsyncReplay)
    assert_type(await s.replay.put(Group("g", "t", ("sid",)), "owner"), PutResult)
    assert_type(await s.replay.take("t", 1, owner="o"), Taken)
    assert_type(await s.replay.take_many({"t": 1}, owner="o", at_most=True), TakenMany)
    assert_type(await s.replay.ready_many({"t": 1}), bool)
    assert_type(await s.trace_keys("sid"), list[str])
    r = s.router(["ep-a", "ep-b"], retention_s=60.0)
    assert_type(r, AsyncRouter)
    assert_type(await r.acquire("sid"), str)
    assert_type(await r.acquire_route("sid"), Route)
    assert_type(await s.run(route_table(s.context, ["sid"])), RouteTable)
    rec = AsyncTurnRecorder(s, lambda msgs, gen: "", lambda text: [1])
    assert_type(await rec.prepare("sid", []), Request)
    assert_type(await rec.before_request("sid", []), list[int])
    # wrong calls stay errors (the ignores are reported as unused otherwise)
    # the batching door: operations built by store.ops, run together by store.gather
    reveal_type(await s.gather(s.ops.lookup("sid", "p"), s.ops.gate.status()))
    assert_type(s.ops.lookup("sid", "p"), Op[PrefixMatch])
    assert_type(
        await s.gather(s.ops.release_owner("o", "done"), s.ops.router(["ep"]).retire(["sid"])),
        tuple[list[str], list[str]],
    )
    assert_type(
        await s.gather(s.ops.gate.settle(lease, "completed"), errors_in_place=True),
        tuple[SettlementReceipt | TracestoreError],
    )
    assert_type(await s.gather(*[s.ops.owner_of("a"), s.ops.owner_of("b")]), tuple[str | None, ...])
    assert_type(rec.ops.prepare("sid", []), Op[Request])
    await s.gather(s.lookup("sid", "p"))  # type: ignore[call-overload]  # a coroutine is no operation
    await s.lookup("sid", 1)  # type: ignore[arg-type]
    await s.gate.admit("sid", "worker")  # type: ignore[call-arg]
    s.router(["ep"], retention_s="1d")  # type: ignore[arg-type]
    x: int = await s.lookup("sid", "p")  # type: ignore[assignment]
    del x


def sync_results(s: TraceStore, rec: TurnRecorder) -> None:
    reveal_type(s.lookup("sid", "prompt"))
    reveal_type(s.gate.status())
    assert_type(s.lookup("sid", "prompt"), PrefixMatch)
    assert_type(s.gate, Gate)
    assert_type(s.gate.status(), GateStatus)
    assert_type(s.gate.weight_update(1, 5.0), AbstractContextManager[DrainResult])
    with s.gate.weight_update(1, 5.0) as drained:
        assert_type(drained, DrainResult)
    assert_type(s.replay, Replay)
    assert_type(s.replay.count(), int)
    assert_type(s.replay.ready("t", 1, current_version=3, max_staleness=1), bool)
    assert_type(s.replay.take_many({"t": 1}, owner="o"), TakenMany)
    assert_type(s.replay.claim_retry("t", 0, "o"), list[Group])
    assert_type(s.trace_keys("sid"), list[str])
    s.replay.take_many(["t"], owner="o")  # type: ignore[arg-type]
    assert_type(s.router(["ep-a"]), Router)
    assert_type(s.router(["ep-a"]).table(), RouteTable)
    assert_type(s.run(route_table(s.context)), RouteTable)
    assert_type(rec.before_request("sid", []), list[int])
    reveal_type(s.gather(s.ops.lookup("sid", "p"), s.ops.replay.count()))
    assert_type(s.ops.router(["ep"]), RouterOps)
    assert_type(s.gather(s.ops.replay.count(), s.ops.gate.status(), s.ops.ping()), tuple[int, GateStatus, bool])
    assert_type(s.gather(s.ops.gate.status(), s.ops.owners(), errors_in_place=True)[0], GateStatus | TracestoreError)
    s.ops.lookup("sid")  # type: ignore[call-arg]
    s.lookup("sid")  # type: ignore[call-arg]
    s.release(["sid"], 5)  # type: ignore[arg-type]

