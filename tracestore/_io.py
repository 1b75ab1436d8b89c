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
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from .errors import PermissionDenied, ScriptError, StorageError, TracestoreError, raise_for_code
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
    if isinstance(exc, ResponseError) and what.startswith("script "):
        return ScriptError(what[len("script ") :], str(exc))
    return StorageError(f"{what}: {type(exc).__name__}: {exc}")


def _eval_args(ev: Eval) -> tuple[Any, ...]:
    return (len(ev.keys), *ev.keys, *ev.args)


def _ms(time_reply: Any) -> int:
    sec, usec = time_reply
    return int(sec) * 1000 + int(usec) // 1000


class SyncIO:
    """Executes requests with a redis-py ``Redis`` or ``RedisCluster`` client."""

    def __init__(self, client: redis.Redis | RedisCluster, *, cluster: bool) -> None:
        self.client = client
        self.cluster = cluster

    def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
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

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()


class AsyncIO:
    """Executes requests with ``redis.asyncio.Redis`` or its ``RedisCluster``."""

    #: Requests of cluster batches in flight at once per client: the async
    #: cluster client raises MaxConnectionsError instead of waiting when a
    #: node's pool (ConnectionOptions.max_connections, 64) runs out.
    CLUSTER_INFLIGHT = 32

    def __init__(self, client: redis.asyncio.Redis | AsyncRedisCluster, *, cluster: bool) -> None:
        self.client = client
        self.cluster = cluster
        self._inflight = asyncio.Semaphore(self.CLUSTER_INFLIGHT)

    async def execute(self, req: Request) -> Any:
        """Execute one request and return its decoded reply (no redis-py exception escapes)."""
        try:
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
            if err is not reply:  # (an error that is typed already keeps its own cause)
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
