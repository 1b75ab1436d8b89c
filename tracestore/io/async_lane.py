"""The asyncio script lane: one kept connection per server (a standalone server, or each cluster
primary) that every task's script calls share, pipelined, outside redis-py's per-command path."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any

from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from ..connection import FastPacker

#: :meth:`AsyncScriptLane.call`'s answer when the lane cannot take the call (the client's
#: connections have no stream it can write to): send it through redis-py.
BUSY = object()

_Waiting = deque[tuple["asyncio.Future[list[Any]]", int, list[Any]]]

#: Bytes buffered in the script lane's transport above which a call waits for the socket to drain.
_HIGH_WATER = 1 << 20

#: :func:`_buffered_replies`' answer when no whole reply is buffered.
_WAIT: Any = object()


def _buffered_replies(conn: Any) -> Any:
    """A function giving the next reply already read off ``conn``'s socket, or :data:`_WAIT`.

    The replies of a pipelined batch arrive together: redis-py's
    ``read_response`` would enter a read timeout and check the connection for
    each. Here a buffered reply is taken from the connection's hiredis reader
    at once (an error reply is the redis-py exception its parser makes, a
    connection failure a ConnectionError); only waiting for data goes through
    ``read_response``. None without hiredis (or with a RESP3 connection, whose
    replies may be pushes): every reply through ``read_response``.
    """
    parser: Any = getattr(conn, "_parser", None)
    if getattr(parser, "_reader", None) is None or str(getattr(conn, "protocol", 2)) != "2":
        return None
    from redis._parsers.hiredis import NOT_ENOUGH_DATA

    def take() -> Any:
        reader = parser._reader  # noqa: SLF001 - None once disconnected
        if reader is None or not parser._connected:  # noqa: SLF001
            return _WAIT  # read_response raises the connection's error
        reply = reader.gets()
        return _WAIT if reply is NOT_ENOUGH_DATA else reply

    return take


class AsyncScriptLane:
    """The asyncio counterpart of :class:`~tracestore.io.sync_io.ScriptLane`, pipelined.

    One connection of a standalone client's pool kept checked out for script
    calls, **shared by every task**: a call packs its command (or a batch its
    commands) with the sync client's :class:`~tracestore.connection.FastPacker`
    (the same RESP bytes as redis-py's packer), queues it and waits for its
    place in the queue of replies; the calls queued during one event-loop
    iteration are written together at its end (one system call, and one read
    for the server, for the calls of every turn that ran meanwhile: a lone call
    waits for nothing); one reader task reads the replies in order (the
    connection's own parser) and hands each to its caller. So the turns of a
    gateway in flight together share one connection and its round trips, with
    none of redis-py's per-command machinery (a pool checkout and release, a
    pipeline object, timing records and observability counters, a Python
    encoder call per argument).

    * An error reply (NOSCRIPT, a script's error) is that call's exception (in
      a batch, in its place); the connection stays clean.
    * A connection error or timeout fails every call waiting on the
      connection, which is closed; each call is then sent again under the
      connection's retry policy (the scripts are idempotent under retry), on a
      new connection.
    * A cancelled caller leaves nothing behind: its reply is read in its turn
      and dropped.
    """

    __slots__ = ("_pool", "_conn", "_pid", "_packer", "_waiting", "_reader", "_lock", "_settled", "_gen", "_out", "_ready")

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: Any = None
        self._pid = os.getpid()
        self._packer = FastPacker()
        self._waiting: _Waiting = deque()
        self._reader: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        # set when the (re)connect under way ends, however it ends: the calls that arrived
        # meanwhile wake together (on the lock they would go one per loop iteration)
        self._settled: asyncio.Event | None = None
        self._gen = 0  # counts the connection's failures: a late failure report fails nothing newer
        self._out: list[bytes] | None = None  # the commands to write at the end of this loop iteration
        # True once the connection's connect() (with its handshake) is over; redis-py counts a
        # connection connected while its handshake still reads its replies (see _connection).
        self._ready = False

    @property
    def pool_node(self) -> Any:
        """The cluster node whose connection this lane keeps (None: a standalone server's pool)."""
        return getattr(self._pool, "node", None)

    async def call(self, args: tuple[Any, ...]) -> Any:
        """The reply of the command ``args`` (an error reply raises its redis-py exception), or :data:`BUSY`."""
        got = await self._exchange([self._packer.pack(*args)])
        if got is BUSY:
            return BUSY
        reply = got[0]
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def calls(self, commands: list[tuple[Any, ...]]) -> Any:
        """The replies of ``commands``, pipelined, an error reply in its place; or :data:`BUSY`."""
        return await self._exchange([self._packer.pack(*args) for args in commands])

    async def _exchange(self, packed: list[list[bytes]]) -> Any:
        conn = await self._connection()
        if conn is None:
            return BUSY
        sent = [self._gen]

        async def attempt() -> list[Any]:
            c = await self._connection()
            if c is None:
                raise ConnectionError("the script lane has no connection")
            sent[0] = self._gen
            return await self._send(c, packed)

        async def failed(_err: BaseException) -> None:
            if self._gen == sent[0]:
                await self._fail(ConnectionError("the script lane's connection failed"))

        return await conn.retry.call_with_retry(attempt, failed)

    async def _connection(self) -> Any:
        """The lane's connection, connected and past its handshake (None: it has no writer).

        redis-py counts a connection connected as soon as its socket is open, while its
        ``connect()`` still sends the handshake (``CLIENT SETINFO``, ``SELECT``) and reads its
        replies. A call sent then would have the lane's reader take those replies for its own,
        and the handshake read the calls' (two readers on one stream): a call waits on the lock
        instead, until the connect is over. The calls that arrive during a reconnect wait for
        its end together and go out in one write (one waiting on the lock would wake the next
        only after its own turn: one write per loop iteration, ~500 after a reconnect under load).
        """
        conn = self._conn
        if conn is not None and self._ready and self._pid == os.getpid() and conn.is_connected:
            return conn
        if self._lock is None or self._pid != os.getpid():
            self._lock, self._settled = asyncio.Lock(), None
        # (again after a connect that failed or was cancelled: the next one's waiters wake together too)
        while (settled := self._settled) is not None and not settled.is_set() and self._lock.locked():
            await settled.wait()
            conn = self._conn
            if conn is not None and self._ready and self._pid == os.getpid() and conn.is_connected:
                return conn if getattr(conn, "_writer", None) is not None else None
        async with self._lock:
            self._settled = settled = asyncio.Event()
            try:
                return await self._connect()
            finally:
                settled.set()

    async def _connect(self) -> Any:
        """:meth:`_connection`'s part under the lock: the lane's connection, connected."""
        conn = self._conn
        if conn is None or self._pid != os.getpid():
            self._ready = False
            self._conn, self._waiting, self._reader = None, deque(), None
            conn = await self._pool.get_connection()
            self._conn, self._pid = conn, os.getpid()
        elif not (self._ready and conn.is_connected):
            self._ready = False
            try:
                await conn.connect()
            except BaseException:
                # a connect cut short (its caller cancelled) is not left "connected" with its
                # handshake's replies unread: the next call connects afresh (the lane does not
                # rely on redis-py closing it)
                await conn.disconnect(nowait=True)
                raise
        self._ready = True
        return conn if getattr(conn, "_writer", None) is not None else None

    async def _send(self, conn: Any, packed: list[list[bytes]]) -> list[Any]:
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append((fut, len(packed), []))
        out = self._out
        if out is None:  # the first call of this loop iteration: its flush writes every call's
            self._out = out = []
            asyncio.get_running_loop().call_soon(self._flush, conn, self._gen)
        for cmd in packed:
            out += cmd
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read(conn, self._waiting))
        writer = conn._writer  # noqa: SLF001
        if writer.transport.get_write_buffer_size() > _HIGH_WATER:  # the server reads slower than we write
            gen = self._gen
            try:
                await writer.drain()
            except OSError as exc:
                if gen == self._gen:
                    await self._fail(ConnectionError(f"writing to the script lane: {exc}"))
            except asyncio.CancelledError:
                fut.cancel()  # its reply is read in its turn and dropped
                raise
        # Not shielded: a cancelled caller cancels its future, and the reader (or a failure)
        # finds it done and drops its reply in its turn (one future per call, not three).
        return await fut

    def _flush(self, conn: Any, gen: int) -> None:
        """Write the commands queued during this loop iteration, in the order of the queue of
        replies, in one write (one system call for the calls of every turn that ran meanwhile)."""
        if gen != self._gen:  # the connection failed meanwhile: its calls were failed with it
            return
        out, self._out = self._out, None
        if not out:
            return
        try:
            conn._writer.writelines(out)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001 - every waiting call learns of it
            asyncio.ensure_future(self._fail_gen(gen, ConnectionError(f"writing to the script lane: {exc!r}")))

    async def _fail_gen(self, gen: int, exc: BaseException) -> None:
        """:meth:`_fail`, unless the connection failed (and was replaced) since generation ``gen``."""
        if gen == self._gen:
            await self._fail(exc)

    async def _read(self, conn: Any, waiting: _Waiting) -> None:
        buffered = _buffered_replies(conn)
        try:
            while waiting:
                fut, n, acc = waiting[0]
                reply = buffered() if buffered is not None else _WAIT
                if reply is _WAIT:  # none read yet: redis-py waits for it (under its read timeout)
                    try:
                        # not disconnected by redis-py on an error: _fail closes the connection if
                        # this reader's calls are its current ones (a reader cancelled late must
                        # not close the connection reconnected meanwhile)
                        reply = await conn.read_response(disconnect_on_error=False)
                    except ResponseError as err:
                        reply = err
                elif isinstance(reply, ConnectionError):
                    raise reply
                elif isinstance(reply, list) and reply and isinstance(reply[0], ConnectionError):
                    raise reply[0]  # (as redis-py's parser does)
                acc.append(reply)
                if len(acc) == n:
                    waiting.popleft()
                    if not fut.done():
                        fut.set_result(acc)
        except BaseException as exc:  # every waiting call learns of it
            failure = exc if isinstance(exc, (ConnectionError, TimeoutError)) else ConnectionError(f"the script lane's read failed: {exc!r}")
            await self._fail(failure, waiting)
            if not isinstance(exc, Exception):
                raise
        finally:
            if waiting is self._waiting and self._reader is asyncio.current_task():
                self._reader = None

    async def _fail(self, err: BaseException, waiting: _Waiting | None = None) -> None:
        """Fail the calls waiting on the connection; if they are its current ones, close it (a reply
        may be unread) and stop its reader."""
        if waiting is None or waiting is self._waiting:
            waiting = self._waiting
            reader, self._waiting, self._reader = self._reader, deque(), None
            self._gen += 1
            self._ready = False
            self._out = None  # (its flush finds the generation changed and writes nothing)
            if reader is not None and reader is not asyncio.current_task():
                reader.cancel()
            if self._conn is not None:
                await self._conn.disconnect(nowait=True)
        while waiting:
            fut, _, _ = waiting.popleft()
            if not fut.done():
                fut.set_exception(err)

    async def close(self) -> None:
        """Give the connection back to the pool (the next call takes one again)."""
        conn, self._conn = self._conn, None
        reader, self._waiting, self._reader = self._reader, deque(), None
        self._gen += 1  # a flush still due writes nothing to a connection given back
        self._ready = False
        self._out = None
        if reader is not None:  # calls in flight: their replies are never read
            reader.cancel()
            if conn is not None:
                await conn.disconnect(nowait=True)
        if conn is not None and self._pid == os.getpid():
            await self._pool.release(conn)


class NodePool:
    """A cluster primary's connections (redis-py's ``ClusterNode``) as the pool a lane takes its
    one connection from: a connection of the node's own, connected, given back when the lane closes.

    The node's connections do not retry (redis-py leaves retries to the cluster client), so a lane
    to a node that failed or lost the slot raises at once and its caller sends the call the cluster
    client's way, which follows the redirect and learns the new slot map.
    """

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node

    async def get_connection(self) -> Any:
        """A connected connection of the node's (ConnectionError: the node does not answer)."""
        conn = self.node.acquire_connection()
        try:
            if not conn.is_connected:
                await conn.connect()
        except BaseException:
            self.node.release(conn)
            raise
        return conn

    async def release(self, conn: Any) -> None:
        """Give ``conn`` back to the node."""
        self.node.release(conn)

