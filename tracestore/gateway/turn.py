"""One request's path through the gateway, as one object: a :class:`Turn`.

In order (DESIGN section 10):

1. **route, admit, prepare**, one pipelined round trip shared with the other
   turns admitted in the same loop iteration (:meth:`.Admission.admit_with`):
   a gate lease (sealed: 503 with ``Retry-After``), ``router.acquire``
   (retired: 410) and the prompt mode's ``prepare`` (the engine input, from
   the stored trace);
2. **engine**: the ids to the session's engine, streamed or not;
3. **record**: the first time this process records a turn of the session,
   ``open_session(sid, owner)`` (so a refused request opens nothing; an open
   session is left as it is); then the turn written in one round trip (routed experts into the
   holder first), before the client sees the end of the answer, so its next
   turn finds this one;
4. **answer** (exact ``usage``) and **settle** the lease ``completed``.

Any failure goes through one table (:mod:`.failures`): the client gets the
HTTP error in its wire format's shape (or, once a stream has started, an
error event), the lease is settled with what is known, nothing is recorded.
A client that leaves mid-request gets its engine request aborted and its
lease settled ``aborted`` (``completed`` if the turn was already recorded).

Without a session id a turn is a plain proxy: the template, an engine
chosen round-robin, nothing recorded, no lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import orjson
from aiohttp import web

from ..errors import GateSealed
from ..gate import Lease
from . import holds
from .admission import Admitted, Flight
from .chat import Answer, ApiError, ChatRequest, Wire, invalid, new_id
from .engines import EngineLost, EngineOutput, EngineRefused, EngineRequest, extend_ids
from .failures import Failure, TurnAborted, classify, first
from .generation import Generation
from .h1 import send
from .metrics import Timing
from .prompts import Prepared
from .services import Services, build_answer
from .stream import TextStream
from .tracing import turn_attributes

log = logging.getLogger(__name__)

#: Where a turn leaves the HTTP status it answered (an error event inside a 200 stream counts
#: as its error's status in the metrics).
STATUS_KEY = "tracestore.status"


class Turn:
    """One chat request being served (see the module docstring); :meth:`run` answers it."""

    def __init__(
        self,
        s: Services,
        request: web.Request,
        wire: Wire,
        req: ChatRequest,
        sid: str | None,
        owner: str,
        timing: Timing,
    ) -> None:
        self.s = s
        self.request = request
        self.wire = wire
        self.req = req
        self.sid = sid
        self.owner = owner
        self.timing = timing
        self.prep: Prepared | None = None
        self.flight: Flight | None = None
        self.first_version: int | None = None
        self.gen: Generation = Generation(0)
        self.out: TextStream | None = None
        self.kept = False  # this turn's tokens were kept in the store (held)
        self.opened = False  # the engine input ends inside a reasoning block
        self.continued = False
        self.span: Any = None  # the turn's OpenTelemetry span (None: not traced)
        self.digest: str | None = None  # the retry digest while this request leads its turn (retries.py)

    async def run(self) -> web.StreamResponse:
        """Serve the request; a turn failure is answered here, in the caller's shape."""
        spans = self.s.spans
        self.span = spans.turn(self.request.headers, {"tracestore.run": self.s.store.run_id, "tracestore.session": self.sid})
        status = 499
        try:
            resp = await self.s.retries.attempt(self, self._run())  # a retry may join it after its client left
            status = int(self.request.get(STATUS_KEY, resp.status))
            return resp
        except Exception:
            status = 500
            raise
        finally:
            self.s.retries.done(self)
            if self.span is not None:
                spans.set(self.span, **turn_attributes(self.flight, self.prep, self.gen))
                spans.end(self.span, status)

    async def _run(self) -> web.StreamResponse:
        try:
            self.s.features.check(self.req)
            live = self.s.liveness
            if live is not None and live.run_lost and self.sid is not None:
                err = ApiError("unavailable", live.problems()[0] + ": this gateway records nothing more; restart it", code="run_lost")
                err.no_retry = True
                raise err
            if self.sid is None:
                flight = Flight(new_id("req-"), None, self.s.next_engine())
                return await self._serve(flight, self.s.prompts.plain(self.req))
            if (joined := await self.s.retries.join(self)) is not None:  # the same turn runs: its answer
                return joined
            with self.s.spans.child(self.span, "admit"):
                flight = await self._admit(self.sid)
            assert self.prep is not None
            if (replayed := await self.s.retries.replay(self)) is not None:  # the same turn was recorded
                return replayed
            return await self._serve(flight, self.prep.input_ids)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            f = classify(exc)
            if f is None:  # a bug: settle what is known, then the server answers 500
                if self.flight is not None:
                    await self.s.admission.settle_flight(self.flight, "failed")
                raise
            if isinstance(exc, EngineRefused) and self.s.liveness is not None and self.flight is not None:
                self.s.liveness.engines_up[self.flight.engine.url] = False
                f.error.no_retry = not self.s.liveness.any_engine_up  # no engine up: fail fast, no retry storm
            await self._settle_failed(f, exc)
            return self._error_response(f)

    # -- 1 and 2: open, route, admit, prepare ----------------------------------------------

    async def _admit(self, sid: str) -> Flight:
        s = self.s
        t0 = time.perf_counter()
        rid = new_id("req-")  # chosen first: the lease records it (and the engine, when known)
        hint = s.route_hint(sid)
        phase = s.admission.admit_phase(sid, hint, rid, s.prompts.prepare(sid, self.req), s.router.acquire(sid))
        try:
            got = await asyncio.shield(phase)
        except asyncio.CancelledError:
            s.spawn(self._settle_phase(phase))
            raise
        lease, (prep, entry) = got.lease, got.results
        self.timing.store_s += self.timing.add("admit", t0) - t0
        if isinstance(lease, GateSealed) and not isinstance(prep, BaseException) and not isinstance(entry, BaseException):
            s.admission.abort_all("weight_update")  # learnt of a seal: stop what runs now
            if s.config.on_weight_update == "continue":
                lease = await holds.wait_for_gate(self, sid, hint, rid)  # the agent does not see the update at all
        errors = [x for x in (prep, entry, lease) if isinstance(x, BaseException)]
        if errors:
            if isinstance(lease, Lease):
                await s.admission.settle(lease, "aborted")
            e = first(errors)
            if isinstance(e, GateSealed):
                s.admission.abort_all("weight_update")  # learnt of a seal: stop what runs now
            raise e
        assert isinstance(prep, Prepared) and isinstance(lease, Lease)
        self.prep = prep
        s.routed(sid, str(entry))
        self.flight = Flight(rid, sid, s.engines[str(entry)], lease)
        return self.flight

    async def _settle_phase(self, phase: asyncio.Future[Admitted]) -> None:
        """After a cancelled admission phase: settle its lease, if one was admitted."""
        got = await phase
        if isinstance(got.lease, Lease):
            await self.s.admission.settle(got.lease, "aborted")

    # -- 3: the engine call ----------------------------------------------------------------

    async def _serve(self, flight: Flight, input_ids: Sequence[int]) -> web.StreamResponse:
        s = self.s
        self.flight = flight
        self.first_version = flight.lease.version if flight.lease is not None else None
        s.admission.register(flight)
        s.metrics.tokens.labels("prompt").inc(len(input_ids))
        if self.prep is not None:
            s.metrics.tokens.labels("prompt_new").inc(self.prep.new_tokens)
        # the generation prompt may open the reasoning block itself (DeepSeek R1's "<think>\n")
        self.opened = s.tok.reasoning.opens(s.tok.decode(list(input_ids[-8:]))) if input_ids else False
        kept = self.prep.partial if self.prep is not None else None
        gen = Generation(len(input_ids)) if kept is None else Generation.resumed(len(input_ids), kept.ids, kept.logprobs, kept.versions, kept.experts)
        self.gen = gen
        if self.req.stream:
            self.out = TextStream(
                self.request, self.wire, self.req, self._rid(), len(input_ids), s.tok, s.stop_ids, self._headers,
                self.opened,
            )
        try:
            if self.out is not None and gen.ids:  # resumed: what the client has not seen yet
                await self.out.push(gen.ids, False, False)
            await self._generate(input_ids)
            t0 = time.perf_counter()
            answer = self._answer(gen.output(), len(input_ids))
            self.timing.add("respond", t0)
            await self._record(answer, gen)
            if self.req.on_recorded is not None and self.sid is not None:
                await self.req.on_recorded(answer)  # Responses: keep the items (previous_response_id)
            t0 = time.perf_counter()
            if self.out is not None:
                resp = await self.out.end(answer)
            else:
                resp = await send(self.request, web.Response(
                    body=orjson.dumps(self.wire.response(self.req, answer, self._rid(), self._piece)),
                    content_type="application/json",
                    headers=self._headers(),
                ))  # fmt: skip
            self.timing.add("respond", t0)
            assert self.flight is not None
            settling = s.admission.completed(self.flight)
            if settling is not None:
                s.spawn(self._settling(settling, "completed"))
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            assert self.flight is not None
            s.spawn(self._client_gone(self.flight))
            raise
        except Exception as exc:
            f = classify(exc)
            if self.out is None or not self.out.started or f is None:
                raise  # answered by run() as an HTTP error
            await self._settle_failed(f, exc)
            self.request[STATUS_KEY] = f.error.status
            return await self.out.error(f.error)

    async def _generate(self, input_ids: Sequence[int]) -> None:
        """Engine calls until the answer is whole; a call a weight update stopped is held and
        continued (``--on-weight-update continue``), else the turn is aborted."""
        s, gen = self.s, self.gen
        while True:
            flight = self.flight
            assert flight is not None
            if flight.abort_reason is not None:
                raise TurnAborted(flight.abort_reason)
            budget = self.req.max_tokens - len(gen.ids)
            if s.max_context is not None:
                room = s.max_context - len(input_ids) - len(gen.ids)
                if room <= 0 and not gen.ids:
                    raise invalid(
                        f"the prompt of {len(input_ids)} tokens leaves no room to answer in the engine's "
                        f"context of {s.max_context} tokens",
                        "messages",
                    )
                budget = min(budget, room)
            if budget <= 0:
                gen.finish, gen.matched = "length", None
                return
            context = extend_ids(input_ids, gen.ids)
            ereq = EngineRequest(flight.rid, context, s.sampling(self.req, budget), s.experts and self.sid is not None)
            version = flight.lease.version if flight.lease is not None else 0
            gen.begin()
            flight.engine_started, flight.engine_done = True, False
            t0 = time.perf_counter()
            try:
                with s.spans.child(self.span, "engine", **{"tracestore.engine": flight.engine.url, "tracestore.version": version}):
                    if self.out is not None:
                        async for chunk in flight.engine.stream(ereq):
                            gen.add(chunk, version)
                            await self.out.push(chunk.ids, chunk.finish is not None, chunk.finish == "stop")
                    else:
                        gen.add_output(await flight.engine.generate(ereq), version)
            except (EngineRefused, EngineLost) as exc:
                if await holds.engine_back(self, exc):
                    continue  # the engine answers again: the same turn goes on under a new lease
                raise
            finally:
                self.timing.engine_s += time.perf_counter() - t0
            flight.engine_done = True
            if ereq.routed_experts and gen.experts is None and gen.ids:
                gen.experts_missing = True
            if gen.finish != "abort":
                return
            reason = flight.abort_reason or "engine_abort"
            if reason != "weight_update" or s.config.on_weight_update != "continue" or self.sid is None:
                raise TurnAborted(reason)
            await holds.hold(self, input_ids)

    # -- the answer and 4: the record -------------------------------------------------------

    def _answer(self, out: EngineOutput, prompt_tokens: int) -> Answer:
        assert self.flight is not None
        return build_answer(self.s, self.req, self.wire.NAME, self.flight, out, prompt_tokens, self.opened)

    async def _record(self, answer: Answer, gen: Generation) -> None:
        """Record the turn; the write is shielded from a client disconnect (it is the commit point)."""
        flight, prep, s = self.flight, self.prep, self.s
        if prep is None:  # a plain proxy request records nothing
            return
        assert flight is not None and flight.lease is not None and self.sid is not None
        t0 = time.perf_counter()
        await s.open_once(self.sid, self.owner)
        t1 = self.timing.add("record", t0)
        self.timing.store_s += t1 - t0
        experts = await s.prompts.put_experts(prep, gen.output())
        versions = gen.versions if len(gen.distinct_versions) > 1 else None
        t0 = self.timing.add("experts", t1)
        kept = s.retries.kept(self, answer)  # the answer kept for retries, in the same write
        flight.record_task = asyncio.ensure_future(
            s.db(s.prompts.write(prep, self.req, answer, experts, flight.lease.version, versions, kept))
        )
        try:
            with s.spans.child(self.span, "record"):
                await asyncio.shield(flight.record_task)
            s.retries.recorded(self, answer)
        finally:
            self.timing.store_s += self.timing.add("record", t0) - t0
        s.metrics.turns.inc()
        s.metrics.tokens.labels("completion").inc(answer.completion_tokens)
        if prep.fork is not None:
            s.metrics.forks.labels(prep.fork).inc()
        if self.continued or prep.partial is not None:
            s.metrics.held.labels("continued").inc()
        if (self.kept or prep.partial is not None) and prep.key is not None and self.sid is not None:
            s.spawn(s.db(s.store.drop_partial(self.sid, prep.key)))

    # -- 5: settling, failures, a client gone -----------------------------------------------

    async def _settle_failed(self, f: Failure, exc: BaseException) -> None:
        """Settle the flight (if any) with the failure's outcome and count it."""
        m = self.s.metrics
        if f.metric is not None:
            getattr(m, f.metric[0]).labels(f.metric[1]).inc()
        if isinstance(exc, TurnAborted):
            m.sealed.labels("weight_update").inc()
            m.aborted.labels(exc.reason).inc()
            if self.gen is not None:
                m.tokens.labels("discarded").inc(len(self.gen.ids))
        flight = self.flight
        if flight is None or flight.settled:
            return
        outcome = "aborted" if flight.abort_reason is not None and f.outcome == "failed" else f.outcome
        if isinstance(exc, EngineLost) and await flight.engine.stopped(flight.rid):
            outcome = "aborted"  # provably not running (aborted, or its engine gone): nothing to poison
        with self.s.spans.child(self.span, "settle", **{"tracestore.outcome": outcome}):
            await self.s.admission.settle_flight(flight, outcome)

    def _error_response(self, f: Failure) -> web.Response:
        return web.Response(
            body=orjson.dumps(self.wire.error_body(f.error)),
            status=f.error.status,
            content_type="application/json",
            headers=f.error.headers(),
        )

    async def _settling(self, settle: Awaitable[None], outcome: str) -> None:
        with self.s.spans.child(self.span, "settle", **{"tracestore.outcome": outcome}):
            await settle

    async def _client_gone(self, flight: Flight) -> None:
        """The client left (handler cancelled, or a write failed): abort, settle, record nothing new."""
        if flight.generating:
            await flight.engine.abort(flight.rid)
        outcome = "aborted"
        if flight.record_task is not None:
            try:
                await flight.record_task
                outcome = "completed"  # recorded before the client left: the turn stands
            except Exception:
                outcome = "failed"
        else:
            self.s.metrics.aborted.labels("client_disconnect").inc()
        await self.s.admission.settle_flight(flight, outcome)

    # -- small parts -------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        flight = self.flight
        assert flight is not None
        h = {"X-Request-Id": flight.rid}
        if flight.sid is not None:
            h["X-Session-Id"] = flight.sid
        if flight.lease is not None:
            h["X-Tracestore-Version"] = str(self.first_version if self.first_version is not None else flight.lease.version)
        versions = self.gen.distinct_versions
        if len(versions) > 1:
            h["X-Tracestore-Versions"] = ",".join(str(v) for v in versions)
        if self.prep is not None and self.prep.fork is not None:
            h["X-Tracestore-Fork"] = self.prep.fork
        return h

    def _piece(self, tid: int) -> str:
        return self.s.tok.decode([tid])

    def _rid(self) -> str:
        if self.req.response_id is not None:
            return self.req.response_id
        return new_id("msg_" if self.wire.NAME == "anthropic" else "chatcmpl-")


__all__ = ["STATUS_KEY", "Turn"]
