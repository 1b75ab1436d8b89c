"""What the request routes share apart from the turn itself: the session and owner a request names,
and the body of ``GET /v1/sessions/{sid}/trace``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..errors import InvalidId
from ..keys import validate_id
from .chat import invalid


def session_and_owner(request: web.Request, body: dict[str, Any], default_owner: str) -> tuple[str | None, str]:
    """The session id (``session_id`` in the body or the ``X-Session-Id`` header; None: a plain proxy
    turn) and the owner (``X-Tracestore-Owner``, else ``default_owner``). Raises a 400 ApiError naming
    the field for a bad id, or for a body and header that name different sessions."""
    sid = body.get("session_id")
    header_sid = request.headers.get("X-Session-Id")
    if sid is not None and header_sid is not None and sid != header_sid:
        raise invalid("session_id in the body and X-Session-Id differ", "session_id")
    sid = sid if sid is not None else header_sid
    owner = request.headers.get("X-Tracestore-Owner", default_owner)
    try:
        if sid is not None:
            validate_id("session id", sid)
        validate_id("owner", owner)
    except InvalidId as exc:
        raise invalid(str(exc), "session_id" if exc.kind == "session id" else "X-Tracestore-Owner") from None
    return sid, owner


def trace_body(sid: str, tr: Any) -> dict[str, Any]:
    """The JSON of a session's training trace (``tr``: a :class:`~tracestore.Trace`)."""
    return {
        "session_id": sid,
        "input_ids": tr.input_ids,
        "labels": tr.labels,
        "logprobs": tr.logprobs,
        "versions": tr.versions,
        "expert_keys": tr.expert_keys,
    }


__all__ = ["session_and_owner", "trace_body"]
