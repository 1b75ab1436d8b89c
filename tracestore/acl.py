"""The ACL grants of a run (docs/security.md): its key patterns and the exact commands tracestore sends.

Two roles:

* ``writer`` — everything a run's processes do: the store's operations, the
  RefHolder's event consumer, ``gc``, checkpoint and restore, run listing and
  deletion;
* ``observer`` — reads only, with keys granted read-only (``%R~``): gate
  status, lookup, search, export, replay counts and stats, session and owner
  listings, run listings, checkpoints. Its scripts run with EVALSHA_RO (the
  read scripts are ``#!lua flags=no-writes``), so a write is refused by the
  server (:class:`~tracestore.errors.PermissionDenied`).

ACL rules apply to the commands a Lua script calls as well, so each list
names the commands called from ``lua/`` next to those sent by the client
(tests/test_security.py checks the lists against the sources and runs the
API as each role). A grant is per server: on a cluster, run it on every node.
"""

from __future__ import annotations

import shlex

from .errors import InvalidInput
from .keys import Keys
from .validate import validate_prefix, validate_run

#: Script calls (the ``_RO`` forms run the ``no-writes`` scripts).
SCRIPTS = ("evalsha", "eval", "evalsha_ro", "eval_ro")
SCRIPTS_RO = ("evalsha_ro", "eval_ro")

#: What redis-py sends to set up a connection and keep it healthy, and to
#: find a cluster's topology (detection, slots, the command table).
CONNECTION = ("ping", "info", "client|setname", "client|setinfo", "cluster|slots", "cluster|shards", "command")

#: Commands called by the scripts in lua/ (writer).
LUA = (
    "del", "exists", "get", "hdel", "hexists", "hget", "hgetall", "hincrby", "hkeys", "hlen",
    "hmget", "hscan", "hset", "hsetnx", "hvals", "incr", "llen", "pexpire", "pttl", "rpush", "sadd", "scard",
    "set", "smismember", "srem", "time", "xadd", "zadd", "zcard", "zcount", "zincrby", "zmscore", "zrange",
    "zrangebylex", "zrangebyscore", "zrem", "zremrangebyscore", "zscore",
)
#: Commands called by the ``no-writes`` scripts (observer).
LUA_RO = (
    "exists", "hexists", "hget", "hgetall", "hlen", "hmget", "hscan", "hvals", "time", "zcount", "zrange",
    "zrangebylex", "zrangebyscore", "zscore",
)

#: Commands the client sends itself (writer): reads, purges, the release event
#: consumer (RefHolder), gc, checkpoint and restore, run listing and deletion.
CLIENT = (
    "blpop", "del", "exists", "get", "hdel", "hget", "hgetall", "hlen", "hmget", "hset", "incrby", "lrange",
    "memory|usage", "mget", "mset", "pexpire", "pttl", "rpush", "sadd", "scan", "scard", "set", "smembers",
    "sscan", "time", "type",
    "unlink", "xack", "xadd", "xgroup|create", "xgroup|createconsumer", "xgroup|destroy",
    "xinfo|consumers", "xinfo|groups", "xpending", "xrange", "xreadgroup", "xrevrange", "xtrim",
    "zadd", "zcard", "zcount", "zmscore", "zrange", "zrangebyscore", "zrem", "zscore",
)
#: Commands the client sends for the observer's reads (the viewer, ``tracestore ui``, pages an
#: owner's sessions with SSCAN and counts a session's nodes with HLEN).
CLIENT_RO = (
    "exists", "get", "hget", "hgetall", "hlen", "hmget", "lrange", "memory|usage", "mget", "pttl", "scan", "scard",
    "smembers", "sscan", "time", "type", "xrange", "xrevrange", "zcard", "zcount", "zrange", "zscore",
)

ROLES = ("writer", "observer")


def key_patterns(run: str, prefix: str = "ts") -> tuple[str, str, str]:
    """The run's three key patterns: its control plane ``ts:{R}:*``, its sessions' data
    ``ts:{R/*`` and its turn counter shards ``ts:{R|*`` (one per hash slot, beside the data)."""
    k = Keys(validate_prefix(prefix), validate_run(run))
    return k.control_pattern, f"{prefix}:{{{run}/*", f"{prefix}:{{{run}|*"


def commands(role: str) -> tuple[str, ...]:
    """The sorted, distinct commands of ``role`` (``writer`` or ``observer``)."""
    if role == "writer":
        return tuple(sorted({*SCRIPTS, *CONNECTION, *LUA, *CLIENT}))
    if role == "observer":
        return tuple(sorted({*SCRIPTS_RO, *CONNECTION, *LUA_RO, *CLIENT_RO}))
    raise InvalidInput("role", f"must be one of {', '.join(ROLES)}, got {role!r}")


def grant(run: str, role: str = "writer", *, user: str, password: str, prefix: str = "ts") -> list[str]:
    """The ``ACL SETUSER`` arguments that give ``user`` the ``role`` on run ``run``.

    ``reset`` first, so the rules are exactly these: the password, the run's
    three key patterns (read-only ``%R~`` for an observer), no pub/sub channel,
    no command but those of :func:`commands`.
    """
    mark = "~" if role == "writer" else "%R~"
    keys = [mark + p for p in key_patterns(run, prefix)]
    return ["ACL", "SETUSER", user, "reset", "on", f">{password}", *keys, "resetchannels", "-@all",
            *(f"+{c}" for c in commands(role))]


def grant_line(run: str, role: str = "writer", *, user: str, password: str, prefix: str = "ts") -> str:
    """:func:`grant` as one ``redis-cli`` command line (arguments quoted for a POSIX shell)."""
    return "redis-cli " + " ".join(
        shlex.quote(a) for a in grant(run, role, user=user, password=password, prefix=prefix)
    )


__all__ = ["ROLES", "commands", "grant", "grant_line", "key_patterns"]
