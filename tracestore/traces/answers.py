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

The gateway keeps it in the same write as the turn (``record_turn(...,
answer=KeptAnswer(...))``, one round trip); :func:`keep_answer` keeps one on
its own.

Nothing is pickled: the value is JSON (``{"v": 1, ...}``); one that does not
decode raises CorruptData.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class KeptAnswer:
    """An answer record to keep with the turn ``record_turn`` writes (its ``answer=``): the retry
    ``digest`` (32 hex), the JSON object ``record``, and how long the session's answers are kept
    after the last one (``ttl_s``)."""

    digest: str
    record: dict[str, Any]
    ttl_s: float = 600.0

    def args(self) -> tuple[str, int, bytes]:
        """``(field, ttl ms, value)`` for the scripts; InvalidInput before any I/O."""
        field = _field(self.digest)
        if not isinstance(self.record, dict):
            raise InvalidInput("record", "an answer record is a JSON object")
        try:
            value = orjson.dumps({"v": 1, **self.record})
        except TypeError as exc:
            raise InvalidInput("record", f"an answer record is a JSON object: {exc}") from None
        return field, duration_ms("ttl_s", self.ttl_s), value


def keep_answer(ctx: Context, sid: str, digest: str, record: dict[str, Any], *, ttl_s: float = 600.0) -> Op[None]:
    """Keep ``record`` (a JSON object) as the answer of the turn whose retry digest is ``digest``.

    Raises InvalidId/InvalidInput before I/O; SessionReleased when the
    session's data was purged. Idempotent. One round trip.
    """
    validate_id("session id", sid)
    field, ttl_ms, value = KeptAnswer(digest, record, ttl_s).args()
    k = ctx.keys
    reply = yield Eval(script("session_field_keep"), (k.ans(sid), k.dead(sid)), (sid, field, ttl_ms, value))
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


__all__ = ["KeptAnswer", "keep_answer", "read_answer"]
