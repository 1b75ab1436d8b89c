"""Answers of recorded turns, kept a while so that a retried request is answered, not generated again.

A client that retries a turn (same session, same prompt, same sampling
options: the SDKs' retry after a timeout or a lost reply) must get the turn
that was recorded, not a second generation beside it. The gateway keeps, per
recorded turn, a small JSON record in the session's data slot
(``ts:{R/sid}:ans``, one field per turn named by the turn's *retry digest*,
see :mod:`tracestore.gateway.retries`): the answer's text, reasoning, tool
calls with their ids, finish reason, the rest of the response key, the number
of generated tokens and the engine request id. The token ids, logprobs and
versions stay where they are, in the trace (read back with
``export_training_trace``). The hash expires ``ttl_s`` after the last answer
kept in it and goes with the session's data when that is purged.

Nothing is pickled: the value is JSON (``{"v": 1, ...}``); one that does not
decode raises CorruptData.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..context import Context
from ..errors import CorruptData, InvalidInput
from ..scripts import Cmd, Eval, Op, script
from ..validate import duration_ms, validate_id

_DIGEST = re.compile(r"[0-9a-f]{32}")


def _field(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InvalidInput("digest", f"a retry digest is 32 lowercase hex characters, got {digest!r}")
    return digest


def keep_answer(ctx: Context, sid: str, digest: str, record: dict[str, Any], *, ttl_s: float = 600.0) -> Op[None]:
    """Keep ``record`` (a JSON object) as the answer of the turn whose retry digest is ``digest``.

    Raises InvalidId/InvalidInput before I/O; SessionReleased when the
    session's data was purged. Idempotent. One round trip.
    """
    validate_id("session id", sid)
    field = _field(digest)
    if not isinstance(record, dict):
        raise InvalidInput("record", "an answer record is a JSON object")
    value = orjson.dumps({"v": 1, **record})
    k = ctx.keys
    reply = yield Eval(script("session_field_keep"), (k.ans(sid), k.dead(sid)), (sid, field, duration_ms("ttl_s", ttl_s), value))
    del reply  # {}: the status was the whole reply
    return None


def read_answer(ctx: Context, sid: str, digest: str) -> Op[dict[str, Any] | None]:
    """The answer record kept for retry digest ``digest`` (None: none, or expired). One round trip.
    Raises CorruptData on a value that does not decode."""
    validate_id("session id", sid)
    field = _field(digest)
    k = ctx.keys
    raw = yield Cmd(("HGET", k.ans(sid), field), key=k.ans(sid))
    if raw is None:
        return None
    try:
        rec = orjson.loads(bytes(raw))
    except orjson.JSONDecodeError:
        rec = None
    if not isinstance(rec, dict) or rec.get("v") != 1:
        raise CorruptData(k.ans(sid), "the kept answer does not decode", field)
    return rec


__all__ = ["keep_answer", "read_answer"]
