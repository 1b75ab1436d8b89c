"""Reading a request body: its size limit, its ``Content-Encoding``, JSON; every failure a 4xx.

The server does not decode bodies itself (``serve.start_site`` turns aiohttp's
decompression off): an encoding it does not take, or a body that is not what
its header says, must be a 400 in the caller's shape, not aiohttp's plain-text
error page or a 500.
"""

from __future__ import annotations

import zlib
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from .chat import ApiError, invalid


async def read_body(request: web.Request, limit: int) -> dict[str, Any]:
    """The request's JSON object body. ApiError: 413 over ``limit`` bytes (before or after
    decoding), 400 for an unsupported encoding, a body that does not decode, malformed JSON, not
    an object."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError("too_large", f"request body over the limit of {limit} bytes") from None
    except (RequestPayloadError, aiohttp.ClientPayloadError, ValueError) as exc:
        raise invalid(f"the body cannot be read: {exc}") from None
    raw = decode_body(raw, request.headers.get("Content-Encoding", ""), limit)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """The body as its ``Content-Encoding`` says (identity, gzip, deflate), at most ``limit`` bytes
    once decoded; a 400 (413 past the limit) for another encoding or a body that does not decode."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return raw
    if enc not in ("gzip", "x-gzip", "deflate"):
        raise invalid(f"Content-Encoding {encoding!r} is not supported (send identity, gzip or deflate)")
    d = zlib.decompressobj(wbits=31 if enc != "deflate" else 15)
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise invalid(f"the body is not {enc} as its Content-Encoding says: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError("too_large", f"request body over the limit of {limit} bytes once decoded")
    return out


__all__ = ["decode_body", "read_body"]
