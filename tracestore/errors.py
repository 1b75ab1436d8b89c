"""Typed errors (docs/design.md section 9).

Every error carries the ids involved and, where there is one, what to do
next. Lua scripts report failures as result codes (``{1, CODE, fields...}``;
success is ``{0, ...}``), never as free-form error strings, so nothing here
parses Redis error text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class TracestoreError(Exception):
    """Base class of every error tracestore raises.

    Errors pickle with their attributes (``kind``, ``sid``, ``field``...), so
    one raised inside a Ray actor reaches its caller intact; the subclasses'
    keyword-rich ``__init__`` is not re-run on unpickling.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(cls: type[TracestoreError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class InvalidId(TracestoreError, ValueError):
    """An id (run, session, owner, group, task, lease) is malformed.

    Raised before any I/O. ``kind`` names what the id is, ``value`` is the
    offending value (repr-truncated in the message).
    """

    def __init__(self, kind: str, value: object, rule: str) -> None:
        self.kind = kind
        self.value = value
        self.rule = rule
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {kind} {shown}: {rule}")


class InvalidInput(TracestoreError, ValueError):
    """An argument other than an id is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class PrefixChanged(InvalidInput):
    """The prefix node a turn extends is not the one ``lookup`` read; nothing was written.

    The store rolled back (a failover to a lagging replica, a restored
    checkpoint) or the session was purged and reopened since: the node is
    stored again by another write (``stored_wid``; read as ``read_wid``), or
    no longer stored (``stored`` False; also what a match of another session
    gets). Its tokens may not be those the turn's response was generated
    after. Look the prompt up again and run the turn again. An InvalidInput
    of field ``prefix`` (docs/traces.md, Write ids).
    """

    def __init__(self, sid: str, node: str, stored_wid: str, read_wid: str, stored: bool = True) -> None:
        self.sid = sid
        self.node = node
        self.stored_wid = stored_wid
        self.read_wid = read_wid
        self.stored = stored
        now = (
            f"was stored again since it was read (write {stored_wid or 'none'}, read {read_wid or 'none'}"
            if stored
            else f"is no longer stored (read under write {read_wid or 'none'}; or it is another session's"
        )
        super().__init__(
            "prefix",
            f"session {sid!r}: prefix node {node} {now}; the store rolled back, or the session was purged "
            "and reopened): look the prompt up again",
        )


class ConfigError(TracestoreError, ValueError):
    """A connection URL or option is invalid."""


class ServerError(TracestoreError):
    """A local server (embedded, cluster, redis-server) could not start or stop."""


class SessionExists(TracestoreError):
    """``open_session`` of a session id that is already open."""

    def __init__(self, sid: str, owner: str) -> None:
        self.sid = sid
        self.owner = owner
        super().__init__(f"session {sid!r} is already open, owned by {owner!r}")


class SessionReleased(TracestoreError):
    """The session was released (tombstoned); its id cannot be reused or written."""

    def __init__(self, sid: str, detail: str = "") -> None:
        self.sid = sid
        msg = f"session {sid!r} was released"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class NotOwner(TracestoreError):
    """The caller does not own the session it tried to change."""

    def __init__(self, sid: str, owner: str, actual: str | None) -> None:
        self.sid = sid
        self.owner = owner
        self.actual = actual
        super().__init__(
            f"session {sid!r} is owned by {actual!r}, not {owner!r}"
            if actual
            else f"session {sid!r} is not open (caller {owner!r})"
        )


class OwnerLost(TracestoreError):
    """``gc`` declared this owner lost (heartbeat expired) and released its sessions.

    The owner tag cannot heartbeat, open or receive sessions again; start the
    process under a new owner tag.
    """

    def __init__(self, owner: str, lost_ms: int) -> None:
        self.owner = owner
        self.lost_ms = lost_ms
        super().__init__(
            f"owner {owner!r} was declared lost at {lost_ms} ms (heartbeat expired) and its "
            "sessions were released; use a new owner tag"
        )


class NodeConflict(TracestoreError, ValueError):
    """A node with this key exists with a different payload; nothing was written.

    The caller should drop the expert ref it created for the rejected write.
    A ValueError too (a bad value for that key), like the other errors that
    describe bad values: InvalidId, InvalidInput, PromptMismatch.
    """

    def __init__(self, sid: str, digest: str, detail: str = "") -> None:
        self.sid = sid
        self.digest = digest
        super().__init__(
            f"session {sid!r}: node {digest} already exists with a different payload"
            + (f" ({detail})" if detail else "")
        )


class PromptMismatch(TracestoreError, ValueError):
    """``export_training_trace`` found no stored node whose key equals the prompt (a ValueError too)."""

    def __init__(
        self,
        sid: str,
        matched_len: int,
        prompt_len: int,
        nearest_ends: Sequence[int],
        window: str | None,
    ) -> None:
        self.sid = sid
        self.matched_len = matched_len
        self.prompt_len = prompt_len
        self.nearest_ends = list(nearest_ends)
        self.window = window
        msg = (
            f"session {sid!r}: prompt of {prompt_len} chars matches a stored key only up to "
            f"{matched_len} chars; nearest stored ends {self.nearest_ends}"
        )
        if window is not None:
            msg += f"; around the first difference: {window}"
        super().__init__(msg)


class GateSealed(TracestoreError):
    """The request gate is sealed for a weight update; retry after ``retry_after_ms``."""

    def __init__(self, version: int, retry_after_ms: int) -> None:
        self.version = version
        self.retry_after_ms = retry_after_ms
        super().__init__(
            f"gate sealed at version {version}; retry in about {retry_after_ms} ms"
        )


class GatePoisoned(TracestoreError):
    """Leases with an unknown outcome block the weight update; resolve with ``clear_poison``."""

    def __init__(self, lease_ids: Sequence[str]) -> None:
        self.lease_ids = list(lease_ids)
        super().__init__(
            f"{len(self.lease_ids)} poisoned lease(s) {self.lease_ids[:5]} block install; "
            "resolve them with gate.clear_poison(...)"
        )


class NotDrained(TracestoreError):
    """``install`` while the gate is open or leases are still live.

    From ``weight_update``: ``dead_held`` live leases are held by holders whose
    heartbeat stopped (``lease_ids``: the first 100), which only a resolver
    settles (``gate.resolve_dead_holders``, ``tracestore gc``).
    """

    def __init__(self, state: str, live: int, lease_ids: Sequence[str] = (), dead_held: int = 0) -> None:
        self.state = state
        self.live = live
        self.lease_ids = list(lease_ids)
        self.dead_held = dead_held
        if dead_held:
            shown = ", ".join(self.lease_ids[:5]) + (" ..." if len(self.lease_ids) > 5 else "")
            super().__init__(
                f"cannot install: gate is {state} with {live} live lease(s), {dead_held} of them held by "
                f"holders whose heartbeat stopped ({shown}); abort them at their engines and settle them "
                "(gate.resolve_dead_holders, or `tracestore gc`), or wait for their deadlines"
            )
            return
        super().__init__(
            f"cannot install: gate is {state} with {live} live lease(s); seal() and drain() first"
        )


class HolderNotDead(TracestoreError):
    """``settle_dead`` of a lease whose holder is heart-beating (it came back), or never heart-beat.

    Nothing was written. ``deadline_ms``: the holder's heartbeat deadline
    (server clock), None when it never heart-beat.
    """

    def __init__(self, lease_id: str, holder: str, deadline_ms: int | None) -> None:
        self.lease_id = lease_id
        self.holder = holder
        self.deadline_ms = deadline_ms
        why = "never heart-beat" if deadline_ms is None else f"heart-beats (deadline {deadline_ms} ms)"
        super().__init__(
            f"lease {lease_id!r} was not settled: its holder {holder!r} {why}; it is the holder's to settle"
        )


class StaleVersion(TracestoreError):
    """``install`` of a version not larger than the current one."""

    def __init__(self, current: int, requested: int) -> None:
        self.current = current
        self.requested = requested
        super().__init__(
            f"cannot install version {requested}: current version is {current} "
            "(versions must increase)"
        )


class SessionRetired(TracestoreError):
    """The session was retired by the router (an HTTP front end answers 410 Gone)."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        super().__init__(f"session {sid!r} was retired (410 Gone)")


class LeaseFenced(TracestoreError):
    """An admit with a lease id that was settled before it was admitted; nothing was admitted.

    ``settle`` of a lease id the server never admitted (the recovery of an
    admit whose reply was lost and which never ran) fences that id for the
    receipt retention (``op_ttl_s``): the admit, arriving late, or called again
    with that ``op_id``, is refused instead of admitting a lease nobody
    serves. Admit again without ``op_id`` for a new lease.
    """

    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id
        super().__init__(
            f"lease {lease_id!r} was settled before it was admitted (the recovery of a lost "
            "admit fenced it): nothing admitted; admit again without op_id for a new lease"
        )


class UnknownLease(InvalidInput):
    """A gate lease id that was never admitted, or whose settled record expired (``renew``)."""

    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id
        super().__init__(
            "lease",
            f"unknown lease {lease_id!r} (never admitted, or settled longer ago than the "
            "receipt retention)",
        )


class GroupExists(TracestoreError):
    """``replay.put`` of a group id that is already stored in the replay buffer; nothing written."""

    def __init__(self, gid: str, status: str = "") -> None:
        self.gid = gid
        self.status = status
        super().__init__(
            f"replay group {gid!r} is already stored"
            + (f" (status {status!r})" if status else "")
            + "; use a new group id"
        )


class RunNotEmpty(TracestoreError):
    """``restore`` into a run that already holds keys; restore only into an empty run."""

    def __init__(self, run: str, found: Sequence[str]) -> None:
        self.run = run
        self.found = list(found)
        super().__init__(
            f"run {run!r} is not empty ({len(self.found)}+ keys, e.g. {self.found[:3]}); "
            "restore into a new run id or delete this run first (store.delete_run())"
        )


class RunInUse(TracestoreError):
    """``delete_run`` of a run whose live owners still hold sessions; nothing was deleted.

    ``owners`` lists ``(owner tag, live sessions)``.
    """

    def __init__(self, run: str, owners: Sequence[tuple[str, int]]) -> None:
        self.run = run
        self.owners = list(owners)
        shown = ", ".join(f"{o} ({n})" for o, n in self.owners[:5])
        more = f" and {len(self.owners) - 5} more" if len(self.owners) > 5 else ""
        super().__init__(
            f"run {run!r} is in use: live owners hold sessions: {shown}{more}; stop them "
            "(or let gc declare them lost), or delete with force=True"
        )


class RunLocked(TracestoreError):
    """Another process holds the run's lock (one trainer per run); nothing was changed.

    ``holder`` is its token, ``host``, ``boot`` (the machine's boot id, ''
    when unknown) and ``pid`` say where it runs, ``what`` what it is,
    ``since_ms`` when it took the lock and ``deadline_ms`` when the lock
    expires unless renewed (server clock, ms; -1 when unknown). Wait for it
    to end, or use another run; a holder that is gone (its lock expired, or
    its pid is dead on this machine) is taken over.
    """

    def __init__(
        self,
        run: str,
        holder: str,
        host: str,
        boot: str,
        pid: int,
        what: str,
        since_ms: int,
        deadline_ms: int,
    ) -> None:
        self.run = run
        self.holder = holder
        self.host = host
        self.boot = boot
        self.pid = pid
        self.what = what
        self.since_ms = since_ms
        self.deadline_ms = deadline_ms
        super().__init__(
            f"run {run!r} is held by {what or 'another process'} (pid {pid} on {host}, since "
            f"{self.since}); wait for it to end, or use another run"
        )

    @property
    def since(self) -> str:
        """``since_ms`` as local time (``2026-12-01 20:43:10``), for messages."""
        if self.since_ms < 0:
            return "an unknown time"
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_ms / 1000))


