"""``expire``: move or release groups that became too stale, in bounded atomic calls."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..context import Context, OpId, mutating
from ..errors import InvalidInput
from ..purge import purge_sessions
from ..replies import Reply
from ..scripts import Batch, Op
from ._common import _cutoff, _flag, _keyed_eval, _status, _with_keys
from .layout import task_keys
from .reads import _tasks
from .types import EXPIRABLE_STATUSES, EXPIRE_BATCH, REPLAY_OWNER, ExpireReport

# -- expiry ------------------------------------------------------------------------------------------


def _expire_cells(
    ctx: Context,
    cells: Sequence[tuple[str, str]],
    cutoff: str,
    keep: str,
    per_member: bool,
    op: OpId,
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
                k.owner(REPLAY_OWNER),
                k.released,
                k.events,
                k.rb_groups,
                k.rb_sids,
                k.rb_payloads,
                k.rb_bytes,
                part.key,
                k.stats,
                *task_keys(k, task, (status, "expired")),
            )
            args = (task, cutoff, keep, EXPIRE_BATCH, REPLAY_OWNER, ctx.op_ttl_ms, int(per_member), status)
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
