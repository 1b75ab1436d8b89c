"""Rollout worker: a copy of the policy, reached in process through the gate and a TurnRecorder.

:class:`LocalModel` is how turns reach the model in this process (what the
session gateway does over HTTP). It serves the turns of a round of samples at
once, with one batched store call per step instead of one per turn: admit
their gate leases (``admit_many``), render and look up the stored prefixes
(``TurnRecorder.prepare_many``), generate each, record the turns with their
routed experts (``after_response_many``), settle the leases (``settle_many``
per outcome, pipelined). :class:`RolloutWorker` (a Ray actor) drives the
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracestore import GateSealed, Lease, OwnerLost, TraceStore, TracestoreError, TurnRecorder
from tracestore.ray import HolderStats, RefHolder
from tracestore.scripts import Op
from tracestore.session import Request, Response

from .actors import node_id, serve_host
from .agent import NoReply, Outcome, Reply, TurnRequest, drive_many, play
from .chat import render, strip_stop
from .clock import Stopwatch
from .config import TrainConfig
from .dispatch import settle_calls
from .policy import load_numpy_state, new_policy, set_determinism
from .sample import Sample
from .tokenizer import TOKENIZER as TOK

log = logging.getLogger(__name__)


def holder_name(worker: str) -> str:
    """The name of worker ``worker``'s RefHolder (its consumer group on the release events)."""
    return f"holder-{worker}"


@dataclass(frozen=True)
class _Answer:
    """A generated answer, before it is recorded: what to record, what to reply, how long it took."""

    response: Response
    reply: Reply
    generate_s: float


