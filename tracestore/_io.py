"""Sync and asyncio I/O layers: execute the requests that operations yield against Redis.

The stores drive operations (:mod:`tracestore.twin`); each request they
meet comes here. Both layers do the same four things, and nothing else:

* run :class:`~tracestore.scripts.Eval` with EVALSHA, and on NOSCRIPT (the
  script cache empties on restart and failover) re-run it once with EVAL,
  which also reloads the cache of that node;
* pipeline a :class:`~tracestore.scripts.Batch` (redis-py's cluster pipeline
  groups it by node; MOVED/ASK are followed by redis-py);
* strip the script status word and turn error results into typed errors;
* wrap redis-py exceptions into :class:`~tracestore.errors.StorageError`
  (connection, timeout) or :class:`~tracestore.errors.ScriptError`
  (a failing script), raised ``from`` the original.

(and they call a :class:`~tracestore.scripts.Blocking` request's function:
in place, or in a worker thread under asyncio).

With a durability level other than ``"none"`` (:mod:`tracestore.durability`),
a request holding a mutating script takes the *durable path*: per node, its
requests and then ``WAIT``/``WAITAOF`` are written on one pooled connection
of that node and read back in the same round trip; a mutating script whose
wait fell short answers :class:`~tracestore.errors.DurabilityUnconfirmed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from .connection import ConnectionOptions
from .durability import NONE, Durability
from .errors import (
    ConfigError,
    DurabilityUnconfirmed,
    NotEnoughReplicas,
    PermissionDenied,
    ScriptError,
    StorageError,
    TracestoreError,
    raise_for_code,
)
from .keys import key_slot
from .replies import text
from .scripts import Batch, Blocking, Cmd, Eval, Request, ScanAll, ServerTime

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

#: What redis-py raises: its errors, and the cluster client's own (not a RedisError).
REDIS_ERRORS = (RedisError, RedisClusterException)


def decode_script_reply(ev: Eval, reply: Any) -> Any:
    """Strip the status word of a script reply; raise the typed error it encodes."""
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], int):
        raise ScriptError(ev.script.name, f"malformed reply {reply!r:.200}")
    if reply[0] == 0:
        return reply[1:]
    raise_for_code(ev.script.name, text(reply[1]), reply[2:])
    raise AssertionError("unreachable")


def wrap_error(exc: BaseException, what: str) -> TracestoreError:
    """Map a redis-py exception to StorageError/ScriptError/PermissionDenied (caller raises ``from exc``)."""
    if isinstance(exc, TracestoreError):
        return exc
    if isinstance(exc, NoPermissionError):
        return PermissionDenied(what, str(exc))
    detail = (str(exc).strip().splitlines() or [""])[0]  # one line (cluster errors span several)
    if isinstance(exc, ResponseError) and detail.startswith("NOREPLICAS"):  # the server's error code
        return NotEnoughReplicas(
            f"{what}: the primary refused the write, fewer replicas are in sync than its "
            "min-replicas-to-write; nothing was written, retry when they are back"
        )
    if isinstance(exc, ResponseError) and what.startswith("script "):
        return ScriptError(what[len("script ") :], detail)
    return StorageError(f"{what}: {type(exc).__name__}: {detail}")


def _eval_args(ev: Eval) -> tuple[Any, ...]:
    return (len(ev.keys), *ev.keys, *ev.args)


def _ms(time_reply: Any) -> int:
    sec, usec = time_reply
    return int(sec) * 1000 + int(usec) // 1000


class _Durable:
    """What the sync and async durable paths share: the waits, timeouts and retry budget."""

    def __init__(self, durability: Durability, opts: ConnectionOptions | None) -> None:
        opts = opts or ConnectionOptions()
        self.durability = durability
        self.waits: tuple[tuple[Any, ...], ...] = durability.commands()
        self.read_timeout = opts.socket_timeout_s
        # a wait blocks up to its own timeout on the server before it answers
        self.wait_read_timeout = opts.socket_timeout_s + durability.timeout_s
        self.attempts = 1 + opts.retries
        self.backoff = ExponentialBackoff(cap=opts.backoff_cap_s, base=opts.backoff_base_s)

    def commands(self, reqs: Sequence[Eval | Cmd], sha: Sequence[bool]) -> list[tuple[Any, ...]]:
        """The commands of one node's exchange: the requests, then the waits if one of them writes."""
        cmds = [_args(r, s) for r, s in zip(reqs, sha, strict=True)]
        if any(_writes(r) for r in reqs):
            cmds += self.waits
        return cmds

    def timeouts(self, cmds: Sequence[tuple[Any, ...]]) -> list[float]:
        return [self.wait_read_timeout if c[0] in ("WAIT", "WAITAOF") else self.read_timeout for c in cmds]

    def confirm(self, reqs: Sequence[Eval | Cmd], replies: list[Any], node: str) -> list[Any]:
        """The replies of the requests, with unconfirmed successful writes turned into errors."""
        n = len(reqs)
        main, waits = replies[:n], replies[n:]
        if not waits:
            return main
        short = self.durability.shortfall(waits)
        if short is None:
            return main
        out = []
        for req, reply in zip(reqs, main, strict=True):
            if _writes(req) and isinstance(reply, list) and reply and reply[0] == 0:
                assert isinstance(req, Eval)
                reply = DurabilityUnconfirmed(
                    req.script.name, node, self.durability.level, short, op_id=req.op_id or ""
                )
            out.append(reply)
        return out

    @staticmethod
    def start(req: Eval | Batch) -> tuple[tuple[Eval | Cmd, ...], list[Any], list[int]]:
        """``(requests, their replies so far, the indexes still to run)`` of a durable request."""
        reqs: tuple[Eval | Cmd, ...] = (req,) if isinstance(req, Eval) else req.requests
        return reqs, [None] * len(reqs), list(range(len(reqs)))

    @staticmethod
    def route(
        client: Any, cluster: bool, reqs: Sequence[Eval | Cmd], idxs: list[int], target: Any
    ) -> list[tuple[Any, str, list[int]]]:
        """``(target(node), node name, request indexes)`` per node serving ``reqs[idxs]``.

        ``target`` turns a cluster node into what the I/O layer writes to (None
        on a standalone server: the client's own pool).
        """
        if not cluster:
            return [(target(None), _server_name(client), idxs)]
        groups: dict[str, tuple[Any, str, list[int]]] = {}
        try:
            for i in idxs:
                key = _route_key(reqs[i])
                node = client.get_node_from_key(key) if key else client.get_random_node()
                groups.setdefault(node.name, (target(node), node.name, []))[2].append(i)
        except REDIS_ERRORS as exc:
            raise StorageError(f"cluster slot map unavailable: {type(exc).__name__}: {exc}") from exc
        return list(groups.values())

    @staticmethod
    def collect(groups: list[tuple[Any, str, list[int]]], results: list[list[Any]], out: list[Any]) -> list[int]:
        """Store each group's replies in ``out``; the indexes to run again (see :func:`_retryable`)."""
        again = []
        for (_, _, idxs), replies in zip(groups, results, strict=True):
            for i, reply in zip(idxs, replies, strict=True):
                out[i] = reply
                if _retryable(reply):
                    again.append(i)
        return again

    def finish(self, req: Eval | Batch, replies: list[Any]) -> Any:
        """Decode the replies of a request that took the durable path (as the ordinary path does)."""
        if isinstance(req, Batch):
            return _finish_batch(req, replies)
        (reply,) = replies
        if isinstance(reply, TracestoreError):
            raise reply
        if isinstance(reply, Exception):
            raise wrap_error(reply, f"script {req.script.name}") from reply
        return decode_script_reply(req, reply)