class RunRecordMissing(TracestoreError):
    """The run's record (``ts:{R}:meta``) is gone but keys of the run remain; nothing was deleted.

    The server restarted or was flushed while a client went on writing to
    the run. ``control_keys``, ``data_keys`` (of ``sessions`` sessions) and
    ``turn_shards`` count what is left; ``delete_run(force=True)``
    (``tracestore run delete R --force``) removes it.
    """

    def __init__(self, run: str, control_keys: int, data_keys: int, sessions: int, turn_shards: int) -> None:
        self.run = run
        self.control_keys = control_keys
        self.data_keys = data_keys
        self.sessions = sessions
        self.turn_shards = turn_shards
        super().__init__(
            f"run {run!r} has no record (ts:{{{run}}}:meta is gone: the server restarted or was "
            f"flushed while a client wrote to it), but {self.keys} of its keys remain "
            f"({control_keys} control, {data_keys} data of {sessions} sessions, {turn_shards} "
            "turn counter shards); delete them with delete_run(force=True)"
        )

    @property
    def keys(self) -> int:
        """Every key left."""
        return self.control_keys + self.data_keys + self.turn_shards


class StorageError(TracestoreError):
    """The Redis server could not be reached or answered with an error.

    Always raised ``from`` the underlying redis-py exception.
    """


