"""Rollout worker: a copy of the policy, reached in process through the gate and a TurnRecorder.

:class:`LocalModel` is how turns reach the model in this process (what the
session gateway does over HTTP). It serves the turns of a round of samples at
once, with one batched store call per step instead of one per turn: admit
their gate leases (``admit_many``), render and look up the stored prefixes
(``TurnRecorder.prepare_many``), generate each, record the turns with their
routed experts (``after_response_many``), settle the leases (``settle_many``
per outcome, pipelined). A weight update that stops a generation either
throws it away (``--on-weight-update abort``) or holds it and continues it
under the new weights, one recorded turn with the version of each token
(``continue``, the default; :meth:`LocalModel.turns`,
:mod:`~tracestore.trainer.continuation`). :class:`RolloutWorker` (a Ray actor) drives the
calculator agents (:mod:`~tracestore.trainer.agent`) of the samples it is
given over it, round by round, and keeps the sessions' routed experts in its
``RefHolder`` until they are released (one ``put_many`` per round: the
round's turns share one object in the Ray object store).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracestore import GateSealed, Lease, OwnerLost, TraceStore, TracestoreError, TurnRecorder
from tracestore.ray import HolderStats, RefHolder
from tracestore.scripts import Op
from tracestore.session import Request, Response

from .actors import bulk_idle, lower_priority, node_id, serve_host
from .agent import NoReply, Outcome, Reply, TurnRequest, drive_many, play
from .chat import render, strip_stop
from .clock import Backoff, Stopwatch
from .config import TrainConfig
from .continuation import Continuation
from .dispatch import settle_calls
from .policy import load_numpy_state, new_policy, set_determinism
from .sample import Sample
from .tokenizer import TOKENIZER as TOK

log = logging.getLogger(__name__)


def holder_name(worker: str) -> str:
    """The name of worker ``worker``'s RefHolder (its consumer group on the release events)."""
    return f"holder-{worker}"


@dataclass
class _Turn:
    """One request of a round as it is served: its lease (a new one after each weight update
    it was held across) and its answer so far."""

    i: int
    req: TurnRequest
    prep: Request
    lease: Lease
    gen: Continuation
    generate_s: float = 0.0


@dataclass(frozen=True)
class PolicyCall:
    """One call of the worker's policy for a turn: the session, the version of the lease it ran
    under, the version of the weights the policy had, how many tokens it generated and how it
    ended (``stop``, ``length``, ``abort``). The worker keeps the last :data:`CALL_LOG` of them."""

    sid: str
    lease_version: int
    weight_version: int
    tokens: int
    finish: str


#: How many :class:`PolicyCall` records a worker keeps (tests and reports read them).
CALL_LOG = 20_000


