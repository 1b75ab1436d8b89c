"""Read-only views of the buffer: ``ready``, ``ready_many``, ``count``, ``stats``, ``groups``."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..context import Context
from ..errors import InvalidInput
from ..replies import field_map, pairs, stored, text
from ..scripts import Batch, Cmd, Op
from ..validate import int_in, validate_id
from ._common import _cutoff, _status, read_groups
from .types import STORED_STATUSES, Group, StatusStats

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
            ctx,
            {validate_id("task", task): n},
            current_version=current_version,
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
        cmds.append(
            Cmd(("ZRANGE", k.rb_versions(t, s), 0, 0, "WITHSCORES"), key=k.rb_versions(t, s))
        )
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