def _check_level(d: Durability, node: str, info: Any, aof: Any, cluster_nodes: Any = None) -> None:
    """Raise ConfigError when ``node`` (a primary) cannot give ``d``: too few replicas, no AOF.

    A cluster primary is judged by the replicas the cluster lists for it
    (a replica that is down right now still counts: the writes then raise
    DurabilityUnconfirmed until it is back); a standalone one by the
    replicas connected to it.
    """
    if isinstance(info, BaseException):
        raise ConfigError(f"cannot check durability={d.level!r} on {node}: {info}")
    if d.needs_replicas:
        if cluster_nodes is not None and not isinstance(cluster_nodes, BaseException):
            have, how = _listed_replicas(text(cluster_nodes)), "listed in the cluster"
        else:
            have, how = int(info.get("connected_slaves", 0)), "connected"
        if have < d.replicas:
            raise ConfigError(
                f"durability={d.level!r} needs {d.replicas} replica(s) per primary, but {node} has "
                f"{have} {how}; add replicas, lower durability_replicas, or choose another level"
            )
    if d.needs_aof and isinstance(aof, BaseException):
        if "unknown command" in str(aof).lower():
            why = "the server has no WAITAOF (Redis or Valkey 7.2+ needed)"
        else:
            why = f"{node} answered: {aof} (set appendonly yes)"
        raise ConfigError(f"durability={d.level!r} needs the append-only file on every primary: {why}")


