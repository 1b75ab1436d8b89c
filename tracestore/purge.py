"""Release phase 2: purge sessions' data keys, grouped by slot (DESIGN section 5, invariant 4).

The control-plane release script has already made the release final and
appended its event; purging is idempotent, so a crash between the phases
leaves only garbage for ``gc`` to remove, never a live session without data.

A session's purge is two plain commands on its ``{R/sid}`` slot, in this
order: set the tombstone ``ts:{R/sid}:dead`` (from then on ``record_turn``
and ``insert`` fail with SessionReleased, because their scripts check the
tombstone atomically), then ``UNLINK`` :meth:`~tracestore.keys.Keys.data_keys`.
A write that ran before the tombstone is deleted by the UNLINK; none can run
after it. Both commands are idempotent, so no script is needed. Sessions are
grouped by slot: the sessions of one slot share one ``MSET`` and one
``UNLINK``, and a :class:`~tracestore.scripts.Batch` pipelines the groups per
node, one round trip per node for any number of sessions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .context import Context
from .keys import key_slot, validate_ids
from .scripts import Batch, Cmd, Op, chunks, group_by_slot

#: Sessions per MSET/UNLINK pair (a standalone server takes many sessions per command).
PURGE_CHUNK = 1000


def purge_cmds(ctx: Context, sids: Sequence[str], now_ms: int) -> list[Cmd]:
    """Tombstone then unlink the data keys of ``sids`` (validated already), grouped by slot.

    Sessions whose keys share a hash slot share one ``MSET`` of their
    tombstones and one ``UNLINK`` of their data keys (chunks of
    :data:`PURGE_CHUNK`). On a cluster that is usually one pair per session;
    a standalone server has no slots, so a thousand sessions cost two commands.
    """
    k = ctx.keys
    if ctx.cluster:
        groups: list[list[str]] = list(group_by_slot((key_slot(k.dead(s)), s) for s in sids).values())
    else:
        groups = [list(sids)]
    out: list[Cmd] = []
    stamp = str(now_ms)
    for group in groups:
        for part in chunks(group, PURGE_CHUNK):
            deads = k.dead_keys(part)
            mset: list[str] = [stamp] * (2 * len(deads))
            mset[::2] = deads
            out.append(Cmd(("MSET", *mset), key=deads[0]))
            out.append(Cmd(("UNLINK", *k.data_keys_of(part)), key=deads[0]))
    return out


def purge_sessions(ctx: Context, sids: list[str]) -> Op[int]:
    """Purge ``sids`` (validated already); returns the number of data keys deleted.

    One pipelined round trip per node. The tombstone holds the client's clock
    (ms): it is informational, only its existence is checked.
    """
    if not sids:
        return 0
    replies = yield Batch(tuple(purge_cmds(ctx, sids, int(time.time() * 1000))))
    return sum(int(r) for r in replies[1::2])


def drop_sessions_data(ctx: Context, sids: list[str]) -> Op[int]:
    """Delete the data of ``sids`` and tombstone it; returns the number of keys deleted.

    Idempotent. Raises InvalidId before I/O. One pipelined round trip per node.
    """
    sids = validate_ids("session id", sids)
    return (yield from purge_sessions(ctx, sids))


def drop_session_data(ctx: Context, sid: str) -> Op[int]:
    """Delete one session's data keys and tombstone it (see :func:`drop_sessions_data`)."""
    return (yield from drop_sessions_data(ctx, [sid]))
