"""The sync I/O layer's script lane (tracestore/io/sync_io.py, ScriptLane): a standalone
client's script calls on one kept connection of its pool, outside redis-py's per-command path."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis.exceptions import MovedError, NoScriptError, ResponseError

from tracestore import AsyncTraceStore, TraceStore
from tracestore.io.async_io import AsyncScriptLane
from tracestore.io.sync_io import BUSY, ScriptLane


@pytest.fixture
def st(standalone_url: str) -> Iterator[TraceStore]:
    s = TraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
    try:
        yield s
    finally:
        s.close()


def _turn(st: TraceStore, sid: str, prompt: str, response: str, version: int = 0) -> None:
    m = st.lookup(sid, prompt)
    st.record_turn(
        sid, prompt, response, prefix=m, delta_token_ids=[1] * (3 - (m.text_len > 0)),
        response_token_ids=[7, 8], response_logprobs=[-0.5, -0.25], version=version,
    )


def _lane(st: TraceStore) -> ScriptLane:
    lane = st._io._lane  # noqa: SLF001 - the mechanism under test
    assert isinstance(lane, ScriptLane)
    return lane


def test_script_calls_take_the_lane_and_keep_one_connection(st: TraceStore) -> None:
    _turn(st, "s", "hello there", " hi")
    lane = _lane(st)
    conn = lane._conn  # noqa: SLF001
    assert conn is not None and conn.is_connected
    pool = st.redis.connection_pool
    assert conn in pool._in_use_connections  # noqa: SLF001 - counted by the pool
    cid = st.redis.client_id()  # (a plain command: redis-py's path, another connection)
    _turn(st, "s", "hello there hi more", " ok", 1)
    assert lane._conn is conn  # noqa: SLF001 - the same connection, kept
    assert st.redis.client_id() == cid
    st.close()
    assert lane._conn is None and conn not in pool._in_use_connections  # noqa: SLF001


def test_a_busy_lane_sends_through_redis_py(st: TraceStore) -> None:
    _turn(st, "s", "hello there", " hi")
    lane = _lane(st)
    with lane._lock:  # noqa: SLF001 - another thread's call in flight
        assert lane.call(("PING",)) is BUSY
        _turn(st, "s", "hello there hi more", " ok", 1)  # still works, through the pool
    assert st.export_training_trace("s", "hello there hi more ok").input_ids == [1, 1, 1, 7, 8, 1, 1, 7, 8]


def test_a_killed_connection_is_retried_on_a_new_one(st: TraceStore) -> None:
    _turn(st, "s", "hello there", " hi")
    lane = _lane(st)
    conn = lane._conn  # noqa: SLF001
    lane_id = lane.call(("CLIENT", "ID"))
    assert st.redis.execute_command("CLIENT", "KILL", "ID", lane_id) == 1
    _turn(st, "s", "hello there hi more", " ok", 1)  # the retry policy reconnects
    assert lane._conn is conn and lane.call(("CLIENT", "ID")) != lane_id  # noqa: SLF001
    assert len(st.export_training_trace("s", "hello there hi more ok").input_ids) == 9


def test_pool_disconnect_closes_the_lane_too(st: TraceStore) -> None:
    _turn(st, "s", "hello there", " hi")
    lane = _lane(st)
    st.redis.connection_pool.disconnect()
    assert not lane._conn.is_connected  # noqa: SLF001
    _turn(st, "s", "hello there hi more", " ok", 1)
    assert lane._conn.is_connected  # noqa: SLF001


def test_error_replies_leave_the_connection_clean(st: TraceStore) -> None:
    _turn(st, "s", "hello there", " hi")
    lane = _lane(st)
    st.redis.script_flush()  # NOSCRIPT on the next EVALSHA: reloaded with EVAL
    _turn(st, "s", "hello there hi more", " ok", 1)
    with pytest.raises(Exception, match="(?i)unknown command"):
        lane.call(("NOSUCHCOMMAND",))
    assert lane.call(("PING",)) == b"PONG"
    assert len(st.export_training_trace("s", "hello there hi more ok").input_ids) == 9


def test_a_cluster_client_has_no_lane(cluster_url: str) -> None:
    s = TraceStore.connect(cluster_url, run=f"lane-{uuid.uuid4().hex[:8]}")
    try:
        assert s._io._lane is None  # noqa: SLF001
    finally:
        s.close()


# -- the asyncio lane ---------------------------------------------------------------------


async def _aturn(st: AsyncTraceStore, sid: str, prompt: str, response: str, version: int = 0) -> None:
    m = await st.lookup(sid, prompt)
    await st.record_turn(
        sid, prompt, response, prefix=m, delta_token_ids=[1] * (3 - (m.text_len > 0)),
        response_token_ids=[7, 8], response_logprobs=[-0.5, -0.25], version=version,
    )


def test_async_script_calls_take_the_lane(standalone_url: str, arun: Any) -> None:
    async def go() -> None:
        st = await AsyncTraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            await _aturn(st, "s", "hello there", " hi")
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            conn = lane._conn  # noqa: SLF001
            assert conn is not None and conn.is_connected
            lane_id = await lane.call(("CLIENT", "ID"))
            await _aturn(st, "s", "hello there hi more", " ok", 1)
            assert lane._conn is conn and await lane.call(("CLIENT", "ID")) == lane_id  # noqa: SLF001
            # tasks in flight together share the one connection, their replies each to its caller
            got = await asyncio.gather(*(lane.call(("ECHO", f"e{i}")) for i in range(50)), lane.call(("CLIENT", "ID")))
            assert got == [f"e{i}".encode() for i in range(50)] + [lane_id]
            await _aturn(st, "s", "hello there hi more ok again", " yes", 2)
            # a killed connection: the retry policy reconnects
            assert await st.redis.execute_command("CLIENT", "KILL", "ID", lane_id) == 1
            await _aturn(st, "s", "hello there hi more ok again yes then", " fine", 3)
            assert await lane.call(("CLIENT", "ID")) != lane_id
            trace = await st.export_training_trace("s", "hello there hi more ok again yes then fine")
            assert len(trace.input_ids) == 4 * 2 + 3 + 3 * 2
        finally:
            await st.close()
        assert lane._conn is None  # noqa: SLF001

    arun(go())


def test_async_batches_pipeline_on_the_lane_with_errors_in_place(standalone_url: str, arun: Any) -> None:
    async def go() -> None:
        st = await AsyncTraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            lane_id = await lane.call(("CLIENT", "ID"))
            replies = await lane.calls([("ECHO", "a"), ("NOSUCHCOMMAND",), ("EVALSHA", "0" * 40, 0), ("CLIENT", "ID")])
            assert replies[0] == b"a" and replies[3] == lane_id
            assert isinstance(replies[1], ResponseError) and isinstance(replies[2], NoScriptError)
            # a turn's batches (lookups, records) through the store go the same way
            await asyncio.gather(*(_aturn(st, f"b{i}", "hello there", " hi") for i in range(20)))
            assert await lane.call(("CLIENT", "ID")) == lane_id
            # the connection killed under calls in flight: every one is sent again, none is lost
            kill = asyncio.ensure_future(st.redis.execute_command("CLIENT", "KILL", "ID", lane_id))
            got = await asyncio.gather(*(lane.call(("ECHO", f"k{i}")) for i in range(30)))
            await kill
            assert got == [f"k{i}".encode() for i in range(30)]
            assert await lane.call(("CLIENT", "ID")) != lane_id
        finally:
            await st.close()

    arun(go())


def test_async_cancelled_call_leaves_no_reply_behind(standalone_url: str, arun: Any) -> None:
    async def go() -> None:
        st = await AsyncTraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            key = f"lane-missing-{uuid.uuid4().hex}"
            with pytest.raises(asyncio.TimeoutError):  # cancelled while the server holds the reply
                await asyncio.wait_for(lane.call(("BLPOP", key, "0.3")), 0.05)
            assert await lane.call(("PING",)) == b"PONG"  # queued behind it: its own reply, not the BLPOP's
            await asyncio.sleep(0.4)
            assert await lane.call(("PING",)) == b"PONG"
            await _aturn(st, "s", "hello there", " hi")
        finally:
            await st.close()

    arun(go())


def test_async_replies_read_together_are_taken_without_a_wait_each(standalone_url: str, arun: Any) -> None:
    """A pipelined batch's replies arrive together: the lane takes the ones already read off the
    socket from the parser, and goes through redis-py's ``read_response`` (its read timeout, its
    checks) only to wait for more. Counted on the lane's own connection."""

    async def go() -> None:
        st = await AsyncTraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            await lane.call(("PING",))
            conn = lane._conn  # noqa: SLF001
            waits = 0
            read = conn.read_response

            async def counted(*a: Any, **kw: Any) -> Any:
                nonlocal waits
                waits += 1
                return await read(*a, **kw)

            conn.read_response = counted
            replies = await lane.calls([("ECHO", f"e{i}") for i in range(200)] + [("NOSUCHCOMMAND",)])
            assert replies[:200] == [f"e{i}".encode() for i in range(200)]
            assert isinstance(replies[200], ResponseError)  # an error reply in its place, taken the same way
            assert 1 <= waits < 20, waits
            assert await lane.call(("ECHO", "after")) == b"after"  # the connection is clean
        finally:
            await st.close()

    arun(go())


