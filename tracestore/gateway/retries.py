"""A retry of a turn is one turn: joined while the first attempt runs, replayed once it was recorded.

The SDKs retry a request whose reply did not arrive (a timeout, a cut
connection, a 5xx); a gateway that generated again would leave an orphan
sibling answer in the session, which the trainer then sees as a second
sample of the turn. The rule (docs/gateway.md, Retries):

**Same turn**: the same session, the same wire format, the same request
(canonical messages or prompt ids, tools, ``chat_template_kwargs``: in ``tito`` and
``tokens`` mode, the digest of the session key they make) and the
same sampling options (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``stop``, ``seed``, ``ignore_eos``, ``tool_choice``); their
*retry digest* (:func:`retry_digest`, sha256, 128 bits). Fields that only shape
the answer (``stream``, ``logprobs``, ``include_usage``) are not part of it:
a retry gets the answer in the shape it asks for.

* **joined**: the same turn arrives while an attempt of it runs *in this
  process*: it waits for that attempt and gets its answer (one generation at
  the engine). If that attempt fails, the waiting request runs on its own.
  A non-streamed attempt whose client left (an SDK timeout) goes on for
  ``--retry-grace`` seconds for its retry to join it (:meth:`Retries.attempt`),
  and is aborted when none comes.
* **replayed**: the same turn arrives after an attempt was recorded (by any
  gateway process of the run: the answer is kept in the store, see
  :mod:`tracestore.traces.answers`, for :data:`RETRY_WINDOW_S`), and the
  request's prompt is exactly a stored prompt of the session (nothing new to
  tokenise): it is answered from the recorded turn (tokens, logprobs and
  versions read back from the trace, text and tool calls as first answered).
  No generation, nothing recorded, not a fork.

A client that wants a second sample of a prompt it already asked in the same
session changes an option (a different ``seed``) or sends ``X-Tracestore-Retry:
new``; an RL group samples its answers in different sessions, which never
share a turn. ``tracestore_gateway_retries_total{outcome="joined"|"replayed"}``
counts both.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Protocol, runtime_checkable

import orjson
from aiohttp import web

from ..errors import TracestoreError
from ..traces import KeptAnswer
from .chat import Answer, ChatRequest, ToolCall
from .h1 import send
from .stream import TextStream

log = logging.getLogger(__name__)

#: How long a recorded turn's answer is kept for a retry to be replayed (seconds).
RETRY_WINDOW_S = 600.0
#: Request header: ``new`` asks for a new generation even when the request is a retry.
RETRY_HEADER = "X-Tracestore-Retry"


@dataclass
class _Lead:
    """The attempt of a turn running in this process: who leads it, what its waiters get."""

    owner: int  # id() of the leading Turn
    answer: asyncio.Future[Joined | None]
    joined: asyncio.Event  # set when a request starts waiting for it


@dataclass(frozen=True)
class Joined:
    """What a running attempt answered: the answer, its engine request id, its version."""

    answer: Answer
    rid: str
    version: int | None


@runtime_checkable
class Replayable(Protocol):
    """A prompt mode whose recorded turns can be found again by prompt key + response suffix."""

    def response_suffix(self, answer: Answer) -> str: ...  # pragma: no cover - protocol


def _options(req: ChatRequest) -> list[Any]:
    return [req.max_tokens, req.temperature, req.top_p, req.top_k, list(req.stop), req.seed, req.ignore_eos, req.tool_choice]


@runtime_checkable
class KeyedPrompts(Protocol):
    """A prompt mode that names a request's prompt by a digest it computes anyway (its key's)."""

    def retry_basis(self, sid: str, req: ChatRequest) -> str: ...  # pragma: no cover - protocol


@functools.cache
def _implements(cls: Any, protocol: Any) -> bool:
    return issubclass(cls, protocol)


def _is(prompts: Any, protocol: Any) -> bool:
    """``isinstance(prompts, protocol)`` for a runtime protocol, once per class (a protocol's own
    isinstance walks its members on every call: tens of µs, three times a turn)."""
    cls: Any = type(prompts)
    return _implements(cls, protocol)


def retry_digest(wire: str, req: ChatRequest, basis: str | None = None) -> str:
    """The retry digest of ``req`` on ``wire`` (see the module docstring): 32 hex characters.

    ``basis``: the prompt mode's digest of the request's prompt (:class:`KeyedPrompts`: in
    ``tito`` mode the conversation key's, which covers the canonical messages, tools and
    template options and costs only the new messages' bytes on a warm session); without it
    the messages, tools and options themselves are hashed."""
    if basis is not None:
        return sha256(orjson.dumps([wire, basis, _options(req)])).hexdigest()[:32]
    prompt = getattr(req, "prompt_ids", None)
    body = [wire, req.messages if prompt is None else list(prompt), req.tools, req.template_kwargs, _options(req)]
    # no key sorting: the parsers build canonical dicts in a fixed order, and a retry sends the same bytes
    return sha256(orjson.dumps(body)).hexdigest()[:32]  # (sha256: hardware-assisted, ~2x blake2b here)


def _record(answer: Answer, rid: str, suffix: str) -> dict[str, Any]:
    return {
        "rid": rid,
        "resp": suffix,
        "n": answer.completion_tokens,
        "content": answer.content,
        "reasoning": answer.reasoning,
        "calls": [[c.id, c.name, c.arguments] for c in answer.tool_calls],
        "finish": answer.finish,
        "stop": answer.stop_string,
        "version": answer.version,
    }


class Retries:
    """One gateway process's attempts in flight (for joins) and the replay of recorded turns."""

    def __init__(self) -> None:
        #: (session, retry digest) -> the attempt running in this process
        self.running: dict[tuple[str, str], _Lead] = {}
        self._orphans: set[int] = set()  # id() of leading turns whose client left, still running

    # -- the turn's side (called by turn.Turn) ---------------------------------------------

    async def join(self, turn: Any) -> web.StreamResponse | None:
        """Before admission: wait for a running attempt of the same turn and answer its answer
        (None: this request leads, or the attempt it waited for failed)."""
        if turn.sid is None or turn.request.headers.get(RETRY_HEADER, "").lower() == "new":
            return None
        prompts = turn.s.prompts
        basis = prompts.retry_basis(turn.sid, turn.req) if _is(prompts, KeyedPrompts) else None
        digest = retry_digest(turn.wire.NAME, turn.req, basis)
        key = (turn.sid, digest)
        while (running := self.running.get(key)) is not None and not running.answer.done():
            running.joined.set()
            joined = await asyncio.shield(running.answer)
            if joined is not None:
                turn.s.metrics.retries.labels("joined").inc()
                return await respond(turn, joined.answer, joined.rid, joined.version, "joined")
        turn.digest = digest
        self.running[key] = _Lead(id(turn), asyncio.get_running_loop().create_future(), asyncio.Event())
        return None

    async def replay(self, turn: Any) -> web.StreamResponse | None:
        """After prepare: a request whose prompt is a stored prompt and whose answer was kept is
        answered from the recorded turn (its lease settled at once); None otherwise."""
        prep, s = turn.prep, turn.s
        if turn.digest is None or prep is None or prep.key is None or prep.new_tokens or prep.partial is not None:
            return None
        if not _is(s.prompts, Replayable):
            return None
        try:
            rec = await s.db(s.store.read_answer(turn.sid, turn.digest))
            if rec is None:
                return None
            n = int(rec["n"])
            tr = await s.db(s.store.export_training_trace(turn.sid, prep.key + str(rec["resp"])))
            if not tr.nodes or tr.nodes[-1].end != len(prep.key) + len(str(rec["resp"])) or not 0 < n <= len(tr.input_ids):
                return None
            if any(lab < 0 for lab in tr.labels[-n:]):
                return None  # not a generated answer
            calls = tuple(ToolCall(str(i), str(nm), dict(a)) for i, nm, a in rec["calls"])
            answer = Answer(
                str(rec["content"]), calls, str(rec["finish"]), rec["stop"], list(tr.input_ids[-n:]),
                list(tr.logprobs[-n:]), len(tr.input_ids) - n, rec["version"], rec["reasoning"],
            )
        except (TracestoreError, KeyError, TypeError, ValueError) as exc:
            log.info("gateway: no replay of turn %s of session %s (%s): generating", turn.digest, turn.sid, exc)
            return None
        flight = turn.flight
        if flight is not None:
            await s.admission.settle_flight(flight, "aborted")  # nothing ran at the engine
        s.metrics.retries.labels("replayed").inc()
        return await respond(turn, answer, str(rec["rid"]), answer.version, "replayed")

    def kept(self, turn: Any, answer: Answer) -> KeptAnswer | None:
        """The answer record to keep for later retries, written with the turn's record (one
        round trip); None when the prompt mode cannot replay or the request does not lead its turn."""
        prompts = turn.s.prompts
        if turn.digest is None or turn.sid is None or not _is(prompts, Replayable):
            return None
        record = _record(answer, turn.flight.rid if turn.flight is not None else "", prompts.response_suffix(answer))
        return KeptAnswer(turn.digest, record, RETRY_WINDOW_S)

    def recorded(self, turn: Any, answer: Answer) -> None:
        """The turn was recorded (its answer kept with it): the requests that joined it get its answer."""
        fut = self._release(turn)
        if fut is not None and not fut.done():
            rid = turn.flight.rid if turn.flight is not None else ""
            fut.set_result(Joined(answer, rid, turn.first_version))

    async def attempt(self, turn: Any, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Run ``turn``'s ``work``; when its client leaves while it generates a non-streamed answer,
        the work goes on for ``--retry-grace`` seconds, and to its end (recorded) if the
        client's retry joins it meanwhile; else it is cancelled (aborted, as without retries)."""
        if turn.sid is None or turn.req.stream or not turn.s.config.retry_grace_s:
            return await work  # nothing to keep going without its client
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            flight = turn.flight
            grace = turn.s.config.retry_grace_s
            if task.done() or turn.digest is None or flight is None or flight.lease is None:
                task.cancel()
            else:
                self._orphans.add(id(turn))
                turn.s.spawn(self._orphan(turn, task, grace))
            raise

    async def _orphan(self, turn: Any, task: asyncio.Future[web.StreamResponse], grace: float) -> None:
        lead = self.running.get((turn.sid, turn.digest))
        try:
            if lead is not None and lead.owner == id(turn):
                joined: asyncio.Future[Any] = asyncio.ensure_future(lead.joined.wait())
                waits: list[asyncio.Future[Any]] = [task, joined]
                await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
                joined.cancel()
                if not task.done() and not lead.joined.is_set():
                    task.cancel()  # nobody came back for it: aborted
            else:
                task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                log.info("gateway: the attempt of session %s whose client left ended with %r", turn.sid, task.exception())
        finally:
            self._orphans.discard(id(turn))
            self.done(turn)

    def done(self, turn: Any) -> None:
        """The turn is over (answered, failed or cancelled): requests still waiting run on their own."""
        if id(turn) in self._orphans:
            return  # it goes on without its client (attempt)
        fut = self._release(turn)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _release(self, turn: Any) -> asyncio.Future[Joined | None] | None:
        """The waiters' future of the attempt ``turn`` leads, no longer listed (None: it leads none)."""
        key = (turn.sid, turn.digest)
        running = self.running.get(key) if turn.digest is not None else None
        if running is None or running.owner != id(turn):
            return None
        del self.running[key]
        return running.answer


async def respond(turn: Any, answer: Answer, rid: str, version: int | None, outcome: str) -> web.StreamResponse:
    """``answer`` in the shape ``turn``'s request asks for (streamed or not), marked as a retry."""
    s, req, wire = turn.s, turn.req, turn.wire
    headers = {"X-Request-Id": rid, "X-Session-Id": str(turn.sid), RETRY_HEADER: outcome}
    if version is not None:
        headers["X-Tracestore-Version"] = str(version)
    rsp_id = turn._rid()
    if req.stream:
        out = TextStream(turn.request, wire, req, rsp_id, answer.prompt_tokens, s.tok, s.stop_ids, lambda: headers)
        return await out.end(answer)
    body = orjson.dumps(wire.response(req, answer, rsp_id, lambda tid: s.tok.decode([tid])))
    return await send(turn.request, web.Response(body=body, content_type="application/json", headers=headers))


__all__ = ["RETRY_HEADER", "RETRY_WINDOW_S", "Joined", "Replayable", "Retries", "respond", "retry_digest"]
