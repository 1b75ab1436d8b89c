"""The durable path: a node's mutating scripts, then ``WAIT``/``WAITAOF``, in one round trip.

With a durability level other than ``"none"`` (:mod:`tracestore.durability`),
a request holding a mutating script is written, per node, on one pooled
connection of that node followed by the waits, and read back in the same
round trip; a mutating script whose wait fell short answers
:class:`~tracestore.errors.DurabilityUnconfirmed`. :class:`DurablePath`
holds what the sync and async layers share (the waits, read timeouts, the
retry budget, routing by node); :func:`check_level` is the check at connect
that every primary can give the level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.backoff import ExponentialBackoff

from ..connection import ConnectionOptions
from ..durability import Durability
from ..errors import ConfigError, DurabilityUnconfirmed, StorageError, TracestoreError
from ..replies import text
from ..scripts import Batch, Cmd, Eval
from .commands import (
    REDIS_ERRORS,
    command_args,
    decode_script_reply,
    finish_batch,
    retryable,
    route_key,
    wrap_error,
    writes,
)


class DurablePath:
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
        cmds = [command_args(r, s) for r, s in zip(reqs, sha, strict=True)]
        if any(writes(r) for r in reqs):
            cmds += self.waits
        return cmds

    def timeouts(self, cmds: Sequence[tuple[Any, ...]]) -> list[float]:
        """The read timeout of each command (a wait blocks up to its own timeout first)."""
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
            if writes(req) and isinstance(reply, list) and reply and reply[0] == 0:
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
            return [(target(None), server_name(client), idxs)]
        groups: dict[str, tuple[Any, str, list[int]]] = {}
        try:
            for i in idxs:
                key = route_key(reqs[i])
                node = client.get_node_from_key(key) if key else client.get_random_node()
                groups.setdefault(node.name, (target(node), node.name, []))[2].append(i)
        except REDIS_ERRORS as exc:
            raise StorageError(f"cluster slot map unavailable: {type(exc).__name__}: {exc}") from exc
        return list(groups.values())

    @staticmethod
    def collect(groups: list[tuple[Any, str, list[int]]], results: list[list[Any]], out: list[Any]) -> list[int]:
        """Store each group's replies in ``out``; the indexes to run again (see :func:`retryable`)."""
        again = []
        for (_, _, idxs), replies in zip(groups, results, strict=True):
            for i, reply in zip(idxs, replies, strict=True):
                out[i] = reply
                if retryable(reply):
                    again.append(i)
        return again

    def finish(self, req: Eval | Batch, replies: list[Any]) -> Any:
        """Decode the replies of a request that took the durable path (as the ordinary path does)."""
        if isinstance(req, Batch):
            return finish_batch(req, replies)
        (reply,) = replies
        if isinstance(reply, TracestoreError):
            raise reply
        if isinstance(reply, Exception):
            raise wrap_error(reply, f"script {req.script.name}") from reply
        return decode_script_reply(req, reply)


def check_level(d: Durability, node: str, info: Any, aof: Any, cluster_nodes: Any = None) -> None:
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
            have, how = listed_replicas(text(cluster_nodes)), "listed in the cluster"
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


def server_name(client: Any) -> str:
    """``host:port`` (or the socket path) of a standalone client, for messages."""
    conn = client.connection_pool.connection_kwargs
    return f"{conn.get('host', conn.get('path', '?'))}:{conn.get('port', '')}"


def listed_replicas(cluster_nodes: str) -> int:
    """How many replicas a ``CLUSTER NODES`` reply (asked of a primary) lists for that primary."""
    rows = [line.split() for line in cluster_nodes.splitlines() if line.strip()]
    me = next((r[0] for r in rows if len(r) > 2 and "myself" in r[2].split(",")), None)
    return sum(1 for r in rows if len(r) > 3 and r[3] == me)
