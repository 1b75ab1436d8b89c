"""The gateway's client of an inference engine: SGLang's native ``/generate`` protocol.

Token ids in, token ids + log-probabilities (+ routed experts) out::

    POST /generate        {"rid", "input_ids", "sampling_params": {"max_new_tokens",
                           "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                           "ignore_eos", "sampling_seed"}, "return_logprob": true,
                           "return_routed_experts": bool, "stream": bool}
      -> {"output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort",
          "matched": id|str|null}, "prompt_tokens", "completion_tokens",
          "output_token_logprobs": [[logprob, id, null], ...], "weight_version",
          "routed_experts": base64 int32 LE, "routed_experts_shape": [rows, layers, top_k]}}
      (stream: SSE ``data: {...}`` chunks carrying the *new* ids and logprobs
      since the previous chunk, the last one with ``finish_reason``; then
      ``data: [DONE]``)
    POST /abort_request   {"rid"}  (the request ends with finish_reason "abort")
    GET  /health

Routed experts are the rows of every token fed through the model (``prompt +
output - 1`` rows, no dummy row); ``routed_experts_shape`` is an extension of
this project's reference engine, without it the rows are kept flat
(``[rows, layers * top_k]``).

Failures are told apart because they settle the gate lease differently:
:class:`EngineRefused` (the connection was never made: the engine never saw
the request), :class:`EngineLost` (the connection broke or timed out after
the request was sent: its outcome is unknown), :class:`EngineRejected` (the
engine answered with an error status).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


class EngineError(Exception):
    """Base class of engine call failures (``url`` names the engine)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"engine {url}: {message}")
        self.url = url


class EngineRefused(EngineError):
    """The engine could not be reached: it never received the request."""


class EngineLost(EngineError):
    """The connection broke, or timed out, after the request was sent: outcome unknown."""


