"""Turn recorder for a session server: the single-phase write of XTuner's SessionServer.

A session server (an HTTP proxy in front of the inference engine, or a
rollout worker that calls its engine directly) does two things per turn:

* :meth:`TurnRecorder.before_request` renders the conversation with the
  generation prompt, looks up the longest stored prefix of the session and
  tokenizes only the remaining text (the *delta*); it returns the ids to send
  to the engine (prefix ids + delta ids) and writes nothing;
* :meth:`TurnRecorder.after_response` renders the conversation including the
  assistant turn (no generation prompt, right-stripped, so it ends in the stop
  word), splits the engine's routed experts into the delta's rows and the
  response's rows, puts each part through the holder (a Ray ``RefHolder``:
  ``put(sid, value) -> expert_key``), then records the delta node and the
  response node in one atomic :meth:`~tracestore.TraceStore.record_turn`.

Every check runs before anything is put or written: when the response is
invalid (empty output, wrong logprob count, routed-experts rows that do not
match the ids sent, a rendered conversation that does not extend the prompt)
:class:`~tracestore.errors.InvalidInput` is raised and neither Redis nor the
holder sees anything. If the write itself fails after the puts (for example
:class:`~tracestore.errors.NodeConflict`), the new refs stay registered under
the session in the holder and are dropped when the session is released.

Routed-experts layout (the engine's): ``[len(input_ids) + len(output_ids),
layers, top_k]`` where row 0 of the whole conversation is a dummy row and row
``i`` is the routing of the token at position ``i - 1``. Rows of the stored
prefix are dropped (earlier nodes hold them); rows ``[P, P + D)`` go with the
delta node and rows ``[P + D, P + D + O)`` with the response node, so the
concatenation of a trace's parts, dummy row dropped, is ``[tokens - 1,
layers, top_k]``, aligned with ``input_ids[:-1]``.

The core library does not import numpy: ``routed_experts`` is anything with
``shape`` and slicing (a numpy array in practice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import InvalidInput
from .keys import validate_id
from .traces import PrefixMatch, Turn

if TYPE_CHECKING:
    from .store import AsyncTraceStore, TraceStore

Message = Mapping[str, Any]
Render = Callable[[Sequence[Message], bool], str]
Encode = Callable[[str], list[int]]


class ExpertHolder(Protocol):
    """What the recorder needs of a holder (:class:`tracestore.ray.RefHolder`)."""

    def put(self, sid: str, value: Any) -> str:  # pragma: no cover - protocol
        """Keep ``value`` for session ``sid``; return its expert key."""
        ...


@dataclass(frozen=True)
class Request:
    """What :meth:`TurnRecorder.before_request` prepared: the ids to send and how they split."""

    sid: str
    prompt_text: str
    prefix: PrefixMatch
    delta_ids: list[int]

    @property
    def input_ids(self) -> list[int]:
        """Prefix ids followed by the delta ids (what the engine receives)."""
        return [*self.prefix.token_ids, *self.delta_ids]


@dataclass
class RecorderStats:
    """Counters of one recorder (for reports): turns, invalid responses, time in store calls."""

    requests: int = 0
    turns: int = 0
    invalid: int = 0
    store_s: float = 0.0
    holder_s: float = 0.0
    expert_bytes: int = 0


@dataclass(frozen=True)
class _Plan:
    """A checked response, ready to put and write."""

    req: Request
    response_text: str
    output_ids: list[int]
    logprobs: list[float]
    version: int
    parts: tuple[Any, Any] | None  # routed-expert rows of the delta and of the response


class _Recorder:
    """State and checks shared by :class:`TurnRecorder` and :class:`AsyncTurnRecorder`."""

    def __init__(self, render: Render, encode: Encode, holder: ExpertHolder | None) -> None:
        self.render = render
        self.encode = encode
        self.holder = holder
        self.stats = RecorderStats()
        self._pending: dict[str, Request] = {}

    def forget(self, sid: str) -> None:
        """Drop the remembered request of ``sid`` (after an aborted or failed request)."""
        self._pending.pop(sid, None)

    def _prompt(self, sid: str, messages: Sequence[Message]) -> str:
        validate_id("session id", sid)
        return self.render(messages, True)

    def _remember(self, sid: str, prompt: str, match: PrefixMatch) -> Request:
        req = Request(sid, prompt, match, list(self.encode(prompt[match.text_len :])))
        self._pending[sid] = req
        self.stats.requests += 1
        return req

    def _pending_for(self, sid: str, prompt: str) -> Request | None:
        req = self._pending.get(sid)
        return req if req is not None and req.prompt_text == prompt else None

    def _plan(
        self,
        req: Request,
        messages: Sequence[Message],
        assistant_message: Message,
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        routed_experts: Any | None,
        version: int,
    ) -> _Plan:
        """Every check of a response, before anything is put or written."""
        sid, prompt = req.sid, req.prompt_text
        new_text = self.render([*messages, assistant_message], False).rstrip()
        if not new_text.startswith(prompt) or len(new_text) <= len(prompt):
            raise self._invalid(
                sid,
                "assistant_message",
                "the conversation rendered with the answer does not extend the prompt",
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise self._invalid(sid, "version", f"must be a non-negative int, got {version!r}")
        out = list(output_ids)
        lps = list(logprobs)
        if not out:
            raise self._invalid(sid, "output_ids", "empty response")
        if len(lps) != len(out):
            raise self._invalid(sid, "logprobs", f"{len(lps)} logprobs for {len(out)} output ids")
        p, d = len(req.prefix.token_ids), len(req.delta_ids)
        parts: tuple[Any, Any] | None = None
        if routed_experts is not None and self.holder is not None:
            shape = getattr(routed_experts, "shape", None)
            rows = shape[0] if shape else -1
            if rows != p + d + len(out):
                raise self._invalid(
                    sid,
                    "routed_experts",
                    f"{rows} rows for {p} prefix + {d} delta + {len(out)} output tokens",
                )
            parts = (routed_experts[p : p + d], routed_experts[p + d :])
        return _Plan(req, new_text[len(prompt) :], out, lps, version, parts)

    def _put(self, plan: _Plan) -> tuple[str | None, str | None]:
        """Put the expert parts through the holder: ``(delta_key, response_key)``."""
        if plan.parts is None or self.holder is None:
            return None, None
        t0 = time.perf_counter()
        dkey = self.holder.put(plan.req.sid, plan.parts[0]) if plan.req.delta_ids else None
        rkey = self.holder.put(plan.req.sid, plan.parts[1])
        self.stats.holder_s += time.perf_counter() - t0
        self.stats.expert_bytes += sum(int(getattr(x, "nbytes", 0)) for x in plan.parts)
        return dkey, rkey

    @staticmethod
    def _record_args(plan: _Plan, keys: tuple[str | None, str | None]) -> dict[str, Any]:
        req = plan.req
        return {
            "sid": req.sid,
            "prompt_text": req.prompt_text,
            "response_text": plan.response_text,
            "prefix": req.prefix,
            "delta_token_ids": req.delta_ids,
            "response_token_ids": plan.output_ids,
            "response_logprobs": plan.logprobs,
            "version": plan.version,
            "delta_expert_key": keys[0],
            "response_expert_key": keys[1],
        }

    def _invalid(self, sid: str, field: str, message: str) -> InvalidInput:
        self.stats.invalid += 1
        self._pending.pop(sid, None)
        return InvalidInput(field, message)


_DOC_AFTER = """Record the turn: delta node (key = old prompt) and response node (key = new prompt).

        ``messages`` are those passed to ``before_request``;
        ``assistant_message`` is the parsed answer; ``output_ids`` /
        ``logprobs`` what the engine generated; ``routed_experts`` the
        engine's ``[input + output tokens, layers, top_k]`` array (None:
        record no experts); ``version`` the weight version of the request's
        gate lease. Raises InvalidInput (nothing put, nothing written) when the
        response is invalid; otherwise the errors of ``record_turn``.
        """


class TurnRecorder(_Recorder):
    """XTuner-style ``on_request`` / ``on_response`` over a :class:`~tracestore.TraceStore`.

    ``render(messages, add_generation_prompt) -> str`` is the chat template,
    ``encode(text) -> list[int]`` the tokenizer; ``holder`` keeps routed
    experts (``put(sid, value) -> expert_key``), or None to record no experts.
    The recorder remembers the last prepared request of each session so that
    ``after_response`` does not look the prefix up again when the prompt is
    unchanged (otherwise it looks up again). Not thread-safe per session.
    Costs: ``before_request`` one lookup (1 round trip warm), ``after_response``
    one ``record_turn`` (1 round trip).
    """

    def __init__(
        self,
        store: TraceStore,
        render: Render,
        encode: Encode,
        holder: ExpertHolder | None = None,
    ) -> None:
        super().__init__(render, encode, holder)
        self.store = store

    def prepare(self, sid: str, messages: Sequence[Message]) -> Request:
        """Render, look up the stored prefix and tokenize the delta; writes nothing."""
        prompt = self._prompt(sid, messages)
        t0 = time.perf_counter()
        try:
            match = self.store.lookup(sid, prompt)
        finally:
            self.stats.store_s += time.perf_counter() - t0
        return self._remember(sid, prompt, match)

    def before_request(self, sid: str, messages: Sequence[Message]) -> list[int]:
        """The input ids to send for ``messages`` (stored prefix ids + delta ids)."""
        return self.prepare(sid, messages).input_ids

    def after_response(
        self,
        sid: str,
        messages: Sequence[Message],
        assistant_message: Message,
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        routed_experts: Any | None,
        version: int,
    ) -> Turn:
        req = self._pending_for(sid, self._prompt(sid, messages)) or self.prepare(sid, messages)
        plan = self._plan(
            req, messages, assistant_message, output_ids, logprobs, routed_experts, version
        )
        keys = self._put(plan)
        t0 = time.perf_counter()
        try:
            turn = self.store.record_turn(**self._record_args(plan, keys))
        finally:
            self.stats.store_s += time.perf_counter() - t0
            self._pending.pop(sid, None)
        self.stats.turns += 1
        return turn

    after_response.__doc__ = _DOC_AFTER


class AsyncTurnRecorder(_Recorder):
    """:class:`TurnRecorder` over an :class:`~tracestore.AsyncTraceStore` (same methods, coroutines).

    For asyncio session servers (an OpenAI-compatible proxy). The holder's
    ``put`` is called synchronously (``RefHolder.put`` is a local ``ray.put``).
    """

    def __init__(
        self,
        store: AsyncTraceStore,
        render: Render,
        encode: Encode,
        holder: ExpertHolder | None = None,
    ) -> None:
        super().__init__(render, encode, holder)
        self.store = store

    async def prepare(self, sid: str, messages: Sequence[Message]) -> Request:
        """Render, look up the stored prefix and tokenize the delta; writes nothing."""
        prompt = self._prompt(sid, messages)
        t0 = time.perf_counter()
        try:
            match = await self.store.lookup(sid, prompt)
        finally:
            self.stats.store_s += time.perf_counter() - t0
        return self._remember(sid, prompt, match)

    async def before_request(self, sid: str, messages: Sequence[Message]) -> list[int]:
        """The input ids to send for ``messages`` (stored prefix ids + delta ids)."""
        return (await self.prepare(sid, messages)).input_ids

    async def after_response(
        self,
        sid: str,
        messages: Sequence[Message],
        assistant_message: Message,
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        routed_experts: Any | None,
        version: int,
    ) -> Turn:
        req = self._pending_for(sid, self._prompt(sid, messages)) or await self.prepare(
            sid, messages
        )
        plan = self._plan(
            req, messages, assistant_message, output_ids, logprobs, routed_experts, version
        )
        keys = self._put(plan)
        t0 = time.perf_counter()
        try:
            turn: Turn = await self.store.record_turn(**self._record_args(plan, keys))
        finally:
            self.stats.store_s += time.perf_counter() - t0
            self._pending.pop(sid, None)
        self.stats.turns += 1
        return turn

    after_response.__doc__ = _DOC_AFTER


__all__ = ["AsyncTurnRecorder", "ExpertHolder", "RecorderStats", "Request", "TurnRecorder"]
