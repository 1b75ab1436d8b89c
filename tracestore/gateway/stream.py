"""A streamed answer on its way out: text deltas as the engine generates, held back where a stop
string may be forming, the SSE response opened at the first byte.

The response headers wait for the engine's first text, so a failure before
it is a plain HTTP error (the SDKs' retries apply); after it, failures are
error events in the stream. A generation continued across a weight update
keeps writing into the same stream: nothing already sent is sent again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from .chat import Answer, ApiError, ChatRequest, Wire
from .h1 import open_stream
from .tokenizer import ChatTokenizer, Detokenizer

#: A comment line that keeps an idle SSE connection alive (clients ignore it).
KEEPALIVE = b": keep-alive\n\n"


def cut(text: str, stop: str | None) -> str:
    """``text`` up to the first ``stop`` (all of it when ``stop`` is absent or empty)."""
    if not stop:
        return text
    i = text.find(stop)
    return text if i < 0 else text[:i]


class TextStream:
    """One streamed answer (see the module docstring).

    ``headers()`` gives the response headers when it opens; ``stop_ids``
    are the end-of-turn ids (never shown as text).
    """

    def __init__(
        self,
        request: web.Request,
        wire: Wire,
        req: ChatRequest,
        rid: str,
        prompt_tokens: int,
        tok: ChatTokenizer,
        stop_ids: frozenset[int],
        headers: Callable[[], dict[str, str]],
        opened: bool = False,
    ) -> None:
        self.request = request
        self.req = req
        self.sw: Any = wire.Stream(req, rid, prompt_tokens)
        self.det = Detokenizer(tok.decode)
        self.stop_ids = stop_ids
        self.headers = headers
        self.cuts = [x for x in (*req.stop, None if req.ignore_eos else tok.stop_word) if x]
        self.hold = max((len(x) for x in self.cuts), default=1) - 1
        self.text = ""
        self.sent = 0  # content characters sent
        self.sent_reasoning = 0
        self.rp = tok.reasoning
        self.opened = opened  # the generation prompt opened the reasoning block
        self.resp: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        """True once the first byte went out (failures are error events from then on)."""
        return self.resp is not None

    async def open(self) -> web.StreamResponse:
        """Send the headers and the stream's first event (once)."""
        if self.resp is None:
            r = await open_stream(self.request, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.headers()})
            await r.write(self.sw.start())
            self.resp = r
        return self.resp

    async def push(self, ids: Sequence[int], finished: bool, stopped: bool) -> None:
        """New ids of the answer; ``stopped``: the generation ended with a stop token (not shown)."""
        if stopped and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        self.text += self.det.push(ids)
        if finished:
            return  # the end is parsed on the whole answer
        reasoning, content, thinking = self._parts()
        if reasoning:
            hold = len(self.rp.end or "") - 1 if thinking else 0
            safe_r = max(self.sent_reasoning, len(reasoning) - hold)
            if safe_r > self.sent_reasoning:
                resp = await self.open()
                await resp.write(self.sw.reasoning(reasoning[self.sent_reasoning : safe_r]))
                self.sent_reasoning = safe_r
        if thinking or self.req.parse_tools:
            return  # tool calls are parsed on the whole answer
        shown = content
        for x in self.cuts:
            shown = cut(shown, x)
        safe = len(shown) if len(shown) < len(content) else max(self.sent, len(shown) - self.hold)
        if safe > self.sent:
            resp = await self.open()
            await resp.write(self.sw.text(shown[self.sent : safe]))
            self.sent = safe

    def _parts(self) -> tuple[str, str, bool]:
        """``(reasoning, content, still thinking)`` of the text so far, as the reasoning parser
        splits it (nothing shown while it cannot tell yet whether a reasoning block opens)."""
        start, end, t = self.rp.start, self.rp.end, self.text
        if start is None or end is None:
            return "", t, False
        if self.opened:
            body = t
        else:
            lead = t.lstrip()
            if lead.startswith(start):
                body = lead[len(start) :]
            elif start.startswith(lead):
                return "", "", True  # it may still become the opening tag
            else:
                return "", t, False
        i = body.find(end)
        if i < 0:
            return body.lstrip(), "", True
        return body[:i].strip(), body[i + len(end) :].lstrip("\n"), False

    async def keepalive(self) -> None:
        """While the answer waits (a held generation): a comment, when the stream is open."""
        if self.resp is not None:
            await self.resp.write(KEEPALIVE)

    async def end(self, answer: Answer) -> web.StreamResponse:
        """What was held back, tool calls, the finish (and usage) events; end the response."""
        resp = await self.open()
        _, content, _ = self._parts()
        pending = answer.content[self.sent :] if answer.content.startswith(content[: self.sent]) else ""
        r = answer.reasoning or ""
        pending_r = r[self.sent_reasoning :] if self.sent_reasoning <= len(r) else ""
        await resp.write(self.sw.end(answer, pending, pending_r))
        await resp.write_eof()
        return resp

    async def error(self, err: ApiError) -> web.StreamResponse:
        """An error event in the open stream (the SDKs raise it)."""
        assert self.resp is not None
        await self.resp.write(self.sw.error(err))
        return self.resp


__all__ = ["KEEPALIVE", "TextStream", "cut"]
