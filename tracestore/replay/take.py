"""``take`` / ``take_many`` / ``claim_retry``: hand groups to a learner in one atomic call per slot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..context import Context, mutating
from ..errors import InvalidInput, ScriptError
from ..purge import purge_sessions
from ..replies import Reply
from ..scripts import Op
from ..validate import validate_id
from ._common import _cutoff, _decode_groups, _flag, _n, _with_keys
from .expire import _expire_cells
from .layout import task_keys
from .policies import policy as take_policy
from .types import MAX_ROUNDS, MAX_STALE_IN_TAKE, MAX_TAKE, REPLAY_OWNER, Group, Taken, TakenMany

#: The cells of each task that ``rb_take`` reads (its header's ``-- CELLS:`` line).
_TAKE_CELLS = ("completed", "expired")
#: The cells of the task that ``rb_claim`` reads (its header's ``-- CELLS:`` line).
_CLAIM_CELLS = ("aborted", "expired")

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
    groups, no group is taken (the result is empty and ``ready`` says how
    many each task had). ``at_most``: take up to ``n`` of each instead
    (never short). With ``max_staleness``, each task's stale groups
    (``current_version - min_version > max_staleness``) are expired first,
    in the same script, whether or not the take then finds enough ready
    groups (a short take expires them too, so a stale group never stays
    counted as completed): retryable ones move to ``expired`` and keep
    their sessions (with ``per_member``, only their fresh members; agentic
    groups whole), the others are released (one event per session, data
    purged); ``expired`` and ``released`` of the result list them. The one
    exception to atomicity is a backlog of more than 2,048 stale groups,
    expired by separate calls first. Groups leave in ``policy``
    order (:data:`~tracestore.replay.policies.POLICIES`: ``fifo``, put
    order; ``staleness``, oldest ``min_version`` first, then put order;
    ``priority``, ``payload["priority"]`` highest first, then put order,
    the groups without one after those with one) and their sessions move
    to ``owner``. A task with n=0,
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
        raise InvalidInput(
            "n", f"{sum(asked.values())} groups in one take; at most {MAX_TAKE} per call"
        )
    validate_id("owner tag", owner)
    take_policy(policy)
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
        fixed += task_keys(k, t, _TAKE_CELLS)
    args: tuple[Any, ...] = (
        cutoff,
        policy,
        owner,
        REPLAY_OWNER,
        ctx.op_ttl_ms,
        MAX_STALE_IN_TAKE,
        int(at_most),
        int(per_member),
        len(tasks),
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
        if tag == "SHORT":  # nothing taken; the stale groups were expired all the same
            expired += r.counted()
            rel = r.counted()
            ready = dict.fromkeys(asked, 0)
            for t, n in zip(tasks, [r.int() for _ in range(r.int())], strict=True):
                ready[t] = n
            yield from purge_sessions(ctx, rel)
            released += rel
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

    All or nothing: with fewer than ``n`` ready groups nothing is taken
    (the result is empty and falsy, ``ready`` says how many were ready; it
    is a :class:`Taken`, not a list, so test it with ``if not taken``), but
    the stale groups are expired all the same (``expired``, ``released``). ``at_most``: up to ``n``. ``n=0`` is a no-op
    without I/O. Otherwise as :func:`take_many` (expiry first, policy order,
    sessions to ``owner``); ``n`` is at most 2,000 (:data:`MAX_TAKE`).
    Raises InvalidId/InvalidInput before I/O, OwnerLost, CorruptData,
    OutcomeUnknown (call again with ``op_id=err.op_id``: the groups the
    first call took). One round trip (two with declared keys).
    """
    validate_id("task", task)
    got = yield from take_many(
        ctx,
        {task: n},
        owner=owner,
        current_version=current_version,
        policy=policy,
        max_staleness=max_staleness,
        at_most=at_most,
        per_member=per_member,
        op_id=op_id,
    )
    return Taken(
        got.tasks[task], got.expired, got.released, None if got.ready is None else got.ready[task]
    )


@mutating
def claim_retry(
    ctx: Context, task: str, n: int, owner: str, *, op_id: str | None = None
) -> Op[list[Group]]:
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
        k.owner(REPLAY_OWNER),
        k.owner(owner),
        k.rb_groups,
        k.rb_sids,
        k.rb_payloads,
        k.rb_bytes,
        op.key,
        k.owners_lost,
        k.stats,
        *task_keys(k, task, _CLAIM_CELLS),
    )
    args = (task, n, owner, REPLAY_OWNER, ctx.op_ttl_ms)
    r = Reply((yield from _with_keys(ctx, "rb_claim", fixed, args, op.id)), "rb_claim")
    r.raw()  # OK
    return sorted(_decode_groups(ctx, r), key=lambda g: g.seq or 0)  # oldest put first
