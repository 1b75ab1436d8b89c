"""Learner: takes ``train:<step>`` batches, trains with routing replay, syncs weights through the gate.

A step: ``replay.take`` moves ``prompts_per_step`` completed groups to the
owner tag ``train:<step>`` -> their batch (:mod:`.batch`: exported traces,
borrowed routed experts) -> one GRPO step -> ``release_owner`` of the step's
tag and ``router.retire`` -> every ``sync_every`` steps, a weight update
through the gate (abort generation in flight, seal, drain, push, install,
reopen) -> every ``eval_every`` steps, an evaluation.

A rollout worker found dead (its node was lost) is reclaimed before the
next weight update (:func:`~.housekeeping.reclaim_lost_worker`: gc declares
its owner tags lost, its poisoned leases are cleared), and the run goes on
with the others.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from tracestore import GatePoisoned, Group, NotDrained, TraceStore

from .actors import Workers, bulk_idle, lower_priority, node_id
from .batch import Batch, BatchBuilder
from .checkpoint import CheckpointState, load_model, write_checkpoint
from .clock import Backoff, Stopwatch
from .config import TASK, TrainConfig
from .dispatch import WorkerPool
from .evaluation import Evaluator
from .grpo import collate, train_step
from .housekeeping import reclaim_lost_worker
from .http_agents import GATEWAY_HOLDER
from .policy import new_policy, replay_logprobs, set_determinism, state_to_numpy
from .steps import StepRecord
from .tokenizer import TOKENIZER as TOK
from .warmup import warm_start


@dataclass(frozen=True)
class LearnerStats:
    """Time in tracestore and busy, weight updates, the current version, routing fallbacks."""

    store_s: float
    busy_s: float
    gate_cycles: int
    version: int
    replay_fallbacks: int
    baseline_eval: float | None
    #: Workers found dead, with what reclaiming each did (owner tags, sessions, leases).
    lost_workers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


class Learner:
    """A Ray actor (one thread)."""

    def __init__(
        self,
        cfg: TrainConfig,
        workers: Workers,
        gateways: Workers | None = None,
        gateway_urls: dict[str, str] | None = None,
    ) -> None:
        lower_priority(idle=bulk_idle(cfg))  # bulk work: the gateway's event loop goes first (actors.BULK_NICENESS)
        self.cfg = cfg
        # routed experts are borrowed from the workers, and from the gateways with --agents http
        holders: Workers = dict(gateways or {})
        set_determinism(cfg.seed)
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.pool = WorkerPool(self.store, workers)
        self.store_time = Stopwatch()
        self.busy = Stopwatch()
        # evaluation samples go through the first gateway (their experts are not trained on)
        eval_url = gateway_urls[GATEWAY_HOLDER] if gateway_urls else None
        self.evaluate = Evaluator(cfg, self.store, self.pool, self.store_time, eval_url)
        self.batches = BatchBuilder(self.store, self.pool, self.store_time, holders)
        self.model = new_policy(TOK.vocab_size, seed=cfg.seed, max_len=256)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.version = 0
        self.history: list[StepRecord] = []
        self.gate_cycles = 0
        self.baseline_eval: float | None = None
        self.lost_workers: dict[str, dict[str, int]] = {}

    def node_id(self) -> str:
        """The Ray node the learner runs on."""
        return node_id()

    def init(self, state: CheckpointState | None) -> int:
        """Warm start (or load the checkpoint), push weights to the workers; returns the next step."""
        start = 1
        if state is not None:
            load_model(self.cfg, self.model, self.opt)
            self.history = list(state.history)
            self.gate_cycles = state.gate_cycles
            self.baseline_eval = state.baseline_eval
            start = state.step + 1
        else:
            warm_start(self.model, TOK, steps=self.cfg.warmup_steps, seed=self.cfg.seed)
        # busy like a step's: the share of time in tracestore calls counts these calls over it
        with self.busy():
            with self.store_time():
                self.version = self.store.gate.status().version
            self._push(self.version)
            if start == 1:
                self.baseline_eval = self.evaluate(0, self.version)  # the warm start, before RL
        return start

    # -- one step ------------------------------------------------------------------------------

    def step(self, step: int, wait_s: float = 60.0) -> StepRecord:
        """Train on one batch (waiting up to ``wait_s`` for it); the step's record.

        Raises RuntimeError when no batch is ready in time (every group
        filtered, i.e. the policy collapsed, or the producer stalled).
        """
        with self.busy():
            owner = f"train:{step}"
            t0 = time.perf_counter()
            groups = self._take(owner, step, wait_s)
            wait = time.perf_counter() - t0
            batch = self.batches.build(groups, self.version)
            align = self._alignment(batch)
            stats = train_step(self.model, self.opt, batch.samples, TOK.pad_id)
            released = self._release(owner, batch.sids)
            synced = self._sync_weights(step)
            rec = StepRecord(
                step=step,
                reward=float(np.mean(batch.rewards)),
                staleness_mean=float(np.mean(batch.staleness)),
                staleness_max=int(max(batch.staleness)),
                groups=batch.groups,
                samples=len(batch.samples),
                released=released,
                taken=len(batch.sids),
                loss=stats["loss"],
                approx_kl=stats["approx_kl"],
                replay_max_abs_diff=align,
                version=self.version,
                synced=synced,
                wait_s=wait,
            )
            if step % self.cfg.eval_every == 0 or step == self.cfg.steps:
                rec = dataclasses.replace(rec, eval_reward=self.evaluate(step, self.version))
            self.history.append(rec)
            return rec

    def _take(self, owner: str, step: int, wait_s: float) -> list[Group]:
        end = time.monotonic() + wait_s
        n = self.cfg.prompts_per_step
        pause = Backoff()
        while True:
            with self.store_time():
                taken = self.store.replay.take(
                    TASK,
                    n,
                    owner=owner,
                    current_version=self.version,
                    max_staleness=self.cfg.max_staleness,
                )
            if taken:
                return list(taken)
            if time.monotonic() > end:
                raise RuntimeError(
                    f"step {step}: no batch of {n} groups within {wait_s}s ({taken.ready} ready; "
                    "every group filtered, i.e. the policy collapsed, or the producer stalled)"
                )
            pause.sleep()

    def _alignment(self, batch: Batch) -> float | None:
        """Max |replayed - rollout| logprob over generated tokens of samples made by these weights."""
        chosen = [batch.samples[i] for i in batch.same_version]
        if not chosen:
            return None
        b = collate(chosen, TOK.pad_id)
        with torch.no_grad():
            lp = replay_logprobs(self.model, b.input_ids, b.routing)
        return float(((lp - b.old_logprobs).abs() * b.mask).max())

    def _release(self, owner: str, sids: list[str]) -> int:
        """Release the step's sessions (their holders drop the experts) and retire their routes.

        Both in one ``store.gather``: the retirement shares the
        release's first round trip (three in all instead of four).
        """
        ops = self.store.ops
        with self.store_time():
            released, _retired = self.store.gather(
                ops.release_owner(owner, "trained"), self.pool.router_ops.retire(sids)
            )
        return len(released)

    def _sync_weights(self, step: int) -> bool:
        """Every ``sync_every`` steps: a weight update through the gate; True when it ran."""
        if step % self.cfg.sync_every:
            return False
        new = self.version + 1
        self.pool.call("node_id")  # a call to every worker finds the dead ones
        self._reclaim_lost()
        try:
            self._weight_update(new)
        except (GatePoisoned, NotDrained):
            # a worker died with a request in flight since: reclaim it, then once more
            self.pool.call("node_id")
            if not self._reclaim_lost():
                raise
            self._weight_update(new)
        self.version = new
        self.gate_cycles += 1
        return True

    def _weight_update(self, new: int) -> None:
        """Abort generation in flight, then seal, drain, push the weights, install, reopen."""
        # like an engine pause: abort generation in flight, so the drain is short (colocated, the
        # producer's rounds are over by now: nothing generates, so the test knob has nothing to wait for)
        mid = self.cfg.update_mid_generation_s if self.cfg.mode != "colocated" else 0.0
        self.pool.call("abort_requests", mid)
        t0 = time.perf_counter()
        with self.store.gate.weight_update(new, self.cfg.drain_timeout_s):
            t1 = time.perf_counter()
            self._push(new)
            t2 = time.perf_counter()
        # seal + drain before the push and install + reopen after it are tracestore time
        self.store_time.add((t1 - t0) + (time.perf_counter() - t2))

    def _reclaim_lost(self) -> bool:
        """Reclaim the workers found dead since the last time (see the module); True if any."""
        fresh = [w for w in self.pool.lost if w not in self.lost_workers]
        for w in fresh:  # mostly waiting for deadlines: not counted as time in tracestore
            self.lost_workers[w] = reclaim_lost_worker(
                self.store, w, self.cfg.lease_ttl_s, self.cfg.owner_ttl_s
            )
        return bool(fresh)

    def _push(self, version: int) -> None:
        ref = ray.put(state_to_numpy(self.model))
        self.pool.call("set_weights", ref, version)
        del ref

    # -- checkpoint and report -----------------------------------------------------------------

    def checkpoint(self, step: int) -> CheckpointState:
        """Write the checkpoint of ``step``: model and optimizer, the store, then ``state.json``."""
        state = CheckpointState(
            step, self.version, list(self.history), self.gate_cycles, self.baseline_eval, self.cfg
        )
        write_checkpoint(state, self.model, self.opt, self.store)
        return state

    def stats(self) -> LearnerStats:
        """Counters for the report."""
        return LearnerStats(
            store_s=self.store_time.seconds,
            busy_s=self.busy.seconds,
            gate_cycles=self.gate_cycles,
            version=self.version,
            replay_fallbacks=self.batches.fallbacks,
            baseline_eval=self.baseline_eval,
            lost_workers=dict(self.lost_workers),
        )

    def close(self) -> None:
        """Close the store."""
        self.store.close()
