"""Rollout worker: a copy of the policy, reached in process through the gate and a TurnRecorder.

:class:`LocalModel` is how a turn reaches the model in this process (what
the session gateway does over HTTP): admit a gate lease, render and look up
the stored prefix (``TurnRecorder.before_request``), generate, record the
turn with its routed experts (``after_response``), settle the lease.
:class:`RolloutWorker` (a Ray actor) drives the calculator agent
(:mod:`~tracestore.trainer.agent`) over it for every sample it is given, and
keeps the session's routed experts in its ``RefHolder`` until the session is
released.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracestore import GateSealed, Lease, OwnerLost, TraceStore, TracestoreError, TurnRecorder
from tracestore.ray import HolderStats, RefHolder

from .actors import node_id, serve_host
from .agent import NoReply, Outcome, Reply, TurnRequest, drive, play
from .chat import render, strip_stop
from .clock import Stopwatch
from .config import TrainConfig
from .policy import load_numpy_state, new_policy, set_determinism
from .sample import Sample
from .tokenizer import TOKENIZER as TOK

log = logging.getLogger(__name__)


def holder_name(worker: str) -> str:
    """The name of worker ``worker``'s RefHolder (its consumer group on the release events)."""
    return f"holder-{worker}"


class _Aborted(Exception):
    """The engine aborted the request (a weight update is coming)."""


class LocalModel:
    """The worker's policy behind the run's gate, recording every turn (``turn`` per request)."""

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

    def abort(self) -> None:
        """Abort generation in flight until the next :meth:`load` (thread-safe)."""
        self._abort.set()

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Install new weights (the gate is sealed and drained: no generation runs)."""
        load_numpy_state(self.policy, state)
        self._abort.clear()

    def turn(self, req: TurnRequest, temperature: float) -> Outcome:
        """One assistant turn under a gate lease; the lease is settled with what happened.

        Sealed gate: aborted, nothing admitted. Engine abort: settled
        ``aborted``, nothing recorded (the turn is redone after the update).
        Any other error: settled ``failed`` (its outcome is known).
        """
        try:
            with self.store_time():
                lease: Lease = self.store.gate.admit(req.sid, self.name, self.cfg.lease_ttl_s)
        except GateSealed:
            return NoReply("aborted")
        t0 = time.perf_counter()
        try:
            content, stopped = self._generate_and_record(req, lease, temperature)
        except _Aborted:
            self._settle(req.sid, lease, "aborted")
            self.aborted_requests += 1
            return NoReply("aborted")
        except Exception as exc:
            self._settle(req.sid, lease, "failed")
            return NoReply("failed", f"{type(exc).__name__}: {exc}")
        with self.store_time():
            self.store.gate.settle(lease, "completed")
        self.turn_s.append(time.perf_counter() - t0)
        return Reply(content, stopped, lease.version)

    def _generate_and_record(
        self, req: TurnRequest, lease: Lease, temperature: float
    ) -> tuple[str, bool]:
        ids = self.recorder.before_request(req.sid, req.messages)
        gen = self.policy.generate(
            ids,
            max_new_tokens=self.cfg.max_new_tokens,
            stop_id=TOK.stop_id,
            generator=self.gen,
            temperature=temperature,
            should_abort=self._abort.is_set,
        )
        if gen.finish_reason == "abort":
            raise _Aborted
        content, stopped = strip_stop(TOK.decode(gen.output_ids))
        self.recorder.after_response(
            req.sid,
            req.messages,
            {"role": "assistant", "content": content},
            gen.output_ids,
            gen.logprobs,
            gen.routed_experts,
            lease.version,
        )
        return content, stopped

    def _settle(self, sid: str, lease: Lease, outcome: str) -> None:
        self.recorder.forget(sid)
        with self.store_time():
            self.store.gate.settle(lease, outcome)


@dataclass(frozen=True)
class WorkerStats:
    """What a worker did: its holder, turn latencies, time in tracestore and busy, counters."""

    holder: HolderStats
    turn_s: list[float]
    store_s: float
    busy_s: float
    invalid: int
    aborted_requests: int


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
        from tracestore.gateway._http import BackgroundServer

        from .engine import PolicyEngine

        if self._server is None:
            self.engine = PolicyEngine(self.model.policy, seed=self.cfg.seed + sum(map(ord, self.model.name)))

            async def make() -> Any:
                return self.engine.app()

            self._server = BackgroundServer(make, host=serve_host(self.cfg))
            self._server.start()
        return str(self._server.url)

    def run(self, samples: list[Sample], temperature: float = 1.0) -> list[Sample]:
        """Continue every unfinished sample until it ends, aborts (gate sealed) or fails."""
        model = functools.partial(self.model.turn, temperature=temperature)
        with self.busy():
            return [drive(play(s, self.cfg.max_calls), model) for s in samples]

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
        )

    def close(self) -> None:
        """Stop the heartbeat, the engine (if served), the holder's consumer (its group removed), close the store."""
        self._stop_heartbeats()
        if self._server is not None:
            self._server.stop()
        self.holder.close(destroy_group=True)
        self.store.close()