def test_async_calls_of_one_loop_iteration_go_out_in_one_write(standalone_url: str, arun: Any) -> None:
    """The calls queued while the loop runs one iteration's callbacks (the turns woken together)
    are written together at its end: one write on the lane's connection for all of them, each
    still given its own reply; a call cancelled before the write leaves nothing behind."""

    async def go() -> None:
        st = await AsyncTraceStore.connect(standalone_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            await lane.call(("PING",))  # connected: a call no longer waits before it queues
            writer = lane._conn._writer  # noqa: SLF001
            writes = 0
            write = writer.writelines

            def counted(data: Any) -> None:
                nonlocal writes
                writes += 1
                write(data)

            writer.writelines = counted
            got = await asyncio.gather(*(lane.call(("ECHO", f"k{i}")) for i in range(40)))
            assert got == [f"k{i}".encode() for i in range(40)]
            assert writes == 1, writes
            gone = asyncio.ensure_future(lane.call(("ECHO", "gone")))
            await asyncio.sleep(0)  # queued, not written yet
            gone.cancel()
            # written with the next call (the same iteration): its reply read first and dropped
            assert await lane.call(("ECHO", "mine")) == b"mine"
            assert gone.cancelled() and writes == 2, writes
            assert await lane.call(("ECHO", "after")) == b"after" and writes == 3
        finally:
            await st.close()

    arun(go())


def test_async_cluster_scripts_take_a_lane_per_primary_and_a_moved_reply_goes_the_cluster_way(
    cluster_url: str, arun: Any
) -> None:
    """On a 3-primary cluster each primary gets a lane of its own, found from the slot map; a
    call sent to a primary that does not serve its slot (a stale map: here a lane picked wrong on
    purpose) is answered MOVED by the server and goes the cluster client's way, with the right
    reply; in a batch the calls of that slot follow it, in order."""

    async def go() -> None:
        st = await AsyncTraceStore.connect(cluster_url, run=f"lane-{uuid.uuid4().hex[:8]}")
        try:
            sids = [f"s{i}" for i in range(24)]
            for sid in sids:
                await _aturn(st, sid, "hello there", " hi")
            io = st._io  # noqa: SLF001 - the mechanism under test
            lanes = dict(io._lanes)  # noqa: SLF001
            assert len(lanes) == 3 and all(lane._conn is not None for lane in lanes.values())  # noqa: SLF001
            home = {sid: io._node_lane(st.context.keys.idx(sid)) for sid in sids}  # noqa: SLF001
            wrong = {sid: next(lane for lane in lanes.values() if lane is not home[sid]) for sid in sids}
            key = st.context.keys.idx(sids[0])
            with pytest.raises(MovedError):  # the server says: not here
                await wrong[sids[0]].call(("HLEN", key))
            tag = {st.context.keys.idx(sid).split("}", 1)[0]: sid for sid in sids}  # "ts:{run/sid" -> sid
            io._node_lane = lambda k: wrong[tag[k.split("}", 1)[0]]]  # type: ignore[method-assign]  # noqa: SLF001
            for sid in sids[:4]:  # single calls
                m = await st.lookup(sid, "hello there hi, and more")
                assert m.text_len == len("hello there hi")
            got = await st.gather(*(st.ops.lookup(sid, "hello there hi, and more") for sid in sids))  # a batch
            assert [m.text_len for m in got] == [len("hello there hi")] * len(sids)
            del io._node_lane  # noqa: SLF001 - the real routing again
            await _aturn(st, sids[0], "hello there hi, and more", " ok")
        finally:
            await st.close()

    arun(go())


def test_sync_cluster_scripts_take_a_lane_per_primary_and_a_moved_reply_goes_the_cluster_way(
    cluster_url: str,
) -> None:
    """The sync client's lanes on a 3-primary cluster: one per primary, over that node's own pool
    (counted there, given back on close); a call a lane sends to a primary that does not serve
    its slot (a lane picked wrong on purpose: a stale map) is answered MOVED and goes the cluster
    client's way, with the right reply."""
    st = TraceStore.connect(cluster_url, run=f"lane-{uuid.uuid4().hex[:8]}")
    sids = [f"s{i}" for i in range(12)]
    try:
        for sid in sids:
            _turn(st, sid, "hello there", " hi")
        io = st._io  # noqa: SLF001 - the mechanism under test
        lanes = {name: lane for name, (_, lane) in io._lanes.items()}  # noqa: SLF001
        assert len(lanes) == 3 and all(lane._conn is not None for lane in lanes.values())  # noqa: SLF001
        conns = {name: lane._conn for name, lane in lanes.items()}  # noqa: SLF001
        pools = {name: lane._pool for name, lane in lanes.items()}  # noqa: SLF001
        assert all(conns[n] in pools[n]._in_use_connections for n in lanes)  # noqa: SLF001
        home = {sid: io._node_lane(st.context.keys.idx(sid)) for sid in sids}  # noqa: SLF001
        assert len({id(home[sid]) for sid in sids}) == 3  # the 12 sessions span the 3 primaries
        wrong = {sid: next(lane for lane in lanes.values() if lane is not home[sid]) for sid in sids}
        with pytest.raises(MovedError):  # the server says: not here
            wrong[sids[0]].call(("HLEN", st.context.keys.idx(sids[0])))
        tag = {st.context.keys.idx(sid).split("}", 1)[0]: sid for sid in sids}  # "ts:{run/sid" -> sid
        io._node_lane = lambda k: wrong[tag[k.split("}", 1)[0]]]  # type: ignore[method-assign]  # noqa: SLF001
        for sid in sids:
            m = st.lookup(sid, "hello there hi, and more")
            assert m.text_len == len("hello there hi")
        _turn(st, sids[1], "hello there hi, and more", " ok", 1)  # a write, redirected too
        del io._node_lane  # noqa: SLF001 - the real routing again
        assert [len(st.export_training_trace(sids[1], "hello there hi, and more ok").input_ids)] == [9]
        assert all(lane._conn is conns[n] for n, lane in lanes.items())  # noqa: SLF001 - kept
    finally:
        st.close()
    assert all(conns[n] not in pools[n]._in_use_connections for n in lanes)  # noqa: SLF001 - given back


async def _reconnecting_slowly(lane: AsyncScriptLane, direct: Any, proxy: Any) -> tuple[Any, asyncio.Future[Any]]:
    """Kill the lane's connection, hold the new one's first reply (its handshake) for 0.5 s at
    ``proxy``, and send a call: (the old connection's id, that call) once the call is reconnecting,
    mid-handshake (the lane's lock held, the socket open, the lane not ready)."""
    lane_id = await lane.call(("CLIENT", "ID"))
    assert await direct.redis.execute_command("CLIENT", "KILL", "ID", lane_id) == 1
    proxy.hold_first_reply_s = 0.5
    first = asyncio.ensure_future(lane.call(("ECHO", "first")))
    for _ in range(2000):
        lock, conn = lane._lock, lane._conn  # noqa: SLF001
        if lock is not None and lock.locked() and conn is not None and conn.is_connected and not lane._ready:  # noqa: SLF001
            return lane_id, first
        await asyncio.sleep(0.002)
    raise AssertionError("the lane did not reconnect")


Body = Callable[[AsyncTraceStore, AsyncTraceStore, AsyncScriptLane, Any], Awaitable[None]]


def _behind_proxy(standalone_url: str, arun: Any, body: Body) -> None:
    """Run ``body(st, direct, lane, proxy)``: a store whose lane reaches the server through a
    :class:`CutProxy` (that can hold the handshake), a store connected directly (to kill the
    lane's connection), and the lane; both stores closed after it."""
    from tests._netcut import CutProxy

    host, port = standalone_url.removeprefix("redis://").split("/")[0].split(":")

    async def go(proxy: CutProxy) -> None:
        st = await AsyncTraceStore.connect(proxy.url, run=f"lane-{uuid.uuid4().hex[:8]}")
        direct = await AsyncTraceStore.connect(standalone_url, run="lane-kill")
        try:
            lane = st._io._lane  # noqa: SLF001
            assert isinstance(lane, AsyncScriptLane)
            await body(st, direct, lane, proxy)
        finally:
            await st.close()
            await direct.close()

    with CutProxy(host, int(port)) as proxy:
        arun(go(proxy))


def _writes_of_echoes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """From now on, the bytes of every stream write that carries an ``ECHO during-...`` call."""
    writes: list[bytes] = []
    write = asyncio.StreamWriter.writelines

    def counted(self: asyncio.StreamWriter, data: Any) -> None:
        out = b"".join(map(bytes, data))
        if b"during-" in out:
            writes.append(out)
        write(self, data)

    monkeypatch.setattr(asyncio.StreamWriter, "writelines", counted)
    return writes


def test_async_a_call_during_a_reconnect_waits_for_the_handshake(standalone_url: str, arun: Any) -> None:
    """A connection being reconnected reads its handshake's replies (CLIENT SETINFO's OKs) while
    redis-py already counts it connected: a call arriving then must not send on it, or the lane's
    reader takes the handshake's replies for its own (seen under load: ``open_session`` got
    ``OK``, a reply of another command; a reply of the right shape would have been taken
    silently)."""

    async def body(st: AsyncTraceStore, direct: AsyncTraceStore, lane: AsyncScriptLane, proxy: Any) -> None:
        failures = lane._gen  # noqa: SLF001
        lane_id, first = await _reconnecting_slowly(lane, direct, proxy)
        got = await asyncio.gather(*(lane.call(("ECHO", f"during-{i}")) for i in range(5)))
        assert got == [f"during-{i}".encode() for i in range(5)]
        assert await first == b"first"
        assert lane._gen == failures + 1  # noqa: SLF001 - the kill's failure, no other: one reader at a time
        assert await lane.call(("CLIENT", "ID")) != lane_id
        await _aturn(st, "s", "hello there", " hi")  # the store's scripts on the new connection

    _behind_proxy(standalone_url, arun, body)


def test_async_calls_waiting_for_a_reconnect_go_out_together(
    standalone_url: str, arun: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls that arrive while the lane reconnects wake together when the handshake is over
    and go out in one write, each with its own reply (waiting on the lock, each woke the next
    after its own turn: one write per loop iteration, ~20 writes for these 40 calls)."""

    async def body(st: AsyncTraceStore, direct: AsyncTraceStore, lane: AsyncScriptLane, proxy: Any) -> None:
        _, first = await _reconnecting_slowly(lane, direct, proxy)
        writes = _writes_of_echoes(monkeypatch)
        got = await asyncio.gather(*(lane.call(("ECHO", f"during-{i}")) for i in range(40)))
        assert got == [f"during-{i}".encode() for i in range(40)]
        assert await first == b"first"
        assert len(writes) == 1, [w.count(b"during-") for w in writes]
        assert writes[0].count(b"during-") == 40

    _behind_proxy(standalone_url, arun, body)


def test_async_calls_waiting_on_a_connect_cut_short_go_out_together_on_the_next(
    standalone_url: str, arun: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller reconnecting the lane is cancelled mid-handshake while 40 calls wait for it:
    one of them connects afresh, and all 40 go out in one write on the new connection, each
    with its own reply (they queued on the lock again: ~20 writes)."""

    async def body(st: AsyncTraceStore, direct: AsyncTraceStore, lane: AsyncScriptLane, proxy: Any) -> None:
        _, first = await _reconnecting_slowly(lane, direct, proxy)
        writes = _writes_of_echoes(monkeypatch)
        waiting = asyncio.ensure_future(asyncio.gather(*(lane.call(("ECHO", f"during-{i}")) for i in range(40))))
        await asyncio.sleep(0.05)  # all 40 wait for the handshake
        assert not waiting.done() and not lane._ready  # noqa: SLF001
        proxy.hold_first_reply_s = 0.0
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await waiting == [f"during-{i}".encode() for i in range(40)]
        assert len(writes) == 1, [w.count(b"during-") for w in writes]
        assert writes[0].count(b"during-") == 40

    _behind_proxy(standalone_url, arun, body)


def test_async_a_connect_cut_short_by_a_cancelled_caller_is_started_again(standalone_url: str, arun: Any) -> None:
    """The caller whose call reconnects the lane is cancelled while the handshake's replies are
    still coming: the next call must not take the half-done connection as ready (its handshake's
    replies unread, its ``SELECT`` maybe never sent) but connect afresh and get its own reply.
    (redis-py 8 closes the socket of a cancelled connect itself; the lane does not rely on it:
    the project allows redis-py from 5.2.)"""

    async def body(st: AsyncTraceStore, direct: AsyncTraceStore, lane: AsyncScriptLane, proxy: Any) -> None:
        lane_id, first = await _reconnecting_slowly(lane, direct, proxy)
        await asyncio.sleep(0.05)  # inside the held handshake
        assert not first.done() and not lane._ready, (first, lane._conn)  # noqa: SLF001
        first.cancel()  # mid-handshake
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not lane._ready  # noqa: SLF001
        proxy.hold_first_reply_s = 0.0
        got = await asyncio.gather(*(lane.call(("ECHO", f"after-{i}")) for i in range(5)))
        assert got == [f"after-{i}".encode() for i in range(5)]
        assert await lane.call(("CLIENT", "ID")) not in (lane_id, None)
        await _aturn(st, "s", "hello there", " hi")  # the store's scripts on the new connection

    _behind_proxy(standalone_url, arun, body)