class OutcomeUnknown(StorageError):
    """A mutating call failed after it may have reached the server: it may or may not have taken effect.

    Raised (instead of a plain StorageError) when the connection broke or
    timed out during a mutating call, or when a later step of a call failed
    after its first write (the purge after a release, a take's second round),
    so the caller does not know the call's reply. ``op_id`` is the
    idempotency key the call used (the caller's ``op_id=``, or the one drawn
    for it): calling the same method again with the same arguments and
    ``op_id=err.op_id`` within ``op_ttl_s`` returns the first call's reply if
    it took effect, never a second effect, and otherwise runs it now.
    ``lease_ids`` are the lease ids an ``admit``/``admit_many`` chose before
    the call (``lease_id``: the first; None for other calls): call ``admit``
    again with ``op_id`` to learn the lease, or settle them (``aborted``) so
    that no lease is left live. ``leases_settled``: None, unless the admit
    was called with ``on_unconfirmed="settle"``: then True when it settled
    those leases itself, False when that settle did not land either (settle
    them again). Subclasses name more specific causes.
    """

    def __init__(self, message: str, *, op_id: str, lease_ids: Sequence[str] = ()) -> None:
        self.reason = message
        self.op_id = op_id
        self.lease_ids = tuple(lease_ids)
        self.lease_id = self.lease_ids[0] if self.lease_ids else None
        self.leases_settled: bool | None = None
        super().__init__(message)

    def __str__(self) -> str:
        # Built when shown: a call made of nested calls names its own op id.
        hint = f"outcome unknown (op_id={self.op_id!r}"
        if self.lease_ids:
            more = f" (+{len(self.lease_ids) - 1} more)" if len(self.lease_ids) > 1 else ""
            hint += f", lease id {self.lease_ids[0]!r}{more}"
        if self.leases_settled:
            return f"{self.reason}; {hint}); the lease(s) were settled aborted: admit again"
        return f"{self.reason}; {hint}); call again with this op_id to learn the first reply"


