"""``put`` / ``put_many``: store finished groups, each member's oldest version read from its traces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from .. import validate
from ..context import Context, OpId, mutating
from ..errors import InvalidInput
from ..purge import purge_sessions
from ..replies import Reply
from ..scripts import Batch, Cmd, Eval, Op, gather, script
from ..validate import int_in
from ._common import _check_group, _Checked, _cutoff, _flag
from .layout import priority_score, task_keys
from .types import MAX_VERSION, REPLAY_OWNER, Group, PutResult

# -- put ---------------------------------------------------------------------------------------------


def _version_reads(ctx: Context, sids: Sequence[str]) -> list[Eval | Cmd]:
    """One read-only ``trace_versions`` call per session (validated already), on its data slot."""
    k = ctx.keys
    sc = script("trace_versions")
    return [Eval(sc, (k.idx(s), k.dead(s))) for s in sids]


def _group_versions(
    ctx: Context, c: _Checked, current_version: int | None
) -> Op[tuple[int, list[int | None]]]:
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
        raise InvalidInput(
            "min_version", f"{minv} is above the replay buffer's bound {MAX_VERSION}"
        )
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
        ctx,
        group,
        c,
        owner,
        c.min_version,
        mv,
        _cutoff(current_version, max_staleness),
        per_member,
        ctx.op(None, "put"),
    )


def _put_eval(
    ctx: Context,
    group: Group,
    c: _Checked,
    owner: str,
    minv: int,
    mv: Sequence[int],
    cutoff: str,
    per_member: bool,
    op: OpId,
    op_key: str | None = None,
) -> Eval:
    """The ``rb_put`` call of a checked group; its reply recorded at ``op_key`` (default ``op.key``)."""
    k = ctx.keys
    keys = (
        k.rb_groups,
        k.rb_sids,
        k.rb_payloads,
        k.rb_seq,
        k.rb_tasks,
        k.rb_bytes,
        k.owner(owner),
        k.owner(REPLAY_OWNER),
        k.released,
        k.events,
        op.key if op_key is None else op_key,
        k.stats,
        *task_keys(k, c.task, (c.status, "expired")),
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
        priority_score(c.priority),
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

    A payload with a ``priority`` (a finite number: the ``priority`` take
    policy, highest first) also puts the group in its cell's priority index.

    Raises, with nothing written: InvalidId/InvalidInput (before I/O:
    unknown status, payload not a dict or over the size limit,
    ``payload["priority"]`` not a finite number (field
    ``payload.priority``), duplicate or
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
    plans = yield from gather(
        [_put_plan(ctx, g, c, current_version) for g, c in zip(groups, checked, strict=True)]
    )
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
    ctx: Context,
    group: Group,
    c: _Checked,
    owner: str,
    plan: tuple[int, int | None, list[int]],
    cutoff: str,
    per_member: bool,
    op: OpId,
    op_key: str,
) -> Op[PutResult]:
    """Run a planned put (its reply recorded at ``op_key``), then purge the sessions it released."""
    minv, shown, mv = plan
    reply = yield _put_eval(ctx, group, c, owner, minv, mv, cutoff, per_member, op, op_key)
    res = put_result(c.gid, shown, reply)
    if res.released:
        yield from purge_sessions(ctx, list(res.released))
    return res