class LocalModel:
    """The worker's policy behind the run's gate, recording every turn (``turns`` per round).

    With ``cfg.on_weight_update == "continue"`` a generation that a weight
    update stops keeps its tokens and resumes under the new weights (see
    :meth:`turns`); with ``abort`` it is thrown away.
    """

    def __init__(self, store: TraceStore, holder: RefHolder, name: str, cfg: TrainConfig) -> None:
        self.store = store
        self.name = name
        self.cfg = cfg
        self.continues = cfg.on_weight_update == "continue"
        self.recorder = TurnRecorder(store, render, TOK.encode, holder)
        self.policy = new_policy(TOK.vocab_size, seed=cfg.seed, max_len=256)
        self.gen = torch.Generator().manual_seed(cfg.seed * 1000 + sum(map(ord, name)))
        #: The version of the weights loaded (:meth:`load`).
        self.version = 0
        self.turn_s: list[float] = []
        self.aborted_requests = 0
        #: Tokens generated, then thrown away (an aborted turn, or one held past the timeout).
        self.tokens_discarded = 0
        #: Turns a weight update stopped that were then continued and recorded.
        self.turns_continued = 0
        #: Tokens the policy generated for turns (as they come: tests wait on it).
        self.tokens_generated = 0
        self.calls: deque[PolicyCall] = deque(maxlen=CALL_LOG)
        self.store_time = Stopwatch()  # gate calls (the recorder times its own)
        #: Set while the policy may generate: cleared by :meth:`abort`, set by :meth:`load`.
        self._may_run = threading.Event()
        self._may_run.set()
        #: Leases of the last round served, with their outcome: settled with the next round's admission.
        self._unsettled: list[tuple[Lease, str]] = []
        #: Armed by :meth:`abort_after_next_token`: set (and the policy stopped) at the next token.
        self._abort_at_token: threading.Event | None = None

    def abort(self) -> None:
        """Stop generation in flight until the next :meth:`load` (thread-safe)."""
        self._may_run.clear()

    def abort_after_next_token(self, timeout_s: float) -> bool:
        """:meth:`abort`, right after the next token the policy generates (within ``timeout_s``;
        then at once). True when a token came first: the abort landed mid-generation."""
        fired = threading.Event()
        self._abort_at_token = fired
        hit = fired.wait(timeout_s)
        self._abort_at_token = None
        self.abort()
        return hit

    def _aborting(self) -> bool:
        return not self._may_run.is_set()

    def load(self, state: dict[str, np.ndarray], version: int) -> None:
        """Install the weights of ``version`` (the gate is sealed and drained: no generation runs)."""
        load_numpy_state(self.policy, state)
        self.installed(version)

    def installed(self, version: int) -> None:
        """The policy has the weights of ``version`` now (loaded here, or by the engine serving it)."""
        self.version = version
        self._may_run.set()

    def turns(self, reqs: Sequence[TurnRequest], temperature: float) -> list[Outcome]:
        """One assistant turn for each request (distinct sessions), each under a gate lease.

        Two round trips for the whole round: one pipeline settles the leases
        of the previous round and admits this round's (``admit_many``) and
        looks up its prefixes (``prepare_many``); after generation, one
        records every answer (``after_response_many``). Call
        :meth:`settle_pending` when no round follows (or hand the leases to
        the caller: :meth:`take_unsettled`). Any error of a turn: settled
        ``failed`` (its outcome is known), nothing recorded.

        A weight update (:meth:`abort`, then the gate sealed): in ``abort``
        mode a sealed gate at admission ends every turn ``aborted`` (nothing
        admitted), and a stopped generation is settled ``aborted``, nothing
        recorded (the episode redoes the turn after the update). In
        ``continue`` mode admission waits for the gate to reopen; a stopped
        generation keeps its ids, logprobs and routed experts, the answers
        done are recorded and every lease of the round settled at once (the
        drain is not held), and once the new weights are in and the gate
        reopens the stopped turns are admitted again and resume from prompt +
        kept ids with the rest of the budget: one recorded turn each, with
        per-token versions. A turn held past ``hold_timeout_s`` ends as in
        ``abort`` mode.
        """
        if not reqs:
            return []
        t0 = time.perf_counter()
        leases, prepared = self._admit_and_prepare(reqs)
        if leases is None:
            return [NoReply("aborted") for _ in reqs]
        store_s = time.perf_counter() - t0
        outcome: dict[int, Outcome] = {}
        running: list[_Turn] = []
        for i, (req, prep) in enumerate(zip(reqs, prepared, strict=True)):
            if isinstance(prep, Exception):
                self._end(i, req, leases[i], NoReply("failed", f"{type(prep).__name__}: {prep}"), outcome)
            else:
                running.append(_Turn(i, req, prep, leases[i], Continuation(list(prep.token_ids))))
        done: list[_Turn] = []
        answered: list[_Turn] = []
        while running:
            stopped: list[_Turn] = []
            for t in running:
                failed = self._call(t, temperature)
                if failed is not None:
                    self._end(t.i, t.req, t.lease, failed, outcome)
                else:
                    (stopped if t.gen.finish == "abort" else done).append(t)
            if not stopped:
                break
            if not self.continues:
                for t in stopped:
                    self._give_up(t, outcome, settled=False)
                break
            # continue: what is done is recorded and every lease of the round settled now, so
            # the drain goes on; the stopped turns wait for the new weights and an open gate
            answered += self._record(done, outcome)
            done = []
            self._unsettled += [(t.lease, "aborted") for t in stopped]
            self.settle_pending()
            fresh = self._readmit([t.req.sid for t in stopped])
            if fresh is None:
                for t in stopped:
                    self._give_up(t, outcome, settled=True)
                break
            for t, lease in zip(stopped, fresh, strict=True):
                t.lease = lease
                t.gen.held += 1
            running = stopped
        t1 = time.perf_counter()
        answered += self._record(done, outcome)
        store_s += time.perf_counter() - t1
        # a turn's latency: its generation and its share of the round's batched store calls
        # (a turn held across a weight update: without the wait for the new weights)
        self.turn_s += [t.generate_s + store_s / len(reqs) for t in answered]
        return [outcome[i] for i in range(len(reqs))]

    def _end(self, i: int, req: TurnRequest, lease: Lease, o: NoReply, outcome: dict[int, Outcome]) -> None:
        """Turn ``i`` ends without an answer: its lease settles with the round's, the prefix is forgotten."""
        outcome[i] = o
        self._unsettled.append((lease, o.status))
        self.recorder.forget(req.sid)

    def _give_up(self, t: _Turn, outcome: dict[int, Outcome], *, settled: bool) -> None:
        """A stopped turn is thrown away (``abort`` mode, or held past the timeout): aborted."""
        self.tokens_discarded += len(t.gen.ids)
        why = "held past hold_timeout_s" if settled else None
        outcome[t.i] = NoReply("aborted", why)
        if not settled:
            self._unsettled.append((t.lease, "aborted"))
        self.recorder.forget(t.req.sid)

    def _call(self, t: _Turn, temperature: float) -> NoReply | None:
        """One policy call for ``t`` from its input so far (``t.gen`` gets what it generated).

        None when it ran or was stopped by a weight update (``t.gen.finish ==
        "abort"``; stopped before it started: no call); NoReply when it failed.
        """
        if self._aborting():  # a weight update is under way: this call would stop at once
            t.gen.stopped_before_start()
            self.aborted_requests += 1
            return None
        t0 = time.perf_counter()
        weights = self.version
        try:
            gen = self.policy.generate(
                t.gen.input_ids,
                max_new_tokens=t.gen.budget(self.cfg.max_new_tokens),
                stop_id=TOK.stop_id,
                generator=self.gen,
                temperature=temperature,
                should_abort=self._aborting,
                on_token=self._count,
            )
            t.gen.add(gen, t.lease.version)
        except Exception as exc:
            return NoReply("failed", f"{type(exc).__name__}: {exc}")
        finally:
            t.generate_s += time.perf_counter() - t0
        self.calls.append(PolicyCall(t.req.sid, t.lease.version, weights, len(gen.output_ids), gen.finish_reason))
        if gen.finish_reason == "abort":
            self.aborted_requests += 1
        return None

    def _count(self, token: int, logprob: float) -> None:
        self.tokens_generated += 1
        fired = self._abort_at_token
        if fired is not None:  # stop before the next token: this one is the last of the call
            self.abort()
            fired.set()

    def _record(self, turns: list[_Turn], outcome: dict[int, Outcome]) -> list[_Turn]:
        """Record the answers of ``turns`` (one ``after_response_many``); their leases settle
        ``completed`` (``failed`` when the record failed) with the round's. Returns those recorded.

        A continued turn is recorded under its last lease's version with the
        version of each token; its reply carries the version of its first
        token (the one it was admitted under, as the gateway's ``X-Tracestore-Version``).
        """
        if not turns:
            return []
        texts = [strip_stop(TOK.decode(t.gen.ids)) for t in turns]
        recorded = self.recorder.after_response_many(
            [
                Response(
                    t.req.sid, t.req.messages, {"role": "assistant", "content": content}, t.gen.ids,
                    t.gen.logprobs, t.gen.experts, t.lease.version, t.gen.mixed_versions,
                )
                for t, (content, _) in zip(turns, texts, strict=True)
            ]
        )
        ok: list[_Turn] = []
        for t, (content, stopped), turn in zip(turns, texts, recorded, strict=True):
            if isinstance(turn, Exception):
                self._end(t.i, t.req, t.lease, NoReply("failed", f"{type(turn).__name__}: {turn}"), outcome)
                continue
            first = t.gen.first_version
            outcome[t.i] = Reply(content, stopped, t.lease.version if first is None else first)
            self._unsettled.append((t.lease, "completed"))
            self.turns_continued += 1 if t.gen.held else 0
            ok.append(t)
        return ok

    def _readmit(self, sids: list[str]) -> list[Lease] | None:
        """Leases for the stopped turns of ``sids`` once the new weights are in and the gate
        reopened; None past ``hold_timeout_s``. Polls the gate (``admit_many``) while it is sealed."""
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        pause = Backoff(cap_s=0.1)
        while True:
            if not self._may_run.wait(max(0.0, deadline - time.monotonic())):
                return None
            try:
                with self.store_time():
                    return list(self.store.gate.admit_many([(s, self.name) for s in sids], self.cfg.lease_ttl_s))
            except GateSealed:
                if time.monotonic() > deadline:
                    return None
                pause.sleep()

    def _admit_and_prepare(
        self, reqs: Sequence[TurnRequest]
    ) -> tuple[list[Lease] | None, list[Request | TracestoreError]]:
        """One pipeline: settle the last round, admit and look up this one. None when sealed
        (in ``continue`` mode: when it stays sealed past ``hold_timeout_s``; it waits until then)."""
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        pause = Backoff(cap_s=0.1)
        while True:
            got = self._try_admit_and_prepare(reqs)
            if got[0] is not None or not self.continues or time.monotonic() > deadline:
                return got
            pause.sleep()

    def _try_admit_and_prepare(
        self, reqs: Sequence[TurnRequest]
    ) -> tuple[list[Lease] | None, list[Request | TracestoreError]]:
        """One try of :meth:`_admit_and_prepare`."""
        rec_s, t0 = self.recorder.stats.store_s, time.perf_counter()
        admitted, prepared, *settled = self.store.gather(
            self.store.ops.gate.admit_many([(r.sid, self.name) for r in reqs], self.cfg.lease_ttl_s),
            self.recorder.ops.prepare_many([(r.sid, r.messages) for r in reqs]),
            *self._settle_calls(),
            errors_in_place=True,
        )
        # the lookups' time is the recorder's (it timed them): count the rest once, here
        self.store_time.add(time.perf_counter() - t0 - (self.recorder.stats.store_s - rec_s))
        for err in (x for x in settled if isinstance(x, Exception)):
            raise err
        if isinstance(admitted, GateSealed):
            for r in reqs:
                self.recorder.forget(r.sid)
            return None, []
        if isinstance(admitted, Exception):
            raise admitted
        if isinstance(prepared, Exception):
            raise prepared
        return admitted, prepared

    def _settle_calls(self) -> list[Op[Any]]:
        """The settlements of the leases served since the last ones (a pipeline per outcome)."""
        return settle_calls(self.store.ops, self.take_unsettled())

    def take_unsettled(self) -> list[tuple[Lease, str]]:
        """The leases served since the last settlement, with their outcome; the caller settles them."""
        out, self._unsettled = self._unsettled, []
        return out

    def settle_pending(self) -> None:
        """Settle the leases of the last round served (one round trip; nothing when none)."""
        calls = self._settle_calls()
        if calls:
            with self.store_time():
                self.store.gather(*calls)


