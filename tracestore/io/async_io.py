"""The asyncio I/O layer: :class:`AsyncIO` executes requests with ``redis.asyncio.Redis`` or its ``RedisCluster``."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import TYPE_CHECKING, Any

import redis.asyncio
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from ..connection import ConnectionOptions, FastPacker
from ..durability import NONE, Durability
from ..errors import PermissionDenied, ScriptError, StorageError, TracestoreError
from ..keys import key_slot
from ..replies import text
from ..scripts import Batch, Blocking, Cmd, Eval, Request, ScanAll, ServerTime
from .commands import (
    REDIS_ERRORS,
    acl_user,
    apply_callback,
    decode_script_reply,
    describe,
    eval_args,
    explain_denied,
    finish_batch,
    mutates,
    permission_probes,
    queue_request,
    script_args,
    time_ms,
    with_acl_hint,
    wrap_error,
)
from .durable import DurablePath, check_level, server_name

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

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

    __slots__ = ("_pool", "_conn", "_pid", "_packer", "_waiting", "_reader", "_lock", "_gen", "_out")

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: Any = None
        self._pid = os.getpid()
        self._packer = FastPacker()
        self._waiting: _Waiting = deque()
        self._reader: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._gen = 0  # counts the connection's failures: a late failure report fails nothing newer
        self._out: list[bytes] | None = None  # the commands to write at the end of this loop iteration

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
        conn = self._conn
        if conn is not None and self._pid == os.getpid() and conn.is_connected:
            return conn
        if self._lock is None or self._pid != os.getpid():
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = self._conn
            if conn is None or self._pid != os.getpid():
                self._conn, self._waiting, self._reader = None, deque(), None
                conn = await self._pool.get_connection()
                self._conn, self._pid = conn, os.getpid()
            elif not conn.is_connected:
                await conn.connect()
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
            asyncio.ensure_future(self._fail(ConnectionError(f"writing to the script lane: {exc!r}")))

    async def _read(self, conn: Any, waiting: _Waiting) -> None:
        buffered = _buffered_replies(conn)
        try:
            while waiting:
                fut, n, acc = waiting[0]
                reply = buffered() if buffered is not None else _WAIT
                if reply is _WAIT:  # none read yet: redis-py waits for it (under its read timeout)
                    try:
                        reply = await conn.read_response()
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
        self._out = None
        if reader is not None:  # calls in flight: their replies are never read
            reader.cancel()
            if conn is not None:
                await conn.disconnect(nowait=True)
        if conn is not None and self._pid == os.getpid():
            await self._pool.release(conn)


class AsyncIO:
    """Executes requests with ``redis.asyncio.Redis`` or its ``RedisCluster``."""

    #: Requests of cluster batches in flight at once per client: the async
    #: cluster client raises MaxConnectionsError instead of waiting when a
    #: node's pool (ConnectionOptions.max_connections, 64) runs out.
    CLUSTER_INFLIGHT = 32

    def __init__(
        self,
        client: redis.asyncio.Redis | AsyncRedisCluster,
        *,
        cluster: bool,
        durability: Durability = NONE,
        opts: ConnectionOptions | None = None,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self._inflight = asyncio.Semaphore(self.CLUSTER_INFLIGHT)
        self.durability = durability
        self._durable = DurablePath(durability, opts) if durability.waits else None
        self._acl_user = acl_user(client)  # names the user in a failed script's hint
        # script calls on a standalone server skip redis-py's per-command machinery
        pool = getattr(client, "connection_pool", None)
        plain = not cluster and isinstance(client, redis.asyncio.Redis) and client.connection is None
        self._lane = AsyncScriptLane(pool) if plain and pool is not None else None

    async def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
            if self._durable is not None and mutates(req):
                assert isinstance(req, (Eval, Batch))
                return self._durable.finish(req, await self._durable_replies(req))
            return await self._dispatch(req)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, describe(req)) from exc
        except PermissionDenied as err:
            raise (await self._explained(err, req)) from err
        except ScriptError as err:
            if self._acl_user is None or not isinstance(req, (Eval, Batch)):
                raise
            raise with_acl_hint(err, self._acl_user, req) from err

    async def _explained(self, err: PermissionDenied, req: Request) -> PermissionDenied:
        """``err`` naming the key patterns its user may not access (one round trip; ``err`` if that fails)."""
        probes = permission_probes(req)
        if not probes:
            return err
        try:
            replies = await self._dispatch(Batch(tuple(c for _, c in probes), errors_in_place=True))
        except Exception:  # noqa: BLE001 - the diagnosis is best effort: the first error stands
            return err
        return explain_denied(err, probes, replies)

    async def _dispatch(self, req: Request) -> Any:
        if isinstance(req, Eval):
            return await self._eval(req)
        if isinstance(req, Batch):
            return await self._batch(req)
        if isinstance(req, Cmd):
            return await self._cmd(req)
        if isinstance(req, ScanAll):
            return await self._scan_all(req)
        if isinstance(req, ServerTime):
            return time_ms(await self._cmd(Cmd(("TIME",), key=req.key)))
        if isinstance(req, Blocking):
            return await asyncio.to_thread(req.fn)
        raise TypeError(f"unknown request {req!r}")

    async def _eval(self, ev: Eval) -> Any:
        try:
            try:
                reply = await self._script(ev, use_sha=True)
            except NoScriptError:
                reply = await self._script(ev, use_sha=False)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"script {ev.script.name}") from exc
        return decode_script_reply(ev, reply)

    async def _script(self, ev: Eval, *, use_sha: bool) -> Any:
        if self._lane is not None:
            reply = await self._lane.call(script_args(ev, use_sha))
            if reply is not BUSY:
                return reply
        c: Any = self.client
        if not ev.script.readonly:
            if use_sha:
                return await c.evalsha(ev.script.sha, *eval_args(ev))
            return await c.eval(ev.script.source, *eval_args(ev))
        if self.cluster:
            node = c.get_node_from_key(ev.keys[0]) if ev.keys else c.get_random_node()
            return await c.execute_command(*script_args(ev, use_sha), target_nodes=node)
        return await c.execute_command(*script_args(ev, use_sha))

    async def _batch(self, batch: Batch) -> list[Any]:
        if not batch.requests:
            return []
        replies = await self._pipeline(batch.requests, use_sha=True)
        retry = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if retry:
            again = await self._pipeline([batch.requests[i] for i in retry], use_sha=False)
            for i, r in zip(retry, again, strict=True):
                replies[i] = r
        return finish_batch(batch, replies)

    async def _pipeline(self, reqs: Any, *, use_sha: bool) -> list[Any]:
        if self.cluster:
            # The async cluster client routes each call (following redirects);
            # issuing them concurrently gives one round trip per node as well.
            # Requests of one hash slot keep their order (as in a pipeline):
            # a purge's tombstone must land before its UNLINK.
            out: list[Any] = [None] * len(reqs)
            chains: dict[Any, list[int]] = {}
            for i, r in enumerate(reqs):
                key = r.keys[0] if isinstance(r, Eval) and r.keys else getattr(r, "key", None)
                chains.setdefault(key_slot(key) if key is not None else ("alone", i), []).append(i)

            async def chain(idxs: list[int]) -> None:
                for i in idxs:
                    async with self._inflight:
                        out[i] = await self._single(reqs[i], use_sha)

            await asyncio.gather(*(chain(c) for c in chains.values()))
            return out
        if self._lane is not None and all(isinstance(r, Eval) for r in reqs):
            try:
                replies = await self._lane.calls([script_args(r, use_sha) for r in reqs])
            except REDIS_ERRORS as exc:
                raise wrap_error(exc, "pipeline") from exc
            if replies is not BUSY:  # as redis-py's pipeline without raise_on_error: errors in place
                return list(replies)
        pipe: Any = self.client.pipeline(transaction=False)
        for r in reqs:
            queue_request(pipe, r, use_sha)
        try:
            return list(await pipe.execute(raise_on_error=False))
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, "pipeline") from exc

    async def _single(self, r: Eval | Cmd, use_sha: bool) -> Any:
        try:
            if isinstance(r, Eval):
                return await self._script(r, use_sha=use_sha)
            return await self._cmd(r)
        except (*REDIS_ERRORS, TracestoreError) as exc:
            return exc

    async def _cmd(self, cmd: Cmd) -> Any:
        c: Any = self.client
        try:
            if cmd.block_s is not None:
                return await self._blocking(cmd)
            if self.cluster and cmd.key is not None:
                node = c.get_node_from_key(cmd.key)
                return await c.execute_command(*cmd.args, target_nodes=node)
            return await c.execute_command(*cmd.args)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"command {cmd.args[0]}") from exc

    async def _blocking(self, cmd: Cmd) -> Any:
        assert cmd.block_s is not None
        c: Any = self.client
        if self.cluster and cmd.key is not None:
            # A connection of the node owning the key's slot, read with a timeout
            # that covers the block time (the cluster client's own calls would
            # cut the wait at the socket timeout).
            node = c.get_node_from_key(cmd.key)
            nconn = node.acquire_connection()
            try:
                await nconn.send_command(*cmd.args)
                reply = await nconn.read_response(timeout=cmd.block_s + 5.0)
            except BaseException:
                await nconn.disconnect()
                raise
            finally:
                node.release(nconn)
            if isinstance(reply, ResponseError):
                raise reply
            return reply
        if self.cluster:
            return await c.execute_command(*cmd.args)
        conn = await c.connection_pool.get_connection()
        try:
            await conn.send_command(*cmd.args)
            return await conn.read_response(timeout=cmd.block_s + 5.0)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await c.connection_pool.release(conn)

    async def _scan_all(self, req: ScanAll) -> list[str]:
        c: Any = self.client
        out: list[str] = []
        try:
            if self.cluster:
                for node in c.get_primaries():
                    cursor = 0
                    while True:
                        reply = await c.execute_command(
                            "SCAN", cursor, "MATCH", req.pattern, "COUNT", req.count,
                            *(("TYPE", req.type) if req.type else ()),
                            target_nodes=node,
                        )
                        cursor, keys = reply
                        if isinstance(cursor, dict):  # the cluster client keys cursors by node
                            (cursor,) = cursor.values()
                        out.extend(text(k) for k in keys)
                        if int(cursor) == 0:
                            break
            else:
                async for k in c.scan_iter(match=req.pattern, count=req.count, _type=req.type):
                    out.append(text(k))
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, "SCAN") from exc
        return out

    async def check_durability(self) -> None:
        """The asyncio counterpart of :meth:`SyncIO.check_durability`."""
        if self._durable is None:
            return
        c: Any = self.client
        if self.cluster:
            try:
                await c.initialize()
                nodes = c.get_primaries()
            except REDIS_ERRORS as exc:
                raise StorageError(f"cluster nodes unavailable: {type(exc).__name__}: {exc}") from exc
            for node in nodes:
                try:
                    info = await c.execute_command("INFO", "replication", target_nodes=node)
                    known = await c.execute_command("CLUSTER", "NODES", target_nodes=node)
                    aof: Any = await c.execute_command("WAITAOF", 1, 0, 1, target_nodes=node)
                except ResponseError as exc:
                    aof = exc
                except REDIS_ERRORS as exc:
                    raise wrap_error(exc, f"durability check of {node.name}") from exc
                check_level(self.durability, node.name, info, aof, known)
            return
        name = server_name(c)
        pipe = c.pipeline(transaction=False)
        pipe.info("replication")
        pipe.execute_command("WAITAOF", 1, 0, 1)
        try:
            info, aof = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"durability check of {name}") from exc
        check_level(self.durability, name, info, aof)

    # -- the durable path (see SyncIO._durable_replies) -------------------------------------

    async def _durable_replies(self, req: Eval | Batch) -> list[Any]:
        d = self._durable
        assert d is not None
        c: Any = self.client
        reqs, out, pending = d.start(req)
        for attempt in range(d.attempts):
            if attempt:
                await asyncio.sleep(d.backoff.compute(attempt))
                await self._refresh_slots()
            if self.cluster:
                try:
                    await c.initialize()  # the asyncio cluster client learns its slot map on first use
                except REDIS_ERRORS as exc:
                    raise StorageError(f"cluster slot map unavailable: {type(exc).__name__}: {exc}") from exc
            groups = d.route(c, self.cluster, reqs, pending, self._target)
            results = await asyncio.gather(
                *(self._node_exchange(node, name, [reqs[i] for i in idxs]) for node, name, idxs in groups)
            )
            pending = d.collect(groups, results, out)
            if not pending:
                break
        return out

    @staticmethod
    def _target(node: Any) -> Any:
        """Where a node's exchange is written: the ClusterNode (None: the client's own pool)."""
        return node

    async def _refresh_slots(self) -> None:
        if self.cluster:
            c: Any = self.client
            try:
                await c.nodes_manager.initialize()
            except REDIS_ERRORS:
                pass

    async def _node_exchange(self, node: Any, name: str, reqs: list[Eval | Cmd]) -> list[Any]:
        d = self._durable
        assert d is not None
        replies = await self._exchange(node, d.commands(reqs, [True] * len(reqs)))
        out = d.confirm(reqs, replies, name)
        missing = [j for j, r in enumerate(out) if isinstance(r, NoScriptError)]
        if missing:
            sub = [reqs[j] for j in missing]
            again = d.confirm(sub, await self._exchange(node, d.commands(sub, [False] * len(sub))), name)
            for j, r in zip(missing, again, strict=True):
                out[j] = r
        return out

    async def _exchange(self, node: Any, cmds: list[tuple[Any, ...]]) -> list[Any]:
        """One round trip on a pooled connection (of ``node``, a ClusterNode; None: standalone)."""
        d = self._durable
        assert d is not None
        c: Any = self.client
        async with self._inflight:
            try:
                if node is None:
                    conn = await c.connection_pool.get_connection()
                else:
                    conn = node.acquire_connection()
            except REDIS_ERRORS as exc:
                return [exc] * len(cmds)
            callbacks = node.response_callbacks if node is not None else c.response_callbacks
            try:
                await conn.send_packed_command(conn.pack_commands(cmds))
                out: list[Any] = []
                for args, timeout in zip(cmds, d.timeouts(cmds), strict=True):
                    try:
                        out.append(apply_callback(callbacks, args, await conn.read_response(timeout=timeout)))
                    except ResponseError as exc:
                        out.append(exc)
                return out
            except REDIS_ERRORS as exc:
                await conn.disconnect()
                return [exc] * len(cmds)
            except BaseException:
                await conn.disconnect()
                raise
            finally:
                if node is None:
                    await c.connection_pool.release(conn)
                else:
                    node.release(conn)

    async def close(self) -> None:
        """Close the client's connections."""
        if self._lane is not None:
            await self._lane.close()
        await self.client.aclose()