class EngineRejected(EngineError):
    """The engine answered with an error status (``status``; 4xx means a bad request)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, f"HTTP {status}: {message}")
        self.status = status
        self.detail = message


@dataclass
class Generated:
    """One engine reply (or the sum of a stream's chunks so far)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    weight_version: str | None = None
    routed_experts: str | None = None
    experts_shape: list[int] | None = None

    def add(self, meta: dict[str, Any], ids: list[int]) -> None:
        """Fold one reply or chunk into this result (ids and logprobs are appended)."""
        self.output_ids.extend(int(x) for x in ids)
        self.logprobs.extend(float(x[0]) for x in meta.get("output_token_logprobs") or ())
        fr = meta.get("finish_reason")
        if isinstance(fr, dict):
            self.finish = str(fr.get("type"))
            self.matched = fr.get("matched")
        elif isinstance(fr, str):
            self.finish = fr
        self.prompt_tokens = int(meta.get("prompt_tokens") or self.prompt_tokens)
        if meta.get("weight_version") is not None:
            self.weight_version = str(meta["weight_version"])
        if meta.get("routed_experts") is not None:
            self.routed_experts = meta["routed_experts"]
            self.experts_shape = meta.get("routed_experts_shape")


def decode_experts(b64: str, shape: list[int] | None, rows: int) -> Any:
    """The routed experts of a reply as int32 ``[rows + 1, layers, top_k]`` with a dummy row 0.

    The dummy row makes the layout the one :class:`tracestore.session.TurnRecorder`
    splits (row ``i`` is the routing of token ``i - 1``). Raises ValueError
    when the payload does not hold ``rows`` rows. Needs numpy.
    """
    import base64

    import numpy as np

    flat: Any = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    arr: Any
    if shape is not None and len(shape) >= 2:
        arr = flat.reshape([-1, *shape[1:]])
    elif rows > 0 and flat.size % rows == 0:
        arr = flat.reshape(rows, -1)
    else:
        raise ValueError(f"routed experts: {flat.size} values do not split into {rows} rows")
    if arr.shape[0] != rows:
        raise ValueError(f"routed experts: {arr.shape[0]} rows, expected {rows}")
    return np.concatenate([np.zeros((1, *arr.shape[1:]), dtype=np.int32), arr.astype(np.int32)])


class EngineClient:
    """Calls engines over one shared aiohttp session (keep-alive connections per engine).

    ``timeout_s``: longest a generation may take before the call counts as
    lost. Create inside a running event loop; :meth:`close` when done.
    """

    def __init__(self, timeout_s: float = 600.0, connect_timeout_s: float = 5.0) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )

    async def close(self) -> None:
        """Close the connections."""
        await self.session.close()

    @staticmethod
    def payload(
        rid: str, input_ids: list[int], sampling: dict[str, Any], *, stream: bool, experts: bool
    ) -> bytes:
        """The JSON body of a ``/generate`` call."""
        return orjson.dumps(
            {
                "rid": rid,
                "input_ids": input_ids,
                "sampling_params": sampling,
                "return_logprob": True,
                "return_routed_experts": experts,
                "stream": stream,
            }
        )

    async def generate(self, url: str, body: bytes) -> Generated:
        """One non-streaming ``/generate`` call. Raises EngineRefused/EngineLost/EngineRejected."""
        async with self._post(url, "/generate", body) as resp:
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineLost(url, f"connection lost while reading the reply: {exc!r}") from exc
            if resp.status != 200:
                raise EngineRejected(url, resp.status, _detail(raw))
            reply = _json(url, raw)
            out = Generated()
            out.add(reply.get("meta_info") or {}, reply.get("output_ids") or [])
            if out.finish is None:
                raise EngineLost(url, "reply without finish_reason")
            return out

    async def stream(self, url: str, body: bytes) -> AsyncIterator[tuple[dict[str, Any], list[int]]]:
        """A streaming ``/generate`` call: yields ``(meta_info, new ids)`` per SSE chunk.

        Raises EngineRefused/EngineLost/EngineRejected; EngineLost also when
        the stream ends without a chunk that has a finish reason.
        """
        async with self._post(url, "/generate", body) as resp:
            if resp.status != 200:
                raise EngineRejected(url, resp.status, _detail(await resp.read()))
            finished = False
            try:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = _json(url, data)
                    meta = chunk.get("meta_info") or {}
                    finished = finished or bool(meta.get("finish_reason"))
                    yield meta, chunk.get("output_ids") or []
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineLost(url, f"stream broken: {exc!r}") from exc
            if not finished:
                raise EngineLost(url, "stream ended without a finish reason")

    async def abort(self, url: str, rid: str) -> bool:
        """Ask the engine to abort request ``rid``; False when it could not be told."""
        try:
            async with self.session.post(
                url + "/abort_request",
                data=orjson.dumps({"rid": rid}),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def _post(self, url: str, path: str, body: bytes) -> _Call:
        return _Call(self, url, path, body)


class _Call:
    """``async with`` a POST, mapping connection failures to EngineRefused / EngineLost."""

    def __init__(self, client: EngineClient, url: str, path: str, body: bytes) -> None:
        self.client, self.url, self.path, self.body = client, url, path, body
        self.resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            self.resp = await self.client.session.post(
                self.url + self.path,
                data=self.body,
                headers={"Content-Type": "application/json"},
                timeout=self.client.timeout,
            )
        except aiohttp.ClientConnectorError as exc:
            raise EngineRefused(self.url, f"cannot connect: {exc.os_error or exc}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineLost(self.url, f"no reply: {exc!r}") from exc
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()


def _json(url: str, raw: bytes) -> dict[str, Any]:
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EngineLost(url, f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(out, dict):
        raise EngineLost(url, "reply is not a JSON object")
    return out


def _detail(raw: bytes) -> str:
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


__all__ = [
    "EngineClient",
    "EngineError",
    "EngineLost",
    "EngineRefused",
    "EngineRejected",
    "Generated",
    "decode_experts",
]
