"""Release phase 2: purge sessions' data keys, grouped by slot (DESIGN section 5, invariant 4).

The control-plane release script has already made the release final and
appended its event; purging is idempotent, so a crash between the phases
leaves only garbage for ``gc`` to remove, never a live session without data.

Each session's purge is two plain commands on its own ``{R/sid}`` slot, in
this order: ``SET ts:{R/sid}:dead <ms>`` (from then on ``record_turn`` and
``insert`` fail with SessionReleased, because their scripts check the
tombstone atomically), then ``UNLINK`` of :meth:`~tracestore.keys.Keys.data_keys`
(which frees the memory off the main thread). A write that ran before the
tombstone is deleted by the UNLINK; none can run after it. Both commands are
idempotent, so no script (and no per-call script overhead) is needed; a
:class:`~tracestore.scripts.Batch` pipelines them per node, one round trip per
node for any number of sessions.
"""

from __future__ import annotations

import time

from .context import Context
from .keys import validate_ids
from .scripts import Batch, Cmd, Op, ServerTime


def purge_cmds(ctx: Context, sids: list[str], now_ms: int) -> list[Cmd]:
    """Tombstone then unlink the data keys of each of ``sids`` (``sids`` validated already)."""
    k = ctx.keys
    out: list[Cmd] = []
    for s in sids:
        dead = k.dead(s)
        out.append(Cmd(("SET", dead, now_ms), key=dead))
        out.append(Cmd(("UNLINK", *k.data_keys(s)), key=dead))
    return out


def purge_evals(ctx: Context, sids: list[str]) -> list[Cmd]:
    """:func:`purge_cmds` stamped with the client clock, for a caller already inside a Batch.

    (The name is kept for callers written when each purge was a script; the
    tombstone's value is informational, only its existence is checked.)
    """
    return purge_cmds(ctx, list(sids), int(time.time() * 1000))


def purge_sessions(ctx: Context, sids: list[str]) -> Op[int]:
    """Purge ``sids`` (validated already); returns the number of data keys deleted.

    Two round trips: the server clock (the tombstone's value), then the
    pipelined commands.
    """
    if not sids:
        return 0
    now = yield ServerTime(ctx.keys.meta)
    replies = yield Batch(tuple(purge_cmds(ctx, sids, now)))
    return sum(int(r) for r in replies[1::2])


def drop_sessions_data(ctx: Context, sids: list[str]) -> Op[int]:
    """Delete the data of ``sids`` and tombstone it; returns the number of keys deleted.

    Idempotent. Raises InvalidId before I/O. Two round trips (server clock,
    then one pipeline per node).
    """
    sids = validate_ids("session id", sids)
    return (yield from purge_sessions(ctx, sids))


def drop_session_data(ctx: Context, sid: str) -> Op[int]:
    """Delete one session's data keys and tombstone it (see :func:`drop_sessions_data`)."""
    return (yield from drop_sessions_data(ctx, [sid]))
