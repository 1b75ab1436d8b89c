"""The asyncio I/O layer: :class:`AsyncIO` executes requests with ``redis.asyncio.Redis`` or its ``RedisCluster``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import redis.asyncio
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from ..connection import ConnectionOptions
from ..durability import NONE, Durability
from ..errors import PermissionDenied, ScriptError, StorageError, TracestoreError
from ..keys import key_slot
from ..replies import text
from ..scripts import Batch, Blocking, Cmd, Eval, Request, ScanAll, ServerTime
from .async_lane import BUSY, AsyncScriptLane, NodePool
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
        # on a cluster, one lane per primary (by node name; a new node object: a new lane)
        self._lanes: dict[str, AsyncScriptLane] = {}

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
        elif self.cluster and ev.keys and (lane := self._node_lane(ev.keys[0])) is not None:
            try:
                reply = await lane.call(script_args(ev, use_sha))
            except (*NOT_HERE, ConnectionError, TimeoutError):
                reply = BUSY  # the cluster client's way (scripts are idempotent under retry)
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
            out: list[Any] = [None] * len(reqs)
            rest = await self._lane_pipeline(reqs, use_sha, out)
            await self._chains(reqs, rest, use_sha, out)
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

    def _node_lane(self, key: str) -> AsyncScriptLane | None:
        """The lane of the primary serving ``key``'s slot; None before the cluster client knows
        its slot map (it learns it on its first call) or when no node serves the slot."""
        try:
            node: Any = self.client.get_node_from_key(key)  # type: ignore[union-attr]
        except REDIS_ERRORS:
            return None
        if node is None:
            return None
        lane = self._lanes.get(node.name)
        if lane is None or lane.pool_node is not node:  # (a refreshed slot map makes new node objects)
            lane = self._lanes[node.name] = AsyncScriptLane(NodePool(node))
        return lane

    async def _lane_pipeline(self, reqs: Any, use_sha: bool, out: list[Any]) -> list[int]:
        """A cluster batch's scripts on their primaries' lanes, one pipeline per primary, their
        replies into ``out``; returns the indexes left for :meth:`_chains`, in order: the requests
        that are not scripts with keys, and from a call a lane could not place (a moved slot, a
        failed node) on, every call of its slot (so a slot's calls still run in their order)."""
        groups: dict[int, tuple[AsyncScriptLane, list[int]]] = {}
        rest: list[int] = []
        slots: list[int | None] = []
        held: set[int] = set()  # slots with a call left for the chains: their later calls follow it
        for i, r in enumerate(reqs):
            key = r.keys[0] if isinstance(r, Eval) and r.keys else getattr(r, "key", None)
            slot = key_slot(key) if key is not None else None
            slots.append(slot)
            lane = self._node_lane(key) if isinstance(r, Eval) and key is not None and slot not in held else None
            if lane is None:
                rest.append(i)
                if slot is not None:
                    held.add(slot)
            else:
                groups.setdefault(id(lane), (lane, []))[1].append(i)
        if not groups:
            return rest

        async def send(lane: AsyncScriptLane, idxs: list[int]) -> Any:
            try:
                return await lane.calls([script_args(reqs[i], use_sha) for i in idxs])
            except (ConnectionError, TimeoutError):
                return BUSY

        results = await asyncio.gather(*(send(lane, idxs) for lane, idxs in groups.values()))
        for (_, idxs), got in zip(groups.values(), results, strict=True):
            for j, i in enumerate(idxs):
                slot = slots[i]
                if got is BUSY or slot in held or isinstance(got[j], NOT_HERE):
                    held.add(slot)  # type: ignore[arg-type]  # (a lane's call has a key)
                    rest.append(i)
                else:
                    out[i] = got[j]
        return sorted(rest)

    async def _chains(self, reqs: Any, idxs: list[int], use_sha: bool, out: list[Any]) -> None:
        """``reqs[i]`` for ``i`` in ``idxs`` the cluster client's way, replies (errors in place)
        into ``out``. It routes each call (following redirects); issuing them concurrently gives
        one round trip per node as well. Requests of one hash slot keep their order (as in a
        pipeline): a purge's tombstone must land before its UNLINK."""
        chains: dict[Any, list[int]] = {}
        for i in idxs:
            r = reqs[i]
            key = r.keys[0] if isinstance(r, Eval) and r.keys else getattr(r, "key", None)
            chains.setdefault(key_slot(key) if key is not None else ("alone", i), []).append(i)

        async def chain(ids: list[int]) -> None:
            for i in ids:
                async with self._inflight:
                    out[i] = await self._single(reqs[i], use_sha)

        if chains:
            await asyncio.gather(*(chain(c) for c in chains.values()))

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
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            await lane.close()
        await self.client.aclose()
