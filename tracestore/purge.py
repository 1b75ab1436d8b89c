"""Release phase 2: purge sessions' data keys, grouped by slot (DESIGN section 5, invariant 4).

The control-plane release script has already made the release final and
appended its event; purging is idempotent, so a crash between the phases
leaves only garbage for ``gc`` to remove, never a live session without data.
"""

from __future__ import annotations

from .context import Context
from .keys import validate_ids
from .scripts import Batch, Eval, Op, script


def purge_evals(ctx: Context, sids: list[str]) -> list[Eval]:
    """One ``purge_session`` call per session (each in its own ``{R/sid}`` slot).

    The keys are the tombstone and :meth:`~tracestore.keys.Keys.data_keys`;
    in a :class:`Batch` the calls are pipelined per node, so a release of n
    sessions costs one round trip per node, not n.
    """
    k = ctx.keys
    sc = script("purge_session")
    return [Eval(sc, (k.dead(s), *k.data_keys(s)), (0,)) for s in sids]


def drop_sessions_data(ctx: Context, sids: list[str]) -> Op[int]:
    """Delete the data of ``sids`` and tombstone it; returns the number of keys deleted.

    Idempotent. Raises InvalidId before I/O. One pipelined round trip per
    node (sessions are grouped by the node serving their slot).
    """
    sids = validate_ids("session id", sids)
    if not sids:
        return 0
    replies = yield Batch(tuple(purge_evals(ctx, sids)))
    return sum(int(r[0]) for r in replies)


def drop_session_data(ctx: Context, sid: str) -> Op[int]:
    """Delete one session's data keys and tombstone it (see :func:`drop_sessions_data`)."""
    return (yield from drop_sessions_data(ctx, [sid]))
