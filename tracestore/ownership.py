"""Control plane: session ownership and release (DESIGN section 5).

Every session has exactly one owner tag (``rollout:<worker>``, ``replay``,
``train:<step>``, ``eval:<step>``). The scripts in ``lua/`` change a
session's state, its owner index and the event stream atomically, and replay
their recorded reply when redis-py retries a call whose reply was lost.
"""

from __future__ import annotations

from .context import Context
from .errors import InvalidInput
from .keys import validate_id
from .run import session_states
from .scripts import Eval, Op, new_op_id, script


def open_session(
    ctx: Context, sid: str, owner: str, *, version: int = 0, group: str | None = None
) -> Op[int]:
    """Open session ``sid`` owned by ``owner``; returns the open time (server ms).

    ``version`` is the weight version at open (``born``); ``group`` an optional
    replay group id. Raises InvalidId (before I/O), SessionExists (already
    open), SessionReleased (the id was released: ids are never reused).
    Idempotent under client retries. One round trip.
    """
    k = ctx.keys
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidInput("version", f"must be a non-negative int, got {version!r}")
    if group is not None:
        validate_id("group id", group)
    op = new_op_id()
    reply = yield Eval(
        script("open_session"),
        (k.session(sid), k.owner(owner), k.released, k.op(op)),
        (sid, owner, version, group or "", ctx.config.op_ttl_s * 1000),
    )
    return int(reply[0])


def owner_of(ctx: Context, sid: str) -> Op[str | None]:
    """Current owner of a live session, else None (unknown or released). One round trip."""
    states = yield from session_states(ctx, [sid])
    st = states[sid]
    return st[0] if st is not None and st[1] == "live" else None