def _server_name(client: Any) -> str:
    """``host:port`` (or the socket path) of a standalone client, for messages."""
    conn = client.connection_pool.connection_kwargs
    return f"{conn.get('host', conn.get('path', '?'))}:{conn.get('port', '')}"


def _listed_replicas(cluster_nodes: str) -> int:
    """How many replicas a ``CLUSTER NODES`` reply (asked of a primary) lists for that primary."""
    rows = [line.split() for line in cluster_nodes.splitlines() if line.strip()]
    me = next((r[0] for r in rows if len(r) > 2 and "myself" in r[2].split(",")), None)
    return sum(1 for r in rows if len(r) > 3 and r[3] == me)


def _writes(r: Eval | Cmd) -> bool:
    return isinstance(r, Eval) and not r.script.readonly


def _mutates(req: Request) -> bool:
    """True for a mutating script, or a batch holding one: the requests the durable path waits for."""
    if isinstance(req, Eval):
        return not req.script.readonly
    return isinstance(req, Batch) and any(_writes(r) for r in req.requests)


def _args(r: Eval | Cmd, use_sha: bool) -> tuple[Any, ...]:
    if isinstance(r, Eval):
        if use_sha:
            return ("EVALSHA", r.script.sha, *_eval_args(r))
        return ("EVAL", r.script.source, *_eval_args(r))
    return r.args


def _callback(callbacks: Any, args: tuple[Any, ...], reply: Any) -> Any:
    """redis-py's response callback of a plain command (the ordinary path applies them too)."""
    if isinstance(reply, BaseException) or args[0] in ("EVALSHA", "EVAL"):
        return reply
    cb = callbacks.get(str(args[0]).upper())
    return cb(reply) if cb is not None else reply


