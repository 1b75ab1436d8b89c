"""Run-level operations: create the run's meta record, ping, server facts, run discovery."""

from __future__ import annotations

from dataclasses import dataclass

from .context import SCHEMA_VERSION, Context
from .errors import CorruptData
from .replies import Reply, stored, text
from .scripts import Batch, Cmd, Eval, Op, ServerTime, script, variadic_evals
from .validate import validate_ids


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


def session_states(ctx: Context, sids: list[str]) -> Op[dict[str, tuple[str, str] | None]]:
    """Owner and state of each session (None when unknown).

    Raises InvalidId before I/O. One round trip per 4,000 sessions (pipelined).
    """
    sids = validate_ids("session id", sids)
    evals = variadic_evals("session_states", (), [ctx.keys.session(s) for s in sids])
    replies = yield Batch(tuple(evals))
    r = Reply([x for part in replies for x in part], "session_states")
    out: dict[str, tuple[str, str] | None] = {}
    for sid in sids:
        with stored(ctx.keys.session(sid), "owner/state"):
            owner, state = r.text(), r.text()
        out[sid] = (owner, state) if state else None
    return out


def server_info(ctx: Context, prefix: str = "ts") -> Op[ServerInfo]:
    """Engine, version, mode and the runs found under ``prefix`` (SCAN on every primary)."""
    info = yield Cmd(("INFO", "server"), key=ctx.keys.meta)
    fields = info if isinstance(info, dict) else _parse_info(text(info))
    engine = "valkey" if "valkey_version" in fields or fields.get("server_name") == "valkey" else "redis"
    version = str(fields.get("valkey_version") or fields.get("redis_version") or "?")
    from .keys import Keys
    from .runs import run_ids  # runs builds on ownership, which builds on this module

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
