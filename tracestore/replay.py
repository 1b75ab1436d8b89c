"""Replay buffer in Redis: groups of finished rollouts between producers and learners (DESIGN section 7).

A *group* is a set of sessions (the rollouts of one prompt, its *members*)
with a status, the oldest weight version of any of its tokens (per member
and overall) and a JSON payload (rewards, finish reasons...). Stored groups
live on the run's control-plane slot:

* ``ts:{R}:rb:groups`` hash gid -> record, a JSON object: ``task``,
  ``status``, ``min_version``, ``seq``, ``retryable``, ``agentic``, ``mv``
  (each member's oldest token version), ``reroll`` (members released by
  per-member expiry), ``put_ms``, ``producer``;
* ``ts:{R}:rb:sids`` hash gid -> the members' session ids (JSON array);
* ``ts:{R}:rb:payloads`` hash gid -> the payload (JSON, verbatim as put);
* ``ts:{R}:rb:q:<task>:<status>`` zset gid -> seq (FIFO order);
* ``ts:{R}:rb:v:<task>:<status>`` zset gid -> ``min_version + seq / 2**32``:
  one index gives both the staleness order (oldest version, then FIFO) and
  the expiry range (``ZRANGEBYSCORE -inf (cutoff``, O(log n + k));
* ``ts:{R}:rb:bytes`` (bytes of records per task and status),
  ``ts:{R}:rb:seq``, ``ts:{R}:rb:tasks``.

A group lives in three run-level hashes rather than in a key of its own so
that a take reads and deletes its groups with a few commands, whatever
their number, and hands their three strings out undecoded.

Each operation is one atomic script (``lua/rb_*.lua``) that also moves or
releases the group's sessions with the shared ownership primitives, so a
session is owned by its producer, then by ``replay``, then by its taker,
never by two, and a released session gets exactly one event.

Staleness: ``staleness = current_version - min_version``. A group is
*ready* when ``staleness <= max_staleness`` and *stale* otherwise, i.e. stale
iff ``min_version < current_version - max_staleness``. ``put`` reads each
member's oldest version from its stored traces (the trained tokens' weight
versions), so callers need not track it.

Scripts that choose their groups inside Redis (take, claim, expire) reach
those groups' session hashes in one of two ways (``lua/_lib/rb.lua``): by
default the script appends the sids to the session key prefix of the run's
control-plane slot (one round trip; see docs/replay.md for what Redis and
Valkey permit), or, with ``StoreConfig.replay_declared_keys``, every key
travels in KEYS and a first call answers ``NEED`` with the sids (two round
trips).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import validate
from .context import Context, OpId, mutating
from .errors import CorruptData, InvalidInput, ScriptError
from .purge import purge_sessions
from .replies import Reply, field_map, pairs, stored, text
from .scripts import Batch, Cmd, Eval, Op, gather, script
from .twin import AsyncPart, SyncPart, op
from .validate import int_in, one_of, validate_id, validate_ids

#: Owner tag of sessions held by the replay buffer.
REPLAY_OWNER = "replay"
#: Every group status; ``failed`` and ``filtered`` groups are never stored.
STATUSES = ("completed", "aborted", "expired", "failed", "filtered")
#: Statuses a stored group can have.
STORED_STATUSES = ("completed", "aborted", "expired")
#: Statuses :func:`expire` moves to ``expired`` (or releases).
EXPIRABLE_STATUSES = ("completed", "aborted")
#: Versions are packed with the FIFO seq into one zset score (53-bit mantissa).
MAX_VERSION = 2**21 - 1
#: Most sessions in one group.
MAX_SIDS = 4000
#: Most groups one take, take_many (all tasks together) or claim_retry moves:
#: a call holds the server while it runs; take more with several calls.
MAX_TAKE = 2000
#: Most stale groups a take expires inside its own atomic call; beyond that it
#: runs :func:`expire` for the task first (separate atomic calls).
MAX_STALE_IN_TAKE = 2048
#: Most groups expired per ``rb_expire`` call (a call holds the server briefly).
EXPIRE_BATCH = 1000
#: Rounds of the NEED protocol before giving up (contention on one queue head).
MAX_ROUNDS = 64
#: Reply fields per group of rb_take / rb_claim: gid, record, sids, payload.
_GROUP_FIELDS = 4


# -- value types -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """A replay group: the rollouts of one prompt and what the learner needs about them.

    Input fields (to :meth:`Replay.put`):

    * ``sids``: the group's sessions (members), in the order the learner
      should see them; ``status``: one of :data:`STATUSES`;
    * ``min_version``: oldest weight version of any token of the group.
      Leave it None: ``put`` reads it from the stored traces (the oldest
      version of each member's trained tokens). A given value older than the
      traces is kept (a conservative bound); a newer one is refused;
    * ``retryable`` (default True, as in XTuner): an expired group is kept
      (status ``expired``, claimable by a producer with
      :meth:`Replay.claim_retry`) instead of being released;
    * ``agentic``: the group's members are one agent's interdependent
      sessions: per-member expiry never splits it (it expires whole);
    * ``payload``: JSON object (rewards, finish reasons...), at most
      ``StoreConfig.replay_payload_bytes`` once encoded.

    Set by the buffer on the groups it returns: ``seq`` (FIFO position),
    ``member_versions`` (each member's oldest version, aligned with ``sids``)
    and ``reroll``: the members that per-member expiry released (their
    sessions are gone; the producer rolls them out again under new session
    ids), while ``sids`` keeps the fresh members in their order.
    """

    gid: str
    task: str
    sids: tuple[str, ...]
    status: str = "completed"
    min_version: int | None = None
    retryable: bool = True
    payload: dict[str, Any] = field(default_factory=dict, hash=False)
    agentic: bool = False
    reroll: tuple[str, ...] = ()
    member_versions: tuple[int, ...] = field(default=(), compare=False)
    seq: int | None = field(default=None, compare=False)

    def staleness(self, current_version: int) -> int:
        """``current_version - min_version``; InvalidInput before the buffer has set ``min_version``."""
        if self.min_version is None:
            raise InvalidInput("min_version", f"group {self.gid!r} has none yet (put sets it)")
        return current_version - self.min_version


@dataclass(frozen=True)
class PutResult:
    """What :meth:`Replay.put` did.

    ``stored``: the group is in the buffer, with ``seq`` and ``status``
    (``expired`` when it was already stale at put). ``released``: sessions
    released instead (all of them for a group that was not stored; the stale
    members of a group expired per member at put). ``min_version``: the
    version the group was put with.
    """

    gid: str
    stored: bool
    seq: int | None
    released: tuple[str, ...] = ()
    status: str | None = None
    min_version: int | None = None


@dataclass(frozen=True)
class Taken:
    """The result of :meth:`Replay.take`: the groups taken (possibly none) and the expiry it ran first.

    Iterating, ``len``, indexing and truth work on the groups, like a
    sequence; but a ``Taken`` is not a list: ``Taken(()) == []`` is False.
    Test a take with ``if not taken`` or ``len(taken) == 0``.
    ``expired``: gids of stale retryable groups moved to status
    ``expired``; ``released``: sids released by the expiry (one event each).
    ``ready``: on a short all-or-nothing take, how many groups were ready
    (nothing was taken or changed); None otherwise.
    """

    groups: tuple[Group, ...]
    expired: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    ready: int | None = None

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __getitem__(self, i: int) -> Group:
        return self.groups[i]


@dataclass(frozen=True)
class TakenMany:
    """The result of :meth:`Replay.take_many`: groups per task, and the expiry it ran first.

    ``tasks``: task -> the groups taken from it, in policy order (every task
    asked for is a key). ``ready``: on a short all-or-nothing take, how many
    groups each task had ready (nothing was taken or changed); None
    otherwise. ``taken[task]`` is ``taken.tasks[task]``; iterating yields
    every group (tasks in the order asked); ``len`` counts them; a take that
    took nothing is falsy.
    """

    tasks: dict[str, tuple[Group, ...]]
    expired: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    ready: dict[str, int] | None = None

    def __getitem__(self, task: str) -> tuple[Group, ...]:
        return self.tasks[task]

    def __iter__(self) -> Iterator[Group]:
        return (g for groups in self.tasks.values() for g in groups)

    def __len__(self) -> int:
        return sum(len(g) for g in self.tasks.values())

    def __bool__(self) -> bool:
        return len(self) > 0


@dataclass(frozen=True)
class ExpireReport:
    """The result of :meth:`Replay.expire`.

    ``kept``: gids now ``expired`` (claimable); ``released_groups``: gids
    released whole; ``released_sids``: every session released (whole groups
    and the stale members of groups expired per member; one event each).
    """

    kept: tuple[str, ...]
    released_groups: tuple[str, ...]
    released_sids: tuple[str, ...]

    @property
    def expired(self) -> int:
        """Groups that left their queue (kept + released)."""
        return len(self.kept) + len(self.released_groups)


@dataclass(frozen=True)
class StatusStats:
    """One (task, status) cell of :meth:`Replay.stats`."""

    task: str
    status: str
    groups: int
    oldest_version: int | None
    bytes: int


# -- validation (before any I/O) ----------------------------------------------------------------


def _status(status: str, allowed: Sequence[str] = STATUSES) -> str:
    return one_of("status", status, allowed)


def _payload(ctx: Context, payload: object) -> bytes:
    if not isinstance(payload, dict):
        raise InvalidInput("payload", f"must be a JSON object (dict), got {type(payload).__name__}")
    try:
        data = orjson.dumps(payload)
    except TypeError as exc:
        raise InvalidInput("payload", f"not JSON-serialisable: {exc}") from None
    limit = ctx.config.replay_payload_bytes
    if len(data) > limit:
        raise InvalidInput(
            "payload",
            f"{len(data)} bytes of JSON exceed the limit of {limit} (StoreConfig.replay_payload_bytes); "
            "keep large data in the traces",
        )
    return data


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(name, f"must be a bool, got {value!r}")
    return value


def _cutoff(current_version: int | None, max_staleness: int | None) -> str:
    if max_staleness is None:
        return ""
    validate.version("max_staleness", max_staleness)
    if current_version is None:
        raise InvalidInput("current_version", "required when max_staleness is given")
    validate.version("current_version", current_version)
    return str(current_version - max_staleness)


def _n(n: object) -> int:
    return int_in("n", n, 0, MAX_TAKE)


@dataclass(frozen=True)
class _Checked:
    """A validated group of :func:`put`: its ids, payload bytes and given min_version."""

    gid: str
    task: str
    status: str
    sids: list[str]
    payload: bytes
    min_version: int | None


def _check_group(ctx: Context, group: object, owner: str) -> _Checked:
    if not isinstance(group, Group):
        raise InvalidInput("group", f"must be a replay.Group, got {type(group).__name__}")
    gid = validate_id("group id", group.gid)
    task = validate_id("task", group.task)
    status = _status(group.status)
    sids = validate_ids("session id", group.sids)
    if not sids or len(sids) > MAX_SIDS:
        raise InvalidInput("sids", f"a group needs 1..{MAX_SIDS} sessions, got {len(sids)}")
    if len(set(sids)) != len(sids):
        raise InvalidInput("sids", f"duplicate session ids in group {gid!r}")
    minv = None if group.min_version is None else int_in("min_version", group.min_version, 0, MAX_VERSION)
    _flag("retryable", group.retryable)
    _flag("agentic", group.agentic)
    payload = _payload(ctx, group.payload)
    validate_id("owner tag", owner)
    return _Checked(gid, task, status, sids, payload, minv)


# -- decoding ---------------------------------------------------------------------------------------


def _group(gid: str, rec: Any, sids: Any, payload: Any) -> Group:
    """A group from its three fields: record (JSON object), sids and payload (JSON).

    ValueError/TypeError/KeyError when a field is not what put stores (the caller names the key).
    """
    loads = orjson.loads
    r = loads(rec)
    ids = loads(sids)
    body = loads(payload)
    if (
        type(ids) is not list
        or type(body) is not dict
        or r["status"] not in STORED_STATUSES
        or type(r["task"]) is not str
        or not all(type(x) is str for x in ids)
    ):
        raise ValueError("not the shape put stores")
    return Group(
        gid, r["task"], tuple(ids), r["status"], int(r["min_version"]), bool(r["retryable"]),
        body, bool(r["agentic"]), tuple(r["reroll"]), tuple(r["mv"]), int(r["seq"]),
    )


def _corrupt(ctx: Context, gid: str, rec: Any, sids: Any, payload: Any, exc: Exception) -> CorruptData:
    """The CorruptData of a stored group the client cannot decode: which hash, the gid as the field."""
    k = ctx.keys
    checks = ((k.rb_groups, rec, dict), (k.rb_sids, sids, list), (k.rb_payloads, payload, dict))
    for key, value, kind in checks:
        try:
            if value is None or not isinstance(orjson.loads(value), kind):
                return CorruptData(key, f"not a JSON {kind.__name__}", gid)
        except orjson.JSONDecodeError as err:  # (a UnicodeDecodeError too)
            return CorruptData(key, f"{type(err).__name__}: {err}", gid)
    if not all(isinstance(x, str) for x in orjson.loads(sids)):
        return CorruptData(k.rb_sids, "not a list of session ids", gid)
    return CorruptData(k.rb_groups, f"{type(exc).__name__}: {exc}", gid)


def _groups_of(ctx: Context, rows: Sequence[tuple[str, Any, Any, Any]]) -> list[Group]:
    """Groups from ``(gid, record, sids, payload)`` rows; CorruptData naming the first malformed one."""
    try:
        return [_group(*row) for row in rows]
    except (ValueError, TypeError, KeyError):  # off the hot path: find the culprit
        for row in rows:
            try:
                _group(*row)
            except (ValueError, TypeError, KeyError) as err:
                raise _corrupt(ctx, *row, err) from None
        raise


def _decode_groups(ctx: Context, r: Reply) -> list[Group]:
    """A count ``m``, then ``m`` groups of :data:`_GROUP_FIELDS` fields: gid, record, sids, payload.

    The hot path of a take (512 groups are 2,048 items): one pass, no per-item cursor calls.
    The scripts hand out only groups that pass their decoding check (``lua/_lib/rb.lua``);
    CorruptData all the same if one does not decode.
    """
    m = r.int()
    items = r.take(_GROUP_FIELDS * m)
    return _groups_of(
        ctx,
        [(text(items[i]), items[i + 1], items[i + 2], items[i + 3]) for i in range(0, _GROUP_FIELDS * m, _GROUP_FIELDS)],
    )


def read_groups(ctx: Context, gids: Sequence[str]) -> Op[list[Group]]:
    """The stored groups ``gids`` (those still stored), in that order; one round trip.

    For inspection and checkpoints: O(len(gids)), three pipelined HMGETs.
    CorruptData (naming the hash and the gid) for a group that does not decode.
    """
    if not gids:
        return []
    k = ctx.keys
    recs, sids, pays = yield Batch(
        tuple(Cmd(("HMGET", key, *gids), key=key) for key in (k.rb_groups, k.rb_sids, k.rb_payloads))
    )
    return _groups_of(
        ctx,
        [
            (g, rec, js, pay)
            for g, rec, js, pay in zip(gids, recs, sids, pays, strict=True)
            if rec is not None or js is not None or pay is not None
        ],
    )


# -- keys of the groups a script picks -------------------------------------------------------------


def _keyed_eval(
    ctx: Context, name: str, fixed_keys: tuple[str, ...], fixed_args: tuple[Any, ...], op_id: str,
    sids: Sequence[str] = (),
) -> Eval:
    """A call of a script that picks its groups inside Redis (``lua/_lib/rb.lua``).

    ARGV ends with the session key prefix (:attr:`~tracestore.keys.Keys.session_prefix`;
    empty with ``StoreConfig.replay_declared_keys``) and the declared
    session keys' sids, whose keys end KEYS.
    """
    k = ctx.keys
    prefix = "" if ctx.config.replay_declared_keys else k.session_prefix
    keys = fixed_keys + tuple(k.session(s) for s in sids)
    return Eval(script(name), keys, (*fixed_args, prefix, len(sids), *sids), op_id=op_id)


def _with_keys(
    ctx: Context, name: str, fixed_keys: tuple[str, ...], fixed_args: tuple[Any, ...], op_id: str
) -> Op[list[Any]]:
    """Call a script that picks its groups inside Redis; return its final (non-NEED) reply.

    In-script keys (the default): one call; the script appends the sids to
    the session key prefix. Declared keys (``StoreConfig.replay_declared_keys``):
    the sids a NEED reply names are accumulated and passed as the KEYS tail
    (their session keys). The op key of ``op_id`` is part of ``fixed_keys``:
    NEED replies are not recorded, so every round may carry the same op id,
    and a retried final round replays its reply.
    """
    sids: list[str] = []
    for _ in range(MAX_ROUNDS):
        reply = yield _keyed_eval(ctx, name, fixed_keys, fixed_args, op_id, sids)
        if text(reply[0]) != "NEED":
            return list(reply)
        new = [text(x) for x in reply[1:]]
        if len(sids) + len(new) > 3 * MAX_SIDS:
            sids = []  # stale names piled up under contention: start afresh
        sids = list(dict.fromkeys(sids + new))
    raise ScriptError(name, f"no stable plan after {MAX_ROUNDS} rounds (heavy contention)")


# -- put ---------------------------------------------------------------------------------------------


def _version_reads(ctx: Context, sids: Sequence[str]) -> list[Eval | Cmd]:
    """One read-only ``trace_versions`` call per session (validated already), on its data slot."""
    k = ctx.keys
    sc = script("trace_versions")
    return [Eval(sc, (k.idx(s), k.dead(s))) for s in sids]


def _group_versions(ctx: Context, c: _Checked, current_version: int | None) -> Op[tuple[int, list[int | None]]]:
    """The group's min_version and each member's oldest trained-token version (see :func:`put`).

    One pipelined round trip: the members' ``trace_versions`` (and the gate's
    version when it may be the fallback). Raises InvalidInput for a given
    min_version newer than the traces, or one above :data:`MAX_VERSION`.
    """
    k = ctx.keys
    reads = _version_reads(ctx, c.sids)
    if c.min_version is None and current_version is None:
        reads.append(Cmd(("HGET", k.gate, "version"), key=k.gate))
    replies = yield Batch(tuple(reads))
    versions = _versions(replies[: len(c.sids)])
    known = [v for v in versions if v is not None]
    if c.min_version is not None:
        if known and c.min_version > min(known):
            sid = c.sids[versions.index(min(known))]
            raise InvalidInput(
                "min_version",
                f"{c.min_version} is newer than the traces of group {c.gid!r}: session {sid!r} "
                f"has tokens of version {min(known)}; give None to use the traces",
            )
        minv = c.min_version
    elif known:
        minv = min(known)
    elif current_version is not None:
        minv = current_version
    else:
        minv = int(replies[-1] or 0)
    if minv > MAX_VERSION:
        raise InvalidInput("min_version", f"{minv} is above the replay buffer's bound {MAX_VERSION}")
    return minv, versions


def _versions(replies: Sequence[Any]) -> list[int | None]:
    """Each session's oldest trained-token version from its ``trace_versions`` reply (None: none)."""
    out: list[int | None] = []
    for reply in replies:
        r = Reply(reply, "trace_versions")
        r.flag()  # dead: rb_put itself reports a released session
        oldest = r.int()
        out.append(None if oldest < 0 else oldest)
    return out


def put_request(
    ctx: Context,
    group: Group,
    owner: str,
    member_versions: Sequence[int] | None = None,
    *,
    current_version: int | None = None,
    max_staleness: int | None = None,
    per_member: bool = False,
) -> Eval:
    """The ``rb_put`` call of ``group`` whose versions are known: no trace read (pure, no I/O).

    For bulk loads that pipeline many puts (benchmarks, tests): ``group``
    must carry ``min_version``; ``member_versions`` (one per sid) default to
    it. :meth:`Replay.put` reads them from the traces instead. Raises as
    ``put`` does before I/O.
    """
    c = _check_group(ctx, group, owner)
    if c.min_version is None:
        raise InvalidInput("min_version", "put_request needs it; put() reads it from the traces")
    mv = list(member_versions) if member_versions is not None else [c.min_version] * len(c.sids)
    if len(mv) != len(c.sids):
        raise InvalidInput("member_versions", f"{len(mv)} versions for {len(c.sids)} sessions")
    for v in mv:
        int_in("member_versions", v, 0, MAX_VERSION)
    return _put_eval(
        ctx, group, c, owner, c.min_version, mv, _cutoff(current_version, max_staleness), per_member,
        ctx.op(None, "put"),
    )


def _put_eval(
    ctx: Context, group: Group, c: _Checked, owner: str, minv: int, mv: Sequence[int], cutoff: str,
    per_member: bool, op: OpId, op_key: str | None = None,
) -> Eval:
    """The ``rb_put`` call of a checked group; its reply recorded at ``op_key`` (default ``op.key``)."""
    k = ctx.keys
    keys = (
        k.rb_groups,
        k.rb_sids,
        k.rb_payloads,
        k.rb_queue(c.task, c.status),
        k.rb_versions(c.task, c.status),
        k.rb_queue(c.task, "expired"),
        k.rb_versions(c.task, "expired"),
        k.rb_seq,
        k.rb_tasks,
        k.rb_bytes,
        k.owner(owner),
        k.owner(REPLAY_OWNER),
        k.released,
        k.events,
        op.key if op_key is None else op_key,
        k.stats,
        *(k.session(s) for s in c.sids),
    )
    args = (
        c.gid,
        c.task,
        c.status,
        orjson.dumps(c.sids),
        minv,
        int(group.retryable),
        c.payload,
        owner,
        REPLAY_OWNER,
        ctx.op_ttl_ms,
        int(group.agentic),
        orjson.dumps(list(mv)),
        cutoff,
        int(_flag("per_member", per_member)),
        *c.sids,
    )
    return Eval(script("rb_put"), keys, args, op_id=op.id)


def put_result(gid: str, minv: int | None, reply: Sequence[Any]) -> PutResult:
    """Decode an ``rb_put`` reply (its status word stripped)."""
    r = Reply(reply, "rb_put")
    stored, seq, status = r.flag(), r.int(), r.text()
    released = tuple(r.rest_texts())
    if stored:
        return PutResult(gid, True, seq, released, status, minv)
    return PutResult(gid, False, None, released, None, minv)


@mutating
def put(
    ctx: Context,
    group: Group,
    owner: str,
    *,
    current_version: int | None = None,
    max_staleness: int | None = None,
    per_member: bool = False,
    op_id: str | None = None,
) -> Op[PutResult]:
    """Store ``group`` and move its sessions from ``owner`` to the buffer, atomically.

    ``min_version``: when the group gives none, the oldest version of its
    members' stored trained tokens (each member's oldest is kept too, for
    per-member expiry); a member without any takes the group's version; a
    group without any takes ``current_version`` if given, else the version
    the gate has installed (0 if none). A given ``min_version`` newer than
    the traces is refused.

    Never stored (sessions released at once, one event each, data purged):
    a ``failed`` or ``filtered`` group (reason = status), a non-retryable
    ``expired`` group, and, with ``max_staleness``, a non-retryable
    completed or aborted group already stale at put (reason ``expired``). A
    retryable one stale at put is stored as ``expired`` (claimable); with
    ``per_member`` (not for ``agentic`` groups) only its stale members are
    released and listed in ``reroll``.

    Raises, with nothing written: InvalidId/InvalidInput (before I/O:
    unknown status, payload not a dict or over the size limit, duplicate or
    no sids, min_version out of 0..2**21-1; after reading the traces: a
    min_version newer than they are), GroupExists (gid already stored),
    NotOwner (a session is not live or not owned by ``owner``),
    SessionReleased; OutcomeUnknown when the reply was lost (call again
    with its ``op_id``: the first reply, not GroupExists). Two round trips
    (the traces' versions, then the put; one for a group that is never
    stored), plus the purge when sessions are released.
    """
    c = _check_group(ctx, group, owner)
    op = ctx.op(op_id, "put")
    cutoff = _put_options(current_version, max_staleness, per_member)
    plan = yield from _put_plan(ctx, group, c, current_version)
    return (yield from _put_stored(ctx, group, c, owner, plan, cutoff, per_member, op, op.key))


@mutating
def put_many(
    ctx: Context,
    groups: Sequence[Group],
    owner: str,
    *,
    current_version: int | None = None,
    max_staleness: int | None = None,
    per_member: bool = False,
    op_id: str | None = None,
) -> Op[list[PutResult]]:
    """:func:`put` for each of ``groups`` (same options), batched: their results, in order.

    Two round trips for the whole list: the traces' versions of every
    group's members (one pipeline), then every group's ``rb_put`` (one
    pipeline); plus the purge when sessions are released (shared). Every
    group is checked before any I/O (the errors of :func:`put`), and a
    given min_version newer than the traces is refused after the reads with
    nothing written for any group. Each put is then its own atomic script:
    a group refused by the server (GroupExists, NotOwner, SessionReleased)
    leaves the others stored, and the first such error is raised once all
    have run. One op id names the call (``op_id``, else a fresh one); group
    ``i`` records its reply under the call's part ``i`` (group 0 under the
    call's own op key, as a :func:`put` with that ``op_id``), so after an
    OutcomeUnknown, calling again with ``op_id=err.op_id`` and the same
    groups replays each put's first reply.
    """
    checked = [_check_group(ctx, g, owner) for g in groups]
    op = ctx.op(op_id, "put")
    cutoff = _put_options(current_version, max_staleness, per_member)
    if not checked:
        return []
    plans = yield from gather([_put_plan(ctx, g, c, current_version) for g, c in zip(groups, checked, strict=True)])
    return (
        yield from gather(
            [
                _put_stored(ctx, g, c, owner, plan, cutoff, per_member, op, op.key_of(i))
                for i, (g, c, plan) in enumerate(zip(groups, checked, plans, strict=True))
            ]
        )
    )


def _put_options(current_version: int | None, max_staleness: int | None, per_member: bool) -> str:
    """Check put's options (before I/O); the staleness cutoff they give."""
    cutoff = _cutoff(current_version, max_staleness)
    if current_version is not None:
        validate.version("current_version", current_version)
    _flag("per_member", per_member)
    return cutoff


def _put_plan(
    ctx: Context, group: Group, c: _Checked, current_version: int | None
) -> Op[tuple[int, int | None, list[int]]]:
    """A checked group's min_version, the one its result shows, and each member's version.

    No I/O for a group that is never stored; else one round trip (the traces' versions).
    """
    if c.status in ("failed", "filtered") or (c.status == "expired" and not group.retryable):
        # never stored: its sessions are released, no version is needed
        minv = c.min_version or 0
        return minv, c.min_version, [minv] * len(c.sids)
    minv, versions = yield from _group_versions(ctx, c, current_version)
    return minv, minv, [v if v is not None else minv for v in versions]


def _put_stored(
    ctx: Context, group: Group, c: _Checked, owner: str, plan: tuple[int, int | None, list[int]], cutoff: str,
    per_member: bool, op: OpId, op_key: str,
) -> Op[PutResult]:
    """Run a planned put (its reply recorded at ``op_key``), then purge the sessions it released."""
    minv, shown, mv = plan
    reply = yield _put_eval(ctx, group, c, owner, minv, mv, cutoff, per_member, op, op_key)
    res = put_result(c.gid, shown, reply)
    if res.released:
        yield from purge_sessions(ctx, list(res.released))
    return res


# -- take -------------------------------------------------------------------------------------------


@mutating
def take_many(
    ctx: Context,
    wants: Mapping[str, int],
    *,
    owner: str,
    current_version: int | None = None,
    policy: str = "fifo",
    max_staleness: int | None = None,
    at_most: bool = False,
    per_member: bool = False,
    op_id: str | None = None,
) -> Op[TakenMany]:
    """Take ``wants[task]`` completed groups of each task for ``owner``, in one atomic script.

    All or nothing across the tasks: unless every task has its ``n`` ready
    groups, nothing is taken or changed (the result is empty and ``ready``
    says how many each task had). ``at_most``: take up to ``n`` of each
    instead (never short). With ``max_staleness``, each task's stale groups
    (``current_version - min_version > max_staleness``) are expired first,
    in the same script: retryable ones move to ``expired`` and keep their
    sessions (with ``per_member``, only their fresh members; agentic groups
    whole), the others are released (one event per session, data purged);
    the one exception to atomicity is a backlog of more than 2,048 stale
    groups, expired by separate calls first. Groups leave in ``policy``
    order (``fifo``: put order; ``staleness``: oldest ``min_version`` first,
    then put order) and their sessions move to ``owner``. A task with n=0,
    or an empty ``wants``, takes nothing (no I/O when nothing is asked).

    Raises InvalidId/InvalidInput before I/O (n outside 0..2000 or more
    than 2000 in all: :data:`MAX_TAKE`), OwnerLost (gc declared ``owner``
    lost), CorruptData (a group the client could not decode; nothing
    taken), OutcomeUnknown when a reply was lost: calling again with the
    same arguments and ``op_id=err.op_id`` returns the groups the first call
    took (its commit replays), never a second take. One round trip (two
    with declared keys; more under contention or with released sessions).
    """
    if not isinstance(wants, Mapping):
        raise InvalidInput("wants", f"must be a mapping task -> n, got {type(wants).__name__}")
    asked = {validate_id("task", t): _n(n) for t, n in wants.items()}
    if sum(asked.values()) > MAX_TAKE:
        raise InvalidInput("n", f"{sum(asked.values())} groups in one take; at most {MAX_TAKE} per call")
    validate_id("owner tag", owner)
    one_of("policy", policy, ("fifo", "staleness"))
    cutoff = _cutoff(current_version, max_staleness)
    _flag("at_most", at_most)
    _flag("per_member", per_member)
    tasks = [t for t, n in asked.items() if n > 0]
    if not tasks:
        return TakenMany({t: () for t in asked})
    k = ctx.keys
    op = ctx.op(op_id, "take")
    fixed: tuple[str, ...] = (
        k.owner(REPLAY_OWNER),
        k.owner(owner),
        k.released,
        k.events,
        k.rb_groups,
        k.rb_sids,
        k.rb_payloads,
        k.rb_bytes,
        op.key,
        k.owners_lost,
        k.stats,
    )
    for t in tasks:
        fixed += (
            k.rb_queue(t, "completed"),
            k.rb_versions(t, "completed"),
            k.rb_queue(t, "expired"),
            k.rb_versions(t, "expired"),
        )
    args: tuple[Any, ...] = (
        cutoff, policy, owner, REPLAY_OWNER, ctx.op_ttl_ms, MAX_STALE_IN_TAKE, int(at_most),
        int(per_member), len(tasks),
    )
    for t in tasks:
        args += (t, asked[t])
    expired: list[str] = []
    released: list[str] = []
    for rnd in range(MAX_ROUNDS):
        r = Reply((yield from _with_keys(ctx, "rb_take", fixed, args, op.id)), "rb_take")
        tag = r.text()
        if tag == "EXPIRE_FIRST":
            rep = yield from _expire_cells(
                ctx, [(t, "completed") for t in tasks], cutoff, "", per_member, op.sub("x", rnd)
            )
            expired += rep.kept
            released += rep.released_sids
            continue
        if tag == "SHORT":
            ready = dict.fromkeys(asked, 0)
            for t, n in zip(tasks, [r.int() for _ in range(r.int())], strict=True):
                ready[t] = n
            return TakenMany({t: () for t in asked}, tuple(expired), tuple(released), ready)
        if tag != "OK":
            raise ScriptError("rb_take", f"unexpected reply {r.items[:3]!r}")
        expired += r.counted()
        rel = r.counted()
        got: dict[str, tuple[Group, ...]] = {t: () for t in asked}
        for t in tasks:
            got[t] = tuple(_decode_groups(ctx, r))
        yield from purge_sessions(ctx, rel)
        released += rel
        return TakenMany(got, tuple(expired), tuple(released))
    raise ScriptError("rb_take", "stale groups keep appearing faster than they can be expired")


def take(
    ctx: Context,
    task: str,
    n: int,
    *,
    owner: str,
    current_version: int | None = None,
    policy: str = "fifo",
    max_staleness: int | None = None,
    at_most: bool = False,
    per_member: bool = False,
    op_id: str | None = None,
) -> Op[Taken]:
    """Take ``n`` completed groups of ``task`` for ``owner``: :func:`take_many` of one task.

    All or nothing: with fewer than ``n`` ready groups nothing is taken or
    changed, not even the expiry (the result is empty and falsy, ``ready``
    says how many were ready; it is a :class:`Taken`, not a list, so test it
    with ``if not taken``). ``at_most``: up to ``n``. ``n=0`` is a no-op
    without I/O. Otherwise as :func:`take_many` (expiry first, policy order,
    sessions to ``owner``); ``n`` is at most 2,000 (:data:`MAX_TAKE`).
    Raises InvalidId/InvalidInput before I/O, OwnerLost, CorruptData,
    OutcomeUnknown (call again with ``op_id=err.op_id``: the groups the
    first call took). One round trip (two with declared keys).
    """
    validate_id("task", task)
    got = yield from take_many(
        ctx, {task: n}, owner=owner, current_version=current_version, policy=policy,
        max_staleness=max_staleness, at_most=at_most, per_member=per_member, op_id=op_id,
    )
    return Taken(got.tasks[task], got.expired, got.released, None if got.ready is None else got.ready[task])


@mutating
def claim_retry(ctx: Context, task: str, n: int, owner: str, *, op_id: str | None = None) -> Op[list[Group]]:
    """Claim up to ``n`` retryable groups of ``task`` (``aborted`` or ``expired``) for a producer.

    Oldest put first across both statuses. Their sessions move from the
    buffer to ``owner`` and the groups leave the buffer, atomically; the
    producer continues the rollouts and puts the groups again. A group
    expired per member comes back with its fresh members in ``sids`` and
    the released ones in ``reroll`` (roll those out again under new session
    ids). Returns the claimed groups (possibly fewer than ``n``, or none;
    ``n=0`` is a no-op without I/O; ``n`` at most 2,000). Raises
    InvalidId/InvalidInput before I/O, OwnerLost, CorruptData (nothing
    claimed), OutcomeUnknown (call again with its ``op_id``: the groups the
    first call claimed). One round trip (two with declared keys and
    something to claim).
    """
    k = ctx.keys
    validate_id("task", task)
    validate_id("owner tag", owner)
    if _n(n) == 0:
        return []
    op = ctx.op(op_id, "claim")
    fixed = (
        k.rb_queue(task, "aborted"),
        k.rb_versions(task, "aborted"),
        k.rb_queue(task, "expired"),
        k.rb_versions(task, "expired"),
        k.owner(REPLAY_OWNER),
        k.owner(owner),
        k.rb_groups,
        k.rb_sids,
        k.rb_payloads,
        k.rb_bytes,
        op.key,
        k.owners_lost,
        k.stats,
    )
    args = (task, n, owner, REPLAY_OWNER, ctx.op_ttl_ms)
    r = Reply((yield from _with_keys(ctx, "rb_claim", fixed, args, op.id)), "rb_claim")
    r.raw()  # OK
    return sorted(_decode_groups(ctx, r), key=lambda g: g.seq or 0)  # oldest put first


# -- expiry ------------------------------------------------------------------------------------------


def _expire_cells(
    ctx: Context, cells: Sequence[tuple[str, str]], cutoff: str, keep: str, per_member: bool, op: OpId
) -> Op[ExpireReport]:
    """Expire the stale groups of (task, status) queues, up to 1,000 per atomic call.

    Each round calls ``rb_expire`` once per cell that may have more, all
    pipelined in one round trip (with declared keys, one call after the
    other), then purges the released sessions in one more. Call ``j`` of a
    cell runs under its part of ``op`` (a digest of the cell names it, so
    that any task name fits in an op id), so the calls of a retry replay.
    """
    k = ctx.keys
    kept: list[str] = []
    rel_g: list[str] = []
    rel_s: list[str] = []
    pending = list(cells)
    rounds = 0
    while pending:
        calls = []
        for task, status in pending:
            tag = hashlib.blake2b(f"{task} {status}".encode(), digest_size=8).hexdigest()
            part = op.sub(tag, rounds)
            fixed = (
                k.rb_queue(task, status),
                k.rb_versions(task, status),
                k.rb_queue(task, "expired"),
                k.rb_versions(task, "expired"),
                k.owner(REPLAY_OWNER),
                k.released,
                k.events,
                k.rb_groups,
                k.rb_sids,
                k.rb_payloads,
                k.rb_bytes,
                part.key,
                k.stats,
            )
            args = (task, cutoff, keep, EXPIRE_BATCH, REPLAY_OWNER, ctx.op_ttl_ms, int(per_member))
            calls.append((fixed, args, part.id))
        if ctx.config.replay_declared_keys:
            replies = []
            for fixed, args, op_id in calls:
                replies.append((yield from _with_keys(ctx, "rb_expire", fixed, args, op_id)))
        else:
            replies = yield Batch(tuple(_keyed_eval(ctx, "rb_expire", *call) for call in calls))
        more: list[tuple[str, str]] = []
        released: list[str] = []
        for cell, reply in zip(pending, replies, strict=True):
            r = Reply(reply, "rb_expire")
            r.raw()  # OK
            if r.flag():
                more.append(cell)
            kept += r.counted()
            rel_g += r.counted()
            released += r.counted()
        yield from purge_sessions(ctx, released)
        rel_s += released
        pending = more
        rounds += 1
    return ExpireReport(tuple(kept), tuple(rel_g), tuple(rel_s))


@mutating
def expire(
    ctx: Context,
    current_version: int,
    max_staleness: int,
    *,
    retryable: bool | None = None,
    task: str | None = None,
    statuses: Sequence[str] = EXPIRABLE_STATUSES,
    per_member: bool = False,
    op_id: str | None = None,
) -> Op[ExpireReport]:
    """Expire every stored group with ``current_version - min_version > max_staleness``.

    ``statuses``: which groups (default completed and aborted, as XTuner's
    refresh). A range query on each task's version index, O(log n + k) for
    k expired groups, in atomic calls of up to 1,000 groups; never a scan of
    the buffer. ``retryable``: None uses each group's own flag; True keeps
    every expired group (status ``expired``, sessions stay with the buffer,
    claimable with :func:`claim_retry`); False releases them all (one event
    per session, data purged). ``per_member``: a kept group (not agentic)
    keeps only its fresh members; the members whose oldest version is
    stale are released (one event each) and listed in its ``reroll``. The
    order of the remaining groups is unchanged. ``task``: only this task
    (default: every task).

    Raises InvalidId/InvalidInput before I/O, CorruptData (that call wrote
    nothing), OutcomeUnknown (call again with its ``op_id``: each atomic
    call of the first one replays). Round trips: the task list
    (without ``task``), then one per 1,000 groups of the largest cell (the
    calls of every task and status are pipelined; with declared keys they
    run one after the other, two round trips each), plus the purge.
    """
    cutoff = _cutoff(current_version, max_staleness)
    if retryable is not None and not isinstance(retryable, bool):
        raise InvalidInput("retryable", f"must be None or a bool, got {retryable!r}")
    if isinstance(statuses, str):
        statuses = (statuses,)
    sts = [_status(s, EXPIRABLE_STATUSES) for s in statuses]
    _flag("per_member", per_member)
    keep = "" if retryable is None else str(int(retryable))
    tasks = yield from _tasks(ctx, task)
    cells = [(t, s) for t in tasks for s in sts]
    return (yield from _expire_cells(ctx, cells, cutoff, keep, per_member, ctx.op(op_id, "expire")))


# -- reads -------------------------------------------------------------------------------------------


def _tasks(ctx: Context, task: str | None) -> Op[list[str]]:
    if task is not None:
        return [validate_id("task", task)]
    members = yield Cmd(("SMEMBERS", ctx.keys.rb_tasks), key=ctx.keys.rb_tasks)
    return sorted(text(m) for m in members)


def ready_many(
    ctx: Context,
    wants: Mapping[str, int],
    *,
    current_version: int | None = None,
    max_staleness: int | None = None,
) -> Op[bool]:
    """True when every task has at least ``wants[task]`` ready completed groups (read only).

    Ready: not stale at ``max_staleness`` (any completed group without it).
    A ``take_many`` with the same arguments would then succeed, unless
    another learner takes first. Raises InvalidId/InvalidInput before I/O.
    One round trip (none for an empty ``wants``).
    """
    if not isinstance(wants, Mapping):
        raise InvalidInput("wants", f"must be a mapping task -> n, got {type(wants).__name__}")
    asked = {validate_id("task", t): int_in("n", n, 0, 2**31) for t, n in wants.items()}
    cutoff = _cutoff(current_version, max_staleness)
    tasks = [t for t, n in asked.items() if n > 0]
    if not tasks:
        return True
    k = ctx.keys
    cmds = []
    for t in tasks:
        v = k.rb_versions(t, "completed")
        cmds.append(Cmd(("ZCOUNT", v, cutoff or "-inf", "+inf"), key=v))
    counts = yield Batch(tuple(cmds))
    return all(int(c) >= asked[t] for t, c in zip(tasks, counts, strict=True))


def ready(
    ctx: Context,
    task: str,
    n: int,
    *,
    current_version: int | None = None,
    max_staleness: int | None = None,
) -> Op[bool]:
    """True when ``task`` has at least ``n`` ready completed groups (see :func:`ready_many`)."""
    return (
        yield from ready_many(
            ctx, {validate_id("task", task): n}, current_version=current_version,
            max_staleness=max_staleness,
        )
    )


def count(ctx: Context, task: str | None = None, status: str | None = None) -> Op[int]:
    """Stored groups of ``task`` (default all) with ``status`` (default any stored status).

    Raises InvalidId/InvalidInput before I/O. One round trip (two without ``task``).
    """
    statuses = [_status(status, STORED_STATUSES)] if status is not None else list(STORED_STATUSES)
    tasks = yield from _tasks(ctx, task)
    if not tasks:
        return 0
    k = ctx.keys
    cmds = [Cmd(("ZCARD", k.rb_queue(t, s)), key=k.rb_queue(t, s)) for t in tasks for s in statuses]
    replies = yield Batch(tuple(cmds))
    return sum(int(r) for r in replies)


def stats(ctx: Context, task: str | None = None) -> Op[list[StatusStats]]:
    """Per (task, stored status): groups, oldest min_version, bytes of group records.

    Two round trips (three without ``task``); O(tasks), not O(groups).
    """
    k = ctx.keys
    tasks = yield from _tasks(ctx, task)
    if not tasks:
        return []
    cells = [(t, s) for t in tasks for s in STORED_STATUSES]
    cmds: list[Cmd] = []
    for t, s in cells:
        cmds.append(Cmd(("ZCARD", k.rb_queue(t, s)), key=k.rb_queue(t, s)))
        cmds.append(Cmd(("ZRANGE", k.rb_versions(t, s), 0, 0, "WITHSCORES"), key=k.rb_versions(t, s)))
    cmds.append(Cmd(("HGETALL", k.rb_bytes), key=k.rb_bytes))
    replies = yield Batch(tuple(cmds))
    with stored(k.rb_bytes):
        nbytes = {f: int(v) for f, v in field_map(replies[-1]).items()}
    out = []
    for j, (t, s) in enumerate(cells):
        n = int(replies[2 * j])
        head = pairs(replies[2 * j + 1])
        oldest = math.floor(float(head[0][1])) if head else None
        out.append(StatusStats(t, s, n, oldest, nbytes.get(f"{s} {t}", 0)))
    return out


def groups(ctx: Context, task: str, status: str = "completed") -> Op[list[Group]]:
    """Every stored group of ``task`` with ``status``, in FIFO order (inspection, checkpoint).

    O(groups): reads the queue, then the groups' records in one pipelined round trip.
    """
    k = ctx.keys
    validate_id("task", task)
    _status(status, STORED_STATUSES)
    q = k.rb_queue(task, status)
    members = yield Cmd(("ZRANGE", q, 0, -1), key=q)
    return (yield from read_groups(ctx, [text(m) for m in members]))


class ReplayMethods:
    """The replay buffer's methods, listed once for :class:`Replay` and :class:`AsyncReplay`."""

    put = op(put)
    put_many = op(put_many)
    take = op(take)
    take_many = op(take_many)
    ready = op(ready)
    ready_many = op(ready_many)
    claim_retry = op(claim_retry)
    expire = op(expire)
    count = op(count)
    stats = op(stats)
    groups = op(groups)


class Replay(ReplayMethods, SyncPart[Context]):
    """The replay buffer of a run (``store.replay``); see the module docstring."""


class AsyncReplay(ReplayMethods, AsyncPart[Context]):
    """asyncio counterpart of :class:`Replay` (``AsyncTraceStore.replay``); same methods, as coroutines."""
