"""The synchronous I/O layer: :class:`SyncIO` executes requests with a redis-py ``Redis`` or ``RedisCluster``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError, TimeoutError

from ..connection import ConnectionOptions, FastPacker, fast_packer
from ..durability import NONE, Durability
from ..errors import PermissionDenied, ScriptError, StorageError
from ..replies import text
from ..scripts import Batch, Blocking, Cmd, Eval, Request, ScanAll, ServerTime
from .commands import (
    NOT_HERE,
    REDIS_ERRORS,
    acl_user,
    apply_callback,
    decode_script_reply,
    describe,
    eval_args,
    explain_denied,
    finish_batch,
    is_connection_error,
    is_redirect,
    mutates,
    permission_probes,
    queue_request,
    route_key,
    script_args,
    time_ms,
    with_acl_hint,
    wrap_error,
)
from .durable import DurablePath, check_level, server_name

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

#: :meth:`ScriptLane.call`'s answer when another thread holds the lane.
BUSY = object()


class ScriptLane:
    """One connection of a pool, kept checked out for its script calls: a standalone client's
    pool, or on a cluster one primary's (a lane per primary, :meth:`SyncIO._node_lane`).

    A script call is one command and one reply, the call every turn makes twice
    (``lookup``'s ``read_index``, ``record_turn``'s script), and redis-py's
    ``execute_command`` spends more client CPU around it than on it: a pool
    checkout and release per command (a ``poll`` of the socket, the lock,
    four observability counter updates, an event dispatch), its own timing and
    metrics records, a closure per call. The lane sends the same command bytes
    (the client's packer) on a connection it keeps, under the same retry
    policy (the connection's ``Retry``: connection errors and timeouts, each
    followed by a disconnect, so the next attempt reconnects), and reads the
    reply with the same parser; a reply that is an error (NOSCRIPT, a script
    error) raises the same redis-py exception.

    The connection is the pool's (counted in ``max_connections``; a
    ``pool.disconnect()`` closes it too, and the next call reconnects), never
    left with a reply unread: any exception other than a server's error reply
    disconnects it. One thread at a time: a call finding the lane busy gets
    :data:`BUSY` and goes through redis-py. After a fork the child takes a
    connection of its own (the pool resets itself in the child).

    ``packer``: packs the commands instead of the connection's packer (a cluster's nodes use
    redis-py's Python packer, one encode call per argument; a standalone client's already
    has the :class:`~tracestore.connection.FastPacker`). The bytes are the same.
    On a cluster a reply that says "not here" (MOVED, ASK, TRYAGAIN, CLUSTERDOWN,
    READONLY) raises as any error reply does; the caller sends the call the cluster
    client's way (the nodes' connections do not retry: a failed node falls back at once).
    """

    __slots__ = ("_pool", "_lock", "_conn", "_pid", "_pack")

    def __init__(self, pool: Any, packer: FastPacker | None = None) -> None:
        self._pool = pool
        self._pack = packer.pack if packer is not None else None
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = os.getpid()

    def call(self, args: tuple[Any, ...]) -> Any:
        """The reply of the command ``args`` (redis-py errors raise), or :data:`BUSY`."""
        if not self._lock.acquire(blocking=False):
            return BUSY
        try:
            conn = self._conn
            if conn is None or self._pid != os.getpid():
                self._conn = None
                conn = self._pool.get_connection()
                self._conn, self._pid = conn, os.getpid()
            packed = conn.pack_command(*args) if self._pack is None else self._pack(*args)

            def attempt() -> Any:
                conn.send_packed_command(packed)
                return conn.read_response()

            try:
                return conn.retry.call_with_retry(attempt, lambda _err: conn.disconnect())
            except ResponseError:
                raise  # the server's error reply, read whole: the connection is clean
            except BaseException:
                conn.disconnect()  # a reply may be unread (redis-py's own errors did this already)
                raise
            finally:
                if conn.should_reconnect():  # (redis-py's maintenance notifications)
                    conn.disconnect()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Give the connection back to the pool (the next call takes one again)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._pid == os.getpid():
                self._pool.release(conn)


class SyncIO:
    """Executes requests with a redis-py ``Redis`` or ``RedisCluster`` client."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        cluster: bool,
        durability: Durability = NONE,
        opts: ConnectionOptions | None = None,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self.durability = durability
        self._durable = DurablePath(durability, opts) if durability.waits else None
        self._acl_user = acl_user(client)  # names the user in a failed script's hint
        # script calls on a standalone server skip redis-py's per-command machinery
        pool = getattr(client, "connection_pool", None)
        plain = not cluster and isinstance(client, redis.Redis) and client.connection is None
        self._lane = ScriptLane(pool) if plain and pool is not None else None
        # on a cluster, a lane per primary (keyed by node name), over that node's own pool
        self._lanes: dict[str, tuple[Any, ScriptLane]] = {}
        self._lanes_lock = threading.Lock()

    def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
            if self._durable is not None and mutates(req):
                assert isinstance(req, (Eval, Batch))
                return self._durable.finish(req, self._durable_replies(req))
            return self._dispatch(req)
        except REDIS_ERRORS as exc:  # one the steps below did not wrap (cluster routing...)
            raise wrap_error(exc, describe(req)) from exc
        except PermissionDenied as err:
            raise self._explained(err, req) from err
        except ScriptError as err:
            if self._acl_user is None or not isinstance(req, (Eval, Batch)):
                raise
            raise with_acl_hint(err, self._acl_user, req) from err

    def _explained(self, err: PermissionDenied, req: Request) -> PermissionDenied:
        """``err`` naming the key patterns its user may not access (one round trip; ``err`` if that fails)."""
        probes = permission_probes(req)
        if not probes:
            return err
        try:
            replies = self._dispatch(Batch(tuple(c for _, c in probes), errors_in_place=True))
        except Exception:  # noqa: BLE001 - the diagnosis is best effort: the first error stands
            return err
        return explain_denied(err, probes, replies)

    def _dispatch(self, req: Request) -> Any:
        if isinstance(req, Eval):
            return self._eval(req)
        if isinstance(req, Batch):
            return self._batch(req)
        if isinstance(req, Cmd):
            return self._cmd(req)
        if isinstance(req, ScanAll):
            return self._scan_all(req)
        if isinstance(req, ServerTime):
            return self._time(req)
        if isinstance(req, Blocking):
            return req.fn()
        raise TypeError(f"unknown request {req!r}")

    def _eval(self, ev: Eval) -> Any:
        try:
            try:
                reply = self._script(ev, use_sha=True)
            except NoScriptError:
                reply = self._script(ev, use_sha=False)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"script {ev.script.name}") from exc
        return decode_script_reply(ev, reply)

    def _script(self, ev: Eval, *, use_sha: bool) -> Any:
        if self._lane is not None:
            reply = self._lane.call(script_args(ev, use_sha))
            if reply is not BUSY:
                return reply
        elif self.cluster and ev.keys and (lane := self._node_lane(ev.keys[0])) is not None:
            try:
                reply = lane.call(script_args(ev, use_sha))
            except (*NOT_HERE, ConnectionError, TimeoutError):
                reply = BUSY  # the cluster client's way (scripts are idempotent under retry)
            if reply is not BUSY:
                return reply
        c: Any = self.client
        if not ev.script.readonly:
            return c.evalsha(ev.script.sha, *eval_args(ev)) if use_sha else c.eval(ev.script.source, *eval_args(ev))
        if self.cluster:  # (the cluster client would ask the server for an _RO command's keys)
            node = c.get_node_from_key(ev.keys[0]) if ev.keys else c.get_random_node()
            return c.execute_command(*script_args(ev, use_sha), target_nodes=node)
        return c.execute_command(*script_args(ev, use_sha))

    def _node_lane(self, key: str) -> ScriptLane | None:
        """The script lane of the primary serving ``key``'s slot, over that node's own pool; None
        before the cluster client knows its slot map or when no node serves the slot. A refreshed
        slot map makes new node objects: a node's lane is made again for its new object."""
        c: Any = self.client
        try:
            node = c.get_node_from_key(key)
        except REDIS_ERRORS:
            return None
        if node is None:
            return None
        got = self._lanes.get(node.name)
        if got is not None and got[0] is node:
            return got[1]
        with self._lanes_lock:
            got = self._lanes.get(node.name)
            if got is not None and got[0] is node:
                return got[1]
            try:
                pool = c.get_redis_connection(node).connection_pool
            except REDIS_ERRORS:
                return None
            lane = ScriptLane(pool, fast_packer())  # (the cluster client's nodes pack in Python)
            self._lanes[node.name] = (node, lane)
        if got is not None:
            got[1].close()  # the old node object's connection back to its pool
        return lane

    def _batch(self, batch: Batch) -> list[Any]:
        if not batch.requests:
            return []
        replies = self._pipeline(batch.requests, use_sha=True)
        retry = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if retry:
            again = self._pipeline([batch.requests[i] for i in retry], use_sha=False)
            for i, r in zip(retry, again, strict=True):
                replies[i] = r
        return finish_batch(batch, replies)

    def _pipeline(self, reqs: Any, *, use_sha: bool) -> list[Any]:
        if self.cluster:
            return self._cluster_pipeline(reqs, use_sha=use_sha)
        pipe: Any = self.client.pipeline(transaction=False)
        for r in reqs:
            queue_request(pipe, r, use_sha)
        try:
            return list(pipe.execute(raise_on_error=False))
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, "pipeline") from exc

    def _cluster_pipeline(self, reqs: Any, *, use_sha: bool) -> list[Any]:
        # redis-py's cluster pipeline refuses EVALSHA, so group the requests by
        # the node that serves their slot and pipeline each group on that
        # node's own connection. A request that meets a redirect (slot moved)
        # is re-run alone through the cluster client, which follows MOVED/ASK.
        c: Any = self.client
        replies: list[Any] = [None] * len(reqs)
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, r in enumerate(reqs):
            node = c.get_node_from_key(route_key(r)) if route_key(r) else c.get_random_node()
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        for name, idxs in by_node.items():
            pipe: Any = c.get_redis_connection(nodes[name]).pipeline(transaction=False)
            for i in idxs:
                queue_request(pipe, reqs[i], use_sha)
            try:
                out = pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as exc:
                out = [exc] * len(idxs)
            for i, reply in zip(idxs, out, strict=True):
                # A redirect (slot moved) or a lost connection: re-run the request
                # alone through the cluster client, which follows MOVED/ASK and
                # retries connection errors (a node's own pipeline does not). Safe
                # because every mutating script replays its reply by op id.
                if isinstance(reply, RedisError) and (is_redirect(reply) or is_connection_error(reply)):
                    reply = self._single(reqs[i], use_sha)
                replies[i] = reply
        return replies

    def _single(self, r: Eval | Cmd, use_sha: bool) -> Any:
        try:
            if isinstance(r, Eval):
                return self._script(r, use_sha=use_sha)
            return self._cmd(r)
        except REDIS_ERRORS as exc:
            return exc

    def _cmd(self, cmd: Cmd) -> Any:
        c: Any = self.client
        try:
            if cmd.block_s is not None:
                return self._blocking(cmd)
            if self.cluster and cmd.key is not None:
                return c.execute_command(*cmd.args, target_nodes=self._node_of(cmd.key))
            return c.execute_command(*cmd.args)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"command {cmd.args[0]}") from exc

    def _node_of(self, key: str) -> Any:
        c: Any = self.client
        return c.get_node_from_key(key)

    def _blocking(self, cmd: Cmd) -> Any:
        # A dedicated connection whose read timeout covers the block time, so
        # a long BLPOP is not cut by the client's ordinary socket timeout.
        assert cmd.block_s is not None
        c: Any = self.client
        pool_client: Any = c.get_redis_connection(self._node_of(cmd.key)) if (
            self.cluster and cmd.key is not None
        ) else c
        conn = pool_client.connection_pool.get_connection()
        try:
            conn.send_command(*cmd.args)
            return conn.read_response(timeout=cmd.block_s + 5.0)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool_client.connection_pool.release(conn)

    def _scan_all(self, req: ScanAll) -> list[str]:
        c: Any = self.client
        nodes = c.get_primaries() if self.cluster else [None]
        out: list[str] = []
        try:
            for node in nodes:
                client = c.get_redis_connection(node) if node is not None else c
                for k in client.scan_iter(match=req.pattern, count=req.count, _type=req.type):
                    out.append(text(k))
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, "SCAN") from exc
        return out

    def _time(self, req: ServerTime) -> int:
        return time_ms(self._cmd(Cmd(("TIME",), key=req.key)))

    def check_durability(self) -> None:
        """Raise ConfigError unless every primary can give the durability level (no-op for ``"none"``).

        Per primary, one round trip: ``INFO replication`` and, on a cluster,
        ``CLUSTER NODES`` (enough replicas: see :func:`check_level`), and
        ``WAITAOF 1 0 1`` (the AOF is on and the server knows WAITAOF,
        Redis/Valkey 7.2+). StorageError when a primary cannot be reached.
        """
        if self._durable is None:
            return
        c: Any = self.client
        if self.cluster:
            try:
                targets = [(n.name, c.get_redis_connection(n)) for n in c.get_primaries()]
            except REDIS_ERRORS as exc:
                raise StorageError(f"cluster nodes unavailable: {type(exc).__name__}: {exc}") from exc
        else:
            targets = [(server_name(c), c)]
        for name, node in targets:
            pipe = node.pipeline(transaction=False)
            pipe.info("replication")
            pipe.execute_command("WAITAOF", 1, 0, 1)
            if self.cluster:
                pipe.execute_command("CLUSTER", "NODES")
            try:
                info, aof, *nodes = pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as exc:
                raise wrap_error(exc, f"durability check of {name}") from exc
            check_level(self.durability, name, info, aof, *nodes)

    # -- the durable path ----------------------------------------------------------------

    def _durable_replies(self, req: Eval | Batch) -> list[Any]:
        """Run ``req``'s requests node by node, each node's batch followed by its waits.

        A node whose connection fails, or a request redirected (slot moved,
        cluster down), is run again after a backoff, on the node that serves
        it then (mutating scripts replay their reply by op id), within the
        retry budget of the connection options.
        """
        d = self._durable
        assert d is not None
        c: Any = self.client
        reqs, out, pending = d.start(req)
        for attempt in range(d.attempts):
            if attempt:
                time.sleep(d.backoff.compute(attempt))
                self._refresh_slots()
            groups = d.route(c, self.cluster, reqs, pending, self._target)
            results = self._exchanges(groups, reqs)
            pending = d.collect(groups, results, out)
            if not pending:
                break
        return out

    def _target(self, node: Any) -> Any:
        """Where a node's exchange is written: the node's own client (the client itself if standalone)."""
        c: Any = self.client
        return c if node is None else c.get_redis_connection(node)

    def _refresh_slots(self) -> None:
        if self.cluster:
            c: Any = self.client
            try:
                c.nodes_manager.initialize()
            except REDIS_ERRORS:
                pass  # no node answered; the next attempt fails again or the budget ends

    def _exchanges(self, groups: list[tuple[Any, str, list[int]]], reqs: Sequence[Eval | Cmd]) -> list[list[Any]]:
        """One round trip per node, overlapped: every node's commands are written, then read.

        Each node gets its requests then the waits; a NOSCRIPT request is
        sent again with EVAL (and the waits) on its node.
        """
        d = self._durable
        assert d is not None
        sent: list[tuple[Any, list[tuple[Any, ...]], Any]] = []
        results: list[list[Any]] = []
        read = 0
        try:
            for target, _, idxs in groups:
                cmds = d.commands([reqs[i] for i in idxs], [True] * len(idxs))
                sent.append((target, cmds, self._send(target, cmds)))
            for target, cmds, handle in sent:
                read += 1  # _receive releases its connection whatever happens
                results.append(self._receive(target, cmds, handle))
        except BaseException:
            for target, _, handle in sent[read:]:  # written to, never read: unusable
                if not isinstance(handle, BaseException):
                    handle.disconnect()
                    target.connection_pool.release(handle)
            raise
        out = []
        for (target, name, idxs), replies in zip(groups, results, strict=True):
            sub = [reqs[i] for i in idxs]
            confirmed = d.confirm(sub, replies, name)
            missing = [j for j, r in enumerate(confirmed) if isinstance(r, NoScriptError)]
            if missing:  # the script cache emptied (restart, failover): EVAL reloads it
                again = [sub[j] for j in missing]
                cmds = d.commands(again, [False] * len(again))
                redone = d.confirm(again, self._receive(target, cmds, self._send(target, cmds)), name)
                for j, r in zip(missing, redone, strict=True):
                    confirmed[j] = r
            out.append(confirmed)
        return out

    def _send(self, target: Any, cmds: list[tuple[Any, ...]]) -> Any:
        """Write ``cmds`` on a pooled connection of ``target``; the connection, or the error."""
        pool = target.connection_pool
        try:
            conn = pool.get_connection()
        except REDIS_ERRORS as exc:
            return exc
        try:
            conn.send_packed_command(conn.pack_commands(cmds))
        except REDIS_ERRORS as exc:
            conn.disconnect()
            pool.release(conn)
            return exc
        return conn

    def _receive(self, target: Any, cmds: list[tuple[Any, ...]], conn: Any) -> list[Any]:
        """Read every reply of ``cmds`` from ``conn`` (errors as values) and release it.

        A lost connection makes every reply the connection error (the
        outcome of each request is then unknown).
        """
        d = self._durable
        assert d is not None
        if isinstance(conn, BaseException):
            return [conn] * len(cmds)
        try:
            out: list[Any] = []
            for args, timeout in zip(cmds, d.timeouts(cmds), strict=True):
                try:
                    out.append(apply_callback(target.response_callbacks, args, conn.read_response(timeout=timeout)))
                except ResponseError as exc:
                    out.append(exc)
            return out
        except REDIS_ERRORS as exc:
            conn.disconnect()
            return [exc] * len(cmds)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            target.connection_pool.release(conn)

    def close(self) -> None:
        """Close the client's connections."""
        if self._lane is not None:
            self._lane.close()
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for _, lane in lanes:
            lane.close()
        self.client.close()
