"""Run-level operations: create the run's meta record, ping, the server clock and facts, the run's counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context import SCHEMA_VERSION, Context
from .errors import CorruptData
from .keys import Keys
from .replies import Reply, text
from .runs import run_ids
from .scripts import Batch, Cmd, Eval, Op, ServerTime, script


@dataclass(frozen=True)
class RunInfo:
    """The run's meta record as created by the first client."""

    run: str
    schema: int
    created_ms: int
    created_now: bool


@dataclass(frozen=True)
class ServerInfo:
    """What ``tracestore info`` shows about a server."""

    engine: str  # "valkey" or "redis"
    version: str
    mode: str  # "standalone" or "cluster"
    nodes: int
    runs: tuple[str, ...]


def init_run(ctx: Context) -> Op[RunInfo]:
    """Create ``ts:{R}:meta`` if absent. One round trip. Raises InvalidInput on a schema clash."""
    reply = yield Eval(
        script("init_run"), (ctx.keys.meta,), (SCHEMA_VERSION, ctx.config.to_json())
    )
    r = Reply(reply, "init_run")
    schema, created_ms, created = r.int(), r.int(), r.flag()
    if created_ms < 0:
        raise CorruptData(ctx.keys.meta, "created_ms is not a number", "created_ms")
    return RunInfo(ctx.keys.run, schema, created_ms, created)


def ping(ctx: Context) -> Op[bool]:
    """PING the node of the run's control plane. One round trip."""
    reply = yield Cmd(("PING",), key=ctx.keys.meta)
    return bool(reply)


def server_ms(ctx: Context) -> Op[int]:
    """The server clock (ms, ``TIME``) of the run's control-plane node. One round trip."""
    now = yield ServerTime(ctx.keys.meta)
    return int(now)


def server_info(ctx: Context, prefix: str = "ts") -> Op[ServerInfo]:
    """Engine, version, mode and the runs found under ``prefix`` (SCAN on every primary)."""
    info = yield Cmd(("INFO", "server"), key=ctx.keys.meta)
    fields = info if isinstance(info, dict) else _parse_info(text(info))
    engine = "valkey" if "valkey_version" in fields or fields.get("server_name") == "valkey" else "redis"
    version = str(fields.get("valkey_version") or fields.get("redis_version") or "?")
    runs = yield from run_ids(Context(Keys(prefix, ctx.keys.run), ctx.cluster, ctx.config))
    nodes = 1
    if ctx.cluster:
        slots = yield Cmd(("CLUSTER", "SHARDS"), key=ctx.keys.meta)
        nodes = len(slots) if isinstance(slots, list) else 1
    return ServerInfo(engine, version, "cluster" if ctx.cluster else "standalone", nodes, tuple(runs))


def _parse_info(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


@dataclass(frozen=True)
class RunStats:
    """The run's exact counters (DESIGN section 12), from :func:`stats`.

    Each counter is changed in the same atomic script as the state it counts
    and never decreases; trimming the event stream or the tombstones (gc)
    never changes it. ``sessions_released`` and ``release_events`` grow
    together (one event per released session, in the releasing script).
    ``groups_expired`` counts every group expiry, kept (status ``expired``)
    or released; ``groups_claimed`` the groups ``claim_retry`` handed back.
    ``turns_recorded`` counts the ``record_turn`` calls that wrote a new
    response node (a retried or repeated turn writes nothing and is not
    counted); it is kept in one shard per hash slot on the data plane (see
    :meth:`~tracestore.keys.Keys.turn_shard`) and summed here.
    """

    sessions_opened: int = 0
    sessions_released: int = 0
    release_events: int = 0
    groups_put: int = 0
    groups_taken: int = 0
    groups_expired: int = 0
    groups_claimed: int = 0
    turns_recorded: int = 0

    @property
    def sessions_live(self) -> int:
        """Sessions opened and not released (live now, whoever owns them)."""
        return self.sessions_opened - self.sessions_released


#: The fields of :class:`RunStats` kept in the hash ``ts:{R}:stats``.
STATS_FIELDS = (
    "sessions_opened",
    "sessions_released",
    "release_events",
    "groups_put",
    "groups_taken",
    "groups_expired",
    "groups_claimed",
)
#: Turn counter shards read per MGET (standalone).
_SHARDS_PER_MGET = 4096


def _turn_shard_reads(ctx: Context) -> tuple[Cmd, ...]:
    """Reads of the run's 16,384 turn counter shards: MGETs on a standalone
    server, one GET per slot (grouped by node into one pipeline) on a cluster."""
    shards = ctx.keys.turn_shards()
    if ctx.cluster:
        return tuple(Cmd(("GET", key), key=key) for key in shards)
    parts = [shards[i : i + _SHARDS_PER_MGET] for i in range(0, len(shards), _SHARDS_PER_MGET)]
    return tuple(Cmd(("MGET", *p), key=p[0]) for p in parts)


def _sum_shards(replies: list[Any]) -> int:
    values = [v for r in replies for v in (r if isinstance(r, list) else [r])]
    return sum(int(v) for v in values if v is not None)


def stats(ctx: Context) -> Op[RunStats]:
    """The run's exact counters as :class:`RunStats`.

    Read without a lock: on a quiet run (no call in flight) the figures are
    exact; while calls run, each counter lies between its values at the
    start and at the end of the read, and nothing is ever counted twice or
    lost. One pipelined round trip (per node on a cluster): the counters'
    hash and the run's turn counter shards.
    """
    k = ctx.keys
    replies = yield Batch((Cmd(("HMGET", k.stats, *STATS_FIELDS), key=k.stats), *_turn_shard_reads(ctx)))
    counts = {f: int(v) if v is not None else 0 for f, v in zip(STATS_FIELDS, replies[0], strict=True)}
    return RunStats(**counts, turns_recorded=_sum_shards(replies[1:]))
