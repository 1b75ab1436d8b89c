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
  ``put(sid, value) -> expert_key``; ``after_response_many`` puts every
  part of its turns with one ``put_many`` when the holder has it), then
  records the delta node and the response node in one atomic
  :meth:`~tracestore.TraceStore.record_turn`.

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
from typing import Any, Generic, Protocol, TypeVar

from . import traces
from .errors import InvalidInput, TracestoreError
from .scripts import Op, gather
from .scripts import Request as ScriptRequest
from .store import AsyncTraceStore, StoreMethods, TraceStore
from .traces import PrefixMatch, TokenIds, Turn
from .twin import AsyncRunner, OpBuilder, SyncRunner, op
from .validate import validate_id

St = TypeVar("St", bound=StoreMethods)
R = TypeVar("R")

Message = Mapping[str, Any]
Render = Callable[[Sequence[Message], bool], str]
Encode = Callable[[str], list[int]]


class ExpertHolder(Protocol):
    """What the recorder needs of a holder (:class:`tracestore.ray.RefHolder`).

    A holder that also has ``put_many(items) -> keys`` (``RefHolder`` does)
    gets every expert part of an :meth:`TurnRecorder.after_response_many` in
    one call (one ``ray.put`` for the round); others get one ``put`` per part.
    The gateway uses ``keep(sid, value) -> key`` when a holder has it
    (``RefHolder`` does: nothing is put until the value is lent).
    """

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
        """Prefix ids followed by the delta ids (what the engine receives), as a new list.

        O(context): an HTTP engine needs the list for its JSON body. In process,
        :attr:`token_ids` is the same sequence without the copy.
        """
        return [*self.prefix.token_ids, *self.delta_ids]

    @property
    def token_ids(self) -> TokenIds:
        """:attr:`input_ids` as :class:`~tracestore.traces.TokenIds`: the prefix's buffer
        extended by the delta, O(delta)."""
        return self.prefix.token_ids + self.delta_ids


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
    versions: Sequence[int] | None = None  # per response token, when they differ
    fork: str | None = None  # why the turn starts a branch (``template``), recorded on its first new node


class RecorderMethods(Generic[St]):
    """State, checks and methods of :class:`TurnRecorder` and :class:`AsyncTurnRecorder`, written once.

    ``render(messages, add_generation_prompt) -> str`` is the chat template,
    ``encode(text) -> list[int]`` the tokenizer; ``holder`` keeps routed
    experts (``put(sid, value) -> expert_key``), or None to record no experts.
    The recorder remembers the last prepared request of each session so that
    ``after_response`` does not look the prefix up again when the prompt is
    unchanged (otherwise it looks up again), and the store keeps each
    session's continuation, so a turn's client work does not grow with the
    context (docs/traces.md). Not thread-safe per session.
    Costs: ``before_request`` one lookup (1 round trip warm), ``after_response``
    one ``record_turn`` (1 round trip); ``prepare_many`` and
    ``after_response_many`` the same for many sessions in one round trip each.
    """

    def __init__(
        self, store: St, render: Render, encode: Encode, holder: ExpertHolder | None = None
    ) -> None:
        self.store = store
        self.render = render
        self.encode = encode
        self.holder = holder
        self.stats = RecorderStats()
        self._pending: dict[str, Request] = {}
        self._scope = self  # what the recorder's operations receive

    def forget(self, sid: str) -> None:
        """Drop the remembered request of ``sid`` (after an aborted or failed request)."""
        self._pending.pop(sid, None)

    @property
    def ops(self) -> RecorderOps:
        """The recorder's operations built and not run, to batch with the store's:
        ``store.gather(store.ops.gate.admit(...), recorder.ops.prepare(...))``. No I/O."""
        return RecorderOps(self._scope)

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
        self, req: Request, messages: Sequence[Message], assistant_message: Message,
        output_ids: Sequence[int], logprobs: Sequence[float], routed_experts: Any | None, version: int,
        versions: Sequence[int] | None = None, fork: str | None = None,
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
        return _Plan(req, new_text[len(prompt) :], out, lps, version, parts, versions, fork)

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

    def _put_many(self, plans: Sequence[_Plan]) -> list[tuple[str | None, str | None]]:
        """:meth:`_put` of each plan; one ``put_many`` for them all when the holder has it."""
        put_many = getattr(self.holder, "put_many", None)
        if put_many is None or not callable(put_many):
            return [self._put(p) for p in plans]
        items: list[tuple[str, Any]] = []
        for p in plans:
            if p.parts is not None:
                if p.req.delta_ids:
                    items.append((p.req.sid, p.parts[0]))
                items.append((p.req.sid, p.parts[1]))
        if not items:
            return [(None, None)] * len(plans)
        t0 = time.perf_counter()
        got = iter(put_many(items))
        self.stats.holder_s += time.perf_counter() - t0
        out: list[tuple[str | None, str | None]] = []
        for p in plans:
            if p.parts is None:
                out.append((None, None))
                continue
            dkey = next(got) if p.req.delta_ids else None
            out.append((dkey, next(got)))
            self.stats.expert_bytes += sum(int(getattr(x, "nbytes", 0)) for x in p.parts)
        return out

    def _invalid(self, sid: str, field: str, message: str) -> InvalidInput:
        self.stats.invalid += 1
        self._pending.pop(sid, None)
        return InvalidInput(field, message)


