"""Where a turn waits: for the gate to reopen, or for its engine to come back.

Functions of a :class:`~.turn.Turn` (``turn``), which calls them.

* **Held** (``--on-weight-update continue``): a weight update stopped the
  turn's generation. Its lease is settled (the drain goes on), its tokens so
  far are kept in the store (a retry on any gateway resumes from them), and
  once the gate reopens the turn is admitted anew and continues.
* **Engine back** (``--engine-wait``): the engine refused the turn's request,
  or lost it and the request provably runs no more (the engine stopped it, or
  is gone). The lease is settled ``aborted``, the turn waits for the engine to
  answer its health check again, is admitted anew and goes on from the tokens
  it has (a stream continues where it was cut; a whole answer is asked for
  again). Past the wait it fails as without it (502).

Streams get keep-alive comments while they wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..errors import GateSealed, TracestoreError
from ..gate import Lease
from .admission import Flight
from .chat import new_id
from .engines import EngineLost, EngineRefused
from .failures import TurnAborted

log = logging.getLogger(__name__)

#: How often a turn waiting for its engine to come back asks for its health (s).
ENGINE_POLL_S = 0.25


async def hold(turn: Any, input_ids: Sequence[int]) -> None:
    """Settle the lease (the drain goes on), keep the tokens so far in the store (a retry on
    any gateway resumes from them), wait for the gate to reopen, and admit the turn again
    (a new engine request id) to continue it."""
    s, flight, gen = turn.s, turn.flight, turn.gen
    assert flight is not None and turn.sid is not None
    # the engine request is over: settle first, so the drain never waits on the keeping
    await s.admission.settle_flight(flight, "aborted")
    s.metrics.held.labels("held").inc()
    if turn.prep is not None and turn.prep.key is not None:
        try:
            await s.db(
                s.store.keep_partial(
                    turn.sid, turn.prep.key, gen.ids, gen.logprobs, gen.versions, len(input_ids),
                    ttl_s=s.config.hold_timeout_s, experts=gen.kept_experts(len(input_ids) - turn.prep.new_tokens),
                )
            )
            turn.kept = True
        except TracestoreError as exc:  # kept in this process only: a retry elsewhere regenerates
            log.warning("gateway: could not keep the tokens of held turn %s: %s", flight.rid, exc)
    rid = new_id("req-")
    lease = await wait_for_gate(turn, turn.sid, flight.engine.url, rid)
    nxt = Flight(rid, turn.sid, flight.engine, lease)
    turn.flight = nxt
    s.admission.register(nxt)
    turn.continued = True

async def engine_back(turn: Any, exc: EngineRefused | EngineLost) -> bool:
    """The engine refused or lost this turn's request: when the request provably runs no more
    (refused; or lost, and its engine stopped it or is gone), settle its lease, wait (at most
    ``--engine-wait``) for the engine to answer again and admit the turn anew; True then (the
    caller goes on from the tokens it has: a stream continues, a whole answer is asked again).
    False: fail as without waiting."""
    s, flight = turn.s, turn.flight
    if s.config.engine_wait_s <= 0 or turn.sid is None or flight is None or flight.lease is None:
        return False
    if isinstance(exc, EngineLost) and not await flight.engine.stopped(flight.rid):
        return False  # it may still run: its outcome is unknown
    await s.admission.settle_flight(flight, "aborted")  # nothing runs under it: no poison
    if s.liveness is not None:
        s.liveness.engines_up[flight.engine.url] = False
    deadline = time.monotonic() + s.config.engine_wait_s
    while not await flight.engine.health():
        if time.monotonic() >= deadline:
            s.metrics.engine_waits.labels("timed_out").inc()
            return False
        if turn.out is not None:
            await turn.out.keepalive()
        await asyncio.sleep(ENGINE_POLL_S)
    if s.liveness is not None:
        s.liveness.engines_up[flight.engine.url] = True
    s.metrics.engine_waits.labels("resumed").inc()
    rid = new_id("req-")
    nxt = Flight(rid, turn.sid, flight.engine, await wait_for_gate(turn, turn.sid, flight.engine.url, rid))
    turn.flight = nxt
    s.admission.register(nxt)
    return True

async def wait_for_gate(turn: Any, sid: str, engine: str | None, rid: str) -> Lease:
    """Wait (at most ``--hold-timeout``) until the gate reopens and admits ``sid``; its lease.

    Raises TurnAborted("hold_timeout") when it does not, and what admission raises
    otherwise (SessionReleased...). Streams get keep-alive comments meanwhile.
    """
    s = turn.s
    deadline = time.monotonic() + s.config.hold_timeout_s
    with s.admission.holding():
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                s.metrics.held.labels("timed_out").inc()
                raise TurnAborted("hold_timeout")
            if not await s.admission.wait_open(min(left, 10.0)):
                if turn.out is not None:
                    await turn.out.keepalive()
                continue
            try:
                lease: Lease = await s.admission.admit(sid, engine, rid)
                return lease
            except GateSealed:
                s.admission.sealed()


__all__ = ["ENGINE_POLL_S", "engine_back", "hold", "wait_for_gate"]