@dataclass(frozen=True)
class WorkerStats:
    """What a worker did: its holder, turn latencies, time in tracestore and busy, counters."""

    holder: HolderStats
    turn_s: list[float]
    #: Time in tracestore calls, the holder's puts of routed experts included.
    store_s: float
    busy_s: float
    invalid: int
    aborted_requests: int
    #: Of ``store_s``: the holder's puts (``RefHolder.put_many``: a ``ray.put`` per round).
    holder_s: float = 0.0
    #: Tokens generated, then thrown away (aborted turns; in ``continue`` mode only turns held
    #: past the timeout).
    tokens_discarded: int = 0
    #: Turns a weight update stopped, continued under the new weights and recorded once.
    turns_continued: int = 0
    #: Tokens its policy generated (local agents' turns and, with ``--agents http``, its engine's).
    tokens_generated: int = 0


class RolloutWorker:
    """A Ray actor (threaded: the learner borrows refs and pushes weights while it runs)."""

    def __init__(self, cfg: TrainConfig, name: str) -> None:
        lower_priority(idle=bulk_idle(cfg))  # bulk work: the gateway's event loop goes first (actors.BULK_NICENESS)
        self.cfg = cfg
        set_determinism(cfg.seed)
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.holder = RefHolder(self.store, name=holder_name(name))
        self.model = LocalModel(self.store, self.holder, name, cfg)
        self.busy = Stopwatch()
        self.engine: Any = None  # a PolicyEngine over the same policy, with --agents http
        self._server: Any = None
        self._alive = threading.Event()
        self._heartbeats: threading.Thread | None = None

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return node_id()

    def keep_alive(self, owner: str, ttl_s: float) -> None:
        """Heartbeat ``owner`` (the tag the producer hands this worker's sessions to) from now on.

        A background thread renews the tag every ``ttl_s / 3`` seconds until
        :meth:`close`, so when this process or its node dies, the heartbeat
        stops and ``gc`` declares the tag lost ``ttl_s`` later (its sessions
        are released as ``owner-lost``). Replaces the tag kept alive before.
        The first heartbeat is sent before this returns.
        """
        self._stop_heartbeats()
        self.store.heartbeat(owner, ttl_s)
        stop = threading.Event()
        self._alive = stop

        def beat() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    self.store.heartbeat(owner, ttl_s)
                except OwnerLost:  # gc gave up on us (a pause longer than the TTL): stop vouching
                    log.error("owner %s was declared lost; its heartbeat stops", owner)
                    return
                except TracestoreError as exc:  # the store is away: the next beat retries
                    log.warning("heartbeat of %s failed: %s", owner, exc)

        self._heartbeats = threading.Thread(target=beat, name=f"heartbeat-{owner}", daemon=True)
        self._heartbeats.start()

    def _stop_heartbeats(self) -> None:
        self._alive.set()
        if self._heartbeats is not None:
            self._heartbeats.join()
            self._heartbeats = None

    def serve_http(self) -> str:
        """Serve this worker's policy over HTTP (SGLang's /generate shape); returns its URL.

        With ``--agents http`` the gateway sends every turn here; weights and
        aborts then go through the engine (its worker thread, between generations).
        """
        from tracestore.gateway.serve import BackgroundServer

        from .engine import PolicyEngine

        if self._server is None:
            self.engine = PolicyEngine(self.model.policy, seed=self.cfg.seed + sum(map(ord, self.model.name)))

            async def make() -> Any:
                return self.engine.app()

            self._server = BackgroundServer(make, host=serve_host(self.cfg))
            self._server.start()
        return str(self._server.url)

    def run(self, samples: list[Sample], temperature: float = 1.0) -> list[Sample]:
        """Continue every unfinished sample until it ends, aborts (a weight update, in ``abort``
        mode) or fails.

        The samples' turns are served in rounds (:func:`~.agent.drive_many`),
        so that each round's store calls are batched.
        """
        model = functools.partial(self.model.turns, temperature=temperature)
        with self.busy():
            try:
                return drive_many([play(s, self.cfg.max_calls) for s in samples], model)
            finally:
                self.model.settle_pending()

    def run_unsettled(
        self, samples: list[Sample], temperature: float = 1.0
    ) -> tuple[list[Sample], list[tuple[Lease, str]]]:
        """:meth:`run`, but the leases of the last round are handed back with their outcome
        instead of settled here: the caller settles them in a round trip it makes anyway
        (:meth:`~.dispatch.WorkerPool.run_unsettled`), one round trip less per run.

        Settled here when the run fails, as :meth:`run` does, and always in
        ``continue`` mode: there a worker that holds a generation across a
        weight update waits for the update to end, and the caller (waiting
        for every worker) would settle the others' leases only after that,
        while the update's drain waits for those leases.
        """
        model = functools.partial(self.model.turns, temperature=temperature)
        with self.busy():
            try:
                out = drive_many([play(s, self.cfg.max_calls) for s in samples], model)
            except BaseException:
                self.model.settle_pending()
                raise
            if self.model.continues:
                self.model.settle_pending()
            return out, self.model.take_unsettled()

    def abort_requests(self, mid_generation_s: float = 0.0) -> None:
        """Stop generation in flight (before a weight update) until :meth:`set_weights`.

        ``mid_generation_s > 0`` (tests: ``TrainConfig.update_mid_generation_s``):
        wait up to that long for the policy's next token and stop right
        after it, so the update lands inside a generation. The wait does not
        need a run in progress: between two rounds the next one starts
        within milliseconds (under the knob the producer never pauses), and
        an update that found every worker between rounds would stop nothing.

        ``abort`` mode: an aborted request records nothing, its lease is
        settled ``aborted`` and its episode returns as ``aborted``, to be
        claimed back and continued after the update. ``continue`` mode: the
        local agents' generations are held and resumed after the update
        (:meth:`LocalModel.turns`); the engine (``--agents http``) is left to
        the gateway, whose seal watcher stops its requests once the gate is
        sealed and holds them (an engine abort before the seal would reach the
        gateway as a failed request, not a held one).
        """
        if mid_generation_s > 0:
            self.model.abort_after_next_token(mid_generation_s)
        self.model.abort()
        if self.engine is not None and not self.model.continues:
            self.engine.abort_all()

    def set_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        """Load weights of ``version`` (the gate is sealed and drained); returns ``version``."""
        if self.engine is not None:  # the engine's thread (the same policy): never under a generation
            self.engine.set_weights(state, version)
            self.model.installed(version)
        else:
            self.model.load(state, version)
        return version

    def generated_tokens(self) -> int:
        """Tokens the policy generated for local agents' turns so far (counted as they come)."""
        return self.model.tokens_generated

    def policy_calls(self, sids: list[str] | None = None) -> list[PolicyCall]:
        """The last policy calls of local agents' turns (of ``sids`` only, when given), oldest first."""
        keep = None if sids is None else set(sids)
        return [c for c in self.model.calls if keep is None or c.sid in keep]

    def get_refs(self, keys: list[str]) -> list[Any]:
        """Lend the ObjectRefs of ``keys`` (the caller borrows them; Ray counts the borrow)."""
        return self.holder.get(keys)

    def stats(self) -> WorkerStats:
        """Counters for the report (the recorder's store and holder time count as tracestore's)."""
        rec = self.model.recorder.stats
        return WorkerStats(
            holder=self.holder.stats(),
            turn_s=list(self.model.turn_s),
            store_s=self.model.store_time.seconds + rec.store_s + rec.holder_s,
            busy_s=self.busy.seconds,
            invalid=rec.invalid,
            aborted_requests=self.model.aborted_requests + (self.engine.aborted if self.engine else 0),
            holder_s=rec.holder_s,
            tokens_discarded=self.model.tokens_discarded,
            turns_continued=self.model.turns_continued,
            tokens_generated=self.model.tokens_generated + (self.engine.batcher.tokens if self.engine else 0),
        )

    def close(self) -> None:
        """Stop the heartbeat, the engine (if served), the holder's consumer (its group removed), close the store."""
        self._stop_heartbeats()
        if self._server is not None:
            self._server.stop()
        self.holder.close(destroy_group=True)
        self.store.close()