@dataclass(frozen=True)
class Response:
    """One engine answer: the arguments of :meth:`TurnRecorder.after_response`, for
    :meth:`TurnRecorder.after_response_many`."""

    sid: str
    messages: Sequence[Message]
    assistant_message: Message
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    routed_experts: Any | None
    version: int
    #: Per output token, when a generation continued across weight updates (None: ``version``).
    versions: Sequence[int] | None = None


def _timed(rec: RecorderMethods[Any], operation: Op[R]) -> Op[R]:
    """Run ``operation``, counting its time as the recorder's store time."""
    t0 = time.perf_counter()
    try:
        return (yield from operation)
    finally:
        rec.stats.store_s += time.perf_counter() - t0


def prepare(rec: RecorderMethods[Any], sid: str, messages: Sequence[Message]) -> Op[Request]:
    """Render, look up the stored prefix and tokenize the delta; writes nothing. One round trip warm."""
    prompt = rec._prompt(sid, messages)
    match = yield from _timed(rec, traces.lookup(rec.store.context, sid, prompt))
    return rec._remember(sid, prompt, match)


def prepare_many(
    rec: RecorderMethods[Any], items: Sequence[tuple[str, Sequence[Message]]]
) -> Op[list[Request | TracestoreError]]:
    """:meth:`prepare` of each ``(sid, messages)``, the lookups pipelined.

    One round trip warm for all of them (two when some index changed).
    Errors stand in the list in place of their request (InvalidId,
    SessionReleased...): a failed item does not stop the others. Sessions
    must be distinct.
    """
    out: list[Request | TracestoreError | None] = [None] * len(items)
    prompts: dict[int, str] = {}
    for i, (sid, messages) in enumerate(items):
        try:
            prompts[i] = rec._prompt(sid, messages)
        except TracestoreError as err:
            out[i] = err
    ctx = rec.store.context
    lookups = [traces.lookup(ctx, items[i][0], p) for i, p in prompts.items()]
    matches = yield from _timed(rec, gather(lookups, errors_in_place=True))
    for (i, prompt), m in zip(prompts.items(), matches, strict=True):
        out[i] = m if isinstance(m, TracestoreError) else rec._remember(items[i][0], prompt, m)
    return out  # type: ignore[return-value]  # every slot is filled


def before_request(rec: RecorderMethods[Any], sid: str, messages: Sequence[Message]) -> Op[list[int]]:
    """The input ids to send for ``messages`` (stored prefix ids + delta ids). One round trip warm."""
    req = yield from prepare(rec, sid, messages)
    return req.input_ids


def _record(rec: RecorderMethods[Any], plan: _Plan, keys: tuple[str | None, str | None]) -> Op[Turn]:
    """``record_turn`` of a checked response whose experts were put (``keys``)."""
    req = plan.req
    try:
        turn = yield from traces.record_turn(
            rec.store.context,
            req.sid,
            req.prompt_text,
            plan.response_text,
            prefix=req.prefix,
            delta_token_ids=req.delta_ids,
            response_token_ids=plan.output_ids,
            response_logprobs=plan.logprobs,
            version=plan.version,
            delta_expert_key=keys[0],
            response_expert_key=keys[1],
            response_versions=plan.versions,
            fork=plan.fork,
        )
    finally:
        rec._pending.pop(req.sid, None)
    rec.stats.turns += 1
    return turn


