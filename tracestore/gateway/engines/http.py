"""HTTP helpers shared by the engine adapters: a POST that maps connection failures, JSON replies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from .base import EngineLost, EngineRefused, EngineRejected
from .wire import EngineHTTP, NoConnection, Reply


class post:
    """``async with post(session, url, path, body, timeout, wire) as resp``: a JSON POST whose
    failures are :class:`EngineRefused` (no connection was made) or :class:`EngineLost` (no reply).

    With ``wire`` (the engine's :class:`~.wire.EngineHTTP`, for ``http://`` engines) the call goes
    on its keep-alive connections; without, on the aiohttp ``session``. Both answer and fail alike.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        path: str,
        body: bytes,
        timeout: aiohttp.ClientTimeout,
        wire: EngineHTTP | None = None,
    ) -> None:
        self.session, self.url, self.path, self.body, self.timeout = session, url, path, body, timeout
        self.wire = wire
        self.resp: Any = None  # aiohttp.ClientResponse or wire.Reply

    async def __aenter__(self) -> Any:
        if self.wire is not None:
            try:
                self.resp = await self.wire.post(self.path, self.body, self.timeout)
            except NoConnection as exc:  # refused, unreachable: the engine took no request
                raise EngineRefused(self.url, f"cannot connect: {exc}") from exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineLost(self.url, f"no reply: {exc!r}") from exc
            return self.resp
        try:
            self.resp = await self.session.post(
                self.url + self.path,
                data=self.body,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            )
        except aiohttp.ClientConnectorError as exc:
            raise EngineRefused(self.url, f"cannot connect: {exc.os_error or exc}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineLost(self.url, f"no reply: {exc!r}") from exc
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()

    def close(self) -> None:
        """Close the request's connection now (vLLM aborts a request whose client left)."""
        if self.resp is not None:
            self.resp.close()


async def probe(session: aiohttp.ClientSession, url: str, path: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``GET url + path`` as a JSON object. Raises EngineRefused / EngineLost / EngineRejected."""
    try:
        async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise EngineRejected(url, resp.status, detail(raw))
    except aiohttp.ClientConnectorError as exc:
        raise EngineRefused(url, f"cannot connect: {exc.os_error or exc}") from exc
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise EngineLost(url, f"no reply to GET {path}: {exc!r}") from exc
    return json_object(url, raw)


async def gone(session: aiohttp.ClientSession, url: str, recheck_s: float = 0.2) -> bool:
    """True when ``url`` refuses connections, twice ``recheck_s`` apart: a process that listens no
    more runs no request (anything that answers, even with an error, is not gone)."""
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(recheck_s)
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return False
        except aiohttp.ClientConnectorError:
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
    return True


def json_object(url: str, raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object; EngineLost when it is not one (a broken engine reply)."""
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EngineLost(url, f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(out, dict):
        raise EngineLost(url, "reply is not a JSON object")
    return out


def detail(raw: bytes) -> str:
    """The message of an engine's error reply (OpenAI/SGLang shapes, or the raw text)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(body.get("message") or err or body)
    return str(body)


async def sse_events(resp: aiohttp.ClientResponse | Reply) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE body, of any length (the first chunk carries the whole
    prompt's ids: longer than aiohttp's line limit for a long context)."""
    partial: list[bytes] = []  # a line's pieces until its newline arrives
    async for piece in resp.content.iter_any():
        if b"\n" not in piece:
            partial.append(piece)
            continue
        *lines, rest = b"".join([*partial, piece]).split(b"\n")
        partial = [rest] if rest else []
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    tail = b"".join(partial)
    if tail.startswith(b"data:"):
        yield tail[5:].strip()


__all__ = ["EngineHTTP", "detail", "gone", "json_object", "post", "probe", "sse_events"]