class PermissionDenied(TracestoreError):
    """The server's ACL refused a command to this connection's user (``NOPERM``); nothing ran.

    ``what`` names the request. An observer (read-only) user gets it for
    every write; docs/security.md lists the grants of each role.
    ``missing_patterns``: the key patterns of the request's keys the user may
    not access, asked of the server (a user of an earlier version may lack
    ``ts:{R|*``); empty when they are accessible (a command or write access
    is missing) or that could not be told. ``tracestore acl R --check --user U``.
    """

    def __init__(self, what: str, detail: str, *, missing_patterns: Sequence[str] = (), hint: str = "") -> None:
        self.what = what
        self.detail = detail
        self.missing_patterns = tuple(missing_patterns)
        super().__init__(
            f"{what}: permission denied by the server's ACL ({detail}){hint}; see docs/security.md"
        )


class DurabilityUnconfirmed(OutcomeUnknown):
    """A mutating script ran, but its write was not confirmed at the store's durability level.

    The primary executed the script and answered; the ``WAIT``/``WAITAOF``
    that followed it in the same round trip did not confirm it within
    ``durability_timeout_s`` (fewer replicas acknowledged it than
    ``durability_replicas``, or the primary's AOF was not fsynced). The
    write may be lost if the primary fails now, or may survive: the outcome
    is unknown (see :class:`OutcomeUnknown` for how to learn it with
    ``op_id``). ``script`` names the script, ``node`` the primary,
    ``level`` the durability level, ``detail`` what was missing.
    """

    def __init__(
        self, script: str, node: str, level: str, detail: str, *, op_id: str, lease_ids: Sequence[str] = ()
    ) -> None:
        self.script = script
        self.node = node
        self.level = level
        self.detail = detail
        super().__init__(
            f"script {script!r} ran on {node} but durability={level!r} was not confirmed: {detail}",
            op_id=op_id,
            lease_ids=lease_ids,
        )


class NotEnoughReplicas(StorageError):
    """The primary refused a write: fewer replicas are in sync than its ``min-replicas-to-write``.

    Nothing was written (the outcome is known). Retry once the replicas are
    back; ``node``-level settings are in docs/durability.md.
    """


class StateRolledBack(TracestoreError):
    """The run's state went backwards: a value that only grows is lower than one this client saw.

    ``what`` names the value (the gate's weight version), ``seen`` the
    highest value this store object observed, ``found`` the lower one just
    read. It happens when the primary serving the run failed and a replica
    that lacked its last writes was promoted, or when older data was
    restored. The call did not act on the older state (an ``admit`` settles
    the lease it was given as ``aborted`` first). Check the run (leases,
    releases, replay groups of the lost writes), then call
    ``store.gate.fence(found)`` to accept the older state, or install the
    version the engines run.
    """

    def __init__(self, what: str, seen: int, found: int) -> None:
        self.what = what
        self.seen = seen
        self.found = found
        super().__init__(
            f"{what} went back from {seen} to {found}: the run's state was rolled back "
            "(failover to a lagging replica, or older data restored); not acting on it. "
            f"Check the run, then store.gate.fence({found}) to accept it"
        )