def after_response(
    rec: RecorderMethods[Any],
    sid: str,
    messages: Sequence[Message],
    assistant_message: Message,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    routed_experts: Any | None,
    version: int,
    versions: Sequence[int] | None = None,
    fork: str | None = None,
) -> Op[Turn]:
    """Record the turn: delta node (key = old prompt) and response node (key = new prompt).

    ``messages`` are those passed to ``before_request``;
    ``assistant_message`` is the parsed answer; ``output_ids`` /
    ``logprobs`` what the engine generated; ``routed_experts`` the
    engine's ``[input + output tokens, layers, top_k]`` array (None:
    record no experts); ``version`` the weight version of the request's
    gate lease; ``fork`` the reason the turn starts a branch (``template``:
    the template rendered the stored history differently), recorded on its
    first new node (``Node.fork``). Raises InvalidInput (nothing put, nothing written) when the
    response is invalid; otherwise the errors of ``record_turn``. One round
    trip (two when the prompt changed since ``before_request``).
    """
    req = rec._pending_for(sid, rec._prompt(sid, messages))
    if req is None:
        req = yield from prepare(rec, sid, messages)
    plan = rec._plan(req, messages, assistant_message, output_ids, logprobs, routed_experts, version, versions, fork)
    return (yield from _timed(rec, _record(rec, plan, rec._put(plan))))


def after_response_many(
    rec: RecorderMethods[Any], responses: Sequence[Response]
) -> Op[list[Turn | TracestoreError]]:
    """:meth:`after_response` of each :class:`Response`, the writes pipelined.

    One round trip for all of them (plus one, shared, for the lookups of
    those whose prompt changed since ``before_request``). Each response is
    checked, its experts put (all in one ``put_many`` when the holder has
    it) and its turn written as by ``after_response``;
    errors stand in the list in place of their turn (InvalidInput: nothing
    put or written for that one; NodeConflict...): a failed item does not
    stop the others. Sessions must be distinct.
    """
    out: list[Turn | TracestoreError | None] = [None] * len(responses)
    reqs: dict[int, Request] = {}
    again: list[int] = []
    for i, r in enumerate(responses):
        try:
            req = rec._pending_for(r.sid, rec._prompt(r.sid, r.messages))
        except TracestoreError as err:
            out[i] = err
            continue
        if req is None:
            again.append(i)
        else:
            reqs[i] = req
    if again:
        prepared = yield from prepare_many(rec, [(responses[i].sid, responses[i].messages) for i in again])
        for i, got in zip(again, prepared, strict=True):
            if isinstance(got, TracestoreError):
                out[i] = got
            else:
                reqs[i] = got
    plans: dict[int, _Plan] = {}
    for i, req in sorted(reqs.items()):
        r = responses[i]
        try:
            plans[i] = rec._plan(
                req, r.messages, r.assistant_message, r.output_ids, r.logprobs, r.routed_experts, r.version,
                r.versions,
            )
        except TracestoreError as err:
            out[i] = err
    # every checked response's experts in one put_many (one ray.put), then the writes
    keys = rec._put_many(list(plans.values()))
    writes = {i: _record(rec, plan, k) for (i, plan), k in zip(plans.items(), keys, strict=True)}
    turns = yield from _timed(rec, gather(writes.values(), errors_in_place=True))
    for i, turn in zip(writes, turns, strict=True):
        out[i] = turn
    return out  # type: ignore[return-value]  # every slot is filled


class _RecorderOps:
    prepare = op(prepare)
    prepare_many = op(prepare_many)
    before_request = op(before_request)
    after_response = op(after_response)
    after_response_many = op(after_response_many)


class RecorderOps(_RecorderOps, OpBuilder[RecorderMethods[Any]]):
    """A recorder's operations built and not run (``recorder.ops``); run them with the store's ``gather``."""


class TurnRecorder(_RecorderOps, RecorderMethods[TraceStore], SyncRunner[RecorderMethods[Any]]):
    """XTuner-style ``on_request`` / ``on_response`` over a :class:`~tracestore.TraceStore`.

    See :class:`RecorderMethods` for the arguments and costs.
    """

    def execute(self, request: ScriptRequest) -> Any:
        """Execute one request through the store."""
        return self.store.execute(request)


class AsyncTurnRecorder(
    _RecorderOps, RecorderMethods[AsyncTraceStore], AsyncRunner[RecorderMethods[Any]]
):
    """:class:`TurnRecorder` over an :class:`~tracestore.AsyncTraceStore` (same methods, coroutines).

    For asyncio session servers (an OpenAI-compatible proxy). The holder's
    ``put`` / ``put_many`` is called synchronously (a local ``ray.put``).
    """

    async def execute(self, request: ScriptRequest) -> Any:
        """Execute one request through the store."""
        return await self.store.execute(request)


__all__ = [
    "AsyncTurnRecorder",
    "ExpertHolder",
    "RecorderMethods",
    "RecorderOps",
    "Request",
    "RecorderStats",
    "Response",
    "TurnRecorder",
]
