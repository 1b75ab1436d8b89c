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

A user granted by an earlier version may lack what this one needs (the turn
counter shards' pattern ``ts:{R|*``, a command a new script calls):
:func:`missing_grants` compares a user's rules (``ACL GETUSER``) with the
grant of a role, and :func:`pattern_of_key` names the pattern a key needs
(what a ``NOPERM`` error says is missing).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .errors import InvalidInput
from .keys import Keys, slot_tag
from .validate import is_run_id, validate_prefix, validate_run

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


def pattern_of_key(key: str) -> str | None:
    """The key pattern of :func:`key_patterns` that grants ``key`` (``ts:{R|*`` for a turn
    counter shard...), or None for a key that is no run's."""
    start = key.find(":{")
    end = key.find("}", start + 2)
    if start < 1 or end < 0:
        return None
    prefix, tag = key[:start], key[start + 2 : end]
    for sep in ("/", "|"):
        run, found, _ = tag.partition(sep)
        if found:
            return f"{prefix}:{{{run}{sep}*" if is_run_id(run) else None
    return f"{prefix}:{{{tag}}}:*" if is_run_id(tag) else None


#: What each key pattern holds, for the lines of a check and the hint of a NOPERM.
PATTERN_ROLES = ("the run's control plane", "its sessions' data", "its turn counter shards, written by record_turn")


@dataclass(frozen=True)
class UserRules:
    """A user's ACL rules as ``ACL GETUSER`` gives them (root selector).

    ``commands``: the command rules, in order (``-@all +get +@read -hgetall
    +client|setname``); ``keys``: the key patterns with their permissions
    (``~p``, ``%R~p``, ``%W~p``, ``%RW~p``, ``allkeys``); ``selectors``: how
    many extra selectors the user has (not checked: they can only add).
    """

    commands: tuple[str, ...]
    keys: tuple[str, ...]
    selectors: int = 0
    enabled: bool = True

    @classmethod
    def from_getuser(cls, reply: object) -> UserRules:
        """Decode an ``ACL GETUSER`` reply (a flat list or a dict of fields; bytes or str)."""
        def txt(x: object) -> str:
            return x.decode() if isinstance(x, bytes) else str(x)

        if isinstance(reply, Mapping):
            fields = {txt(k): v for k, v in reply.items()}
        elif isinstance(reply, (list, tuple)):
            fields = {txt(reply[i]): reply[i + 1] for i in range(0, len(reply) - 1, 2)}
        else:
            raise InvalidInput("ACL GETUSER", f"not a user's rules: {reply!r:.80}")
        flags = [txt(f) for f in fields.get("flags") or []]
        cmds = fields.get("commands") or ""
        keys = fields.get("keys") or ""
        keys_t = txt(keys) if isinstance(keys, (str, bytes)) else " ".join(txt(k) for k in keys)
        return cls(tuple(txt(cmds).split()), tuple(keys_t.split()), len(fields.get("selectors") or []), "on" in flags)


def _glob(pattern: str) -> re.Pattern[str]:
    """A Redis glob (``*``, ``?``, ``[...]`` with ``^`` and ranges, ``\\`` escapes) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and "]" in pattern[i + 1 :]:
            j = pattern.index("]", i + 2 if pattern[i + 1 : i + 2] in ("^", "]") else i + 1)
            body = pattern[i + 1 : j]
            neg = body.startswith("^")
            body = body[1:] if neg else body
            out.append("[" + ("^" if neg else "") + body.replace("[", "\\[") + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z", re.S)


def _key_perms(rules: UserRules, key: str) -> set[str]:
    """The permissions (``R``, ``W``) ``rules`` give on ``key``."""
    perms: set[str] = set()
    for rule in rules.keys:
        if rule == "allkeys":
            rule = "~*"
        m = re.match(r"(?:%(R|W|RW|WR)~|~)(.*)\Z", rule, re.S)
        if m and _glob(m.group(2)).match(key):
            perms |= set(m.group(1) or "RW")
    return perms


def _allowed(rules: UserRules, command: str, categories: Callable[[str], set[str]]) -> bool:
    """True when ``rules`` allow ``command`` (``get``, ``client|setname``): the last rule
    that names it (itself, its container, a category holding it, ``@all``) decides."""
    parent = command.split("|", 1)[0]
    ok = False
    for rule in rules.commands:
        if rule in ("allcommands", "nocommands"):
            ok = rule == "allcommands"
            continue
        sign, target = rule[:1], rule[1:].lower()
        if sign not in "+-" or not target:
            continue
        if target == "@all":
            hit = True
        elif target.startswith("@"):
            members = categories(target[1:])
            hit = command in members or parent in members
        else:
            hit = target in (command, parent)
        if hit:
            ok = sign == "+"
    return ok


@dataclass(frozen=True)
class Missing:
    """One grant a user lacks for a role: a key ``pattern`` (with the ``mark`` the role needs)
    or a ``command``; ``what`` says what it is for. ``rule`` is what ``ACL SETUSER`` adds."""

    kind: str
    rule: str
    what: str

    def line(self) -> str:
        """``missing key pattern ~ts:{R|* (its turn counter shards ...)`` / ``missing command +hdel``."""
        return f"missing {'key pattern' if self.kind == 'pattern' else 'command'} {self.rule}" + (
            f" ({self.what})" if self.what else ""
        )


def sample_keys(run: str, prefix: str = "ts") -> tuple[tuple[str, ...], ...]:
    """Keys of each of :func:`key_patterns` (a user's patterns are checked on them)."""
    k = Keys(validate_prefix(prefix), validate_run(run))
    return (
        (k.meta, k.gate_holders, k.session("s")),
        (k.idx("s"), k.dead("s")),
        (k.turn_shard_of_slot(0), f"{prefix}:{{{run}|{slot_tag(run + '|', 16383)}}}:turns"),
    )


def missing_grants(
    rules: UserRules, run: str, role: str, categories: Callable[[str], set[str]], *, prefix: str = "ts"
) -> list[Missing]:
    """What ``rules`` lack of the grant of ``role`` on ``run``: key patterns first, then commands.

    A key pattern counts as granted when every sample key of it
    (:func:`sample_keys`) is readable (observer) or readable and writable
    (writer) by the user's patterns, however they are written (``~*``,
    ``~ts:*``...); a command when the user's command rules allow it
    (``categories(name)`` gives the commands of ``@name``, from ``ACL CAT``).
    InvalidInput for an unknown role.
    """
    need = set("RW") if role == "writer" else {"R"}
    wanted = commands(role)
    mark = "~" if role == "writer" else "%R~"
    out = [
        Missing("pattern", mark + pat, what)
        for pat, what, keys in zip(key_patterns(run, prefix), PATTERN_ROLES, sample_keys(run, prefix), strict=True)
        if not all(need <= _key_perms(rules, key) for key in keys)
    ]
    out += [Missing("command", f"+{c}", "") for c in wanted if not _allowed(rules, c, categories)]
    return out


def add_line(user: str, missing: Iterable[Missing]) -> str:
    """The ``redis-cli ACL SETUSER`` line that adds ``missing`` to ``user`` (without a reset)."""
    return "redis-cli " + " ".join(shlex.quote(a) for a in ["ACL", "SETUSER", user, *(m.rule for m in missing)])


__all__ = [
    "ROLES",
    "Missing",
    "UserRules",
    "add_line",
    "commands",
    "grant",
    "grant_line",
    "key_patterns",
    "missing_grants",
    "pattern_of_key",
    "sample_keys",
]
