"""``POST /v1/messages/count_tokens`` (Anthropic): the ids the engine would get for these messages.

The count is the length of the engine input a turn of the same request would
send: in a session (``X-Session-Id`` or ``session_id``) the prompt mode's
``prepare`` (in tito mode the stored path's ids and the new messages'
rendering; nothing is written), without one the whole conversation through
the chat template. Errors are in Anthropic's shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import InvalidId, SessionReleased, TracestoreError
from ..keys import validate_id
from ..store import AsyncTraceStore
from . import anthropic
from .body import read_body
from .chat import ApiError, invalid
from .prompts import PromptMode


async def count_tokens(
    request: web.Request,
    store: AsyncTraceStore,
    prompts: PromptMode,
    model: str,
    max_body_bytes: int,
    db: Callable[[Awaitable[Any]], Awaitable[Any]],
) -> dict[str, Any]:
    """``{"input_tokens": n}`` of the request (module docstring); ApiError when it is not valid."""
    body = await read_body(request, max_body_bytes)
    req = anthropic.parse({**body, "max_tokens": 1}, 1)
    if req.model != model:
        raise ApiError("not_found", f"model {req.model!r} is not served here; GET /v1/models lists {model!r}", param="model")
    sid = body.get("session_id", request.headers.get("X-Session-Id"))
    if sid is None:
        return {"input_tokens": len(prompts.plain(req))}
    try:
        prep = await db(store.run(prompts.prepare(validate_id("session id", sid), req)))
    except InvalidId as exc:
        raise invalid(str(exc), "session_id") from None
    except SessionReleased as exc:
        raise ApiError("gone", str(exc)) from None
    except TracestoreError as exc:
        raise ApiError("unavailable", f"{type(exc).__name__}: {exc}", retry_after_s=1.0) from None
    return {"input_tokens": len(prep.input_ids)}


__all__ = ["count_tokens"]