class LocalModel:
    """The worker's policy behind the run's gate, recording every turn (``turns`` per round)."""

    def __init__(self, store: TraceStore, holder: RefHolder, name: str, cfg: TrainConfig) -> None:
        self.store = store
        self.name = name
        self.cfg = cfg
        self.recorder = TurnRecorder(store, render, TOK.encode, holder)
        self.policy = new_policy(TOK.vocab_size, seed=cfg.seed, max_len=256)
        self.gen = torch.Generator().manual_seed(cfg.seed * 1000 + sum(map(ord, name)))
        self.turn_s: list[float] = []
        self.aborted_requests = 0
        self.store_time = Stopwatch()  # gate calls (the recorder times its own)
        self._abort = threading.Event()
        #: Leases of the last round served, with their outcome: settled with the next round's admission.
        self._unsettled: list[tuple[Lease, str]] = []

    def abort(self) -> None:
        """Abort generation in flight until the next :meth:`load` (thread-safe)."""
        self._abort.set()

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Install new weights (the gate is sealed and drained: no generation runs)."""
        load_numpy_state(self.policy, state)
        self._abort.clear()

    def turns(self, reqs: Sequence[TurnRequest], temperature: float) -> list[Outcome]:
        """One assistant turn for each request (distinct sessions), each under a gate lease.

        Two round trips for the whole round: one pipeline settles the leases
        of the previous round and admits this round's (``admit_many``) and
        looks up its prefixes (``prepare_many``); after generation, one
        records every answer (``after_response_many``). Call
        :meth:`settle_pending` when no round follows (or hand the leases to
        the caller: :meth:`take_unsettled`). Sealed gate: every
        turn aborted, nothing admitted. Engine abort: settled ``aborted``,
        nothing recorded (the turn is redone after the update). Any other
        error: settled ``failed`` (its outcome is known).
        """
        if not reqs:
            return []
        t0 = time.perf_counter()
        leases, prepared = self._admit_and_prepare(reqs)
        if leases is None:
            return [NoReply("aborted") for _ in reqs]
        store_s = time.perf_counter() - t0
        outcome: dict[int, Outcome] = {}
        answers: dict[int, _Answer] = {}
        for i, (req, prep) in enumerate(zip(reqs, prepared, strict=True)):
            got = self._generate(req, prep, leases[i], temperature)
            if isinstance(got, _Answer):
                answers[i] = got
            else:
                outcome[i] = got
        t1 = time.perf_counter()
        turns = self.recorder.after_response_many([a.response for a in answers.values()])
        store_s += time.perf_counter() - t1
        for (i, a), turn in zip(answers.items(), turns, strict=True):
            failed = isinstance(turn, Exception)
            outcome[i] = NoReply("failed", f"{type(turn).__name__}: {turn}") if failed else a.reply
        for i, lease in enumerate(leases):
            o = outcome[i]
            self._unsettled.append((lease, "completed" if isinstance(o, Reply) else o.status))
            if not isinstance(o, Reply):
                self.recorder.forget(reqs[i].sid)
        # a turn's latency: its generation and its share of the round's batched store calls
        self.turn_s += [a.generate_s + store_s / len(reqs) for a in answers.values()]
        return [outcome[i] for i in range(len(reqs))]

    def _admit_and_prepare(
        self, reqs: Sequence[TurnRequest]
    ) -> tuple[list[Lease] | None, list[Request | TracestoreError]]:
        """One pipeline: settle the last round, admit and look up this one. None when sealed."""
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

    def _generate(
        self, req: TurnRequest, prep: Request | Exception, lease: Lease, temperature: float
    ) -> _Answer | NoReply:
        """Generate the answer of one prepared request (NoReply when it failed or was aborted)."""
        if isinstance(prep, Exception):
            return NoReply("failed", f"{type(prep).__name__}: {prep}")
        t0 = time.perf_counter()
        try:
            gen = self.policy.generate(
                prep.token_ids,
                max_new_tokens=self.cfg.max_new_tokens,
                stop_id=TOK.stop_id,
                generator=self.gen,
                temperature=temperature,
                should_abort=self._abort.is_set,
            )
        except Exception as exc:
            return NoReply("failed", f"{type(exc).__name__}: {exc}")
        if gen.finish_reason == "abort":
            self.aborted_requests += 1
            return NoReply("aborted")
        content, stopped = strip_stop(TOK.decode(gen.output_ids))
        answer = {"role": "assistant", "content": content}
        response = Response(
            req.sid, req.messages, answer, gen.output_ids, gen.logprobs, gen.routed_experts, lease.version
        )
        return _Answer(response, Reply(content, stopped, lease.version), time.perf_counter() - t0)


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


class RolloutWorker:
    """A Ray actor (threaded: the learner borrows refs and pushes weights while it runs)."""

    def __init__(self, cfg: TrainConfig, name: str) -> None:
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
        """Continue every unfinished sample until it ends, aborts (gate sealed) or fails.

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

        Settled here when the run fails, as :meth:`run` does.
        """
        model = functools.partial(self.model.turns, temperature=temperature)
        with self.busy():
            try:
                out = drive_many([play(s, self.cfg.max_calls) for s in samples], model)
            except BaseException:
                self.model.settle_pending()
                raise
            return out, self.model.take_unsettled()

    def abort_requests(self) -> None:
        """Abort generation in flight (before a weight update); cleared by :meth:`set_weights`.

        An aborted request records nothing, its lease is settled ``aborted``
        and its episode returns as ``aborted``, to be claimed back and
        continued after the update.
        """
        self.model.abort()
        if self.engine is not None:
            self.engine.abort_all()

    def set_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        """Load weights of ``version`` (the gate is sealed and drained); returns ``version``."""
        if self.engine is not None:  # the engine's thread: never under a generation
            self.engine.set_weights(state, version)
        else:
            self.model.load(state)
        return version

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
        )

    def close(self) -> None:
        """Stop the heartbeat, the engine (if served), the holder's consumer (its group removed), close the store."""
        self._stop_heartbeats()
        if self._server is not None:
            self._server.stop()
        self.holder.close(destroy_group=True)
        self.store.close()