def _retryable(reply: Any) -> bool:
    """A reply that says "run it again, elsewhere or later": lost connection, redirect, cluster down."""
    from redis.exceptions import ClusterDownError

    return isinstance(reply, RedisError) and (
        _is_connection(reply) or _is_redirect(reply) or isinstance(reply, ClusterDownError)
    )


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
        self._durable = _Durable(durability, opts) if durability.waits else None

    def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
            if self._durable is not None and _mutates(req):
                assert isinstance(req, (Eval, Batch))
                return self._durable.finish(req, self._durable_replies(req))
            return self._dispatch(req)
        except REDIS_ERRORS as exc:  # one the steps below did not wrap (cluster routing...)
            raise wrap_error(exc, _what(req)) from exc

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
        c: Any = self.client
        if not ev.script.readonly:
            return c.evalsha(ev.script.sha, *_eval_args(ev)) if use_sha else c.eval(ev.script.source, *_eval_args(ev))
        if self.cluster:  # (the cluster client would ask the server for an _RO command's keys)
            node = c.get_node_from_key(ev.keys[0]) if ev.keys else c.get_random_node()
            return c.execute_command(*_script_args(ev, use_sha), target_nodes=node)
        return c.execute_command(*_script_args(ev, use_sha))

    def _batch(self, batch: Batch) -> list[Any]:
        if not batch.requests:
            return []
        replies = self._pipeline(batch.requests, use_sha=True)
        retry = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if retry:
            again = self._pipeline([batch.requests[i] for i in retry], use_sha=False)
            for i, r in zip(retry, again, strict=True):
                replies[i] = r
        return _finish_batch(batch, replies)

    def _pipeline(self, reqs: Any, *, use_sha: bool) -> list[Any]:
        if self.cluster:
            return self._cluster_pipeline(reqs, use_sha=use_sha)
        pipe: Any = self.client.pipeline(transaction=False)
        for r in reqs:
            _queue(pipe, r, use_sha)
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
            node = c.get_node_from_key(_route_key(r)) if _route_key(r) else c.get_random_node()
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        for name, idxs in by_node.items():
            pipe: Any = c.get_redis_connection(nodes[name]).pipeline(transaction=False)
            for i in idxs:
                _queue(pipe, reqs[i], use_sha)
            try:
                out = pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as exc:
                out = [exc] * len(idxs)
            for i, reply in zip(idxs, out, strict=True):
                # A redirect (slot moved) or a lost connection: re-run the request
                # alone through the cluster client, which follows MOVED/ASK and
                # retries connection errors (a node's own pipeline does not). Safe
                # because every mutating script replays its reply by op id.
                if isinstance(reply, RedisError) and (_is_redirect(reply) or _is_connection(reply)):
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
        return _ms(self._cmd(Cmd(("TIME",), key=req.key)))

    def check_durability(self) -> None:
        """Raise ConfigError unless every primary can give the durability level (no-op for ``"none"``).

        Per primary, one round trip: ``INFO replication`` and, on a cluster,
        ``CLUSTER NODES`` (enough replicas: see :func:`_check_level`), and
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
            targets = [(_server_name(c), c)]
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
            _check_level(self.durability, name, info, aof, *nodes)

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
                    out.append(_callback(target.response_callbacks, args, conn.read_response(timeout=timeout)))
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
        self.client.close()


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
        self._durable = _Durable(durability, opts) if durability.waits else None

    async def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
            if self._durable is not None and _mutates(req):
                assert isinstance(req, (Eval, Batch))
                return self._durable.finish(req, await self._durable_replies(req))
            return await self._dispatch(req)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, _what(req)) from exc

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
            return _ms(await self._cmd(Cmd(("TIME",), key=req.key)))
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
        c: Any = self.client
        if not ev.script.readonly:
            if use_sha:
                return await c.evalsha(ev.script.sha, *_eval_args(ev))
            return await c.eval(ev.script.source, *_eval_args(ev))
        if self.cluster:
            node = c.get_node_from_key(ev.keys[0]) if ev.keys else c.get_random_node()
            return await c.execute_command(*_script_args(ev, use_sha), target_nodes=node)
        return await c.execute_command(*_script_args(ev, use_sha))

    async def _batch(self, batch: Batch) -> list[Any]:
        if not batch.requests:
            return []
        replies = await self._pipeline(batch.requests, use_sha=True)
        retry = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if retry:
            again = await self._pipeline([batch.requests[i] for i in retry], use_sha=False)
            for i, r in zip(retry, again, strict=True):
                replies[i] = r
        return _finish_batch(batch, replies)

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
        pipe: Any = self.client.pipeline(transaction=False)
        for r in reqs:
            _queue(pipe, r, use_sha)
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
                _check_level(self.durability, node.name, info, aof, known)
            return
        name = _server_name(c)
        pipe = c.pipeline(transaction=False)
        pipe.info("replication")
        pipe.execute_command("WAITAOF", 1, 0, 1)
        try:
            info, aof = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            raise wrap_error(exc, f"durability check of {name}") from exc
        _check_level(self.durability, name, info, aof)

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
                        out.append(_callback(callbacks, args, await conn.read_response(timeout=timeout)))
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
        await self.client.aclose()


def _what(req: Request) -> str:
    """How an error names the request: ``script <name>``, ``command <NAME>`` or its kind."""
    if isinstance(req, Eval):
        return f"script {req.script.name}"
    if isinstance(req, Cmd):
        return f"command {req.args[0]}"
    return type(req).__name__


def _route_key(r: Eval | Cmd) -> str | None:
    if isinstance(r, Eval):
        return r.keys[0] if r.keys else None
    return r.key


def _is_connection(exc: RedisError) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


def _is_redirect(exc: RedisError) -> bool:
    from redis.exceptions import AskError, MovedError, TryAgainError

    return isinstance(exc, (MovedError, AskError, TryAgainError))


def _queue(pipe: Any, r: Eval | Cmd, use_sha: bool) -> None:
    pipe.execute_command(*(_script_args(r, use_sha) if isinstance(r, Eval) else r.args))


def _script_args(ev: Eval, use_sha: bool) -> tuple[Any, ...]:
    """The command of a script call: EVALSHA/EVAL, or EVALSHA_RO/EVAL_RO for a ``no-writes`` script.

    The ``_RO`` forms let a user whose keys are granted read-only (ACL
    ``%R~``) run the read scripts (docs/security.md).
    """
    ro = "_RO" if ev.script.readonly else ""
    head = ("EVALSHA" + ro, ev.script.sha) if use_sha else ("EVAL" + ro, ev.script.source)
    return (*head, *_eval_args(ev))


def _finish_batch(batch: Batch, replies: list[Any]) -> list[Any]:
    out: list[Any] = []
    first: BaseException | None = None
    for req, reply in zip(batch.requests, replies, strict=True):
        what = f"script {req.script.name}" if isinstance(req, Eval) else f"command {req.args[0]}"
        if isinstance(reply, Exception):
            err = wrap_error(reply, what)
            if err is not reply:  # a typed error (DurabilityUnconfirmed) keeps its own cause
                err.__cause__ = reply
            first = first or err
            out.append(None)
            continue
        if isinstance(req, Eval):
            try:
                out.append(decode_script_reply(req, reply))
            except TracestoreError as err:
                first = first or err
                out.append(None)
        else:
            out.append(reply)
    if first is not None:
        raise first
    return out
