"""Items of Responses-API responses, kept with their session: what ``previous_response_id`` resolves.

The gateway's ``POST /v1/responses`` (docs/design.md section 17) keeps, for each
response it answers in a session, the response's new input and its output as
canonical messages and the id of the response it continued, in the session's
data slot (``ts:{R/sid}:resp``, one field per response id). A later request
naming the response as ``previous_response_id`` reads the hash and walks the
chain back, on any gateway of the run. The hash is a data key of the session:
releasing the session deletes it with the trace, and a write after the purge
fails with SessionReleased.

Value layout: a JSON object ``{"prev": <id or null>, "items": [<message>...]}``
(nothing pickled; a value that does not decode is CorruptData).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ..context import Context
from ..errors import CorruptData
from ..scripts import Cmd, Eval, Op, script
from ..validate import validate_id


def keep_response(ctx: Context, sid: str, response_id: str, prev: str | None, items: Sequence[dict[str, Any]]) -> Op[None]:
    """Keep the items of response ``response_id`` of ``sid`` (after ``prev``, None for a first one).

    Raises InvalidId before I/O; SessionReleased when the session's data was
    purged. Idempotent (a retry writes the same value). One round trip.
    """
    validate_id("session id", sid)
    validate_id("response id", response_id)
    if prev is not None:
        validate_id("response id", prev)
    value = orjson.dumps({"prev": prev, "items": list(items)})
    k = ctx.keys
    reply = yield Eval(script("response_keep"), (k.resp(sid), k.dead(sid)), (sid, response_id, value))
    del reply  # {0}: the status was the whole reply
    return None


def read_responses(ctx: Context, sid: str) -> Op[dict[str, tuple[str | None, list[dict[str, Any]]]]]:
    """Every kept response of ``sid``: id -> (previous id, items). One round trip; CorruptData on
    a value that does not decode."""
    validate_id("session id", sid)
    key = ctx.keys.resp(sid)
    raw = yield Cmd(("HGETALL", key), key=key)
    out: dict[str, tuple[str | None, list[dict[str, Any]]]] = {}
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
    for f, v in pairs:
        name = f.decode() if isinstance(f, bytes) else str(f)
        try:
            obj = orjson.loads(v)
            prev, items = obj["prev"], obj["items"]
            if not (prev is None or isinstance(prev, str)) or not isinstance(items, list):
                raise ValueError("unknown layout")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptData(key, f"kept response items do not decode ({exc})", name) from None
        out[name] = (prev, items)
    return out


def chain(responses: dict[str, tuple[str | None, list[dict[str, Any]]]], last: str) -> list[dict[str, Any]] | None:
    """The messages of the conversation ending with response ``last`` (oldest first), or None
    when ``last`` (or one it continued) is not among ``responses``."""
    parts: list[list[dict[str, Any]]] = []
    seen: set[str] = set()
    at: str | None = last
    while at is not None:
        if at in seen or at not in responses:
            return None
        seen.add(at)
        at, items = responses[at]
        parts.append(items)
    return [m for part in reversed(parts) for m in part]


__all__ = ["chain", "keep_response", "read_responses"]
