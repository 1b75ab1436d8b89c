"""``previous_response_id``: Responses-API conversations kept in the store, with their session.

A response answered in a session gets the id ``resp_<24 hex>_<session id>``:
the id names its session, so a request that continues it needs no session
header and may reach any gateway of the run. Once the turn is recorded (before
the client sees the end of the answer) the response's new input and its
output, as canonical messages, are kept under that id in the session's data
slot (:mod:`tracestore.traces.responses`, ``ts:{R/sid}:resp``) unless the
request said ``store: false``. A request naming ``previous_response_id``
continues that conversation: its messages are ``instructions`` (a request's
own; the previous ones do not carry over, as in OpenAI's API), the messages of
the chain, then its own input, so the turn extends the same trie path as the
same conversation sent whole. The kept items live as long as the session:
releasing it deletes them with the trace. A response answered without a session
(a plain proxy turn) is kept nowhere; its id is ``resp_<24 hex>``.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import InvalidId, SessionReleased
from ..keys import validate_id
from ..store import AsyncTraceStore
from ..traces import chain
from .chat import Answer, ApiError, ChatRequest, Message, as_str, invalid, opt_bool
from .responses import instructions

_HEX = 24
_HEAD = "resp_"


def new_response_id(sid: str | None) -> str:
    """A fresh response id naming ``sid`` (None: answered without a session)."""
    tail = secrets.token_hex(_HEX // 2)
    return f"{_HEAD}{tail}" if sid is None else f"{_HEAD}{tail}_{sid}"


def session_of(response_id: str) -> str | None:
    """The session a response id names (None for an id answered without one); a 400 for
    a string that is no response id of this gateway."""
    head = len(_HEAD) + _HEX
    ok = response_id.startswith(_HEAD) and all(c in "0123456789abcdef" for c in response_id[len(_HEAD) : head])
    if not ok or len(response_id) < head:
        raise invalid(f"previous_response_id {response_id!r} is not a response id of this gateway", "previous_response_id")
    if len(response_id) == head:
        return None
    if response_id[head] != "_" or len(response_id) == head + 1:
        raise invalid(f"previous_response_id {response_id!r} is not a response id of this gateway", "previous_response_id")
    return response_id[head + 1 :]


async def resolve(
    store: AsyncTraceStore,
    db: Callable[[Awaitable[Any]], Awaitable[Any]],
    body: dict[str, Any],
    req: ChatRequest,
    sid: str | None,
) -> tuple[ChatRequest, str | None]:
    """The request's whole conversation and session (module docstring): ``previous_response_id``
    resolved from the store, ``instructions`` first, the hook that keeps the items set.

    ApiError: 400 for an id that is not one or names another session than the request,
    404 for a response that was not kept (``store: false``, no session, released, unknown).
    """
    prev = body.get("previous_response_id")
    new_input: list[Message] = list(req.messages)
    history: list[Message] = []
    if prev is not None:
        prev = as_str(prev, "previous_response_id")
        owner_sid = session_of(prev)
        if owner_sid is None:
            raise ApiError(
                "not_found", f"response {prev!r} was answered without a session: nothing of it was kept",
                param="previous_response_id", code="previous_response_not_found",
            )
        try:
            validate_id("session id", owner_sid)
        except InvalidId:
            raise invalid(f"previous_response_id {prev!r} is not a response id of this gateway", "previous_response_id") from None
        if sid is not None and sid != owner_sid:
            raise invalid(
                f"previous_response_id belongs to session {owner_sid!r}, the request names session {sid!r}",
                "previous_response_id",
            )
        sid = owner_sid
        try:
            kept = await db(store.read_responses(sid))
        except SessionReleased:
            kept = {}
        found = chain(kept, prev)
        if found is None:
            raise ApiError(
                "not_found",
                f"response {prev!r} is not kept (sent with store: false, or its session was released)",
                param="previous_response_id", code="previous_response_not_found",
            )
        history = found
    req.messages = [*instructions(body), *history, *new_input]
    if not req.messages or all(m["role"] == "system" for m in req.messages):
        raise invalid("input must hold a message", "input")
    req.previous_response_id = prev
    req.response_store = body.get("store") is None or opt_bool(body, "store")
    req.response_id = new_response_id(sid)
    if sid is not None and req.response_store:
        rid, session = req.response_id, sid

        async def keep(answer: Answer) -> None:
            await db(store.keep_response(session, rid, prev, [*new_input, answer.message()]))

        req.on_recorded = keep
    return req, sid


__all__ = ["new_response_id", "resolve", "session_of"]