class CorruptData(TracestoreError):
    """A value stored in Redis cannot be decoded (written by something other than tracestore?).

    ``key`` names the Redis key, ``field`` the hash field or part (may be
    empty), ``detail`` what is wrong. Nothing was changed by the call that
    raised it: inspect the key with ``redis-cli`` and delete or repair it.
    """

    def __init__(self, key: str, detail: str, field: str = "") -> None:
        self.key = key
        self.field = field
        self.detail = detail
        where = f"{key} field {field!r}" if field else key
        super().__init__(f"corrupt data in {where}: {detail}")


class ScriptError(StorageError):
    """A Lua script failed on the server; ``script`` names it."""

    def __init__(self, script: str, detail: str) -> None:
        self.script = script
        self.detail = detail
        super().__init__(f"script {script!r} failed: {detail}")


def raise_for_code(script: str, code: str, fields: Sequence[Any]) -> None:
    """Turn a script's error result ``{"ERR", code, *fields}`` into a typed error.

    Codes are defined by tracestore's own scripts (see each ``lua/*.lua``
    contract header), so this mapping is the single place where they are read.
    """
    f = [x.decode() if isinstance(x, bytes) else x for x in fields]
    if code == "SESSION_EXISTS":
        raise SessionExists(str(f[0]), str(f[1]) if len(f) > 1 else "")
    if code == "SESSION_RELEASED":
        raise SessionReleased(str(f[0]), str(f[1]) if len(f) > 1 else "")
    if code == "NOT_OWNER":
        raise NotOwner(str(f[0]), str(f[1]), (str(f[2]) or None) if len(f) > 2 else None)
    if code == "OWNER_LOST":
        raise OwnerLost(str(f[0]), int(f[1]) if len(f) > 1 else 0)
    if code == "NODE_CONFLICT":
        raise NodeConflict(str(f[0]), str(f[1]), str(f[2]) if len(f) > 2 else "")
    if code == "GATE_SEALED":
        raise GateSealed(int(f[0]), int(f[1]))
    if code == "GATE_POISONED":
        raise GatePoisoned([str(x) for x in f])
    if code == "NOT_DRAINED":
        raise NotDrained(str(f[0]), int(f[1]))
    if code == "STALE_VERSION":
        raise StaleVersion(int(f[0]), int(f[1]))
    if code == "SESSION_RETIRED":
        raise SessionRetired(str(f[0]))
    if code == "UNKNOWN_LEASE":
        raise UnknownLease(str(f[0]))
    if code == "LEASE_FENCED":
        raise LeaseFenced(str(f[0]))
    if code == "HOLDER_NOT_DEAD":
        raise HolderNotDead(str(f[0]), str(f[1]), None if int(f[2]) < 0 else int(f[2]))
    if code == "GROUP_EXISTS":
        raise GroupExists(str(f[0]), str(f[1]) if len(f) > 1 else "")
    if code == "CORRUPT":
        raise CorruptData(str(f[0]), str(f[2]) if len(f) > 2 else "undecodable", str(f[1]) if len(f) > 1 else "")
    if code == "PREFIX_CHANGED":
        raise PrefixChanged(str(f[0]), str(f[1]), str(f[2]), str(f[3]), str(f[4]) != "0" if len(f) > 4 else True)
    if code == "RUN_LOCKED":  # the run's id is filled in by the caller (tracestore.runlock)
        holder, host, boot, pid, what = (str(x) for x in f[:5])
        raise RunLocked("", holder, host, boot, int(pid or -1), what, int(f[5]), int(f[7]))
    if code == "INVALID_INPUT":
        raise InvalidInput(str(f[0]), str(f[1]) if len(f) > 1 else "invalid")
    raise ScriptError(script, f"unknown result code {code!r} {f!r}")


__all__ = [
    "TracestoreError",
    "InvalidId",
    "InvalidInput",
    "ConfigError",
    "ServerError",
    "SessionExists",
    "SessionReleased",
    "NotOwner",
    "OwnerLost",
    "NodeConflict",
    "PrefixChanged",
    "PromptMismatch",
    "GateSealed",
    "GatePoisoned",
    "NotDrained",
    "HolderNotDead",
    "StaleVersion",
    "SessionRetired",
    "UnknownLease",
    "LeaseFenced",
    "GroupExists",
    "RunNotEmpty",
    "RunInUse",
    "RunLocked",
    "RunRecordMissing",
    "StorageError",
    "OutcomeUnknown",
    "DurabilityUnconfirmed",
    "NotEnoughReplicas",
    "StateRolledBack",
    "PermissionDenied",
    "CorruptData",
    "ScriptError",
    "raise_for_code",
]
